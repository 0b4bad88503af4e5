"""llama.cpp's slot files against the real llama.cpp (b11549, xllamacpp's in-process llama-server) and
strata-engine, both ways, on SmolLM2 with f16 caches: V transposed (flash attention off) and V rows (on).

llama-server saves -> converted -> strata-engine restores every token and its greedy continuation equals
its own cold one; strata-engine saves -> converted -> llama-server restores, reuses every token
(`timings.cache_n`) and continues as it does cold.
"""

from __future__ import annotations

import pytest
import strata_sessionfile as sf
from strata_engine.session import EngineSession, runner_identity
from strata_sessionfile import llamacpp as L

from .continuation import N_REPLY, assert_same_until_a_near_tie, best_gap, greedy
from .llama_server import FLASH_ATTN, LlamaServer

PROMPT = (
    "<|im_start|>user\nName three colours and say why the sky is blue.<|im_end|>\n<|im_start|>assistant\n"
)


def test_llama_server_slot_restores_in_strata_engine(llama, runner, smollm2_path, tmp_path):
    prompt = llama.tokenize(PROMPT)
    first = llama.complete(prompt, N_REPLY)
    saved = llama.post("/slots/0?action=save", {"filename": "chat.bin"})
    assert saved["n_saved"] > len(prompt)
    slot = L.read_slot_file(llama.slots / "chat.bin", L.model_geometry(smollm2_path))
    assert slot.sections[0].v_trans is llama.v_trans
    assert list(slot.tokens[: len(prompt)]) == prompt

    out = tmp_path / "chat.ssf"
    L.slot_to_session(llama.slots / "chat.bin", smollm2_path, out, config=runner_identity(runner).config)
    info = sf.inspect(out)
    n = info.metadata.state.n_tokens
    assert (
        n == slot.sections[0].n_cells
        and info.header.model_fingerprint == runner_identity(runner).model.fingerprint
    )

    runner.erase()
    sf.restore(out, EngineSession(runner))
    assert runner.n_held == n
    turn = list(slot.tokens[:n]) + llama.tokenize("<|im_end|>\n<|im_start|>user\nAnd grass?")[1:]
    cache_n, restored, steps = greedy(runner, turn)
    assert cache_n == n  # every token of llama.cpp's conversation reused
    runner.erase()
    _, cold, cold_steps = greedy(runner, turn)
    assert_same_until_a_near_tie(restored, cold, cold_steps)
    assert best_gap(steps[0], cold_steps[0]) < 0.5
    assert first["tokens"]  # llama-server produced the reply that the slot holds


def test_strata_engine_session_restores_in_llama_server(llama, runner, smollm2_path, tmp_path):
    prompt = llama.tokenize(PROMPT)
    runner.erase()
    runner.prefill(prompt)
    ssf = tmp_path / "strata.ssf"
    sf.save(ssf, EngineSession(runner))
    L.session_to_slot(ssf, smollm2_path, llama.slots / "strata.bin", L.SlotOptions(v_trans=llama.v_trans))

    turn = prompt + llama.tokenize("Blue, red")[1:]
    llama.post("/slots/0?action=erase", {})
    restored = llama.post("/slots/0?action=restore", {"filename": "strata.bin"})
    assert restored.get("n_restored") == len(prompt), restored
    warm = llama.complete(turn, N_REPLY)
    assert warm["timings"]["cache_n"] == len(prompt)  # every restored token reused
    llama.post("/slots/0?action=erase", {})
    cold = llama.complete(turn, N_REPLY, n_probs=2)
    assert cold["timings"]["cache_n"] == 0
    # strata-engine's K/V are not llama.cpp's bit for bit: the replies agree up to a step where llama.cpp's
    # own cold run was near a tie between its two best tokens
    pairs = zip(warm["tokens"], cold["tokens"], strict=True)
    differ = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
    if differ is not None:
        top = cold["completion_probabilities"][differ]["top_logprobs"]
        assert abs(top[0]["logprob"] - top[1]["logprob"]) < 0.5, (differ, top)


