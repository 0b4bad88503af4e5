"""`SessionStore`: the server keeps every conversation in a bounded folder of session files and restores
the longest stored prefix of each prompt into the slot (issue 17; `--cache-disk DIR`).

The request path (`CompletionRun`) calls `prepare` under the slot's lease before its COMPLETE: the
engine gives the prompt's tokens (PROMPT_TOKENS), `policy.plan` decides, the slot's conversation is
saved if the request is about to replace it, a match is restored (RESTORE_PREFIX, cut to the match,
landing in place), and the COMPLETE is sent with the tokens; `completed` records what the slot holds
after it. A background thread scans the folder once the engine is ready (the index is the files), then
saves a slot idle for --cache-idle-seconds; `shutdown` saves every slot at SIGTERM / SIGINT.

The store tracks each slot's tokens (`SlotConversation`, by slot id: one slot today, N later) from the
prompts and results it sees; when it cannot know them (a COMPLETE that failed or was cut off) they are
unknown until the next COMPLETE, and an unknown conversation is never saved.
"""

from __future__ import annotations

import enum
import logging
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
from .folder import Fingerprints, StoreFolder, conversation_name
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
        self._lock = threading.Lock()  # the slots' tracked state
        self._ready = threading.Event()  # the folder was scanned for this engine
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        if self.settings.ephemeral:
            shutil.rmtree(self.settings.folder, ignore_errors=True)
        self.folder.create()
        self._thread = threading.Thread(target=self._run, name="session-store", daemon=True)
        self._thread.start()

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

    def shutdown(self) -> None:
        """Save every slot whose conversation is not stored yet (bounded, logged); stop the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self.settings.ephemeral:
            shutil.rmtree(self.settings.folder, ignore_errors=True)
            return
        if not self._ready.is_set():
            return
        deadline = time.monotonic() + self.settings.shutdown_budget_s
        for slot_id in self.slots:
            if not self._needs_save(slot_id):
                log.info("session store: slot %d has nothing to save at shutdown (stored already, too short or "
                         "unknown)", slot_id)
                continue
            try:
                with self.engine.acquire(max(0.0, deadline - time.monotonic())) as lease:
                    self._save(lease, slot_id, SaveTrigger.SHUTDOWN)
            except EngineCallError as exc:
                log.warning("session store: slot %d not saved at shutdown: %s", slot_id, exc)
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
        if ready and cache_prompt and self.remote is not None:
            self._fetch_remote(prompt, held)
        match = self.index.longest_prefix(prompt) if ready and cache_prompt else None
        decision = plan(prompt, held, match, min_reuse=self.settings.min_reuse, cache_prompt=cache_prompt)
        if ready and decision.save_first:
            self._save(lease, slot_id, SaveTrigger.REPLACE)
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
        return (self.fingerprints is not None and worth_saving(tokens, self.settings.min_reuse)
                and not self.index.covers(tokens))

    def _save(self, lease: EngineLease, slot_id: int, trigger: SaveTrigger) -> None:
        """Save the slot's conversation unless the store holds it already; a longer one replaces the files
        it extends; then evict down to the limit."""
        if not self._needs_save(slot_id):
            return
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
            if not exc.error.get("file_in_place"):
                return
        seconds = time.perf_counter() - t0
        try:
            stored = self.folder.conversation(name, self.fingerprints)  # the file as written: the index is the files
        except (sf.SessionFileError, OSError) as exc:
            log.error("session store: the file just saved for slot %d does not read back (%s); removing it", slot_id, exc)
            self.folder.remove(name)
            return
        assert stored is not None
        if not np.array_equal(stored.tokens, tokens):
            log.warning("session store: slot %d held %d tokens, not the %d tracked; the file's are kept", slot_id,
                        stored.n_tokens, len(tokens))
            with self._lock:
                self.slots[slot_id].tokens = stored.tokens
        self.index.add(stored)
        if self.remote is not None and self.folder.local:
            self.remote.upload(self.folder.file(name), self.fingerprints, stored.tokens)
        for older in self.index.strict_prefixes_of(stored.tokens):
            self._drop(older)
        self.metrics.saved(trigger, int(result.get("n_written", stored.nbytes)), seconds)
        log.info("session store: saved slot %d (%d tokens, %.1f MiB, %s) in %.0f ms as %s", slot_id, stored.n_tokens,
                 stored.nbytes / MIB, trigger, seconds * 1000, name)
        self._evict(keep=name)

    def _save_idle_slots(self) -> None:
        now = time.monotonic()
        for slot_id in self.slots:
            with self._lock:
                idle = now - self.slots[slot_id].last_active >= self.settings.idle_s
            if not idle or not self._needs_save(slot_id):
                continue
            try:
                lease = self.engine.acquire(0.0)
            except EngineCallError:
                continue  # busy (it is not idle after all) or restarting
            with lease:
                self._save(lease, slot_id, SaveTrigger.IDLE)

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
            if exc.kind != ErrorKind.SESSION_REFUSED:
                raise  # fail_stop: the engine restarts (engine_exited empties the slot)
            held = int(lease.call("STATUS").get("n_tokens_held", 0))
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

