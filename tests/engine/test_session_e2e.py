"""A conversation survives a restart, end to end: `strata-engine serve` child processes, SAVE, a NEW
process, RESTORE, the next turn.

* For both real models, f16 and int8 K/V, and both placements (each conversation is saved under one
  placement and restored under the other; both restore modes are used): the restored process reuses at
  least 99.9 % of the held tokens (`timings.cache_n`) and its greedy tokens equal those of the process
  that never restarted; a sampled turn that continues the engine's generator (seed -1) draws the same
  tokens too (the sampler state travels in the file). For gemma3 (sliding windows) a turn that leaves
  the last reply early resumes from the deepest checkpoint the file carried.
* Refusals, each followed by a turn that shows the live conversation intact: another model, another K/V
  type, a smaller context than the file holds, another engine version, a flipped byte (data and header),
  a truncated file, a symlink, a second hard link.
* The gate: a fault injected after it makes the engine exit with status 4 (streaming, and a staged
  switch); a fault before it is a clean refusal and the engine keeps serving. Faults are armed through
  the environment variable STRATA_ENGINE_SESSION_FAULT, which no request can set.

The refusal files are written in this process by the engine's adapter over a real K/V pool filled
with random bytes ("synthetic" sessions): the same identity as the engine process (or the one thing
that differs), without a prefill.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import numpy as np
import pytest
import strata_sessionfile as sf
from strata_engine.client import EngineProcess
from strata_engine.config import ModelConfig
from strata_engine.gguf import read_gguf
from strata_engine.kv import KVGeometry, KVParts, KVPool, make_placement
from strata_engine.ops import get_ops
from strata_engine.runner import RunnerState
from strata_engine.session import FAULT_ENV, EngineSession, runner_identity
from strata_engine.settings import EngineSettings, KVType
from support.data import gemma3_model_path, smollm2_model_path

from .runners import bare_runner

FAIL_STOP_STATUS = 4
MODEL_PATHS = {"smollm2": smollm2_model_path, "gemma3": gemma3_model_path}


class Engine(EngineProcess):
    """`strata-engine serve` of one of the real models in a child process."""

    def __init__(self, model: str, *args: str, env: dict[str, str] | None = None):
        super().__init__(MODEL_PATHS[model](), *args, env=env)


@pytest.fixture
def engines():
    started: list[Engine] = []

    def start(*args, **kw) -> Engine:
        engine = Engine(*args, **kw)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.quit()


def prompt_tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1000, 20000, n)]


# ---- a conversation survives a restart ---------------------------------------------------------------


@attrs.frozen
class Case:
    model: str
    kv_type: str
    n_prompt: int
    n_ctx: int
    save_args: tuple[str, ...]  # the process that holds, saves and never restarts
    restore_args: tuple[str, ...]  # the new process


RESIDENT = ("--kv-resident", "256")
CASES = [
    Case("smollm2", "f16", 2000, 2048, (), (*RESIDENT, "--restore-mode", "streaming")),
    Case("smollm2", "int8", 2000, 2048, RESIDENT, ("--restore-mode", "staged")),
    Case("gemma3", "f16", 1600, 2048, (), (*RESIDENT, "--restore-mode", "streaming")),  # 3x its window
    Case("gemma3", "int8", 1600, 2048, RESIDENT, ("--restore-mode", "auto")),
]
N_FIRST, N_NEXT = 4, 8


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.model}-{c.kv_type}")
def test_conversation_survives_a_restart(engines, tmp_path, case):
    settings = ("--ctx-size", str(case.n_ctx), "--kv-type", case.kv_type)
    prompt = prompt_tokens(case.n_prompt, seed=len(case.model) + len(case.kv_type))
    path = tmp_path / "chat.session"

    never_restarted = engines(case.model, *settings, *case.save_args)
    first = never_restarted.complete(prompt, N_FIRST)
    held = first["n_tokens_held"]
    assert held == case.n_prompt + N_FIRST - 1
    held_digest = never_restarted.status()["tokens_held_digest"]
    save = never_restarted.all_lines("SAVE", {"path": str(path)})
    assert save[-1]["event"] == "result", save[-1]
    assert save[-1]["n_saved"] == held and save[-1]["n_written"] == path.stat().st_size
    assert {"copy", "flush", "rename"} <= {line["phase"] for line in save if line["event"] == "progress"}
    next_turn = prompt + first["tokens"] + [1500 + i for i in range(6)]
    expected = never_restarted.complete(next_turn, N_NEXT)
    # gemma3: a turn that leaves the last reply at its first token can resume only at the end of the
    # first prompt (the deepest checkpoint); the never-restarted process has it too.
    diverging = prompt + [1499]
    expected_diverging = never_restarted.complete(diverging, N_NEXT) if case.model == "gemma3" else None
    # Greedy turns draw nothing: the sampler state is still the saved one, so a sampled turn with seed -1
    # (continue the engine's generator) must draw the same tokens after the restart.
    sampled_turn = {
        "prompt": next_turn + expected["tokens"],
        "n_predict": N_NEXT,
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "seed": -1,
        "ignore_eos": True,
    }
    expected_sampled = never_restarted.result("COMPLETE", sampled_turn)
    assert never_restarted.quit() == 0

    restarted = engines(case.model, *settings, *case.restore_args)
    restore = restarted.result("RESTORE", {"path": str(path)})
    assert restore["n_restored"] == held and restore["n_read"] >= path.stat().st_size
    assert restore["mode"] == {"streaming": "streaming"}.get(case.restore_args[-1], "staged")
    assert 0 < restore["read_pass_ms"] + restore["apply_ms"] <= restore["restore_ms"] * 1.001 + 0.01
    status = restarted.status()
    assert status["n_tokens_held"] == held and status["tokens_held_digest"] == held_digest
    got = restarted.complete(next_turn, N_NEXT)
    assert got["timings"]["cache_n"] >= 0.999 * held
    assert got["timings"]["cache_n"] == expected["timings"]["cache_n"] == held
    assert got["tokens"] == expected["tokens"]
    if expected_diverging is not None:
        got_diverging = restarted.complete(diverging, N_NEXT)
        assert (
            got_diverging["timings"]["cache_n"] == expected_diverging["timings"]["cache_n"] == case.n_prompt
        )
        assert got_diverging["tokens"] == expected_diverging["tokens"]
    got_sampled = restarted.result("COMPLETE", sampled_turn)
    assert got_sampled["tokens"] == expected_sampled["tokens"]
    assert got_sampled["seed"] == expected_sampled["seed"]


# ---- refusals keep the live conversation ------------------------------------------------------------

REFUSAL_CTX = 256


def synthetic_file(
    path: Path,
    model: str,
    *,
    n_ctx: int = REFUSAL_CTX,
    kv_type: str = "f16",
    n_tokens: int = 40,
    seed: int = 0,
    engine_version: str | None = None,
) -> Path:
    """A valid session file of random K/V written by the engine's adapter under the identity of an engine
    process started with `--ctx-size n_ctx --kv-type kv_type` (another engine version if given)."""
    model_path = MODEL_PATHS[model]()
    gguf = read_gguf(model_path)
    config = ModelConfig.from_gguf(gguf)
    settings = EngineSettings(model_path, n_ctx=n_ctx, kv_type=kv_type, backend="numpy")
    pool = KVPool(KVGeometry.from_config(config, n_ctx, KVType(kv_type)), get_ops("numpy", "f32"))
    runner = bare_runner(settings, gguf, config, make_placement(pool, None))
    rng = np.random.default_rng(seed)
    pool.begin_append(0, n_tokens)
    for i in range(pool.geometry.n_layers):
        layer = pool.layer(i)
        shape = (n_tokens, *layer.k.shape[1:])
        if layer.k_scale is None:
            parts = KVParts(*(rng.standard_normal(shape).astype(layer.k.dtype) for _ in range(2)))
        else:
            sshape = (n_tokens, *layer.k_scale.shape[1:])
            parts = KVParts(
                rng.integers(-127, 128, shape, dtype=np.int8),
                rng.integers(-127, 128, shape, dtype=np.int8),
                rng.random(sshape, dtype=np.float32),
                rng.random(sshape, dtype=np.float32),
            )
        pool.write(i, 0, parts)
    pool.commit_append(n_tokens)
    runner.restore_state(RunnerState(tuple(prompt_tokens(n_tokens, seed)), pool.ring_start))
    identity = runner_identity(runner, engine_version_override=engine_version) if engine_version else None
    sf.save(path, EngineSession(runner, identity=identity))
    return path


def _flip(data: bytes, offset: int) -> bytes:
    out = bytearray(data)
    out[offset] ^= 0x5A
    return bytes(out)


@pytest.mark.slow
def test_refusals_keep_the_live_conversation(engines, tmp_path):
    good = synthetic_file(tmp_path / "good.session", "smollm2", seed=1)
    good_bytes = good.read_bytes()
    data_offset = sf.inspect(good).layout.data_offset
    files: dict[str, tuple[Path, str]] = {
        "another model": (synthetic_file(tmp_path / "gemma3.session", "gemma3"), "model_mismatch"),
        "another K/V type": (
            synthetic_file(tmp_path / "int8.session", "smollm2", kv_type="int8"),
            "config_mismatch",
        ),
        "a smaller context than the file holds": (
            synthetic_file(
                tmp_path / "big.session", "smollm2", n_ctx=2 * REFUSAL_CTX, n_tokens=REFUSAL_CTX + 44
            ),
            "config_mismatch",
        ),
        "another engine version": (
            synthetic_file(tmp_path / "version.session", "smollm2", engine_version="0.0.0-another"),
            "config_mismatch",
        ),
    }
    for name, data, reason in (
        ("a flipped K/V byte", _flip(good_bytes, data_offset + 1000), "payload_corrupt"),
        ("a flipped header byte", _flip(good_bytes, 20), "header_corrupt"),
        ("a truncated file", good_bytes[:-4096], "truncated"),
    ):
        bad = tmp_path / (name.replace(" ", "-").replace("/", "") + ".session")
        bad.write_bytes(data)
        files[name] = (bad, reason)
    link = tmp_path / "link.session"
    link.symlink_to(good)
    files["a symlink"] = (link, "symlink")
    linked = tmp_path / "linked.session"
    linked.write_bytes(good_bytes)
    os.link(linked, tmp_path / "second-name.session")
    files["a second hard link"] = (linked, "multiple_links")

    engine = engines("smollm2", "--ctx-size", str(REFUSAL_CTX))
    empty = engine.result(
        "SAVE", {"path": str(tmp_path / "empty.session")}
    )  # nothing held: a valid file of 0 tokens
    assert empty["n_saved"] == 0 and sf.inspect(tmp_path / "empty.session").metadata.state.n_tokens == 0
    live_prompt = prompt_tokens(60, seed=9)
    first = engine.complete(live_prompt, 2)
    live = engine.status()
    for name, (path, reason) in files.items():
        answer = engine.command("RESTORE", {"path": str(path)})
        assert answer["event"] == "error", f"{name}: accepted"
        error = answer["error"]
        assert (error["type"], error["reason"]) == ("session_refused", reason), f"{name}: {error}"
        if name == "another K/V type":
            assert "kv_type" in error["message"]
        if name == "a smaller context than the file holds":
            assert "n_ctx" in error["message"]
        if name == "another engine version":
            assert "engine_version" in error["message"] and "0.0.0-another" in error["message"]
        assert engine.status()["tokens_held_digest"] == live["tokens_held_digest"], name
        turn = engine.complete(live_prompt, 2)  # the same turn again: same tokens from the held prefix
        assert turn["tokens"] == first["tokens"], name
        assert turn["timings"]["cache_n"] == len(live_prompt) - 1, name
    # The undamaged file itself is accepted (so each refusal was about its damage).
    assert engine.result("RESTORE", {"path": str(good)})["n_restored"] == 40
    assert engine.quit() == 0


# ---- the gate ------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "mode"), [("restore-after-gate", "streaming"), ("restore-at-commit", "staged")]
)
def test_a_fault_after_the_gate_erases_that_slot_only_and_the_other_streams_on(
    engines, tmp_path, fault, mode
):
    good = synthetic_file(tmp_path / "good.session", "smollm2", seed=2)
    engine = engines(
        "smollm2",
        "--parallel",
        "2",
        "--ctx-size",
        str(2 * REFUSAL_CTX),
        "--restore-mode",
        mode,
        env={FAULT_ENV: fault},
    )
    engine.complete(prompt_tokens(20, seed=3), 2)  # slot 0 holds a conversation
    stream = {
        "id": "s",
        "slot": 1,
        "prompt": prompt_tokens(12, seed=4),
        "n_predict": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    engine.send("COMPLETE", stream)
    assert engine.next_line()["id"] == "s"  # slot 1 streams
    engine.send("RESTORE", {"id": "r", "slot": 0, "path": str(good)})
    terminal: dict[str, dict] = {}
    while len(terminal) < 2:
        line = engine.next_line()
        if line["event"] in ("result", "error"):
            terminal[line["id"]] = line
    error, result = terminal["r"], terminal["s"]
    assert (error["event"], error["slot"], error["error"]["type"]) == ("error", 0, "slot_failed"), error
    assert "slot 0 was erased" in error["error"]["message"]
    assert (
        engine.status(0)["n_tokens_held"] == 0 and engine.proc.poll() is None
    )  # that slot only; still serving
    alone = engine.result("COMPLETE", {**stream, "id": "again", "cache_prompt": False})
    assert result["stop_type"] == "limit" and result["tokens"] == alone["tokens"]  # the stream was intact
    assert engine.quit() == 0


@pytest.mark.slow
def test_a_fault_before_the_gate_is_a_clean_refusal(engines, tmp_path):
    good = synthetic_file(tmp_path / "good.session", "smollm2", seed=2)
    engine = engines("smollm2", "--ctx-size", str(REFUSAL_CTX), env={FAULT_ENV: "restore-before-gate"})
    live_prompt = prompt_tokens(20, seed=3)
    first = engine.complete(live_prompt, 3)
    digest = engine.status()["tokens_held_digest"]
    answer = engine.command("RESTORE", {"path": str(good)})
    assert answer["event"] == "error" and answer["error"]["type"] == "session_refused", answer
    assert answer["error"]["reason"] == "adapter_failed" and "before the gate" in answer["error"]["message"]
    assert engine.status()["tokens_held_digest"] == digest
    assert engine.complete(live_prompt, 3)["tokens"] == first["tokens"]
    assert engine.quit() == 0
