"""`SessionStore`: the server keeps every conversation in a bounded folder of session files and restores
the longest stored prefix of each prompt into the slot (`--cache-disk DIR`).

The request path (`CompletionRun`) calls `prepare` under the slot's lease before its COMPLETE: the
engine gives the prompt's tokens (PROMPT_TOKENS), `policy.plan` decides, the slot's conversation is
saved if the request is about to replace it, a match is restored (RESTORE_PREFIX, cut to the match,
landing in place), and the COMPLETE is sent with the tokens; `completed` records what the slot holds
after it. A background thread scans the folder once the engine is ready (the index is the files), then
saves a slot idle for --cache-idle-seconds; `shutdown` saves every slot at SIGTERM / SIGINT.

Every save is two steps: the engine writes `<name>.pending` without fsync (SAVE with "sync": false, under the
lease), then a commit fsyncs it, makes room (evicting), renames it to `<name>` and indexes it. A save in a
request's path (a displaced conversation) is committed by the commit thread, off the request's path
(~40 ms of fsync for a 46 MiB file: bench/server/DECISIONS.md "The displaced chat's save"); a request whose prompt a pending save holds
waits for that commit before its lookup. A pending file left by a kill is verified in full at start-up
and committed, or removed: only committed files are ever indexed. With the object store alone (no
--cache-disk) the save is an object, a multipart upload that appears whole: read back and indexed at once.

The store tracks each slot's tokens (`SlotConversation`, by slot id: one slot today, N later) from the
prompts and results it sees; when it cannot know them (a COMPLETE that failed or was cut off) they are
unknown until the next COMPLETE, and an unknown conversation is never saved.
"""

from __future__ import annotations

import enum
import logging
import queue
import shutil
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import strata_sessionfile as sf
from strata_engine.protocol import ErrorKind, Reason

from ..engine.client import EngineClient, EngineLease, EngineState
from ..errors import EngineCallError, EngineDied, EngineReplyError
from .folder import PENDING_SUFFIX, Fingerprints, StoreFolder, conversation_name
from .index import StoredConversation, StoreIndex, as_tokens, common_prefix
from .metrics import Lookup, Row, SaveTrigger, StoreMetrics
from .objects import ObjectShelf
from .policy import Plan, plan, worth_saving
from .remote import RemoteSettings, RemoteTier

log = logging.getLogger("strata_server.store")

MIB = 1 << 20
SCAN_BUDGET_S = 60.0  # start-up scan: files not read by then stay unindexed (logged)
READY_WAIT_S = 2.0  # how long a request waits for the start-up scan before it goes on without the store
SHUTDOWN_BUDGET_S = 20.0  # saving every slot at shutdown (inside gunicorn's 30 s graceful timeout)
COMMIT_WAIT_S = 20.0  # how long a request waits for the commit of a pending save that holds its prompt
EMPTY = as_tokens([])


class Origin(enum.StrEnum):
    """Where a slot's conversation came from (GET /slots)."""

    NONE = "none"  # nothing held (start-up, erase, an engine restart)
    EVALUATED = "evaluated"  # its prompt was evaluated (nothing reused from the store)
    STORE = "store"  # restored from the session store, then continued
    SLOT_FILE = "slot_file"  # restored by POST /slots/0?action=restore


@attrs.frozen
class StoreSettings:
    folder: Path | None  # None: the object store alone (`remote`), no local files
    max_bytes: int
    min_reuse: int
    idle_s: float  # 0: no idle saves
    ephemeral: bool = False  # a RAM-only store: emptied at start, removed at shutdown, never saved at shutdown
    key: sf.SessionKey | None = None  # --session-key-file: files are read only when their MAC checks
    require_mac: bool = True  # with a key: a file without a MAC is bad (moved aside), as the engine refuses it
    remote: RemoteSettings | None = None  # --cache-store: the object-store tier behind the folder
    shutdown_budget_s: float = SHUTDOWN_BUDGET_S
    scan_budget_s: float = SCAN_BUDGET_S


@attrs.define
class SlotConversation:
    """What the server knows one slot holds."""

    tokens: np.ndarray | None = EMPTY  # None: unknown
    origin: Origin = Origin.NONE
    origin_file: str | None = None  # the store file (or slot file) it was restored from
    n_restored: int = 0  # tokens that restore kept
    last_active: float = attrs.Factory(time.monotonic)
    pending: np.ndarray | None = None  # the prompt of the COMPLETE in flight

    def replace(self, tokens: np.ndarray | None, origin: Origin, origin_file: str | None = None,
                n_restored: int = 0) -> None:
        self.tokens, self.origin, self.origin_file, self.n_restored = tokens, origin, origin_file, n_restored
        self.last_active = time.monotonic()

    def info(self) -> dict[str, Any]:
        return {"origin": self.origin.value, "file": self.origin_file, "n_restored": self.n_restored,
                "n_tokens": None if self.tokens is None else len(self.tokens)}


