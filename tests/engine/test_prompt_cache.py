"""Prompt cache: reusing the held conversation gives what a cold run gives; rings and checkpoints make
earlier turn boundaries valid resume points on gemma3; the resident-ring placement reads the same K/V as
the pool; running state moves between runners; context limits and bad tokens are refused."""

from __future__ import annotations

import numpy as np
import pytest
from strata_engine.errors import ContextOverflow, EngineError, InvalidToken

from .runners import base_runner, sibling

# A resumed run evaluates tokens in other batch shapes than a cold run (decode steps, other chunk
# boundaries), so BLAS sums differ in the last bits: with f32 K/V the logits agree to LOGIT_ATOL and the
# greedy tokens are identical. (With f16 K/V such last-bit differences can flip an f16 rounding and move
# logits by ~5e-3, as they do in llama.cpp; the pool-vs-resident tests below are bit-exact in f16.)
LOGIT_ATOL = 1e-3


def _ids(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(100, 20000, n)]


def _greedy_from(runner, logits, n):
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = runner.decode(out[-1])
    return out, logits


@pytest.fixture(scope="module")
def smollm2():
    return sibling(base_runner("smollm2"), kv_type="f32", n_ctx=1024, prefill_chunk=64)


def test_reused_prefix_equals_cold_run(smollm2):
    warm = smollm2
    cold = sibling(smollm2)
    first = [1] + _ids(1, 150)
    warm.erase()
    res = warm.prefill(first)
    assert (res.cache_n, res.prompt_n) == (0, len(first))
    reply, _ = _greedy_from(warm, res.logits, 6)
    second = first + reply + _ids(2, 90)
    res2 = warm.prefill(second)
    # Every held token is reused (the reply's tokens were all evaluated by decode).
    assert res2.cache_n == len(first) + len(reply)
    assert res2.prompt_n == len(second) - res2.cache_n
    cold.erase()
    ref = cold.prefill(second)
    assert ref.cache_n == 0
    np.testing.assert_allclose(res2.logits, ref.logits, atol=LOGIT_ATOL)
    assert _greedy_from(warm, res2.logits, 8)[0] == _greedy_from(cold, ref.logits, 8)[0]
    # A prompt that diverges early keeps only the common prefix.
    third = first[:40] + _ids(3, 20)
    res3 = warm.prefill(third)
    assert res3.cache_n == 40
    cold.erase()
    np.testing.assert_allclose(res3.logits, cold.prefill(third).logits, atol=LOGIT_ATOL)
    assert list(warm.tokens_held) == third


def test_a_stopped_prefill_keeps_its_chunks_and_the_next_one_resumes(smollm2):
    runner, cold = sibling(smollm2), sibling(smollm2)
    prompt = [1] + _ids(4, 300)
    asked = []

    def stop_after_two_chunks() -> bool:
        asked.append(runner.n_held)
        return len(asked) > 2

    runner.erase()
    stopped = runner.prefill(prompt, should_stop=stop_after_two_chunks)
    assert stopped.stopped and stopped.logits is None
    assert asked == [64, 128, 192]  # asked between chunks only, never before the first
    assert (stopped.cache_n, stopped.prompt_n) == (0, 192) and list(runner.tokens_held) == prompt[:192]
    resumed = runner.prefill(prompt)
    assert (resumed.cache_n, resumed.prompt_n) == (192, len(prompt) - 192)
    cold.erase()
    np.testing.assert_allclose(resumed.logits, cold.prefill(prompt).logits, atol=LOGIT_ATOL)


def test_whole_prompt_held_re_evaluates_the_last_token(smollm2):
    prompt = [1] + _ids(4, 70)
    smollm2.erase()
    first = smollm2.prefill(prompt)
    again = smollm2.prefill(prompt)
    assert (again.cache_n, again.prompt_n) == (len(prompt) - 1, 1)
    np.testing.assert_allclose(again.logits, first.logits, atol=LOGIT_ATOL)
    off = sibling(smollm2, prompt_cache=False)
    off.prefill(prompt)
    assert off.prefill(prompt).cache_n == 0


def test_erase_and_refusals(smollm2):
    small = sibling(smollm2, n_ctx=32)
    with pytest.raises(ContextOverflow) as exc:
        small.prefill(list(range(33)))
    assert (exc.value.n_prompt_tokens, exc.value.n_ctx) == (33, 32)
    res = small.prefill(list(range(100, 131)))
    small.decode(int(np.argmax(res.logits)))
    with pytest.raises(ContextOverflow):
        small.decode(5)
    assert len(small.tokens_held) == 32  # the refused step changed nothing
    with pytest.raises(InvalidToken):
        small.prefill([1, 10**6])
    with pytest.raises(EngineError):
        small.prefill([])
    assert small.erase() == 32
    assert small.tokens_held == () and small.pool.n_tokens == 0


