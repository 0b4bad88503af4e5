"""CuPy operations against their NumPy twins (GPU), and the blocked attention algorithm (CPU too).

Tolerances (relative L2 error ||gpu - numpy|| / ||numpy|| on fresh random inputs, float32 reference):
  f32: 1e-5 (element-wise ops and reductions in a different order); matmul/attention 1e-5 (cuBLAS
  f32 without TF32: CuPy leaves TF32 off unless CUPY_TF32=1).
  f16: 2e-3 (one rounding to a 10-bit mantissa per stored value);  bf16: 1.6e-2 (7-bit mantissa).
  Attention in f16 / bf16 (the flash kernel): 3e-3 / 1.6e-2 (probabilities are rounded to f16 too).
int8 K/V: dequantize(quantize(x)) is bit-identical to numpy's (same float32 products and rint).
"""

from __future__ import annotations

import numpy as np
import pytest
from strata_engine.config import Activation, RopeStyle
from strata_engine.ops.attention_tiling import blocked_attention, key_block_for
from strata_engine.ops.numpy_ops import NumpyOps

from .gpu import rel_err

TOL = {"f32": 1e-5, "f16": 2e-3, "bf16": 1.6e-2}
# Attention in f16 / bf16 runs on the tensor cores: f16 operands and probabilities, f32 accumulation.
FLASH_TOL = {"f16": 3e-3, "bf16": 1.6e-2}


