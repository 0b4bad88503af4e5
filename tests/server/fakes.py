"""An in-process ``EngineClient`` over ``FakeEngine``: the HTTP layer's tests run without a process."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any

from strata_engine.protocol import ErrorKind
from strata_server.engine.client import EngineLease, EngineState, EngineStatus, SlotGate, raise_for_error
from strata_server.engine.process import encode_command
from strata_server.errors import EngineUnavailable, SlotBusy

from .fake_engine import FailStop, FakeEngine


class FakeLease(EngineLease):
    def __init__(self, client: FakeEngineClient) -> None:
        super().__init__(client.gate)
        self.client = client
        self._open: Iterator[dict] | None = None
        self._cancel = threading.Event()

    def request(self, verb: str, argument: Mapping[str, Any] | str | None = None, *,
                idle_s: float | None = None) -> Iterator[dict]:
        self._finish()
        self.client.commands.append(verb)
        self._cancel.clear()
        self.client.engine.cancel_requested = self._cancel.is_set
        line = encode_command(verb, argument)
        assert "\n" not in line
        self._open = self._answers(self.client.engine.handle(line))
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
            raise_for_error({"event": "error", "error": {"type": ErrorKind.FAIL_STOP, "reason": "apply_failed",
                                                         "message": str(exc)}})

    def cancel(self) -> None:
        self._cancel.set()

    def _finish(self) -> None:
        if self._open is not None:
            self._cancel.set()
            for _ in self._open:
                pass
            self._open = None


class FakeEngineClient:
    """``EngineClient`` with a FakeEngine inside; ``state`` can be set to simulate loading/restarts."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.gate = SlotGate()
        self.state = EngineState.READY
        self.restarts = 0
        self.commands: list[str] = []

    def status(self) -> EngineStatus:
        info = self.engine.ready_line() if self.state is EngineState.READY else None
        return EngineStatus(self.state, info=info, restarts=self.restarts,
                            message="" if self.state is EngineState.READY else "Loading model")

    def acquire(self, wait_s: float | None = None) -> FakeLease:
        if self.state is not EngineState.READY:
            raise EngineUnavailable()
        wait = 1.0 if wait_s is None else wait_s
        if not self.gate.acquire(wait):
            raise SlotBusy(wait)
        return FakeLease(self)

    def fail_stop(self) -> None:
        """What the supervisor does after exit 4: a fresh engine, the conversation gone."""
        self.restarts += 1
        self.engine = FakeEngine(self.engine.model_path, self.engine.n_ctx, self.engine.kv_type,
                                 fim=self.engine.fim)

    def stop(self) -> None:
        self.state = EngineState.STOPPED