def test_llama_server_refuses_nothing_it_wrote_back(llama, smollm2_path, tmp_path):
    """A slot file through format v1 and back is byte for byte the one llama-server wrote."""
    prompt = llama.tokenize(PROMPT)
    llama.post("/slots/0?action=erase", {})
    llama.complete(prompt, 4)
    llama.post("/slots/0?action=save", {"filename": "again.bin"})
    src = llama.slots / "again.bin"
    L.slot_to_session(src, smollm2_path, tmp_path / "again.ssf")
    L.session_to_slot(
        tmp_path / "again.ssf", smollm2_path, tmp_path / "back.bin", L.SlotOptions(v_trans=llama.v_trans)
    )
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()


def test_gemma3_iswa_slot_file_through_v1_keeps_every_state_byte(gemma3_path, tmp_path):
    """gemma3's two caches (3 global layers holding every token, 15 sliding-window layers holding the last
    512) past the window: through format v1 and back, the state is byte for byte llama-server's; its
    context-checkpoint appendix is not carried over; strata-engine restores it and continues as it does cold."""
    llama = LlamaServer(gemma3_path, tmp_path, FLASH_ATTN["v_rows"])
    text = " ".join(f"w{i}" for i in range(300))
    llama.complete(llama.tokenize(text), 2)
    llama.post("/slots/0?action=save", {"filename": "g.bin"})
    src = tmp_path / "g.bin"
    slot = L.read_slot_file(src, L.model_geometry(gemma3_path))
    full, swa = slot.sections
    assert full.n_cells > 512 and swa.n_cells == 512 and len(full.k) == 3 and len(swa.k) == 15
    assert min(swa.positions) == full.n_cells - 512
    L.slot_to_session(src, gemma3_path, tmp_path / "g.ssf")
    held = [g.tokens_held for g in sf.inspect(tmp_path / "g.ssf").metadata.layers]
    assert held == [full.n_cells if i % 6 == 5 else 512 for i in range(18)]
    L.session_to_slot(tmp_path / "g.ssf", gemma3_path, tmp_path / "back.bin")
    # the window cache's cells come back in position order (llama-server's ring may start mid-cache): the
    # same state, so converting it again gives the same format v1 payload
    L.slot_to_session(tmp_path / "back.bin", gemma3_path, tmp_path / "again.ssf")
    assert sf.inspect(tmp_path / "again.ssf").payload_hash == sf.inspect(tmp_path / "g.ssf").payload_hash
    again = L.read_slot_file(tmp_path / "back.bin", L.model_geometry(gemma3_path))
    assert again.checkpoints == 0 and list(again.sections[1].positions) == sorted(swa.positions)

    # strata-engine restores it (the window layers' last 512 cells only) and continues as it does cold
    from strata_engine.settings import EngineSettings
    from strata_engine.slots import SlotSet

    runner = SlotSet.load(EngineSettings(model_path=gemma3_path, kv_type="f16", n_ctx=2048)).runners[0]
    L.slot_to_session(src, gemma3_path, tmp_path / "e.ssf", config=runner_identity(runner).config)
    sf.restore(tmp_path / "e.ssf", EngineSession(runner))
    assert runner.n_held == full.n_cells
    turn = list(slot.tokens[: full.n_cells]) + llama.tokenize(" w300 w301")[1:]
    cache_n, restored, steps = greedy(runner, turn, 4)
    assert cache_n == full.n_cells
    runner.erase()
    _, cold, cold_steps = greedy(runner, turn, 4)
    assert_same_until_a_near_tie(restored, cold, cold_steps)
    assert (
        best_gap(steps[0], cold_steps[0]) < 1.0
    )  # gemma3's Q4_K products: llama.cpp quantizes the activations


