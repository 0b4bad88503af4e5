"""Sampling functions one by one (penalties and logit bias by llama.cpp's formulas), the chain and its
order, the reported distributions, seeded reproducibility, and state capture/restore."""

from __future__ import annotations

import numpy as np
import pytest
from strata_engine.errors import SamplerStateError
from strata_engine.sampling import (
    Candidates,
    Sampler,
    SamplerState,
    SamplingParams,
    best_indices,
    draw,
    final_probs,
    greedy,
    log_softmax,
    logit_bias,
    min_p,
    penalties,
    softmax,
    sort_descending,
    temperature,
    token_logprob,
    top_k,
    top_n_logprobs,
    top_p,
)

LOGITS = np.array([1.0, 3.0, -2.0, 2.0, 0.5, 3.0 - 1e-3], dtype=np.float32)


def test_softmax_and_log_softmax():
    p = softmax(LOGITS)
    assert p.sum() == pytest.approx(1.0)
    assert np.allclose(np.log(p), log_softmax(LOGITS))
    assert np.allclose(softmax(np.array([1000.0, 1000.0])), [0.5, 0.5])  # no overflow


def test_top_n_logprobs_best_first():
    top = top_n_logprobs(LOGITS, 3)
    assert [i for i, _ in top] == [1, 5, 3]
    assert top[0][1] == pytest.approx(float(log_softmax(LOGITS)[1]))
    assert top_n_logprobs(LOGITS, 0) == [] and len(top_n_logprobs(LOGITS, 100)) == 6


def test_greedy():
    assert greedy(LOGITS) == 1


def test_token_logprob_and_best_indices():
    assert token_logprob(LOGITS, 2) == pytest.approx(float(log_softmax(LOGITS)[2]))
    assert best_indices(np.array([1.0, 5.0, 5.0, -1.0]), 3).tolist() == [1, 2, 0]  # ties in index order
    assert best_indices(LOGITS, 0).tolist() == []


def test_repeat_penalty_divides_positive_multiplies_negative():
    out = penalties(LOGITS, [1, 2, 2, 99, -1], repeat=2.0)  # out-of-range ids ignored, repeats once
    assert out[1] == pytest.approx(1.5) and out[2] == pytest.approx(-4.0)
    assert np.array_equal(np.delete(out, [1, 2]), np.delete(LOGITS, [1, 2]))
    assert penalties(LOGITS, [1], repeat=1.0) is LOGITS and penalties(LOGITS, [], repeat=2.0) is LOGITS


def test_frequency_and_presence_penalties_follow_llama_cpp():
    recent = [3, 3, 3, 0, 2]  # counts: 3 x3, 0 x1, 2 x1
    out = penalties(LOGITS, recent, repeat=1.5, frequency=0.25, presence=0.5)
    counts = np.bincount(recent, minlength=LOGITS.size)
    for i, logit in enumerate(LOGITS.tolist()):
        if counts[i] == 0:
            assert out[i] == logit
        else:  # llama.cpp: repeat first (divide a positive logit, multiply a negative one), then subtract
            repeated = logit / 1.5 if logit > 0 else logit * 1.5
            assert out[i] == pytest.approx(repeated - counts[i] * 0.25 - 0.5, rel=1e-6)
    # the distribution moves away from the repeated tokens, by the frequency for each occurrence
    assert softmax(out)[3] < softmax(penalties(LOGITS, [3], frequency=0.25))[3] < softmax(LOGITS)[3]
    presence_only = penalties(LOGITS, recent, presence=0.5)
    assert presence_only[3] == pytest.approx(LOGITS[3] - 0.5)  # presence counts a token once


def test_logit_bias_adds_and_bans():
    out = logit_bias(LOGITS, [(0, 2.0), (1, -np.inf), (0, 0.5), (4, -1.0)])
    assert out[0] == pytest.approx(LOGITS[0] + 2.5) and out[1] == -np.inf and out[4] == pytest.approx(-0.5)
    assert greedy(out) == 0 and greedy(logit_bias(LOGITS, [(1, -np.inf)])) == 5  # a ban: the next one wins
    assert logit_bias(LOGITS, []) is LOGITS


def test_chain_order_is_bias_then_penalties():
    params = SamplingParams(temperature=0.0, repeat_penalty=2.0, logit_bias=((0, 3.0),))
    out = Sampler(params, SamplerState.seeded(0)).adjusted(LOGITS, [0])
    assert out[0] == pytest.approx((LOGITS[0] + 3.0) / 2.0)  # llama.cpp: logit bias, then penalties


def test_final_probs():
    c = Candidates.from_logits(LOGITS)
    assert final_probs(c, is_greedy=False) == pytest.approx(softmax(LOGITS))
    assert final_probs(c, is_greedy=True).tolist() == [0, 1, 0, 0, 0, 0]


