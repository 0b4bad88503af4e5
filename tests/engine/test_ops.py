"""The numpy ops against direct, loop-based definitions of the same math."""

from __future__ import annotations

import math

import numpy as np
import pytest
from strata_engine.config import Activation, RopeStyle
from strata_engine.ops import get_ops

from .weights import EXTRA_LAYOUTS, F16_FIELDS, made_packed, random_packed, real_weights


@pytest.fixture(scope="module")
def ops():
    return get_ops("numpy", "f64")


def _rope_reference(x, positions, base, style):
    T, H, D = x.shape
    out = x.copy()
    for t, p in enumerate(positions):
        for i in range(D // 2):
            theta = p * base ** (-2 * i / D)
            c, s = math.cos(theta), math.sin(theta)
            a, b = (2 * i, 2 * i + 1) if style is RopeStyle.INTERLEAVED else (i, i + D // 2)
            out[t, :, a] = x[t, :, a] * c - x[t, :, b] * s
            out[t, :, b] = x[t, :, b] * c + x[t, :, a] * s
    return out


@pytest.mark.parametrize("style", list(RopeStyle))
def test_rope_both_styles(ops, style):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 8))
    cos, sin = ops.rope_tables(1000, 5, 10000.0, 8)
    got = ops.rope(x, cos, sin, style)
    np.testing.assert_allclose(got, _rope_reference(x, range(1000, 1005), 10000.0, style), atol=1e-10)
    # A rotation keeps each pair's norm.
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-12)


def test_interleaved_rope_on_permuted_rows_equals_neox_on_original():
    """llama GGUFs store Q/K rows permuted so that interleaved RoPE equals HF's rotate-half RoPE."""
    ops = get_ops("numpy", "f64")
    rng = np.random.default_rng(1)
    D = 8
    x = rng.standard_normal((4, 1, D))
    perm = np.empty(D, dtype=int)
    perm[0::2] = np.arange(D // 2)
    perm[1::2] = np.arange(D // 2) + D // 2
    cos, sin = ops.rope_tables(3, 4, 500.0, D)
    neox = ops.rope(x, cos, sin, RopeStyle.NEOX)
    inter = ops.rope(x[..., perm], cos, sin, RopeStyle.INTERLEAVED)
    np.testing.assert_allclose(inter, neox[..., perm], atol=1e-12)


def _attention_reference(q, k, v, q_pos0, k_pos0, window, scale):
    T, H, D = q.shape
    S, Hkv, _ = k.shape
    G = H // Hkv
    out = np.zeros((T, H, D))
    for t in range(T):
        p = q_pos0 + t
        for h in range(H):
            kh = h // G
            scores, vals = [], []
            for j in range(S):
                kp = k_pos0 + j
                if kp <= p and (window is None or p - kp < window):
                    scores.append(q[t, h] @ k[j, kh] * scale)
                    vals.append(v[j, kh])
            w = np.exp(np.array(scores) - max(scores))
            out[t, h] = (w / w.sum()) @ np.array(vals)
    return out.reshape(T, H * D)


@pytest.mark.parametrize(
    ("T", "S", "q_pos0", "k_pos0", "window"),
    [
        (6, 6, 0, 0, None),
        (4, 10, 6, 0, None),
        (1, 9, 8, 0, None),
        (5, 12, 9, 2, 4),
        (1, 4, 10, 7, 4),
        (7, 7, 0, 0, 3),
    ],
)
def test_attention_gqa_causal_and_window(ops, T, S, q_pos0, k_pos0, window):
    rng = np.random.default_rng(2)
    q = rng.standard_normal((T, 6, 4))
    k = rng.standard_normal((S, 2, 4))
    v = rng.standard_normal((S, 2, 4))
    got = ops.attention(q, k, v, q_pos0=q_pos0, k_pos0=k_pos0, window=window, scale=0.5)
    np.testing.assert_allclose(got, _attention_reference(q, k, v, q_pos0, k_pos0, window, 0.5), atol=1e-12)


def test_rms_norm_and_activations(ops):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 16))
    w = rng.standard_normal(16)
    expected = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(ops.rms_norm(x, w, 1e-6), expected, rtol=1e-12)
    np.testing.assert_allclose(ops.silu(x), x / (1 + np.exp(-x)), rtol=1e-12)
    gelu = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(ops.gelu_tanh(x), gelu, rtol=1e-12)


@pytest.mark.parametrize("activation", list(Activation))
def test_gated_mlp(ops, activation):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 8))
    wg, wu, wd = rng.standard_normal((16, 8)), rng.standard_normal((16, 8)), rng.standard_normal((8, 16))
    act = ops.silu if activation is Activation.SILU else ops.gelu_tanh
    expected = (act(x @ wg.T) * (x @ wu.T)) @ wd.T
    np.testing.assert_allclose(
        ops.gated_mlp(x, np.concatenate([wg, wu]), wd, activation), expected, rtol=1e-12
    )


def test_project_equals_the_separate_products_bit_for_bit(ops):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((7, 24))
    ws = [rng.standard_normal((n, 24)) for n in (36, 12, 12)]
    parts = ops.project(x, np.concatenate(ws), (36, 12, 12))
    for got, w in zip(parts, ws, strict=True):
        np.testing.assert_array_equal(got, ops.matmul(x, w))


