"""Packed weight products with activations quantized to int8 (`q8.py`: llama.cpp's Q8_1 math) and AVX512-VNNI
integer dot products (`vpdpbusd`: 64 u8 x s8 products summed by fours into 16 int32 lanes, one instruction).

The weight is tiled (`packed.PackedWeight.tile`, made once at load): in a tile of 16 rows a 64-byte vector holds
the same dword (4 values, or 8 nibbles) of every row, so int32 lane l belongs to weight row l all the way
through and no lanes are ever summed together (bench/engine/DECISIONS.md "The q8 products": x1.3-2.8 over transposing
each group of a row's blocks into lanes and summing them at the row's end). Per weight block, the block's
vectors (int8: 4 or 8; 4-bit: 4 loads, their low nibbles then their high ones) are loaded once for up to
Q8_ROWS token rows; each token row multiplies them by its own activation dwords broadcast to every lane
(`vpdpbusd`'s 4 u8 x s8 products a lane), then scales the block's integer sums with vectors:
acc += float(I) * (d * dx) (+ m * dx * sum(qx): the min term). int8 weights (signed) are read as q + 128
(unsigned: an xor), the integer sum starting at -128 * sum(qx) of the block. A tile's 16 outputs of a token
row are one vector store.

Shapes: xq int32 [M, K / 4] (the quantized row, 4 int8 a dword, in order); per token row and weight block dxw
float32 (the block's dx), xneg int32 (-128 * the block's sum of qx), xsum float32 (dx * that sum), [M, K / block];
values, scale, mins tiled; y float32 [M, N].
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .numba_kernels import (
    _F32,
    _I32,
    _I64,
    PREFETCH_LOCALITY,
    _counted_loop,
    _indices,
    _load_vector,
    _row_ptr,
    _splat,
)
from .packed import TILE_ROWS, PackedWeight
from .q8 import QX

_I8 = ir.IntType(8)
LANES = TILE_ROWS  # int32 / float32 lanes of a vector (AVX-512): one a weight row of a tile
_V16I = ir.VectorType(_I32, LANES)
_V16F = ir.VectorType(_F32, LANES)
F32 = np.float32
_ZERO, _LOCALITY, _ONE = (ir.Constant(_I32, v) for v in (0, PREFETCH_LOCALITY, 1))
# A tile's first pass (its first token rows) prefetches its bytes this far ahead, into L2, so the next tile's
# arrive while this one is multiplied: 8 rows x1.04-1.24, one row x1.04-1.08 SmolLM2 / x0.96-1.06 gemma3 (into L1
# it had cost one row 5 %; bench/engine/DECISIONS.md "Products' prefetch into L2").
Q8_PREFETCH_BYTES = 4096
Q8_ROWS = 8  # token rows whose accumulators a loop keeps in registers (a block's weight vectors loaded once for them)
# Token rows from which the parallel product quantizes them over all threads too (a prefill chunk: ~0.3 us a
# 576-value row on one thread, `quantize_blocks`).
Q8_PARALLEL_ROWS = 16


def target_has_vnni() -> bool:
    """Whether numba compiles for AVX512-VNNI (and AVX512BW): the host's features, or NUMBA_CPU_FEATURES."""
    from llvmlite import binding

    features = numba.config.CPU_FEATURES  # type: ignore[attr-defined]  # numba.config's options are set at run time
    if features is not None:
        feats = features.split(",")
        return "+avx512vnni" in feats and "+avx512bw" in feats
    host = binding.get_host_cpu_features()
    return bool(host.get("avx512vnni", False) and host.get("avx512bw", False))


HAS_VNNI = target_has_vnni()


def _weight_vectors(builder, raw, nibbles):
    """The unsigned bytes vpdpbusd multiplies: 4-bit: the low nibbles of each vector, then the high ones;
    int8: q + 128 (q xor 0x80)."""
    if nibbles:
        low = ir.Constant(_V16I, [0x0F0F0F0F] * LANES)
        four = ir.Constant(_V16I, [4] * LANES)
        return [builder.and_(v, low) for v in raw] + [builder.and_(builder.lshr(v, four), low) for v in raw]
    return [builder.xor(v, ir.Constant(_V16I, [0x80808080 - (1 << 32)] * LANES)) for v in raw]


def _lanes_f32(builder, row, first, half):
    """16 consecutive scales (a tile's 16 rows' of one block) as float32."""
    v = _load_vector(builder, row, first, ir.IntType(16) if half else _F32, LANES)
    return builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), LANES)), _V16F) if half else v


