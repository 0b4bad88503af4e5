"""Packed weight products with activations quantized to int8 (`q8.py`: llama.cpp's Q8_1 math) and AVX512-VNNI
integer dot products (`vpdpbusd`: 64 u8 x s8 products summed by fours into 16 int32 lanes, one instruction).

The weight's bytes are read as they are packed (`packed.py`), a *unit* of 16 bytes at a time (a 4-bit block
of 32 values, or 16 int8 values): a main group of 16 units is four 64-byte loads transposed (8 in-lane
shuffles, once per weight row and group, shared by the token rows) so that int32 lane l of every vector
belongs to one unit; each token row then sums its 4 (int8) or 8 (4-bit) `vpdpbusd`s into one integer
vector whose lane l is unit l's whole dot product, and scales it with vectors: acc += float(I) * (d * dx)
(+ m * dx * sum(qx): the min term, for 16 blocks at once). int8 weights (signed) are read as q + 128
(unsigned: an xor), the integer vector starting at -128 * sum(qx) per unit. Units past the last main group
go in tail groups of 4 (one load, 4 lanes a unit). The activation's kernel layout (`q8.layout`) matches.

Shapes: xq int32 [M, dwords of the layout] (4 int8 each); dxu, xsum float32 [M, lanes] (a lane's dx and dx * sum of its qx),
xneg int32 [M, lanes] (-128 * sum of its qx); values, scale, mins as packed; y float32 [M, N].
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .numba_kernels import _F32, _I32, _I64, _counted_loop, _hsum, _indices, _load_vector, _row_ptr
from .packed import PackedWeight
from .q8 import GROUP_UNITS, LANES, QX, TAIL_UNITS, UNIT_BYTES, layout

_I8 = ir.IntType(8)
_V16I = ir.VectorType(_I32, LANES)
_V16F = ir.VectorType(_F32, LANES)
F32 = np.float32
Q8_ROWS = 8  # token rows whose accumulators a loop keeps in registers (the weight's group decoded once for them)
# Weight rows a group of token rows meets before the next group (their activations stay in L1): more than
# Q8_ROWS token rows read each row's activations once a tile instead of once a weight row.
Q8_TILE = 16
# Token rows from which the parallel product quantizes them over all threads too (a prefill chunk: ~0.5 us a
# 576-value row, 5-10% of a SmolLM2 chunk on one thread).
Q8_PARALLEL_ROWS = 16


def target_has_vnni() -> bool:
    """Whether numba compiles for AVX512-VNNI (and AVX512BW): the host's features, or NUMBA_CPU_FEATURES."""
    from llvmlite import binding

    if numba.config.CPU_FEATURES is not None:
        feats = numba.config.CPU_FEATURES.split(",")
        return "+avx512vnni" in feats and "+avx512bw" in feats
    host = binding.get_host_cpu_features()
    return bool(host.get("avx512vnni", False) and host.get("avx512bw", False))


HAS_VNNI = target_has_vnni()


def _sigma(lane: int) -> int:
    """The unit (in a main group) of int32 lane `lane` after the transpose: lane 4i + k holds unit 4k + i."""
    return 4 * (lane % 4) + lane // 4


def _transpose(builder, r):
    """Four <16 x i32> (unit 4k + i in 128-bit lane i of r[k]) -> four whose lane 4i + k is dword j of that
    unit: a 4x4 dword transpose in every 128-bit lane (unpack lo/hi 32, then 64)."""
    def lanes(pattern):
        return _indices([p + 4 * i for i in range(4) for p in pattern])

    lo32, hi32 = lanes([0, 16, 1, 17]), lanes([2, 18, 3, 19])
    lo64, hi64 = lanes([0, 1, 16, 17]), lanes([2, 3, 18, 19])
    t0, t1 = builder.shuffle_vector(r[0], r[1], lo32), builder.shuffle_vector(r[0], r[1], hi32)
    t2, t3 = builder.shuffle_vector(r[2], r[3], lo32), builder.shuffle_vector(r[2], r[3], hi32)
    return [builder.shuffle_vector(a, b, m) for a, b in ((t0, t2), (t1, t3)) for m in (lo64, hi64)]


