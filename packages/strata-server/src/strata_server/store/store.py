"""`SessionStore`: the server keeps every conversation in a bounded folder of session files and restores
the longest stored prefix of each prompt into the slot (`--cache-disk DIR`).

The request path (`CompletionRun`) calls `prepare` under the slot's lease before its COMPLETE: the
engine gives the prompt's tokens (PROMPT_TOKENS), `policy.plan` decides, the slot's conversation is
saved if the request is about to replace it (saving.py), a match is restored (RESTORE_PREFIX, cut to the
match, landing in place), and the COMPLETE is sent with the tokens. What each slot holds is the slot
ledger's (ledger.py). A background thread scans the shelf once the engine is ready (the index is the
files), then saves a slot idle for --cache-idle-seconds; `shutdown` saves every slot at SIGTERM / SIGINT.

A pending file left by a kill is verified in full at start-up and committed, or removed: only committed
files are ever indexed. With the object store alone (no --cache-disk) the shelf is the objects themselves
(objects.py).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import strata_sessionfile as sf
from strata_engine.protocol import ErrorKind, Reason

from ..engine.client import EngineClient, EngineLease, EngineState
from ..errors import EngineDied, EngineReplyError
from ..ledger import Origin, SlotLedger
from ..tokens import as_tokens, common_prefix
from .folder import StoreFolder
from .index import StoreIndex
from .metrics import Lookup, Row, SaveTrigger, StoreMetrics
from .names import PENDING_SUFFIX, Fingerprints
from .objects import ObjectShelf
from .policy import Plan, plan
from .remote import RemoteTier, missing
from .saving import Saves
from .settings import MIB, StoreSettings
from .shelf import Shelf
from .writebehind import WriteBehindSaver

log = logging.getLogger("strata_server.store")

READY_WAIT_S = 2.0  # how long a request waits for the start-up scan before it goes on without the store

__all__ = ["MIB", "SessionStore", "StoreSettings"]


def open_shelf(settings: StoreSettings, remote: RemoteTier | None) -> Shelf:
    """The folder (with the object store behind it, if any), or the object store's objects alone."""
    require_mac = settings.require_mac and settings.key is not None
    if settings.folder is not None:
        return StoreFolder(settings.folder, settings.key, require_mac, remote, private=settings.ephemeral)
    assert remote is not None, "a store without a folder has an object store"
    return ObjectShelf(remote)


