"""The numeric operations of the engine on NumPy arrays: the reference implementation of `base.Ops`.

Every heavy operation the models and the K/V code perform lives here, written against `self.xp`
(the array module), so the CuPy twin (`cupy_ops.CupyOps`) subclasses it and overrides what it runs
as its own kernels. Models never call numpy for heavy work directly.

Shape conventions: T tokens in a chunk, S context (key) positions, H query heads, Hkv K/V heads,
G = H // Hkv, D head dim. Weights are stored as ggml does, (out_features, in_features); `matmul`
computes x @ W^T (BLAS reads the transposed view without a copy).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..config import Activation, RopeStyle
from .attention_tiling import soft_cap

GELU_C = math.sqrt(2.0 / math.pi)
INT8_MAX = 127.0
# A batch-invariant product's rows per BLAS call (zero-padded): OpenBLAS gives a row a result of its own only in
# calls of one shape with the rows on gemm's N side (bench/engine/DECISIONS.md, "The numpy backend's batch invariance").
INVARIANT_ROWS = 8


def rope_angles(
    pos0: int, n: int, base: float, rope_dim: int, factors: tuple[float, ...] | None = None
) -> np.ndarray:
    """float64 angles [n, rope_dim/2]: position * base^(-2i/rope_dim) / factors[i] for positions pos0 ..
    pos0+n-1 (factors None: all 1)."""
    inv_freq = 1.0 / (base ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim))
    if factors is not None:
        inv_freq /= np.asarray(factors, dtype=np.float64)
    return np.arange(pos0, pos0 + n, dtype=np.float64)[:, None] * inv_freq[None, :]


class NumpyOps:
    """Operations on `xp` arrays in `dtype` (the compute dtype: float32 by default)."""

    name = "numpy"
    packs_weights = False
    attends_in_place = False
    compiles_kernels = False
    copies_beside_steps = False

    def __init__(self, dtype: str = "f32", batch_invariant: bool = False):
        self.xp: Any = np
        self.dtype = np.dtype({"f32": np.float32, "f64": np.float64}[dtype])
        # a row's arithmetic never depends on the pass's other rows (`settings.EngineSettings.batch_invariant`):
        # products in fixed row groups (`grouped_matmul`), a prompt's attention query by query as decoding does
        self.batch_invariant = batch_invariant

    # ---- data movement -------------------------------------------------------------------------
    def asarray(self, host: np.ndarray, dtype: Any = None) -> Any:
        """Host array -> backend array (a no-op copy-free view here)."""
        return self.xp.ascontiguousarray(host, dtype=dtype)

    def to_host(self, arr: Any) -> np.ndarray:
        return np.asarray(arr)

    def copy_bytes(self, dest: np.ndarray, offset: int, src: np.ndarray) -> None:
        """dest[offset:offset + src.nbytes] = src for flat uint8 arrays (done when this returns)."""
        dest[offset : offset + src.nbytes] = src

    def flush_copies(self) -> None:
        """Start every copy copy_bytes held back: none here (each is done when copy_bytes returns)."""

    def synchronize(self) -> None:
        """Wait for queued work: none here (numpy computes when called)."""

    def take_row(self, a: Any, row: Any) -> Any:
        """Row `row` (an int32 [1] array) of a [T, ...] as a new [1, ...] array."""
        i = int(row[0])
        return a[i : i + 1].copy()

    def weight(self, host_f32: np.ndarray) -> Any:
        """A dequantized weight in the compute dtype on the backend."""
        return self.xp.ascontiguousarray(host_f32, dtype=self.dtype)

    def packed_layout(self, w: Any) -> Any:
        """A packed weight as packed: these products read no other layout (they take no packed weights)."""
        return w

    # ---- elementwise and normalisation ---------------------------------------------------------
    def embed(self, table: Any, ids: np.ndarray, scale: float = 1.0) -> Any:
        """Rows of `table` [V, E] for `ids` [T] -> [T, E], times `scale` (gemma: sqrt(E))."""
        x = table[self.xp.asarray(ids)]
        if scale != 1.0:
            x *= self.dtype.type(scale)
        return x

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        """x / sqrt(mean(x^2) + eps) * weight over the last axis (gemma3 weights already hold the +1)."""
        xp = self.xp
        ms = xp.mean(xp.square(x), axis=-1, keepdims=True)
        return x * (1.0 / xp.sqrt(ms + self.dtype.type(eps))) * weight

    def add_rms_norm(self, x: Any, y: Any, w_post: Any | None, w_next: Any, eps: float) -> tuple[Any, Any]:
        """The residual step between blocks: x' = x + (rms_norm(y) * w_post if w_post is given, else y)
        (gemma3 normalises each branch, llama adds it as it is); returns (x', rms_norm(x') * w_next)."""
        if w_post is not None:
            y = self.rms_norm(y, w_post, eps)
        x = x + y
        return x, self.rms_norm(x, w_next, eps)

    def silu(self, x: Any) -> Any:
        return x / (1.0 + self.xp.exp(-x))

    def gelu_tanh(self, x: Any) -> Any:
        xp = self.xp
        return 0.5 * x * (1.0 + xp.tanh(self.dtype.type(GELU_C) * (x + 0.044715 * x * x * x)))

    # ---- matrix products -----------------------------------------------------------------------
    def matmul(self, x: Any, w: Any) -> Any:
        """x [T, in] @ W^T for W [out, in] -> [T, out]."""
        return self.grouped_matmul(x, w) if self.batch_invariant else x @ w.T

    def grouped_matmul(self, x: Any, w: Any) -> Any:
        """x @ W^T as W @ g^T for x's rows in groups g of INVARIANT_ROWS (the last zero-padded): one BLAS call
        shape for every row count, a row's outputs computed alike wherever it lies in its group (measured:
        x @ W^T's row bits change with the row count and the row's place, and a single row takes gemv)."""
        xp = self.xp
        n, k = x.shape
        groups = -(-n // INVARIANT_ROWS)
        padded = xp.zeros((groups * INVARIANT_ROWS, k), dtype=x.dtype)
        padded[:n] = x
        y = xp.matmul(w, padded.reshape(groups, INVARIANT_ROWS, k).transpose(0, 2, 1))  # [groups, out, rows]
        # contiguous whatever the groups (one group's reshape is a strided view): numpy's sums over a row
        # take another order on strided data
        return xp.ascontiguousarray(y.transpose(0, 2, 1).reshape(groups * INVARIANT_ROWS, -1)[:n])

    def project(self, x: Any, w_fused: Any, sizes: tuple[int, ...], bias: Any | None = None) -> list[Any]:
        """x @ W^T (+ b) for a fused weight W = [W_1; W_2; ...] whose blocks have `sizes` rows (and a fused
        bias b = [b_1; b_2; ...] where given): one product per block here (each block is a contiguous row
        range, so BLAS computes exactly what it would for the separate weight); the GPU twin makes one
        product and returns column views."""
        out, row = [], 0
        for n in sizes:
            y = self.matmul(x, w_fused[row : row + n])
            if bias is not None:
                y += bias[row : row + n]
            out.append(y)
            row += n
        return out

    def gated_mlp(self, x: Any, w_gate_up: Any, w_down: Any, activation: Activation) -> Any:
        """down(act(gate(x)) * up(x)): SwiGLU (silu) or GeGLU (tanh gelu); w_gate_up = [W_gate; W_up]."""
        n_ff = w_down.shape[1]
        gate, up = self.project(x, w_gate_up, (n_ff, n_ff))
        act = self.silu(gate) if activation is Activation.SILU else self.gelu_tanh(gate)
        act *= up
        return self.matmul(act, w_down)

    # ---- rotary position embedding -------------------------------------------------------------
    def rope_tables(
        self, pos0: int, n: int, base: float, rope_dim: int, factors: tuple[float, ...] | None = None,
        scale: float = 1.0,
    ) -> tuple[Any, Any]:  # fmt: skip
        """cos, sin [n, rope_dim/2] for positions pos0 .. pos0+n-1: theta_i = pos * base^(-2i/rope_dim)
        / factors[i] (factors None: all 1), cos and sin times `scale` (longrope's attention factor).

        Angles are formed in float64 (exact for any position below 2^53) and rounded once."""
        angles = rope_angles(pos0, n, base, rope_dim, factors)
        cos, sin = np.cos(angles), np.sin(angles)
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        return self.asarray(cos, self.dtype), self.asarray(sin, self.dtype)

    def rope(self, x: Any, cos: Any, sin: Any, style: RopeStyle) -> Any:
        """Rotate x [T, heads, D] (first rope_dim dims) by the tables [T, rope_dim/2]."""
        half = cos.shape[-1]
        rot = 2 * half
        c = cos[:, None, :]
        s = sin[:, None, :]
        out = x.copy()
        if style is RopeStyle.NEOX:
            a = x[..., :half]
            b = x[..., half:rot]
            out[..., :half] = a * c - b * s
            out[..., half:rot] = b * c + a * s
        else:
            a = x[..., 0:rot:2]
            b = x[..., 1:rot:2]
            out[..., 0:rot:2] = a * c - b * s
            out[..., 1:rot:2] = b * c + a * s
        return out

    def qk_norm_rope(
        self,
        q: Any,
        k: Any,
        head_dim: int,
        q_norm: Any | None,
        k_norm: Any | None,
        cos: Any,
        sin: Any,
        style: RopeStyle,
        eps: float,
    ) -> tuple[Any, Any]:
        """q [T, H*D], k [T, Hkv*D] (projections) -> rotated q [T, H, D], k [T, Hkv, D], each head first
        RMS-normalised with q_norm / k_norm when given (gemma3)."""
        n_tok = q.shape[0]
        q = q.reshape(n_tok, -1, head_dim)
        k = k.reshape(n_tok, -1, head_dim)
        if q_norm is not None:
            q = self.rms_norm(q, q_norm, eps)
            k = self.rms_norm(k, k_norm, eps)
        return self.rope(q, cos, sin, style), self.rope(k, cos, sin, style)

    # ---- K/V store -----------------------------------------------------------------------------
    def store_kv(self, k: Any, v: Any, k_pool: Any, v_pool: Any, pos0: int, ring_capacity: int = 0) -> None:
        """Write k, v [T, Hkv, D] into pool slots (storage dtype): position pos0 + t to slot pos0 + t,
        or (pos0 + t) % ring_capacity in a ring of that many slots."""
        slots = self.xp.arange(pos0, pos0 + k.shape[0])
        if ring_capacity:
            slots %= ring_capacity
        k_pool[slots] = k
        v_pool[slots] = v

    # ---- attention -----------------------------------------------------------------------------
    def attention(
        self,
        q: Any,
        k: Any,
        v: Any,
        *,
        q_pos0: int,
        k_pos0: int,
        window: int | None,
        scale: float,
        softcap: float = 0.0,
        ring_capacity: int = 0,
    ) -> Any:
        """Causal (optionally sliding-window) grouped-query attention, scores soft-capped where softcap > 0.

        q [T, H, D] for positions q_pos0 .. q_pos0+T-1; k, v [S, Hkv, D] for positions k_pos0 ..
        k_pos0+S-1. A query at p sees keys at j <= p with p - j < window. Returns [T, H*D].
        With `ring_capacity` > 0, k and v are a whole ring [capacity, Hkv, D] holding position p in slot
        p % capacity, and the keys are positions k_pos0 .. q_pos0+T-1.
        Batch-invariant, a chunk's queries attend one by one over exactly the keys each sees: the call decoding
        that position alone makes (`query_by_query`)."""
        xp = self.xp
        if ring_capacity:
            slots = xp.arange(k_pos0, q_pos0 + q.shape[0]) % ring_capacity
            k, v = k[slots], v[slots]
        if self.batch_invariant and q.shape[0] > 1:
            return self.query_by_query(q, k, v, q_pos0=q_pos0, k_pos0=k_pos0, window=window, scale=scale,
                                       softcap=softcap)  # fmt: skip
        n_q, n_head, d = q.shape
        n_k, n_kv, _ = k.shape
        group = n_head // n_kv
        # [T, Hkv, G, D] -> [Hkv, G*T, D]: the G query heads sharing a K/V head form one matrix.
        qg = q.reshape(n_q, n_kv, group, d).transpose(1, 2, 0, 3).reshape(n_kv, group * n_q, d)
        scores = xp.matmul(qg, k.transpose(1, 2, 0))  # [Hkv, G*T, S]
        scores *= self.dtype.type(scale)
        soft_cap(xp, scores, softcap)
        scores = scores.reshape(n_kv, group, n_q, n_k)
        bias = self.mask_bias(q_pos0, n_q, k_pos0, n_k, window)
        if bias is not None:
            scores += bias
        scores -= scores.max(axis=-1, keepdims=True)
        xp.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        out = xp.matmul(scores.reshape(n_kv, group * n_q, n_k), v.transpose(1, 0, 2))  # [Hkv, G*T, D]
        return out.reshape(n_kv, group, n_q, d).transpose(2, 0, 1, 3).reshape(n_q, n_head * d)

    def query_by_query(
        self, q: Any, k: Any, v: Any, *, q_pos0: int, k_pos0: int, window: int | None, scale: float,
        softcap: float,
    ) -> Any:  # fmt: skip
        """`attention` of each query of q [T, H, D] alone over keys [lo, p] of k, v [S, Hkv, D] (positions
        k_pos0..): a position's sums and products the same whatever chunk holds it."""
        out = []
        for t in range(q.shape[0]):
            p = q_pos0 + t
            lo = k_pos0 if window is None else max(k_pos0, p - window + 1)
            keys = slice(lo - k_pos0, p - k_pos0 + 1)
            out.append(self.attention(q[t : t + 1], k[keys], v[keys], q_pos0=p, k_pos0=lo, window=window,
                                      scale=scale, softcap=softcap))  # fmt: skip
        return self.xp.concatenate(out)

    def mask_bias(self, q_pos0: int, n_q: int, k_pos0: int, n_k: int, window: int | None) -> Any | None:
        """Additive mask [T, S] (0 where visible, -inf elsewhere), or None when every key is visible."""
        q_last = q_pos0 + n_q - 1
        k_last = k_pos0 + n_k - 1
        causal_free = k_last <= q_pos0
        window_free = window is None or q_last - k_pos0 < window
        if causal_free and window_free:
            return None
        xp = self.xp
        qp = xp.arange(q_pos0, q_pos0 + n_q)[:, None]
        kp = xp.arange(k_pos0, k_pos0 + n_k)[None, :]
        visible = kp <= qp
        if window is not None:
            visible &= (qp - kp) < window
        return xp.where(visible, self.dtype.type(0), self.dtype.type(-np.inf)).astype(self.dtype)

    def warm_attention(self, k: Any, v: Any, k_scale: Any = None, v_scale: Any = None) -> None:
        """Compile the attention kernels a warm-up does not reach: none here (nothing compiles on first call)."""

    # ---- int8 K/V ------------------------------------------------------------------------------
    def quantize_int8(self, x: Any, group: int | None = None) -> tuple[Any, Any]:
        """Symmetric int8 over blocks of `group` values of the last axis (None: the whole axis):
        x ~ q * scale with scale = max|block| / 127 (float32, shape x.shape[:-1] + (n_blocks,))."""
        xp = self.xp
        d = x.shape[-1]
        g = d if group is None else group
        blocks = x.reshape(*x.shape[:-1], d // g, g)
        scale = (xp.abs(blocks).max(axis=-1) / INT8_MAX).astype(xp.float32)
        safe = xp.where(scale > 0, scale, xp.float32(1.0))
        q = xp.rint(blocks / safe[..., None]).clip(-INT8_MAX, INT8_MAX).astype(xp.int8)
        return q.reshape(x.shape), scale

    def dequantize_int8(self, q: Any, scale: Any) -> Any:
        d = q.shape[-1]
        n_blocks = scale.shape[-1]
        blocks = q.reshape(*q.shape[:-1], n_blocks, d // n_blocks).astype(self.dtype)
        blocks *= scale[..., None].astype(self.dtype)
        return blocks.reshape(q.shape)

    # ---- output --------------------------------------------------------------------------------
    def logits(self, x: Any, w_out: Any, softcap: float = 0.0) -> np.ndarray:
        """x [T, E] @ W_out^T -> float32 host logits [T, V] (computed in the compute dtype: f32 or f64),
        soft-capped where softcap > 0."""
        return soft_cap(np, self.to_host(self.matmul(x, w_out)).astype(np.float32, copy=False), softcap)
