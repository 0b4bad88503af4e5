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
from numba.core.imputils import impl_ret_borrowed
from numba.extending import intrinsic
from numba.np.arrayobj import make_array, populate_array

F32 = np.float32
# OpenMP (GNU libgomp) before numba's workqueue, whose sleeping threads take ~100 us to start each parallel
# region. libgomp's threads spin between regions for as long as `--poll` says (`threads.set_poll`).
if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]  # type: ignore[attr-defined]  # set at run time
# fastmath without nnan / ninf: attention compares scores with -inf.
SAFE_FAST = {"reassoc", "contract", "arcp", "nsz"}


def _target_has_avx512() -> bool:
    """Whether numba compiles for AVX-512 (32 vector registers): the host's features, or NUMBA_CPU_FEATURES
    where set (as numba's own code generator decides)."""
    from llvmlite import binding

    features = numba.config.CPU_FEATURES  # type: ignore[attr-defined]  # numba.config's options are set at run time
    if features is not None:
        return "+avx512f" in features.split(",")
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
# across blocks), 2x slower.

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
        q = builder.sitofp(
            _load_vector(builder, values, offset_q, ir.IntType(8), block), ir.VectorType(_F32, block)
        )
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
                context.make_array(t)(context, builder, a)
                for t, a in zip(signature.args[:5], args[:5], strict=True)
            )
            lanes = _lanes(nibbles, n)
            vf = ir.VectorType(_F32, lanes)
            fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fma.v{lanes}f32"
            )
            fma1 = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_F32, [_F32] * 3), "llvm.fma.f32"
            )

            def one_block(b, acc, macc):
                offset_x = builder.mul(b, ir.Constant(_I64, n))
                offset_q = builder.mul(b, ir.Constant(_I64, n // 2 if nibbles else n))
                prod = _block_products(builder, q_arr.data, x_arr.data, offset_q, offset_x, nibbles, n)
                acc = builder.call(
                    fma, [prod, _splat(builder, _scale_at(builder, s_arr, b, half), lanes), acc]
                )
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
            acc0, acc1, macc0, macc1 = _counted_loop(
                builder, pairs, block_pair, [zero_v, zero_v, zero_s, zero_s]
            )
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
# row at a time; 3 or 4 rows spill), no pairs. bench/engine/DECISIONS.md "Multi-row float32 products".
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
            fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fma.v{lanes}f32"
            )
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
                    _row_ptr(builder, x_arr, builder.add(r0_val, ir.Constant(_I64, r)), _F32)
                    for r in range(n_rows)
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
                    out = list(
                        accs
                    )  # accumulator (r * n_w + i) * n_acc + c: token row r, weight row i, chunk c
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
            acc = (
                row_dot_min(row, xr, sc, mn, xs, 32) if block == 32 else row_dot_min(row, xr, sc, mn, xs, 16)
            )
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
def matmul_packed(x, xsum, values, scale, mins, has_min, block, by_row, pairs, y):
    """y = x W^T for a packed weight, weight rows over all threads: a token row at a time (by_row:
    `row_dot`, plus min * sum(x) per block where it has mins, xsum [M, K / block]) or each block of a tile
    of weight rows decoded once for a group of token rows (`rows_dot`; pairs of weight rows from PAIR_MIN_ROWS
    token rows where `pairs`, else one: the same bits whatever the token rows; xsum read only for the rows past
    the last full tile). One kernel for both: warming one warms both."""
    if by_row:
        for n in prange(values.shape[0]):
            _matmul_row(x, xsum, values, scale, mins, has_min, block, y, n)
    else:
        tile = _weight_tile(x.shape[0]) if pairs else 1
        full = values.shape[0] // tile
        for t in prange(full):
            _matmul_rows(x, values, scale, mins, has_min, block, y, t * tile, tile)
        # past the last full tile, a row at a time (apart: inlined in the loop above it slowed that 1.4x)
        for n in range(full * tile, values.shape[0]):
            _matmul_row(x, xsum, values, scale, mins, has_min, block, y, n)


@njit(fastmath=True, cache=True)
def matmul_packed_serial(x, xsum, values, scale, mins, has_min, block, by_row, pairs, y):
    """`matmul_packed` on the calling thread (a product too small to be worth a parallel region)."""
    if by_row:
        for n in range(values.shape[0]):
            _matmul_row(x, xsum, values, scale, mins, has_min, block, y, n)
    else:
        tile = _weight_tile(x.shape[0]) if pairs else 1
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
# A work item is one range of key positions (a split) for every K/V head, read a tile of keys at a time:
# the pool's rows are token-major [slots, Hkv, D], so a tile's rows of every head are read while they are
# in cache (one head's pass over all keys strides through 1 / Hkv of each row: 3x slower for SmolLM2 at
# 4,096 held). Per head and block of query rows: scores by `key_dots`, a softmax with `fast_exp`, the
# weighted sum of values by `value_sums` (LLVM vector IR: a block's accumulators stay in registers). Keys
# and values are read as stored (f16 bits, int8 with per-block scales, f32) and converted in registers,
# never into a float32 copy. Every output element is a sum in key order, so the blocks, the tiles and a
# ring's runs give the same bits wherever the rows lie. With AVX-512 (`_AVX512`: 32 registers of 16
# float32) a vector is one register, else two AVX2 ones; the register blocks are sized for 32 or 16.
_HEAD_DIMS = (32, 64, 96, 128, 256)  # head sizes the IR is generated for (others: a plain loop)
_VEC = 16 if _AVX512 else 8  # float32 lanes of one register
_KEY_TILE = 32  # keys per tile: every head's rows of a tile (16 KiB of f16 at Hkv x D = 256) stay in L1
_DOT_ROWS = 4  # query rows per `key_dots` block
# Query rows per `value_sums` call for a prompt chunk's many rows, in column blocks where their accumulators would
# not fit the registers: each value row read once per four rows (gemma3's 256-wide heads: x1.28). A decode step's
# few rows stream whole value rows from memory, one row a call there (x1.1 over column blocks; bench/engine/DECISIONS.md "Prompt chunks").
_SUM_ROWS = 4
_PREFETCH_KEYS = (
    32  # keys ahead whose rows the kernels prefetch (the hardware's prefetch misses strided rows)
)
# Software prefetches go to L2, not L1 (prefetcht1: LLVM's locality 2): a batched step's attention from memory
# x1.2-1.3 over prefetcht0, whose misses hold the L1's few fill buffers (bench/engine/DECISIONS.md "Decode attention").
PREFETCH_LOCALITY = 2
_PREFETCH_LINES = 8  # 64-byte lines of a stored row prefetched at most (512 bytes: f16 rows of 256 values)
# Value sums: the accumulators (registers) a block of query rows keeps over the loop: whole value rows
# where they fit (D / lanes per row: the rows stream in address order, 1.2x faster from memory than
# column blocks of a row, bench/engine/DECISIONS.md "Decode attention"), else column blocks of every row of the block.
_SUM_ACC = 16 if _AVX512 else 8


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
    return y * f32_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))


