"""Attention tiling that does not depend on the array library: `blocked_attention` (the exact float32
path: key blocks with an online softmax, bounded score memory) runs on numpy and cupy alike and is
tested on the CPU; `flash_tiles` / `flash_splits` size strata_flash_attn's launches (kernels.cu)."""

from __future__ import annotations

from typing import Any

import numpy as np

# Bytes of float32 attention scores one key block may occupy ([Hkv, G*T, block]).
ATTENTION_SCORE_BUDGET = 256 << 20
MIN_KEY_BLOCK = 256


def soft_cap(xp: Any, s: Any, cap: float) -> Any:
    """s -> cap * tanh(s / cap) in place (gemma2's attention scores and logits); cap 0: s untouched."""
    if cap > 0:
        s *= s.dtype.type(1.0 / cap)
        xp.tanh(s, out=s)
        s *= s.dtype.type(cap)
    return s


def blocked_attention(
    xp: Any,
    q: Any,
    k: Any,
    v: Any,
    *,
    q_pos0: int,
    k_pos0: int,
    window: int | None,
    scale: float,
    softcap: float = 0.0,
    key_block: int,
    out_dtype: Any,
    softmax_step: Any = None,
) -> Any:
    """Causal (optionally sliding-window) GQA attention over key blocks with an online softmax.

    q [T, H, D]; k, v [S, Hkv, D] (any float dtype; computed in float32). A query at position p sees
    keys at j <= p with p - j < window. Key blocks wholly outside every query's view are skipped.
    Returns [T, H*D] in `out_dtype`. Per block: s = soft_cap((q * scale) k^T, softcap) + mask; m' = max(m, rowmax s);
    acc = acc * e^(m - m') + e^(s - m') v; l = l * e^(m - m') + rowsum e^(s - m'); out = acc / l.
    softmax_step(s, m, l, acc) [R, B], [R], [R], [R, D] (a compiled kernel: `numba_kernels.online_softmax_step`)
    may do a block's softmax part in place of the array library's passes."""
    f32 = xp.float32
    n_q, n_head, d = q.shape
    n_k, n_kv, _ = k.shape
    group = n_head // n_kv
    rows = group * n_q
    # [T, Hkv, G, D] -> [Hkv, G*T, D]: row r of a K/V head is query position q_pos0 + r % T.
    qg = q.astype(f32).reshape(n_q, n_kv, group, d).transpose(1, 2, 0, 3).reshape(n_kv, rows, d)
    qg *= f32(scale)  # scaling the queries once costs a pass over [rows, D], not over the scores
    q_first, q_last = q_pos0, q_pos0 + n_q - 1
    # Keys any query can see: [lo_vis, hi_vis] in positions.
    lo_vis = k_pos0 if window is None else max(k_pos0, q_first - window + 1)
    hi_vis = min(k_pos0 + n_k - 1, q_last)
    start = lo_vis - k_pos0
    stop = hi_vis - k_pos0 + 1
    qpos = xp.arange(q_first, q_last + 1)[:, None]  # [T, 1]

    def block_scores(b0: int, b1: int) -> Any:
        """Masked, scaled scores of keys [b0, b1): [Hkv, G*T, b1 - b0] float32."""
        s = soft_cap(xp, xp.matmul(qg, k[b0:b1].astype(f32, copy=False).transpose(1, 2, 0)), softcap)
        kpos0, kpos1 = k_pos0 + b0, k_pos0 + b1 - 1
        if kpos1 > q_first or (window is not None and q_last - kpos0 >= window):
            kpos = xp.arange(kpos0, kpos1 + 1)[None, :]  # [1, B]
            visible = kpos <= qpos
            if window is not None:
                visible &= (qpos - kpos) < window
            s = s.reshape(n_kv, group, n_q, b1 - b0)
            s += xp.where(visible, f32(0), f32(-np.inf)).astype(f32)  # [T, B] broadcast
            s = s.reshape(n_kv, rows, b1 - b0)
        return s

    def finish(acc: Any) -> Any:
        out = acc.reshape(n_kv, group, n_q, d).transpose(2, 0, 1, 3).reshape(n_q, n_head * d)
        return out.astype(out_dtype, copy=False)

    if stop - start <= key_block:
        # One block (every decode step, most prefill chunks): a plain softmax, no running statistics.
        s = block_scores(start, stop)
        s -= s.max(axis=-1, keepdims=True)
        xp.exp(s, out=s)
        acc = xp.matmul(s, v[start:stop].astype(f32, copy=False).transpose(1, 0, 2))
        acc /= s.sum(axis=-1, keepdims=True)
        return finish(acc)

    m = xp.full((n_kv, rows, 1), -np.inf, dtype=f32)
    l_sum = xp.zeros((n_kv, rows, 1), dtype=f32)
    acc = xp.zeros((n_kv, rows, d), dtype=f32)
    for b0 in range(start, stop, key_block):
        b1 = min(b0 + key_block, stop)
        s = block_scores(b0, b1)
        if softmax_step is not None:
            softmax_step(
                s.reshape(n_kv * rows, b1 - b0), m.reshape(-1), l_sum.reshape(-1), acc.reshape(n_kv * rows, d)
            )
            acc += xp.matmul(s, v[b0:b1].astype(f32, copy=False).transpose(1, 0, 2))
            continue
        m_new = xp.maximum(m, s.max(axis=-1, keepdims=True))
        # A row that has seen no visible key yet keeps m = -inf; shift it by 0 so exp() gives 0, not NaN.
        shift = xp.where(m_new == f32(-np.inf), f32(0), m_new)
        s -= shift
        xp.exp(s, out=s)
        correction = xp.exp(m - shift)
        l_sum *= correction
        l_sum += s.sum(axis=-1, keepdims=True)
        acc *= correction
        acc += xp.matmul(s, v[b0:b1].astype(f32, copy=False).transpose(1, 0, 2))
        m = m_new
    acc /= l_sum
    return finish(acc)