@pytest.mark.parametrize("rotated", [True, False])
def test_q8_0_slot_file_dequantized_restores_in_strata_engine(
    runner, smollm2_path, tmp_path, monkeypatch, rotated
):
    """llama.cpp's q8_0 cache, Hadamard-rotated (its default: n_rot_k = n_rot_v = 64 for SmolLM2's 64-value
    heads) or not (LLAMA_ATTN_ROT_DISABLE=1): dequantized to f16 (the rotation undone) it restores in
    strata-engine, every token reused, the same greedy continuation as its cold one."""
    if not rotated:
        monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", "1")  # read when llama.cpp builds its cache
    llama = LlamaServer(smollm2_path, tmp_path, FLASH_ATTN["v_rows"], kv_type="GGML_TYPE_Q8_0")
    prompt = llama.tokenize(PROMPT)
    llama.complete(prompt, 4)
    llama.post("/slots/0?action=save", {"filename": "q8.bin"})
    src, out = tmp_path / "q8.bin", tmp_path / "q8.ssf"
    slot = L.read_slot_file(src, L.model_geometry(smollm2_path))
    assert {p.ggml_type for p in slot.sections[0].k} == {L.GGMLType.Q8_0}
    assert (slot.sections[0].n_rot_k, slot.sections[0].n_rot_v) == ((64, 64) if rotated else (0, 0))
    L.slot_to_session(src, smollm2_path, out, config=runner_identity(runner).config)
    runner.erase()
    sf.restore(out, EngineSession(runner))
    n = runner.n_held
    turn = list(slot.tokens[:n]) + llama.tokenize("<|im_end|>\n<|im_start|>user\nAnd grass?")[1:]
    cache_n, restored, steps = greedy(runner, turn)
    assert cache_n == n
    runner.erase()
    _, cold, cold_steps = greedy(runner, turn)
    assert_same_until_a_near_tie(restored, cold, cold_steps)
    assert best_gap(steps[0], cold_steps[0]) < 0.5


@pytest.mark.parametrize("rotated", [True, False])
def test_strata_engine_session_restores_in_llama_servers_q8_0_cache(
    runner, smollm2_path, tmp_path, monkeypatch, rotated
):
    """strata-engine's f16 session quantized to q8_0, rotated as llama.cpp rotates its cache (or not, for a
    llama.cpp run with LLAMA_ATTN_ROT_DISABLE=1): llama-server restores it, reuses every token and continues
    as it does cold (up to a near tie of its own cold run); without the rotation it refuses the file."""
    if not rotated:
        monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", "1")
    llama = LlamaServer(smollm2_path, tmp_path, FLASH_ATTN["v_rows"], kv_type="GGML_TYPE_Q8_0")
    prompt = llama.tokenize(PROMPT)
    runner.erase()
    runner.prefill(prompt)
    sf.save(tmp_path / "s.ssf", EngineSession(runner))
    q8 = L.GGMLType.Q8_0
    for name, rotate in (("other.bin", not rotated), ("q8.bin", rotated)):
        opts = L.SlotOptions(k_type=q8, v_type=q8, rotate=rotate)
        L.session_to_slot(tmp_path / "s.ssf", smollm2_path, tmp_path / name, opts)
    llama.post("/slots/0?action=erase", {})
    refused = llama.post("/slots/0?action=restore", {"filename": "other.bin"})
    assert "n_restored" not in refused, refused  # n_rot is checked against the cache's own
    restored = llama.post("/slots/0?action=restore", {"filename": "q8.bin"})
    assert restored.get("n_restored") == len(prompt), restored
    turn = prompt + llama.tokenize("Blue, red")[1:]
    warm = llama.complete(turn, N_REPLY)
    assert warm["timings"]["cache_n"] == len(prompt)
    llama.post("/slots/0?action=erase", {})
    cold = llama.complete(turn, N_REPLY, n_probs=2)
    differ = next(
        (i for i, (a, b) in enumerate(zip(warm["tokens"], cold["tokens"], strict=True)) if a != b), None
    )
    if differ is not None:
        top = cold["completion_probabilities"][differ]["top_logprobs"]
        assert abs(top[0]["logprob"] - top[1]["logprob"]) < 0.5, (differ, top)
