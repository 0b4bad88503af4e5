"""One engine child process (protocol v2): its lines routed by request id, and the leases that use it."""

from __future__ import annotations

import io
import itertools
import json
import logging
import os
import queue
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from strata_engine.protocol import CANCELLABLE_VERBS, ErrorKind, ExitStatus
from strata_engine.wire import VERBS

from ..errors import EngineDied, EngineProtocolViolation
from ..slot_manager import SlotManager
from .client import IDLE_EVENT, TERMINAL_EVENTS, EngineLease, raise_for_error

log = logging.getLogger("strata_server.engine")

_EOF = object()
# The engine's stdout is read through a buffer: Popen's bufsize=0 file (kept for the unbuffered stdin) would
# read a line one byte (one system call) at a time.
READ_BUFFER_BYTES = 1 << 16
# The verbs that act on one slot: the lease names its slot in them (spec/engine-protocol.md, Lines).
SLOT_VERBS = frozenset(verb for verb, spec in VERBS.items() if spec.slotted)


class Call:
    """One command in flight: the lines the engine wrote for its id, in order."""

    def __init__(self, process: EngineProcess, request_id: str, verb: str) -> None:
        self.process = process
        self.id = request_id
        self.verb = verb
        self.lines: queue.Queue = queue.Queue()
        self.cancel_sent = False

    def next_event(self, timeout: float | None) -> dict | None:
        """Its next line, or None after ``timeout`` seconds of silence; EngineDied at end of output."""
        try:
            item = self.lines.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is _EOF:
            self.lines.put(_EOF)  # every later read sees the end too
            raise EngineDied(self.process.describe_exit())
        return item

    def done(self) -> None:
        self.process.forget(self.id)


class EngineProcess:
    """The child process and a reader thread routing its stdout lines by request id (protocol v2).

    Lines with an ``id`` go to that command's ``Call``; the others (``ready``, ``fatal``) to the
    start-up queue. A line that is not a protocol line means the engine is broken: it is killed (the
    supervisor restarts it) and every command in flight ends with ``EngineDied``.
    The child gets its own session, so a Ctrl-C at the terminal reaches the server (which QUITs the
    engine) rather than the engine directly. Its stderr is inherited: engine logs go to the server's.
    """

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        on_forward: Callable[[int], None] | None = None,
    ) -> None:
        self.argv = list(argv)
        # the engine's count of forward passes (the latest ``n_forward`` of its lines); on_forward(increase)
        self.n_forward = 0
        self._on_forward = on_forward
        self._events: queue.Queue = queue.Queue()  # lines without an id: ready, fatal
        self._calls: dict[str, Call] = {}
        self._calls_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._ended = False
        self._write_lock = threading.Lock()
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,
            env=dict(env) if env is not None else None,
            start_new_session=True,
            bufsize=0,
        )
        self.pid = self.proc.pid
        self.doomed = False  # it announced its exit (fail_stop): no new command may start on it
        self._reader = threading.Thread(
            target=self._read_lines, name=f"engine-stdout-{self.pid}", daemon=True
        )
        self._reader.start()

    def _read_lines(self) -> None:
        assert isinstance(self.proc.stdout, io.FileIO)  # bufsize=0: the raw pipe, for a buffer of our size
        stdout = io.BufferedReader(self.proc.stdout, READ_BUFFER_BYTES)
        try:
            with stdout:  # closed at the pipe's end, not left to the collector (a ResourceWarning)
                for raw in stdout:
                    try:
                        event = json.loads(raw)
                        if not isinstance(event, dict) or not isinstance(event.get("event"), str):
                            raise ValueError("not an object with an 'event' field")
                    except ValueError as exc:
                        violation = EngineProtocolViolation(f"unparseable line {raw[:200]!r}: {exc}")
                        log.error("engine pid %d: %s; killing it", self.pid, violation)
                        self._events.put(violation)
                        self.kill()
                        continue
                    self._route(event)
        except (OSError, ValueError):
            pass
        finally:
            with self._calls_lock:
                self._ended = True
                calls = list(self._calls.values())
            for call in calls:
                call.lines.put(_EOF)
            self._events.put(_EOF)

    def _route(self, event: dict) -> None:
        self._count_forward(event.get("n_forward"))
        request_id = event.get("id")
        if request_id is None:
            if event["event"] == "error":
                log.warning("engine pid %d answered a line without an id: %s", self.pid, event)
            self._events.put(event)
            return
        with self._calls_lock:
            call = self._calls.get(request_id)
        if call is None:
            log.warning("engine pid %d wrote a line for no request in flight: %s", self.pid, event)
            return
        call.lines.put(event)

    def _count_forward(self, n_forward: object) -> None:
        """The engine's cumulative count, from any line that carries it (lines of requests that ended
        unread too): its increase goes to on_forward."""
        if isinstance(n_forward, int) and not isinstance(n_forward, bool) and n_forward > self.n_forward:
            increase, self.n_forward = n_forward - self.n_forward, n_forward
            if self._on_forward is not None:
                self._on_forward(increase)

    def start(self, verb: str, argument: Mapping[str, Any] | None, slot: int | None) -> Call:
        """Send ``verb`` with a fresh id (and ``slot`` for the verbs acting on one); its lines go to the Call."""
        request_id = f"r{next(self._ids)}"
        call = Call(self, request_id, verb)
        fields = {**(argument or {}), "id": request_id}
        if slot is not None and verb in SLOT_VERBS:
            fields["slot"] = slot
        with self._calls_lock:
            self._calls[request_id] = call
            if self._ended:
                call.lines.put(_EOF)
                return call
        try:
            self.send(encode_command(verb, fields))
        except EngineDied:
            call.lines.put(_EOF)
        return call

    def forget(self, request_id: str) -> None:
        with self._calls_lock:
            self._calls.pop(request_id, None)

    def cancel(self, call: Call) -> None:
        if not call.cancel_sent:
            call.cancel_sent = True
            self.send(encode_command("CANCEL", {"id": call.id}))

    def send(self, line: str) -> None:
        assert "\n" not in line and "\r" not in line, "one command per line"
        stdin = self.proc.stdin
        assert stdin is not None
        try:
            with self._write_lock:
                stdin.write(line.encode("utf-8") + b"\n")
                stdin.flush()
        except (BrokenPipeError, OSError, ValueError) as exc:
            raise EngineDied(f"the engine's input is closed ({exc.__class__.__name__})") from None

    def next_event(self, timeout: float | None) -> dict | None:
        """The next line without an id (start-up), or None after ``timeout`` seconds; EngineDied at end of output."""
        try:
            item = self._events.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is _EOF:
            self._events.put(_EOF)
            raise EngineDied(self.describe_exit())
        if isinstance(item, Exception):
            raise item
        return item

    def close_input(self) -> None:
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
        except OSError:
            pass

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.pid, 9)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()

    def wait(self, timeout: float | None = None) -> int | None:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self.close_input()  # an exited engine reads nothing more: its pipe is closed, not left to the collector
        return code

    def describe_exit(self) -> str:
        code = self.wait(timeout=2.0)
        if code is None:
            return "the engine closed its output"
        return describe_exit_status(code)


