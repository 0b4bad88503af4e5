"""The real gunicorn entry with the fake engine process: boot, serve, engine kill -9 mid-stream,
graceful shutdown that QUITs the engine, and a server that stops when the engine cannot start."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import psutil
import pytest
import requests
from support.server_process import ServerProcess

from .fake_engine import FAKE_ENGINE_PATH as FAKE_ENGINE

pytestmark = pytest.mark.timeout(120)


def engine_command(*extra: str) -> str:
    return " ".join([sys.executable, str(FAKE_ENGINE), "serve", *extra])


@pytest.fixture
def server(tmp_path, fake_model, slot_dir):
    pid_file = tmp_path / "engine-pids"
    proc = ServerProcess(
        "--model",
        str(fake_model),
        "--engine-command",
        engine_command("--token-delay", "0.01", "--pid-file", str(pid_file)),
        "--slot-save-path",
        str(slot_dir),
        "--metrics",
        log_path=tmp_path / "server.log",
    ).start(60)
    proc.pid_file = pid_file
    yield proc
    proc.stop()


def engine_pids(server) -> list[int]:
    return [int(p) for p in server.pid_file.read_text().split()]


def test_serves_and_quits_engine_on_sigterm(server):
    body = requests.post(server.url + "/completion", json={"prompt": "hi", "n_predict": 3}, timeout=30).json()
    assert body["tokens_predicted"] == 3
    engine = psutil.Process(engine_pids(server)[-1])
    assert server.stop(signal.SIGTERM) == 0
    engine.wait(10)  # the engine exited (QUIT), not orphaned
    assert "stopping the engine" in server.log()


def test_engine_kill_9_mid_stream(server):
    with requests.post(
        server.url + "/completion",
        json={"prompt": "go", "n_predict": 2000, "stream": True},
        stream=True,
        timeout=30,
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        first = next(line for line in lines if line)
        assert json.loads(first[len(b"data: ") :])["stop"] is False
        os.kill(engine_pids(server)[-1], signal.SIGKILL)
        rest = [line for line in lines if line]
    error = json.loads(rest[-1][len(b"data: ") :])["error"]
    assert error["code"] == 500 and error["type"] == "server_error" and "restarted" in error["message"]
    deadline = time.monotonic() + 30
    while requests.get(server.url + "/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert len(engine_pids(server)) == 2
    after = requests.post(server.url + "/completion", json={"prompt": "again", "n_predict": 2}, timeout=30)
    assert after.status_code == 200
    metrics = requests.get(server.url + "/metrics", timeout=10).text
    assert "strata:engine_restarts_total 1" in metrics


def test_server_stops_when_engine_cannot_load(tmp_path, fake_model):
    proc = ServerProcess(
        "--model",
        str(fake_model),
        "--engine-command",
        engine_command("--fail-load"),
        log_path=tmp_path / "server.log",
    ).start(wait_healthy=0)
    code = proc.proc.wait(60)
    proc.stop()
    assert code == 3
    assert "cannot load model" in proc.log()


def test_pings_while_prompt_is_slow_then_disconnect_cancels(tmp_path, fake_model):
    proc = ServerProcess(
        "--model",
        str(fake_model),
        "--sse-ping-interval",
        "0.2",
        "--engine-command",
        engine_command("--prompt-delay", "0.7", "--token-delay", "0.02"),
        log_path=tmp_path / "server.log",
    ).start(60)
    try:
        with requests.post(
            proc.url + "/completion",
            json={"prompt": "slow", "n_predict": 5, "stream": True},
            stream=True,
            timeout=30,
        ) as response:
            frames = response.content.decode().split("\n\n")
        assert frames[0] == ":"  # a keep-alive while the prompt is evaluated (0.7 s, pings every 0.2 s)
        assert json.loads(frames[-2][6:])["stop"] is True
        # A client that goes away mid-stream: the generation is cancelled, the slot freed at once.
        response = requests.post(
            proc.url + "/completion",
            json={"prompt": "x", "n_predict": 100000, "stream": True},
            stream=True,
            timeout=30,
        )
        next(line for line in response.iter_lines() if line and line != b":")
        response.close()
        started = time.monotonic()
        after = requests.post(proc.url + "/tokenize", json={"content": "hi"}, timeout=30)
        assert after.status_code == 200 and time.monotonic() - started < 5
    finally:
        assert proc.stop() == 0


def test_concurrent_requests_take_turns(server):
    import threading

    results = []

    def one(prompt: str) -> None:
        results.append(
            requests.post(
                server.url + "/completion",
                json={"prompt": prompt, "n_predict": 30, "ignore_eos": True},
                timeout=60,
            )
        )

    threads = [threading.Thread(target=one, args=(p,)) for p in ("first", "second", "third")]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [r.status_code for r in results] == [200, 200, 200]
    assert time.monotonic() - started >= 3 * 30 * 0.01  # one slot: they ran one after another
    assert all(r.json()["tokens_predicted"] == 30 for r in results)


def test_listens_on_every_host_given(tmp_path, fake_model):
    proc = ServerProcess(
        "--model",
        str(fake_model),
        "--host",
        "::1",
        "--engine-command",
        engine_command(),
        log_path=tmp_path / "server.log",
    ).start(60)
    try:
        for url in (proc.url, f"http://[::1]:{proc.port}"):  # --host 127.0.0.1 (ServerProcess's) and ::1
            assert requests.get(url + "/health", timeout=10).json() == {"status": "ok"}, url
    finally:
        assert proc.stop() == 0
