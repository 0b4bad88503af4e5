"""The compiled CPU kernels (numba): products with packed weights (`packed.py`) and attention over the K/V
pool's own storage (f32, f16 seen as uint16 bits, int8 with per-block scales), converting per tile.

Every kernel is `@njit(..., fastmath=..., cache=True)`: compiled once per argument types, cached on
disk (NUMBA_CACHE_DIR, else __pycache__ beside this file), compiled or loaded at the engine's warm-up
(`NumbaOps.warm`). Callers pass C-contiguous arrays of fixed dtypes so each kernel keeps one signature.

Shapes: x [M, K] float32 activations; a packed weight's values int8 [N, K] or 4-bit pairs uint8 [N, K / 2],
its scale and mins float32 or f16 bits (uint16) [N, K / block]; y [M, N] float32.
"""

from __future__ import annotations

import os

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

F32 = np.float32
# OpenMP (GNU libgomp) before numba's workqueue, whose sleeping threads take ~100 us to start each parallel
# region. libgomp's threads spin between regions, bounded here (GOMP_SPINCOUNT) so that on a busy machine
# a waiting thread soon yields the core another needs: unbounded spinning (or 30,000 spins) fell to 7-17
# tok/s there. bench/CPU-NOTES.md has the figures.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")
if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]
# fastmath without nnan / ninf: attention compares scores with -inf.
SAFE_FAST = {"reassoc", "contract", "arcp", "nsz"}


def _target_has_avx512() -> bool:
    """Whether numba compiles for AVX-512 (32 vector registers): the host's features, or NUMBA_CPU_FEATURES
    where set (as numba's own code generator decides)."""
    from llvmlite import binding

    if numba.config.CPU_FEATURES is not None:
        return "+avx512f" in numba.config.CPU_FEATURES.split(",")
    return bool(binding.get_host_cpu_features().get("avx512f", False))


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

    elif value in (types.uint8, types.uint32):

        def codegen(context, builder, sig, args):
            return builder.uitofp(args[0], ir.FloatType())

    else:
        return None
    return types.float32(value), codegen


# ---- products with packed weights -------------------------------------------------------------------
# A row's dot product is written in LLVM vector IR (`row_dot`): the same loop in Python gets vectorized 8
# wide with a horizontal sum per 32-value block (or, with a constant block length, unrolled and gathered
# across blocks), 2x slower (bench/CPU-NOTES.md).

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
# numba's fastmath pass gives every float instruction that has no flags the kernel's (reassoc, contract):
# an explicit flag that changes no finite result keeps it off, so the instruction rounds as written.
EXACT = ("nsz",)
_F32 = ir.FloatType()
_LANES = 16  # float32 lanes of the accumulator (one AVX-512 register, two AVX2 ones)


def _indices(values: list[int]) -> ir.Constant:
    return ir.Constant(ir.VectorType(_I32, len(values)), values)


def _load_vector(builder, base, offset, elem, n):
    ptr = builder.gep(base, [offset])
    return builder.load(builder.bitcast(ptr, ir.VectorType(elem, n).as_pointer()), align=1)


def _scale_at(builder, scale_array, index, half):
    """scale[index] as float32 (an f16 scale is stored as its uint16 bits)."""
    value = builder.load(builder.gep(scale_array.data, [index]))
    return builder.fpext(builder.bitcast(value, ir.HalfType()), _F32) if half else value


