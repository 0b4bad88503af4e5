"""The compiled CPU kernels (numba): products with packed weights (`packed.py`) and attention over the K/V
pool's own storage (f32, f16 seen as uint16 bits, int8 with per-block scales), converting per tile.

Every kernel is `@njit(..., fastmath=True, cache=True)`: compiled once per argument types, cached on
disk (NUMBA_CACHE_DIR, else __pycache__ beside this file), compiled or loaded at the engine's warm-up
(`NumbaOps.warm`). Callers pass C-contiguous arrays of fixed dtypes so each kernel keeps one signature.

Shapes: x [M, K] float32 activations; a Q4 weight's values uint8 [N, K / 2], a Q8 weight's int8 [N, K];
scale, mins float32 [N, K / block]; y [M, N] float32.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

F32 = np.float32


@intrinsic
def widen(typingctx, value):
    """A stored K/V element as float32: uint16 holds f16 bits (`fpext half`: vcvtph2ps where the CPU has
    it), int8 and float32 convert as numbers. numba has no float16 type on the CPU."""
    if value == types.uint16:

        def codegen(context, builder, sig, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    elif value == types.float32:

        def codegen(context, builder, sig, args):
            return args[0]

    elif value in (types.int8, types.int16, types.int32):

        def codegen(context, builder, sig, args):
            return builder.sitofp(args[0], ir.FloatType())

    else:
        return None
    return types.float32(value), codegen


# ---- products with packed weights -------------------------------------------------------------------
# The block loops take their length from the arrays, not a constant: LLVM fully unrolls a constant
# 32-step loop and then vectorizes the loop over blocks with gathers, 10x slower (bench/CPU-NOTES.md).


@njit(parallel=True, fastmath=True, cache=True)
def matmul_packed(x, xsum, values, scale, mins, has_min, y):
    """y = x W^T: per block, scale * sum(q x) (+ min * sum(x), xsum [M, K / block], with has_min)."""
    n_tok = x.shape[0]
    n_blocks = scale.shape[1]
    block = values.shape[1] // n_blocks
    for n in prange(values.shape[0]):
        row = values[n]
        sc = scale[n]
        for m in range(n_tok):
            xr = x[m]
            acc = F32(0)
            for b in range(n_blocks):
                o = b * block
                s = F32(0)
                for j in range(block):
                    s += F32(row[o + j]) * xr[o + j]
                acc += s * sc[b]
                if has_min:
                    acc += mins[n, b] * xsum[m, b]
            y[m, n] = acc


@njit(parallel=True, fastmath=True, cache=True)
def dequantize_packed(values, scale, mins, has_min, out):
    """out [N, K] float32 = q * scale + min."""
    n_blocks = scale.shape[1]
    block = values.shape[1] // n_blocks
    for n in prange(values.shape[0]):
        row = values[n]
        o_row = out[n]
        for b in range(n_blocks):
            d = scale[n, b]
            mn = mins[n, b] if has_min else F32(0)
            o = b * block
            for j in range(block):
                o_row[o + j] = F32(row[o + j]) * d + mn


# ---- attention over the K/V pool's storage -------------------------------------------------------------
ATTN_TILE = 32  # keys converted to float32 at a time (two [32, D] tiles stay in L1)


@njit(inline="always")
def _load_tile(src, scales, has_scales, slot, head, dst):
    """One stored K or V row [D] (f32, f16 bits or int8 with scales [D / block]) -> float32 `dst`."""
    row = src[slot, head]
    d = row.shape[0]
    if has_scales:
        srow = scales[slot, head]
        block = d // srow.shape[0]
        for b in range(srow.shape[0]):
            s = srow[b]
            for j in range(block):
                dst[b * block + j] = widen(row[b * block + j]) * s
    else:
        for j in range(d):
            dst[j] = widen(row[j])


@njit(parallel=True, fastmath=True, cache=True)
def attention_partials(
    q, k, v, k_scale, v_scale, has_scales, q_pos0, k_lo, base, capacity, window, n_split, acc, m_out, l_out
):
    """Causal (sliding-window) GQA attention of queries q [T, H, D] (already times the softmax scale) over
    the keys at positions [k_lo, q_pos0 + T), read from storage k, v [slots, Hkv, D]: position p sits in
    slot p % capacity (a ring, capacity > 0) or p - base. A query at position p sees keys j <= p with
    p - j < window (window 0: no window). Work item (kv head, split) covers one of n_split equal key
    ranges and leaves, per row r = g * T + t (query head kv_head * G + g, token t), the running max
    m_out, the sum l_out of exp(s - m) and acc = sum exp(s - m) v, merged by `attention_merge`."""
    n_tok, n_head, d = q.shape
    n_kv = k.shape[1]
    group = n_head // n_kv
    rows = group * n_tok
    k_hi = q_pos0 + n_tok
    span = k_hi - k_lo
    per_split = (span + n_split - 1) // n_split
    neg_inf = -np.inf
    for item in prange(n_kv * n_split):
        hk = item // n_split
        sp = item % n_split
        s_lo = k_lo + sp * per_split
        s_hi = min(k_hi, s_lo + per_split)
        a = acc[hk, sp]
        m = m_out[hk, sp]
        l_sum = l_out[hk, sp]
        a[:] = 0
        m[:] = neg_inf
        l_sum[:] = 0
        kt = np.empty((ATTN_TILE, d), dtype=F32)
        vt = np.empty((ATTN_TILE, d), dtype=F32)
        p_tile = np.empty((rows, ATTN_TILE), dtype=F32)
        for p0 in range(s_lo, s_hi, ATTN_TILE):
            nt = min(ATTN_TILE, s_hi - p0)
            for i in range(nt):
                p = p0 + i
                slot = p % capacity if capacity > 0 else p - base
                _load_tile(k, k_scale, has_scales, slot, hk, kt[i])
                _load_tile(v, v_scale, has_scales, slot, hk, vt[i])
            for r in range(rows):
                g = r // n_tok
                t = r % n_tok
                qp = q_pos0 + t
                qr = q[t, hk * group + g]
                pr = p_tile[r]
                tile_max = neg_inf
                for i in range(nt):
                    p = p0 + i
                    if p > qp or (window > 0 and qp - p >= window):
                        pr[i] = neg_inf
                        continue
                    s = F32(0)
                    kr = kt[i]
                    for j in range(d):
                        s += qr[j] * kr[j]
                    pr[i] = s
                    tile_max = max(tile_max, s)
                if tile_max == neg_inf:
                    continue  # no key of this tile is visible to this row
                m_new = max(m[r], tile_max)
                if m[r] != neg_inf and m_new != m[r]:
                    corr = np.exp(m[r] - m_new)
                    l_sum[r] *= corr
                    ar = a[r]
                    for j in range(d):
                        ar[j] *= corr
                m[r] = m_new
                ar = a[r]
                for i in range(nt):
                    if pr[i] == neg_inf:
                        continue
                    e = np.exp(pr[i] - m_new)
                    l_sum[r] += e
                    vr = vt[i]
                    for j in range(d):
                        ar[j] += e * vr[j]


@njit(fastmath=True, cache=True)
def attention_merge(acc, m_in, l_in, n_tok, out):
    """out [T, H * D] from the splits' partials: sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M)."""
    n_kv, n_split, rows, d = acc.shape
    group = rows // n_tok
    for hk in range(n_kv):
        for r in range(rows):
            g = r // n_tok
            t = r % n_tok
            top = -np.inf
            for sp in range(n_split):
                top = max(top, m_in[hk, sp, r])
            o = out[t, (hk * group + g) * d : (hk * group + g + 1) * d]
            o[:] = 0
            total = F32(0)
            for sp in range(n_split):
                if m_in[hk, sp, r] == -np.inf:
                    continue
                w = np.exp(m_in[hk, sp, r] - top)
                total += w * l_in[hk, sp, r]
                a = acc[hk, sp, r]
                for j in range(d):
                    o[j] += w * a[j]
            for j in range(d):
                o[j] /= total