@intrinsic
def q8_tile(typingctx, values, scale, mins, high, t, xq, dxw, xneg, xsum, y, r0, rows):
    """y[r0 + r, 16 t : 16 t + 16] = weight tile t's rows . token row r0 + r (r < rows <= Q8_ROWS), the token
    rows quantized (xq, dxw, xneg, xsum); mins tiled [N, K / block], or 1-D (a placeholder: no min); high the
    high bits of a 5-bit weight (`packed.PackedWeight.as_five_bit`), or 1-D (a placeholder). Each layout
    compiles only its own code; int8 weights branch at run time on their block (16 or 32 values: 4 or 8
    vectors a block)."""
    with_min = mins.ndim == 2
    five = high.ndim == 2
    nibbles = values.dtype == types.uint8
    half = scale.dtype == types.uint16
    sig = types.void(values, scale, mins, high, t, xq, dxw, xneg, xsum, y, r0, rows)

    def codegen(context, builder, signature, args):
        q_arr, s_arr, m_arr, h_arr, xq_arr, dx_arr, xn_arr, xs_arr, y_arr = (
            context.make_array(signature.args[i])(context, builder, args[i])
            for i in (0, 1, 2, 3, 5, 6, 7, 8, 9)
        )
        t_val, r0_val, rows_val = (
            context.cast(builder, args[i], signature.args[i], types.int64) for i in (4, 10, 11)
        )
        dp = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_V16I, [_V16I] * 3), "llvm.x86.avx512.vpdpbusd.512"
        )
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fma.v16f32"
        )
        row0 = builder.mul(t_val, ir.Constant(_I64, TILE_ROWS))
        q_tile = _row_ptr(builder, q_arr, row0, _I8)
        scale_elem = ir.IntType(16) if half else _F32
        s_tile = _row_ptr(builder, s_arr, row0, scale_elem)
        m_tile = _row_ptr(builder, m_arr, row0, scale_elem) if with_min else None
        h_tile = _row_ptr(builder, h_arr, row0, _I32) if five else None
        n_blocks = builder.extract_value(s_arr.shape, 1)
        block_bytes = builder.udiv(
            builder.extract_value(q_arr.shape, 1), n_blocks
        )  # of a row: 16 (4-bit), 16 or 32
        first_pass = builder.icmp_signed("==", r0_val, ir.Constant(_I64, 0))
        prefetch = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]),
            "llvm.prefetch",
        )

        def rows_loop(n_rows, loads):
            x_rows = [builder.add(r0_val, ir.Constant(_I64, r)) for r in range(n_rows)]
            xq_rows = [_row_ptr(builder, xq_arr, i, _I32) for i in x_rows]
            dx_rows = [_row_ptr(builder, dx_arr, i, _F32) for i in x_rows]
            signed = five or not nibbles  # the integer sum starts at the weight's offset times sum(qx)
            xn_rows = [_row_ptr(builder, xn_arr, i, _I32) for i in x_rows] if signed else []
            xs_rows = [_row_ptr(builder, xs_arr, i, _F32) for i in x_rows] if with_min else []

            def block(b, accs):
                base = builder.mul(b, ir.Constant(_I64, 64 * loads))
                # the first token rows' pass streams the tile from memory: ask ahead
                ahead = builder.select(first_pass, ir.Constant(_I64, Q8_PREFETCH_BYTES), ir.Constant(_I64, 0))
                for k in range(loads):
                    at = builder.add(builder.add(base, ahead), ir.Constant(_I64, 64 * k))
                    builder.call(prefetch, [builder.gep(q_tile, [at]), _ZERO, _LOCALITY, _ONE])
                raw = [
                    builder.bitcast(_load_vector(builder, q_tile, builder.add(base, ir.Constant(_I64, 64 * k)), _I8, 64), _V16I)
                    for k in range(loads)
                ]  # fmt: skip
                wv = _weight_vectors(builder, raw, nibbles)
                lane0 = builder.mul(b, ir.Constant(_I64, LANES))
                if five:  # u = q + 16: dword j's 4 high bits (bits 8m + j of the word) shifted to bit 4 of its bytes
                    hv = _load_vector(builder, h_tile, lane0, _I32, LANES)
                    bit4 = ir.Constant(_V16I, [0x10101010] * LANES)

                    def shifted(j):
                        by = ir.Constant(_V16I, [abs(4 - j)] * LANES)
                        return hv if j == 4 else builder.shl(hv, by) if j < 4 else builder.lshr(hv, by)

                    wv = [builder.or_(w, builder.and_(shifted(j), bit4)) for j, w in enumerate(wv)]
                dw = _lanes_f32(builder, s_tile, lane0, half)
                mw = _lanes_f32(builder, m_tile, lane0, half) if with_min else None
                x0 = builder.mul(b, ir.Constant(_I64, len(wv)))  # the block's first activation dword
                out = []
                for r in range(n_rows):
                    if not signed:
                        total = ir.Constant(_V16I, [0] * LANES)
                    else:  # -128 sum(qx) (int8 read as q + 128), or -16 sum(qx) (5 bits: q + 16), exactly
                        neg = builder.load(builder.gep(xn_rows[r], [b]))
                        total = _splat(
                            builder, builder.ashr(neg, ir.Constant(_I32, 3)) if five else neg, LANES
                        )
                    for j, w in enumerate(wv):
                        xv = builder.load(builder.gep(xq_rows[r], [builder.add(x0, ir.Constant(_I64, j))]))
                        total = builder.call(dp, [total, w, _splat(builder, xv, LANES)])
                    p = builder.fmul(dw, _splat(builder, builder.load(builder.gep(dx_rows[r], [b])), LANES))
                    acc = builder.call(fma, [builder.sitofp(total, _V16F), p, accs[r]])
                    if with_min:
                        acc = builder.call(
                            fma, [mw, _splat(builder, builder.load(builder.gep(xs_rows[r], [b])), LANES), acc]
                        )
                    out.append(acc)
                return out

            zero = ir.Constant(_V16F, [0.0] * LANES)
            accs = _counted_loop(builder, n_blocks, block, [zero] * n_rows)
            for r in range(n_rows):
                y_row = _row_ptr(builder, y_arr, x_rows[r], _F32)
                builder.store(
                    accs[r], builder.bitcast(builder.gep(y_row, [row0]), _V16F.as_pointer()), align=4
                )

        done = builder.append_basic_block("q8_done")
        # one loop per token-row count (its accumulators in registers); another count writes nothing
        switch = builder.switch(rows_val, done)
        for n_rows in range(1, Q8_ROWS + 1):
            case = builder.append_basic_block(f"q8_rows_{n_rows}")
            switch.add_case(ir.Constant(_I64, n_rows), case)
            builder.position_at_end(case)
            if nibbles:
                rows_loop(n_rows, 4)
            else:
                wide = builder.icmp_signed("==", block_bytes, ir.Constant(_I64, 32))
                with builder.if_else(wide) as (blocks_32, blocks_16):
                    with blocks_32:
                        rows_loop(n_rows, 8)
                    with blocks_16:
                        rows_loop(n_rows, 4)
            builder.branch(done)
        builder.position_at_end(done)
        return context.get_dummy_value()

    return sig, codegen