def _lanes(nibbles: bool, block: int) -> int:
    """The accumulator's float32 lanes for a block: 16, or fewer for a short block of 4-bit pairs."""
    return min(_LANES, block // 2 if nibbles else block)


def _block_products(builder, values, x, offset_q, offset_x, nibbles, block):
    """One block's products q * x folded to `_lanes` lanes: <lanes x float>."""
    if nibbles:  # block / 2 bytes: value j in the low nibble of byte j, value j + block / 2 in its high one
        n = block // 2
        vf = ir.VectorType(_F32, n)
        raw = builder.zext(_load_vector(builder, values, offset_q, ir.IntType(8), n), ir.VectorType(_I32, n))
        lo = builder.uitofp(builder.and_(raw, ir.Constant(raw.type, [15] * n)), vf)
        hi = builder.uitofp(builder.lshr(raw, ir.Constant(raw.type, [4] * n)), vf)
        x_lo = _load_vector(builder, x, offset_x, _F32, n)
        x_hi = _load_vector(builder, x, builder.add(offset_x, ir.Constant(_I64, n)), _F32, n)
        prod = builder.fadd(builder.fmul(lo, x_lo), builder.fmul(hi, x_hi))
    else:
        q = builder.sitofp(_load_vector(builder, values, offset_q, ir.IntType(8), block), ir.VectorType(_F32, block))
        prod = builder.fmul(q, _load_vector(builder, x, offset_x, _F32, block))
    width = prod.type.count
    while width > _LANES:  # fold halves
        width //= 2
        prod = builder.fadd(
            builder.shuffle_vector(prod, prod, _indices(list(range(width)))),
            builder.shuffle_vector(prod, prod, _indices(list(range(width, 2 * width)))),
        )
    return prod


def _row_dot(with_min: bool):
    """The `row_dot` intrinsic, or with mins (`row_dot_min`)."""

    def typer(typingctx, values, x, scale, mins, xsum, block):
        if not isinstance(block, types.IntegerLiteral) or block.literal_value not in (16, 32):
            return None
        nibbles = values.dtype == types.uint8
        half = scale.dtype == types.uint16
        sig = types.float32(values, x, scale, mins, xsum, block)

        def codegen(context, builder, signature, args):
            n = block.literal_value
            q_arr, x_arr, s_arr, m_arr, xs_arr = (
                context.make_array(t)(context, builder, a) for t, a in zip(signature.args[:5], args[:5], strict=True)
            )
            lanes = _lanes(nibbles, n)
            vf = ir.VectorType(_F32, lanes)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fma.v{lanes}f32")
            fma1 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32] * 3), "llvm.fma.f32")

            def one_block(b, acc, macc):
                offset_x = builder.mul(b, ir.Constant(_I64, n))
                offset_q = builder.mul(b, ir.Constant(_I64, n // 2 if nibbles else n))
                prod = _block_products(builder, q_arr.data, x_arr.data, offset_q, offset_x, nibbles, n)
                acc = builder.call(fma, [prod, _splat(builder, _scale_at(builder, s_arr, b, half), lanes), acc])
                if with_min:  # min * sum(x) of the block
                    xs = builder.load(builder.gep(xs_arr.data, [b]))
                    macc = builder.call(fma1, [_scale_at(builder, m_arr, b, half), xs, macc])
                return acc, macc

            def block_pair(i, carried):  # two accumulators: the fma chains of even and odd blocks overlap
                b = builder.mul(i, ir.Constant(_I64, 2))
                even = one_block(b, carried[0], carried[2])
                odd = one_block(builder.add(b, ir.Constant(_I64, 1)), carried[1], carried[3])
                return [even[0], odd[0], even[1], odd[1]]

            n_blocks = builder.extract_value(s_arr.shape, 0)
            zero_v, zero_s = ir.Constant(vf, [0.0] * lanes), ir.Constant(_F32, 0.0)
            pairs = builder.lshr(n_blocks, ir.Constant(_I64, 1))
            acc0, acc1, macc0, macc1 = _counted_loop(builder, pairs, block_pair, [zero_v, zero_v, zero_s, zero_s])
            last = builder.mul(pairs, ir.Constant(_I64, 2))

            def tail(i, carried):  # the last block of an odd count
                return list(one_block(builder.add(last, i), carried[0], carried[1]))

            acc0, macc0 = _counted_loop(builder, builder.sub(n_blocks, last), tail, [acc0, macc0])
            return builder.fadd(_hsum(builder, builder.fadd(acc0, acc1)), builder.fadd(macc0, macc1))

        return sig, codegen

    typer.__name__ = "row_dot_min" if with_min else "row_dot"
    return intrinsic(typer)


# sum over blocks b of scale[b] * sum_j q[b, j] x[b * block + j] (+ mins[b] * xsum[b] with min) for one
# packed row: values int8 [K] or 4-bit pairs uint8 [K / 2]; x float32 [K]; scale (and mins) float32 or
# uint16 (f16 bits) [K / block]; xsum float32 [K / block] (x's block sums); block an integer literal (16
# or 32). One vector accumulator (and one scalar for the mins), one horizontal sum at the end.
row_dot = _row_dot(with_min=False)
row_dot_min = _row_dot(with_min=True)


# A decode step of B slots multiplies B token rows by each weight. `row_dot` per token row would decode every
# weight block B times; `rows_dot` decodes a block once to w = q * scale + min and multiplies it into a group
# of up to ROWS_GROUP token rows, its accumulators in registers: one weight row with an accumulator per
# token row and 16-lane chunk of a block (their fma chains overlap), or, from PAIR_MIN_ROWS token rows, two
# weight rows with one per token row and weight row (each x chunk loaded once for both: 1.15x at 8 rows,
# 1.5x at 16). 8 rows x 2 x 16 lanes take 16 of AVX-512's 32 registers; AVX2 has 16 half as wide: 2 rows (1.45x a
# row at a time; 3 or 4 rows spill), no pairs. bench/CPU-NOTES.md "The multi-row kernel" has the measurements.
_AVX512 = _target_has_avx512()
ROWS_GROUP = 8 if _AVX512 else 2
PAIR_MIN_ROWS = 8 if _AVX512 else 1 << 62
# (token rows, weight rows) of the loops `rows_dot` has (each costs compile time): one weight row for every
# group size, two for groups of 8, 4, 2, 1 (`_matmul_rows` cuts the token rows so).
ROWS_TILES = [(r, 1) for r in range(1, ROWS_GROUP + 1)] + [(r, 2) for r in (8, 4, 2, 1) if _AVX512]


def _decoded_block(builder, values, offset_q, nibbles, block, lanes):
    """One block's q as float32 in value order, as <lanes x float> chunks (4-bit pairs: the low nibbles
    are values 0 .. block / 2 - 1, the high ones the rest)."""
    if nibbles:
        n = block // 2
        raw = builder.zext(_load_vector(builder, values, offset_q, ir.IntType(8), n), ir.VectorType(_I32, n))
        vf = ir.VectorType(_F32, n)
        halves = [
            builder.uitofp(builder.and_(raw, ir.Constant(raw.type, [15] * n)), vf),
            builder.uitofp(builder.lshr(raw, ir.Constant(raw.type, [4] * n)), vf),
        ]
    else:
        q = _load_vector(builder, values, offset_q, ir.IntType(8), block)
        halves = [builder.sitofp(q, ir.VectorType(_F32, block))]
    return [
        builder.shuffle_vector(h, h, _indices(list(range(lo, lo + lanes)))) if h.type.count > lanes else h
        for h in halves
        for lo in range(0, h.type.count, lanes)
    ]


def _rows_dot(with_min: bool):
    """The `rows_dot` intrinsic, or with mins (`rows_dot_min`)."""

    def typer(typingctx, values, x, r0, rows, scale, mins, y, n, tile, block):
        if not isinstance(block, types.IntegerLiteral) or block.literal_value not in (16, 32):
            return None
        nibbles = values.dtype == types.uint8
        half = scale.dtype == types.uint16
        sig = types.void(values, x, r0, rows, scale, mins, y, n, tile, block)

        def codegen(context, builder, signature, args):
            q_arr, x_arr, s_arr, m_arr, y_arr = (
                context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 1, 4, 5, 6)
            )
            nb = block.literal_value
            lanes = _lanes(nibbles, nb)
            vf = ir.VectorType(_F32, lanes)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fma.v{lanes}f32")
            r0_val, rows_val, n_val, tile_val = (
                context.cast(builder, args[i], signature.args[i], types.int64) for i in (2, 3, 7, 8)
            )
            scale_elem = ir.IntType(16) if half else _F32
            n_blocks = builder.extract_value(s_arr.shape, 1)
            n_chunks = nb // lanes

            def tile_loop(n_rows, n_w):
                n_acc = n_chunks if n_w == 1 else 1  # accumulators per token row and weight row
                weight_rows = [builder.add(n_val, ir.Constant(_I64, i)) for i in range(n_w)]
                q_rows = [_row_ptr(builder, q_arr, i, ir.IntType(8)) for i in weight_rows]
                s_rows = [_row_ptr(builder, s_arr, i, scale_elem) for i in weight_rows]
                m_rows = [_row_ptr(builder, m_arr, i, scale_elem) for i in weight_rows] if with_min else []
                x_rows = [
                    _row_ptr(builder, x_arr, builder.add(r0_val, ir.Constant(_I64, r)), _F32) for r in range(n_rows)
                ]

                def body(b, accs):
                    offset_q = builder.mul(b, ir.Constant(_I64, nb // 2 if nibbles else nb))
                    w = []  # the weight rows' block b as w = q * scale + min: [weight row][chunk]
                    for i in range(n_w):
                        d = _splat(builder, _scale_value(builder, s_rows[i], b, half), lanes)
                        q = _decoded_block(builder, q_rows[i], offset_q, nibbles, nb, lanes)
                        if with_min:
                            m = _splat(builder, _scale_value(builder, m_rows[i], b, half), lanes)
                            w.append([builder.call(fma, [qc, d, m]) for qc in q])
                        else:
                            w.append([builder.fmul(qc, d) for qc in q])
                    out = list(accs)  # accumulator (r * n_w + i) * n_acc + c: token row r, weight row i, chunk c
                    offset_x = builder.mul(b, ir.Constant(_I64, nb))
                    for r, x_row in enumerate(x_rows):
                        for c in range(n_chunks):  # each x chunk loaded once for the tile's weight rows
                            offset = builder.add(offset_x, ir.Constant(_I64, c * lanes))
                            xc = _load_vector(builder, x_row, offset, _F32, lanes)
                            for i in range(n_w):
                                a = (r * n_w + i) * n_acc + (c if n_acc > 1 else 0)
                                out[a] = builder.call(fma, [w[i][c], xc, out[a]])
                    return out

                zero = ir.Constant(vf, [0.0] * lanes)
                final = _counted_loop(builder, n_blocks, body, [zero] * (n_rows * n_w * n_acc))
                for r in range(n_rows):
                    y_row = _row_ptr(builder, y_arr, builder.add(r0_val, ir.Constant(_I64, r)), _F32)
                    for i in range(n_w):
                        parts = final[(r * n_w + i) * n_acc : (r * n_w + i + 1) * n_acc]
                        total = parts[0]
                        for part in parts[1:]:
                            total = builder.fadd(total, part, flags=EXACT)
                        builder.store(_hsum(builder, total), builder.gep(y_row, [weight_rows[i]]))

            done = builder.append_basic_block("rows_done")
            # one loop per (token rows, weight rows): its accumulators stay in registers. Another combination
            # writes nothing (callers pass only these; a trapping default made the loops 1.3-1.6x slower).
            switch = builder.switch(builder.add(builder.mul(rows_val, ir.Constant(_I64, 8)), tile_val), done)
            for n_rows, n_w in ROWS_TILES:
                case = builder.append_basic_block(f"rows_{n_rows}_{n_w}")
                switch.add_case(ir.Constant(_I64, n_rows * 8 + n_w), case)
                builder.position_at_end(case)
                tile_loop(n_rows, n_w)
                builder.branch(done)
            builder.position_at_end(done)
            return context.get_dummy_value()

        return sig, codegen

    typer.__name__ = "rows_dot_min" if with_min else "rows_dot"
    return intrinsic(typer)


def _scale_value(builder, row, index, half):
    """row[index] of a scale row (a pointer to f16 bits or float32) as float32."""
    value = builder.load(builder.gep(row, [index]))
    return builder.fpext(builder.bitcast(value, ir.HalfType()), _F32) if half else value


# y[r0 + r, n + i] = w_(n + i) . x[r0 + r] for the `rows` token rows from r0 of x [M, K] float32 and the
# `tile` packed weight rows from n ((rows, tile) one of ROWS_TILES; values int8 [N, K] or 4-bit pairs uint8
# [N, K / 2]; scale, and mins with min, float32 or uint16 f16 bits [N, K / block]), decoded a block at a time
# (block a literal, 16 or 32); y float32 [M, N]. A token row's result does not depend on the other rows nor
# on its place among them: each accumulator sees the same operations in the same order whatever the group
# (one weight row, or two: their results differ by round-off).
rows_dot = _rows_dot(with_min=False)
rows_dot_min = _rows_dot(with_min=True)


@njit(fastmath=True, cache=True, inline="always")
def _matmul_row(x, xsum, values, scale, mins, has_min, block, y, n):
    """Row n of y = x W^T, one token row at a time (`row_dot`)."""
    row = values[n]
    sc = scale[n]
    mn = mins[n] if has_min else mins[0]
    for m in range(x.shape[0]):
        xr, xs = x[m], xsum[m if has_min else 0]
        if has_min:
            acc = row_dot_min(row, xr, sc, mn, xs, 32) if block == 32 else row_dot_min(row, xr, sc, mn, xs, 16)
        else:
            acc = row_dot(row, xr, sc, mn, xs, 32) if block == 32 else row_dot(row, xr, sc, mn, xs, 16)
        y[m, n] = acc


@njit(fastmath=True, cache=True, inline="always")
def _rows_dot_any(values, x, r, rows, scale, mins, has_min, y, n, tile, block):
    if has_min and block == 32:
        rows_dot_min(values, x, r, rows, scale, mins, y, n, tile, 32)
    elif has_min:
        rows_dot_min(values, x, r, rows, scale, mins, y, n, tile, 16)
    elif block == 32:
        rows_dot(values, x, r, rows, scale, mins, y, n, tile, 32)
    else:
        rows_dot(values, x, r, rows, scale, mins, y, n, tile, 16)


@njit(fastmath=True, cache=True, inline="always")
def _matmul_rows(x, values, scale, mins, has_min, block, y, n, tile):
    """Weight rows n .. n + tile - 1 of y = x W^T by `rows_dot`, the token rows in groups of up to ROWS_GROUP
    (with a pair of weight rows, of 8, 4, 2, 1: the loops it has)."""
    r = 0
    while r < x.shape[0]:
        rows = min(ROWS_GROUP, x.shape[0] - r)
        while tile > 1 and rows & (rows - 1):  # a pair of weight rows: groups of 8, 4, 2, 1
            rows &= rows - 1
        _rows_dot_any(values, x, r, rows, scale, mins, has_min, y, n, tile, block)
        r += rows


@njit(fastmath=True, cache=True, inline="always")
def _weight_tile(n_tok):
    return 2 if n_tok >= PAIR_MIN_ROWS else 1


@njit(parallel=True, fastmath=True, cache=True)
def matmul_packed(x, xsum, values, scale, mins, has_min, block, by_row, y):
    """y = x W^T for a packed weight, weight rows over all threads: a token row at a time (by_row:
    `row_dot`, plus min * sum(x) per block where it has mins, xsum [M, K / block]) or each block of a tile
    of weight rows decoded once for a group of token rows (`rows_dot`; xsum read only for the rows past the
    last full tile). One kernel for both: warming one warms both."""
    if by_row:
        for n in prange(values.shape[0]):
            _matmul_row(x, xsum, values, scale, mins, has_min, block, y, n)
    else:
        tile = _weight_tile(x.shape[0])
        full = values.shape[0] // tile
        for t in prange(full):
            _matmul_rows(x, values, scale, mins, has_min, block, y, t * tile, tile)
        # past the last full tile, a row at a time (apart: inlined in the loop above it slowed that 1.4x)
        for n in range(full * tile, values.shape[0]):
            _matmul_row(x, xsum, values, scale, mins, has_min, block, y, n)


@njit(fastmath=True, cache=True)
def matmul_packed_serial(x, xsum, values, scale, mins, has_min, block, by_row, y):
    """`matmul_packed` on the calling thread (a product too small to be worth a parallel region)."""
    if by_row:
        for n in range(values.shape[0]):
            _matmul_row(x, xsum, values, scale, mins, has_min, block, y, n)
    else:
        tile = _weight_tile(x.shape[0])
        full = values.shape[0] // tile
        for t in range(full):
            _matmul_rows(x, values, scale, mins, has_min, block, y, t * tile, tile)
        for n in range(full * tile, values.shape[0]):
            _matmul_row(x, xsum, values, scale, mins, has_min, block, y, n)


@njit(fastmath=True, cache=True, inline="always")
def _dequantize_row(row, scale, mins, has_min, o_row):
    n_blocks = scale.shape[0]
    block = o_row.shape[0] // n_blocks
    nibbles = row.shape[0] != o_row.shape[0]
    half = block // 2
    for b in range(n_blocks):
        d = widen(scale[b])
        mn = widen(mins[b]) if has_min else F32(0)
        o = b * block
        if nibbles:
            for j in range(half):
                v = row[b * half + j]
                o_row[o + j] = F32(v & 15) * d + mn
                o_row[o + half + j] = F32(v >> 4) * d + mn
        else:
            for j in range(block):
                o_row[o + j] = F32(row[o + j]) * d + mn


@njit(parallel=True, fastmath=True, cache=True)
def dequantize_packed(values, scale, mins, has_min, out):
    """out [N, K] float32 = q * scale + min (values int8 [N, K], or 4-bit pairs uint8 [N, K / 2])."""
    for n in prange(values.shape[0]):
        if has_min:
            _dequantize_row(values[n], scale[n], mins[n], True, out[n])
        else:
            _dequantize_row(values[n], scale[n], mins[0], False, out[n])


@njit(fastmath=True, cache=True)
def dequantize_packed_serial(values, scale, mins, has_min, out):
    """`dequantize_packed` on the calling thread: between BLAS calls, whose threads still spin."""
    for n in range(values.shape[0]):
        _dequantize_row(values[n], scale[n], mins[n if has_min else 0], has_min, out[n])


# ---- attention over the K/V pool's storage -------------------------------------------------------------
# Per query row, its visible keys are one position range: scores by `key_dots`, a softmax with
# `fast_exp`, the weighted sum of values by `value_sums` (both in LLVM vector IR: the row's accumulators
# stay in registers). Keys and values are read as stored (f16 bits, int8 with per-block scales, f32)
# and converted in registers, never into a float32 copy.
_HEAD_DIMS = (64, 128, 256)  # head sizes the IR is generated for (others: a plain loop)


@intrinsic
def f32_from_bits(typingctx, bits):
    """The float32 whose bits are the low 32 bits of the integer `bits`."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        low = args[0] if bits.bitwidth == 32 else builder.trunc(args[0], _I32)
        return builder.bitcast(low, _F32)

    return types.float32(bits), codegen


@njit(fastmath=SAFE_FAST, cache=True, inline="always")
def fast_exp(x):
    """e^x for x <= 0 (Cephes' expf: relative error ~2e-7; 2^-126 below -87): arithmetic only, so a loop
    of it vectorizes, where numba calls libm's scalar expf once a value."""
    x = max(x, F32(-87.0))
    n = np.floor(x * F32(1.4426950408889634) + F32(0.5))
    r = x - n * F32(0.693359375)
    r = r + n * F32(2.12194440e-4)
    p = F32(1.9875691500e-4)
    p = p * r + F32(1.3981999507e-3)
    p = p * r + F32(8.3334519073e-3)
    p = p * r + F32(4.1665795894e-2)
    p = p * r + F32(1.6666665459e-1)
    p = p * r + F32(5.0000001201e-1)
    y = p * (r * r) + r + F32(1)
    return y * f32_from_bits((np.int64(n) + 127) << 23)


def _row_ptr(builder, arr, index, elem):
    """Pointer to row `index` of a 2-D array (any strides) as elem*."""
    stride = builder.extract_value(arr.strides, 0)
    raw = builder.gep(builder.bitcast(arr.data, ir.IntType(8).as_pointer()), [builder.mul(index, stride)])
    return builder.bitcast(raw, elem.as_pointer())


def _stored_chunk(builder, row, scale_row, c, dtype):
    """Values [16c, 16c + 16) of a stored K/V row as <16 x float> (int8 times its 32-value block's scale)."""
    vf = ir.VectorType(_F32, _LANES)
    off = ir.Constant(_I64, c * _LANES)
    if dtype == types.uint16:
        bits = _load_vector(builder, row, off, ir.IntType(16), _LANES)
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), _LANES)), vf)
    if dtype == types.float32:
        return _load_vector(builder, row, off, _F32, _LANES)
    q = builder.sitofp(_load_vector(builder, row, off, ir.IntType(8), _LANES), vf)
    scale = builder.load(builder.gep(scale_row, [ir.Constant(_I64, c * _LANES // 32)]))
    return builder.fmul(q, _splat(builder, scale, _LANES), flags=EXACT)  # rounded as the decoded copy


def _splat(builder, value, lanes):
    vf = ir.VectorType(value.type, lanes)
    return builder.shuffle_vector(
        builder.insert_element(ir.Constant(vf, ir.Undefined), value, ir.Constant(_I32, 0)),
        ir.Constant(vf, ir.Undefined), _indices([0] * lanes),
    )  # fmt: skip


def _hsum(builder, v):
    """The lanes' sum, halves folded in a fixed order."""
    width = v.type.count
    while width > 1:
        width //= 2
        v = builder.fadd(
            builder.shuffle_vector(v, v, _indices(list(range(width)))),
            builder.shuffle_vector(v, v, _indices(list(range(width, 2 * width)))),
            flags=EXACT,
        )
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _counted_loop(builder, n, body, carried):
    """for i in range(n): carried = body(i, carried); returns the final carried values (a list of IR
    values; their initial values are `carried`)."""
    entry = builder.block
    loop = builder.append_basic_block("loop")
    done = builder.append_basic_block("done")
    builder.cbranch(builder.icmp_signed(">", n, ir.Constant(_I64, 0)), loop, done)
    builder.position_at_end(loop)
    i = builder.phi(_I64)
    phis = [builder.phi(v.type) for v in carried]
    nxt = body(i, phis)
    i_next = builder.add(i, ir.Constant(_I64, 1))
    tail = builder.block
    i.add_incoming(ir.Constant(_I64, 0), entry)
    i.add_incoming(i_next, tail)
    for phi, start, end in zip(phis, carried, nxt, strict=True):
        phi.add_incoming(start, entry)
        phi.add_incoming(end, tail)
    builder.cbranch(builder.icmp_signed("<", i_next, n), loop, done)
    builder.position_at_end(done)
    out = []
    for start, end in zip(carried, nxt, strict=True):
        phi = builder.phi(start.type)
        phi.add_incoming(start, entry)
        phi.add_incoming(end, tail)
        out.append(phi)
    return out


def _kv_intrinsic_args(context, builder, signature, args):
    return [context.make_array(t)(context, builder, a) for t, a in zip(signature.args[:3], args[:3], strict=True)]


_ELEM = {types.uint16: ir.IntType(16), types.float32: _F32, types.int8: ir.IntType(8)}
# Rows of one token's query heads (of a K/V head) the value sums keep in registers at once: rows x D / 16
# accumulators, at most 16 (AVX-512 has 32 registers).
_SUM_ROWS = {64: 4, 128: 2, 256: 1}


@intrinsic
def key_dots(typingctx, q, keys, scales, lo, n, out, d):
    """out[r, i] = q[r] . keys[lo + i] for every row r of q [R, D] (float32) and i < n: each key row is
    read and converted once for all R rows; keys a stored head's rows [slots, D] (uint16 f16 bits,
    float32, or int8 with `scales` [slots, D / 32]); out float32 [R, >= n]; d the literal D."""
    if not isinstance(d, types.IntegerLiteral) or d.literal_value not in _HEAD_DIMS or keys.dtype not in _ELEM:
        return None
    sig = types.void(q, keys, scales, lo, n, out, d)

    def codegen(context, builder, signature, args):
        q_arr, k_arr, s_arr = _kv_intrinsic_args(context, builder, signature, args)
        out_arr = context.make_array(signature.args[5])(context, builder, args[5])
        chunks = d.literal_value // _LANES
        vf = ir.VectorType(_F32, _LANES)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3), "llvm.fma.v16f32")
        n_rows = builder.extract_value(q_arr.shape, 0)

        def key(i, carried):
            idx = builder.add(args[3], i)
            row = _row_ptr(builder, k_arr, idx, _ELEM[keys.dtype])
            scale_row = _row_ptr(builder, s_arr, idx, _F32)
            kv = [_stored_chunk(builder, row, scale_row, c, keys.dtype) for c in range(chunks)]

            def query(r, carried_r):
                q_row = _row_ptr(builder, q_arr, r, _F32)
                acc = ir.Constant(vf, [0.0] * _LANES)
                for c in range(chunks):
                    qc = _load_vector(builder, q_row, ir.Constant(_I64, c * _LANES), _F32, _LANES)
                    acc = builder.call(fma, [qc, kv[c], acc])
                builder.store(_hsum(builder, acc), builder.gep(_row_ptr(builder, out_arr, r, _F32), [i]))
                return []

            _counted_loop(builder, n_rows, query, [])
            return []

        _counted_loop(builder, args[4], key, [])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def value_sums(typingctx, acc, weights, values, scales, lo, n, d, rows):
    """acc[r] += sum_i weights[r, i] * values[lo + i] for i < n and the `rows` (a literal) rows of acc
    [rows, D] and weights [rows, >= n]: each value row is read and converted once for all of them, and
    the rows x D / 16 accumulators stay in registers over the loop; values as in `key_dots`."""
    if not isinstance(d, types.IntegerLiteral) or d.literal_value not in _HEAD_DIMS or values.dtype not in _ELEM:
        return None
    if not isinstance(rows, types.IntegerLiteral) or not 1 <= rows.literal_value <= _SUM_ROWS[d.literal_value]:
        return None
    sig = types.void(acc, weights, values, scales, lo, n, d, rows)

    def codegen(context, builder, signature, args):
        acc_arr, w_arr, v_arr = _kv_intrinsic_args(context, builder, signature, args)
        s_arr = context.make_array(signature.args[3])(context, builder, args[3])
        chunks, n_rows = d.literal_value // _LANES, rows.literal_value
        vf = ir.VectorType(_F32, _LANES)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3), "llvm.fma.v16f32")
        acc_rows = [_row_ptr(builder, acc_arr, ir.Constant(_I64, r), _F32) for r in range(n_rows)]
        w_rows = [_row_ptr(builder, w_arr, ir.Constant(_I64, r), _F32) for r in range(n_rows)]
        start = [
            _load_vector(builder, acc_rows[r], ir.Constant(_I64, c * _LANES), _F32, _LANES)
            for r in range(n_rows)
            for c in range(chunks)
        ]

        def body(i, carried):
            idx = builder.add(args[4], i)
            row = _row_ptr(builder, v_arr, idx, _ELEM[values.dtype])
            scale_row = _row_ptr(builder, s_arr, idx, _F32)
            kv = [_stored_chunk(builder, row, scale_row, c, values.dtype) for c in range(chunks)]
            out = []
            for r in range(n_rows):
                w = _splat(builder, builder.load(builder.gep(w_rows[r], [i])), _LANES)
                out += [builder.call(fma, [kv[c], w, carried[r * chunks + c]]) for c in range(chunks)]
            return out

        final = _counted_loop(builder, args[5], body, start)
        for r in range(n_rows):
            for c in range(chunks):
                ptr = builder.gep(acc_rows[r], [ir.Constant(_I64, c * _LANES)])
                builder.store(final[r * chunks + c], builder.bitcast(ptr, vf.as_pointer()), align=1)
        return context.get_dummy_value()

    return sig, codegen