def _attention_case(rng, n_q, n_k, n_head, n_kv, d, q_pos0):
    q = rng.standard_normal((n_q, n_head, d)).astype(np.float32)
    k = rng.standard_normal((n_k, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((n_k, n_kv, d)).astype(np.float32)
    return q, k, v, q_pos0, q_pos0 + n_q - n_k


# ---- the algorithm, on numpy (runs everywhere) -------------------------------------------------
@pytest.mark.parametrize(
    ("n_q", "n_k", "n_head", "n_kv", "d", "q_pos0", "window", "block"),
    [
        (37, 37, 9, 3, 64, 0, None, 8),  # prefill from 0, many blocks, GQA 3
        (16, 300, 4, 1, 32, 284, None, 64),  # chunk after a held prefix
        (16, 300, 4, 1, 32, 284, 50, 32),  # sliding window: early blocks skipped, partial masks
        (1, 513, 4, 1, 16, 900, 512, 100),  # decode in a window
        (64, 64, 2, 2, 8, 5, 3, 7),  # tiny window, blocks smaller than the window
        (16, 300, 4, 1, 32, 284, 50, 10_000),  # one block: the plain-softmax path, masked
        (1, 513, 4, 1, 16, 900, 512, 10_000),  # one block: a decode step, no mask needed
    ],
)
def test_blocked_attention_matches_numpy_attention(n_q, n_k, n_head, n_kv, d, q_pos0, window, block):
    rng = np.random.default_rng(n_q * 1000 + n_k)
    q, k, v, q0, k0 = _attention_case(rng, n_q, n_k, n_head, n_kv, d, q_pos0)
    ref = NumpyOps("f64").attention(
        q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
        q_pos0=q0, k_pos0=k0, window=window, scale=0.125,
    )  # fmt: skip
    got = blocked_attention(
        np, q, k, v, q_pos0=q0, k_pos0=k0, window=window, scale=0.125, key_block=block, out_dtype=np.float32
    )
    assert got.shape == (n_q, n_head * d)
    assert rel_err(got, ref) < 1e-5


def test_key_block_respects_the_score_budget():
    assert key_block_for(1, 4 * 512, budget=256 << 20) == (256 << 20) // (4 * 4 * 512)
    assert key_block_for(64, 10**6, budget=1 << 20) == 256  # never below the minimum block


# ---- CuPy twins (GPU) ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cp():
    return pytest.importorskip("cupy")


def _ops(dtype: str):
    from strata_engine.ops.cupy_ops import CupyOps

    try:
        return CupyOps(dtype)
    except Exception as e:  # bf16 where this CuPy lacks the dtype
        pytest.skip(f"cupy compute dtype {dtype} unavailable: {e}")


DTYPES = ["f32", "f16", "bf16"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_silu_gelu_match_numpy(cp, dtype):
    ops, ref = _ops(dtype), NumpyOps("f32")
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((33, 640)) * 3).astype(np.float32)
    w = rng.standard_normal(640).astype(np.float32)
    xd, wd = ops.asarray(x, ops.dtype), ops.weight(w)
    xr = ops.to_host(xd).astype(np.float32)  # the same rounded inputs for the reference
    wr = ops.to_host(wd).astype(np.float32)
    assert rel_err(ops.to_host(ops.rms_norm(xd, wd, 1e-6)), ref.rms_norm(xr, wr, 1e-6)) < TOL[dtype]
    assert rel_err(ops.to_host(ops.silu(xd)), ref.silu(xr)) < TOL[dtype]
    assert rel_err(ops.to_host(ops.gelu_tanh(xd)), ref.gelu_tanh(xr)) < TOL[dtype]
    # per-head norm over the last axis of a 3-D tensor (gemma3's q/k norms)
    x3 = rng.standard_normal((5, 4, 256)).astype(np.float32)
    w3 = rng.standard_normal(256).astype(np.float32)
    got = ops.to_host(ops.rms_norm(ops.asarray(x3, ops.dtype), ops.weight(w3), 1e-6))
    want = ref.rms_norm(
        ops.to_host(ops.asarray(x3, ops.dtype)).astype(np.float32),
        ops.to_host(ops.weight(w3)).astype(np.float32),
        1e-6,
    )
    assert rel_err(got, want) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_logits_are_accumulated_and_returned_in_float32(cp, dtype):
    """The final projection of f16 / bf16 activations comes out in float32 (cuBLAS f32 output): within
    f32 rounding of the exact products of the rounded inputs (1e-4 relative L2), where an output rounded
    to f16 is ~3e-4 off and one rounded to bf16 ~2e-3; the graph's device path gives the same values."""
    ops = _ops(dtype)
    rng = np.random.default_rng(9)
    for n_rows in (1, 2, 3, 12):  # the decode-sized products (strata_gemv_rows) and cuBLAS's
        x = rng.standard_normal((n_rows, 640)).astype(np.float32)
        w = (rng.standard_normal((5000, 640)) * 0.05).astype(np.float32)
        _check_logits(ops, x, w)


@pytest.mark.gpu
def test_argmax_rows_is_numpys_argmax_ties_and_nan_included(cp):
    """`argmax_rows` (a greedy step's token on the device): per row the first maximal index, as np.argmax
    (exact ties within and across the spans read in parallel, NaNs, all -inf, a row shorter than a block's
    span), and that logit."""
    from strata_engine.sampling import Argmax

    ops = _ops("f16")
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((9, 262_144)).astype(np.float32)
    logits[1, [70_000, 5, 200_000]] = 9.0  # a tie: the lowest index wins
    logits[2, 131_071:131_075] = np.float32(7.5)  # a tie across neighbouring threads
    logits[3, [900, 40]] = np.nan  # the first NaN, as np.argmax
    logits[4] = -np.inf
    logits[5, -1] = 50.0  # the last column
    logits[6] = np.round(logits[6] * 4) / 4  # bf16-like coarse values: many exact ties
    logits[7, :] = 0.0
    logits[8, [200_001, 4097, 4095]] = 11.0  # a tie across the row's spans: the first index wins
    logits[0, [250_000, 100_000]] = np.nan  # NaNs in two spans: the first
    for rows in (logits, logits[:, :700]):  # 700 columns: most of the block's threads see nothing
        words = ops.to_host(ops.argmax_rows(ops.xp.asarray(np.ascontiguousarray(rows))))
        got = Argmax.of_words(words, rows.shape[0])
        want = [Argmax.of_logits(row) for row in rows]
        assert [g.token for g in got] == [w.token for w in want]
        np.testing.assert_array_equal([g.logit for g in got], [w.logit for w in want])


def _check_logits(ops, x, w):
    xd, wd = ops.asarray(x, ops.dtype), ops.weight(w)
    want = ops.to_host(xd).astype(np.float64) @ ops.to_host(wd).astype(np.float64).T
    got = ops.logits(xd, wd)
    assert got.dtype == np.float32 and got.shape == (x.shape[0], 5000)
    assert rel_err(got, want) < 1e-4
    np.testing.assert_array_equal(ops.to_host(ops.logits_f32(xd, wd)), got)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", list(Activation))
@pytest.mark.parametrize("n_rows", [1, 5, 8, 17])  # up to SMALL_STEP_ROWS: the decode-sized kernels
def test_matmul_and_gated_mlp_match_numpy(cp, dtype, activation, n_rows):
    ops, ref = _ops(dtype), NumpyOps("f32")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((n_rows, 576)).astype(np.float32)
    wg, wu = (
        (rng.standard_normal((1536, 576)) / 24).astype(np.float32),
        (rng.standard_normal((1536, 576)) / 24).astype(np.float32),
    )
    wd = (rng.standard_normal((576, 1536)) / 40).astype(np.float32)
    dev = [ops.asarray(a, ops.dtype) for a in (x, np.concatenate([wg, wu]), wd)]
    host = [ops.to_host(a).astype(np.float32) for a in dev]
    assert rel_err(ops.to_host(ops.matmul(dev[0], dev[1])), ref.matmul(host[0], host[1])) < TOL[dtype]
    got = ops.to_host(ops.gated_mlp(*dev, activation))
    want = ref.gated_mlp(*host, activation)
    assert rel_err(got, want) < 2 * TOL[dtype]
    parts = ops.project(dev[0], dev[1], (1000, 536, 1536))  # column views of one product
    for got_part, want_part in zip(parts, ref.project(host[0], host[1], (1000, 536, 1536)), strict=True):
        assert rel_err(ops.to_host(got_part), want_part) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("post", [False, True])
@pytest.mark.parametrize(("n_rows", "n"), [(33, 640), (1, 640), (1, 576), (8, 2304), (3, 100)])
def test_add_rms_norm_matches_numpy(cp, dtype, post, n_rows, n):
    ops, ref = _ops(dtype), NumpyOps("f32")
    rng = np.random.default_rng(11)
    arrays = [(rng.standard_normal((n_rows, n)) * 3).astype(np.float32) for _ in range(2)]
    weights = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
    x, y = (ops.asarray(a, ops.dtype) for a in arrays)
    w_post, w_next = (ops.weight(w) for w in weights)
    host = [ops.to_host(a).astype(np.float32) for a in (x, y, w_post, w_next)]
    got_x, got_h = ops.add_rms_norm(x, y, w_post if post else None, w_next, 1e-6)
    want_x, want_h = ref.add_rms_norm(host[0], host[1], host[2] if post else None, host[3], 1e-6)
    assert rel_err(ops.to_host(got_x), want_x) < TOL[dtype]
    assert rel_err(ops.to_host(got_h), want_h) < 2 * TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("style", "n_head", "n_kv", "dim", "rope_dim", "norm"),
    [
        (RopeStyle.INTERLEAVED, 9, 3, 64, 64, False),  # smollm2
        (RopeStyle.NEOX, 4, 1, 256, 256, True),  # gemma3 (per-head q/k norms)
        (RopeStyle.NEOX, 3, 3, 64, 32, True),  # partial rotary dims
    ],
)
def test_qk_norm_rope_matches_numpy(cp, dtype, style, n_head, n_kv, dim, rope_dim, norm):
    ops, ref = _ops(dtype), NumpyOps("f32")
    rng = np.random.default_rng(12)
    n_tok = 21
    x = rng.standard_normal((n_tok, 96)).astype(np.float32)
    w = (rng.standard_normal(((n_head + 2 * n_kv) * dim, 96)) / 10).astype(np.float32)
    norms = [rng.standard_normal(dim).astype(np.float32) for _ in range(2)]
    sizes = (n_head * dim, n_kv * dim, n_kv * dim)
    xd, wd = ops.asarray(x, ops.dtype), ops.weight(w)
    qd, kd, _ = ops.project(xd, wd, sizes)  # strided column views, as the models pass them
    qn, kn = (ops.weight(a) for a in norms) if norm else (None, None)
    cos, sin = ops.rope_tables(4090, n_tok, 10000.0, rope_dim)
    got_q, got_k = ops.qk_norm_rope(qd, kd, dim, qn, kn, cos, sin, style, 1e-6)
    hq, hk = (
        ops.to_host(cp.ascontiguousarray(qd)).astype(np.float32),
        ops.to_host(cp.ascontiguousarray(kd)).astype(np.float32),
    )
    rc, rs = ref.rope_tables(4090, n_tok, 10000.0, rope_dim)
    hn = [ops.to_host(a).astype(np.float32) for a in (qn, kn)] if norm else [None, None]
    want_q, want_k = ref.qk_norm_rope(hq, hk, dim, hn[0], hn[1], rc, rs, style, 1e-6)
    assert got_q.shape == (n_tok, n_head, dim) and got_k.shape == (n_tok, n_kv, dim)
    assert rel_err(ops.to_host(got_q), want_q) < 2 * TOL[dtype]
    assert rel_err(ops.to_host(got_k), want_k) < 2 * TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("style", "heads", "dim", "rope_dim"),
    [(RopeStyle.INTERLEAVED, 9, 64, 64), (RopeStyle.NEOX, 4, 256, 256), (RopeStyle.NEOX, 3, 64, 32)],
)
def test_rope_matches_numpy(cp, dtype, style, heads, dim, rope_dim):
    ops, ref = _ops(dtype), NumpyOps("f32")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((21, heads, dim)).astype(np.float32)
    xd = ops.asarray(x, ops.dtype)
    xr = ops.to_host(xd).astype(np.float32)
    cos, sin = ops.rope_tables(4090, 21, 10000.0, rope_dim)
    rc, rs = ref.rope_tables(4090, 21, 10000.0, rope_dim)
    assert rel_err(ops.to_host(cos), rc) < 1e-7 and rel_err(ops.to_host(sin), rs) < 1e-7
    assert rel_err(ops.to_host(ops.rope(xd, cos, sin, style)), ref.rope(xr, rc, rs, style)) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n_q", "n_k", "n_head", "n_kv", "d", "q_pos0", "window"),
    [
        (512, 512, 9, 3, 64, 0, None),  # smollm2 prefill chunk
        (1, 4097, 9, 3, 64, 4096, None),  # smollm2 decode
        (512, 1023, 4, 1, 256, 3000, 512),  # gemma3 local layer chunk
        (512, 8192, 4, 1, 256, 7680, None),  # gemma3 global layer, several key blocks at a small budget
    ],
)
def test_attention_matches_numpy(cp, dtype, n_q, n_k, n_head, n_kv, d, q_pos0, window):
    ops, ref = _ops(dtype), NumpyOps("f32")
    rng = np.random.default_rng(4)
    q, k, v, q0, k0 = _attention_case(rng, n_q, n_k, n_head, n_kv, d, q_pos0)
    dev = [ops.asarray(a, ops.dtype) for a in (q, k, v)]
    host = [ops.to_host(a).astype(np.float32) for a in dev]
    want = ref.attention(*host, q_pos0=q0, k_pos0=k0, window=window, scale=d**-0.5)
    ops.score_budget = 8 << 20  # several key blocks on the long cases
    got = ops.to_host(ops.attention(*dev, q_pos0=q0, k_pos0=k0, window=window, scale=d**-0.5))
    assert rel_err(got, want) < FLASH_TOL.get(dtype, TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize(
    ("n_q", "n_k", "n_head", "n_kv", "d", "q_pos0", "window"),
    [
        (37, 100, 8, 4, 64, 63, 40),  # a chunk over a held prefix, gemma2's local layer
        (1, 5000, 8, 4, 256, 4999, None),  # decode: key splits merged by the combine
    ],
)
def test_soft_capped_flash_attention_matches_numpy(cp, dtype, n_q, n_k, n_head, n_kv, d, q_pos0, window):
    """gemma2's attention logit soft-cap in strata_flash_attn (applied to base-2 scores) and the exact path,
    scores large enough for the cap to bite; without the cap the kernel's result is another."""
    ops, ref = _ops(dtype), NumpyOps("f32")
    rng = np.random.default_rng(n_q + n_k + d)
    q, k, v, q0, k0 = _attention_case(rng, n_q, n_k, n_head, n_kv, d, q_pos0)
    q *= 4
    qd, kd, vd = ops.asarray(q, ops.dtype), ops.asarray(k, ops.dtype), ops.asarray(v, ops.dtype)
    host = [ops.to_host(a).astype(np.float32) for a in (qd, kd, vd)]
    want = ref.attention(*host, q_pos0=q0, k_pos0=k0, window=window, scale=d**-0.5, softcap=2.0)
    got = ops.to_host(
        ops.flash_attention(qd, kd, vd, q_pos0=q0, k_pos0=k0, window=window, scale=d**-0.5, softcap=2.0)
    )
    assert rel_err(got, want) < FLASH_TOL[dtype]
    uncapped = ops.to_host(
        ops.flash_attention(qd, kd, vd, q_pos0=q0, k_pos0=k0, window=window, scale=d**-0.5)
    )
    assert rel_err(uncapped, want) > 10 * FLASH_TOL[dtype]
    f32 = _ops("f32")  # the exact path: blocked_attention on the device
    exact = f32.attention(
        *(f32.asarray(a) for a in host), q_pos0=q0, k_pos0=k0, window=window, scale=d**-0.5, softcap=2.0
    )
    assert rel_err(f32.to_host(exact), want) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("kv_dtype", ["compute", "f16", "f32"])
@pytest.mark.parametrize(
    ("n_q", "n_k", "n_head", "n_kv", "d", "q_pos0", "window"),
    [
        (4096, 4096, 9, 3, 64, 0, None),  # smollm2 one-chunk prefill: many row tiles, causal skipping
        (37, 100, 9, 3, 64, 63, None),  # ragged rows (G*T not a tile multiple), a held prefix
        (1, 32768, 4, 1, 256, 32767, None),  # gemma3 decode at 32K: key splits merged by the combine
        (2048, 2559, 4, 1, 256, 30000, 512),  # gemma3 local chunk: window edge inside tiles
        (3, 600, 4, 1, 256, 597, 512),  # a short chunk in a window: splits and window together
        (1, 1, 4, 1, 128, 0, None),  # the first token: one key
    ],
)
def test_flash_attention_matches_numpy(cp, dtype, kv_dtype, n_q, n_k, n_head, n_kv, d, q_pos0, window):
    ops, ref = _ops(dtype), NumpyOps("f32")
    rng = np.random.default_rng(n_q + n_k + d)
    q, k, v, q0, k0 = _attention_case(rng, n_q, n_k, n_head, n_kv, d, q_pos0)
    kv_dt = ops.dtype if kv_dtype == "compute" else np.dtype({"f16": np.float16, "f32": np.float32}[kv_dtype])
    qd = ops.asarray(q, ops.dtype)
    kd, vd = ops.asarray(k, kv_dt), ops.asarray(v, kv_dt)
    host = [ops.to_host(a).astype(np.float32) for a in (qd, kd, vd)]
    want = ref.attention(*host, q_pos0=q0, k_pos0=k0, window=window, scale=d**-0.5)
    got = ops.to_host(ops.flash_attention(qd, kd, vd, q_pos0=q0, k_pos0=k0, window=window, scale=d**-0.5))
    assert got.shape == (n_q, n_head * d)
    assert rel_err(got, want) < FLASH_TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize(("n_q", "q_pos0"), [(1, 5000), (1, 700), (200, 3000), (1, 3)])
def test_flash_attention_over_a_ring_matches_the_gathered_context(cp, dtype, n_q, q_pos0):
    """Keys read in place from a 1,024-slot ring (position % capacity), as the device placement does for
    sliding-window layers; slots outside the window hold NaN so a wrong slot cannot pass."""
    ops, ref = _ops(dtype), NumpyOps("f32")
    rng = np.random.default_rng(q_pos0)
    cap, window, n_head, d = 1024, 512, 4, 256
    k_pos0 = max(0, q_pos0 - window + 1)
    positions = np.arange(k_pos0, q_pos0 + n_q)
    k = rng.standard_normal((len(positions), 1, d)).astype(np.float16)
    v = rng.standard_normal((len(positions), 1, d)).astype(np.float16)
    ring_k = np.full((cap, 1, d), np.nan, dtype=np.float16)
    ring_v = np.full((cap, 1, d), np.nan, dtype=np.float16)
    ring_k[positions % cap], ring_v[positions % cap] = k, v
    q = rng.standard_normal((n_q, n_head, d)).astype(np.float32)
    qd = ops.asarray(q, ops.dtype)
    want = ref.attention(
        ops.to_host(qd).astype(np.float32), k.astype(np.float32), v.astype(np.float32),
        q_pos0=q_pos0, k_pos0=k_pos0, window=window, scale=d**-0.5,
    )  # fmt: skip
    got = ops.attention(
        qd, ops.asarray(ring_k), ops.asarray(ring_v), q_pos0=q_pos0, k_pos0=k_pos0, window=window,
        scale=d**-0.5, ring_capacity=cap,
    )  # fmt: skip
    assert rel_err(ops.to_host(got), want) < FLASH_TOL[dtype]


def test_flash_tiles_and_splits():
    from strata_engine.ops.attention_tiling import flash_splits, flash_tiles

    assert (
        flash_tiles(64, 3) == (1, 64)
        and flash_tiles(256, 4096) == (8, 16)
        and flash_tiles(64, 12288) == (4, 64)
    )
    assert flash_splits(400, 4096, 64, 132) == 1  # enough row tiles: no split
    assert flash_splits(1, 32768, 16, 132) == 264  # decode at 32K: 2 x 132 SMs
    assert flash_splits(3, 100, 64, 132) == 1  # too few keys to split
    assert (
        flash_splits(3, 8192, 64, 132, min_tiles=1) == 88
    )  # a tile a split at least: 2 x 132 SMs over 3 heads
    assert flash_splits(3, 8192, 64, 132, min_tiles=4) == 32


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [32, None])
def test_int8_quantize_dequantize_match_numpy(cp, dtype, group):
    ops, ref = _ops(dtype), NumpyOps("f32")
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((40, 3, 64)) * rng.uniform(0.1, 8, (40, 3, 1))).astype(np.float32)
    x[3, 1] = 0.0  # an all-zero block keeps scale 0 and decodes to 0
    xd = ops.asarray(x, ops.dtype)
    xr = ops.to_host(xd).astype(np.float32)
    q, s = ops.quantize_int8(xd, group)
    qr, sr = ref.quantize_int8(xr, group)
    qh, sh = ops.to_host(q), ops.to_host(s)
    assert qh.dtype == np.int8 and sh.dtype == np.float32
    if dtype == "f32":
        np.testing.assert_array_equal(sh, sr)
        assert (
            np.abs(qh.astype(int) - qr.astype(int)).max() <= 1
        )  # rint ties after a different division order
    back = ops.to_host(ops.dequantize_int8(q, s)).astype(np.float32)
    np.testing.assert_allclose(back, ref.dequantize_int8(qh, sh), rtol=TOL[dtype], atol=0)
    assert np.all(back[3, 1] == 0)
    assert rel_err(back, xr) < 1e-2  # int8 itself: < 1 % of the signal


