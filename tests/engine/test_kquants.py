"""The test files' K-quant encoder (support/kquants.py) read back by gguf-py's dequantization and by the engine's
packing: every value within a quantization step of what was written (a misplaced nibble, high bit or scale would
move values by whole steps), zeros and one-signed sub-blocks included."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from strata_engine.ops.packed import pack_tensor
from support.kquants import K_QUANTIZERS, quantize

T = gguf.GGMLQuantizationType
# q's largest value: a step is (max - min) / TOP (Q4_K, Q5_K) or max |w| / TOP (Q6_K) of a sub-block.
TOP = {T.Q4_K: 15, T.Q5_K: 31, T.Q6_K: 31}


def _weights() -> np.ndarray:
    rng = np.random.default_rng(7)
    w = (0.08 * rng.standard_normal((16, 512))).astype(np.float32)
    w[0, :256] = 0.0  # a zero super-block: d = 0
    w[1, :256] = np.abs(w[1, :256])  # no negative value: min 0
    w[2, :256] = -np.abs(w[2, :256])
    w[3, 256:] *= 100  # super-blocks of very different scales in one row
    return w


@pytest.mark.parametrize("qtype", list(K_QUANTIZERS), ids=lambda t: t.name)
def test_gguf_reads_back_what_was_written(qtype):
    w = _weights()
    raw = quantize(w, qtype)
    assert raw.shape == (16, 2 * gguf.GGML_QUANT_SIZES[qtype][1])
    back = gguf.quants.dequantize(raw, qtype)
    assert back.shape == w.shape
    # the step of the super-block (its widest sub-block's), and 1/63 of it again for the 6-bit scales' rounding
    blocks = w.reshape(-1, 256)
    spread = blocks.max(-1) - np.minimum(blocks.min(-1), 0) if qtype != T.Q6_K else np.abs(blocks).max(-1)
    step = np.repeat(spread / TOP[qtype], 256).reshape(w.shape)
    assert (np.abs(back - w) <= step * (0.5 + 1 / 32) + 1e-6).all()
    assert (back[0, :256] == 0).all()
    assert np.abs(back - w).mean() < 0.3 * np.abs(w).mean()  # far from a coarse approximation


@pytest.mark.parametrize("qtype", list(K_QUANTIZERS), ids=lambda t: t.name)
def test_the_engine_packs_the_values_gguf_reads(qtype):
    raw = quantize(_weights(), qtype)
    packed = pack_tensor(raw, qtype, (16, 512), "w")
    assert packed is not None
    np.testing.assert_array_equal(packed.dequantize(), gguf.quants.dequantize(raw, qtype))


def test_a_row_of_partial_super_blocks_is_refused():
    with pytest.raises(ValueError, match="not whole 256-value blocks"):
        quantize(np.zeros((4, 128), np.float32), T.Q4_K)
