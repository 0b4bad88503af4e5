"""``--parallel 4`` through the real gunicorn entry with the fake engine process (protocol v2, a thread per
command): concurrent streams, a client going away, a save beside a stream, /tokenize beside streams."""

from __future__ import annotations

import sys
import time

import pytest
import requests
from support.parallel import (
    cancel_one_others_finish,
    concurrent_streams_match_solo,
    save_while_another_streams,
    tokenize_while_streaming,
)
from support.server_process import ServerProcess

from .fake_engine import FAKE_ENGINE_PATH

pytestmark = pytest.mark.timeout(180)
PROMPTS = ["the first chat", "a second one", "third", "and a fourth"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parallel")
    model = tmp / "fake-model-A.gguf"
    model.write_text("fake-model-A\n", encoding="utf-8")
    (tmp / "slots").mkdir()
    engine = " ".join([sys.executable, FAKE_ENGINE_PATH, "serve", "--token-delay", "0.01"])
    proc = ServerProcess(
        "--model",
        str(model),
        "--engine-command",
        engine,
        "-np",
        "4",
        "-c",
        "8192",
        "--slot-save-path",
        str(tmp / "slots"),
        log_path=tmp / "server.log",
    ).start(60)
    yield proc
    assert proc.stop() == 0


def test_concurrent_streams_get_their_own_tokens_at_once(server):
    t0 = time.monotonic()
    concurrent_streams_match_solo(server.url, PROMPTS, n_predict=40)
    # Alone 4 x 40 x 10 ms, then together about 40 x 10 ms: slower than 2 x alone would mean they took turns.
    assert time.monotonic() - t0 < 4 * 40 * 0.01 * 1.75


def test_a_client_going_away_cancels_its_stream_only(server):
    cancel_one_others_finish(server.url, server.port, PROMPTS[:3], n_predict=60)


def test_save_a_slot_while_another_streams(server):
    save_while_another_streams(server.url, "two.bin", n_predict=150)


def test_tokenize_answers_while_every_slot_streams(server):
    assert tokenize_while_streaming(server.url, PROMPTS, n_predict=100) < 0.5


def test_slots_shape(server):
    slots = requests.get(server.url + "/slots", timeout=10).json()
    assert [s["id"] for s in slots] == [0, 1, 2, 3] and all(s["n_ctx"] == 2048 for s in slots)
    assert requests.get(server.url + "/props", timeout=10).json()["total_slots"] == 4