@pytest.mark.gpu
def test_embed_and_logits(cp):
    ops, ref = _ops("f32"), NumpyOps("f32")
    rng = np.random.default_rng(6)
    table = rng.standard_normal((1000, 64)).astype(np.float32)
    ids = np.array([0, 999, 5, 5, 123])
    got = ops.to_host(ops.embed(ops.weight(table), ids, scale=8.0))
    np.testing.assert_array_equal(got, ref.embed(table.copy(), ids, scale=8.0))
    logits = ops.logits(ops.asarray(got[-1:]), ops.weight(table))
    assert isinstance(logits, np.ndarray) and logits.dtype == np.float32 and logits.shape == (1, 1000)
    assert rel_err(logits, got[-1:] @ table.T) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("ring", "pos0", "n_tok"), [(0, 37, 5), (1024, 1020, 9), (1024, 5000, 1)])
@pytest.mark.parametrize("from_device", [False, True])
def test_store_kv_matches_numpy(cp, dtype, ring, pos0, n_tok, from_device):
    """K/V rows into pool slots (ring slots by position % capacity), the position given as an argument
    or read from device memory (a captured step); V arrives as a strided column view, as the models
    pass it. Stored values are rounded once to the pool's f16."""
    ops, ref = _ops(dtype), NumpyOps("f32")
    rng = np.random.default_rng(pos0)
    slots, n_kv, d = ring or 6000, 3, 64
    k = ops.asarray(rng.standard_normal((n_tok, n_kv, d)).astype(np.float32), ops.dtype)
    kv_cols = ops.asarray(rng.standard_normal((n_tok, 3 * n_kv * d)).astype(np.float32), ops.dtype)
    v = kv_cols[:, n_kv * d : 2 * n_kv * d].reshape(n_tok, n_kv, d)
    k_pool = cp.full((slots, n_kv, d), np.nan, dtype=cp.float16)
    v_pool = cp.full((slots, n_kv, d), np.nan, dtype=cp.float16)
    dyn = cp.asarray([pos0], dtype=cp.int32) if from_device else None
    ops.store_kv(k, v, k_pool, v_pool, -1 if from_device else pos0, ring_capacity=ring, dyn=dyn)
    want_k = np.full((slots, n_kv, d), np.nan, dtype=np.float16)
    want_v = want_k.copy()
    host = [ops.to_host(cp.ascontiguousarray(a)).astype(np.float32) for a in (k, v)]
    ref.store_kv(host[0], host[1], want_k, want_v, pos0, ring_capacity=ring)
    np.testing.assert_array_equal(ops.to_host(k_pool), want_k)  # NaN where nothing was written, on both
    np.testing.assert_array_equal(ops.to_host(v_pool), want_v)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_long_chunk_over_a_ring_layer_matches_the_generic_placement(cp, dtype):
    """Chunks longer than a ring can take in place (T > capacity - window + 1) through the device
    placement's context path against the generic gather-then-write path, over the same stored K/V:
    the ring's slots end identical, and attention is identical in f32 (the same f16 values, read
    directly instead of decoded) and within the flash bound in bf16. Chunks: from 0, then one whose
    window reaches back across the ring's wrap, then one longer than the ring."""
    from strata_engine.kv import KVGeometry
    from strata_engine.kv.device import DevicePool, DevicePoolPlacement
    from strata_engine.kv.layout import LayerGeometry
    from strata_engine.kv.placement import PoolPlacement
    from strata_engine.settings import KVType

    ops = _ops(dtype)
    window, cap, n_head, d = 512, 1024, 4, 256
    geometry = KVGeometry(KVType.F16, 4096, (LayerGeometry(0, 1, d, window, cap),))
    fast, generic = DevicePool(geometry, ops), DevicePool(geometry, ops)
    placements = (DevicePoolPlacement(fast), PoolPlacement(generic))
    rng = np.random.default_rng(7)
    pos0 = 0
    for n in (700, 900, 1500):
        q, k, v = (ops.asarray(rng.standard_normal((n, h, d)).astype(np.float32), ops.dtype)
                   for h in (n_head, 1, 1))  # fmt: skip
        outs = []
        for pool, placement in zip((fast, generic), placements, strict=True):
            pool.begin_append(pos0, n)
            outs.append(
                ops.to_host(
                    placement.attend(0, pos0, q, k, v, q_pos0=pos0, window=window, scale=d**-0.5, softcap=0.0)
                )
            )
            pool.commit_append(n)
        held = slice(None) if pos0 + n >= cap else slice(0, pos0 + n)
        for name in ("k", "v"):
            assert np.array_equal(ops.to_host(getattr(fast.layer(0), name))[held],
                                  ops.to_host(getattr(generic.layer(0), name))[held])  # fmt: skip
        if dtype == "f32":
            assert np.array_equal(outs[0], outs[1])
        else:
            assert rel_err(outs[0], outs[1].astype(np.float32)) < FLASH_TOL[dtype]
        pos0 += n


