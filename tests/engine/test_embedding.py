"""EMBED (embedding.py) on the real models: the scratch evaluation is the model's own forward pass, the
pooling and normalization are llama-server's, and the held conversation is left exactly as it was."""

from __future__ import annotations

import numpy as np
import pytest
from strata_engine.chat import ChatTemplate
from strata_engine.embedding import embed, hidden_states, model_pooling, normalize
from strata_engine.errors import ContextOverflow, InvalidRequest, InvalidToken
from strata_engine.protocol import FimToken, Request
from strata_engine.serve import build_registry, ready_line, serve_context
from strata_engine.settings import Pooling
from strata_engine.tokenizer import Tokenizer

from .inprocess import InProcessEngine
from .runners import base_runner, sharing, sibling

TEXT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def smollm2():
    runner = base_runner("smollm2")
    return runner, Tokenizer.from_gguf_metadata(runner.gguf.metadata)


def logits_of_last_row(runner, h: np.ndarray) -> np.ndarray:
    ops = runner.model.ops
    return ops.logits(ops.asarray(h[-1:]), runner.model.output)[0]


def test_the_scratch_pass_is_the_models_forward_pass(smollm2):
    runner, tok = smollm2
    ids = tok.encode(TEXT, add_special=True)
    h = hidden_states(runner.model, ids, chunk=4)  # several chunks on the scratch K/V
    assert h.shape == (len(ids), runner.config.n_embd) and h.dtype == np.float32
    fresh = sibling(runner)
    np.testing.assert_allclose(logits_of_last_row(runner, h), fresh.prefill(ids).logits, atol=2e-4)


@pytest.mark.slow
def test_the_scratch_pass_keeps_gemma3s_sliding_window():
    runner = base_runner("gemma3")
    tok = Tokenizer.from_gguf_metadata(runner.gguf.metadata)
    ids = tok.encode(" ".join(f"w{i}" for i in range(260)), add_special=True)
    assert len(ids) > 512 + 256  # past the 512-token window, over several chunks
    h = hidden_states(runner.model, ids, chunk=256)
    fresh = sibling(runner, prefill_chunk=256)
    np.testing.assert_allclose(logits_of_last_row(runner, h), fresh.prefill(ids).logits, atol=2e-4)


def test_pooling_and_normalization(smollm2):
    runner, tok = smollm2
    ids = tok.encode(TEXT, add_special=True)
    rows = embed(runner, ids, Pooling.NONE)
    assert rows.shape == (len(ids), runner.config.n_embd)
    np.testing.assert_allclose(rows, hidden_states(runner.model, ids, 512))  # per token: not normalized
    for pooling, expected in (
        (Pooling.MEAN, rows.mean(axis=0)),
        (Pooling.CLS, rows[0]),
        (Pooling.LAST, rows[-1]),
    ):
        (vector,) = embed(runner, ids, pooling)
        np.testing.assert_allclose(vector, expected / np.linalg.norm(expected), rtol=1e-5, atol=1e-6)
        assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)
    same = embed(runner, list(ids), Pooling.MEAN)
    other = embed(runner, tok.encode("A completely different sentence."), Pooling.MEAN)
    assert np.array_equal(same, embed(runner, ids, Pooling.MEAN)) and not np.allclose(same, other)


def test_normalize_is_llamacpps_embd_normalize():
    v = np.array([3.0, -4.0, 1.0], dtype=np.float32)
    np.testing.assert_allclose(normalize(v, -1), v)
    np.testing.assert_allclose(normalize(v, 0), v * (32760.0 / 4.0))
    np.testing.assert_allclose(normalize(v, 1), v / 8.0)
    np.testing.assert_allclose(normalize(v, 2), v / np.sqrt(26.0))
    np.testing.assert_allclose(normalize(v, 3), v / (27 + 64 + 1) ** (1 / 3), rtol=1e-6)
    assert not normalize(np.zeros(3, dtype=np.float32), 2).any()


def test_embed_leaves_the_held_conversation_as_it_was(smollm2):
    runner, tok = smollm2
    slots = sharing(runner, n_ctx=256, prefill_chunk=4)
    slot = slots.runners[0]
    held = tok.encode("<|im_start|>user\nHello there<|im_end|>\n", add_special=True)
    slot.prefill(held)
    before = (slot.tokens_held, slot.snapshot_state().ring_start, np.array(slot.pool.layer(0).k, copy=True))
    engine = InProcessEngine(slots, tok, ChatTemplate.for_model(slot.gguf.metadata, tok))
    try:
        answer = engine.command("EMBED", {"id": "e", "tokens": tok.encode(TEXT), "pooling": "mean"})
    finally:
        engine.close()
    assert engine.scheduler.steps == -(-len(tok.encode(TEXT)) // 4)  # a chunk per step
    np.testing.assert_allclose(
        answer["embedding"][0], embed(slot, tok.encode(TEXT), Pooling.MEAN)[0], rtol=1e-5
    )
    assert len(answer["embedding"]) == 1 and len(answer["embedding"][0]) == runner.config.n_embd
    assert answer["n_tokens"] == len(tok.encode(TEXT))
    assert slot.tokens_held == before[0] and slot.snapshot_state().ring_start == before[1]
    assert np.array_equal(np.asarray(slot.pool.layer(0).k), before[2])
    assert slot.prefill(held + tok.encode("More")).cache_n == len(held)  # the next turn reuses it all


def test_embed_refuses_bad_arguments(smollm2):
    runner, tok = smollm2
    ctx = serve_context(sharing(runner, n_ctx=16), tok, None)
    handler = build_registry().get("EMBED").handler

    def call(args):
        return handler(ctx, Request("EMBED", args))

    with pytest.raises(InvalidRequest) as exc:
        call({"tokens": "abc", "pooling": "rank", "normalize": -2})
    assert len(exc.value.problems) == 3
    with pytest.raises(InvalidRequest):
        call({"tokens": []})
    with pytest.raises(InvalidToken):
        call({"tokens": [1, 10**6]})
    with pytest.raises(ContextOverflow):
        call({"tokens": [1] * 17})


def test_ready_line_names_fim_tokens_and_pooling(smollm2):
    runner, tok = smollm2
    ready = ready_line(sharing(runner, n_ctx=64), tok, ChatTemplate.for_model(runner.gguf.metadata, tok))
    assert ready["fim_tokens"] == {role.value: (4 if role is FimToken.REP else None) for role in FimToken}
    assert ready["pooling"] == "none"  # SmolLM2 names none: llama.cpp's default
    meta = {"llama.pooling_type": 1}
    assert (
        model_pooling(meta, "llama") is Pooling.MEAN
        and model_pooling({"llama.pooling_type": 4}, "llama") is Pooling.NONE
        and model_pooling({}, "gemma3") is Pooling.NONE
    )