def key_block_for(n_kv: int, rows: int, budget: int = ATTENTION_SCORE_BUDGET) -> int:
    """Keys per block so that one block's float32 scores [Hkv, rows, block] fit the budget."""
    return max(MIN_KEY_BLOCK, budget // (4 * n_kv * max(rows, 1)))


FLASH_HEAD_DIMS = (64, 128, 256)  # head sizes strata_flash_attn is instantiated for


def flash_tiles(head_dim: int, rows: int) -> tuple[int, int]:
    """(warps per block, keys per tile) of strata_flash_attn: a block holds 16 query rows per warp;
    one warp when the rows fit it (decode), else four, or eight for 256-wide heads with many rows.
    Head size 256 takes 16-key tiles so a warp's accumulators stay in registers; the shapes are the
    fastest of bench/gpu/bench_gpu_kernels.py's sweep (bench/gpu/DECISIONS.md "Flash attention kernel")."""
    if rows <= 16:
        warps = 1
    else:
        warps = 8 if head_dim > 128 and rows > 64 else 4
    return warps, (16 if head_dim > 128 else 64)


FLASH_MIN_TILES = 4  # key tiles a split gets at least (`flash_splits`)
FLASH_DECODE_MIN_TILES = (
    1  # the same for a one-warp (decode) launch: bench/gpu/DECISIONS.md "Decode attention"
)


def flash_splits(
    n_blocks: int, n_keys: int, key_tile: int, n_sm: int, min_tiles: int = FLASH_MIN_TILES
) -> int:
    """Key splits per row tile: enough blocks to fill the device twice over when the row tiles alone
    do not (decode, short chunks), but never under `min_tiles` key tiles per split."""
    if n_blocks >= 2 * n_sm:
        return 1
    want = -(-2 * n_sm // n_blocks)
    return max(1, min(want, n_keys // (min_tiles * key_tile)))