@attrs.frozen(eq=False)
class PendingSave:
    """A conversation the engine just saved: `<name>.pending` (SAVE, "sync": false) to commit, or an object."""

    slot_id: int
    trigger: SaveTrigger
    name: str
    tokens: np.ndarray
    n_written: int
    write_s: float  # the engine's part (in the path of whoever held the lease)


class SessionStore:
    def __init__(self, settings: StoreSettings, engine: EngineClient, n_slots: int = 1) -> None:
        self.settings = settings
        self.engine = engine
        require_mac = settings.require_mac and settings.key is not None
        self.remote = RemoteTier(settings.remote, settings.key, require_mac) if settings.remote is not None else None
        self.folder = (StoreFolder(settings.folder, settings.key, require_mac) if settings.folder is not None
                       else ObjectShelf(self.remote))
        self.index = StoreIndex()
        self.metrics = StoreMetrics()
        self.fingerprints: Fingerprints | None = None
        self.slots = {slot_id: SlotConversation() for slot_id in range(n_slots)}
        self._lock = threading.Lock()  # the slots' tracked state and the pending saves
        self._files = threading.RLock()  # committed files and index vs a lookup + restore (no eviction between)
        self._pending: dict[str, np.ndarray] = {}  # name -> tokens of the saves written, not yet committed
        self._committed = threading.Condition(self._lock)  # notified when a pending save is done
        self._commits: queue.SimpleQueue[PendingSave | None] = queue.SimpleQueue()
        self._committer: threading.Thread | None = None
        self._ready = threading.Event()  # the folder was scanned for this engine
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        if self.settings.ephemeral:
            shutil.rmtree(self.settings.folder, ignore_errors=True)
        self.folder.create()
        self._committer = threading.Thread(target=self._commit_loop, name="session-store-commit", daemon=True)
        self._committer.start()
        self._thread = threading.Thread(target=self._run, name="session-store", daemon=True)
        self._thread.start()

    def _commit_loop(self) -> None:
        while (job := self._commits.get()) is not None:
            try:
                self._commit(job)
            except Exception:  # the thread must outlive one bad commit: later saves and waiting requests need it
                log.exception("session store: committing %s failed", job.name)

    def _run(self) -> None:
        while not self._stop.is_set() and self.engine.status().state is not EngineState.READY:
            if self.engine.status().state in (EngineState.FAILED, EngineState.STOPPED):
                return
            self._stop.wait(0.05)
        if self._stop.is_set():
            return
        fingerprints = Fingerprints.of_ready_line(dict(self.engine.status().info or {}))
        if fingerprints is None:
            log.error("session store off: the engine's ready line names no session fingerprints")
            return
        self.fingerprints = fingerprints
        self.scan()
        if self.settings.idle_s <= 0:
            return
        while not self._stop.wait(min(1.0, self.settings.idle_s / 4)):
            self._save_idle_slots()

    def scan(self) -> None:
        """Index this engine's files (headers and metadata only), oldest use first; move bad ones aside."""
        assert self.fingerprints is not None
        t0 = time.monotonic()
        for name in list(self.folder.pending_names()):
            self._recover(name)
        names = sorted(self.folder.names(), key=self.folder.used_at)
        indexed = foreign = bad = 0
        for done, name in enumerate(names):
            if time.monotonic() - t0 > self.settings.scan_budget_s:
                log.warning("session store: scan stopped after %.0f s; %d of %d files left unindexed",
                            self.settings.scan_budget_s, len(names) - done, len(names))
                break
            try:
                conversation = self.folder.conversation(name, self.fingerprints)
            except sf.SessionFileError as exc:
                self._bad_file(name, exc.reason)
                bad += 1
                continue
            except OSError:
                continue  # removed meanwhile (another server's eviction)
            if conversation is None:
                foreign += 1
            else:
                self.index.add(conversation)
                indexed += 1
        self._evict()
        log.info("session store %s: %d conversations (%.1f MiB) indexed, %d of other engines ignored, %d bad, "
                 "in %.2f s", self.folder.path, indexed, self.index.bytes_held() / MIB, foreign, bad,
                 time.monotonic() - t0)
        self._ready.set()

    def _recover(self, name: str) -> None:
        """A pending file left by a server stopped before its commit: the engine renamed it complete, so it
        is committed when it verifies in full (payload hash included), else removed; another engine's is
        left to its server."""
        assert self.fingerprints is not None
        try:
            stored = self.folder.conversation(name, self.fingerprints, pending=True, verify=True)
            if stored is not None:
                self.folder.sync_pending(name)
                self.folder.publish(name)
                log.info("session store: committed %s, left pending by a server stopped before its commit", name)
        except sf.SessionFileError as exc:
            log.warning("session store: %s%s, left pending, does not verify (%s); removing it", name,
                        PENDING_SUFFIX, exc.reason)
            self.folder.remove_pending(name)
        except OSError as exc:
            log.warning("session store: %s%s, left pending, could not be committed: %s", name, PENDING_SUFFIX, exc)

    def shutdown(self) -> None:
        """Save every slot whose conversation is not stored yet (bounded, logged); stop the threads."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        deadline = time.monotonic() + self.settings.shutdown_budget_s
        self._drain(deadline)
        try:
            self._save_at_shutdown(deadline)
        finally:
            self._commits.put(None)
            if self._committer is not None:
                self._committer.join(timeout=max(1.0, deadline - time.monotonic()))

    def _save_at_shutdown(self, deadline: float) -> None:
        if self.settings.ephemeral:
            shutil.rmtree(self.settings.folder, ignore_errors=True)
            return
        if not self._ready.is_set():
            return
        for slot_id in self.slots:
            if not self._needs_save(slot_id):
                log.info("session store: slot %d has nothing to save at shutdown (stored already, too short or "
                         "unknown)", slot_id)
                continue
            try:
                with self.engine.acquire(max(0.0, deadline - time.monotonic()), id_slot=slot_id) as lease:
                    job = self._save(lease, slot_id, SaveTrigger.SHUTDOWN)
            except EngineCallError as exc:
                log.warning("session store: slot %d not saved at shutdown: %s", slot_id, exc)
                continue
            if job is not None:
                self._commit(job)
        if self.remote is not None:
            self.remote.close(max(1.0, deadline - time.monotonic()))

    # --- hooks of the request path (under the slot's lease) --------------------------------------

    def prepare(self, lease: EngineLease, command: Mapping[str, Any], slot_id: int = 0) -> dict[str, Any]:
        """The COMPLETE to send for `command`, after saving and restoring what the store decides."""
        prompt = as_tokens(lease.call("PROMPT_TOKENS", command)["tokens"])
        cache_prompt = command.get("cache_prompt", True) is not False
        with self._lock:
            held = self.slots[slot_id].tokens
        # A request right after start-up waits briefly for the scan (ms for a few files): a returning chat is found.
        ready = self._ready.wait(READY_WAIT_S)
        if ready and cache_prompt:
            self._await_commits(prompt, common_prefix(prompt, held) if held is not None else 0)
        with self._files:
            if ready and cache_prompt and self.remote is not None:
                self._fetch_remote(prompt, held)
            match = self.index.longest_prefix(prompt) if ready and cache_prompt else None
            decision = plan(prompt, held, match, min_reuse=self.settings.min_reuse, cache_prompt=cache_prompt)
            if ready and decision.save_first:
                job = self._save(lease, slot_id, SaveTrigger.REPLACE)
                if job is not None:
                    self._commits.put(job)  # the fsync and the rest off this request's path
            restored = decision.restore is not None and self._restore(lease, slot_id, prompt, decision)
        if ready and decision.restore is None:
            self.metrics.lookup(Lookup.MISS if match is None else Lookup.HELD)
        with self._lock:
            slot = self.slots[slot_id]
            if not restored and (decision.held_common == 0 or slot.tokens is None or not len(slot.tokens)):
                slot.replace(None, Origin.EVALUATED)
            slot.tokens, slot.pending = None, prompt  # unknown until the completion's result
        rest = {k: v for k, v in command.items() if k not in ("messages", "prompt")}
        return {**rest, "prompt": prompt.tolist()}

    def completed(self, result: Mapping[str, Any], slot_id: int = 0) -> None:
        """A COMPLETE's result: the slot holds (prompt + generated)[:n_tokens_held]."""
        with self._lock:
            slot = self.slots[slot_id]
            prompt = slot.pending
            if prompt is None:
                return
            generated = np.asarray(result.get("tokens") or [], dtype="<i4")
            held = int(result.get("n_tokens_held", 0))
            slot.tokens = as_tokens(np.concatenate([prompt, generated])[:held])
            slot.last_active = time.monotonic()
            slot.pending = None

    def slot_replaced(self, slot_id: int, tokens: np.ndarray | None, origin: Origin, file: str | None = None) -> None:
        with self._lock:
            self.slots[slot_id].replace(tokens, origin, file, 0 if tokens is None else len(tokens))

    def slot_restored_from(self, slot_id: int, path: Path) -> None:
        """POST /slots/{id}?action=restore put this file's conversation in the slot (its tokens: the file's)."""
        try:
            tokens: np.ndarray | None = as_tokens(np.frombuffer(
                sf.inspect(path, verify=False, read_threads=1).metadata.state.tokens, dtype="<i4"))
        except (sf.SessionFileError, OSError):
            tokens = None
        self.slot_replaced(slot_id, tokens, Origin.SLOT_FILE, path.name)

    def slot_erased(self, slot_id: int) -> None:
        self.slot_replaced(slot_id, EMPTY, Origin.NONE)

    def engine_exited(self, _code: int) -> None:
        with self._lock:
            for slot in self.slots.values():
                slot.replace(EMPTY, Origin.NONE)

    # --- saving -----------------------------------------------------------------------------------

    def _needs_save(self, slot_id: int) -> bool:
        with self._lock:
            tokens = self.slots[slot_id].tokens
            pending = list(self._pending.values())
        return (self.fingerprints is not None and worth_saving(tokens, self.settings.min_reuse)
                and not self.index.covers(tokens)
                and not any(common_prefix(tokens, p) == len(tokens) for p in pending))

    def _save(self, lease: EngineLease, slot_id: int, trigger: SaveTrigger) -> PendingSave | None:
        """The engine writes the slot's conversation as a pending file (SAVE, "sync": false) unless the store
        holds it already; `_commit` makes it a stored one."""
        if not self._needs_save(slot_id):
            return None
        with self._lock:
            tokens = self.slots[slot_id].tokens
        assert tokens is not None and self.fingerprints is not None
        name = conversation_name(self.fingerprints, tokens)
        t0 = time.perf_counter()
        try:
            result = lease.call("SAVE", self.folder.target(name, self.fingerprints, tokens))
        except EngineReplyError as exc:
            self.metrics.save_failed()
            log.warning("session store: saving slot %d (%d tokens, %s) failed: %s", slot_id, len(tokens),
                        trigger, exc.message)
            return None
        job = PendingSave(slot_id, trigger, name, tokens, int(result.get("n_written", 0)), time.perf_counter() - t0)
        if not self.folder.local:
            self._store_object(job)  # a multipart upload appears whole: nothing to commit
            return None
        with self._lock:
            self._pending[name] = tokens
        return job

    def _store_object(self, job: PendingSave) -> None:
        """An object the engine just saved (no --cache-disk): read back and indexed; the prefixes it extends
        deleted."""
        assert self.fingerprints is not None
        try:
            stored = self.folder.conversation(job.name, self.fingerprints)  # the object as written
        except (sf.SessionFileError, OSError) as exc:
            self.metrics.save_failed()
            log.error("session store: the object saved for slot %d does not read back (%s); removing it", job.slot_id,
                      exc)
            self.folder.remove(job.name)
            return
        assert stored is not None
        self._kept_tokens(job, stored)
        with self._files:
            self.index.add(stored)
            for older in self.index.strict_prefixes_of(stored.tokens):
                self._drop(older)
        self.metrics.saved(job.trigger, job.n_written or stored.nbytes, job.write_s)
        log.info("session store: saved slot %d (%d tokens, %.1f MiB, %s) in %.0f ms as %s", job.slot_id,
                 stored.n_tokens, stored.nbytes / MIB, job.trigger, job.write_s * 1000, self.folder.file(job.name))

    def _kept_tokens(self, job: PendingSave, stored: StoredConversation) -> None:
        """The tokens the file holds are the slot's (a tracked count that differs is logged)."""
        if np.array_equal(stored.tokens, job.tokens):
            return
        log.warning("session store: slot %d held %d tokens, not the %d tracked; the file's are kept", job.slot_id,
                    stored.n_tokens, len(job.tokens))
        with self._lock:
            slot = self.slots[job.slot_id]
            if slot.tokens is job.tokens:
                slot.tokens = stored.tokens

    def _commit(self, job: PendingSave) -> None:
        """fsync the pending file, make room for it (evicting the least recently used), rename it to its
        name, index it (the index is the files) and drop the stored prefixes it extends."""
        try:
            self._commit_file(job)
        finally:
            with self._committed:
                self._pending.pop(job.name, None)
                self._committed.notify_all()

    def _commit_file(self, job: PendingSave) -> None:
        assert self.fingerprints is not None
        t0 = time.perf_counter()
        try:
            stored = self.folder.conversation(job.name, self.fingerprints, pending=True)  # the file as written
            assert stored is not None
            self.folder.sync_pending(job.name)
        except (sf.SessionFileError, OSError) as exc:
            self.metrics.save_failed()
            log.error("session store: the file saved for slot %d does not read back or sync (%s); removing it",
                      job.slot_id, exc)
            self.folder.remove_pending(job.name)
            return
        if stored.nbytes > self.settings.max_bytes:
            self.folder.remove_pending(job.name)
            self.metrics.evicted(stored.nbytes)
            log.warning("session store: a conversation of %.1f MiB is larger than the store's limit (%.1f MiB); "
                        "not kept", stored.nbytes / MIB, self.settings.max_bytes / MIB)
            return
        self._kept_tokens(job, stored)
        with self._files:
            older = self.index.strict_prefixes_of(stored.tokens)  # replaced by this file: dropped after it lands
            room = self.settings.max_bytes - stored.nbytes + sum(c.nbytes for c in older)
            for victim in self.index.over_limit(room, keep=[c.name for c in older]):
                self._drop(victim)  # before the rename: the folder never holds more than the limit
                self.metrics.evicted(victim.nbytes)
            try:
                self.folder.publish(job.name)
            except OSError as exc:
                self.metrics.save_failed()
                log.error("session store: renaming the file saved for slot %d failed (%s); removing it",
                          job.slot_id, exc)
                self.folder.remove_pending(job.name)
                return
            self.index.add(stored)
            for conversation in older:
                self._drop(conversation)
            self._evict(keep=job.name)
        if self.remote is not None:
            self.remote.upload(self.folder.file(job.name), self.fingerprints, stored.tokens)
        commit_s = time.perf_counter() - t0
        self.metrics.saved(job.trigger, job.n_written or stored.nbytes, job.write_s + commit_s)
        log.info("session store: saved slot %d (%d tokens, %.1f MiB, %s) in %.0f ms + %.0f ms committing as %s",
                 job.slot_id, stored.n_tokens, stored.nbytes / MIB, job.trigger, job.write_s * 1000, commit_s * 1000,
                 job.name)

    def _drain(self, deadline: float) -> None:
        """Wait for the pending saves' commits (at shutdown)."""
        with self._committed:
            while self._pending and self._committed.wait(max(0.0, deadline - time.monotonic())):
                pass

    def _await_commits(self, prompt: np.ndarray, held_common: int) -> None:
        """A pending save holding at least --cache-min-reuse more of the prompt than the slot would be the
        lookup's match: wait for its commit (it began when the request before this one ended)."""
        want = held_common + self.settings.min_reuse
        deadline = time.monotonic() + COMMIT_WAIT_S
        with self._committed:
            while any(common_prefix(prompt, p) >= want for p in self._pending.values()):
                if not self._committed.wait(max(0.0, deadline - time.monotonic())):
                    return

    def _save_idle_slots(self) -> None:
        now = time.monotonic()
        for slot_id in self.slots:
            with self._lock:
                idle = now - self.slots[slot_id].last_active >= self.settings.idle_s
            if not idle or not self._needs_save(slot_id):
                continue
            try:
                lease = self.engine.acquire(0.0, id_slot=slot_id)
            except EngineCallError:
                continue  # busy (it is not idle after all) or restarting
            with lease:
                lease.used = False  # an idle save is no use of the slot (its LRU order stays)
                job = self._save(lease, slot_id, SaveTrigger.IDLE)
            if job is not None:
                self._commit(job)  # the lease given back: the fsync holds no request

    def _drop(self, conversation: StoredConversation) -> None:
        self.index.remove(conversation.name)
        self.folder.remove(conversation.name)

    def _evict(self, keep: str | None = None) -> None:
        for victim in self.index.over_limit(self.settings.max_bytes, keep=(keep,) if keep else ()):
            self._drop(victim)
            self.metrics.evicted(victim.nbytes)
            if victim.name == keep:
                log.warning("session store: a conversation of %.1f MiB is larger than the store's limit "
                            "(%.1f MiB); not kept", victim.nbytes / MIB, self.settings.max_bytes / MIB)

    # --- restoring --------------------------------------------------------------------------------

    def _fetch_remote(self, prompt: np.ndarray, held: np.ndarray | None) -> None:
        """Download the object store's longest match for `prompt` into the folder when it holds at least
        --cache-min-reuse tokens more than the slot and the folder already have (it is then a local hit)."""
        assert self.remote is not None and self.fingerprints is not None
        local = self.index.longest_prefix(prompt)
        have = max(local.n_tokens if local is not None else 0, common_prefix(prompt, held) if held is not None else 0)
        if len(prompt) < have + self.settings.min_reuse:
            return  # no object could add enough: no request (the usual next turn of a chat held here)
        candidate = None
        try:
            candidate = self.remote.best(prompt, self.fingerprints, have + self.settings.min_reuse)
            if candidate is None or self.index.get(candidate.name) is not None:
                return
            t0 = time.perf_counter()
            stored = self.folder.adopt(candidate, self.fingerprints, self.remote)
        except sf.SessionFileError as exc:
            if candidate is not None:
                self._bad_file(candidate.name, exc.reason)
            return
        except Exception as exc:  # noqa: BLE001 -- the store unreachable: evaluated from what is local
            log.warning("session store: the object store's lookup failed: %s", exc)
            self.metrics.remote_failed()
            return
        if stored is None:
            self.folder.remove(candidate.name)
            return
        self.index.add(stored)
        self.metrics.fetched(stored.nbytes if self.folder.local else 0)
        log.info("session store: %s %s (%d tokens, %d of the prompt's, %.1f MiB) from the object store in "
                 "%.0f ms", "fetched" if self.folder.local else "found (restored in place)", candidate.key,
                 stored.n_tokens, candidate.n_match, stored.nbytes / MIB, (time.perf_counter() - t0) * 1000)
        self._evict(keep=candidate.name)

    def _restore(self, lease: EngineLease, slot_id: int, prompt: np.ndarray, decision: Plan) -> bool:
        match = decision.restore
        assert match is not None
        name = match.conversation.name
        request = {"path": str(self.folder.file(name)), "cut_to": match.n_tokens, "min_keep": decision.min_keep,
                   "discard_held": True}  # the slot's conversation was saved, or is not worth keeping
        t0 = time.perf_counter()
        try:
            result = lease.call("RESTORE_PREFIX", request)
        except EngineReplyError as exc:
            self.metrics.lookup(Lookup.REFUSED)
            if exc.kind == ErrorKind.SESSION_REFUSED and exc.reason == Reason.PREFIX_UNREACHABLE:
                return False  # refused before the gate: the slot is as it was; evaluated cold
            self._bad_file(name, str(exc.reason or exc.kind))
            if exc.kind == ErrorKind.SLOT_FAILED:  # that slot alone was erased: the prompt is evaluated cold
                self.slot_replaced(slot_id, EMPTY, Origin.NONE)
                return False
            if exc.kind != ErrorKind.SESSION_REFUSED:
                raise  # fail_stop: the engine restarts (engine_exited empties the slot)
            held = int(lease.call("STATUS")["slots"][slot_id].get("n_tokens_held", 0))
            if held == 0:  # refused during the in-place read: nothing is held any more
                self.slot_replaced(slot_id, EMPTY, Origin.NONE)
            return False
        except EngineDied:
            self._bad_file(name, "engine_died")
            raise
        seconds = time.perf_counter() - t0
        n_kept = int(result.get("n_kept", 0))
        self.index.touch(name)
        self.folder.touch(name)
        self.metrics.restored(int(result.get("n_read", 0)), n_kept, seconds)
        with self._lock:
            self.slots[slot_id].replace(prompt[:n_kept], Origin.STORE, name, n_kept)
        return True

    def _bad_file(self, name: str, reason: str) -> None:
        """Logged once (here), moved aside, never restored again."""
        self.index.remove(name)
        self.folder.move_aside(name, reason)
        self.metrics.bad_file(reason)

    # --- reporting --------------------------------------------------------------------------------

    def slot_info(self, slot_id: int = 0) -> dict[str, Any]:
        with self._lock:
            return self.slots[slot_id].info()

    def metric_rows(self) -> list[Row]:
        return self.metrics.rows(self.index.bytes_held(), len(self.index), self.settings.max_bytes)

