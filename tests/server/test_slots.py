"""Slot actions through falcon.testing with the fake engine: shapes, every refusal, the kept conversation."""

from __future__ import annotations

import json
import os

import pytest

from .checks import BAD_NAMES, assert_error
from .fake_engine import mark_fail_after_gate

GREEDY = {"temperature": 0, "n_predict": 6}
PROMPT = "the conversation that must survive"


def slot_post(client, action: str, body: dict | None = None, *, slot: str = "0", **kwargs):
    kwargs.setdefault("content_type", "application/json")
    raw = json.dumps(body) if body is not None else ""
    return client.simulate_post(f"/slots/{slot}", params={"action": action}, body=raw, **kwargs)


@pytest.fixture
def api(make_api, slot_dir):
    client, engine, config = make_api(slot_save_path=str(slot_dir))
    first = client.simulate_post("/completion", json={"prompt": PROMPT, **GREEDY}).json
    return client, engine, first


def held_reuse(client) -> int:
    """cache_n of the same prompt again: how much of the conversation is still held."""
    return client.simulate_post("/completion", json={"prompt": PROMPT, **GREEDY}).json["timings"]["cache_n"]


def test_disabled_without_slot_save_path(make_api):
    client, _, _ = make_api()
    for action in ("save", "restore", "erase"):
        assert_error(
            slot_post(client, action, {"filename": "x"}),
            501,
            "not_supported_error",
            "This server does not support slots action. Start it with `--slot-save-path`",
        )


def test_save_restore_erase_shapes(api, slot_dir):
    client, engine, first = api
    held = first["tokens_cached"]
    saved = slot_post(client, "save", {"filename": "chat1.bin"}).json
    assert set(saved) == {"id_slot", "filename", "n_saved", "n_written", "timings"}
    assert saved["id_slot"] == 0 and saved["filename"] == "chat1.bin" and saved["n_saved"] == held
    assert saved["n_written"] == os.path.getsize(slot_dir / "chat1.bin")
    assert isinstance(saved["timings"]["save_ms"], float)
    erased = slot_post(client, "erase").json
    assert erased == {"id_slot": 0, "n_erased": held}
    assert held_reuse(client) == 0
    slot_post(client, "erase")
    restored = slot_post(client, "restore", {"filename": "chat1.bin"}).json
    assert set(restored) == {"id_slot", "filename", "n_restored", "n_read", "timings"}
    assert restored["n_restored"] == held and restored["n_read"] == saved["n_written"]
    assert isinstance(restored["timings"]["restore_ms"], float)
    # The next turn reuses what was restored (as the peer: prompt tokens - 1).
    assert held_reuse(client) == first["tokens_evaluated"] - 1


def test_erase_ignores_body(api):
    client, _, _ = api
    result = client.simulate_post(
        "/slots/0", params={"action": "erase"}, body="not json", content_type="application/json"
    )
    assert result.status_code == 200


@pytest.mark.parametrize(
    ("slot", "message"),
    [
        ("abc", "Invalid slot ID"),
        ("1", "Invalid slot ID: 1; this server has one slot, 0"),
        ("-1", "Invalid slot ID: -1; this server has one slot, 0"),
        ("1abc", "Invalid slot ID"),
    ],
)
def test_bad_slot_ids(api, slot, message):
    client, _, _ = api
    assert_error(
        slot_post(client, "save", {"filename": "x.bin"}, slot=slot), 400, "invalid_request_error", message
    )


def test_bad_action_and_bodies(api):
    client, _, _ = api
    assert_error(
        slot_post(client, "bogus", {"filename": "x"}), 400, "invalid_request_error", "Invalid action"
    )
    assert_error(
        client.simulate_post("/slots/0", body="{}", content_type="application/json"),
        400,
        "invalid_request_error",
        "Invalid action",
    )
    assert_error(slot_post(client, "save", {}), 400, "invalid_request_error", "'filename' is required")
    assert_error(slot_post(client, "save", {"filename": 3}), 400, "invalid_request_error")
    assert_error(slot_post(client, "save", None), 400, "invalid_request_error")


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_filenames_refused_and_conversation_kept(api, slot_dir, name):
    client, _, first = api
    for action in ("save", "restore"):
        error = assert_error(slot_post(client, action, {"filename": name}), 400, "invalid_request_error")
        assert error["message"].startswith("Invalid filename")
    assert os.listdir(slot_dir) == []
    assert held_reuse(client) == first["tokens_evaluated"] - 1


@pytest.mark.parametrize("name", [".hidden", "café.bin", "x" * 255, "a.b.c", "no-extension"])
def test_good_filenames(api, slot_dir, name):
    client, _, _ = api
    assert slot_post(client, "save", {"filename": name}).status_code == 200
    assert (slot_dir / name).is_file()
    assert slot_post(client, "restore", {"filename": name}).status_code == 200


def test_symlink_in_folder_never_followed(api, slot_dir, tmp_path):
    client, _, first = api
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"precious")
    (slot_dir / "link.bin").symlink_to(outside)
    for action in ("save", "restore"):
        error = assert_error(
            slot_post(client, action, {"filename": "link.bin"}), 400, "invalid_request_error"
        )
        assert "symbolic link" in error["message"]
    assert outside.read_bytes() == b"precious"
    assert held_reuse(client) == first["tokens_evaluated"] - 1
    (slot_dir / "sub").mkdir()
    assert_error(slot_post(client, "restore", {"filename": "sub"}), 400, "invalid_request_error")


