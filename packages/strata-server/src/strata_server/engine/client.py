"""What the HTTP layer needs from an engine: its state, leases on its slots, and slot-less commands.

``EngineClient`` is implemented by ``EngineSupervisor`` (a child process speaking
spec/engine-protocol.md, version 2) and, in tests, by an in-process fake. A lease gives one request one
slot until it is released (``SlotManager`` chooses it; requests finding every slot busy wait their turn,
bounded, as llama-server defers them); commands that need no slot run on a slot-less lease at once.
"""

from __future__ import annotations

import abc
import enum
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import attrs

from ..errors import EngineReplyError
from ..slot_manager import SlotManager

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
    n_forward: int = 0  # forward passes run by the engine processes so far (their lines' ``n_forward``)


class EngineLease(abc.ABC):
    """One request's use of the engine: of slot ``slot`` (exclusive, from ``EngineClient.acquire``), or of
    no slot (``slot`` None, from ``EngineClient.command``: TOKENIZE and the like, which never wait behind
    generation). Commands on one lease run one after another; leases run at once (protocol v2: every
    command carries an id, and the engine answers each by it). Release it exactly once (``with`` does)."""

    def __init__(self, slots: SlotManager | None, slot: int | None) -> None:
        self._slots = slots
        self.slot = slot
        self.used = True  # False: releasing it leaves the slot's last use (LRU order) as it was
        self._released = False
        self.acquired_at = time.monotonic()

    @abc.abstractmethod
    def request(
        self, verb: str, argument: Mapping[str, Any] | str | None = None, *, idle_s: float | None = None
    ) -> Iterator[dict]:
        """Send one command; yield its answer lines up to and including the terminal ``result``.

        A terminal ``error`` line raises ``EngineReplyError``; the engine dying raises ``EngineDied``.
        With ``idle_s``, ``IDLE_EVENT`` is yielded whenever the engine has been silent that long
        (for SSE keep-alives). Closing the iterator early leaves the command unfinished: the lease
        finishes it (cancelling a COMPLETE) before the next command or on release.
        """

    @abc.abstractmethod
    def cancel(self) -> None:
        """Ask the engine to end the COMPLETE or EMBED in flight (``CANCEL`` by its id); keep iterating to its
        terminal line."""

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
        """Bring the lease back to idle: finish (cancel) a command left unread."""

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        try:
            self._finish()
        finally:
            if self._slots is not None and self.slot is not None:
                self._slots.release(self.slot, used=self.used)

    def __enter__(self) -> EngineLease:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class EngineClient(Protocol):
    slots: SlotManager

    def status(self) -> EngineStatus: ...

    def acquire(
        self, wait_s: float | None = None, *, id_slot: int | None = None, prompt: Sequence[int] | None = None
    ) -> EngineLease:
        """A lease on a slot (``id_slot``, else the one ``SlotManager`` chooses for ``prompt``); raises
        ``EngineUnavailable`` (not ready) or ``SlotBusy`` (waited its turn too long)."""

    def command(self) -> EngineLease:
        """A lease on no slot, for commands that need none; raises ``EngineUnavailable``."""

    def add_exit_listener(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(exit status)`` whenever the engine process exits, after the slots' ledger forgot
        what they held."""

    def stop(self) -> None: ...


def engine_call(engine: EngineClient, verb: str, argument: Mapping[str, Any] | str | None = None) -> dict:
    """One slot-less command (TOKENIZE, DETOKENIZE, APPLY_TEMPLATE, PROMPT_TOKENS, ...) to its result."""
    with engine.command() as lease:
        return lease.call(verb, argument)


def raise_for_error(event: dict) -> None:
    if event.get("event") == "error":
        raise EngineReplyError(event.get("error") or {})
