"""Scenarios of a server started with ``--parallel N``, run over HTTP against a real strata-server (with
the fake engine process in tests/server, the real engine and model in tests/e2e)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable

import requests

TIMEOUT = 300


def stream_tokens(
    url: str,
    body: dict,
    on_first: Callable[[], None] | None = None,
    on_count: tuple[int, Callable[[], None]] | None = None,
) -> tuple[list[int], dict]:
    """A streamed ``/completion``: every token id of its chunks, and its final chunk. on_count = (n, call): call()
    once n tokens have arrived."""
    tokens: list[int] = []
    final: dict = {}
    with requests.post(
        url + "/completion",
        json={**body, "stream": True, "return_tokens": True},
        stream=True,
        timeout=TIMEOUT,
    ) as response:
        assert response.status_code == 200, response.text
        for line in response.iter_lines():
            if not line.startswith(b"data: "):
                continue
            chunk = json.loads(line[len(b"data: ") :])
            assert "error" not in chunk, chunk
            if chunk["stop"]:
                final = chunk
                break
            tokens += chunk["tokens"]
            if on_first is not None and tokens:
                on_first()
                on_first = None
            if on_count is not None and len(tokens) >= on_count[0]:
                on_count[1]()
                on_count = None
    if final:  # every token the engine generated went out in the stream (an EOS among them)
        assert len(tokens) == final["tokens_predicted"], (len(tokens), final["tokens_predicted"])
    return tokens, final


def run_threads(targets: list[Callable[[], None]]) -> None:
    threads = [threading.Thread(target=target) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
        assert not thread.is_alive(), "a request did not finish"


def concurrent_streams_match_solo(url: str, prompts: list[str], n_predict: int) -> list[list[int]]:
    """Each prompt's greedy tokens streamed alone, then all at once: the same tokens for each."""
    body = {"n_predict": n_predict, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    alone = [stream_tokens(url, {**body, "prompt": p})[0] for p in prompts]
    together: list[list[int] | None] = [None] * len(prompts)

    def one(i: int) -> Callable[[], None]:
        def run() -> None:
            together[i] = stream_tokens(url, {**body, "prompt": prompts[i]})[0]

        return run

    run_threads([one(i) for i in range(len(prompts))])
    assert all(len(t) == n_predict for t in alone)
    assert together == alone
    return alone


def staggered_streams_match_solo(url: str, prompts: list[str], n_predict: int, every: int) -> list[list[int]]:
    """Each prompt's greedy tokens streamed alone, then together with prompt i + 1 sent once prompt i has streamed
    `every` tokens (arriving mid-way through the others' replies, its prompt's chunks between their steps): the
    same tokens for each (batch invariance)."""
    body = {"n_predict": n_predict, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    alone = [stream_tokens(url, {**body, "prompt": p})[0] for p in prompts]
    together: list[list[int] | None] = [None] * len(prompts)
    sent = [threading.Event() for _ in prompts]
    sent[0].set()

    def one(i: int) -> Callable[[], None]:
        def run() -> None:
            assert sent[i].wait(TIMEOUT), f"prompt {i} was never sent"
            after = (every, sent[i + 1].set) if i + 1 < len(prompts) else None
            together[i] = stream_tokens(url, {**body, "prompt": prompts[i]}, on_count=after)[0]

        return run

    run_threads([one(i) for i in range(len(prompts))])
    assert all(len(t) == n_predict for t in alone)
    for i, (a, t) in enumerate(zip(alone, together, strict=True)):
        differs = [j for j, (x, y) in enumerate(zip(a, t or [], strict=False)) if x != y]
        assert t == a, f"prompt {i}: {len(t or [])} tokens, the first difference at token {differs[:1]}"
    return alone


def restore_under_load_continues_exactly(
    url: str, filename: str, prompt: str, others: list[str], n_predict: int
) -> None:
    """A conversation in slot 0 saved after its first turn; its second turn answered from the held conversation
    (never restarted), then again after the file is restored into slot 0 while the other slots stream: the same
    tokens and the same reused prefix (batch invariance across a restore)."""
    body = {"n_predict": n_predict, "temperature": 0, "ignore_eos": True, "id_slot": 0}
    first, _ = stream_tokens(url, {**body, "prompt": prompt})
    saved = requests.post(
        url + "/slots/0", params={"action": "save"}, json={"filename": filename}, timeout=TIMEOUT
    )
    assert saved.status_code == 200, saved.text
    turn = {**body, "prompt": [*tokenize(url, prompt), *first, *tokenize(url, " Go on.")]}
    held, held_final = stream_tokens(url, turn)
    streaming = threading.Event()
    restored: dict = {}

    def other(i: int) -> Callable[[], None]:
        def run() -> None:
            stream_tokens(url, {**body, "id_slot": i + 1, "prompt": others[i], "n_predict": 3 * n_predict},
                          on_first=streaming.set)  # fmt: skip

        return run

    def restore_and_answer() -> None:
        assert streaming.wait(TIMEOUT)
        answer = requests.post(url + "/slots/0", params={"action": "restore"}, json={"filename": filename},
                               timeout=TIMEOUT)  # fmt: skip
        assert answer.status_code == 200, answer.text
        restored["tokens"], restored["final"] = stream_tokens(url, turn)

    run_threads([*(other(i) for i in range(len(others))), restore_and_answer])
    assert restored["tokens"] == held
    assert restored["final"]["timings"]["cache_n"] == held_final["timings"]["cache_n"] > 0


def tokenize(url: str, text: str) -> list[int]:
    response = requests.post(url + "/tokenize", json={"content": text}, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def raw_stream(host: str, port: int, body: dict) -> socket.socket:
    """A streamed /completion on a raw socket (closing it is a client going away); returns once its first
    token chunk arrived."""
    data = json.dumps({**body, "stream": True}).encode()
    sock = socket.create_connection((host, port), timeout=TIMEOUT)
    sock.sendall(
        f"POST /completion HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    received = b""
    while b'"stop": false' not in received:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the stream"
        received += chunk
    return sock


def slots(url: str) -> list[dict]:
    return requests.get(url + "/slots", timeout=30).json()


def wait_for(predicate: Callable[[], bool], timeout: float) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, "timed out"
        time.sleep(0.02)
    return time.monotonic() - started


def cancel_one_others_finish(url: str, port: int, prompts: list[str], n_predict: int) -> None:
    """One stream's client goes away: its slot is idle soon; the other streams finish in full."""
    endless = {
        "prompt": "a story that never ends",
        "n_predict": -1,
        "ignore_eos": True,
        "temperature": 0,
        "id_slot": 0,
    }
    sock = raw_stream("127.0.0.1", port, endless)
    results: list[tuple[list[int], dict] | None] = [None] * len(prompts)
    started = threading.Event()

    def one(i: int) -> Callable[[], None]:
        def run() -> None:
            body = {
                "prompt": prompts[i],
                "n_predict": n_predict,
                "ignore_eos": True,
                "temperature": 0,
                "id_slot": i + 1,
            }
            results[i] = stream_tokens(url, body, on_first=started.set if i == 0 else None)

        return run

    threads = [threading.Thread(target=one(i)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    assert started.wait(TIMEOUT)
    sock.close()
    wait_for(lambda: not slots(url)[0]["is_processing"], timeout=60)
    for thread in threads:
        thread.join(TIMEOUT)
    for result in results:
        assert result is not None
        tokens, final = result
        assert len(tokens) == n_predict and final["stop_type"] == "limit"


def save_while_another_streams(url: str, filename: str, n_predict: int) -> dict:
    """Slot 2 is saved while slot 1 streams: the save answers before the stream ends."""
    requests.post(
        url + "/completion",
        json={"prompt": "what slot two holds", "n_predict": 4, "temperature": 0, "id_slot": 2},
        timeout=TIMEOUT,
    ).raise_for_status()
    saved: dict = {}
    stream_done = threading.Event()

    def save() -> None:
        response = requests.post(
            url + "/slots/2", params={"action": "save"}, json={"filename": filename}, timeout=TIMEOUT
        )
        assert response.status_code == 200, response.text
        saved.update(response.json(), stream_running=not stream_done.is_set())

    def stream() -> None:
        body = {
            "prompt": "slot one streams",
            "n_predict": n_predict,
            "ignore_eos": True,
            "temperature": 0,
            "id_slot": 1,
        }
        stream_tokens(url, body, on_first=lambda: threading.Thread(target=save).start())
        stream_done.set()

    stream()
    wait_for(lambda: bool(saved), timeout=60)
    assert saved["id_slot"] == 2 and saved["n_saved"] > 0 and saved["stream_running"]
    return saved


def tokenize_while_streaming(url: str, prompts: list[str], n_predict: int) -> float:
    """/tokenize answers while every slot streams, long before they end; returns its answer time in s."""
    done = threading.Event()
    first = threading.Event()
    remaining = [len(prompts)]
    lock = threading.Lock()

    def one(prompt: str) -> Callable[[], None]:
        def run() -> None:
            stream_tokens(
                url,
                {"prompt": prompt, "n_predict": n_predict, "ignore_eos": True, "temperature": 0},
                on_first=first.set,
            )
            with lock:
                remaining[0] -= 1
                if not remaining[0]:
                    done.set()

        return run

    threads = [threading.Thread(target=one(p)) for p in prompts]
    for thread in threads:
        thread.start()
    assert first.wait(TIMEOUT)
    t0 = time.monotonic()
    response = requests.post(url + "/tokenize", json={"content": "hello world"}, timeout=TIMEOUT)
    elapsed = time.monotonic() - t0
    assert response.status_code == 200 and response.json()["tokens"]
    assert not done.is_set(), "the streams ended before /tokenize answered"
    for thread in threads:
        thread.join(TIMEOUT)
    return elapsed
