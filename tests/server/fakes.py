"""An in-process ``EngineClient`` over ``FakeEngine``: the HTTP layer's tests run without a process."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from strata_engine.protocol import ErrorKind, ExitStatus
from strata_server.engine.client import EngineLease, EngineState, EngineStatus, raise_for_error
from strata_server.engine.process import encode_command
from strata_server.errors import EngineUnavailable
from strata_server.ledger import SlotLedger
from strata_server.slot_manager import SlotManager

from .fake_engine import FailStop, FakeEngine, status_of


class FakeLease(EngineLease):
    """A lease on one slot's FakeEngine (``slot`` None: the slot-less one, for TOKENIZE and the like)."""

    def __init__(self, client: FakeEngineClient, slot: int | None) -> None:
        super().__init__(client.slots if slot is not None else None, slot)
        self.client = client
        self._open: Iterator[dict] | None = None
        self._cancel = threading.Event()

    def request(
        self, verb: str, argument: Mapping[str, Any] | str | None = None, *, idle_s: float | None = None
    ) -> Iterator[dict]:
        self._finish()
        self.client.commands.append(verb)
        self._cancel.clear()
        engine = self.client.engine_of(self.slot)
        engine.cancel_requested = self._cancel.is_set
        line = encode_command(verb, argument)
        assert "\n" not in line
        if verb == "STATUS":  # every slot's, as protocol v2's
            busy = frozenset(slot.id for slot in self.client.slots.snapshot() if slot.busy)
            self._open = self._answers(iter([status_of(self.client.slot_engines, busy)]))
        else:
            self._open = self._answers(engine.handle(line))
        return self._open

    def _answers(self, lines: Iterator[dict]) -> Iterator[dict]:
        try:
            for event in lines:
                if event["event"] in ("result", "error"):
                    self._open = None
                    raise_for_error(event)
                    yield event
                    return
                yield event
        except FailStop as exc:
            self._open = None
            self.client.fail_stop()
            raise_for_error(
                {
                    "event": "error",
                    "error": {"type": ErrorKind.FAIL_STOP, "reason": "apply_failed", "message": str(exc)},
                }
            )

    def cancel(self) -> None:
        self._cancel.set()

    def _finish(self) -> None:
        if self._open is not None:
            self._cancel.set()
            for _ in self._open:
                pass
            self._open = None


class FakeEngineClient:
    """``EngineClient`` with one FakeEngine per slot (each with the slot's context, n_ctx // n_slots) and one
    for slot-less commands; ``state`` can be set to simulate loading/restarts."""

    def __init__(self, engine: FakeEngine, n_slots: int = 1, similarity: float = 0.1) -> None:
        self.engine = engine  # the slot-less one; its n_ctx is the total
        self.slots = SlotManager(SlotLedger(n_slots), similarity)
        self.slot_engines = [self._fresh(engine, engine.n_ctx // n_slots) for _ in range(n_slots)]
        self.state = EngineState.READY
        self.restarts = 0
        self.commands: list[str] = []
        self.n_forward_lost = 0  # the passes of slot engines replaced after a fail-stop
        self.exit_listeners: list[Callable[[int], None]] = [self.slots.ledger.engine_exited]

    @staticmethod
    def _fresh(like: FakeEngine, n_ctx: int) -> FakeEngine:
        return FakeEngine(
            like.model_path, n_ctx, like.kv_type, like.token_delay, like.prompt_delay, fim=like.fim
        )

    def engine_of(self, slot: int | None) -> FakeEngine:
        return self.engine if slot is None else self.slot_engines[slot]

    def status(self) -> EngineStatus:
        info = None
        if self.state is EngineState.READY:
            info = {
                **self.engine.ready_line(),
                "n_slots": self.slots.n_slots,
                "n_ctx_slot": self.slot_engines[0].n_ctx,
            }
        return EngineStatus(
            self.state,
            info=info,
            restarts=self.restarts,
            message="" if self.state is EngineState.READY else "Loading model",
            n_forward=self.n_forward_lost + sum(e.n_forward for e in [self.engine, *self.slot_engines]),
        )

    def acquire(
        self, wait_s: float | None = None, *, id_slot: int | None = None, prompt: list[int] | None = None
    ) -> FakeLease:
        if self.state is not EngineState.READY:
            raise EngineUnavailable()
        slot = self.slots.acquire(1.0 if wait_s is None else wait_s, id_slot=id_slot, prompt=prompt)
        return FakeLease(self, slot)

    def command(self) -> FakeLease:
        if self.state is not EngineState.READY:
            raise EngineUnavailable()
        return FakeLease(self, None)

    def add_exit_listener(self, listener: Callable[[int], None]) -> None:
        self.exit_listeners.append(listener)

    def fail_stop(self) -> None:
        """What the supervisor does after exit 4: a fresh engine, every slot's conversation gone."""
        self.restarts += 1
        self.n_forward_lost += sum(e.n_forward for e in self.slot_engines)
        self.slot_engines = [self._fresh(e, e.n_ctx) for e in self.slot_engines]
        for listener in self.exit_listeners:
            listener(ExitStatus.FAIL_STOP)

    def stop(self) -> None:
        self.state = EngineState.STOPPED
