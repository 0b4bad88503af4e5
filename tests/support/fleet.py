"""A fleet on loopback for tests and the soak (bench/soak_fleet.py): strata-servers behind a real HAProxy
(Debian's `haproxy`), started with a config of its own: round robin, health checks on /health, a dead
server's connection retried on another, and each reply naming the server that answered it (the
``X-Strata-Server`` header). Its admin socket tells which servers HAProxy holds up."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import requests

from .server_process import LOOPBACK, free_port

SERVED_BY = "X-Strata-Server"  # the response header HAProxy sets to the name of the server that answered
CHECK_INTERVAL_MS = 300  # a dead server is taken out after FALL checks (~0.6 s), back after RISE
FALL = 2
RISE = 2

CONFIG = """\
global
    maxconn 512
    stats socket {socket} mode 600 level admin

defaults
    mode http
    timeout connect 2s
    timeout client 600s
    timeout server 600s
    timeout check 2s
    # A connection refused (a server just killed, not yet seen down) is tried again on another server;
    # a request already sent is never sent twice (a POST may have been answered).
    retries 3
    option redispatch 1

frontend fleet
    bind {host}:{port}
    default_backend strata

backend strata
    balance roundrobin
    # HTTP/1.1 with a Host header: strata-server refuses a request without one (its Host check).
    option httpchk
    http-check send meth GET uri /health ver HTTP/1.1 hdr Host {host}
    http-check expect status 200
    http-response set-header {served_by} %[srv_name]
    default-server inter {inter}ms fall {fall} rise {rise}
{servers}
"""


def haproxy_binary() -> str | None:
    return shutil.which("haproxy")


def haproxy_config(port: int, backends: dict[str, int], admin_socket: Path) -> str:
    """HAProxy's config for `backends` (name -> loopback port) behind `port`."""
    servers = "\n".join(f"    server {name} {LOOPBACK}:{p} check" for name, p in backends.items())
    return CONFIG.format(
        socket=admin_socket,
        host=LOOPBACK,
        port=port,
        served_by=SERVED_BY,
        inter=CHECK_INTERVAL_MS,
        fall=FALL,
        rise=RISE,
        servers=servers,
    )


class HAProxy:
    """`haproxy` in the foreground in `workdir` (its config, admin socket and log there)."""

    def __init__(self, workdir: Path, backends: dict[str, int]) -> None:
        self.workdir = workdir
        self.backends = backends
        self.port = free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self.admin_socket = workdir / "haproxy.sock"
        self.config_path = workdir / "haproxy.cfg"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> HAProxy:
        binary = haproxy_binary()
        if binary is None:
            raise RuntimeError("haproxy is not installed (apt-get install -y haproxy)")
        self.config_path.write_text(haproxy_config(self.port, self.backends, self.admin_socket))
        check = subprocess.run([binary, "-c", "-f", str(self.config_path)], capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"haproxy refused its config:\n{check.stdout}{check.stderr}")
        self._log = open(self.workdir / "haproxy.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [binary, "-db", "-f", str(self.config_path)], stdout=self._log, stderr=subprocess.STDOUT
        )
        self.wait_up(set(self.backends), timeout)
        return self

    def status(self) -> dict[str, str]:
        """Each server's state as HAProxy holds it ("UP" once checked, "DOWN", ...), from `show stat` on its
        admin socket."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as admin:
            admin.connect(str(self.admin_socket))
            admin.sendall(b"show stat\n")
            data = b""
            while chunk := admin.recv(1 << 16):
                data += chunk
        lines = data.decode().splitlines()
        header = lines[0].lstrip("# ").split(",")
        rows = [dict(zip(header, line.split(","), strict=False)) for line in lines[1:] if line]
        # A server is up once a check passed (HAProxy starts every server up, before its first check).
        return {
            r["svname"]: r["status"] if r["check_status"] == "L7OK" else f"{r['status']} {r['check_status']}"
            for r in rows
            if r["pxname"] == "strata" and r["svname"] in self.backends
        }

    def wait_up(self, names: set[str], timeout: float = 30.0) -> None:
        """Until HAProxy holds exactly `names` up (the others down)."""
        deadline = time.monotonic() + timeout
        state: dict[str, str] = {}
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"haproxy exited with {self.proc.returncode}: {self.log()}")
            try:
                state = self.status()
            except OSError:
                state = {}  # not listening on its socket yet
            if state and {n for n, s in state.items() if s == "UP"} == names:
                return
            time.sleep(0.05)
        raise AssertionError(f"HAProxy does not hold {sorted(names)} up after {timeout} s: {state}")

    def log(self) -> str:
        path = self.workdir / "haproxy.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None
        self._log.close()


def served_by(response: requests.Response) -> str:
    """The name of the fleet's server that answered (HAProxy's header)."""
    return response.headers[SERVED_BY]