@pytest.mark.gpu
@pytest.mark.parametrize(("n_head", "n_kv", "d", "window", "cap"), [(9, 3, 64, None, 0), (4, 1, 256, None, 0),
                                                                     (4, 1, 256, 512, 1024)])  # fmt: skip
@pytest.mark.parametrize(("pos0", "n_q"), [(0, 256), (300, 256), (1300, 256), (1300, 1)])
def test_flash_attention_position_on_the_device_matches_the_argument(
    cp, n_head, n_kv, d, window, cap, pos0, n_q
):
    """A captured step's attention (`dyn`: q_pos0 read on the device, keys from slot 0 of the pool or the
    window's start in a ring, splits sized for the whole pool) against the same call with the positions
    as arguments, for chunks of several rows as well as one: equal up to the order the splits merge."""
    ops = _ops("bf16")
    rng = np.random.default_rng(pos0 + n_q)
    slots = cap or 2048
    k_pool = ops.asarray(rng.standard_normal((slots, n_kv, d)).astype(np.float32), np.float16)
    v_pool = ops.asarray(rng.standard_normal((slots, n_kv, d)).astype(np.float32), np.float16)
    q = ops.asarray(rng.standard_normal((n_q, n_head, d)).astype(np.float32), ops.dtype)
    dyn = cp.asarray([pos0], dtype=cp.int32)
    got = ops.flash_attention(q, k_pool, v_pool, q_pos0=0, k_pos0=0, window=window, scale=d**-0.5,
                              ring_capacity=cap, dyn=dyn)  # fmt: skip
    if cap:
        k_pos0 = max(0, pos0 - window + 1)
        want = ops.flash_attention(q, k_pool, v_pool, q_pos0=pos0, k_pos0=k_pos0, window=window, scale=d**-0.5,
                                   ring_capacity=cap)  # fmt: skip
    else:
        end = pos0 + n_q
        want = ops.flash_attention(q, k_pool[:end], v_pool[:end], q_pos0=pos0, k_pos0=0, window=window,
                                   scale=d**-0.5)  # fmt: skip
    assert rel_err(ops.to_host(got).astype(np.float32), ops.to_host(want).astype(np.float32)) < 1e-2