@njit(fastmath=SAFE_FAST, cache=True, inline="always")
def _dots(q, keys, scales, has_scales, lo, n, out):
    """out[r, :n] = q[r] . keys[lo + i] (`key_dots`, or a plain loop for other head sizes)."""
    d = q.shape[1]
    if d == 64:
        key_dots(q, keys, scales, lo, n, out, 64)
    elif d == 128:
        key_dots(q, keys, scales, lo, n, out, 128)
    elif d == 256:
        key_dots(q, keys, scales, lo, n, out, 256)
    else:
        for r in range(q.shape[0]):
            for i in range(n):
                s = F32(0)
                for j in range(d):
                    s += q[r, j] * widen(keys[lo + i, j]) * (scales[lo + i, j // 32] if has_scales else F32(1))
                out[r, i] = s


@njit(fastmath=SAFE_FAST, cache=True, inline="always")
def _sums(acc, weights, values, scales, has_scales, lo, n):
    """acc[r] += sum_i weights[r, i] values[lo + i] (`value_sums` on as many rows at once as fit the
    registers, or a plain loop for other head sizes)."""
    d = acc.shape[1]
    n_rows = acc.shape[0]
    r = 0
    while r < n_rows:
        left = n_rows - r
        a, w = acc[r:], weights[r:]
        if d == 64 and left >= 4:
            value_sums(a, w, values, scales, lo, n, 64, 4)
            r += 4
        elif d == 64 and left >= 2:
            value_sums(a, w, values, scales, lo, n, 64, 2)
            r += 2
        elif d == 64:
            value_sums(a, w, values, scales, lo, n, 64, 1)
            r += 1
        elif d == 128 and left >= 2:
            value_sums(a, w, values, scales, lo, n, 128, 2)
            r += 2
        elif d == 128:
            value_sums(a, w, values, scales, lo, n, 128, 1)
            r += 1
        elif d == 256:
            value_sums(a, w, values, scales, lo, n, 256, 1)
            r += 1
        else:
            for i in range(n):
                wi = weights[r, i]
                for j in range(d):
                    acc[r, j] += wi * widen(values[lo + i, j]) * (scales[lo + i, j // 32] if has_scales else F32(1))
            r += 1


@njit(fastmath=SAFE_FAST, cache=True, inline="always")
def _attention_item(
    item, q, k, v, k_scale, v_scale, has_scales, q_pos0, k_lo, base, capacity, window, n_split, acc, m_out, l_out
):
    n_tok, n_head, d = q.shape
    group = n_head // k.shape[1]
    k_hi = q_pos0 + n_tok
    per_split = (k_hi - k_lo + n_split - 1) // n_split
    hk = item // n_split
    sp = item % n_split
    s_lo = k_lo + sp * per_split
    s_hi = min(k_hi, s_lo + per_split)
    keys, values = k[:, hk], v[:, hk]
    key_scales, value_scales = k_scale[:, min(hk, k_scale.shape[1] - 1)], v_scale[:, min(hk, v_scale.shape[1] - 1)]
    scores = np.empty((group, max(1, s_hi - s_lo)), dtype=F32)
    for t in range(n_tok):  # the token's `group` query heads see the same keys: rows t * G .. t * G + G - 1
        qp = q_pos0 + t
        lo = s_lo if window <= 0 else max(s_lo, qp - window + 1)
        hi = min(s_hi, qp + 1)
        rows = slice(t * group, (t + 1) * group)
        a = acc[hk, sp, rows]
        a[:] = 0
        m_out[hk, sp, rows] = -np.inf
        l_out[hk, sp, rows] = 0
        if hi <= lo:
            continue
        qt = q[t, hk * group : (hk + 1) * group]
        n = hi - lo
        p = lo
        while p < hi:  # slot runs: one, or two where a ring wraps
            slot = p % capacity if capacity > 0 else p - base
            run = hi - p if capacity <= 0 else min(hi - p, capacity - slot)
            _dots(qt, keys, key_scales, has_scales, slot, run, scores[:, p - lo : p - lo + run])
            p += run
        for g in range(group):
            sg = scores[g]
            top = sg[0]
            for i in range(1, n):
                top = max(top, sg[i])
            total = F32(0)
            for i in range(n):
                e = fast_exp(sg[i] - top)
                sg[i] = e
                total += e
            m_out[hk, sp, t * group + g] = top
            l_out[hk, sp, t * group + g] = total
        p = lo
        while p < hi:
            slot = p % capacity if capacity > 0 else p - base
            run = hi - p if capacity <= 0 else min(hi - p, capacity - slot)
            _sums(a, scores[:, p - lo : p - lo + run], values, value_scales, has_scales, slot, run)
            p += run


@njit(parallel=True, fastmath=SAFE_FAST, cache=True)
def attention_partials(
    q, k, v, k_scale, v_scale, has_scales, q_pos0, k_lo, base, capacity, window, n_split, acc, m_out, l_out
):
    """Causal (sliding-window) GQA attention of queries q [T, H, D] (already times the softmax scale) over
    the keys at positions [k_lo, q_pos0 + T), read from storage k, v [slots, Hkv, D] (int8: with k_scale,
    v_scale [slots, Hkv, D / 32]): position p sits in slot p % capacity (a ring, capacity > 0) or
    p - base. A query at position p sees keys j <= p with p - j < window (window 0: no window). Work
    item (kv head, split) covers one of n_split equal key ranges and leaves, per row r = t * G + g
    (token t, query head kv_head * G + g), the max m_out of its scores, the sum l_out of exp(s - m)
    and acc = sum exp(s - m) v, merged by `attention_merge`. Work items over all threads."""
    for item in prange(k.shape[1] * n_split):
        _attention_item(
            item, q, k, v, k_scale, v_scale, has_scales, q_pos0, k_lo, base, capacity, window, n_split, acc,
            m_out, l_out,
        )  # fmt: skip


@njit(fastmath=SAFE_FAST, cache=True)
def attention_partials_serial(
    q, k, v, k_scale, v_scale, has_scales, q_pos0, k_lo, base, capacity, window, n_split, acc, m_out, l_out
):
    """`attention_partials` on the calling thread (too few keys to be worth a parallel region)."""
    for item in range(k.shape[1] * n_split):
        _attention_item(
            item, q, k, v, k_scale, v_scale, has_scales, q_pos0, k_lo, base, capacity, window, n_split, acc,
            m_out, l_out,
        )  # fmt: skip


@njit(fastmath=SAFE_FAST, cache=True)
def attention_merge(acc, m_in, l_in, n_tok, out):
    """out [T, H * D] from the splits' partials: sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M)."""
    n_kv, n_split, rows, d = acc.shape
    group = rows // n_tok
    for hk in range(n_kv):
        for r in range(rows):
            t = r // group
            g = r % group
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


# ---- the small steps between products (one call each instead of several numpy passes) ------------------
GELU_C = np.float32(0.7978845608028654)  # sqrt(2 / pi)


@njit(fastmath=SAFE_FAST, cache=True, inline="always")
def _norm_row(x, w, eps, out):
    ms = F32(0)
    for j in range(x.shape[0]):
        ms += x[j] * x[j]
    r = F32(1) / np.sqrt(ms / F32(x.shape[0]) + eps)
    for j in range(x.shape[0]):
        out[j] = x[j] * r * w[j]


@njit(fastmath=SAFE_FAST, cache=True)
def rms_norm_rows(x, w, eps, out):
    """out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w for each row of x [R, E]."""
    for i in range(x.shape[0]):
        _norm_row(x[i], w, eps, out[i])


@njit(fastmath=SAFE_FAST, cache=True)
def add_rms_norm_rows(x, y, w_post, has_post, w_next, eps, x_out, h_out):
    """x_out = x + (rms_norm(y) * w_post, or y); h_out = rms_norm(x_out) * w_next (rows of [R, E])."""
    for i in range(x.shape[0]):
        xo = x_out[i]
        if has_post:
            _norm_row(y[i], w_post, eps, xo)
            for j in range(xo.shape[0]):
                xo[j] += x[i, j]
        else:
            for j in range(xo.shape[0]):
                xo[j] = x[i, j] + y[i, j]
        _norm_row(xo, w_next, eps, h_out[i])


@njit(fastmath=SAFE_FAST, cache=True, inline="always")
def _rope_row(src, norm, has_norm, eps, cos_t, sin_t, neox, out):
    """One head [D]: RMS-normalised with `norm` if has_norm, then rotated (first 2 * len(cos_t) dims)."""
    if has_norm:
        _norm_row(src, norm, eps, out)
    else:
        for j in range(src.shape[0]):
            out[j] = src[j]
    half = cos_t.shape[0]
    for i in range(half):
        ia, ib = (i, i + half) if neox else (2 * i, 2 * i + 1)
        a = out[ia]
        b = out[ib]
        out[ia] = a * cos_t[i] - b * sin_t[i]
        out[ib] = b * cos_t[i] + a * sin_t[i]


@njit(fastmath=SAFE_FAST, cache=True)
def qk_norm_rope(q, k, q_norm, k_norm, has_norm, cos, sin, neox, eps, q_out, k_out):
    """q [T, H * D], k [T, Hkv * D] -> q_out [T, H, D], k_out [T, Hkv, D]: each head normalised (gemma3)
    and rotated by the tables cos, sin [T, rope_dim / 2] (neox: rotate-half, else interleaved pairs)."""
    d = q_out.shape[2]
    for t in range(q.shape[0]):
        for h in range(q_out.shape[1]):
            _rope_row(q[t, h * d : (h + 1) * d], q_norm, has_norm, eps, cos[t], sin[t], neox, q_out[t, h])
        for h in range(k_out.shape[1]):
            _rope_row(k[t, h * d : (h + 1) * d], k_norm, has_norm, eps, cos[t], sin[t], neox, k_out[t, h])


@njit(fastmath=SAFE_FAST, cache=True)
def gated_activation(gate_up, gelu, out):
    """out = act(gate) * up for gate_up = [gate | up] [T, 2F]: silu, or gelu (tanh form) with gelu."""
    n_ff = out.shape[1]
    for t in range(out.shape[0]):
        for j in range(n_ff):
            g = gate_up[t, j]
            if gelu:
                a = F32(0.5) * g * (F32(1) + np.tanh(GELU_C * (g + F32(0.044715) * g * g * g)))
            else:
                a = g / (F32(1) + np.exp(-g))
            out[t, j] = a * gate_up[t, n_ff + j]