def _row_ptr(builder, arr, index, elem):
    """Pointer to row `index` of a 2-D array (any strides) as elem*."""
    stride = builder.extract_value(arr.strides, 0)
    raw = builder.gep(builder.bitcast(arr.data, ir.IntType(8).as_pointer()), [builder.mul(index, stride)])
    return builder.bitcast(raw, elem.as_pointer())


def _stored_chunk(builder, row, scale_row, c, dtype):
    """Values [Lc, Lc + L) of a stored K/V row as <L x float>, L = _VEC (int8 times its 32-value block's scale)."""
    vf = ir.VectorType(_F32, _VEC)
    off = ir.Constant(_I64, c * _VEC)
    if dtype == types.uint16:
        bits = _load_vector(builder, row, off, ir.IntType(16), _VEC)
        return builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), _VEC)), vf)
    if dtype == types.float32:
        return _load_vector(builder, row, off, _F32, _VEC)
    q = builder.sitofp(_load_vector(builder, row, off, ir.IntType(8), _VEC), vf)
    scale = builder.load(builder.gep(scale_row, [ir.Constant(_I64, c * _VEC // 32)]))
    return builder.fmul(q, _splat(builder, scale, _VEC), flags=EXACT)  # rounded as the decoded copy


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


def _prefetch_row(builder, arr, index, elem):
    """Prefetch row `index` of a 2-D array (a head's view of the stored rows) into the cache over the row stride
    (up to _PREFETCH_LINES 64-byte lines): the whole stored row, every head (x1.13 on a batched step's attention
    over prefetching the head's own part: bench/engine/DECISIONS.md), _PREFETCH_KEYS keys ahead of the one being read.
    Unrolled, the lines past a shorter row clamped to its last (a loop over the stride cost ~35 instructions a key)."""
    fn = cgutils.get_or_insert_function(
        builder.module,
        ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), _I32, _I32, _I32]),
        "llvm.prefetch",
    )
    row = builder.bitcast(_row_ptr(builder, arr, index, elem), ir.IntType(8).as_pointer())
    last = builder.sub(builder.extract_value(arr.strides, 0), ir.Constant(_I64, 1))
    for j in range(_PREFETCH_LINES):
        off = ir.Constant(_I64, 64 * j)
        if j:
            off = builder.select(builder.icmp_signed("<", off, last), off, last)
        builder.call(fn, [builder.gep(row, [off]), ir.Constant(_I32, 0), ir.Constant(_I32, PREFETCH_LOCALITY),
                          ir.Constant(_I32, 1)])  # fmt: skip


def _kv_intrinsic_args(context, builder, signature, args):
    return [
        context.make_array(t)(context, builder, a) for t, a in zip(signature.args[:3], args[:3], strict=True)
    ]


_ELEM = {types.uint16: ir.IntType(16), types.float32: _F32, types.int8: ir.IntType(8)}


def _fma(builder):
    vf = ir.VectorType(_F32, _VEC)
    return cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fma.v{_VEC}f32"
    )


def _literal(value, allowed) -> bool:
    return isinstance(value, types.IntegerLiteral) and value.literal_value in allowed