def _ring_reference(ref, q, keys, values, pos, window, cap, scale, softcap=0.0):
    """NumPy attention of one query at `pos` over the keys a slot holds (position p in slot p % cap when cap)."""
    k_pos0 = max(0, pos - window + 1) if window else 0
    where = np.arange(k_pos0, pos + 1) % cap if cap else np.arange(k_pos0, pos + 1)
    return ref.attention(q, keys[where], values[where], q_pos0=pos, k_pos0=k_pos0, window=window, scale=scale,
                         softcap=softcap)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("min_tiles", [1, 2, 4])
@pytest.mark.parametrize(
    ("dtype", "n_head", "n_kv", "d", "window", "cap", "pos"),
    [
        ("f16", 9, 3, 64, None, 0, 0),  # one key: every split but the first empty
        ("f16", 9, 3, 64, None, 0, 63),  # one whole tile
        ("f16", 9, 3, 64, None, 0, 700),  # fewer tiles than splits
        ("f16", 9, 3, 64, None, 0, 4095),  # smollm2 at 4,096 held
        ("f16", 9, 3, 64, None, 0, 8191),  # the whole pool: more tiles than splits
        ("bf16", 4, 1, 256, None, 0, 511),
        ("bf16", 4, 1, 256, None, 0, 8191),  # gemma3's global layer: 16-key tiles, 2 x n_sm splits
        ("bf16", 4, 1, 256, 512, 1024, 5000),  # a local layer's ring, wrapped
    ],
)
def test_decode_key_splits_merge_as_numpy(cp, min_tiles, dtype, n_head, n_kv, d, window, cap, pos):
    """A captured decode step's attention (`dyn`, splits sized for the pool, the used splits first and the
    rest empty) merged by strata_attn_combine, at several split counts (`flash_min_tiles`) and lengths,
    against NumPy's attention over the keys held."""
    ops, ref = _ops(dtype), NumpyOps("f32")
    ops.flash_min_tiles = min_tiles
    rng = np.random.default_rng(pos + d + min_tiles)
    slots = cap or 8192
    k_pool = ops.asarray(rng.standard_normal((slots, n_kv, d)).astype(np.float32), ops.dtype)
    v_pool = ops.asarray(rng.standard_normal((slots, n_kv, d)).astype(np.float32), ops.dtype)
    q = ops.asarray(rng.standard_normal((1, n_head, d)).astype(np.float32), ops.dtype)
    dyn = cp.asarray([pos], dtype=cp.int32)
    got = ops.flash_attention(q, k_pool, v_pool, q_pos0=0, k_pos0=0, window=window, scale=d**-0.5,
                              ring_capacity=cap, dyn=dyn)  # fmt: skip
    host_q, host_k, host_v = (ops.to_host(a).astype(np.float32) for a in (q, k_pool, v_pool))
    want = _ring_reference(ref, host_q, host_k, host_v, pos, window, cap, d**-0.5)
    assert rel_err(ops.to_host(got).astype(np.float32), want) < FLASH_TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("wide", [True, False])