@pytest.mark.parametrize("post", [False, True])
def test_add_rms_norm_is_the_residual_add_then_the_next_norm(ops, post):
    rng = np.random.default_rng(6)
    x, y = rng.standard_normal((3, 16)), rng.standard_normal((3, 16))
    w_post, w_next = rng.standard_normal(16), rng.standard_normal(16)
    branch = ops.rms_norm(y, w_post, 1e-6) if post else y
    x_new, h = ops.add_rms_norm(x, y, w_post if post else None, w_next, 1e-6)
    np.testing.assert_array_equal(x_new, x + branch)
    np.testing.assert_array_equal(h, ops.rms_norm(x + branch, w_next, 1e-6))


@pytest.mark.parametrize("style", list(RopeStyle))
@pytest.mark.parametrize("norm", [False, True])
def test_qk_norm_rope_is_per_head_norm_then_rope(ops, style, norm):
    rng = np.random.default_rng(7)
    n_tok, n_head, n_kv, d = 5, 4, 2, 8
    q, k = rng.standard_normal((n_tok, n_head * d)), rng.standard_normal((n_tok, n_kv * d))
    qn, kn = (rng.standard_normal(d), rng.standard_normal(d)) if norm else (None, None)
    cos, sin = ops.rope_tables(3, n_tok, 10000.0, d)
    got_q, got_k = ops.qk_norm_rope(q, k, d, qn, kn, cos, sin, style, 1e-6)
    q3, k3 = q.reshape(n_tok, n_head, d), k.reshape(n_tok, n_kv, d)
    if norm:
        q3, k3 = ops.rms_norm(q3, qn, 1e-6), ops.rms_norm(k3, kn, 1e-6)
    np.testing.assert_array_equal(got_q, ops.rope(q3, cos, sin, style))
    np.testing.assert_array_equal(got_k, ops.rope(k3, cos, sin, style))


