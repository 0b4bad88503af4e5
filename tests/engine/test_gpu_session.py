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

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import strata_sessionfile as sf

from .gpu import MODELS, long_prompt, model_path

pytestmark = pytest.mark.gpu

PLACEMENTS = {"device-pool": [], "host-pool+ring64": ["--kv-resident", "64"]}


class EngineProc:
    """One `strata-engine serve` process spoken to over its line protocol."""

    def __init__(self, model: Path, args: list[str], log: Path, env: dict[str, str] | None = None):
        cmd = [
            sys.executable,
            "-m",
            "strata_engine.cli",
            "serve",
            "--model",
            str(model),
            "--ctx-size",
            "2048",
        ]
        self.log = log.open("a")
        self.proc = subprocess.Popen(
            [*cmd, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.ready = self._read()
        assert self.ready.get("event") == "ready", self.ready

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"engine exited ({self.proc.wait()}); see {self.log.name}")
        return json.loads(line)

    def command(self, line: str) -> dict:
        """Send one line; return its terminal event (result or error)."""
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        while True:
            event = self._read()
            if event["event"] in ("result", "error"):
                return event

    def complete(self, prompt: list[int], n_predict: int) -> dict:
        request = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "seed": 1}
        event = self.command("COMPLETE " + json.dumps(request))
        assert event["event"] == "result", event
        return event

    def quit(self) -> int:
        self.proc.stdin.close()
        code = self.proc.wait(timeout=120)
        self.proc.stdout.close()  # the pipes and the log closed here, not left to the collector
        self.log.close()
        return code


def _start(model: str, placement: str, tmp_path: Path, backend="cupy", env=None, mode="auto") -> EngineProc:
    args = ["--backend", backend, "--restore-mode", mode, *PLACEMENTS[placement]]
    return EngineProc(model_path(model), args, tmp_path / "engine.log", env)


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("model", list(MODELS))
def test_save_new_process_restore_next_turn(tmp_path, model, placement):
    pytest.importorskip("cupy")
    path = tmp_path / "s.ssf"
    prompt = long_prompt(3)
    a = _start(model, placement, tmp_path)
    assert a.ready["backend"] == "cupy"
    first = a.complete(prompt, 8)
    saved = a.command("SAVE " + json.dumps({"path": str(path)}))
    assert saved["event"] == "result" and saved["n_saved"] == first["n_tokens_held"]
    next_prompt = prompt + first["tokens"] + long_prompt(11, 40)
    never_restarted = a.complete(next_prompt, 16)
    assert a.quit() == 0

    b = _start(model, placement, tmp_path)
    restored = b.command("RESTORE " + json.dumps({"path": str(path)}))
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
    a = _start(model, "device-pool", tmp_path)
    a.complete(long_prompt(3), 4)
    assert a.command("SAVE " + json.dumps({"path": str(path)}))["event"] == "result"
    a.quit()
    b = _start(model, "device-pool", tmp_path, env={"STRATA_ENGINE_SESSION_FAULT": fault}, mode=mode)
    b.complete(long_prompt(5, 100), 2)
    event = b.command("RESTORE " + json.dumps({"path": str(path)}))
    assert event["event"] == "error" and event["error"]["type"] == "slot_failed", event
    assert b.command("STATUS")["slots"][0]["n_tokens_held"] == 0
    again = b.complete(long_prompt(5, 100), 2)
    assert again["timings"]["cache_n"] == 0
    assert b.quit() == 0


@pytest.mark.parametrize("model", ["smollm2"])
def test_fault_before_the_gate_keeps_serving(tmp_path, model):
    pytest.importorskip("cupy")
    path = tmp_path / "s.ssf"
    a = _start(model, "device-pool", tmp_path)
    a.complete(long_prompt(3), 4)
    assert a.command("SAVE " + json.dumps({"path": str(path)}))["event"] == "result"
    a.quit()
    b = _start(model, "device-pool", tmp_path, env={"STRATA_ENGINE_SESSION_FAULT": "restore-before-gate"})
    held = b.complete(long_prompt(5, 100), 2)
    event = b.command("RESTORE " + json.dumps({"path": str(path)}))
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
    a = _start("smollm2", placement, tmp_path)
    first = a.complete(prompt, 8)
    assert a.command("SAVE " + json.dumps({"path": str(good)}))["event"] == "result"
    next_prompt = prompt + first["tokens"] + long_prompt(11, 40)
    never_restarted = a.complete(next_prompt, 8)
    assert a.quit() == 0
    data = bytearray(good.read_bytes())
    layout = sf.inspect(good).layout
    data[layout.data_offset + layout.data_length - 3] ^= 0x20  # the last block: after most bytes landed
    bad.write_bytes(bytes(data))

    b = _start("smollm2", placement, tmp_path, mode="staged")  # holds nothing: stages into its own pool
    event = b.command("RESTORE " + json.dumps({"path": str(bad)}))
    assert event["event"] == "error" and event["error"]["type"] == "session_refused", event
    assert event["error"]["reason"] == "payload_corrupt", event
    assert b.command("STATUS")["slots"][0]["n_tokens_held"] == 0
    restored = b.command("RESTORE " + json.dumps({"path": str(good)}))
    assert restored["event"] == "result" and restored["mode"] == "staged", restored
    after_restore = b.complete(next_prompt, 8)
    assert after_restore["timings"]["cache_n"] >= 0.999 * restored["n_restored"]
    assert after_restore["tokens"] == never_restarted["tokens"]
    assert b.quit() == 0


@pytest.mark.parametrize("model", ["smollm2"])
def test_numpy_backend_file_is_refused_by_the_cupy_backend(tmp_path, model):
    pytest.importorskip("cupy")
    path = tmp_path / "n.ssf"
    n = _start(model, "device-pool", tmp_path, backend="numpy")
    n.complete(long_prompt(3, 40), 2)
    assert n.command("SAVE " + json.dumps({"path": str(path)}))["event"] == "result"
    n.quit()
    g = _start(model, "device-pool", tmp_path)
    held = g.complete(long_prompt(5, 60), 2)
    event = g.command("RESTORE " + json.dumps({"path": str(path)}))
    assert event["event"] == "error" and event["error"]["type"] == "session_refused", event
    assert event["error"]["reason"] == "config_mismatch", event
    assert g.command("STATUS")["slots"][0]["n_tokens_held"] == held["n_tokens_held"]
    assert g.quit() == 0
