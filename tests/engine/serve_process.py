"""`strata-engine serve` in a child process, driven line by line (the store verbs' tests)."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

TIMEOUT_S = 300  # a cap for a loaded machine; a healthy run takes seconds


class ServeProcess:
    def __init__(self, model: Path, *args: str, env: dict[str, str] | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "strata_engine.cli", "serve", "--model", str(model), *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, **(env or {})},
        )
        self.lines: queue.Queue[bytes | None] = queue.Queue()
        self.stderr: list[bytes] = []
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        self.ready = self.next_line()
        assert self.ready["event"] == "ready", self.ready

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def next_line(self) -> dict:
        raw = self.lines.get(timeout=TIMEOUT_S)
        assert raw is not None, "engine closed stdout; stderr: " + b"".join(self.stderr).decode(errors="replace")
        return json.loads(raw)

    def send(self, verb: str, argument: dict | str | None = None) -> None:
        line = verb if argument is None else f"{verb} {argument if isinstance(argument, str) else json.dumps(argument)}"
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def all_lines(self, verb: str, argument: dict | str | None = None) -> list[dict]:
        """Every line of one command, its terminal line last."""
        self.send(verb, argument)
        out = [self.next_line()]
        while out[-1]["event"] not in ("result", "error"):
            out.append(self.next_line())
        return out

    def command(self, verb: str, argument: dict | str | None = None) -> dict:
        """The terminal line of one command."""
        return self.all_lines(verb, argument)[-1]

    def result(self, verb: str, argument: dict | str | None = None) -> dict:
        answer = self.command(verb, argument)
        assert answer["event"] == "result", answer
        return answer

    def complete(self, prompt: list[int] | str, n_predict: int, **fields) -> dict:
        return self.result("COMPLETE", {"prompt": prompt, "n_predict": n_predict, "temperature": 0,
                                        "ignore_eos": True, **fields})

    def status(self, slot: int = 0) -> dict:
        return self.result("STATUS")["slots"][slot]

    def wait(self) -> int:
        return self.proc.wait(timeout=TIMEOUT_S)

    def quit(self) -> int:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b"QUIT\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
