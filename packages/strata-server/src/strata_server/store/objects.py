"""The store's shelf without --cache-disk: the object store itself (`--cache-store s3://BUCKET/PREFIX` alone).

`ObjectShelf` answers what `StoreFolder` answers, over objects: a conversation's location is an
``s3://BUCKET/KEY`` URL that the engine's SAVE writes as a multipart upload (the object appears only when it
is complete) and its RESTORE_PREFIX reads with ranged GETs, the version pinned (an object replaced between
the passes is refused before the gate); nothing of the server's passes through this process or a disk.
The index holds the objects this server saved or found for a prompt (`RemoteTier.best`), their tokens only
(no byte limit: the bucket's size is its lifecycle rule's business); there is no scan at start-up (a
fleet's bucket is found by listing, prompt by prompt). An object that a longer save of this server's
supersedes is deleted, as a folder's file is. A refused object is forgotten: one refused
for a reason of the moment (replaced, the store unreachable) is read again by the next lookup, any other
is remembered as bad and never restored.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import strata_sessionfile as sf
from strata_sessionfile.seam import S3_SCHEME

from ..transcript import Notes, read_notes
from .index import StoredConversation
from .names import NAME, Fingerprints
from .remote import TRANSIENT_ERRORS, Candidate, RemoteTier
from .shelf import Adoption

log = logging.getLogger("strata_server.store")

# Refusals that say nothing about the object's bytes: it is looked at afresh by the next lookup.
TRANSIENT_REASONS = frozenset(cls.reason for cls in TRANSIENT_ERRORS)


class ObjectShelf:
    """A `shelf.Shelf` of objects: a save is the object (a multipart upload that appears whole, durable at
    once: its commit steps do nothing), shared with the fleet as it lands; a found object is restored from
    where it is."""

    def __init__(self, remote: RemoteTier) -> None:
        self.remote = remote
        self.path = f"{S3_SCHEME}{remote.settings.bucket}/{remote.settings.prefix}"  # for log lines
        self._lock = threading.Lock()
        self._keys: dict[str, str] = {}  # name -> object key, for every conversation the index holds

    def create(self) -> None:
        pass  # a bucket is made by its owner; the prefix needs nothing

    def names(self) -> Iterator[str]:
        return iter(())  # no start-up scan: objects are found by the prompts' listings

    def _key(self, name: str) -> str:
        with self._lock:
            return self._keys[name]

    def file(self, name: str) -> str:
        """The engine's location of a conversation the index holds."""
        return f"{S3_SCHEME}{self.remote.settings.bucket}/{self._key(name)}"

    def trusted(self, name: str) -> bool:
        return True  # the bucket's access rules and the session key guard objects, not a file's owner

    def pending_names(self) -> Iterator[str]:
        return iter(())  # an upload appears whole or not at all: nothing is left pending

    def target(self, name: str, fingerprints: Fingerprints, tokens: np.ndarray) -> dict[str, Any]:
        """SAVE's object (less the slot) for `tokens`: the key another server's lookup for them lists (a
        multipart upload, durable once it appears: no pending step)."""
        assert NAME.match(name), name
        prefix = self.remote.block_prefix(fingerprints, tokens)
        assert prefix is not None  # a conversation worth saving holds a whole block
        with self._lock:
            self._keys[name] = prefix + name
        return {"path": self.file(name)}

    def key_of(self, name: str) -> str | None:
        """The object key of a conversation the index holds (None: not this shelf's)."""
        with self._lock:
            return self._keys.get(name)

    def held(self, key: str, conversation: StoredConversation) -> None:
        """An object this server put itself (an upload, a rename): the index holds it under `key`."""
        with self._lock:
            self._keys[conversation.name] = key

    def notes(self, name: str) -> Notes | None:
        """The notes an object keeps (its header and metadata: one ranged GET, the MAC checked); None: none,
        not this shelf's, or unreadable now."""
        key = self.key_of(name)
        if key is None:
            return None
        try:
            inspection, _ = self._inspect(key, verify=False)
        except sf.SessionFileError:
            return None
        return read_notes(inspection.metadata.state.engine_fields)

    def conversation(
        self, name: str, fingerprints: Fingerprints, pending: bool = False, verify: bool = False
    ) -> StoredConversation | None:
        """An object read back (its header and metadata: one ranged GET; with `verify`, all of it). An object
        has no pending stage: `pending` reads the object itself."""
        inspection, size = self._inspect(self._key(name), verify=verify)
        if not fingerprints.match(inspection.header):
            return None
        return StoredConversation(name, size, np.frombuffer(inspection.metadata.state.tokens, dtype="<i4"))

    def _inspect(self, key: str, verify: bool) -> tuple[sf.Inspection, int]:
        """An object's inspection under this shelf's key and MAC rule (header and metadata: one ranged GET; with
        `verify`, all of it), and its size."""
        from strata_sessionfile.objstore import S3Source

        with S3Source(self.remote.client, self.remote.settings.bucket, key) as source:
            inspection = sf.inspect(
                source,
                verify=verify,
                read_threads=1,
                key=self.remote.key,
                require_mac=self.remote.require_mac,
            )
            return inspection, source.stamp().size

    def sync_pending(self, name: str) -> None:
        pass  # an object is durable once its upload completes

    def publish(self, name: str) -> None:
        pass  # an object appears under its key whole, when its upload completes

    def remove_pending(self, name: str) -> None:
        self.remove(name)  # a saved object not kept: deleted

    def share(self, name: str, fingerprints: Fingerprints, tokens: np.ndarray) -> None:
        pass  # saved under the key another server's lookup lists: the fleet's already

    def adopt(self, candidate: Candidate, fingerprints: Fingerprints) -> Adoption:
        """A conversation the object store holds for a prompt, restored from there (no download)."""
        with self._lock:
            self._keys[candidate.name] = candidate.key
        return Adoption(StoredConversation(candidate.name, candidate.nbytes, candidate.tokens), 0)

    def used_at(self, name: str) -> float:
        return 0.0

    def touch(self, name: str) -> None:
        pass  # the index's order is this server's; objects carry no use time

    def remove(self, name: str) -> bool:
        """A conversation a longer one of this server's supersedes: its object is deleted."""
        with self._lock:
            key = self._keys.pop(name, None)
        if key is None:
            return False
        try:
            self.remote.client.delete_object(Bucket=self.remote.settings.bucket, Key=key)
        except Exception as exc:  # noqa: BLE001 -- the object stays; a lifecycle rule or a later save removes it
            log.warning("session store: deleting %s failed: %s", key, exc)
            return False
        self.remote.forget(key)
        return True

    def move_aside(self, name: str, reason: str) -> None:
        """A refused object: forgotten; unless refused for a reason of the moment, never used again."""
        with self._lock:
            key = self._keys.pop(name, None)
        if key is None:
            return
        if reason in TRANSIENT_REASONS:
            self.remote.forget(key)
            log.warning("session store: %s refused (%s); looked up again next time", key, reason)
        else:
            self.remote.mark_bad(key)
            log.warning("session store: %s failed validation (%s); never restored", key, reason)