def describe_exit_status(code: int) -> str:
    if code < 0:
        return f"killed by signal {-code}"
    try:
        meaning = ExitStatus(code).meaning
    except ValueError:
        meaning = "unknown status"
    return f"exit status {code}: {meaning}"


def encode_command(verb: str, argument: Mapping[str, Any] | str | None) -> str:
    if argument is None:
        return verb
    if isinstance(argument, str):
        return f"{verb} {argument}"
    # ASCII-only JSON: no raw line separators of any kind can reach the engine's line reader.
    return f"{verb} {json.dumps(argument, ensure_ascii=True, separators=(',', ':'))}"


class ProcessLease(EngineLease):
    """A lease on one slot of an engine process (or on none). A command left unfinished is finished
    (cancelled, read to its end) before the lease's next command and on release; one that never ends
    gets the engine killed, since it can no longer be trusted."""

    def __init__(
        self,
        slots: SlotManager | None,
        slot: int | None,
        process: EngineProcess,
        *,
        command_timeout_s: float | None,
        recover_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(slots, slot)
        self.process = process
        self.command_timeout_s = command_timeout_s
        self.recover_timeout_s = recover_timeout_s
        self._open: Call | None = None

    def request(
        self, verb: str, argument: Mapping[str, Any] | str | None = None, *, idle_s: float | None = None
    ) -> Iterator[dict]:
        assert not self._released, "request on a released lease"
        assert argument is None or isinstance(argument, Mapping), "protocol v2 arguments are JSON objects"
        self._recover()
        if verb in SLOT_VERBS:
            assert self.slot is not None, f"{verb} needs a lease on a slot"
        self._open = self.process.start(verb, argument, self.slot)
        return self._answers(self._open, idle_s)

    def _answers(self, call: Call, idle_s: float | None) -> Iterator[dict]:
        silent = 0.0
        limit = self.command_timeout_s  # None: a long silence (a huge prompt on a CPU) is legitimate
        step = min(x for x in (idle_s, limit) if x) if (idle_s or limit) else None
        while True:
            try:
                event = call.next_event(timeout=step)
            except EngineDied:
                self._close(call)
                raise
            if event is None:
                assert step is not None
                silent += step
                if limit is not None and silent >= limit:
                    self._close(call)
                    self.process.kill()
                    raise EngineDied(f"no answer for {limit:g} s; the engine was killed")
                if idle_s:
                    yield IDLE_EVENT
                continue
            silent = 0.0
            if event["event"] in TERMINAL_EVENTS:
                self._close(call)
                if (
                    event["event"] == "error"
                    and (event.get("error") or {}).get("type") == ErrorKind.FAIL_STOP
                ):
                    self.process.doomed = True  # exit 4 follows; the supervisor restarts it
                raise_for_error(event)
                yield event
                return
            yield event

    def _close(self, call: Call) -> None:
        call.done()
        if self._open is call:
            self._open = None

    def cancel(self) -> None:
        call = self._open
        if call is not None and call.verb in CANCELLABLE_VERBS:
            try:
                self.process.cancel(call)
            except EngineDied:
                pass  # its lines end with EngineDied too

    def _recover(self) -> None:
        """Finish a command whose answers were not read to the end (an early-closed stream)."""
        call = self._open
        if call is None:
            return
        try:
            self.cancel()
            deadline = time.monotonic() + self.recover_timeout_s
            while True:
                event = call.next_event(timeout=max(deadline - time.monotonic(), 0.0))
                if event is None:
                    self.process.kill()
                    raise EngineDied(
                        f"no terminal line for an unfinished {call.verb} within "
                        f"{self.recover_timeout_s:g} s; the engine was killed"
                    )
                if event["event"] in TERMINAL_EVENTS:
                    break
        finally:
            self._close(call)

    def _finish(self) -> None:
        try:
            self._recover()
        except EngineDied as exc:
            log.warning("an unfinished command could not be ended on release: %s", exc)
