"""Run a real ``strata-server`` (gunicorn) as a child process on a free loopback port, for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

LOOPBACK = "127.0.0.1"


def metrics(url: str) -> dict[str, float]:
    """A server's /metrics samples by name (labels included)."""
    text = requests.get(url + "/metrics", timeout=30).text
    return {
        name: float(value)
        for name, value in (
            line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
        )
    }


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


class ServerProcess:
    def __init__(
        self,
        *flags: str,
        log_path: Path,
        port: int | None = None,
        env: dict[str, str] | None = None,
        own_group: bool = False,
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self.argv = [
            sys.executable,
            "-m",
            "strata_server.cli",
            "--host",
            LOOPBACK,
            "--port",
            str(self.port),
            *flags,
        ]
        self.log_path = log_path
        self.env = {**os.environ, **env} if env else None
        self.own_group = (
            own_group  # a process group of its own: kill() ends gunicorn, worker and engine at once
        )
        self.proc: subprocess.Popen | None = None

    def start(self, wait_healthy: float = 120.0) -> ServerProcess:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=self.own_group,
        )
        if wait_healthy:
            try:
                self.wait_healthy(wait_healthy)
            except BaseException:
                self.stop()  # a server that never became healthy is not left running (nor its log open)
                raise
        return self

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except (requests.ConnectionError, requests.Timeout):
                pass  # not listening yet, or too busy to answer within 2 s (a loaded machine)
            time.sleep(0.1)
        raise AssertionError(f"server not healthy after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 40.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            code = self.proc.wait(10)
        self._log.close()
        return code

    def kill(self) -> int:
        """SIGKILL to the server's whole process group (own_group): gunicorn, its worker and the engine die at
        once, as on a crashed machine; nothing of it runs on."""
        assert self.proc is not None and self.own_group
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        code = self.proc.wait(10)
        self._log.close()
        return code
