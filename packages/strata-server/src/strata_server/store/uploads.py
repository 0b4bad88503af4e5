"""The object store's upload queue (pure bookkeeping, no I/O; remote.py runs it on its upload thread).

Write-behind saves every turn, so uploads come in bursts of the same conversation. The queue keeps them
bounded and coalesced:

* **Supersede**: a conversation's pending upload is dropped when a newer one of the same conversation (its
  tokens extend the pending one's) is offered: a burst of turns uploads once, the last turn. An offer that a
  pending upload already holds in full is not queued.
* **Byte limit**: the bytes pending never exceed `max_bytes`; the oldest pending uploads are dropped to make
  room for the newest (the conversation most likely continued next), and an upload larger than the limit
  alone is dropped. A dropped conversation reaches the store with its next save.
* **Order**: first in, first out.
"""

from __future__ import annotations

import enum
from pathlib import Path

import attrs
import numpy as np

from ..tokens import common_prefix


class UploadResult(enum.StrEnum):
    """What became of an upload (the `result` label of strata:store_uploads_total)."""

    UPLOADED = "uploaded"  # the object is in the store
    SUPERSEDED = "superseded"  # a newer upload of the same conversation replaced it while it waited
    DROPPED = "dropped"  # the queue's byte limit: never uploaded
    GONE = "gone"  # its file was removed (evicted or replaced) before its upload began
    FAILED = "failed"  # the object store refused it or could not be reached (after boto3's retries)


@attrs.frozen(eq=False)
class Upload:
    """A committed file waiting for its upload."""

    path: Path
    key: str
    tokens: np.ndarray
    nbytes: int


def holds(longer: np.ndarray, shorter: np.ndarray) -> bool:
    """Whether `longer`'s conversation holds all of `shorter`'s (the same conversation, no older)."""
    return len(longer) >= len(shorter) and common_prefix(longer, shorter) == len(shorter)


@attrs.frozen
class Offered:
    """What one offer did: queued or not, and the pending uploads it took out of the queue."""

    queued: bool
    superseded: tuple[Upload, ...] = ()
    dropped: tuple[Upload, ...] = ()


class UploadQueue:
    def __init__(self, max_bytes: int) -> None:
        assert max_bytes > 0
        self.max_bytes = max_bytes
        self._pending: list[Upload] = []  # oldest first
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def bytes(self) -> int:
        return self._bytes

    def offer(self, upload: Upload) -> Offered:
        """Queue `upload` (see the module's rules)."""
        if any(holds(p.tokens, upload.tokens) for p in self._pending):
            return Offered(False, superseded=(upload,))
        superseded = tuple(p for p in self._pending if holds(upload.tokens, p.tokens))
        for old in superseded:
            self._remove(old)
        if upload.nbytes > self.max_bytes:
            return Offered(False, superseded, (upload,))
        dropped = []
        while self._bytes + upload.nbytes > self.max_bytes:
            dropped.append(self._pending[0])
            self._remove(self._pending[0])
        self._pending.append(upload)
        self._bytes += upload.nbytes
        return Offered(True, superseded, tuple(dropped))

    def take(self) -> Upload | None:
        """The oldest pending upload, out of the queue; None when empty."""
        if not self._pending:
            return None
        upload = self._pending[0]
        self._remove(upload)
        return upload

    def _remove(self, upload: Upload) -> None:
        self._pending.remove(upload)
        self._bytes -= upload.nbytes
