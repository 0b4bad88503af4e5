"""``--parallel`` end to end: a real strata-server with the real engine and model, 4 slots."""

from __future__ import annotations

import threading
import time

import pytest
import requests
from support.parallel import (
    cancel_one_others_finish,
    concurrent_streams_match_solo,
    restore_under_load_continues_exactly,
    save_while_another_streams,
    slots,
    staggered_streams_match_solo,
    tokenize_while_streaming,
)
from support.server_process import metrics
from support.stalled import half_requests

from .servers import start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
PROMPTS = [
    "<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\n",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
]
PER_SLOT_CTX = 512
# Batch invariance over HTTP: 300 greedy tokens a prompt, within a slot's 512 and CI's time; issue 41's >= 500 tokens
# beside 1, 3 and 7 others run through the engine's scheduler, on both models, and the engine's tests compare every
# step's logits bit for bit (tests/engine/test_batch_invariance.py).
LONG_PREDICT = 300
ARRIVE_EVERY = 60  # the next prompt is sent once the previous one has streamed this many tokens


@pytest.fixture(scope="module")
def folder(module_tmp):
    path = module_tmp / "slots"
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def server(module_tmp, folder):
    proc = start_server(
        module_tmp,
        "-np",
        "4",
        "-c",
        str(4 * PER_SLOT_CTX),
        "--slot-save-path",
        str(folder),
        "--metrics",
        name="parallel",
    )
    yield proc
    assert proc.stop() == 0


def busy_slots_per_decode(url: str) -> tuple[float, float]:
    """/metrics' n_decode_total and n_busy_slots_per_decode."""
    values = metrics(url)
    return values["llamacpp:n_decode_total"], values["llamacpp:n_busy_slots_per_decode"]


@pytest.mark.parametrize("n", [2, 4])
def test_concurrent_streams_get_exactly_their_greedy_tokens(server, n):
    concurrent_streams_match_solo(server.url, PROMPTS[:n], n_predict=12)
    # the solo runs decoded one slot per step; the concurrent ones up to n: the mean is measured, not 1
    n_decode, per_decode = busy_slots_per_decode(server.url)
    assert n_decode > 0 and 1.0 < per_decode < n


def test_long_greedy_replies_alone_equal_those_with_others_arriving_midway(server):
    staggered_streams_match_solo(server.url, PROMPTS, n_predict=LONG_PREDICT, every=ARRIVE_EVERY)


def test_a_restore_under_load_continues_as_the_never_restarted_conversation(server):
    restore_under_load_continues_exactly(server.url, "load.bin", PROMPTS[0], PROMPTS[1:], n_predict=48)


def test_a_client_going_away_cancels_its_stream_only(server):
    cancel_one_others_finish(server.url, server.port, PROMPTS[1:3], n_predict=24)


def test_save_slot_2_while_slot_1_streams(server):
    save_while_another_streams(server.url, "two.bin", n_predict=48)


def test_tokenize_answers_while_slots_stream(server):
    tokenize_while_streaming(server.url, PROMPTS[:3], n_predict=40)


def test_slots_shape(server):
    listed = slots(server.url)
    assert [s["id"] for s in listed] == [0, 1, 2, 3]
    assert all(
        s["n_ctx"] == PER_SLOT_CTX and s["speculative"] is False and "is_processing" in s for s in listed
    )
    props = requests.get(server.url + "/props", timeout=30).json()
    assert props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] == PER_SLOT_CTX


def test_restore_from_slot_1_into_slot_0_and_into_a_one_slot_server(server, folder, module_tmp):
    body = {"prompt": PROMPTS[0], "n_predict": 8, "temperature": 0}
    first = requests.post(server.url + "/completion", json={**body, "id_slot": 1}, timeout=300).json()
    assert first["id_slot"] == 1
    saved = requests.post(
        server.url + "/slots/1", params={"action": "save"}, json={"filename": "one.bin"}, timeout=300
    ).json()
    assert saved["n_saved"] == first["tokens_cached"]
    alone = requests.post(server.url + "/completion", json={**body, "id_slot": 1}, timeout=300).json()
    restored = requests.post(
        server.url + "/slots/0", params={"action": "restore"}, json={"filename": "one.bin"}, timeout=300
    ).json()
    assert restored["id_slot"] == 0 and restored["n_restored"] == saved["n_saved"]
    again = requests.post(server.url + "/completion", json={**body, "id_slot": 0}, timeout=300).json()
    assert (
        again["timings"]["cache_n"] == first["tokens_evaluated"] - 1 and again["content"] == alone["content"]
    )
    single = start_server(module_tmp, "-c", str(PER_SLOT_CTX), "--slot-save-path", str(folder), name="single")
    try:
        into = requests.post(
            single.url + "/slots/0", params={"action": "restore"}, json={"filename": "one.bin"}, timeout=300
        ).json()
        assert into["n_restored"] == saved["n_saved"], into
        cont = requests.post(single.url + "/completion", json=body, timeout=300).json()
        assert (
            cont["timings"]["cache_n"] == first["tokens_evaluated"] - 1
            and cont["content"] == alone["content"]
        )
    finally:
        assert single.stop() == 0


def test_the_prompt_goes_back_to_the_slot_holding_its_conversation(server):
    chat = "<|im_start|>user\nTell me about the moon.<|im_end|>\n<|im_start|>assistant\n"
    first = requests.post(
        server.url + "/completion",
        json={"prompt": chat, "n_predict": 8, "temperature": 0, "id_slot": 3},
        timeout=300,
    ).json()
    requests.post(server.url + "/completion", json={"prompt": "Unrelated text", "n_predict": 2}, timeout=300)
    turn = (
        chat
        + first["content"]
        + "<|im_end|>\n<|im_start|>user\nAnd the sun?<|im_end|>\n<|im_start|>assistant\n"
    )
    body = requests.post(
        server.url + "/completion", json={"prompt": turn, "n_predict": 4}, timeout=300
    ).json()
    assert body["id_slot"] == 3 and body["timings"]["cache_n"] >= first["tokens_evaluated"]


def test_256_stalled_connections_hold_nothing_while_a_slot_streams(server):
    answers: dict = {}

    def stream() -> None:
        answers["stream"] = requests.post(
            server.url + "/completion",
            json={"prompt": PROMPTS[3], "n_predict": 48, "temperature": 0, "ignore_eos": True},
            timeout=300,
        )

    streaming = threading.Thread(target=stream)
    streaming.start()
    stalled = half_requests(server.port, 128, body=False) + half_requests(server.port, 128, body=True)
    try:
        started = time.monotonic()
        assert requests.get(server.url + "/health", timeout=10).status_code == 200
        assert [s["id"] for s in requests.get(server.url + "/slots", timeout=10).json()] == [0, 1, 2, 3]
        answer = requests.post(
            server.url + "/completion", json={"prompt": PROMPTS[1], "n_predict": 2}, timeout=60
        )
        assert answer.status_code == 200 and answer.json()["tokens_predicted"] == 2
        print(
            f"/health, /slots and a completion with 256 stalled connections, a slot streaming: "
            f"{time.monotonic() - started:.3f} s"
        )
    finally:
        for sock in stalled:
            sock.close()
        streaming.join(300)
    assert answers["stream"].status_code == 200 and answers["stream"].json()["tokens_predicted"] == 48
