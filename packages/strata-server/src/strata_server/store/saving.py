"""Saving the slots' conversations: the engine's write, the commit (on a thread of its own, or inline where
nobody waits), the pending saves a lookup may wait for, and eviction.

Every save is two steps: the engine writes the conversation pending its commit (on a folder `<name>.pending`,
SAVE with "sync": false, under the slot's lease), then a commit makes it durable (fsync), makes room
(evicting the least recently used), gives it its name and indexes it. A save in a request's path (a displaced
conversation) is committed by the commit thread, off the request's path (~40 ms of fsync for a 46 MiB file:
bench/server/DECISIONS.md "The displaced chat's save"); a request whose prompt a pending save holds waits for that commit before its lookup
(`await_commits`). On the object shelf the save is an object, durable once it appears: its commit reads it
back and indexes it. An unknown conversation (the ledger's tokens None) is never saved.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import attrs
import numpy as np
import strata_sessionfile as sf

from ..engine.client import EngineClient, EngineLease
from ..errors import EngineCallError, EngineReplyError
from ..ledger import SlotLedger
from ..tokens import common_prefix
from ..transcript import Notes, inherits
from .index import StoredConversation, StoreIndex
from .metrics import SaveTrigger, StoreMetrics
from .names import Fingerprints, conversation_name
from .policy import worth_saving
from .settings import MIB, StoreSettings
from .shelf import Shelf

log = logging.getLogger("strata_server.store")

COMMIT_WAIT_S = 20.0  # how long a request waits for the commit of a pending save that holds its prompt


@attrs.frozen(eq=False)
class PendingSave:
    """A conversation the engine just wrote, pending its commit."""

    slot_id: int
    trigger: SaveTrigger
    name: str
    tokens: np.ndarray
    fingerprints: Fingerprints
    n_written: int
    write_s: float  # the engine's part (in the path of whoever held the lease)


class Saves:
    """The store's saves and evictions. `files` is the store's lock of the committed files and the index
    against a lookup + restore: no eviction comes between those two."""

    def __init__(
        self,
        settings: StoreSettings,
        engine: EngineClient,
        ledger: SlotLedger,
        shelf: Shelf,
        index: StoreIndex,
        metrics: StoreMetrics,
        files: threading.RLock,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.ledger = ledger
        self.shelf = shelf
        self.index = index
        self.metrics = metrics
        self.files = files
        self._committed = threading.Condition()  # guards _pending; notified when a pending save is done
        self._pending: dict[str, np.ndarray] = {}  # name -> tokens of the saves written, not yet committed
        self._commits: queue.SimpleQueue[PendingSave | None] = queue.SimpleQueue()
        self._committer: threading.Thread | None = None

    # --- the commit thread ------------------------------------------------------------------------

    def start(self) -> None:
        self._committer = threading.Thread(target=self._commit_loop, name="session-store-commit", daemon=True)
        self._committer.start()

    def stop(self, deadline: float) -> None:
        self._commits.put(None)
        if self._committer is not None:
            self._committer.join(timeout=max(1.0, deadline - time.monotonic()))

    def _commit_loop(self) -> None:
        while (job := self._commits.get()) is not None:
            try:
                self.commit(job)
            except (
                Exception
            ):  # the thread must outlive one bad commit: later saves and waiting requests need it
                log.exception("session store: committing %s failed", job.name)

    def commit_later(self, job: PendingSave) -> None:
        """Commit `job` on the commit thread (the fsync and the rest off the caller's path)."""
        self._commits.put(job)

    # --- saving -----------------------------------------------------------------------------------

    def needs_save(self, slot_id: int, fingerprints: Fingerprints | None) -> bool:
        tokens = self.ledger.tokens(slot_id)
        with self._committed:
            pending = list(self._pending.values())
        return (
            fingerprints is not None
            and worth_saving(tokens, self.settings.min_reuse)
            and tokens is not None
            and not self.index.covers(tokens)
            and not any(common_prefix(tokens, p) == len(tokens) for p in pending)
        )

    def save(
        self, lease: EngineLease, slot_id: int, trigger: SaveTrigger, fingerprints: Fingerprints | None
    ) -> PendingSave | None:
        """The engine writes the slot's conversation pending its commit, unless the store holds it already."""
        if not self.needs_save(slot_id, fingerprints):
            return None
        record = self.ledger[slot_id]
        tokens = record.tokens
        assert tokens is not None and fingerprints is not None
        name = conversation_name(fingerprints, tokens)
        # The chat's text goes into the file (its engine fields), under its hashes and MAC, with the title of
        # the stored conversation it extends (which its commit replaces).
        kept = record.notes
        title = self._inherited_title(tokens, kept)
        if title is not None:
            kept = attrs.evolve(kept or Notes(), title=title)
        encoded = kept.encode() if kept is not None else None
        notes = {"notes": encoded} if encoded is not None else {}
        t0 = time.perf_counter()
        try:
            result = lease.call("SAVE", {**self.shelf.target(name, fingerprints, tokens), **notes})
        except EngineReplyError as exc:
            self.metrics.save_failed()
            log.warning(
                "session store: saving slot %d (%d tokens, %s) failed: %s",
                slot_id,
                len(tokens),
                trigger,
                exc.message,
            )
            return None
        with self._committed:
            self._pending[name] = tokens
        return PendingSave(
            slot_id,
            trigger,
            name,
            tokens,
            fingerprints,
            int(result.get("n_written", 0)),
            time.perf_counter() - t0,
        )

    def _inherited_title(self, tokens: np.ndarray, notes: Notes | None) -> str | None:
        """The title a person gave the longest stored conversation that `tokens` extend, if any."""
        for older in sorted(self.index.strict_prefixes_of(tokens), key=lambda c: -c.n_tokens):
            title = inherits(notes, self.shelf.notes(older.name))
            if title is not None:
                return title
        return None

    def save_idle_slots(self, fingerprints: Fingerprints) -> None:
        """Save each slot idle for --cache-idle-seconds whose conversation is not stored yet."""
        now = time.monotonic()
        for slot_id in range(self.ledger.n_slots):
            idle = now - self.ledger[slot_id].last_active >= self.settings.idle_s
            if not idle or not self.needs_save(slot_id, fingerprints):
                continue
            try:
                lease = self.engine.acquire(0.0, id_slot=slot_id)
            except EngineCallError:
                continue  # busy (it is not idle after all) or restarting
            with lease:
                lease.used = False  # an idle save is no use of the slot (its LRU order stays)
                job = self.save(lease, slot_id, SaveTrigger.IDLE, fingerprints)
            if job is not None:
                self.commit(job)  # the lease given back: the fsync holds no request

    def save_every_slot(self, deadline: float, fingerprints: Fingerprints) -> None:
        """At shutdown: every slot whose conversation is not stored yet (bounded by `deadline`, logged)."""
        for slot_id in range(self.ledger.n_slots):
            if not self.needs_save(slot_id, fingerprints):
                log.info(
                    "session store: slot %d has nothing to save at shutdown (stored already, too short or "
                    "unknown)",
                    slot_id,
                )
                continue
            try:
                with self.engine.acquire(max(0.0, deadline - time.monotonic()), id_slot=slot_id) as lease:
                    job = self.save(lease, slot_id, SaveTrigger.SHUTDOWN, fingerprints)
            except EngineCallError as exc:
                log.warning("session store: slot %d not saved at shutdown: %s", slot_id, exc)
                continue
            if job is not None:
                self.commit(job)

    # --- committing -------------------------------------------------------------------------------

    def commit(self, job: PendingSave) -> None:
        """Make the written conversation durable, make room for it (evicting the least recently used), give
        it its name, index it (the index is the files), drop the stored prefixes it extends, share it."""
        try:
            self._commit(job)
        finally:
            with self._committed:
                self._pending.pop(job.name, None)
                self._committed.notify_all()

    def _commit(self, job: PendingSave) -> None:
        t0 = time.perf_counter()
        try:
            stored = self.shelf.conversation(job.name, job.fingerprints, pending=True)  # as written
            assert stored is not None
            self.shelf.sync_pending(job.name)
        except (sf.SessionFileError, OSError) as exc:
            self.metrics.save_failed()
            log.error(
                "session store: the conversation saved for slot %d does not read back or sync (%s); "
                "removing it",
                job.slot_id,
                exc,
            )
            self.shelf.remove_pending(job.name)
            return
        if stored.nbytes > self.settings.max_bytes:
            self.shelf.remove_pending(job.name)
            self.metrics.evicted(stored.nbytes)
            log.warning(
                "session store: a conversation of %.1f MiB is larger than the store's limit (%.1f MiB); "
                "not kept",
                stored.nbytes / MIB,
                self.settings.max_bytes / MIB,
            )
            return
        if not np.array_equal(stored.tokens, job.tokens):
            log.warning(
                "session store: slot %d held %d tokens, not the %d tracked; the file's are kept",
                job.slot_id,
                stored.n_tokens,
                len(job.tokens),
            )
            self.ledger.saved(job.slot_id, job.tokens, stored.tokens)
        with self.files:
            older = self.index.strict_prefixes_of(
                stored.tokens
            )  # replaced by this one: dropped after it lands
            room = self.settings.max_bytes - stored.nbytes + sum(c.nbytes for c in older)
            for victim in self.index.over_limit(room, keep=[c.name for c in older]):
                self.drop(victim)  # before the rename: the folder never holds more than the limit
                self.metrics.evicted(victim.nbytes)
            try:
                self.shelf.publish(job.name)
            except OSError as exc:
                self.metrics.save_failed()
                log.error(
                    "session store: renaming the file saved for slot %d failed (%s); removing it",
                    job.slot_id,
                    exc,
                )
                self.shelf.remove_pending(job.name)
                return
            self.index.add(stored)
            for conversation in older:
                self.drop(conversation)
            self.evict(keep=job.name)
        self.shelf.share(job.name, job.fingerprints, stored.tokens)
        commit_s = time.perf_counter() - t0
        self.metrics.saved(job.trigger, job.n_written or stored.nbytes, job.write_s + commit_s)
        log.info(
            "session store: saved slot %d (%d tokens, %.1f MiB, %s) in %.0f ms + %.0f ms committing as %s",
            job.slot_id,
            stored.n_tokens,
            stored.nbytes / MIB,
            job.trigger,
            job.write_s * 1000,
            commit_s * 1000,
            self.shelf.file(job.name),
        )

    def drain(self, deadline: float) -> None:
        """Wait for the pending saves' commits (at shutdown)."""
        with self._committed:
            while self._pending and self._committed.wait(max(0.0, deadline - time.monotonic())):
                pass

    def await_commits(self, prompt: np.ndarray, held_common: int) -> None:
        """A pending save holding at least --cache-min-reuse more of the prompt than the slot would be the
        lookup's match: wait for its commit (it began when the request before this one ended)."""
        want = held_common + self.settings.min_reuse
        deadline = time.monotonic() + COMMIT_WAIT_S
        with self._committed:
            while any(common_prefix(prompt, p) >= want for p in self._pending.values()):
                if not self._committed.wait(max(0.0, deadline - time.monotonic())):
                    return

    # --- eviction ---------------------------------------------------------------------------------

    def drop(self, conversation: StoredConversation) -> None:
        self.index.remove(conversation.name)
        self.shelf.remove(conversation.name)

    def evict(self, keep: str | None = None) -> None:
        """The least recently used conversations, until the rest fit the byte limit (`keep` last)."""
        for victim in self.index.over_limit(self.settings.max_bytes, keep=(keep,) if keep else ()):
            self.drop(victim)
            self.metrics.evicted(victim.nbytes)
            if victim.name == keep:
                log.warning(
                    "session store: a conversation of %.1f MiB is larger than the store's limit "
                    "(%.1f MiB); not kept",
                    victim.nbytes / MIB,
                    self.settings.max_bytes / MIB,
                )