# Quantization rounds as written (the oracle's float32 operations): no contraction into fmas, no reciprocal.
QUANT_FAST = {"nnan", "ninf", "nsz", "reassoc"}


_HALF_BLOCK = QX // 2  # values of one vector (AVX-512 float32 lanes) of an activation block


@intrinsic
def quantize_blocks(typingctx, x, r, xq, dx, sums):
    """Row r of x [M, K] (float32, C order) quantized block by block of QX values (`q8.quantize_rows`' math, each
    float operation rounded as written): dx[b] = max|x| / 127, q = trunc(x * (1 / dx) +- 0.5) as int8 into row r
    of xq [M, K / 4] (int32, 4 a dword), and the integer sum of each half block's q into sums [K / 16]. Two
    vectors a block: numba's loop of it stayed scalar (bench/engine/DECISIONS.md "Activation quantization in vectors")."""
    rows_c = all(isinstance(a, types.Array) and a.layout == "C" for a in (x, dx, sums))
    if not (rows_c and x.dtype == types.float32 and x.ndim == 2 and dx.ndim == 1 and sums.ndim == 1):
        return None
    sig = types.void(x, r, xq, dx, sums)

    def codegen(context, builder, signature, args):
        x_arr, xq_arr, dx_arr, sum_arr = (
            context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2, 3, 4)
        )
        row = context.cast(builder, args[1], signature.args[1], types.int64)
        x_row = _row_ptr(builder, x_arr, row, _F32)
        q_row = _row_ptr(builder, xq_arr, row, _I8)
        vf, vi = ir.VectorType(_F32, _HALF_BLOCK), ir.VectorType(_I32, _HALF_BLOCK)
        mod = builder.module
        fabs = cgutils.get_or_insert_function(mod, ir.FunctionType(vf, [vf]), f"llvm.fabs.v{_HALF_BLOCK}f32")
        vmax = cgutils.get_or_insert_function(
            mod, ir.FunctionType(vf, [vf, vf]), f"llvm.maxnum.v{_HALF_BLOCK}f32"
        )
        add_all = cgutils.get_or_insert_function(
            mod, ir.FunctionType(_I32, [vi]), f"llvm.vector.reduce.add.v{_HALF_BLOCK}i32"
        )
        zero = ir.Constant(_F32, 0.0)
        n_blocks = builder.udiv(builder.extract_value(x_arr.shape, 1), ir.Constant(_I64, QX))

        def block(b, carried):
            at = [
                builder.add(builder.mul(b, ir.Constant(_I64, QX)), ir.Constant(_I64, h * _HALF_BLOCK))
                for h in (0, 1)
            ]
            xs = [_load_vector(builder, x_row, a, _F32, _HALF_BLOCK) for a in at]
            top = builder.call(vmax, [builder.call(fabs, [xs[0]]), builder.call(fabs, [xs[1]])])
            width = _HALF_BLOCK
            while width > 1:  # max is exact in any order
                width //= 2
                top = builder.call(vmax, [
                    builder.shuffle_vector(top, top, _indices(list(range(width)) * (_HALF_BLOCK // width))),
                    builder.shuffle_vector(top, top, _indices(list(range(width, 2 * width)) * (_HALF_BLOCK // width))),
                ])  # fmt: skip
            amax = builder.extract_element(top, ir.Constant(_I32, 0))
            d = builder.fdiv(amax, ir.Constant(_F32, 127.0))
            inv = builder.select(
                builder.fcmp_ordered(">", d, zero), builder.fdiv(ir.Constant(_F32, 1.0), d), zero
            )
            builder.store(d, builder.gep(dx_arr.data, [b]))
            for h, (a, xv) in enumerate(zip(at, xs, strict=True)):
                v = builder.fmul(xv, _splat(builder, inv, _HALF_BLOCK))
                half = builder.select(
                    builder.fcmp_ordered(">=", v, ir.Constant(vf, [0.0] * _HALF_BLOCK)),
                    ir.Constant(vf, [0.5] * _HALF_BLOCK),
                    ir.Constant(vf, [-0.5] * _HALF_BLOCK),
                )
                qi = builder.fptosi(builder.fadd(v, half), vi)
                dst = builder.gep(q_row, [a])
                builder.store(
                    builder.trunc(qi, ir.VectorType(_I8, _HALF_BLOCK)),
                    builder.bitcast(dst, ir.VectorType(_I8, _HALF_BLOCK).as_pointer()),
                    align=1,
                )
                slot = builder.add(builder.mul(b, ir.Constant(_I64, 2)), ir.Constant(_I64, h))
                builder.store(builder.call(add_all, [qi]), builder.gep(sum_arr.data, [slot]))
            return []

        _counted_loop(builder, n_blocks, block, [])
        return context.get_dummy_value()

    return sig, codegen


@njit(fastmath=QUANT_FAST, cache=True, inline="always")
def _quantize_row(x, r, block, xq, dxw, xneg, xsum, dx, sums):
    """Token row r of x (C order) into the q8 outputs (`quantize_q8`); dx [K / QX], sums [K / 16]: its scratch."""
    quantize_blocks(x, r, xq, dx, sums)
    per = block // _HALF_BLOCK  # half blocks a weight block
    for wb in range(x.shape[1] // block):
        total = np.int32(0)
        for h in range(wb * per, (wb + 1) * per):
            total += sums[h]
        d = dx[wb * block // QX]
        dxw[r, wb] = d
        xneg[r, wb] = -128 * total
        xsum[r, wb] = d * np.float32(total)


@njit(fastmath=QUANT_FAST, cache=True, inline="always")
def _q8_outputs(x, block):
    m, k = x.shape
    xq = np.empty((m, k // 4), dtype=np.int32)
    dxw = np.empty((m, k // block), dtype=np.float32)
    xneg = np.empty((m, k // block), dtype=np.int32)
    xsum = np.empty((m, k // block), dtype=np.float32)
    dx = np.empty((m, k // QX), dtype=np.float32)  # scratch: per activation block
    sums = np.empty((m, k // _HALF_BLOCK), dtype=np.int32)  # scratch: per half block
    return xq, dxw, xneg, xsum, dx, sums


@njit(fastmath=QUANT_FAST, cache=True)
def quantize_q8(x, block):
    """x [M, K] float32 -> its q8 form for weight blocks of `block` values (16 or 32): per 32-value block
    dx = max|x| / 127 and qx as `q8.quantize_rows` -> (xq int32 [M, K / 4] (the qx, 4 a dword), and per weight
    block dxw (its dx), xneg (-128 * the sum of its qx), xsum (dx * that sum))."""
    x = np.ascontiguousarray(x)
    xq, dxw, xneg, xsum, dx, sums = _q8_outputs(x, block)
    for r in range(x.shape[0]):
        _quantize_row(x, r, block, xq, dxw, xneg, xsum, dx[r], sums[r])
    return xq, dxw, xneg, xsum


@njit(parallel=True, fastmath=QUANT_FAST, cache=True)
def quantize_q8_parallel(x, block):
    """`quantize_q8`, token rows over all threads (a prefill chunk's)."""
    x = np.ascontiguousarray(x)
    xq, dxw, xneg, xsum, dx, sums = _q8_outputs(x, block)
    for r in prange(x.shape[0]):
        _quantize_row(x, r, block, xq, dxw, xneg, xsum, dx[r], sums[r])
    return xq, dxw, xneg, xsum


@njit(fastmath=True, cache=True, inline="always")
def _q8_tile_rows(values, scale, mins, high, xq, dxw, xneg, xsum, y, t):
    """Weight tile t's outputs for every token row, Q8_ROWS at a time (the tile stays in cache meanwhile)."""
    r = 0
    while r < xq.shape[0]:
        rows = min(Q8_ROWS, xq.shape[0] - r)
        q8_tile(values, scale, mins, high, t, xq, dxw, xneg, xsum, y, r, rows)
        r += rows


@njit(parallel=True, fastmath=True, cache=True)
def matmul_q8(x, block, values, scale, mins, high, y):
    """y = x W^T, x quantized (`quantize_q8`; from Q8_PARALLEL_ROWS rows over all threads) then the weight's
    tiles over all threads."""
    if x.shape[0] >= Q8_PARALLEL_ROWS:
        xq, dxw, xneg, xsum = quantize_q8_parallel(x, block)
    else:
        xq, dxw, xneg, xsum = quantize_q8(x, block)
    for t in prange(values.shape[0] // TILE_ROWS):
        _q8_tile_rows(values, scale, mins, high, xq, dxw, xneg, xsum, y, t)


@njit(fastmath=True, cache=True)
def matmul_q8_serial(x, block, values, scale, mins, high, y):
    """`matmul_q8` on the calling thread."""
    xq, dxw, xneg, xsum = quantize_q8(x, block)
    for t in range(values.shape[0] // TILE_ROWS):
        _q8_tile_rows(values, scale, mins, high, xq, dxw, xneg, xsum, y, t)


_NO_HIGH = np.zeros(1, dtype=np.uint32)  # 1-D: not 5 bits (read by nothing; never written)


def takes(w: PackedWeight) -> bool:
    """Whether the q8 kernels multiply this packing (once tiled): 4-bit 32-value blocks, int8 16- or 32-value
    blocks; rows of whole activation blocks; whole tiles of rows."""
    block_ok = w.block == QX if w.four_bit else w.block in (QX // 2, QX)
    return block_ok and w.shape[1] % QX == 0 and w.shape[0] % TILE_ROWS == 0


def product(x: np.ndarray, w: PackedWeight, parallel: bool) -> np.ndarray:
    """x [M, K] float32 (C order), quantized, times the tiled weight -> [M, N] float32, the weight's tiles over
    all threads (parallel) or on this one."""
    if not w.tiled:
        raise ValueError("the q8 kernels read tiled weights (PackedWeight.tile)")
    y = np.empty((x.shape[0], w.shape[0]), dtype=F32)
    mins = w.min if w.min is not None else np.zeros(1, dtype=w.scale.dtype)  # 1-D: no min
    high = w.high if w.high is not None else _NO_HIGH
    kernel = matmul_q8 if parallel else matmul_q8_serial
    kernel(x, w.block, w.values, w.scale, mins, high, y)
    return y