@pytest.mark.parametrize(
    ("dtype", "n_q", "n_head", "n_kv", "d", "q_pos0"),
    [("f16", 37, 9, 3, 64, 4000), ("bf16", 8, 4, 1, 256, 3000), ("f16", 1, 9, 3, 64, 4000)],
)
def test_both_split_merges_match_numpy(cp, monkeypatch, wide, dtype, n_q, n_head, n_kv, d, q_pos0):
    """The same split launch (15-63 splits) merged a block per output row (strata_attn_combine_wide: decode)
    and a thread per value (strata_attn_combine: many rows), each against NumPy's attention."""
    from strata_engine.ops import cupy_ops

    monkeypatch.setattr(cupy_ops, "_COMBINE_WIDE_ROWS", 1 << 20 if wide else 0)
    ops, ref = _ops(dtype), NumpyOps("f32")
    rng = np.random.default_rng(n_q + d)
    q, k, v, q0, k0 = _attention_case(rng, n_q, q_pos0 + n_q, n_head, n_kv, d, q_pos0)
    qd, kd, vd = ops.asarray(q, ops.dtype), ops.asarray(k, np.float16), ops.asarray(v, np.float16)
    host = [ops.to_host(a).astype(np.float32) for a in (qd, kd, vd)]
    want = ref.attention(*host, q_pos0=q0, k_pos0=k0, window=None, scale=d**-0.5)
    got = ops.to_host(ops.flash_attention(qd, kd, vd, q_pos0=q0, k_pos0=k0, window=None, scale=d**-0.5))
    assert rel_err(got.astype(np.float32), want) < FLASH_TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("min_tiles", [1, 4])
