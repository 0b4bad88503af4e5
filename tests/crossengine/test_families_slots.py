"""llama.cpp slot files of the qwen2 and qwen3 families against llama.cpp b11549 (xllamacpp's in-process
llama-server), both ways, V rows (flash attention on) and V transposed (off), on the tiny random-weight models
of support/families.py (the Q8_0 files test_families_llamacpp.py checks the engines' forwards on; f16 caches
on both sides). convert accepts these architectures from their geometry rows (spec/llama-cpp-slot.md); this is
what proves the rows right:

- llama-server continues a prompt and saves its slot -> converted -> strata-engine restores every cell, reuses
  every token and continues as it does cold (up to a near tie: the engines' K/V differ in their last bits);
- strata-engine prefills and saves -> converted to llama.cpp's layout -> llama-server restores, reuses every
  token (`timings.cache_n`) and continues as it does cold (up to a near tie of its own cold run).

Greedy picks are confined to ASCII tokens on llama-server's side (as in test_families_llamacpp.py: it returns
no log-probabilities after a token that leaves its text incomplete UTF-8).
"""

from __future__ import annotations

import numpy as np
import pytest
import strata_sessionfile as sf
from strata_engine.session import EngineSession, runner_identity
from strata_sessionfile import llamacpp as L
from support.families import BOS, EOS

from .continuation import assert_same_until_a_near_tie, best_gap, greedy
from .llama_server import FLASH_ATTN, LlamaServer

FAMILIES = ("qwen2", "qwen3")
N_REPLY = 8
TOP_K = 5
NEAR_TIE = 0.5  # a top-1 lead (log-probability) under which the engines' last bits may pick another token
BANNED = [*range(128, 256), EOS]  # bytes that open or continue a multi-byte character; the end of generation


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(32, 128, n).tolist()


PROMPT = [BOS, *_tokens(43, 31)]
MORE = _tokens(44, 5)  # the next turn's new tokens


@pytest.fixture(scope="module", params=[(f, layout) for f in FAMILIES for layout in ("v_rows", "v_trans")])
def case(request, family_files, tmp_path_factory):
    """(family's Q8_0 file, llama-server with that V layout, a strata-engine runner of the same file)."""
    from strata_engine.settings import EngineSettings
    from strata_engine.slots import SlotSet

    family, layout = request.param
    path = family_files(family, "q8_0")
    llama = LlamaServer(path, tmp_path_factory.mktemp(f"slots-{family}-{layout}"), FLASH_ATTN[layout])
    runner = SlotSet.load(EngineSettings(model_path=path, kv_type="f16", n_ctx=256)).runners[0]
    return path, llama, layout == "v_trans", runner


def _complete(llama: LlamaServer, tokens: list[int], **more: object) -> dict:
    return llama.complete(
        tokens, N_REPLY, logit_bias=[[t, False] for t in BANNED], ignore_eos=True, n_probs=TOP_K, **more
    )


def test_llama_server_slot_restores_in_strata_engine(case, tmp_path):
    path, llama, v_trans, runner = case
    llama.post("/slots/0?action=erase", {})
    _complete(llama, PROMPT)
    assert llama.post("/slots/0?action=save", {"filename": "llama.bin"})["n_saved"] > len(PROMPT)
    slot = L.read_slot_file(llama.slots / "llama.bin", L.model_geometry(path))
    assert slot.sections[0].v_trans is v_trans and list(slot.tokens[: len(PROMPT)]) == PROMPT

    out = tmp_path / "llama.ssf"
    L.slot_to_session(llama.slots / "llama.bin", path, out, config=runner_identity(runner).config)
    runner.erase()
    sf.restore(out, EngineSession(runner))
    n = runner.n_held
    assert n == slot.sections[0].n_cells
    turn = list(slot.tokens[:n]) + MORE
    cache_n, restored, steps = greedy(runner, turn, N_REPLY)
    assert cache_n == n  # every token of llama.cpp's conversation reused
    runner.erase()
    _, cold, cold_steps = greedy(runner, turn, N_REPLY)
    assert_same_until_a_near_tie(restored, cold, cold_steps)
    assert best_gap(steps[0], cold_steps[0]) < NEAR_TIE


def _lead(top: list[dict]) -> float:
    """How far llama.cpp's pick leads the next token it could have picked (banned tokens left out)."""
    allowed = [t["logprob"] for t in top if t["id"] not in BANNED]
    return allowed[0] - allowed[1] if len(allowed) > 1 else float("inf")


def test_strata_engine_session_restores_in_llama_server(case, tmp_path):
    path, llama, v_trans, runner = case
    runner.erase()
    runner.prefill(PROMPT)
    sf.save(tmp_path / "strata.ssf", EngineSession(runner))
    L.session_to_slot(
        tmp_path / "strata.ssf", path, llama.slots / "strata.bin", L.SlotOptions(v_trans=v_trans)
    )

    turn = PROMPT + MORE
    llama.post("/slots/0?action=erase", {})
    restored = llama.post("/slots/0?action=restore", {"filename": "strata.bin"})
    assert restored.get("n_restored") == len(PROMPT), restored
    warm = _complete(llama, turn)
    assert warm["timings"]["cache_n"] == len(PROMPT)  # every restored token reused
    llama.post("/slots/0?action=erase", {})
    cold = _complete(llama, turn)
    assert cold["timings"]["cache_n"] == 0
    differ = next(
        (i for i, (a, b) in enumerate(zip(warm["tokens"], cold["tokens"], strict=True)) if a != b), None
    )
    if differ is not None:
        top = cold["completion_probabilities"][differ]["top_logprobs"]
        assert _lead(top) < NEAR_TIE, (differ, top)
