"""The engine supervisor: starts the engine process, watches it, restarts it with backoff.

States: STARTING -> READY on the ``ready`` line; any exit -> RESTARTING (backoff, then load again)
-> READY, except the statuses that restarting cannot fix (2: bad settings, 3: model not loadable),
which end in FAILED and are reported once. While not READY every lease is refused with the peer's
503 ``Loading model``. Exit statuses are spec/engine-protocol.md's.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from strata_engine.protocol import PROTOCOL_VERSION, ExitStatus

from ..errors import EngineDied, EngineProtocolViolation, EngineUnavailable
from ..ledger import SlotLedger
from ..slot_manager import DEFAULT_SIMILARITY, SlotManager
from .client import EngineState, EngineStatus
from .process import EngineProcess, ProcessLease, describe_exit_status

log = logging.getLogger("strata_server.engine")


class ExitAction(enum.Enum):
    RESTART = "restart"
    GIVE_UP = "give up"


# What an exit status means for the supervisor (spec/engine-protocol.md, "Exit statuses").
# Anything else (0 we did not ask for, 1, 4, killed by a signal, unknown) is restarted.
EXIT_ACTIONS: dict[int, ExitAction] = {
    ExitStatus.USAGE: ExitAction.GIVE_UP,  # the same settings will fail again
    ExitStatus.MODEL_LOAD: ExitAction.GIVE_UP,
}


@attrs.frozen
class RestartPolicy:
    """Exponential backoff between restarts; a process that stayed up ``stable_s`` resets it."""

    base_s: float = 0.25
    factor: float = 2.0
    max_s: float = 15.0
    stable_s: float = 30.0
    ready_timeout_s: float = 600.0  # a load that takes longer is treated as hung

    def delay(self, consecutive_failures: int) -> float:
        return min(self.max_s, self.base_s * self.factor ** max(consecutive_failures - 1, 0))


@attrs.frozen
class SupervisorSettings:
    slot_wait_s: float = 600.0  # how long a request waits its turn for a slot before a 503
    n_slots: int = 1  # the engine's --parallel; its ready line must report as many
    slot_prompt_similarity: float = DEFAULT_SIMILARITY
    command_timeout_s: float | None = None  # silence during one command that means "hung" (None: never)
    stop_timeout_s: float = 10.0  # after QUIT, how long before the engine is terminated


class EngineSupervisor:
    """``EngineClient`` over a supervised child process (see module docstring)."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        policy: RestartPolicy = RestartPolicy(),
        settings: SupervisorSettings = SupervisorSettings(),
        on_give_up: Callable[[str], None] | None = None,
    ) -> None:
        self.argv = list(argv)
        self.env = env
        self.policy = policy
        self.settings = settings
        self.on_give_up = on_give_up
        self.slots = SlotManager(SlotLedger(settings.n_slots), settings.slot_prompt_similarity)
        self._mutex = threading.Lock()
        self._wake = threading.Event()
        self._status = EngineStatus(EngineState.STARTING, message="Loading model")
        self._process: EngineProcess | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._exit_listeners: list[Callable[[int], None]] = [
            self.slots.ledger.engine_exited
        ]  # slots die with it
        self._incompatible: str | None = None
        self._n_forward = 0  # every process's forward passes (EngineStatus.n_forward)

    # --- EngineClient ---------------------------------------------------------------------------

    def status(self) -> EngineStatus:
        with self._mutex:
            status, process = attrs.evolve(self._status, n_forward=self._n_forward), self._process
        if status.state is EngineState.READY and (process is None or process.doomed or not process.alive()):
            # Exited (or announced its exit) but not yet reaped by the supervising thread.
            return attrs.evolve(status, state=EngineState.RESTARTING, message="Loading model")
        return status

    def _count_forward(self, increase: int) -> None:
        with self._mutex:
            self._n_forward += increase

    def acquire(
        self, wait_s: float | None = None, *, id_slot: int | None = None, prompt: Sequence[int] | None = None
    ) -> ProcessLease:
        wait = self.settings.slot_wait_s if wait_s is None else wait_s
        self._ready_process()
        slot = self.slots.acquire(wait, id_slot=id_slot, prompt=prompt)  # SlotBusy after the wait
        try:
            process = self._ready_process()  # it may have died while we waited
        except BaseException:
            self.slots.release(slot)
            raise
        return ProcessLease(self.slots, slot, process, command_timeout_s=self.settings.command_timeout_s)

    def command(self) -> ProcessLease:
        return ProcessLease(
            None, None, self._ready_process(), command_timeout_s=self.settings.command_timeout_s
        )

    def _ready_process(self) -> EngineProcess:
        with self._mutex:
            status, process = self._status, self._process
        if status.state is not EngineState.READY or process is None or process.doomed or not process.alive():
            raise EngineUnavailable(status.message if status.state is EngineState.FAILED else "Loading model")
        return process

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        assert self._thread is None, "start once"
        self._thread = threading.Thread(target=self._supervise, name="engine-supervisor", daemon=True)
        self._thread.start()

    def add_exit_listener(self, listener: Callable[[int], None]) -> None:
        """Called with the exit status each time the engine exits (metrics count restarts with it)."""
        self._exit_listeners.append(listener)

    def wait_ready(self, timeout: float) -> EngineStatus:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self._status
            if status.state in (EngineState.READY, EngineState.FAILED, EngineState.STOPPED):
                return status
            time.sleep(0.02)
        return self._status

    def stop(self) -> None:
        """QUIT the engine (after the request in flight, briefly) and stop supervising."""
        with self._mutex:
            self._stopping = True
            process = self._process
        self._wake.set()
        if process is not None and process.alive():
            # QUIT lets the requests in flight end first; they get a few seconds to.
            self.slots.wait_all_idle(min(self.settings.stop_timeout_s, 5.0))
            try:
                process.send("QUIT")
            except EngineDied:
                pass
            process.close_input()
            if process.wait(self.settings.stop_timeout_s) is None:
                log.warning("engine did not exit after QUIT; terminating it")
                process.terminate()
                if process.wait(5.0) is None:
                    process.kill()
                    process.wait(5.0)
        if self._thread is not None:
            self._thread.join(timeout=10.0)
        self._set(EngineState.STOPPED, message="Loading model")

    def kill_engine(self) -> None:
        """Kill the current engine process (tests and operators; the supervisor restarts it)."""
        with self._mutex:
            process = self._process
        if process is not None:
            process.kill()

    @property
    def engine_pid(self) -> int | None:
        process = self._process
        return process.pid if process is not None else None

    # --- the supervising thread -----------------------------------------------------------------

    def _set(self, state: EngineState, **changes: Any) -> None:
        with self._mutex:
            self._status = attrs.evolve(self._status, state=state, **changes)

    def _supervise(self) -> None:
        consecutive_failures = 0
        while not self._stopping:
            started = time.monotonic()
            try:
                process = EngineProcess(self.argv, self.env, on_forward=self._count_forward)
            except OSError as exc:
                self._give_up(f"the engine could not be started ({' '.join(self.argv[:3])} ...): {exc}", None)
                return
            with self._mutex:
                self._process = process
            fatal_message = self._await_ready(process)
            code = process.wait()
            assert code is not None
            for listener in self._exit_listeners:
                listener(code)
            if self._stopping:
                break
            uptime = time.monotonic() - started
            action = EXIT_ACTIONS.get(code, ExitAction.RESTART)
            detail = describe_exit_status(code)
            if self._incompatible:
                self._give_up(self._incompatible, code)
                return
            if action is ExitAction.GIVE_UP:
                self._give_up(f"the engine cannot start: {fatal_message or detail} ({detail})", code)
                return
            consecutive_failures = 1 if uptime >= self.policy.stable_s else consecutive_failures + 1
            delay = self.policy.delay(consecutive_failures)
            log.warning(
                "engine pid %d stopped (%s) after %.1f s; restarting in %.2f s",
                process.pid,
                detail,
                uptime,
                delay,
            )
            with self._mutex:
                self._status = attrs.evolve(
                    self._status,
                    state=EngineState.RESTARTING,
                    last_exit=code,
                    restarts=self._status.restarts + 1,
                    message="Loading model",
                )
            self._wake.wait(delay)
        self._set(EngineState.STOPPED)

    def _await_ready(self, process: EngineProcess) -> str | None:
        """Read up to the ``ready`` line; returns the engine's fatal message if it wrote one."""
        deadline = time.monotonic() + self.policy.ready_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                log.error(
                    "engine pid %d not ready after %.0f s; killing it",
                    process.pid,
                    self.policy.ready_timeout_s,
                )
                process.kill()
                return None
            try:
                event = process.next_event(timeout=min(remaining, 1.0))
            except EngineDied:
                return None
            except EngineProtocolViolation as exc:
                log.error("engine pid %d: %s; killing it", process.pid, exc)
                process.kill()
                return None
            if self._stopping:
                return None
            if event is None:
                continue
            kind = event["event"]
            if kind == "fatal":
                message = str(event.get("message", ""))
                log.error("engine pid %d: fatal: %s", process.pid, message)
                return message
            if kind != "ready":
                log.error("engine pid %d wrote %r before 'ready'; killing it", process.pid, event)
                process.kill()
                return None
            if event.get("protocol") != PROTOCOL_VERSION:
                # Restarting cannot fix this: the same engine will answer the same way.
                self._incompatible = (
                    f"the engine speaks protocol {event.get('protocol')!r}, "
                    f"this server speaks {PROTOCOL_VERSION}"
                )
                process.kill()
                return None
            if event.get("n_slots", 1) != self.slots.n_slots:
                self._incompatible = (
                    f"the engine holds {event.get('n_slots')!r} slots, the server was started "
                    f"with --parallel {self.slots.n_slots}"
                )
                process.kill()
                return None
            log.info(
                "engine pid %d ready: %s (%s, %s slot(s) of n_ctx %s, kv %s)",
                process.pid,
                event.get("model_path"),
                event.get("backend"),
                event.get("n_slots", 1),
                event.get("n_ctx_slot", event.get("n_ctx")),
                event.get("kv_type"),
            )
            self._set(EngineState.READY, info=event, message="")
            return None

    def _give_up(self, message: str, code: int | None) -> None:
        log.error("%s; not restarting", message)
        self._set(EngineState.FAILED, message=message, last_exit=code)
        if self.on_give_up is not None:
            self.on_give_up(message)


__all__ = [
    "EngineSupervisor",
    "RestartPolicy",
    "SupervisorSettings",
    "EXIT_ACTIONS",
    "ExitAction",
    "EngineDied",
    "EngineProtocolViolation",
]