@pytest.mark.parametrize(
    ("dtype", "n_head", "n_kv", "d", "window", "cap", "softcap"),
    [
        ("f16", 9, 3, 64, None, 0, 0.0),
        ("bf16", 4, 1, 256, None, 0, 0.0),
        ("bf16", 4, 1, 256, 512, 1024, 0.0),
        ("bf16", 8, 4, 64, 40, 64, 1.0),
    ],  # fmt: skip
)
def test_flash_attention_rows_matches_numpy(cp, min_tiles, dtype, n_head, n_kv, d, window, cap, softcap):
    """A batched decode step's attention (`flash_attention_rows`: each row over its own slot of the arena, its
    splits merged per row) against NumPy's attention of each row alone; the rows' lengths differ (one key,
    a few tiles, a full or wrapped slot) and their slots are out of order; gemma2's soft-capped scores too."""
    ops, ref = _ops(dtype), NumpyOps("f32")
    ops.flash_min_tiles = min_tiles
    rng = np.random.default_rng(d + min_tiles)
    capacity = cap or 2048
    positions, slots = [0, 700, 1900 if cap else 2047], [2, 0, 3]
    k_arena = ops.asarray(rng.standard_normal((4, capacity, n_kv, d)).astype(np.float32), ops.dtype)
    v_arena = ops.asarray(rng.standard_normal((4, capacity, n_kv, d)).astype(np.float32), ops.dtype)
    q = ops.asarray(rng.standard_normal((3, n_head, d)).astype(np.float32), ops.dtype)
    rows = cp.asarray([3, *positions, *slots], dtype=cp.int32)
    got = ops.to_host(ops.flash_attention_rows(q, k_arena, v_arena, rows, window=window, scale=d**-0.5,
                                               softcap=softcap, ring_capacity=cap)).astype(np.float32)  # fmt: skip
    assert got.shape == (3, n_head * d)
    host_q, host_k, host_v = (ops.to_host(a).astype(np.float32) for a in (q, k_arena, v_arena))
    for b, (pos, slot) in enumerate(zip(positions, slots, strict=True)):
        want = _ring_reference(
            ref, host_q[b : b + 1], host_k[slot], host_v[slot], pos, window, cap, d**-0.5, softcap
        )
        assert rel_err(got[b : b + 1], want) < FLASH_TOL[dtype], (b, pos)