class SessionStore:
    def __init__(self, settings: StoreSettings, engine: EngineClient, ledger: SlotLedger) -> None:
        self.settings = settings
        self.engine = engine
        self.ledger = ledger
        require_mac = settings.require_mac and settings.key is not None
        self.metrics = StoreMetrics()
        self.remote = (
            RemoteTier(settings.remote, settings.key, require_mac, self.metrics)
            if settings.remote is not None
            else None
        )
        self.shelf = open_shelf(settings, self.remote)
        self.index = StoreIndex()
        self.fingerprints: Fingerprints | None = None
        self._files = (
            threading.RLock()
        )  # committed files and index vs a lookup + restore (no eviction between)
        self.saves = Saves(settings, engine, ledger, self.shelf, self.index, self.metrics, self._files)
        self.write_behind = (
            WriteBehindSaver(engine, self.saves, self.metrics, lambda: self.fingerprints)
            if settings.remote is not None and settings.write_behind
            else None
        )
        self._ready = threading.Event()  # the shelf was scanned for this engine
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """trust.StoreFolderRefused when the folder is not the server user's own."""
        self.shelf.create()
        self.saves.start()
        if self.write_behind is not None:
            self.write_behind.start()
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
            self.saves.save_idle_slots(fingerprints)

    def scan(self) -> None:
        """Index this engine's files (headers and metadata only), oldest use first; move bad ones aside."""
        assert self.fingerprints is not None
        t0 = time.monotonic()
        for name in list(self.shelf.pending_names()):
            self._recover(name)
        names = sorted(self.shelf.names(), key=self.shelf.used_at)
        indexed = foreign = bad = 0
        for done, name in enumerate(names):
            if time.monotonic() - t0 > self.settings.scan_budget_s:
                log.warning(
                    "session store: scan stopped after %.0f s; %d of %d files left unindexed",
                    self.settings.scan_budget_s,
                    len(names) - done,
                    len(names),
                )
                break
            try:
                conversation = self.shelf.conversation(name, self.fingerprints)
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
        self.saves.evict()
        log.info(
            "session store %s: %d conversations (%.1f MiB) indexed, %d of other engines ignored, %d bad, "
            "in %.2f s",
            self.shelf.path,
            indexed,
            self.index.bytes_held() / MIB,
            foreign,
            bad,
            time.monotonic() - t0,
        )
        self._ready.set()

    def _recover(self, name: str) -> None:
        """A pending file left by a server stopped before its commit: the engine renamed it complete, so it
        is committed when it verifies in full (payload hash included), else removed; another engine's is
        left to its server."""
        assert self.fingerprints is not None
        try:
            stored = self.shelf.conversation(name, self.fingerprints, pending=True, verify=True)
            if stored is not None:
                self.shelf.sync_pending(name)
                self.shelf.publish(name)
                log.info(
                    "session store: committed %s, left pending by a server stopped before its commit", name
                )
        except sf.SessionFileError as exc:
            log.warning(
                "session store: %s%s, left pending, does not verify (%s); removing it",
                name,
                PENDING_SUFFIX,
                exc.reason,
            )
            self.shelf.remove_pending(name)
        except OSError as exc:
            log.warning(
                "session store: %s%s, left pending, could not be committed: %s", name, PENDING_SUFFIX, exc
            )

    def wait_ready(self, timeout_s: float = READY_WAIT_S) -> bool:
        """Whether the start-up scan is done (waiting for it at most `timeout_s`)."""
        return self._ready.wait(timeout_s)

    def shutdown(self) -> None:
        """Save every slot whose conversation is not stored yet (bounded, logged); stop the threads."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self.write_behind is not None:
            self.write_behind.stop(timeout_s=5.0)  # the shutdown saves below take over
        deadline = time.monotonic() + self.settings.shutdown_budget_s
        self.saves.drain(deadline)
        try:
            if self.settings.ephemeral and self.settings.folder is not None:
                shutil.rmtree(self.settings.folder, ignore_errors=True)
            elif self._ready.is_set() and self.fingerprints is not None:
                self.saves.save_every_slot(deadline, self.fingerprints)
                if self.remote is not None:
                    self.remote.close(max(1.0, deadline - time.monotonic()))
        finally:
            self.saves.stop(deadline)

    # --- the request path (under the slot's lease) -----------------------------------------------

    def prepare(self, lease: EngineLease, command: Mapping[str, Any], slot_id: int = 0) -> dict[str, Any]:
        """The COMPLETE to send for `command`, after saving and restoring what the store decides."""
        prompt = as_tokens(lease.call("PROMPT_TOKENS", command)["tokens"])
        cache_prompt = command.get("cache_prompt", True) is not False
        held = self.ledger.tokens(slot_id)
        # A request right after start-up waits briefly for the scan (ms for a few files): a returning chat is found.
        ready = self._ready.wait(READY_WAIT_S)
        if ready and cache_prompt:
            self.saves.await_commits(prompt, common_prefix(prompt, held) if held is not None else 0)
        with self._files:
            refused = 0
            if ready and cache_prompt and self.remote is not None:
                refused = self._fetch_remote(prompt, held)
            match = self.index.longest_prefix(prompt) if ready and cache_prompt else None
            decision = plan(prompt, held, match, min_reuse=self.settings.min_reuse, cache_prompt=cache_prompt)
            if ready and decision.save_first:
                job = self.saves.save(lease, slot_id, SaveTrigger.REPLACE, self.fingerprints)
                if job is not None:
                    self.saves.commit_later(job)  # the fsync and the rest off this request's path
            if decision.restore is not None:
                self._restore(lease, slot_id, prompt, decision)
        if ready and decision.restore is None:
            found = Lookup.HELD if match is not None else Lookup.REFUSED if refused else Lookup.MISS
            self.metrics.lookup(found)
        rest = {k: v for k, v in command.items() if k not in ("messages", "prompt")}
        return {**rest, "prompt": prompt.tolist()}

    def turn_done(self, slot_id: int) -> None:
        """A completion on `slot_id` ended and gave its lease back: with write-behind, its conversation is
        saved and shared off this request's path."""
        if self.write_behind is not None:
            self.write_behind.turn_done(slot_id)

    # --- restoring --------------------------------------------------------------------------------

    def _fetch_remote(self, prompt: np.ndarray, held: np.ndarray | None) -> int:
        """Fetch the object store's longest match for `prompt` onto the shelf when it holds at least
        --cache-min-reuse tokens more than the slot and the shelf already have (it is then a local hit); the
        number of objects that could have matched but were refused for their bytes (a MAC, a bad header)."""
        assert self.remote is not None and self.fingerprints is not None
        local = self.index.longest_prefix(prompt)
        have = max(
            local.n_tokens if local is not None else 0, common_prefix(prompt, held) if held is not None else 0
        )
        if len(prompt) < have + self.settings.min_reuse:
            return 0  # no object could add enough: no request (the usual next turn of a chat held here)
        refused = 0
        for attempt in range(2):
            candidate = None
            try:
                search = self.remote.best(prompt, self.fingerprints, have + self.settings.min_reuse)
                candidate, refused = search.candidate, search.refused
                if candidate is None or self.index.get(candidate.name) is not None:
                    return refused
                t0 = time.perf_counter()
                adoption = self.shelf.adopt(candidate, self.fingerprints)
                break
            except sf.SessionFileError as exc:
                if candidate is not None:
                    self._bad_file(candidate.name, exc.reason)
                return refused + 1
            except Exception as exc:  # noqa: BLE001 -- the store unreachable: evaluated from what is local
                if attempt == 0 and candidate is not None and missing(exc):
                    # Deleted since listed (its server's newer turn replaced it): listed again.
                    self.remote.forget(candidate.key)
                    continue
                log.warning("session store: the object store's lookup failed: %s", exc)
                self.metrics.remote_failed()
                return refused
        else:
            return refused
        stored = adoption.conversation
        if stored is None:
            self.shelf.remove(candidate.name)
            return refused
        self.index.add(stored)
        self.metrics.fetched(adoption.downloaded)
        described = f"{candidate.key} ({stored.n_tokens} tokens, {candidate.n_match} of the prompt's, " + (
            f"{stored.nbytes / MIB:.1f} MiB)"
        )
        if adoption.downloaded:
            ms = (time.perf_counter() - t0) * 1000
            log.info("session store: fetched %s from the object store in %.0f ms", described, ms)
        else:  # its restore, read straight from the object, is logged with its time
            log.info("session store: found %s in the object store", described)
        self.saves.evict(keep=candidate.name)
        return refused

    def _restore(self, lease: EngineLease, slot_id: int, prompt: np.ndarray, decision: Plan) -> None:
        match = decision.restore
        assert match is not None
        name = match.conversation.name
        if not self.shelf.trusted(name):  # replaced since its scan by another user's file: never read
            log.warning("session store: %s is not this server's user's file any more; not restored", name)
            self.index.remove(name)
            self.metrics.lookup(Lookup.REFUSED)
            return
        request = {
            "path": str(self.shelf.file(name)),
            "cut_to": match.n_tokens,
            "min_keep": decision.min_keep,
            "discard_held": True,
        }  # the slot's conversation was saved, or is not worth keeping
        t0 = time.perf_counter()
        try:
            result = lease.call("RESTORE_PREFIX", request)
        except EngineReplyError as exc:
            self.metrics.lookup(Lookup.REFUSED)
            if exc.kind == ErrorKind.SESSION_REFUSED and exc.reason == Reason.PREFIX_UNREACHABLE:
                return  # refused before the gate: the slot is as it was; evaluated cold
            self._bad_file(name, str(exc.reason or exc.kind))
            if exc.kind == ErrorKind.SLOT_FAILED:  # that slot alone was erased: the prompt is evaluated cold
                self.ledger.erased(slot_id)
                return
            if exc.kind != ErrorKind.SESSION_REFUSED:
                raise  # fail_stop: the engine restarts (its exit empties the ledger)
            held = int(lease.call("STATUS")["slots"][slot_id].get("n_tokens_held", 0))
            if held == 0:  # refused during the in-place read: nothing is held any more
                self.ledger.erased(slot_id)
            return
        except EngineDied:
            self._bad_file(name, "engine_died")
            raise
        seconds = time.perf_counter() - t0
        n_kept = int(result.get("n_kept", 0))
        self.index.touch(name)
        self.shelf.touch(name)
        self.metrics.restored(int(result.get("n_read", 0)), n_kept, seconds)
        log.info(
            "session store: restored slot %d from %s (%d tokens kept, %.1f MiB read) in %.0f ms",
            slot_id,
            self.shelf.file(name),
            n_kept,
            int(result.get("n_read", 0)) / MIB,
            seconds * 1000,
        )
        self.ledger.restored(slot_id, prompt[:n_kept], Origin.STORE, name)

    def remove(self, name: str) -> None:
        """A conversation a person deleted: its file goes and the index forgets it, never between a lookup and
        its restore."""
        with self._files:
            conversation = self.index.get(name)
            if conversation is not None:
                self.saves.drop(conversation)

    def _bad_file(self, name: str, reason: str) -> None:
        """Logged once (here), moved aside, never restored again."""
        self.index.remove(name)
        self.shelf.move_aside(name, reason)
        self.metrics.bad_file(reason)

    # --- reporting --------------------------------------------------------------------------------

    def metric_rows(self) -> list[Row]:
        return self.metrics.rows(self.index.bytes_held(), len(self.index), self.settings.max_bytes)
