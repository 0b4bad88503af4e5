"""A client that goes away cancels its work: a raw socket closed mid-request, streamed and not, through a
real strata-server (gunicorn, the real engine and model); the slot is idle right after. An embeddings
request stops too (its EMBED cancelled, its other inputs never sent), which /metrics' n_decode_total (the
engine's own count of forward passes) shows."""

from __future__ import annotations

import json
import math
import socket
import time

import pytest
import requests
from support.server_process import metrics

from .servers import start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = "<|im_start|>user\nWrite a very long story about a dragon.<|im_end|>\n<|im_start|>assistant\n"
# Runs to the end of the 2,048-token context unless cancelled (about 11 s on this model and machine).
ENDLESS = {"prompt": PROMPT, "n_predict": -1, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(module_tmp):
    proc = start_server(module_tmp, "--metrics", "--embedding", "--pooling", "mean")
    # The engine's first forward pass is slow (one-time work) and a CANCEL waits for the step in progress.
    requests.post(
        proc.url + "/completion", json={"prompt": PROMPT, "n_predict": 1}, timeout=120
    ).raise_for_status()
    yield proc
    assert proc.stop() == 0


def raw_post(server, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def slot(server) -> dict:
    return requests.get(server.url + "/slots", timeout=10).json()[0]


def wait_for(predicate, timeout: float) -> float:
    """Seconds until ``predicate()`` held; fails after ``timeout``."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, "timed out"
        time.sleep(0.02)
    return time.monotonic() - started


def metric(server, name: str) -> int:
    return int(metrics(server.url)[name])


def tokens_decoded(server) -> int:
    return metric(server, "llamacpp:tokens_predicted_total")


def forward_passes(server) -> int:
    return metric(server, "llamacpp:n_decode_total")


def settled(read, quiet_s: float, timeout: float) -> int:
    """read()'s value once it has not changed for quiet_s seconds; fails after ``timeout``."""
    started = time.monotonic()
    value, since = read(), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() - started < timeout, "never settled"
        time.sleep(0.2)
        if (now := read()) != value:
            value, since = now, time.monotonic()
    return value


def assert_cancelled_soon(server, before: int) -> None:
    idle_after = wait_for(lambda: not slot(server)["is_processing"], timeout=30)
    # A few decode steps (tens of ms each here; seconds on a loaded shared machine), not the ~11 s run.
    assert idle_after < 5.0, f"the slot stayed busy {idle_after:.2f} s after the client left"
    last = slot(server)
    decoded = tokens_decoded(server) - before
    assert 0 < decoded < 1000, decoded  # cut short, far from the 2,048-token context
    assert (last["next_token"][0]["n_remain"], last["next_token"][0]["n_decoded"]) == (-1, 0)  # idle
    # The engine serves the next request.
    after = requests.post(server.url + "/completion", json={"prompt": "Hi", "n_predict": 2}, timeout=60)
    assert after.status_code == 200 and after.json()["tokens_predicted"] == 2


def test_non_streamed_request_cancelled_when_client_closes(server):
    before = tokens_decoded(server)
    sock = raw_post(server, "/completion", ENDLESS)
    wait_for(lambda: slot(server)["is_processing"], timeout=30)
    time.sleep(1.0)  # well into the generation
    sock.close()
    assert_cancelled_soon(server, before)


def test_streamed_request_cancelled_when_client_closes(server):
    before = tokens_decoded(server)
    sock = raw_post(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": -1,
            "ignore_eos": True,
            "stream": True,
        },
    )
    received = b""
    while b"data: " not in received:
        received += sock.recv(4096)
    assert received.startswith(b"HTTP/1.1 200")
    sock.close()
    assert_cancelled_soon(server, before)


def test_request_abandoned_while_waiting_for_the_slot_never_runs(server):
    running = raw_post(server, "/completion", ENDLESS)
    wait_for(lambda: slot(server)["is_processing"], timeout=30)
    waiting = raw_post(server, "/completion", {**ENDLESS, "n_predict": 1500})
    wait_for(
        lambda: (
            requests.get(server.url + "/metrics", timeout=10).text.count("llamacpp:requests_deferred 1") == 1
        ),
        timeout=30,
    )
    waiting.close()
    running.close()
    wait_for(lambda: not slot(server)["is_processing"], timeout=30)
    time.sleep(0.5)
    last = slot(server)
    assert not last["is_processing"] and last["params"]["n_predict"] == -1  # the first one's, cancelled


CHUNK = 512  # the numpy backend's default --prefill-chunk
LONG_INPUT = "The quick brown fox jumps over the lazy dog. " * 160  # about 1,600 tokens: 4 chunks


def test_every_forward_pass_is_in_n_decode_total(server):
    before = forward_passes(server)
    done = requests.post(
        server.url + "/completion",
        json={"prompt": PROMPT, "n_predict": 5, "cache_prompt": False, "temperature": 0},
        timeout=120,
    ).json()
    # the prompt's chunks, then a decode pass per generated token but the last (never evaluated)
    completion = math.ceil(done["timings"]["prompt_n"] / CHUNK) + done["tokens_predicted"] - 1
    assert forward_passes(server) - before == completion
    embedded = requests.post(
        server.url + "/v1/embeddings", json={"input": [LONG_INPUT, "short"]}, timeout=120
    )
    assert embedded.status_code == 200, embedded.text
    n_tokens = [
        len(
            requests.post(
                server.url + "/tokenize", json={"content": text, "add_special": True}, timeout=30
            ).json()["tokens"]
        )
        for text in (LONG_INPUT, "short")
    ]
    assert sum(n_tokens) == embedded.json()["usage"]["prompt_tokens"]
    assert forward_passes(server) - before == completion + sum(math.ceil(n / CHUNK) for n in n_tokens)


def test_embeddings_request_stopped_when_client_closes(server):
    n_inputs = 12
    per_input = math.ceil(
        len(
            requests.post(
                server.url + "/tokenize", json={"content": LONG_INPUT, "add_special": True}, timeout=30
            ).json()["tokens"]
        )
        / CHUNK
    )
    before = forward_passes(server)
    sock = raw_post(
        server, "/v1/embeddings", {"input": [LONG_INPUT] * n_inputs}
    )  # 48 passes, tens of seconds
    time.sleep(1.5)  # a few chunks in
    sock.close()
    wait_for(lambda: forward_passes(server) > before, timeout=30)  # the cancelled EMBED's error line came
    abandoned = settled(lambda: forward_passes(server), quiet_s=3.0, timeout=60) - before
    assert 0 < abandoned < n_inputs * per_input // 2, abandoned  # cut short
    # Nothing of it runs any more: the next request's passes are its own, exactly.
    alone = requests.post(server.url + "/v1/embeddings", json={"input": LONG_INPUT}, timeout=120)
    assert alone.status_code == 200, alone.text
    assert forward_passes(server) - before == abandoned + per_input