@intrinsic
def key_dots(typingctx, q, keys, scales, lo, n, out, d, rows):
    """out[r, i] = q[r] . keys[lo + i] for the first `rows` (a literal, <= _DOT_ROWS) rows r of q [R, D]
    (float32) and i < n: each key row is read and converted once for all of them, key after key (folding
    several keys' sums together saves shuffles but interleaves their rows' loads: 1.15x slower from
    memory); keys a stored head's rows [slots, D] (uint16 f16 bits, float32, or int8 with `scales`
    [slots, D / 32]); out float32 [>= rows, >= n] (any strides); d the literal D."""
    if not _literal(d, _HEAD_DIMS) or not _literal(rows, range(1, _DOT_ROWS + 1)) or keys.dtype not in _ELEM:
        return None
    sig = types.void(q, keys, scales, lo, n, out, d, rows)

    def codegen(context, builder, signature, args):
        q_arr, k_arr, s_arr = _kv_intrinsic_args(context, builder, signature, args)
        out_arr = context.make_array(signature.args[5])(context, builder, args[5])
        chunks, n_rows = d.literal_value // _VEC, rows.literal_value
        fma = _fma(builder)
        q_rows = [_row_ptr(builder, q_arr, ir.Constant(_I64, r), _F32) for r in range(n_rows)]
        out_rows = [builder.bitcast(_row_ptr(builder, out_arr, ir.Constant(_I64, r), _F32), ir.IntType(8).as_pointer())
                    for r in range(n_rows)]  # fmt: skip
        out_step = builder.extract_value(out_arr.strides, 1)
        # loaded once: out may alias q as far as LLVM knows, so loads in the loop would follow every store
        q_vecs = [
            [_load_vector(builder, q_rows[r], ir.Constant(_I64, c * _VEC), _F32, _VEC) for c in range(chunks)]
            for r in range(n_rows)
        ]

        def key(i, carried):
            idx = builder.add(args[3], i)
            row = _row_ptr(builder, k_arr, idx, _ELEM[keys.dtype])
            scale_row = _row_ptr(builder, s_arr, idx, _F32)
            if _PREFETCH_KEYS:
                ahead = builder.add(idx, ir.Constant(_I64, _PREFETCH_KEYS))
                _prefetch_row(builder, k_arr, ahead, _ELEM[keys.dtype])
            acc = [ir.Constant(ir.VectorType(_F32, _VEC), [0.0] * _VEC)] * n_rows
            for c in range(chunks):
                kc = _stored_chunk(builder, row, scale_row, c, keys.dtype)
                acc = [builder.call(fma, [q_vecs[r][c], kc, acc[r]]) for r in range(n_rows)]
            at = builder.mul(i, out_step)
            for r in range(n_rows):
                ptr = builder.bitcast(builder.gep(out_rows[r], [at]), _F32.as_pointer())
                builder.store(_hsum(builder, acc[r]), ptr)
            return []

        _counted_loop(builder, args[4], key, [])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def value_sums(typingctx, acc, weights, values, scales, lo, n, d, rows):
    """acc[r] += sum_i weights[r, i] * values[lo + i] for i < n and the first `rows` (a literal, 1-4) rows
    of acc [R, D] (C order rows) and weights [R, >= n] (unit stride along keys): each value row is read
    and converted once per block of columns (the whole row where rows x D / lanes <= _SUM_ACC), whose
    accumulators stay in registers over the loop; values as in `key_dots`."""
    if not _literal(d, _HEAD_DIMS) or not _literal(rows, range(1, 5)) or values.dtype not in _ELEM:
        return None
    sig = types.void(acc, weights, values, scales, lo, n, d, rows)

    def codegen(context, builder, signature, args):
        acc_arr, w_arr, v_arr = _kv_intrinsic_args(context, builder, signature, args)
        s_arr = context.make_array(signature.args[3])(context, builder, args[3])
        n_rows = rows.literal_value
        chunks = d.literal_value // _VEC
        # chunks per column block: the most the accumulators allow that divides the row (96 = 6 chunks: 3 or 2)
        width = max(w for w in range(1, max(1, min(chunks, _SUM_ACC // n_rows)) + 1) if chunks % w == 0)
        fma = _fma(builder)
        acc_rows = [_row_ptr(builder, acc_arr, ir.Constant(_I64, r), _F32) for r in range(n_rows)]
        w_rows = [_row_ptr(builder, w_arr, ir.Constant(_I64, r), _F32) for r in range(n_rows)]
        for c0 in range(0, chunks, width):
            start = [
                _load_vector(builder, acc_rows[r], ir.Constant(_I64, (c0 + c) * _VEC), _F32, _VEC)
                for r in range(n_rows)
                for c in range(width)
            ]

            def body(i, carried, c0=c0):
                idx = builder.add(args[4], i)
                row = _row_ptr(builder, v_arr, idx, _ELEM[values.dtype])
                if c0 == 0 and _PREFETCH_KEYS:
                    ahead = builder.add(idx, ir.Constant(_I64, _PREFETCH_KEYS))
                    _prefetch_row(builder, v_arr, ahead, _ELEM[values.dtype])
                scale_row = _row_ptr(builder, s_arr, idx, _F32)
                vc = [_stored_chunk(builder, row, scale_row, c0 + c, values.dtype) for c in range(width)]
                out = []
                for r in range(n_rows):
                    w = _splat(builder, builder.load(builder.gep(w_rows[r], [i])), _VEC)
                    out += [builder.call(fma, [vc[c], w, carried[r * width + c]]) for c in range(width)]
                return out

            final = _counted_loop(builder, args[5], body, start)
            for r in range(n_rows):
                for c in range(width):
                    ptr = builder.gep(acc_rows[r], [ir.Constant(_I64, (c0 + c) * _VEC)])
                    builder.store(
                        final[r * width + c],
                        builder.bitcast(ptr, ir.VectorType(_F32, _VEC).as_pointer()),
                        align=1,
                    )
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def decoded(typingctx, value, scale):
    """A stored K/V element as the decoded copy holds it, widen(value) * scale, rounded as written (the
    kernel's fastmath would let LLVM fold the scale into the product it feeds): for the plain loops."""
    if value not in _ELEM:
        return None

    def codegen(context, builder, sig, args):
        x = args[0]
        if value == types.uint16:
            x = builder.fpext(builder.bitcast(x, ir.HalfType()), _F32)
        elif value == types.int8:
            x = builder.sitofp(x, _F32)
        return builder.fmul(x, args[1], flags=EXACT)

    return types.float32(value, types.float32), codegen


@njit(fastmath=SAFE_FAST, cache=True, inline="always")
def _dots_block(q, keys, scales, lo, n, out, b):
    """`key_dots` of the first b (1-4) rows, dispatched on the literal head size and row count."""
    d = q.shape[1]
    if d == 32:
        if b == 4:
            key_dots(q, keys, scales, lo, n, out, 32, 4)
        elif b == 3:
            key_dots(q, keys, scales, lo, n, out, 32, 3)
        elif b == 2:
            key_dots(q, keys, scales, lo, n, out, 32, 2)
        else:
            key_dots(q, keys, scales, lo, n, out, 32, 1)
    elif d == 64:
        if b == 4:
            key_dots(q, keys, scales, lo, n, out, 64, 4)
        elif b == 3:
            key_dots(q, keys, scales, lo, n, out, 64, 3)
        elif b == 2:
            key_dots(q, keys, scales, lo, n, out, 64, 2)
        else:
            key_dots(q, keys, scales, lo, n, out, 64, 1)
    elif d == 96:
        if b == 4:
            key_dots(q, keys, scales, lo, n, out, 96, 4)
        elif b == 3:
            key_dots(q, keys, scales, lo, n, out, 96, 3)
        elif b == 2:
            key_dots(q, keys, scales, lo, n, out, 96, 2)
        else:
            key_dots(q, keys, scales, lo, n, out, 96, 1)
    elif d == 128:
        if b == 4:
            key_dots(q, keys, scales, lo, n, out, 128, 4)
        elif b == 3:
            key_dots(q, keys, scales, lo, n, out, 128, 3)
        elif b == 2:
            key_dots(q, keys, scales, lo, n, out, 128, 2)
        else:
            key_dots(q, keys, scales, lo, n, out, 128, 1)
    elif b == 4:
        key_dots(q, keys, scales, lo, n, out, 256, 4)
    elif b == 3:
        key_dots(q, keys, scales, lo, n, out, 256, 3)
    elif b == 2:
        key_dots(q, keys, scales, lo, n, out, 256, 2)
    else:
        key_dots(q, keys, scales, lo, n, out, 256, 1)


@njit(fastmath=SAFE_FAST, cache=True, inline="always")
def _sums_block(acc, weights, values, scales, lo, n, b):
    """`value_sums` of the first b (1-4) rows, dispatched on the literal head size and row count."""
    d = acc.shape[1]
    if d == 32:
        if b == 4:
            value_sums(acc, weights, values, scales, lo, n, 32, 4)
        elif b == 3:
            value_sums(acc, weights, values, scales, lo, n, 32, 3)
        elif b == 2:
            value_sums(acc, weights, values, scales, lo, n, 32, 2)
        else:
            value_sums(acc, weights, values, scales, lo, n, 32, 1)
    elif d == 64:
        if b == 4:
            value_sums(acc, weights, values, scales, lo, n, 64, 4)
        elif b == 3:
            value_sums(acc, weights, values, scales, lo, n, 64, 3)
        elif b == 2:
            value_sums(acc, weights, values, scales, lo, n, 64, 2)
        else:
            value_sums(acc, weights, values, scales, lo, n, 64, 1)
    elif d == 96:
        if b == 4:
            value_sums(acc, weights, values, scales, lo, n, 96, 4)
        elif b == 3:
            value_sums(acc, weights, values, scales, lo, n, 96, 3)
        elif b == 2:
            value_sums(acc, weights, values, scales, lo, n, 96, 2)
        else:
            value_sums(acc, weights, values, scales, lo, n, 96, 1)
    elif d == 128:
        if b == 4:
            value_sums(acc, weights, values, scales, lo, n, 128, 4)
        elif b == 3:
            value_sums(acc, weights, values, scales, lo, n, 128, 3)
        elif b == 2:
            value_sums(acc, weights, values, scales, lo, n, 128, 2)
        else:
            value_sums(acc, weights, values, scales, lo, n, 128, 1)
    elif b == 4:
        value_sums(acc, weights, values, scales, lo, n, 256, 4)
    elif b == 3:
        value_sums(acc, weights, values, scales, lo, n, 256, 3)
    elif b == 2:
        value_sums(acc, weights, values, scales, lo, n, 256, 2)
    else:
        value_sums(acc, weights, values, scales, lo, n, 256, 1)


@intrinsic
def mul_add(typingctx, acc, a, b):
    """acc + a * b (float32), rounded as written: the kernels' fastmath would let LLVM reorder a plain loop's
    sum differently for each storage type."""
    if not all(t == types.float32 for t in (acc, a, b)):
        return None

    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], builder.fmul(args[1], args[2], flags=EXACT), flags=EXACT)

    return types.float32(acc, a, b), codegen


@intrinsic
def row_sum(typingctx, row):
    """sum(row) of a contiguous float32 row in one fixed order (16-lane partial sums, `_hsum`, then the tail in
    order): a fastmath loop's sum is vectorized in whatever order LLVM picks for each compiled kernel, and
    the kernels for f16, int8 and float32 storage must round alike."""
    if not (
        isinstance(row, types.Array) and row.ndim == 1 and row.dtype == types.float32 and row.layout == "C"
    ):
        return None

    def codegen(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        n = builder.extract_value(arr.shape, 0)
        vf = ir.VectorType(_F32, 16)
        chunks = builder.udiv(n, ir.Constant(_I64, 16))

        def chunk(i, carried):
            v = _load_vector(builder, arr.data, builder.mul(i, ir.Constant(_I64, 16)), _F32, 16)
            return [builder.fadd(carried[0], v, flags=EXACT)]

        (acc,) = _counted_loop(builder, chunks, chunk, [ir.Constant(vf, [0.0] * 16)])
        done = builder.mul(chunks, ir.Constant(_I64, 16))

        def tail(i, carried):
            x = builder.load(builder.gep(arr.data, [builder.add(done, i)]))
            return [builder.fadd(carried[0], x, flags=EXACT)]

        (total,) = _counted_loop(builder, builder.sub(n, done), tail, [_hsum(builder, acc)])
        return total

    return types.float32(row), codegen


@njit(fastmath=SAFE_FAST, cache=True, inline="always")
def _plain_dots(q, keys, scales, has_scales, lo, n, out):
    for r in range(q.shape[0]):
        for i in range(n):
            s = F32(0)
            for j in range(q.shape[1]):
                s = mul_add(
                    s, q[r, j], decoded(keys[lo + i, j], scales[lo + i, j // 32] if has_scales else F32(1))
                )
            out[r, i] = s


@njit(fastmath=SAFE_FAST, cache=True, inline="always")
def _plain_sums(acc, weights, values, scales, has_scales, lo, n):
    for r in range(acc.shape[0]):
        for i in range(n):
            wi = weights[r, i]
            for j in range(acc.shape[1]):
                v = decoded(values[lo + i, j], scales[lo + i, j // 32] if has_scales else F32(1))
                acc[r, j] = mul_add(acc[r, j], wi, v)


@njit(fastmath=SAFE_FAST, cache=True, inline="always")
def _dots(q, keys, scales, has_scales, lo, n, out):
    """out[r, :n] = q[r] . keys[lo + i] for every row r of q (blocks of `key_dots`, or a plain loop for
    other head sizes)."""
    d = q.shape[1]
    if d == 32 or d == 64 or d == 96 or d == 128 or d == 256:
        for r in range(0, q.shape[0], _DOT_ROWS):
            _dots_block(q[r:], keys, scales, lo, n, out[r:], min(_DOT_ROWS, q.shape[0] - r))
        return
    _plain_dots(q, keys, scales, has_scales, lo, n, out)


@njit(fastmath=SAFE_FAST, cache=True, inline="always")
def _sums(acc, weights, values, scales, has_scales, lo, n):
    """acc[r] += sum_i weights[r, i] values[lo + i] (`value_sums` on blocks of rows, or a plain loop for
    other head sizes)."""
    d = acc.shape[1]
    if d == 32 or d == 64 or d == 96 or d == 128 or d == 256:
        block = _SUM_ROWS if acc.shape[0] > _SUM_ROWS else max(1, min(4, _SUM_ACC // (d // _VEC)))
        for r in range(0, acc.shape[0], block):
            _sums_block(acc[r:], weights[r:], values, scales, lo, n, min(block, acc.shape[0] - r))
        return
    _plain_sums(acc, weights, values, scales, has_scales, lo, n)


@njit(fastmath=SAFE_FAST, cache=True, inline="always")
def _row_max(s):
    """max(s) of a non-empty row, in eight running maxima (one is a chain of dependent compares)."""
    n = s.shape[0]
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = s[0]
    i = 0
    while i + 8 <= n:
        m0, m1, m2, m3 = max(m0, s[i]), max(m1, s[i + 1]), max(m2, s[i + 2]), max(m3, s[i + 3])
        m4, m5, m6, m7 = max(m4, s[i + 4]), max(m5, s[i + 5]), max(m6, s[i + 6]), max(m7, s[i + 7])
        i += 8
    while i < n:
        m0 = max(m0, s[i])
        i += 1
    return max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))


@njit(fastmath=SAFE_FAST, cache=True)
def _soft_cap(s, cap):
    """s -> cap * tanh(s / cap) in place over scores [Hkv, rows, keys] (gemma2's attention logit soft-cap)."""
    inv = F32(1) / cap
    for h in range(s.shape[0]):
        for r in range(s.shape[1]):
            row = s[h, r]
            for i in range(row.shape[0]):
                row[i] = cap * np.tanh(row[i] * inv)


@njit(fastmath=SAFE_FAST, cache=True, inline="always")
def _slot_run(p, end, base, capacity):
    """The slot of position p and how many positions from p (before `end`) lie in consecutive slots."""
    if capacity <= 0:
        return p - base, end - p
    slot = p % capacity
    return slot, min(end - p, capacity - slot)


# Keys per attention split, cut at multiples of it in positions: a query's arithmetic never depends on the batch,
# the chunk or the thread count (one split cost ~1 % of a 64-key decode step's attention over splits of the span).
ATTN_SPLIT_KEYS = 64


@njit(cache=True, inline="always")
def split_count(k_lo, k_hi):
    """The attention splits of keys [k_lo, k_hi) (`_attention_split`)."""
    return max(1, (k_hi + ATTN_SPLIT_KEYS - 1) // ATTN_SPLIT_KEYS - k_lo // ATTN_SPLIT_KEYS)


_I = (
    np.int64
)  # the kernels pass _attention_split int64s alike (a literal or a prange index would compile another)


@njit(
    fastmath=SAFE_FAST, cache=True
)  # one compiled body for the four kernels: inlined into each, +25 s at first start
def _attention_split(
    sp, q, k, v, k_scale, v_scale, has_scales, n_tok, q_pos0, k_lo, base, capacity, window, softcap, acc, m_out,
    l_out,
):  # fmt: skip
    """Split sp of [k_lo, q_pos0 + T) cut at multiples of ATTN_SPLIT_KEYS positions (`split_count` of them),
    every K/V head: per row r of q [Hkv, T * G, D] (token r // G), the max m_out of its visible scores
    (soft-capped by `softcap` > 0 first), the sum l_out of exp(s - m) and acc = sum exp(s - m) v, merged by
    `_merge`. The cuts sit at fixed positions, so a query's partials are the same bits whatever else the call
    attends (batch-invariant)."""
    n_kv, rows, d = q.shape
    group = rows // n_tok
    k_hi = q_pos0 + n_tok
    cut = (k_lo // ATTN_SPLIT_KEYS + sp) * ATTN_SPLIT_KEYS
    s_lo = max(k_lo, cut)
    s_hi = min(k_hi, cut + ATTN_SPLIT_KEYS)
    first = s_lo if window <= 0 else max(s_lo, q_pos0 - window + 1)  # the rows' key ranges together
    a = acc[sp]
    a[:] = 0
    m_out[sp] = -np.inf
    l_out[sp] = 0
    if s_hi <= first:
        return
    n = s_hi - first
    # rows 64 bytes longer than n: at a power-of-2 length they would share L1 sets and evict each other
    scores = np.empty((n_kv, rows, n + 16), dtype=F32)
    for t0 in range(first, s_hi, _KEY_TILE):  # a tile's rows of every head while they are in cache
        t1 = min(s_hi, t0 + _KEY_TILE)
        p = t0
        while p < t1:  # slot runs: one, or two where a ring wraps
            slot, run = _slot_run(p, t1, base, capacity)
            for hk in range(n_kv):
                ks = k_scale[:, min(hk, k_scale.shape[1] - 1)]
                _dots(q[hk], k[:, hk], ks, has_scales, slot, run, scores[hk, :, p - first :])
            p += run
    if softcap > 0:  # one branch a split, outside the row loop: without a cap, the loops are as they were
        _soft_cap(scores[:, :, :n], softcap)
    for hk in range(n_kv):
        for r in range(rows):  # softmax over the row's visible keys; the others weigh 0
            qp = q_pos0 + r // group
            lo = first if window <= 0 else max(first, qp - window + 1)
            hi = min(s_hi, qp + 1)
            sg = scores[hk, r]
            if hi <= lo:
                sg[:] = 0
                continue
            sg[: lo - first] = 0
            sg[hi - first :] = 0
            seen = sg[
                lo - first : hi - first
            ]  # indexed from 0: numba's index wrap-around check then folds away
            top = _row_max(seen)
            for i in range(seen.shape[0]):  # vectorized
                seen[i] = fast_exp(seen[i] - top)
            m_out[sp, hk, r] = top
            l_out[sp, hk, r] = row_sum(seen)
    for t0 in range(first, s_hi, _KEY_TILE):
        t1 = min(s_hi, t0 + _KEY_TILE)
        p = t0
        while p < t1:
            slot, run = _slot_run(p, t1, base, capacity)
            for hk in range(n_kv):
                vs = v_scale[:, min(hk, v_scale.shape[1] - 1)]
                _sums(a[hk], scores[hk, :, p - first :], v[:, hk], vs, has_scales, slot, run)
            p += run


@njit(fastmath=SAFE_FAST, cache=True, inline="always")
def _grouped_queries(q, n_kv, scale):
    """q [T, H, D] times the softmax scale as [Hkv, T * G, D]: a K/V head's query rows, token-major."""
    n_tok, n_head, d = q.shape
    group = n_head // n_kv
    out = np.empty((n_kv, n_tok * group, d), dtype=F32)
    for hk in range(n_kv):
        for t in range(n_tok):
            for g in range(group):
                for j in range(d):
                    out[hk, t * group + g, j] = q[t, hk * group + g, j] * scale
    return out


@njit(parallel=True, fastmath=SAFE_FAST, cache=True)
def online_softmax_step(s, m, l_sum, acc):
    """One key block of `attention_tiling.blocked_attention`'s online softmax, a pass over its scores instead
    of numpy's six: per row r of s [R, B] (masked keys -inf), m' = max(m[r], max s[r]); s[r] = e^(s[r] - m')
    (0 where masked); l[r] = l[r] e^(m - m') + sum s[r]; acc[r] *= e^(m - m'); m[r] = m'. A row with no
    visible key yet keeps m = -inf (its scores shifted by 0). m, l_sum [R], acc [R, D], all float32."""
    for r in prange(s.shape[0]):
        row = s[r]
        top = max(m[r], _row_max(row))
        shift = top if top != -np.inf else F32(0)
        for j in range(row.shape[0]):  # vectorized
            x = row[j]
            row[j] = fast_exp(x - shift) if x != -np.inf else F32(0)
        c = np.exp(m[r] - shift)
        l_sum[r] = l_sum[r] * c + row_sum(row)
        for j in range(acc.shape[1]):
            acc[r, j] *= c
        m[r] = top


@njit(fastmath=SAFE_FAST, cache=True, inline="always")
def _merge(acc, m_in, l_in, n_tok, out):
    """out [T, H * D] from the splits' partials: sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M)."""
    n_split, n_kv, rows, d = acc.shape
    group = rows // n_tok
    for hk in range(n_kv):
        for r in range(rows):
            t, g = r // group, r % group
            top = F32(-np.inf)
            for sp in range(n_split):
                top = max(top, m_in[sp, hk, r])
            o = out[t, (hk * group + g) * d : (hk * group + g + 1) * d]
            o[:] = 0
            total = F32(0)
            for sp in range(n_split):
                if m_in[sp, hk, r] == -np.inf:
                    continue
                w = F32(np.exp(m_in[sp, hk, r] - top))
                total = mul_add(total, w, l_in[sp, hk, r])  # rounded as written, as the partials were
                part = acc[sp, hk, r]
                for j in range(d):
                    o[j] = mul_add(o[j], w, part[j])
            for j in range(d):
                o[j] /= total


@njit(parallel=True, fastmath=SAFE_FAST, cache=True)
def attention(
    q, scale, softcap, k, v, k_scale, v_scale, has_scales, q_pos0, k_lo, base, capacity, window, n_split, out
):
    """Causal (sliding-window) GQA attention of queries q [T, H, D] (times `scale`; scores soft-capped by
    softcap * tanh(s / softcap) where softcap > 0, a float32 like scale) over the keys at
    positions [k_lo, q_pos0 + T), read from storage k, v [slots, Hkv, D] (int8: with k_scale, v_scale
    [slots, Hkv, D / 32]) into out [T, H * D]: position p sits in slot p % capacity (a ring, capacity > 0)
    or p - base. A query at position p sees keys j <= p with p - j < window (window 0: no window). The keys
    are cut at multiples of ATTN_SPLIT_KEYS (n_split = `split_count(k_lo, q_pos0 + T)`), one work item each
    over all threads, merged at the end."""
    n_kv = k.shape[1]
    qs = _grouped_queries(q, n_kv, scale)
    rows, d = qs.shape[1], qs.shape[2]
    acc = np.empty((n_split, n_kv, rows, d), dtype=F32)
    m = np.empty((n_split, n_kv, rows), dtype=F32)
    l_sum = np.empty((n_split, n_kv, rows), dtype=F32)
    for sp in prange(n_split):
        _attention_split(
            _I(sp), qs, k, v, k_scale, v_scale, has_scales, q.shape[0], q_pos0, k_lo, base, capacity, window, softcap,
            acc, m, l_sum,
        )  # fmt: skip
    _merge(acc, m, l_sum, q.shape[0], out)


@njit(fastmath=SAFE_FAST, cache=True)
def attention_serial(
    q, scale, softcap, k, v, k_scale, v_scale, has_scales, q_pos0, k_lo, base, capacity, window, n_split, out
):
    """`attention` on the calling thread (too few keys to be worth a parallel region)."""
    n_kv = k.shape[1]
    qs = _grouped_queries(q, n_kv, scale)
    rows, d = qs.shape[1], qs.shape[2]
    acc = np.empty((n_split, n_kv, rows, d), dtype=F32)
    m = np.empty((n_split, n_kv, rows), dtype=F32)
    l_sum = np.empty((n_split, n_kv, rows), dtype=F32)
    for sp in range(n_split):
        _attention_split(
            _I(sp), qs, k, v, k_scale, v_scale, has_scales, q.shape[0], q_pos0, k_lo, base, capacity, window, softcap,
            acc, m, l_sum,
        )  # fmt: skip
    _merge(acc, m, l_sum, q.shape[0], out)


@njit(parallel=True, fastmath=SAFE_FAST, cache=True)
def attention_blocks(
    q, scale, softcap, k, v, k_scale, v_scale, has_scales, q_pos0, k_lo, base, capacity, window, block, out
):
    """`attention` of a prompt chunk: queries q [T, H, D] in blocks of `block` tokens, each block one work item
    over all threads (its tokens share every K/V read), its keys cut as a decode step's (`_attention_split`: the
    same bits a query gets alone). The blocks are taken in the order first, last, second, second last..., so each
    thread's contiguous share holds early and late (causal: cheap and costly) blocks alike."""
    n_tok, n_kv = q.shape[0], k.shape[1]
    n_blocks = (n_tok + block - 1) // block
    for i in prange(n_blocks):
        ib = i // 2 if i % 2 == 0 else n_blocks - 1 - i // 2
        t0 = ib * block
        t1 = min(n_tok, t0 + block)
        lo = k_lo if window <= 0 else max(k_lo, q_pos0 + t0 - window + 1)  # the block's first visible key
        n_split = split_count(lo, q_pos0 + t1)
        qs = _grouped_queries(q[t0:t1], n_kv, scale)
        acc = np.empty((n_split, n_kv, qs.shape[1], qs.shape[2]), dtype=F32)
        m = np.empty((n_split, n_kv, qs.shape[1]), dtype=F32)
        l_sum = np.empty((n_split, n_kv, qs.shape[1]), dtype=F32)
        for sp in range(n_split):
            _attention_split(
                _I(sp), qs, k, v, k_scale, v_scale, has_scales, t1 - t0, q_pos0 + t0, lo, base, capacity, window,
                softcap, acc, m, l_sum,
            )  # fmt: skip
        _merge(acc, m, l_sum, t1 - t0, out[t0:t1])


@njit(parallel=True, fastmath=SAFE_FAST, cache=True)
def attention_rows(
    q, scale, softcap, k, v, k_scale, v_scale, has_scales, slots, q_pos, k_lo, capacity, window, n_split, out
):
    """`attention` of a batched decode step: row b's query q[b] [H, D] at position q_pos[b] over keys
    [k_lo[b], q_pos[b]] of slot slots[b] of a layer's storage for every slot, k, v [n_slots, capacity, Hkv, D]
    (int8: k_scale, v_scale [n_slots, capacity, Hkv, D / 32]; position p at p % capacity in a ring, else at p),
    into out [B, H * D]. The work items, each row's key ranges cut as `attention`'s (n_split: the most any row
    has; a row's others are empty), run over all threads."""
    n_rows, n_kv = q.shape[0], k.shape[2]
    group, d = q.shape[1] // n_kv, q.shape[2]
    acc = np.empty((n_rows, n_split, n_kv, group, d), dtype=F32)
    m = np.empty((n_rows, n_split, n_kv, group), dtype=F32)
    l_sum = np.empty((n_rows, n_split, n_kv, group), dtype=F32)
    for item in prange(n_rows * n_split):
        b, sp = item // n_split, item % n_split
        qs = _grouped_queries(q[b : b + 1], n_kv, scale)
        at = slots[b] if has_scales else 0
        _attention_split(
            _I(sp), qs, k[slots[b]], v[slots[b]], k_scale[at], v_scale[at], has_scales, _I(1), q_pos[b], k_lo[b],
            _I(0), capacity, window, softcap, acc[b], m[b], l_sum[b],
        )  # fmt: skip
    for b in prange(n_rows):
        _merge(acc[b], m[b], l_sum[b], 1, out[b : b + 1])


# ---- the small steps between products (one call each instead of several numpy passes) ------------------
# On the calling thread, but the gated activation: over all threads for a prompt chunk (`parallel`), where it
# pays (bench/engine/DECISIONS.md "The steps between the products": the norms and RoPE over both threads measured within
# the noise of a prefill, and each parallel kernel adds seconds to numba's first compile).
GELU_C = np.float32(0.7978845608028654)  # sqrt(2 / pi)


@intrinsic
def row_span(typingctx, a, t, lo, n):
    """a[t, lo:lo + n] of a 2-D array whose rows are contiguous (its last stride the item size: the caller
    checks) as a C-contiguous 1-D view: a column view's row (a fused projection's q, k, v) typed 'A' would
    read element by element; typed 'C' its loops vectorize (3x faster for gemma3's qk_norm_rope)."""
    if not isinstance(a, types.Array) or a.ndim != 2:
        return None
    ret = types.Array(a.dtype, 1, "C")

    def codegen(context, builder, sig, args):
        arr = make_array(a)(context, builder, args[0])
        t_v, lo_v, n_v = (context.cast(builder, args[i], sig.args[i], types.int64) for i in (1, 2, 3))
        item = context.get_abi_sizeof(context.get_data_type(a.dtype))
        row_offset = builder.mul(t_v, builder.extract_value(arr.strides, 0))
        offset = builder.add(row_offset, builder.mul(lo_v, ir.Constant(_I64, item)))
        raw = builder.gep(builder.bitcast(arr.data, ir.IntType(8).as_pointer()), [offset])
        out = make_array(ret)(context, builder)
        populate_array(
            out, data=builder.bitcast(raw, arr.data.type), shape=cgutils.pack_array(builder, [n_v]),
            strides=cgutils.pack_array(builder, [ir.Constant(_I64, item)]), itemsize=arr.itemsize,
            meminfo=arr.meminfo, parent=arr.parent,
        )  # fmt: skip
        return impl_ret_borrowed(context, builder, ret, out._getvalue())

    return ret(a, t, lo, n), codegen


@intrinsic
def half_bits(typingctx, value):
    """float32 -> the bits (uint16) of the nearest f16, ties to even (`fptrunc`: vcvtps2ph where the CPU
    has it), as numpy's astype(float16) rounds; the inverse of `widen`."""
    if value != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(value), codegen


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
    if neox:
        for i in range(half):
            a = out[i]
            b = out[i + half]
            out[i] = a * cos_t[i] - b * sin_t[i]
            out[i + half] = b * cos_t[i] + a * sin_t[i]
    else:
        for i in range(half):
            a = out[2 * i]
            b = out[2 * i + 1]
            out[2 * i] = a * cos_t[i] - b * sin_t[i]
            out[2 * i + 1] = b * cos_t[i] + a * sin_t[i]


@njit(fastmath=SAFE_FAST, cache=True)
def qk_norm_rope(q, k, q_norm, k_norm, has_norm, cos, sin, neox, eps, q_out, k_out):
    """q [T, H * D], k [T, Hkv * D] (rows contiguous: read by `row_span`) -> q_out [T, H, D], k_out [T, Hkv, D]:
    each head normalised (gemma3) and rotated by the tables cos, sin [T, rope_dim / 2] (neox: rotate-half, else
    interleaved pairs)."""
    d = q_out.shape[2]
    for t in range(q.shape[0]):
        for h in range(q_out.shape[1]):
            _rope_row(row_span(q, t, h * d, d), q_norm, has_norm, eps, cos[t], sin[t], neox, q_out[t, h])
        for h in range(k_out.shape[1]):
            _rope_row(row_span(k, t, h * d, d), k_norm, has_norm, eps, cos[t], sin[t], neox, k_out[t, h])


@njit(fastmath=SAFE_FAST, cache=True, inline="always")
def _sigmoid(z):
    """1 / (1 + e^-z) from `fast_exp` of -|z| (never overflows): a loop of it vectorizes."""
    e = fast_exp(-abs(z))
    r = F32(1) / (F32(1) + e)
    return r if z >= F32(0) else e * r


@njit(fastmath=SAFE_FAST, cache=True, inline="always")
def _gated_row(gate_up, gelu, out):
    n_ff = out.shape[0]
    if gelu:  # 0.5 g (1 + tanh(u)) = g * sigmoid(2u)
        for j in range(n_ff):
            g = gate_up[j]
            out[j] = g * _sigmoid(F32(2) * GELU_C * (g + F32(0.044715) * g * g * g)) * gate_up[n_ff + j]
    else:
        for j in range(n_ff):
            g = gate_up[j]
            out[j] = g * _sigmoid(g) * gate_up[n_ff + j]


# error_model "numpy": numba's default checks every float division for zero (a branch that keeps the loop
# scalar: 10x slower); a prange body is compiled so already.
@njit(parallel=True, fastmath=SAFE_FAST, error_model="numpy", cache=True)
def gated_activation(gate_up, gelu, parallel, out):
    """out = act(gate) * up for gate_up = [gate | up] [T, 2F]: silu, or gelu (tanh form) with gelu."""
    if parallel:
        for t in prange(out.shape[0]):
            _gated_row(gate_up[t], gelu, out[t])
    else:
        for t in range(out.shape[0]):
            _gated_row(gate_up[t], gelu, out[t])


@njit(fastmath=SAFE_FAST, cache=True, inline="always")
def _store_f16_row(k, v, t, k_dst, v_dst):
    """Row t of k, v [T, Hkv * D] (rows contiguous) rounded to f16 into one stored position k_dst, v_dst
    [Hkv, D] (f16 bits: uint16)."""
    d = k_dst.shape[1]
    for h in range(k_dst.shape[0]):
        src_k, src_v = row_span(k, t, h * d, d), row_span(v, t, h * d, d)
        dst_k, dst_v = k_dst[h], v_dst[h]
        for j in range(d):
            dst_k[j] = half_bits(src_k[j])
            dst_v[j] = half_bits(src_v[j])


@njit(
    fastmath={"nnan", "ninf", "nsz"}, cache=True
)  # no reassoc or arcp: the divisions and the rounding are numpy's
def quantize_int8_blocks(x, group, q, scale):
    """`NumpyOps.quantize_int8` of x [N, D] float32 over blocks of `group` values of each row: scale[n, j] =
    max|block| / 127 and q = rint(block / scale) clipped to +-127 (an all-zero block: scale 0, q 0), into q [N, D]
    int8 and scale [N, D / group] float32, for finite x (one call instead of eight numpy passes: 5 us against 22
    for a batched step's [8, 3, 64])."""
    top = F32(127.0)
    for n in range(x.shape[0]):
        for j in range(x.shape[1] // group):
            block = x[n, j * group : (j + 1) * group]
            m = F32(0)
            for i in range(group):
                m = max(m, abs(block[i]))
            s = m / top
            scale[n, j] = s
            safe = s if s > 0 else F32(1)
            for i in range(group):
                q[n, j * group + i] = np.int8(min(top, max(-top, np.rint(block[i] / safe))))


@njit(fastmath=SAFE_FAST, cache=True)
def store_f16_rows(k, v, k_arena, v_arena, slots, positions):
    """A batched decode step's K/V: row b of k, v [B, Hkv * D] into position positions[b] of slot slots[b] of
    a layer's arena k_arena, v_arena [n_slots, capacity, Hkv, D] (uint16); one call instead of two casting
    fancy-index scatters (~9 us each a layer)."""
    for b in range(k.shape[0]):
        _store_f16_row(k, v, b, k_arena[slots[b], positions[b]], v_arena[slots[b], positions[b]])


@njit(fastmath=SAFE_FAST, cache=True)
def store_f16(k, v, k_pool, v_pool, first, capacity):
    """Rows t of k, v [T, Hkv * D] into slot first + t (modulo capacity when > 0) of the pools' storage
    k_pool, v_pool [slots, Hkv, D] (uint16)."""
    for t in range(k.shape[0]):
        slot = first + t
        if capacity > 0:
            slot %= capacity
        _store_f16_row(k, v, t, k_pool[slot], v_pool[slot])
