"""A client of `strata-engine serve` in a child process, line by line (spec/engine-protocol.md): what tests and
benchmarks drive the engine process with. Its lines are read on a thread of their own, so a command's
answer is waited for with a timeout, and the process's stderr is kept for the message of a failure."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from .errors import EngineProcessError
from .protocol import TERMINAL_EVENTS

TIMEOUT_S = 300.0  # a cap for a loaded machine; a healthy command takes seconds


def command_line(verb: str | bytes, argument: Mapping[str, Any] | str | None = None) -> bytes:
    """One command line (its newline included): the verb, then its object (given as JSON text or encoded)."""
    head = verb if isinstance(verb, bytes) else verb.encode()
    if argument is None:
        return head + b"\n"
    text = argument if isinstance(argument, str) else json.dumps(argument)
    return head + b" " + text.encode() + b"\n"


class EngineProcess:
    """`strata-engine serve --model MODEL ARGS` (the environment with `env` added); `ready` is its first line
    (the ready line; a `fatal` one only with `expect_ready=False`)."""

    def __init__(
        self,
        model: str | os.PathLike[str],
        *args: str,
        env: Mapping[str, str] | None = None,
        timeout_s: float = TIMEOUT_S,
        expect_ready: bool = True,
    ):
        self.timeout_s = timeout_s
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "strata_engine.cli", "serve", "--model", str(model), *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
        # all three asked for as pipes
        assert self.proc.stdin is not None and self.proc.stdout is not None and self.proc.stderr is not None
        self._stdin, self._stdout, stderr = self.proc.stdin, self.proc.stdout, self.proc.stderr
        self.lines: queue.Queue[bytes | None] = queue.Queue()
        self.stderr: list[bytes] = []
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._keep_stderr, args=(stderr,), daemon=True).start()
        self.ready = self.next_line()
        if expect_ready and self.ready["event"] != "ready":
            raise EngineProcessError(f"the engine did not start: {self.ready}")

    def _pump(self) -> None:
        with self._stdout:  # closed at the pipe's end, not left to the collector (a ResourceWarning)
            for line in self._stdout:
                self.lines.put(line)
        self.lines.put(None)

    def _keep_stderr(self, stderr: IO[bytes]) -> None:
        with stderr:
            self.stderr.extend(stderr)

    def _exited(self, status: int) -> int:
        """The exit status, the process's stdin closed (its reader is gone)."""
        with contextlib.suppress(BrokenPipeError):  # every command was flushed when sent: nothing is lost
            self._stdin.close()
        return status

    def stderr_text(self) -> str:
        return b"".join(self.stderr).decode(errors="replace")

    def next_line(self) -> dict:
        raw = self.lines.get(timeout=self.timeout_s)
        if raw is None:
            raise EngineProcessError(
                f"the engine closed stdout (exit status {self.proc.wait(timeout=30)}); "
                f"stderr: {self.stderr_text()}"
            )
        if not raw.endswith(b"\n"):
            raise EngineProcessError(f"a line without its newline: {raw[:80]!r}")
        return json.loads(raw)

    def send(self, verb: str | bytes, argument: Mapping[str, Any] | str | None = None) -> None:
        self._stdin.write(command_line(verb, argument))
        self._stdin.flush()

    def until_terminal(self) -> list[dict]:
        """The lines up to the next terminal line (`result` or `error`), it last."""
        out = [self.next_line()]
        while out[-1]["event"] not in TERMINAL_EVENTS:
            out.append(self.next_line())
        return out

    def all_lines(self, verb: str | bytes, argument: Mapping[str, Any] | str | None = None) -> list[dict]:
        """Every line of one command, its terminal line last."""
        self.send(verb, argument)
        return self.until_terminal()

    def command(self, verb: str | bytes, argument: Mapping[str, Any] | str | None = None) -> dict:
        """The terminal line of one command."""
        return self.all_lines(verb, argument)[-1]

    def result(self, verb: str | bytes, argument: Mapping[str, Any] | str | None = None) -> dict:
        """The `result` line of one command; an `error` line raises."""
        answer = self.command(verb, argument)
        if answer["event"] != "result":
            raise EngineProcessError(f"{verb!s} failed: {answer['error']}")
        return answer

    def complete(self, prompt: list[int] | str, n_predict: int, **fields: Any) -> dict:
        """A greedy COMPLETE's result (past end-of-generation tokens, `fields` added)."""
        return self.result(
            "COMPLETE",
            {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "ignore_eos": True, **fields},
        )

    def status(self, slot: int = 0) -> dict:
        return self.result("STATUS")["slots"][slot]

    def memory(self, key: str) -> int:
        """A /proc/PID/status size of the process in bytes (`VmRSS`, `VmHWM`: its peak)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    def reset_peak(self) -> bool:
        """Set the process's peak (`VmHWM`) to its resident size now, where the kernel allows."""
        try:
            Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")
        except OSError:
            return False
        return True

    def wait(self) -> int:
        return self._exited(self.proc.wait(timeout=self.timeout_s))

    def quit(self) -> int:
        """QUIT (requests in flight end first); the exit status."""
        if self.proc.poll() is None:
            try:
                self.send("QUIT")
            except BrokenPipeError:
                pass
        try:
            return self._exited(self.proc.wait(timeout=60))
        except subprocess.TimeoutExpired:
            return self.close()

    def close(self) -> int:
        """Kill the process (if it runs); the exit status."""
        if self.proc.poll() is None:
            self.proc.kill()
        return self._exited(self.proc.wait(timeout=30))
