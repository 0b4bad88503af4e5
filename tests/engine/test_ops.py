"""The numpy ops against direct, loop-based definitions of the same math."""

from __future__ import annotations

import math

import numpy as np
import pytest
from strata_engine.config import Activation, RopeStyle
from strata_engine.ops import get_ops


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
    np.testing.assert_allclose(ops.gated_mlp(x, np.concatenate([wg, wu]), wd, activation), expected, rtol=1e-12)


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