@pytest.mark.gpu
def test_copy_bytes_queues_host_and_device_copies(cp):
    """The session adapter's byte copies: pinned and pageable host sources and a device source into a
    device array at an offset (queued on the stream, complete after a sync), contiguous pieces merged,
    a host destination, and a range that does not fit refused before anything is queued."""
    import cupyx

    ops = _ops("f32")
    rng = np.random.default_rng(5)
    dest = cp.zeros(1 << 20, dtype=cp.uint8)
    expected = np.zeros(1 << 20, dtype=np.uint8)
    pinned = cupyx.empty_pinned((300_000,), dtype=np.uint8)
    pinned[...] = rng.integers(0, 256, pinned.shape, dtype=np.uint8)
    pageable = rng.integers(0, 256, 70_001, dtype=np.uint8)
    device_src = cp.asarray(rng.integers(0, 256, 12_345, dtype=np.uint8))
    for offset, src in ((7, pinned), (400_001, pageable), (1_000_000, device_src)):
        ops.copy_bytes(dest, offset, src)
        host = src if isinstance(src, np.ndarray) else cp.asnumpy(src)
        expected[offset : offset + host.nbytes] = host
    ops.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(dest), expected)
    # pieces that continue each other on both sides become one copy; a gap starts another
    for lo, hi in ((0, 1000), (1000, 250_000), (260_000, 300_000)):
        ops.copy_bytes(dest, 5000 + lo, pinned[lo:hi])
        expected[5000 + lo : 5000 + hi] = pinned[lo:hi]
    ops.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(dest), expected)
    host_dest = np.zeros(100, dtype=np.uint8)
    ops.copy_bytes(host_dest, 10, pageable[:50])
    np.testing.assert_array_equal(host_dest[10:60], pageable[:50])
    with pytest.raises(ValueError, match="do not fit"):
        ops.copy_bytes(dest, (1 << 20) - 10, pageable[:11])
