"""Session save/restore on the GPU through real engine processes (`strata-engine serve --backend cupy`).

* save in one process, restore in a new one, next turn: the restored conversation is reused whole
  (cache_n >= 99.9 % of the tokens restored) and the greedy tokens equal those of the process that
  never restarted — for the device pool and for the host-mapped pool behind a VRAM ring;
* a fault after the gate makes the engine fail-stop (exit status 4); one before it is a refusal and
  the engine keeps serving the conversation it held;
* an engine that holds nothing stages a restore into its own pool (no staging area): a corrupt file is
  a refusal that leaves it holding nothing, and a good file restores next;
* a file written by the numpy backend is refused by the cupy backend (the config fingerprint covers
  the backend), keeping the live conversation.
"""

from __future__ import annotations

import pytest
import strata_sessionfile as sf
from strata_engine.client import EngineProcess

from .gpu import MODELS, long_prompt, model_path

pytestmark = pytest.mark.gpu

PLACEMENTS = {"device-pool": [], "host-pool+ring64": ["--kv-resident", "64"]}


def _start(model: str, placement: str, backend="cupy", env=None, mode="auto") -> EngineProcess:
    args = ["--ctx-size", "2048", "--backend", backend, "--restore-mode", mode, *PLACEMENTS[placement]]
    return EngineProcess(model_path(model), *args, env=env)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("model", list(MODELS))
def test_save_new_process_restore_next_turn(tmp_path, model, placement):
    pytest.importorskip("cupy")
    path = tmp_path / "s.ssf"
    prompt = long_prompt(3)
    a = _start(model, placement)
    assert a.ready["backend"] == "cupy"
    first = a.complete(prompt, 8)
    saved = a.command("SAVE", {"path": str(path)})
    assert saved["event"] == "result" and saved["n_saved"] == first["n_tokens_held"]
    next_prompt = prompt + first["tokens"] + long_prompt(11, 40)
    never_restarted = a.complete(next_prompt, 16)
    assert a.quit() == 0

    b = _start(model, placement)
    restored = b.command("RESTORE", {"path": str(path)})
    assert restored["event"] == "result", restored
    assert restored["n_restored"] == first["n_tokens_held"]
    after_restore = b.complete(next_prompt, 16)
    assert after_restore["timings"]["cache_n"] >= 0.999 * restored["n_restored"]
    assert after_restore["tokens"] == never_restarted["tokens"]
    assert b.quit() == 0


@pytest.mark.parametrize(
    ("fault", "mode"), [("restore-after-gate", "streaming"), ("restore-at-commit", "staged")]
)
@pytest.mark.parametrize("model", ["smollm2"])
def test_fault_after_the_gate_erases_the_slot_and_keeps_serving(tmp_path, model, fault, mode):
    """Protocol v2: a restore failing after its gate erases its slot (`slot_failed`) and the engine goes
    on; the slot then evaluates a prompt from nothing."""
    pytest.importorskip("cupy")
    path = tmp_path / "s.ssf"
    a = _start(model, "device-pool")
    a.complete(long_prompt(3), 4)
    assert a.command("SAVE", {"path": str(path)})["event"] == "result"
    a.quit()
    b = _start(model, "device-pool", env={"STRATA_ENGINE_SESSION_FAULT": fault}, mode=mode)
    b.complete(long_prompt(5, 100), 2)
    event = b.command("RESTORE", {"path": str(path)})
    assert event["event"] == "error" and event["error"]["type"] == "slot_failed", event
    assert b.status()["n_tokens_held"] == 0
    again = b.complete(long_prompt(5, 100), 2)
    assert again["timings"]["cache_n"] == 0
    assert b.quit() == 0


@pytest.mark.parametrize("model", ["smollm2"])
def test_fault_before_the_gate_keeps_serving(tmp_path, model):
    pytest.importorskip("cupy")
    path = tmp_path / "s.ssf"
    a = _start(model, "device-pool")
    a.complete(long_prompt(3), 4)
    assert a.command("SAVE", {"path": str(path)})["event"] == "result"
    a.quit()
    b = _start(model, "device-pool", env={"STRATA_ENGINE_SESSION_FAULT": "restore-before-gate"})
    held = b.complete(long_prompt(5, 100), 2)
    event = b.command("RESTORE", {"path": str(path)})
    assert event["event"] == "error" and event["error"]["type"] == "session_refused", event
    status = b.command("STATUS")
    assert status["slots"][0]["n_tokens_held"] == held["n_tokens_held"]
    again = b.complete(long_prompt(5, 100) + held["tokens"], 2)
    assert again["timings"]["cache_n"] == held["n_tokens_held"]  # the live conversation was kept
    assert b.quit() == 0


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_a_fresh_engine_refuses_a_corrupt_file_then_restores_a_good_one(tmp_path, placement):
    pytest.importorskip("cupy")
    good, bad = tmp_path / "good.ssf", tmp_path / "bad.ssf"
    prompt = long_prompt(3)
    a = _start("smollm2", placement)
    first = a.complete(prompt, 8)
    assert a.command("SAVE", {"path": str(good)})["event"] == "result"
    next_prompt = prompt + first["tokens"] + long_prompt(11, 40)
    never_restarted = a.complete(next_prompt, 8)
    assert a.quit() == 0
    data = bytearray(good.read_bytes())
    layout = sf.inspect(good).layout
    data[layout.data_offset + layout.data_length - 3] ^= 0x20  # the last block: after most bytes landed
    bad.write_bytes(bytes(data))

    b = _start("smollm2", placement, mode="staged")  # holds nothing: stages into its own pool
    event = b.command("RESTORE", {"path": str(bad)})
    assert event["event"] == "error" and event["error"]["type"] == "session_refused", event
    assert event["error"]["reason"] == "payload_corrupt", event
    assert b.status()["n_tokens_held"] == 0
    restored = b.command("RESTORE", {"path": str(good)})
    assert restored["event"] == "result" and restored["mode"] == "staged", restored
    after_restore = b.complete(next_prompt, 8)
    assert after_restore["timings"]["cache_n"] >= 0.999 * restored["n_restored"]
    assert after_restore["tokens"] == never_restarted["tokens"]
    assert b.quit() == 0


@pytest.mark.parametrize("model", ["smollm2"])
def test_numpy_backend_file_is_refused_by_the_cupy_backend(tmp_path, model):
    pytest.importorskip("cupy")
    path = tmp_path / "n.ssf"
    n = _start(model, "device-pool", backend="numpy")
    n.complete(long_prompt(3, 40), 2)
    assert n.command("SAVE", {"path": str(path)})["event"] == "result"
    n.quit()
    g = _start(model, "device-pool")
    held = g.complete(long_prompt(5, 60), 2)
    event = g.command("RESTORE", {"path": str(path)})
    assert event["event"] == "error" and event["error"]["type"] == "session_refused", event
    assert event["error"]["reason"] == "config_mismatch", event
    assert g.status()["n_tokens_held"] == held["n_tokens_held"]
    assert g.quit() == 0
