"""What the store keeps its conversations on: a folder (folder.py, with --cache-disk or --cache-ram) or,
without one, the objects of the object store (objects.py). The store asks a shelf for names, reads and
moves, never for its kind: each shelf says in its own methods what a step means for it (an object is
durable once its upload completes, so its commit steps do nothing)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import attrs
import numpy as np

from ..transcript import Notes
from .index import StoredConversation
from .names import Fingerprints
from .remote import Candidate


@attrs.frozen
class Adoption:
    """A conversation the object store supplied for a prompt, as the shelf now holds it."""

    conversation: StoredConversation | None  # None: it belongs to another engine
    downloaded: int  # bytes copied onto the shelf (0: restored straight from the object)


class Shelf(Protocol):
    @property
    def path(self) -> Path | str:
        """Where it is, for log lines."""
        ...

    def create(self) -> None: ...

    def names(self) -> Iterator[str]:
        """The committed conversations a start-up scan reads."""
        ...

    def pending_names(self) -> Iterator[str]:
        """Saves left uncommitted by a server killed between its write and its commit."""
        ...

    def file(self, name: str) -> Path | str:
        """The engine's location of a committed conversation (RESTORE_PREFIX's path)."""
        ...

    def target(self, name: str, fingerprints: Fingerprints, tokens: np.ndarray) -> dict[str, Any]:
        """SAVE's argument (less the slot) that writes `tokens` under `name`, pending its commit."""
        ...

    def trusted(self, name: str) -> bool:
        """Whether a committed conversation may be restored (a file of another user may not)."""
        ...

    def conversation(
        self, name: str, fingerprints: Fingerprints, pending: bool = False, verify: bool = False
    ) -> StoredConversation | None:
        """Header and metadata of one conversation (`pending`: as written, before its commit); None when it
        belongs to another engine; SessionFileError when they are not valid."""

    def notes(self, name: str) -> Notes | None:
        """The notes a committed conversation keeps (a chat's messages, a title); None: none, or unreadable."""
        ...

    def sync_pending(self, name: str) -> None:
        """Make a written conversation durable (the slow part of a commit)."""
        ...

    def publish(self, name: str) -> None:
        """Give a durable conversation its committed name (what a lookup may restore)."""
        ...

    def remove_pending(self, name: str) -> None:
        """Drop a written conversation that will not be committed."""
        ...

    def share(self, name: str, fingerprints: Fingerprints, tokens: np.ndarray) -> None:
        """Offer a committed conversation to the other servers of a fleet."""
        ...

    def adopt(self, candidate: Candidate, fingerprints: Fingerprints) -> Adoption:
        """A conversation the object store's lookup found for a prompt, made restorable from here."""
        ...

    def used_at(self, name: str) -> float:
        """When it was last used (the start-up scan's least-recently-used order); 0 when unknown."""
        ...

    def touch(self, name: str) -> None:
        """Record a use (a restore)."""
        ...

    def remove(self, name: str) -> bool: ...

    def move_aside(self, name: str, reason: str) -> None:
        """A conversation that failed validation: never restored again."""
        ...