def _weight_vectors(builder, raw, nibbles):
    """The unsigned bytes vpdpbusd multiplies: 4-bit: the low nibbles of each vector, then the high ones;
    int8: q + 128 (q xor 0x80)."""
    if nibbles:
        low = ir.Constant(_V16I, [0x0F0F0F0F] * LANES)
        four = ir.Constant(_V16I, [4] * LANES)
        return [builder.and_(v, low) for v in raw] + [builder.and_(builder.lshr(v, four), low) for v in raw]
    return [builder.xor(v, ir.Constant(_V16I, [0x80808080 - (1 << 32)] * LANES)) for v in raw]


def _scales(builder, row, first, count, half, lane_of):
    """Scales [first, first + count) of a scale row as float32, spread to 16 lanes (lane l gets scale
    lane_of(l))."""
    elem = ir.IntType(16) if half else _F32
    v = _load_vector(builder, row, first, elem, count)
    if half:
        v = builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), count)), ir.VectorType(_F32, count))
    return builder.shuffle_vector(v, v, _indices([lane_of(lane) for lane in range(LANES)]))


def _group_scales(builder, row, g, half, two_units):
    """Main group g's scales spread to its lanes: 16 (a block a unit) or 8 (a block two units)."""
    with builder.if_else(two_units) as (pairs, singles):
        with pairs:
            first = builder.mul(g, ir.Constant(_I64, GROUP_UNITS // 2))
            by_pairs = _scales(builder, row, first, GROUP_UNITS // 2, half, lambda lane: _sigma(lane) // 2)
            pairs_block = builder.block
        with singles:
            first = builder.mul(g, ir.Constant(_I64, GROUP_UNITS))
            by_units = _scales(builder, row, first, GROUP_UNITS, half, _sigma)
            singles_block = builder.block
    out = builder.phi(_V16F)
    out.add_incoming(by_pairs, pairs_block)
    out.add_incoming(by_units, singles_block)
    return out


@intrinsic
def q8_dot(typingctx, values, scale, mins, n, xq, dxu, xsum, xneg, y, r0, rows, upb):
    """y[r0 + r, n] = packed weight row n . token row r0 + r (r < rows <= Q8_ROWS), the token rows quantized
    in the kernel layout (xq, dxu, xsum, xneg); upb the units a weight block spans: 1 (4-bit, or int8
    16-value blocks), 2 (int8 32-value blocks); mins [N, K / block], or 1-D (a placeholder: no min). Each
    layout compiles only its own code (a variant per min and block size quadrupled the compile time)."""
    with_min = mins.ndim == 2
    nibbles = values.dtype == types.uint8
    half = scale.dtype == types.uint16
    sig = types.void(values, scale, mins, n, xq, dxu, xsum, xneg, y, r0, rows, upb)

    def codegen(context, builder, signature, args):
        q_arr, s_arr, m_arr, xq_arr, dxu_arr, xs_arr, xn_arr, y_arr = (
            context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 1, 2, 4, 5, 6, 7, 8)
        )
        n_val, r0_val, rows_val, upb_val = (
            context.cast(builder, args[i], signature.args[i], types.int64) for i in (3, 9, 10, 11)
        )
        two_units = builder.icmp_signed("==", upb_val, ir.Constant(_I64, 2))  # a weight block spans two units
        dp = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_V16I, [_V16I] * 3), "llvm.x86.avx512.vpdpbusd.512"
        )
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fma.v16f32")
        scale_elem = ir.IntType(16) if half else _F32
        q_row = _row_ptr(builder, q_arr, n_val, _I8)
        s_row = _row_ptr(builder, s_arr, n_val, scale_elem)
        m_row = _row_ptr(builder, m_arr, n_val, scale_elem) if with_min else None
        n_units = builder.udiv(builder.extract_value(q_arr.shape, 1), ir.Constant(_I64, UNIT_BYTES))
        n_main = builder.udiv(n_units, ir.Constant(_I64, GROUP_UNITS))
        main_units = builder.mul(n_main, ir.Constant(_I64, GROUP_UNITS))
        n_tail = builder.udiv(
            builder.add(builder.sub(n_units, main_units), ir.Constant(_I64, TAIL_UNITS - 1)),
            ir.Constant(_I64, TAIL_UNITS),
        )
        main_vecs = (8 if nibbles else 4) * 64  # bytes of a main group's activation (a token row)
        tail_vecs = (2 if nibbles else 1) * 64
        last_unit = builder.sub(n_units, ir.Constant(_I64, 1))

        def rows_loop(n_rows):
            x_rows = [builder.add(r0_val, ir.Constant(_I64, r)) for r in range(n_rows)]
            xq_rows = [_row_ptr(builder, xq_arr, i, _I8) for i in x_rows]
            dxu_rows = [_row_ptr(builder, dxu_arr, i, _F32) for i in x_rows]
            xs_rows = [_row_ptr(builder, xs_arr, i, _F32) for i in x_rows] if with_min else []
            xn_rows = [_row_ptr(builder, xn_arr, i, _I32) for i in x_rows] if not nibbles else []
            chains = 2 if n_rows <= 2 else 1  # independent vpdpbusd chains a row (latency-bound when few rows)

            def rows_step(wv, dw, mw, x_off, lane_off, accs):
                """The token rows' products with one group (its weight vectors wv, lane scales dw, mw)."""
                out = []
                for r in range(n_rows):
                    zero = ir.Constant(_V16I, [0] * LANES)
                    sums = [_load_vector(builder, xn_rows[r], lane_off, _I32, LANES) if not nibbles else zero]
                    sums += [zero] * (chains - 1)
                    for v, w in enumerate(wv):
                        off = builder.add(x_off, ir.Constant(_I64, 64 * v))
                        xv = builder.bitcast(_load_vector(builder, xq_rows[r], off, _I8, 64), _V16I)
                        sums[v % chains] = builder.call(dp, [sums[v % chains], w, xv])
                    total = sums[0] if chains == 1 else builder.add(sums[0], sums[1])
                    p = builder.fmul(dw, _load_vector(builder, dxu_rows[r], lane_off, _F32, LANES))
                    acc = builder.call(fma, [builder.sitofp(total, _V16F), p, accs[r]])
                    if with_min:
                        acc = builder.call(fma, [mw, _load_vector(builder, xs_rows[r], lane_off, _F32, LANES), acc])
                    out.append(acc)
                return out

            def main_group(g, accs):
                base = builder.mul(g, ir.Constant(_I64, GROUP_UNITS * UNIT_BYTES))
                raw = [
                    builder.bitcast(
                        _load_vector(builder, q_row, builder.add(base, ir.Constant(_I64, 64 * k)), _I8, 64), _V16I
                    )
                    for k in range(4)
                ]
                wv = _weight_vectors(builder, _transpose(builder, raw), nibbles)
                dw = _group_scales(builder, s_row, g, half, two_units)
                mw = _group_scales(builder, m_row, g, half, two_units) if with_min else None
                x_off = builder.mul(g, ir.Constant(_I64, main_vecs))
                lane_off = builder.mul(g, ir.Constant(_I64, LANES))
                return rows_step(wv, dw, mw, x_off, lane_off, accs)

            def tail_group(t, accs):
                u0 = builder.add(main_units, builder.mul(t, ir.Constant(_I64, TAIL_UNITS)))
                units = []  # clamped to the row: a unit past it multiplies zero activations
                for i in range(TAIL_UNITS):
                    u = builder.add(u0, ir.Constant(_I64, i))
                    units.append(builder.select(builder.icmp_signed("<", u, last_unit), u, last_unit))
                parts = [
                    _load_vector(builder, q_row, builder.mul(u, ir.Constant(_I64, UNIT_BYTES)), _I32, 4)
                    for u in units
                ]
                halves = [builder.shuffle_vector(parts[i], parts[i + 1], _indices(list(range(8)))) for i in (0, 2)]
                raw = builder.shuffle_vector(halves[0], halves[1], _indices(list(range(16))))
                wv = _weight_vectors(builder, [raw], nibbles)

                def lane_scales(row):
                    vals = []
                    for u in units:
                        b = builder.lshr(u, builder.zext(two_units, _I64))
                        value = builder.load(builder.gep(row, [b]))
                        if half:
                            value = builder.fpext(builder.bitcast(value, ir.HalfType()), _F32)
                        vals.append(value)
                    vec = ir.Constant(ir.VectorType(_F32, 4), ir.Undefined)
                    for i, value in enumerate(vals):
                        vec = builder.insert_element(vec, value, ir.Constant(_I32, i))
                    return builder.shuffle_vector(vec, vec, _indices([lane // 4 for lane in range(LANES)]))

                dw = lane_scales(s_row)
                mw = lane_scales(m_row) if with_min else None
                x_off = builder.add(builder.mul(n_main, ir.Constant(_I64, main_vecs)), builder.mul(t, ir.Constant(_I64, tail_vecs)))
                lane_off = builder.mul(builder.add(n_main, t), ir.Constant(_I64, LANES))
                return rows_step(wv, dw, mw, x_off, lane_off, accs)

            zero = ir.Constant(_V16F, [0.0] * LANES)
            accs = _counted_loop(builder, n_main, main_group, [zero] * n_rows)
            accs = _counted_loop(builder, n_tail, tail_group, accs)
            for r in range(n_rows):
                y_row = _row_ptr(builder, y_arr, x_rows[r], _F32)
                builder.store(_hsum(builder, accs[r]), builder.gep(y_row, [n_val]))

        done = builder.append_basic_block("q8_done")
        # one loop per token-row count (its accumulators in registers); another count writes nothing
        switch = builder.switch(rows_val, done)
        for n_rows in range(1, Q8_ROWS + 1):
            case = builder.append_basic_block(f"q8_rows_{n_rows}")
            switch.add_case(ir.Constant(_I64, n_rows), case)
            builder.position_at_end(case)
            rows_loop(n_rows)
            builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    return sig, codegen


# Quantization rounds as written (the oracle's float32 operations): no contraction into fmas, no reciprocal.
QUANT_FAST = {"nnan", "ninf", "nsz", "reassoc"}


@njit(fastmath=QUANT_FAST, cache=True, inline="always")
def _quantize_row(x, r, perm, lane_of, lane_block, q, seg, d, sums, xq, dxu, xsum, xneg):
    """Token row r into the q8 outputs (`quantize_q8`); q int8 [K + 4], seg int32 [K / 4 + 1] (zero at the
    end: the padding's source), d float32 [K / 32] and sums int32 [lanes] are scratch."""
    k = x.shape[1]
    q32 = q.view(np.int32)
    for b in range(k // 32):
        amax = np.float32(0)
        for j in range(32):
            amax = max(amax, abs(x[r, b * 32 + j]))
        dx = amax / np.float32(127)
        inv = np.float32(1) / dx if dx > 0 else np.float32(0)
        d[b] = dx
        for j in range(32):
            v = x[r, b * 32 + j] * inv
            q[b * 32 + j] = np.int8(np.int32(v + (np.float32(0.5) if v >= 0 else np.float32(-0.5))))
    for i in range(k // 4):
        seg[i] = np.int32(q[4 * i]) + np.int32(q[4 * i + 1]) + np.int32(q[4 * i + 2]) + np.int32(q[4 * i + 3])
    sums[:] = 0
    for p in range(perm.shape[0]):
        xq[r, p] = q32[perm[p]]
        sums[lane_of[p]] += seg[perm[p]]
    for lane in range(lane_block.shape[0]):
        dl = d[lane_block[lane]] if lane_block[lane] >= 0 else np.float32(0)
        dxu[r, lane] = dl
        xsum[r, lane] = dl * np.float32(sums[lane])
        xneg[r, lane] = -128 * sums[lane]


@njit(fastmath=QUANT_FAST, cache=True, inline="always")
def _q8_outputs(x, perm, lane_block):
    m, n_lanes = x.shape[0], lane_block.shape[0]
    xq = np.empty((m, perm.shape[0]), dtype=np.int32)
    dxu = np.empty((m, n_lanes), dtype=np.float32)
    xsum = np.empty((m, n_lanes), dtype=np.float32)
    xneg = np.empty((m, n_lanes), dtype=np.int32)
    return xq, dxu, xsum, xneg


@njit(fastmath=QUANT_FAST, cache=True)
def quantize_q8(x, perm, lane_of, lane_block):
    """x [M, K] float32 -> its q8 form in the kernel layout (`q8.layout`'s tables): per 32-value block
    dx = max|x| / 127 and qx as `q8.quantize_rows`, moved a dword at a time -> (xq int32 [M, dwords] (4
    int8 each), and per lane dxu (its dx), xsum (dx * the sum of its qx), xneg (-128 * that sum))."""
    k = x.shape[1]
    xq, dxu, xsum, xneg = _q8_outputs(x, perm, lane_block)
    q, seg = np.zeros(k + 4, dtype=np.int8), np.zeros(k // 4 + 1, dtype=np.int32)
    d, sums = np.empty(k // 32, dtype=np.float32), np.empty(lane_block.shape[0], dtype=np.int32)
    for r in range(x.shape[0]):
        _quantize_row(x, r, perm, lane_of, lane_block, q, seg, d, sums, xq, dxu, xsum, xneg)
    return xq, dxu, xsum, xneg


@njit(parallel=True, fastmath=QUANT_FAST, cache=True)
def quantize_q8_parallel(x, perm, lane_of, lane_block):
    """`quantize_q8`, token rows over all threads (a prefill chunk's)."""
    k = x.shape[1]
    xq, dxu, xsum, xneg = _q8_outputs(x, perm, lane_block)
    for r in prange(x.shape[0]):
        q, seg = np.zeros(k + 4, dtype=np.int8), np.zeros(k // 4 + 1, dtype=np.int32)
        d, sums = np.empty(k // 32, dtype=np.float32), np.empty(lane_block.shape[0], dtype=np.int32)
        _quantize_row(x, r, perm, lane_of, lane_block, q, seg, d, sums, xq, dxu, xsum, xneg)
    return xq, dxu, xsum, xneg


@njit(fastmath=True, cache=True, inline="always")
def _q8_tile(values, scale, mins, upb, xq, dxu, xsum, xneg, y, t):
    """Weight rows [t * Q8_TILE, + Q8_TILE) of y for every token row, Q8_ROWS at a time: a group of token
    rows meets the tile's weight rows while its activations are in L1."""
    n0 = t * Q8_TILE
    n1 = min(n0 + Q8_TILE, values.shape[0])
    r = 0
    while r < xq.shape[0]:
        rows = min(Q8_ROWS, xq.shape[0] - r)
        for n in range(n0, n1):
            q8_dot(values, scale, mins, n, xq, dxu, xsum, xneg, y, r, rows, upb)
        r += rows


@njit(parallel=True, fastmath=True, cache=True)
def matmul_q8(x, perm, lane_of, lane_block, values, scale, mins, upb, y):
    """y = x W^T, x quantized (`quantize_q8`; from Q8_PARALLEL_ROWS rows over all threads) then tiles of weight
    rows over all threads."""
    if x.shape[0] >= Q8_PARALLEL_ROWS:
        xq, dxu, xsum, xneg = quantize_q8_parallel(x, perm, lane_of, lane_block)
    else:
        xq, dxu, xsum, xneg = quantize_q8(x, perm, lane_of, lane_block)
    for t in prange((values.shape[0] + Q8_TILE - 1) // Q8_TILE):
        _q8_tile(values, scale, mins, upb, xq, dxu, xsum, xneg, y, t)


@njit(fastmath=True, cache=True)
def matmul_q8_serial(x, perm, lane_of, lane_block, values, scale, mins, upb, y):
    """`matmul_q8` on the calling thread."""
    xq, dxu, xsum, xneg = quantize_q8(x, perm, lane_of, lane_block)
    for t in range((values.shape[0] + Q8_TILE - 1) // Q8_TILE):
        _q8_tile(values, scale, mins, upb, xq, dxu, xsum, xneg, y, t)


def takes(w: PackedWeight) -> bool:
    """Whether the q8 kernels multiply this packing: 4-bit 32-value blocks, int8 16- or 32-value blocks,
    rows of whole activation blocks."""
    block_ok = w.block == 2 * UNIT_BYTES if w.four_bit else w.block in (UNIT_BYTES, 2 * UNIT_BYTES)
    return block_ok and w.shape[1] % QX == 0


def product(x: np.ndarray, w: PackedWeight, parallel: bool) -> np.ndarray:
    """x [M, K] float32 (C order) quantized in the kernel layout, times the packed weight -> [M, N] float32,
    weight rows over all threads (parallel) or on this one."""
    lay = layout(x.shape[1], w.four_bit)
    y = np.empty((x.shape[0], w.shape[0]), dtype=F32)
    mins = w.min if w.min is not None else np.zeros(1, dtype=w.scale.dtype)  # 1-D: no min
    upb = w.block // (2 * UNIT_BYTES if w.four_bit else UNIT_BYTES)
    kernel = matmul_q8 if parallel else matmul_q8_serial
    kernel(x, lay.perm, lay.lane_of, lay.lane_block, w.values, w.scale, mins, upb, y)
    return y
