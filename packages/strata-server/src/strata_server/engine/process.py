"""One engine child process: line I/O over its stdin/stdout, and the lease that drives it."""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from strata_engine.protocol import ErrorKind, ExitStatus

from ..errors import EngineDied, EngineProtocolViolation
from .client import IDLE_EVENT, TERMINAL_EVENTS, EngineLease, SlotGate, raise_for_error

log = logging.getLogger("strata_server.engine")

_EOF = object()


class EngineProcess:
    """The child process and a reader thread turning its stdout lines into parsed events.

    The child gets its own session, so a Ctrl-C at the terminal reaches the server (which QUITs the
    engine) rather than the engine directly. Its stderr is inherited: engine logs go to the server's.
    """

    def __init__(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        self.argv = list(argv)
        self._events: queue.Queue = queue.Queue()
        self._write_lock = threading.Lock()
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,
            env=dict(env) if env is not None else None, start_new_session=True, bufsize=0,
        )
        self.pid = self.proc.pid
        self.doomed = False  # it announced its exit (fail_stop): no new command may start on it
        self._reader = threading.Thread(target=self._read_lines, name=f"engine-stdout-{self.pid}", daemon=True)
        self._reader.start()

    def _read_lines(self) -> None:
        stdout = self.proc.stdout
        assert stdout is not None
        try:
            for raw in stdout:
                try:
                    event = json.loads(raw)
                    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
                        raise ValueError("not an object with an 'event' field")
                except ValueError as exc:
                    self._events.put(EngineProtocolViolation(f"unparseable line {raw[:200]!r}: {exc}"))
                    continue
                self._events.put(event)
        except (OSError, ValueError):
            pass
        finally:
            self._events.put(_EOF)

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
        """The next line, or None after ``timeout`` seconds of silence; EngineDied at end of output."""
        try:
            item = self._events.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is _EOF:
            self._events.put(_EOF)  # every later read sees the end too
            raise EngineDied(self.describe_exit())
        if isinstance(item, Exception):
            raise item
        return item

    def drain_stale(self) -> list[dict]:
        """Lines that arrived while no command was in flight (the protocol has none; log them)."""
        stale = []
        while True:
            try:
                item = self._events.get_nowait()
            except queue.Empty:
                return stale
            if item is _EOF:
                self._events.put(_EOF)
                return stale
            stale.append(item)

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
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

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
    """A lease on one engine process. A command left unfinished is finished (or the engine killed)
    before the next command and on release, so the channel never falls out of step."""

    def __init__(self, gate: SlotGate, process: EngineProcess, *, command_timeout_s: float | None,
                 recover_timeout_s: float = 30.0) -> None:
        super().__init__(gate)
        self.process = process
        self.command_timeout_s = command_timeout_s
        self.recover_timeout_s = recover_timeout_s
        self._open_verb: str | None = None
        self._cancel_sent = False

    def request(self, verb: str, argument: Mapping[str, Any] | str | None = None, *,
                idle_s: float | None = None) -> Iterator[dict]:
        assert not self._released, "request on a released lease"
        self._recover()
        for stale in self.process.drain_stale():
            log.warning("engine wrote a line outside any command: %s", stale)
        self.process.send(encode_command(verb, argument))
        self._open_verb = verb
        self._cancel_sent = False
        return self._answers(idle_s)

    def _answers(self, idle_s: float | None) -> Iterator[dict]:
        silent = 0.0
        limit = self.command_timeout_s  # None: a long silence (a huge prompt on a CPU) is legitimate
        step = min(x for x in (idle_s, limit) if x) if (idle_s or limit) else None
        while True:
            try:
                event = self.process.next_event(timeout=step)
            except EngineProtocolViolation:
                self._open_verb = None
                self.process.kill()
                raise
            except EngineDied:
                self._open_verb = None
                raise
            if event is None:
                assert step is not None
                silent += step
                if limit is not None and silent >= limit:
                    self._open_verb = None
                    self.process.kill()
                    raise EngineDied(f"no answer for {limit:g} s; the engine was killed")
                if idle_s:
                    yield IDLE_EVENT
                continue
            silent = 0.0
            if event["event"] in TERMINAL_EVENTS:
                self._open_verb = None
                if event["event"] == "error" and (event.get("error") or {}).get("type") == ErrorKind.FAIL_STOP:
                    self.process.doomed = True  # exit 4 follows; the supervisor restarts it
                raise_for_error(event)
                yield event
                return
            yield event

    def cancel(self) -> None:
        if self._open_verb == "COMPLETE" and not self._cancel_sent:
            self._cancel_sent = True
            self.process.send("CANCEL")

    def _recover(self) -> None:
        """Finish a command whose answers were not read to the end (an early-closed stream)."""
        if self._open_verb is None:
            return
        verb = self._open_verb
        try:
            if verb == "COMPLETE":
                self.cancel()
            while True:
                event = self.process.next_event(timeout=self.recover_timeout_s)
                if event is None:
                    raise EngineDied(f"no terminal line for an unfinished {verb} within "
                                     f"{self.recover_timeout_s:g} s; the engine was killed")
                if event["event"] in TERMINAL_EVENTS:
                    break
        except (EngineDied, EngineProtocolViolation):
            self.process.kill()
            raise
        finally:
            self._open_verb = None

    def _finish(self) -> None:
        try:
            self._recover()
        except (EngineDied, EngineProtocolViolation) as exc:
            log.warning("engine channel could not be recovered on release: %s", exc)
