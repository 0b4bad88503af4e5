"""Write-behind (with --cache-store): the conversation a completion just extended is saved and shared as
soon as its reply is out, so another server of the fleet can continue it at its next turn.

The request's part is `turn_done`: its slot id put in a set, after the lease is given back. A thread of its
own then takes the slot's lease only if it is free at once (a next request already holding it ends with its
own write-behind: a burst of turns saves once), has the engine SAVE the conversation (on a folder: a local
file; without one: the object itself), and commits it (the folder's commit queues the upload: uploads.py).
A request for the slot that arrives during the SAVE waits for it (a local write) or, with other slots
free, takes another and restores the file once committed (`Saves.await_commits`): nothing is lost.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..engine.client import EngineClient
from ..errors import EngineCallError
from .metrics import SaveTrigger, StoreMetrics, WriteBehind
from .names import Fingerprints
from .saving import Saves

log = logging.getLogger("strata_server.store")


class DirtySlots:
    """The slots whose conversation a completion extended since their last write-behind (a set: a slot
    marked twice before its turn is saved once)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._slots: list[int] = []  # in the order marked
        self._closed = False

    def mark(self, slot_id: int) -> None:
        with self._changed:
            if slot_id not in self._slots:
                self._slots.append(slot_id)
                self._changed.notify()

    def take(self) -> int | None:
        """The slot marked first (waiting for one); None once closed."""
        with self._changed:
            while not self._slots and not self._closed:
                self._changed.wait()
            return self._slots.pop(0) if self._slots else None

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._slots.clear()
            self._changed.notify_all()


class WriteBehindSaver:
    def __init__(
        self,
        engine: EngineClient,
        saves: Saves,
        metrics: StoreMetrics,
        fingerprints: Callable[[], Fingerprints | None],
    ) -> None:
        self.engine = engine
        self.saves = saves
        self.metrics = metrics
        self.fingerprints = fingerprints  # None until the store's start-up scan ran
        self.dirty = DirtySlots()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="session-store-write-behind", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        self.dirty.close()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def turn_done(self, slot_id: int) -> None:
        """A completion on `slot_id` ended and gave its lease back (the request path's whole part)."""
        self.dirty.mark(slot_id)

    def _run(self) -> None:
        while (slot_id := self.dirty.take()) is not None:
            try:
                self.save(slot_id)
            except Exception:  # the thread must outlive one failed save: later turns need it
                log.exception("session store: the write-behind of slot %d failed", slot_id)

    def save(self, slot_id: int) -> WriteBehind:
        """Save the slot's conversation if it is new and the slot free at once; what happened (counted)."""
        result, lease_s = self._save(slot_id)
        self.metrics.write_behind(result, lease_s)
        return result

    def _save(self, slot_id: int) -> tuple[WriteBehind, float | None]:
        fingerprints = self.fingerprints()
        if not self.saves.needs_save(slot_id, fingerprints):
            return WriteBehind.NOTHING, None
        try:
            lease = self.engine.acquire(0.0, id_slot=slot_id)
        except EngineCallError:
            return WriteBehind.BUSY, None  # the next request has it: its own end saves it
        t0 = time.perf_counter()
        with lease:
            lease.used = False  # a save is no use of the slot (its LRU order stays)
            if not self.saves.needs_save(slot_id, fingerprints):
                return WriteBehind.NOTHING, None
            job = self.saves.save(lease, slot_id, SaveTrigger.WRITE_BEHIND, fingerprints)
        lease_s = time.perf_counter() - t0
        if job is None:
            return WriteBehind.FAILED, lease_s
        self.saves.commit(job)  # the lease given back: the fsync and the upload hold no request
        return WriteBehind.SAVED, lease_s
