"""What the HTTP layer needs from an engine: its state, and exclusive leases on slot 0.

``EngineClient`` is implemented by ``EngineSupervisor`` (a child process speaking
spec/engine-protocol.md) and, in tests, by an in-process fake. A lease gives one request the
engine's command channel until it is released: the protocol is strictly sequential, so every
command — a generation, a tokenize, a save — runs under a lease, one at a time, and others wait
(bounded) as llama-server defers requests for a busy slot.
"""

from __future__ import annotations

import abc
import enum
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import attrs

from ..errors import EngineReplyError

TERMINAL_EVENTS = frozenset({"result", "error"})
IDLE_EVENT = {"event": "idle"}  # yielded by ``request`` while the engine has been silent for ``idle_s``


class EngineState(enum.Enum):
    STARTING = "starting"  # first load after boot
    READY = "ready"
    RESTARTING = "restarting"  # the process exited; waiting out the backoff or loading again
    FAILED = "failed"  # it cannot start (bad settings, model not loadable): not restarted in a loop
    STOPPED = "stopped"


@attrs.frozen
class EngineStatus:
    state: EngineState
    info: Mapping[str, Any] | None = None  # the engine's ``ready`` line
    restarts: int = 0
    last_exit: int | None = None
    message: str = ""  # why it is not ready (for FAILED: the engine's own words)


class SlotGate:
    """Exclusive use of slot 0 with a bounded wait; counts what is processing and what waits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = threading.Lock()
        self.waiting = 0

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    def acquire(self, wait_s: float) -> bool:
        if self._lock.acquire(blocking=False):
            return True
        with self._counts:
            self.waiting += 1
        try:
            return self._lock.acquire(timeout=max(wait_s, 0.0))
        finally:
            with self._counts:
                self.waiting -= 1

    def release(self) -> None:
        self._lock.release()


class EngineLease(abc.ABC):
    """One request's exclusive use of the engine. Release it exactly once (``with`` does)."""

    def __init__(self, gate: SlotGate) -> None:
        self._gate = gate
        self._released = False
        self.acquired_at = time.monotonic()

    @abc.abstractmethod
    def request(self, verb: str, argument: Mapping[str, Any] | str | None = None, *,
                idle_s: float | None = None) -> Iterator[dict]:
        """Send one command; yield its answer lines up to and including the terminal ``result``.

        A terminal ``error`` line raises ``EngineReplyError``; the engine dying raises ``EngineDied``.
        With ``idle_s``, ``IDLE_EVENT`` is yielded whenever the engine has been silent that long
        (for SSE keep-alives). Closing the iterator early leaves the command unfinished: the lease
        finishes it (cancelling a COMPLETE) before the next command or on release.
        """

    @abc.abstractmethod
    def cancel(self) -> None:
        """Ask the engine to end the COMPLETE in flight (``CANCEL``); keep iterating to its result."""

    def call(self, verb: str, argument: Mapping[str, Any] | str | None = None) -> dict:
        """Run one command to its ``result`` line and return it."""
        result: dict | None = None
        for event in self.request(verb, argument):
            if event.get("event") == "result":
                result = event
        assert result is not None, "request() ends with a result or raises"
        return result

    @abc.abstractmethod
    def _finish(self) -> None:
        """Bring the command channel back to idle: finish (cancel) a command left unread."""

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        try:
            self._finish()
        finally:
            self._gate.release()

    def __enter__(self) -> EngineLease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class EngineClient(Protocol):
    def status(self) -> EngineStatus: ...

    def acquire(self, wait_s: float | None = None) -> EngineLease:
        """A lease on slot 0; raises ``EngineUnavailable`` (not ready) or ``SlotBusy`` (waited too long)."""

    @property
    def gate(self) -> SlotGate: ...

    def stop(self) -> None: ...


def raise_for_error(event: dict) -> None:
    if event.get("event") == "error":
        raise EngineReplyError(event.get("error") or {})