def test_top_k():
    c = top_k(Candidates.from_logits(LOGITS), 2)
    assert c.ids.tolist() == [1, 5] and c.sorted
    assert len(top_k(Candidates.from_logits(LOGITS), 0)) == 6


def test_top_p_keeps_smallest_prefix_reaching_p():
    c = Candidates.from_logits(LOGITS)
    probs = np.sort(softmax(LOGITS))[::-1]
    kept = top_p(c, float(probs[0] + probs[1]) - 1e-6)
    assert kept.ids.tolist() == [1, 5]
    assert top_p(c, 1e-9).ids.tolist() == [1]  # at least one
    assert len(top_p(c, 1.0)) == 6


def test_min_p_relative_to_best():
    c = Candidates.from_logits(LOGITS)
    kept = min_p(c, float(np.exp(-1.5)))  # keeps logits >= 3 - 1.5
    assert sorted(kept.ids.tolist()) == [1, 3, 5]
    assert len(min_p(c, 0.0)) == 6


def test_temperature_scales_logits():
    c = temperature(sort_descending(Candidates.from_logits(LOGITS)), 0.5)
    assert c.logits[0] == pytest.approx(6.0) and c.sorted


def test_draw_follows_the_distribution():
    rng = np.random.Generator(np.random.PCG64(0))
    c = Candidates.from_logits(np.log(np.array([0.7, 0.2, 0.1])))
    counts = np.bincount([draw(c, rng) for _ in range(4000)], minlength=3) / 4000
    assert np.allclose(counts, [0.7, 0.2, 0.1], atol=0.03)


def test_greedy_params_ignore_rng():
    sampler = Sampler(SamplingParams(temperature=0.0), SamplerState.seeded(1))
    before = sampler.state
    assert sampler.sample(LOGITS) == 1 and sampler.state == before


def _run(sampler: Sampler, steps: int, rng_logits: np.random.Generator) -> list[int]:
    return [sampler.sample(rng_logits.normal(size=50).astype(np.float32) * 3) for _ in range(steps)]


def test_seeded_sampling_is_reproducible():
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.01)
    a = _run(Sampler(params, SamplerState.seeded(42)), 40, np.random.default_rng(5))
    b = _run(Sampler(params, SamplerState.seeded(42)), 40, np.random.default_rng(5))
    c = _run(Sampler(params, SamplerState.seeded(43)), 40, np.random.default_rng(5))
    assert a == b and a != c


def test_state_capture_restore_continues_exactly():
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    logits_rng = np.random.default_rng(9)
    sampler = Sampler(params, SamplerState.seeded(7))
    _run(sampler, 10, logits_rng)
    captured = sampler.state.to_bytes()
    assert len(captured) == SamplerState.SIZE
    logits_state = logits_rng.bit_generator.state
    expected = _run(sampler, 20, logits_rng)
    logits_rng.bit_generator.state = logits_state
    restored = Sampler(params, SamplerState.from_bytes(captured))
    assert restored.state.seed == 7
    assert _run(restored, 20, logits_rng) == expected


def test_bad_state_bytes_are_refused():
    good = SamplerState.seeded(1).to_bytes()
    assert len(good) == 45  # seed u64, state u128, inc u128, has_uint32 u8, uinteger u32
    with pytest.raises(SamplerStateError, match="expected 45"):
        SamplerState.from_bytes(good[:-1])
    with pytest.raises(SamplerStateError, match="has_uint32"):
        SamplerState.from_bytes(good[:40] + b"\x07" + good[41:])
    even_inc = good[:24] + bytes([good[24] & 0xFE]) + good[25:]
    with pytest.raises(SamplerStateError, match="even"):
        SamplerState.from_bytes(even_inc)


def test_penalty_window():
    sampler = Sampler(SamplingParams(repeat_penalty=2.0, repeat_last_n=2), SamplerState.seeded(0))
    out = sampler.adjusted(LOGITS, [1, 3, 4])  # only 3 and 4 are inside the window
    assert out[1] == LOGITS[1] and out[3] == pytest.approx(1.0) and out[4] == pytest.approx(0.25)
    whole = Sampler(SamplingParams(repeat_penalty=2.0, repeat_last_n=-1), SamplerState.seeded(0))
    assert whole.adjusted(LOGITS, [1, 3, 4])[1] == pytest.approx(1.5)
    off = Sampler(SamplingParams(presence_penalty=1.0, repeat_last_n=0), SamplerState.seeded(0))
    assert off.adjusted(LOGITS, [1]) is LOGITS


def test_top_p_on_a_large_vocabulary_equals_the_full_sort():
    rng = np.random.default_rng(3)
    for scale in (0.5, 3.0, 10.0):
        logits = (rng.normal(size=50_000) * scale).astype(np.float32)
        for p in (0.1, 0.9, 0.999):
            fast = top_p(Candidates.from_logits(logits), p)
            full = top_p(sort_descending(Candidates.from_logits(logits)), p)
            assert fast.ids.tolist() == full.ids.tolist() and fast.sorted