def test_state_moves_between_runners(smollm2):
    """What the session adapter does: copy each layer's held K/V and the running state into another
    runner; its next turn is then bit-identical to the original's."""
    a = smollm2
    a.erase()
    prompt = [1] + _ids(5, 120)
    reply, _ = _greedy_from(a, a.prefill(prompt).logits, 3)
    b = sibling(a, kv_resident=50)
    for i in range(a.kv_geometry.n_layers):
        lo, hi = a.pool.held_range(i)
        b.pool.write(i, lo, a.pool.read(i, lo, hi))
    b.restore_state(a.snapshot_state())
    assert b.tokens_held == a.tokens_held
    follow = prompt + reply + _ids(6, 30)
    ra, rb = a.prefill(follow), b.prefill(follow)
    assert ra.cache_n == rb.cache_n == len(prompt) + len(reply)
    np.testing.assert_array_equal(ra.logits, rb.logits)


def test_resident_ring_equals_pool_placement(smollm2):
    pool = sibling(smollm2, kv_type="f16")
    resident = sibling(smollm2, kv_type="f16", kv_resident=48)
    prompt = [1] + _ids(7, 200)
    for runner in (pool, resident):
        runner.erase()
    a, b = pool.prefill(prompt), resident.prefill(prompt)
    np.testing.assert_array_equal(a.logits, b.logits)
    ta, la = _greedy_from(pool, a.logits, 6)
    tb, lb = _greedy_from(resident, b.logits, 6)
    assert ta == tb
    np.testing.assert_array_equal(la, lb)
    turn = prompt[:150] + _ids(8, 40)  # cut back below the resident ring's span, then extend
    np.testing.assert_array_equal(pool.prefill(turn).logits, resident.prefill(turn).logits)
    stats = resident.placement.stats()
    assert stats.resident_tokens_read > 0 and stats.host_tokens_read > 0


@pytest.mark.slow
def test_gemma3_long_conversation_matches_cold_runs():
    """A gemma3 conversation longer than 2x the 512-token window, over several turns: a turn resumed from
    the rings, and a turn that diverges where the rings no longer reach (resumed from the checkpoint at
    the end of the first prompt) both equal cold runs; the resident-ring placement follows bit for bit."""
    base = base_runner("gemma3")
    warm = sibling(base, kv_type="f32", n_ctx=2048)
    resident = sibling(warm, kv_resident=200)
    cold = sibling(warm)
    window = base.config.max_window
    assert window == 512
    p1 = [2] + _ids(11, 1099)  # 1,100 tokens > 2 x window
    x = _ids(12, 520)
    y = _ids(13, 60)

    def turns(runner):
        runner.erase()
        out = []
        r1 = runner.prefill(p1)
        g1, _ = _greedy_from(runner, r1.logits, 4)
        r2 = runner.prefill(p1 + g1 + x)
        out.append((r1, g1, r2))
        g2, _ = _greedy_from(runner, r2.logits, 4)
        # The rings now hold [n - 1024, n) with n = 1,628: resuming at 1,100 needs [589, 1100): gone.
        assert not runner.pool.can_resume(len(p1))
        r3 = runner.prefill(p1 + y)
        out.append((g2, r3, _greedy_from(runner, r3.logits, 4)[0]))
        return out

    (w1, wg1, w2), (wg2, w3, wg3) = turns(warm)
    assert w2.cache_n == len(p1) + len(wg1)  # resumed from the rings
    assert w3.cache_n == len(p1)  # resumed from the checkpoint taken at the end of the first prompt
    # The checkpoint at the end of the second prompt was dropped with the cut; the third prompt's is new.
    assert [c.position for c in warm.checkpoints] == [len(p1), len(p1) + len(y)]

    cold.erase()
    c2 = cold.prefill(p1 + wg1 + x)
    np.testing.assert_allclose(w2.logits, c2.logits, atol=LOGIT_ATOL)
    assert _greedy_from(cold, c2.logits, 4)[0] == wg2
    cold.erase()
    c3 = cold.prefill(p1 + y)
    np.testing.assert_allclose(w3.logits, c3.logits, atol=LOGIT_ATOL)
    assert _greedy_from(cold, c3.logits, 4)[0] == wg3

    (r1, rg1, r2), (rg2, r3, rg3) = turns(resident)
    np.testing.assert_array_equal(r2.logits, w2.logits)
    np.testing.assert_array_equal(r3.logits, w3.logits)
    assert (rg1, rg2, rg3) == (wg1, wg2, wg3)


def test_failed_forward_keeps_a_consistent_conversation(smollm2, monkeypatch):
    runner = sibling(smollm2)
    prompt = [1] + _ids(9, 100)
    runner.prefill(prompt)
    real = runner.placement.attend

    def failing(layer, *args, **kwargs):
        if layer == 7:
            raise KeyboardInterrupt("cancelled mid-forward")
        return real(layer, *args, **kwargs)

    monkeypatch.setattr(runner.placement, "attend", failing)
    with pytest.raises(KeyboardInterrupt):
        runner.prefill(prompt + _ids(10, 150))
    monkeypatch.undo()
    assert list(runner.tokens_held) == prompt[: len(runner.tokens_held)]
    assert runner.pool.n_tokens == len(runner.tokens_held)
    follow = prompt + _ids(10, 20)
    cold = sibling(smollm2)
    np.testing.assert_allclose(runner.prefill(follow).logits, cold.prefill(follow).logits, atol=LOGIT_ATOL)