def test_attention_over_a_ring_reads_position_modulo_capacity(ops):
    rng = np.random.default_rng(8)
    cap, window, n_q, q_pos0 = 16, 6, 3, 40
    k_pos0 = q_pos0 - window + 1
    keys = np.arange(k_pos0, q_pos0 + n_q)
    k_ctx = rng.standard_normal((len(keys), 1, 4))
    v_ctx = rng.standard_normal((len(keys), 1, 4))
    ring_k, ring_v = np.full((cap, 1, 4), np.nan), np.full((cap, 1, 4), np.nan)  # unseen slots: NaN
    ring_k[keys % cap], ring_v[keys % cap] = k_ctx, v_ctx
    q = rng.standard_normal((n_q, 2, 4))
    want = ops.attention(q, k_ctx, v_ctx, q_pos0=q_pos0, k_pos0=k_pos0, window=window, scale=0.5)
    got = ops.attention(
        q, ring_k, ring_v, q_pos0=q_pos0, k_pos0=k_pos0, window=window, scale=0.5, ring_capacity=cap
    )
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("group", [None, 32])
def test_int8_round_trip_error_is_bounded_by_half_a_step(group):
    ops = get_ops("numpy", "f32")
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((7, 2, 64)) * rng.uniform(0.1, 50, (7, 2, 1))).astype(np.float32)
    x[0, 0] = 0.0  # an all-zero block must not divide by zero
    q, scale = ops.quantize_int8(x, group)
    assert q.dtype == np.int8 and scale.dtype == np.float32
    assert scale.shape == (7, 2, 1 if group is None else 64 // group)
    y = ops.dequantize_int8(q, scale)
    step = np.repeat(scale, x.shape[-1] // scale.shape[-1], axis=-1)
    assert np.all(np.abs(y - x) <= step / 2 + 1e-6)
    assert np.all(y[0, 0] == 0)


@pytest.mark.parametrize("group", [None, 32])
def test_the_numba_int8_quantization_is_numpys_bit_for_bit(numba_ops, group):
    """`NumbaOps.quantize_int8` (`numba_kernels.quantize_int8_blocks`, what every int8 K/V store encodes with)
    gives numpy's q and scales exactly: magnitudes over six decades, an all-zero block, values on rounding ties."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal((9, 3, 64)) * 10.0 ** rng.uniform(-3, 3, (9, 3, 1))).astype(np.float32)
    x[0, 0] = 0.0
    x[1, 1, :32] = np.arange(
        -15.5, 16.5, dtype=np.float32
    )  # block max 15.5: scale 15.5 / 127, q off the ties
    x[2, 2] = np.concatenate([[127.0], np.arange(-62.5, 0.5, dtype=np.float32)])  # scale 1: ties to even
    want_q, want_scale = get_ops("numpy", "f32").quantize_int8(x, group)
    got_q, got_scale = numba_ops.quantize_int8(x, group)
    assert got_q.dtype == np.int8 and got_scale.dtype == np.float32 and got_scale.shape == want_scale.shape
    assert np.array_equal(got_q, want_q)
    assert np.array_equal(got_scale.view(np.uint32), want_scale.view(np.uint32))


# ---- the numba kernels (--cpu-kernels numba) against the numpy oracle ------------------------------------
# Products: |y - y_oracle| <= PRODUCT_RTOL * (|x| @ |W|^T) per output, an f32 sum reassociated (measured:
# under 1e-6 on both models' weights). Attention: |out - oracle| <= ATTENTION_RTOL * max|v|.
PRODUCT_RTOL = 1e-5
ATTENTION_RTOL = 1e-5
STEP_RTOL = 1e-5


@pytest.fixture(scope="module", params=["serial", "parallel"])
def numba_ops(request):
    """The numba ops, their kernels on the calling thread (a decode step's small work) or over all
    threads (the thresholds lowered to zero: the parallel twins)."""
    from strata_engine.ops import numba_ops as module

    ops = get_ops("numpy", "f32", "numba", threads=2)
    saved = module.PARALLEL_MIN_BYTES, module.PARALLEL_MIN_SCORES, module.ACTIVATION_PARALLEL_MIN_ROWS
    threshold = 1 << 62 if request.param == "serial" else 0
    module.PARALLEL_MIN_BYTES = module.PARALLEL_MIN_SCORES = module.ACTIVATION_PARALLEL_MIN_ROWS = threshold
    yield ops
    module.PARALLEL_MIN_BYTES, module.PARALLEL_MIN_SCORES, module.ACTIVATION_PARALLEL_MIN_ROWS = saved


def test_every_packed_type_is_exact_and_the_kernels_read_it(numba_ops):
    """Random blocks of every type the kernels take, packed (4-bit pairs or int8; f16 or float32 scales),
    give gguf's dequantization bit for bit, and the kernels' products and dequantization agree with it;
    so do rows of different types stacked into one weight."""
    from strata_engine.ops.packed import PACKERS, stack_rows

    assert {t.name for t in PACKERS} == set(F16_FIELDS)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    parts = []
    for qtype, (_, block, four_bit) in PACKERS.items():
        packed, dense = random_packed(qtype, 6, 512, rng)
        assert (packed.four_bit, packed.block, packed.values.dtype) == (
            four_bit,
            block,
            np.uint8 if four_bit else np.int8,
        )
        np.testing.assert_array_equal(packed.dequantize(), dense, err_msg=qtype.name)
        np.testing.assert_array_equal(numba_ops.dequantize(packed), dense, err_msg=qtype.name)
        bound = PRODUCT_RTOL * (np.abs(x) @ np.abs(dense).T)
        assert np.all(np.abs(numba_ops.matmul(x, packed) - x @ dense.T) <= bound), qtype.name
        parts.append((packed, dense))
    stacked = stack_rows([p for p, _ in parts])
    dense = np.concatenate([d for _, d in parts])
    np.testing.assert_array_equal(stacked.dequantize(), dense)
    assert np.all(
        np.abs(numba_ops.matmul(x, stacked) - x @ dense.T) <= PRODUCT_RTOL * (np.abs(x) @ np.abs(dense).T)
    )


@pytest.mark.parametrize("n_tok", [1, 2, 3, 4, 5, 8, 9, 16])
def test_both_packed_kernels_match_the_oracle_for_every_layout(numba_ops, n_tok):
    """Every packing (each GGUF type's, and the layouts in EXTRA_LAYOUTS) through the kernel a token row at a
    time and through the one decoding each block once for a group of rows, against numpy on the
    dequantized weight (an odd number of weight rows: the last past the pairs); and a row's result in the
    multi-row kernel does not depend on the rows beside it nor on its place among them, and below
    PAIR_MIN_ROWS rows equals the row alone (a batched decode step gives each slot what it gets alone)."""
    from strata_engine.ops import numba_kernels as nk
    from strata_engine.ops.packed import PACKERS

    rng = np.random.default_rng(12)
    weights = [(t.name, random_packed(t, 41, 512, rng)[0]) for t in PACKERS]
    weights += [(str(layout), made_packed(layout, 41, 512, rng)) for layout in EXTRA_LAYOUTS]
    for name, packed in weights:
        dense = packed.dequantize().astype(np.float64)
        x = rng.standard_normal((n_tok, 512)).astype(np.float32)
        want = x @ dense.T
        bound = PRODUCT_RTOL * (np.abs(x) @ np.abs(dense).T)
        for by_row in (True, False):
            got = numba_ops.packed_matmul(x, packed, by_row=by_row)
            assert got.dtype == np.float32 and np.all(np.abs(got - want) <= bound), (name, by_row)
        grouped = numba_ops.packed_matmul(x, packed, by_row=False)
        flipped = numba_ops.packed_matmul(np.ascontiguousarray(x[::-1]), packed, by_row=False)
        np.testing.assert_array_equal(flipped[::-1], grouped, err_msg=name)
        if n_tok < nk.PAIR_MIN_ROWS:
            alone = [numba_ops.packed_matmul(x[i : i + 1], packed, by_row=False) for i in range(n_tok)]
            np.testing.assert_array_equal(grouped, np.concatenate(alone), err_msg=name)


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
@pytest.mark.parametrize("n_tok", [1, 2, 3, 4, 5, 8, 16, 17, 64, 65, 100])
def test_packed_products_match_the_oracle_on_real_weights(numba_ops, model_files, name, n_tok):
    """The packed kernels (a row at a time for one row, a block decoded once for a group of rows up to
    PACKED_MAX_ROWS) and the dequantize-then-BLAS path (above) against numpy's product with the weights
    dequantized, for both models' weight shapes (the head's first 8,192 rows)."""
    rng = np.random.default_rng(10)
    for packed, dense in real_weights(model_files[name], 8192):
        x = rng.standard_normal((n_tok, dense.shape[1])).astype(np.float32)
        got = numba_ops.matmul(x, packed)
        want = x.astype(np.float64) @ dense.T.astype(np.float64)
        bound = PRODUCT_RTOL * (np.abs(x).astype(np.float64) @ np.abs(dense).T)
        assert got.shape == want.shape and got.dtype == np.float32
        assert np.all(np.abs(got - want) <= bound), (
            f"{name} {dense.shape}: {np.max(np.abs(got - want) / bound):.2f}"
        )


def test_packed_kernels_keep_one_signature(numba_ops):
    """A product kernel compiles once per weight layout: calls with and without mins, with one row or
    many, pass the same types (another signature would compile in a request)."""
    from strata_engine.ops import numba_kernels as nk
    from strata_engine.ops.packed import PackedWeight

    rng = np.random.default_rng(11)
    before = len(nk.matmul_packed.signatures), len(nk.dequantize_packed.signatures)
    for mins in (None, np.ones((5, 2), np.float32)):
        w = PackedWeight(rng.integers(-9, 9, (5, 64), dtype=np.int8), np.ones((5, 2), np.float32), mins, 32)
        for n_tok in (1, 2, 20):
            numba_ops.matmul(rng.standard_normal((n_tok, 64)), w)
    after = len(nk.matmul_packed.signatures), len(nk.dequantize_packed.signatures)
    assert after[0] - before[0] <= 1 and after[1] - before[1] <= 1


# (query tokens, held positions, K/V heads, query heads, head dim, window): both models' head layouts,
# decode and short prompts (the tiled kernel, key splits), prefill chunks (the kernel over blocks of queries, a
# 256-wide head's global chunk at 3,100 held among them; key blocks through BLAS for 256-wide heads over 6,144+
# keys: the two at 6,200 held, one with a window); 16
# tokens whose windows start at 16 different keys of the tiles (each row its own visible range), head
# sizes 128, 32 (the tiny family models') and 96 (Phi-3-mini's), and one the kernels have no vector IR for (160:
# a plain loop).
ATTENTION_CASES = [
    (1, 1, 3, 9, 64, None),
    (1, 700, 3, 9, 64, None),
    (5, 300, 3, 9, 64, None),
    (40, 1200, 3, 9, 64, None),
    (1, 900, 1, 4, 256, 512),
    (16, 1000, 1, 4, 256, 512),
    (33, 600, 1, 4, 256, 512),
    (16, 2100, 3, 9, 64, 700),
    (20, 3100, 1, 4, 256, None),
    (20, 6200, 1, 4, 256, None),
    (18, 6200, 1, 4, 256, 6190),
    (3, 517, 2, 8, 128, None),
    (40, 600, 2, 8, 32, None),
    (5, 300, 2, 8, 96, 64),
    (1, 300, 2, 8, 96, None),
    (2, 150, 2, 4, 160, 64),
]


def _stored(ops, x, kv_type):
    """x [S, Hkv, D] as the pool stores it and as the oracle sees it: (stored, scales, decoded f32)."""
    if kv_type == "int8":
        q, s = ops.quantize_int8(x, 32)
        return q, s, ops.dequantize_int8(q, s)
    dtype = np.float16 if kv_type == "f16" else np.float32
    stored = x.astype(dtype)
    return stored, None, stored.astype(np.float32)


@pytest.mark.parametrize("kv_type", ["f32", "f16", "int8"])
@pytest.mark.parametrize(("n_tok", "held", "n_kv", "n_head", "d", "window"), ATTENTION_CASES)
def test_attention_over_stored_kv_matches_the_oracle(
    numba_ops, kv_type, n_tok, held, n_kv, n_head, d, window
):
    """Attention reading K/V as stored (f32, f16, int8 with scales), a full layer's slice and the same
    keys in a ring that wraps, against NumpyOps.attention over the decoded float32 context; and bit for bit
    what it gives over that decoded context (a resident ring's gathered copy) wherever the rows lie."""
    oracle = get_ops("numpy", "f32")
    rng = np.random.default_rng(12)
    s = held + n_tok
    q_pos0 = held
    lo = 0 if window is None else max(0, q_pos0 - window + 1)
    q = rng.standard_normal((n_tok, n_head, d)).astype(np.float32)
    k = rng.standard_normal((s, n_kv, d)).astype(np.float32) * 2
    v = rng.standard_normal((s, n_kv, d)).astype(np.float32)
    (ks, kscale, kf), (vs, vscale, vf) = _stored(oracle, k, kv_type), _stored(oracle, v, kv_type)
    want = oracle.attention(q, kf[lo:], vf[lo:], q_pos0=q_pos0, k_pos0=lo, window=window, scale=0.125)
    atol = ATTENTION_RTOL * float(np.abs(vf).max())

    def cut(a):
        return None if a is None else a[lo:]

    got = numba_ops.attention(
        q, ks[lo:], vs[lo:], q_pos0=q_pos0, k_pos0=lo, window=window, scale=0.125, k_scale=cut(kscale),
        v_scale=cut(vscale),
    )  # fmt: skip
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)
    cap = s - lo + 7  # a ring holding every visible key, wrapping at a position that is no tile boundary
    slots = np.arange(lo, s) % cap

    def ring(a):
        if a is None:
            return None
        out = np.zeros((cap, *a.shape[1:]), dtype=a.dtype)
        out[slots] = a[lo:]
        return out

    got_ring = numba_ops.attention(
        q, ring(ks), ring(vs), q_pos0=q_pos0, k_pos0=lo, window=window, scale=0.125, ring_capacity=cap,
        k_scale=ring(kscale), v_scale=ring(vscale),
    )  # fmt: skip
    np.testing.assert_allclose(got_ring, want, rtol=0, atol=atol)
    decoded = numba_ops.attention(q, kf[lo:], vf[lo:], q_pos0=q_pos0, k_pos0=lo, window=window, scale=0.125)
    np.testing.assert_array_equal(got, decoded)
    np.testing.assert_array_equal(got_ring, decoded)


def _capped_attention(q, k, v, q_pos0, window, scale, cap):
    """Soft-capped causal attention written out in float64 (keys from position 0): the numpy oracle's oracle."""
    qp = q_pos0 + np.arange(q.shape[0])[:, None]
    kp = np.arange(k.shape[0])[None, :]
    visible = (kp <= qp) & ((qp - kp < window) if window else True)
    group = q.shape[1] // k.shape[1]
    out = np.empty((q.shape[0], q.shape[1], q.shape[2]))
    for h in range(q.shape[1]):
        s = q[:, h].astype(np.float64) @ k[:, h // group].T.astype(np.float64) * scale
        s = np.where(visible, cap * np.tanh(s / cap), -np.inf)
        w = np.exp(s - s.max(axis=-1, keepdims=True))
        out[:, h] = (w / w.sum(axis=-1, keepdims=True)) @ v[:, h // group]
    return out.reshape(q.shape[0], -1)


# (tokens, held, Hkv, H, D, window): a decode step, a chunk of the tiled kernel (blocks of queries) in a window, a
# chunk of 256-wide heads past SOFTCAP_BLAS_HELD keys (the BLAS key blocks, their threshold lowered to it).
SOFTCAP_CASES = [(1, 300, 2, 4, 64, None), (40, 100, 2, 4, 64, 60), (20, 1200, 1, 4, 256, None)]
SOFTCAP_BLAS_HELD = 1000


@pytest.mark.parametrize(("n_tok", "held", "n_kv", "n_head", "d", "window"), SOFTCAP_CASES)
def test_soft_capped_attention_matches_the_oracle(
    numba_ops, monkeypatch, n_tok, held, n_kv, n_head, d, window
):
    """gemma2's attention logit soft-cap on every CPU path (numpy, numba's kernels: one range, key splits,
    query blocks, BLAS key blocks; a batched step's rows), scores large enough for the cap to bite (|s| ~ 4 * cap)."""
    from strata_engine.ops import numba_ops as module

    monkeypatch.setattr(module, "ATTN_BLAS_MIN_HELD", SOFTCAP_BLAS_HELD)
    oracle = get_ops("numpy", "f32")
    rng = np.random.default_rng(50)
    s, cap = held + n_tok, 2.0
    q = rng.standard_normal((n_tok, n_head, d)).astype(np.float32) * 4
    k = rng.standard_normal((s, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((s, n_kv, d)).astype(np.float32)
    exact = _capped_attention(q, k, v, held, window, d**-0.5, cap)
    want = oracle.attention(q, k, v, q_pos0=held, k_pos0=0, window=window, scale=d**-0.5, softcap=cap)
    np.testing.assert_allclose(want, exact, rtol=0, atol=1e-5)
    uncapped = oracle.attention(q, k, v, q_pos0=held, k_pos0=0, window=window, scale=d**-0.5)
    assert np.abs(uncapped - exact).max() > 0.1  # the cap bites
    got = numba_ops.attention(q, k, v, q_pos0=held, k_pos0=0, window=window, scale=d**-0.5, softcap=cap)
    np.testing.assert_allclose(got, exact, rtol=0, atol=1e-5)
    rows = numba_ops.attention_rows(
        q[-1:], k[None], v[None], None, None, slots=[0], q_pos=[s - 1], k_lo=[0 if window is None else s - window],
        capacity=0, window=window or 0, scale=d**-0.5, softcap=cap,
    )  # fmt: skip
    np.testing.assert_allclose(rows, exact[-1:], rtol=0, atol=1e-5)


@pytest.mark.parametrize("kv_type", ["f32", "f16", "int8"])
@pytest.mark.parametrize("ring", [False, True])
@pytest.mark.parametrize(
    ("n_kv", "n_head", "d", "window"), [(3, 9, 64, None), (1, 4, 256, 300), (2, 8, 128, 40)]
)
def test_a_batched_steps_attention_equals_each_row_attending_alone(kv_type, ring, n_kv, n_head, d, window):
    """`attention_rows` (a batched decode step: one row per slot of a layer's storage for every slot, at its
    own depth, in any slot order) against the oracle over each slot's decoded keys and against `attention`
    over that slot alone."""
    oracle = get_ops("numpy", "f32")
    ops = get_ops("numpy", "f32", "numba", threads=2)
    rng = np.random.default_rng(21)
    n_slots, cap = 4, 700
    held = {2: 650, 0: 1, 3: 333}  # slot -> the row's position (keys 0 .. position held in the slot)
    keys = rng.standard_normal((n_slots, cap, n_kv, d)).astype(np.float32) * 2
    values = rng.standard_normal((n_slots, cap, n_kv, d)).astype(np.float32)
    (ks, kscale, kf), (vs, vscale, vf) = (
        _stored(oracle, a.reshape(-1, n_kv, d), kv_type) for a in (keys, values)
    )
    ks, vs, kf, vf = (a.reshape(n_slots, cap, *a.shape[1:]) for a in (ks, vs, kf, vf))
    kscale, vscale = (None if a is None else a.reshape(n_slots, cap, *a.shape[1:]) for a in (kscale, vscale))
    q = rng.standard_normal((len(held), n_head, d)).astype(np.float32)
    slots, positions = list(held), list(held.values())
    k_lo = [0 if window is None else max(0, p - window + 1) for p in positions]
    # in a ring of `cap` slots position p sits at p % cap: the same stored rows read as positions cap ..
    shift = cap if ring else 0
    got = ops.attention_rows(
        q, ks, vs, kscale, vscale, slots=slots, q_pos=[p + shift for p in positions], k_lo=[lo + shift for lo in k_lo],
        capacity=cap if ring else 0, window=window or 0, scale=0.125,
    )  # fmt: skip
    assert got.shape == (len(held), n_head * d)
    for b, (slot, p, lo) in enumerate(zip(slots, positions, k_lo, strict=True)):
        want = oracle.attention(q[b : b + 1], kf[slot, lo : p + 1], vf[slot, lo : p + 1], q_pos0=p, k_pos0=lo,
                                window=window, scale=0.125)  # fmt: skip
        np.testing.assert_allclose(
            got[b : b + 1], want, rtol=0, atol=ATTENTION_RTOL * float(np.abs(vf).max())
        )
        alone = ops.attention(
            q[b : b + 1], ks[slot, lo : p + 1], vs[slot, lo : p + 1], q_pos0=p, k_pos0=lo, window=window, scale=0.125,
            k_scale=None if kscale is None else kscale[slot, lo : p + 1],
            v_scale=None if vscale is None else vscale[slot, lo : p + 1],
        )  # fmt: skip
        np.testing.assert_allclose(got[b : b + 1], alone, rtol=1e-5, atol=1e-6)


def test_warm_attention_compiles_the_blas_paths_softmax_step():
    """A wide head's chunk deep in a context (gemma3's global layers: key blocks through BLAS with the online
    softmax in `online_softmax_step`) compiles nothing after `warm_attention`."""
    from strata_engine.ops import numba_kernels as nk
    from strata_engine.ops import numba_ops as module

    ops = get_ops(
        "numpy", "f32", "numba", threads=2, batch_invariant=False
    )  # the BLAS path is the fast one's
    rng = np.random.default_rng(6)
    held, n_tok = module.ATTN_BLAS_MIN_HELD + 20, module.ATTN_KERNEL_MAX_TOKENS + 4
    kv = rng.standard_normal((held + n_tok, 1, 256)).astype(np.float16)
    ops.warm_attention(kv, kv)
    before = len(nk.online_softmax_step.signatures)
    q = rng.standard_normal((n_tok, 4, 256)).astype(np.float32)
    ops.attention(q, kv, kv, q_pos0=held, k_pos0=0, window=None, scale=0.0625)
    assert before >= 1 and len(nk.online_softmax_step.signatures) == before


@pytest.mark.parametrize("kv_type", ["f16", "int8"])
def test_warm_attention_compiles_what_a_deep_request_runs(kv_type, monkeypatch):
    """After `warm_attention` on a pool's storage, attention over it -- a full layer's slice or a ring,
    serial or over all threads -- runs without compiling another signature (it would in a request)."""
    from strata_engine.ops import numba_kernels as nk
    from strata_engine.ops import numba_ops as module

    ops = get_ops("numpy", "f32", "numba", threads=2)
    rng = np.random.default_rng(5)
    stored, scale, _ = _stored(ops, rng.standard_normal((80, 3, 64)).astype(np.float32), kv_type)
    ops.warm_attention(stored, stored, scale, scale)
    kernels = (nk.attention, nk.attention_serial, nk.attention_blocks, nk.attention_rows)
    before = [len(kernel.signatures) for kernel in kernels]
    q = rng.standard_normal((2, 9, 64)).astype(np.float32)
    for threshold in (module.PARALLEL_MIN_SCORES, 0):
        monkeypatch.setattr(module, "PARALLEL_MIN_SCORES", threshold)
        ops.attention(
            q,
            stored[5:60],
            stored[5:60],
            q_pos0=58,
            k_pos0=5,
            window=None,
            scale=0.125,
            k_scale=None if scale is None else scale[5:60],
            v_scale=None if scale is None else scale[5:60],
        )
        ops.attention(q, stored, stored, q_pos0=98, k_pos0=40, window=50, scale=0.125, ring_capacity=80,
                      k_scale=scale, v_scale=scale)  # fmt: skip
    chunk = rng.standard_normal((20, 9, 64)).astype(np.float32)  # a prompt's chunk: blocks of queries
    ops.attention(
        chunk,
        stored[:60],
        stored[:60],
        q_pos0=40,
        k_pos0=0,
        window=None,
        scale=0.125,
        k_scale=None if scale is None else scale[:60],
        v_scale=None if scale is None else scale[:60],
    )
    ops.attention(chunk, stored, stored, q_pos0=95, k_pos0=40, window=50, scale=0.125, ring_capacity=80,
                  k_scale=scale, v_scale=scale)  # fmt: skip
    arena, arena_scale = np.stack([stored, stored]), None if scale is None else np.stack([scale, scale])
    for capacity in (0, 80):  # a batched step over every slot's storage, full layers and rings
        ops.attention_rows(q, arena, arena, arena_scale, arena_scale, slots=[1, 0], q_pos=[70, 90], k_lo=[0, 30],
                           capacity=capacity, window=0, scale=0.125)  # fmt: skip
    assert [len(kernel.signatures) for kernel in kernels] == before


@pytest.mark.parametrize("style", list(RopeStyle))
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("activation", list(Activation))
def test_fused_steps_match_the_oracle(numba_ops, style, norm, activation):
    """The numba ops' one-call steps (norms, the residual add, per-head norm + RoPE from the projection's
    column views, the gated activation) against NumpyOps, within STEP_RTOL."""
    from strata_engine.ops.packed import QK, PackedWeight

    oracle = get_ops("numpy", "f32")
    rng = np.random.default_rng(15)
    n_tok, n_head, n_kv, d, e = 3, 4, 2, 16, 64
    x, y = rng.standard_normal((2, n_tok, e)).astype(np.float32)
    w_post, w_next = rng.standard_normal((2, e)).astype(np.float32)
    np.testing.assert_allclose(
        numba_ops.rms_norm(x, w_next, 1e-6), oracle.rms_norm(x, w_next, 1e-6), rtol=STEP_RTOL, atol=STEP_RTOL
    )
    for got, want in zip(
        numba_ops.add_rms_norm(x, y, w_post if norm else None, w_next, 1e-6),
        oracle.add_rms_norm(x, y, w_post if norm else None, w_next, 1e-6),
        strict=True,
    ):
        np.testing.assert_allclose(got, want, rtol=STEP_RTOL, atol=STEP_RTOL)
    qkv = rng.standard_normal((n_tok, (n_head + 2 * n_kv) * d)).astype(np.float32)
    q, k = qkv[:, : n_head * d], qkv[:, n_head * d : (n_head + n_kv) * d]  # column views, as `project` gives
    qn, kn = rng.standard_normal((2, d)).astype(np.float32) if norm else (None, None)
    cos, sin = oracle.rope_tables(7, n_tok, 10000.0, d)
    want_qk = oracle.qk_norm_rope(q, k, d, qn, kn, cos, sin, style, 1e-6)
    for q_in, k_in in ((q, k), (np.asfortranarray(q), np.asfortranarray(k))):  # rows read in place, or copied
        for got, want in zip(
            numba_ops.qk_norm_rope(q_in, k_in, d, qn, kn, cos, sin, style, 1e-6), want_qk, strict=True
        ):
            np.testing.assert_allclose(got, want, rtol=STEP_RTOL, atol=STEP_RTOL)
    n_ff = 64
    w_gu = PackedWeight(
        rng.integers(-127, 128, (2 * n_ff, e), dtype=np.int8),
        rng.random((2 * n_ff, e // QK), dtype=np.float32) / 50,
        None,
        QK,
    )
    w_down = PackedWeight(
        rng.integers(-127, 128, (e, n_ff), dtype=np.int8),
        rng.random((e, n_ff // QK), dtype=np.float32) / 50,
        None,
        QK,
    )
    got = numba_ops.gated_mlp(x, w_gu, w_down, activation)
    want = oracle.gated_mlp(x, w_gu.dequantize(), w_down.dequantize(), activation)
    np.testing.assert_allclose(got, want, rtol=STEP_RTOL, atol=STEP_RTOL * np.abs(want).max())


# The gated activation's kernel (act = g * sigmoid(z), z = g for silu, 2 sqrt(2 / pi) (g + 0.044715 g^3) for
# the tanh gelu, e^-|z| by `fast_exp`) against the function in float64 of the same float32 inputs: relative
# error <= ACT_RTOL * (1 + |z|) (z's own rounding grows with |z|; measured 1.5e-7 * (1 + |z|) over g in
# [-30, 30]); below z = -87 `fast_exp` gives e^-87 (1.65e-38), so the error there is under 2e-38 |g u|.
# (numpy's 0.5 g (1 + tanh) loses all relative precision for g below about -3, where 1 + tanh(u) cancels; its
# absolute error is ~1e-7 |g u| like ours.)
ACT_RTOL = 3e-7


@pytest.mark.parametrize("activation", list(Activation))
@pytest.mark.parametrize("parallel", [False, True])
def test_gated_activation_is_within_its_bound_of_the_exact_function(activation, parallel):
    from strata_engine.ops import numba_kernels as nk

    rng = np.random.default_rng(31)
    n_tok, n_ff = 4, 60_000
    gate = np.concatenate(
        [
            np.linspace(-30, 30, 2 * n_ff, dtype=np.float32),
            rng.standard_normal(2 * n_ff, dtype=np.float32) * 3,
        ]
    )
    gate = gate.reshape(n_tok, n_ff)
    up = rng.standard_normal((n_tok, n_ff), dtype=np.float32)
    out = np.empty_like(gate)
    gelu = activation is Activation.GELU_TANH
    nk.gated_activation(np.concatenate([gate, up], axis=1), gelu, parallel, out)
    g = gate.astype(np.float64)
    z = 2 * math.sqrt(2 / math.pi) * (g + 0.044715 * g**3) if gelu else g
    with np.errstate(over="ignore"):
        exact = g / (1 + np.exp(-z)) * up
    bound = ACT_RTOL * (1 + np.minimum(np.abs(z), 87)) * np.abs(exact) + 2e-38 * np.abs(g * up)
    assert np.all(np.abs(out - exact) <= bound), float(
        np.max(np.abs(out - exact) / np.maximum(bound, 1e-300))
    )


def _f16_store_candidates() -> np.ndarray:
    """float32 values whose f16 rounding matters, NaN excepted: every finite f16 value, the midpoints between
    neighbours (ties: to even) and the float32 values either side of each, subnormal f16s and what rounds to
    zero or to the smallest of them, float32 subnormals, the overflow edge (65504, 65520 -> inf) and beyond,
    infinities, and random float32 bit patterns of every finite exponent; both signs."""
    h = (
        np.arange(0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)
    )  # 0 .. 65504, subnormals included
    upper = np.append(h[1:], np.float32(65536))  # the next f16 above each (65536: past the largest)
    mids = (h + (upper - h) / 2).astype(np.float32)  # exact in float32 (12 significant bits)
    near = [np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(0))]
    f32_subnormal = np.array([1e-45, 1e-40, 1.1754942e-38], dtype=np.float32)
    rng = np.random.default_rng(32)
    bits = rng.integers(0, 0x7F800000, 200_000, dtype=np.uint32).view(np.float32)
    edge = np.array(
        [2.0**-25, 2.0**-24, 3 * 2.0**-26, 65519.996, 65520, 65535, 1e5, 3e38, np.inf], dtype=np.float32
    )
    mag = np.concatenate([h, mids, *near, f32_subnormal, bits, edge])
    return np.concatenate([mag, -mag])


@pytest.mark.parametrize("ring", [0, 1000])
def test_f16_store_rounds_as_numpys_cast_bit_for_bit(numba_ops, ring):
    """A chunk stored into an f16 pool by the kernel (`numba_kernels.store_f16`, from a fused projection's
    column view as the models pass v) holds the bits numpy's astype(float16) gives: round to nearest, ties to
    even, subnormals, overflow to inf (NaN not claimed: the payload bits may differ)."""
    values = _f16_store_candidates()
    n_kv, d = 2, 64
    n_tok = 600
    values = np.resize(values, (values.size // (n_tok * n_kv * d) + 1) * n_tok * n_kv * d)
    with np.errstate(over="ignore"):
        for chunk in values.reshape(-1, n_tok, n_kv * d):
            fused = np.concatenate([chunk, chunk[::-1]], axis=1)  # [T, 2 Hkv D]: k, v as column views
            k, v = fused[:, : n_kv * d].reshape(n_tok, n_kv, d), fused[:, n_kv * d :].reshape(n_tok, n_kv, d)
            k_pool, v_pool = np.zeros((2, ring or 1200, n_kv, d), dtype=np.float16)
            pos0 = 700 if ring else 300  # a ring's chunk wraps past slot 999
            numba_ops.store_kv(k, v, k_pool, v_pool, pos0, ring_capacity=ring)
            slots = np.arange(pos0, pos0 + n_tok) % ring if ring else np.arange(pos0, pos0 + n_tok)
            assert np.array_equal(k_pool[slots].view(np.uint16), k.astype(np.float16).view(np.uint16))
            assert np.array_equal(v_pool[slots].view(np.uint16), v.astype(np.float16).view(np.uint16))


def test_a_batched_steps_f16_row_store_rounds_as_numpys_cast_bit_for_bit(numba_ops):
    """A batched step's rows (`store_kv_rows`: `numba_kernels.store_f16_rows`, from a fused projection's column
    views as the models pass v) land at their own slot and position with numpy's astype(float16) bits; nothing
    else in the arena changes."""
    values = _f16_store_candidates()
    n_kv, d, n_rows = 2, 64, 8
    values = np.resize(values, (values.size // (n_rows * n_kv * d) + 1) * n_rows * n_kv * d)
    slots, positions = [3, 0, 5, 1, 7, 2, 6, 4], [9, 0, 31, 17, 2, 30, 8, 16]
    with np.errstate(over="ignore"):
        for chunk in values.reshape(-1, n_rows, n_kv * d)[:64]:
            fused = np.concatenate([chunk, chunk[::-1]], axis=1)  # [B, 2 Hkv D]: k, v as column views
            k, v = (
                fused[:, : n_kv * d].reshape(n_rows, n_kv, d),
                fused[:, n_kv * d :].reshape(n_rows, n_kv, d),
            )
            k_arena, v_arena = np.full((2, 8, 32, n_kv, d), 7.0, dtype=np.float16)
            numba_ops.store_kv_rows(k, v, k_arena, v_arena, slots, positions)
            assert np.array_equal(
                k_arena[slots, positions].view(np.uint16), k.astype(np.float16).view(np.uint16)
            )
            assert np.array_equal(
                v_arena[slots, positions].view(np.uint16), v.astype(np.float16).view(np.uint16)
            )
            untouched = np.ones((8, 32), dtype=bool)
            untouched[slots, positions] = False
            assert (k_arena[untouched] == 7.0).all() and (v_arena[untouched] == 7.0).all()
