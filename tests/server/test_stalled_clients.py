"""Stalled and slow clients through the real gunicorn entry (worker.py): requests are read by the
worker's event loop, so clients that send half a request hold no thread and are closed after the read
timeout, while /health, /slots and completions keep answering."""

from __future__ import annotations

import sys
import time

import pytest
import requests
from support.server_process import ServerProcess
from support.stalled import REST, half_requests

from .fake_engine import FAKE_ENGINE_PATH as FAKE_ENGINE

pytestmark = pytest.mark.timeout(120)

STALLED = 256  # 8x the HTTP threads (32): before worker.py, 32 of these made /health time out


def start_server(tmp_path, fake_model, *flags: str) -> ServerProcess:
    engine = " ".join([sys.executable, str(FAKE_ENGINE), "serve"])
    return ServerProcess(
        "--model", str(fake_model), "--engine-command", engine, *flags, log_path=tmp_path / "server.log"
    ).start(60)


@pytest.mark.parametrize("body", [False, True], ids=["half-head", "head-without-body"])
def test_stalled_connections_do_not_hold_the_server(tmp_path, fake_model, body):
    server = start_server(tmp_path, fake_model, "-np", "2")  # the slots server (spec/http-api.md section 7)
    stalled = half_requests(server.port, STALLED, body)
    try:
        time.sleep(0.5)  # gthread gave a thread to each connection whose first bytes arrived
        started = time.monotonic()
        assert requests.get(server.url + "/health", timeout=10).status_code == 200
        assert [s["id"] for s in requests.get(server.url + "/slots", timeout=10).json()] == [0, 1]
        answer = requests.post(server.url + "/completion", json={"prompt": "hi", "n_predict": 2}, timeout=10)
        assert answer.status_code == 200 and answer.json()["tokens_predicted"] == 2
        print(
            f"/health, /slots and a completion with {STALLED} stalled connections: "
            f"{time.monotonic() - started:.3f} s"
        )
        # The stalled requests still complete when their bytes arrive.
        stalled[0].sendall(REST[body])
        assert stalled[0].recv(12) == b"HTTP/1.1 200"
    finally:
        for sock in stalled:
            sock.close()
        server.stop()


def test_requests_not_complete_within_the_read_timeout_are_closed(tmp_path, fake_model):
    server = start_server(tmp_path, fake_model, "-np", "2", "--timeout", "2")
    stalled = half_requests(server.port, STALLED // 2, body=False) + half_requests(
        server.port, STALLED // 2, body=True
    )
    try:
        started = time.monotonic()
        for sock in stalled:
            assert sock.recv(100) == b""  # closed by the server, no response
        waited = time.monotonic() - started
        assert 1.0 <= waited < 9.0, waited
        assert requests.get(server.url + "/health", timeout=10).status_code == 200
        assert "was not complete within 2s" in server.log()
    finally:
        for sock in stalled:
            sock.close()
        server.stop()


def test_the_read_timeout_is_stated_in_help():
    from strata_server.cli import build_parser

    assert "read timeout" in build_parser().format_help()


@pytest.mark.parametrize(
    ("data", "complete"),
    [
        (b"GET / HTTP/1.1\r\nHost: a\r\n", False),
        (b"GET / HTTP/1.1\r\nHost: a\r\n\r\n", True),
        (b"POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\nabcd", False),
        (b"POST / HTTP/1.1\r\ncontent-length:5\r\n\r\nabcde", True),
        (b"POST / HTTP/1.1\r\nContent-Length: 999999\r\n\r\n", True),  # over the limit: the app refuses it
        (b"POST / HTTP/1.1\r\nContent-Length: x\r\n\r\n", True),  # the parser refuses it
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n", False),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n", True),
        (b"GET /" + b"a" * 70000, True),  # an oversized head: gunicorn's parser refuses it
    ],
)
def test_request_complete(data, complete):
    from strata_server.worker import request_complete

    assert request_complete(data, body_limit=1000) is complete
