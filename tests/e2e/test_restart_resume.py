"""The feature end to end: save -> stop the server -> start it -> restore -> the next turn reuses the
held conversation (timings.cache_n) and generates the same greedy tokens as a server that never
stopped."""

from __future__ import annotations

import os
import threading

import pytest
import requests
from support.parallel import stream_tokens

from .servers import start_server

pytest.importorskip("strata_engine.cli", reason="the engine's `serve` command has not landed")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SYSTEM = "You are a careful assistant. Here are the facts you must remember: " + " ".join(
    f"Item {i} is stored in box {i * 7 % 31} on shelf {i % 5}." for i in range(14)
)
TURN1 = (
    f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nWhere is item 12?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
TURN2_SUFFIX = "<|im_end|>\n<|im_start|>user\nAnd item 30?<|im_end|>\n<|im_start|>assistant\n"
GREEDY = {"temperature": 0, "n_predict": 8, "ignore_eos": True, "return_tokens": True}


def call(url: str, path: str, body: dict) -> requests.Response:
    return requests.post(url + path, json=body, timeout=300)


def tokenize(url: str, text: str) -> list[int]:
    return call(url, "/tokenize", {"content": text}).json()["tokens"]


def test_save_stop_start_restore_next_turn(module_tmp):
    slots = module_tmp / "slots"
    slots.mkdir()
    first = start_server(module_tmp, "--slot-save-path", str(slots), name="first")
    try:
        turn1_ids = tokenize(first.url, TURN1)
        assert len(turn1_ids) > 200
        turn1 = call(first.url, "/completion", {"prompt": turn1_ids, **GREEDY}).json()
        generated = turn1["tokens"]
        assert len(generated) == 8
        held = len(turn1_ids) + len(generated) - 1  # the last sampled token is not evaluated yet
        saved = call(first.url, "/slots/0?action=save", {"filename": "conversation.bin"})
        if saved.status_code != 200 and "not available" in saved.json()["error"]["message"].lower():
            pytest.skip("the engine answers SAVE with 'not available' (session adapter not landed)")
        assert saved.status_code == 200, saved.text
        saved = saved.json()
        assert saved["n_saved"] == held
        assert saved["n_written"] == os.path.getsize(slots / "conversation.bin")
        turn2_ids = turn1_ids + generated + tokenize(first.url, TURN2_SUFFIX)
        reference = call(first.url, "/completion", {"prompt": turn2_ids, **GREEDY}).json()
        assert reference["timings"]["cache_n"] == held  # the server that never stopped
    finally:
        assert first.stop() == 0

    second = start_server(module_tmp, "--slot-save-path", str(slots), name="second")
    try:
        restored = call(second.url, "/slots/0?action=restore", {"filename": "conversation.bin"})
        assert restored.status_code == 200, restored.text
        restored = restored.json()
        assert restored["n_restored"] == held and restored["n_read"] == saved["n_written"]
        resumed = call(second.url, "/completion", {"prompt": turn2_ids, **GREEDY}).json()
        assert resumed["timings"]["cache_n"] >= 0.999 * held, resumed["timings"]
        assert resumed["timings"]["prompt_n"] == len(turn2_ids) - resumed["timings"]["cache_n"]
        assert resumed["tokens"] == reference["tokens"]
        assert resumed["content"] == reference["content"]
    finally:
        assert second.stop() == 0


def test_restore_failing_after_its_gate_erases_that_slot_only(module_tmp):
    """The engine's test-only fault point (an environment variable no request can set) makes a restore fail
    after its first applied block: 500, that slot is erased, while slot 1 streams on to exactly the tokens it
    gets alone; the engine is not restarted and the failed slot serves the next request."""
    slots = module_tmp / "slots-slot-failed"
    slots.mkdir()
    server = start_server(
        module_tmp,
        "-np",
        "2",
        "-c",
        "4096",
        "--slot-save-path",
        str(slots),
        "--metrics",
        "--restore-mode",
        "streaming",
        name="slot-failed",
        env={"STRATA_ENGINE_SESSION_FAULT": "restore-after-gate"},
    )
    try:
        prompt = TURN1[:400]
        first = call(
            server.url, "/completion", {"prompt": prompt, "temperature": 0, "n_predict": 2, "id_slot": 0}
        ).json()
        assert call(server.url, "/slots/0?action=save", {"filename": "c.bin"}).status_code == 200
        stream = {
            "prompt": "Once upon a time",
            "n_predict": 40,
            "temperature": 0,
            "ignore_eos": True,
            "id_slot": 1,
        }
        alone, _ = stream_tokens(server.url, stream)
        failed: list[requests.Response] = []

        def restore() -> None:
            failed.append(call(server.url, "/slots/0?action=restore", {"filename": "c.bin"}))

        restorer = threading.Thread(target=restore)
        together, final = stream_tokens(server.url, stream, on_first=restorer.start)
        restorer.join(300)
        assert together == alone and final["stop_type"] == "limit"
        assert failed[0].status_code == 500, failed[0].text
        error = failed[0].json()["error"]
        assert error["type"] == "server_error" and "slot 0 was erased" in error["message"]
        after = call(
            server.url, "/completion", {"prompt": prompt, "temperature": 0, "n_predict": 2, "id_slot": 0}
        ).json()
        assert after["timings"]["cache_n"] == 0 and after["content"] == first["content"]
        metrics = requests.get(server.url + "/metrics", timeout=30).text
        for line in ("strata:engine_restarts_total 0", "strata:slot_restore_fail_stops_total 1"):
            assert line in metrics, line
    finally:
        assert server.stop() == 0