def test_missing_file_named_and_nothing_wiped(api):
    client, _, first = api
    error = assert_error(
        slot_post(client, "restore", {"filename": "does-not-exist.bin"}), 400, "invalid_request_error"
    )
    assert "'does-not-exist.bin'" in error["message"] and error["reason"] == "not_found"
    assert held_reuse(client) == first["tokens_evaluated"] - 1  # the peer wipes the slot here


def test_refusals_keep_conversation(api, slot_dir, fake_model, tmp_path):
    client, engine, first = api
    assert slot_post(client, "save", {"filename": "good.bin"}).status_code == 200
    # A file from another model.
    from .fake_engine import FakeEngine

    other_model = tmp_path / "model-B.gguf"
    other_model.write_text("fake-model-B")
    other = FakeEngine(str(other_model))
    other.held = [5, 6, 7]
    list(other.handle("SAVE " + json.dumps({"path": str(slot_dir / "other-model.bin")})))
    # A corrupted file: one byte changed.
    data = bytearray((slot_dir / "good.bin").read_bytes())
    data[data.index(b'"tokens"') + 12] ^= 0x01
    (slot_dir / "corrupt.bin").write_bytes(bytes(data))
    (slot_dir / "empty.bin").write_bytes(b"")
    client.simulate_post("/completion", json={"prompt": PROMPT, **GREEDY})
    for name, reason in (
        ("other-model.bin", "model_mismatch"),
        ("corrupt.bin", "corrupt"),
        ("empty.bin", "corrupt"),
    ):
        error = assert_error(slot_post(client, "restore", {"filename": name}), 400, "invalid_request_error")
        assert error["reason"] == reason and repr(name) in error["message"]
        assert error["message"].startswith("Unable to restore slot")
        assert held_reuse(client) == first["tokens_evaluated"] - 1


def test_fail_stop_after_gate_is_500_then_served(api, slot_dir):
    client, engine, _ = api
    assert slot_post(client, "save", {"filename": "doomed.bin"}).status_code == 200
    mark_fail_after_gate(str(slot_dir / "doomed.bin"), fail_stop=True)
    error = assert_error(slot_post(client, "restore", {"filename": "doomed.bin"}), 500, "server_error")
    assert "restarting" in error["message"] and "lost" in error["message"]
    assert engine.restarts == 1
    after = client.simulate_post("/completion", json={"prompt": PROMPT, **GREEDY})
    assert after.status_code == 200 and after.json["timings"]["cache_n"] == 0


def test_save_failure_is_500_and_keeps_old_file(api, slot_dir):
    client, engine, _ = api
    assert slot_post(client, "save", {"filename": "keep.bin"}).status_code == 200
    before = (slot_dir / "keep.bin").read_bytes()
    client.simulate_post("/completion", json={"prompt": "something else entirely", **GREEDY})
    engine.slot_engines[0].fail_saves = True
    error = assert_error(slot_post(client, "save", {"filename": "keep.bin"}), 500, "server_error")
    assert error["message"].startswith("Unable to save slot") and "untouched" in error["message"]
    assert (slot_dir / "keep.bin").read_bytes() == before
    assert sorted(os.listdir(slot_dir)) == ["keep.bin"]
    engine.slot_engines[0].fail_saves = False
    assert client.simulate_post("/completion", json={"prompt": "still serving", **GREEDY}).status_code == 200


def test_slot_actions_need_json_and_no_foreign_origin(make_api, slot_dir):
    client, _, _ = make_api(slot_save_path=str(slot_dir), trusted_origins="http://app.example:3000")
    body = {"filename": "x.bin"}
    for content_type in (None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        kwargs = {"content_type": content_type} if content_type else {}
        result = client.simulate_post("/slots/0", params={"action": "save"}, body=json.dumps(body), **kwargs)
        assert_error(result, 415, "invalid_request_error")
    for origin in ("http://evil.example", "null", "http://127.0.0.1:9999", "https://app.example:3000"):
        result = slot_post(client, "save", body, headers={"Origin": origin})
        assert_error(result, 403, "permission_error")
    for origin in ("http://127.0.0.1:8080", "http://app.example:3000"):
        assert slot_post(client, "save", body, headers={"Origin": origin}).status_code == 200
    assert slot_post(client, "save", body, content_type="application/json; charset=utf-8").status_code == 200
    assert not list(slot_dir.glob(".strata-tmp-*"))
    # erase reads no body: without one it is taken, as llama-server takes it; a body must still be JSON, and a
    # foreign Origin is still refused
    bare = client.simulate_post("/slots/0", params={"action": "erase"})
    assert bare.status_code == 200 and bare.json == {"id_slot": 0, "n_erased": 0}
    for action in ("save", "restore"):
        assert_error(
            client.simulate_post("/slots/0", params={"action": action}), 415, "invalid_request_error"
        )
    text = client.simulate_post("/slots/0", params={"action": "erase"}, body="x", content_type="text/plain")
    assert_error(text, 415, "invalid_request_error")
    foreign = client.simulate_post(
        "/slots/0", params={"action": "erase"}, headers={"Origin": "http://evil.example"}
    )
    assert_error(foreign, 403, "permission_error")


def test_save_folder_flush_failure_says_file_in_place(api, monkeypatch):
    client, engine, _ = api

    def flush_failed(arg):
        yield {
            "event": "error",
            "error": {
                "type": "session_write_failed",
                "reason": "dir_fsync_failed",
                "message": "fsync of the folder failed",
                "file_in_place": True,
            },
        }

    monkeypatch.setattr(engine.slot_engines[0], "do_save", flush_failed)
    error = assert_error(slot_post(client, "save", {"filename": "x.bin"}), 500, "server_error")
    assert "is in place" in error["message"] and error["reason"] == "dir_fsync_failed"
