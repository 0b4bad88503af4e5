"""What integer dot products could give the packed products: a prototype, not engine code.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE NUMBA_NUM_THREADS=1 .venv/bin/python bench/probe_vnni.py

SmolLM2's 4-bit weights (Q4_1: nibble pairs, f16 scale and min) times activations quantized to int8 per
32-value block (as llama.cpp's Q8_1: x ~ dx * qx), with AVX512-VNNI's vpdpbusd (64 u8 x s8 products an
instruction; the machine must have avx512vnni), against the engine's float32 kernels (`row_dot` a token row at
a time, `rows_dot` a block decoded once for the rows) at 1 and 8 token rows, on one thread (CPU time, best of
6, the kernels taking turns), with the prototype's error relative to |x| @ |W|^T (the float32 kernels': ~3e-8).
The prototype is naive (per row and block pair: the scales' products built from scalars, the min term in
scalar fmas); bench/CPU-NOTES.md "The multi-row kernel" has its figures.
"""

from __future__ import annotations

import os
import time

import numpy as np
from bench_cpu_kernels import packed_weights
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic
from strata_engine.ops.numba_kernels import (
    _F32,
    _I32,
    _I64,
    _counted_loop,
    _hsum,
    _indices,
    _load_vector,
    _row_ptr,
    _scale_value,
    _splat,
)
from strata_engine.ops.numba_ops import NumbaOps

I8 = ir.IntType(8)
V16I = ir.VectorType(_I32, 16)
V16F = ir.VectorType(_F32, 16)


@intrinsic
def q4_rows_vnni(typingctx, values, scale, mins, n, xq, xd, xs, y, rows):
    """y[r, n] for r < rows (a literal) = weight row n (nibble pairs, f16 scale and min) . x row r, given as
    int8 xq [M, K], per-block scales xd [M, K / 32] and xs = xd * sum(xq) per block (the min term)."""
    if not isinstance(rows, types.IntegerLiteral):
        return None
    sig = types.void(values, scale, mins, n, xq, xd, xs, y, rows)
    n_rows = rows.literal_value

    def codegen(context, builder, signature, args):
        q_arr, s_arr, m_arr, xq_arr, xd_arr, xs_arr, y_arr = (
            context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 1, 2, 4, 5, 6, 7)
        )
        n_val = args[3]
        dp = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(V16I, [V16I] * 3), "llvm.x86.avx512.vpdpbusd.512"
        )
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16F, [V16F] * 3), "llvm.fma.v16f32")
        fma1 = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32] * 3), "llvm.fma.f32")
        q_row = _row_ptr(builder, q_arr, n_val, I8)
        s_row, m_row = (_row_ptr(builder, a, n_val, ir.IntType(16)) for a in (s_arr, m_arr))
        xq_rows, xd_rows, xs_rows = (
            [_row_ptr(builder, a, ir.Constant(_I64, r), elem) for r in range(n_rows)]
            for a, elem in ((xq_arr, I8), (xd_arr, _F32), (xs_arr, _F32))
        )
        pairs = builder.lshr(builder.extract_value(s_arr.shape, 1), ir.Constant(_I64, 1))
        # value order of two blocks' nibbles: low nibbles of block 0, high, then block 1's
        order = [*range(0, 16), *range(32, 48), *range(16, 32), *range(48, 64)]

        def body(p, accs):
            b0 = builder.mul(p, ir.Constant(_I64, 2))
            b1 = builder.add(b0, ir.Constant(_I64, 1))
            raw = _load_vector(builder, q_row, builder.mul(p, ir.Constant(_I64, 32)), I8, 32)
            lo = builder.and_(raw, ir.Constant(raw.type, [15] * 32))
            hi = builder.lshr(raw, ir.Constant(raw.type, [4] * 32))
            w8 = builder.bitcast(builder.shuffle_vector(lo, hi, _indices(order)), V16I)
            d0, d1, m0, m1 = (_scale_value(builder, row, b, True) for row in (s_row, m_row) for b in (b0, b1))
            out = []
            for r in range(n_rows):
                offset = builder.mul(p, ir.Constant(_I64, 64))
                xv = builder.bitcast(_load_vector(builder, xq_rows[r], offset, I8, 64), V16I)
                dot = builder.sitofp(builder.call(dp, [ir.Constant(V16I, [0] * 16), w8, xv]), V16F)
                e0 = builder.fmul(d0, builder.load(builder.gep(xd_rows[r], [b0])))
                e1 = builder.fmul(d1, builder.load(builder.gep(xd_rows[r], [b1])))
                lanes = _indices([*range(8), *range(24, 32)])  # lanes 0-7 sum block 0, 8-15 block 1
                sc = builder.shuffle_vector(_splat(builder, e0, 16), _splat(builder, e1, 16), lanes)
                acc = builder.call(fma, [dot, sc, accs[2 * r]])
                macc = builder.call(fma1, [m0, builder.load(builder.gep(xs_rows[r], [b0])), accs[2 * r + 1]])
                macc = builder.call(fma1, [m1, builder.load(builder.gep(xs_rows[r], [b1])), macc])
                out += [acc, macc]
            return out

        init = [ir.Constant(V16F, [0.0] * 16), ir.Constant(_F32, 0.0)] * n_rows
        final = _counted_loop(builder, pairs, body, init)
        for r in range(n_rows):
            y_row = _row_ptr(builder, y_arr, ir.Constant(_I64, r), _F32)
            builder.store(builder.fadd(_hsum(builder, final[2 * r]), final[2 * r + 1]), builder.gep(y_row, [n_val]))
        return context.get_dummy_value()

    return sig, codegen


@njit(fastmath=True)
def matmul_vnni(values, scale, mins, xq, xd, xs, y):
    """y = x W^T for 1 or 8 token rows (the prototype's two loops)."""
    for n in range(values.shape[0]):
        if xq.shape[0] == 1:
            q4_rows_vnni(values, scale, mins, n, xq, xd, xs, y, 1)
        else:
            q4_rows_vnni(values, scale, mins, n, xq, xd, xs, y, 8)


def quantize(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x [M, K] -> int8 qx, per-32-block scales dx, and dx * sum(qx) per block."""
    m, k = x.shape
    blocks = x.reshape(m, k // 32, 32)
    d = np.abs(blocks).max(-1) / 127
    d[d == 0] = 1
    q = np.round(blocks / d[..., None]).astype(np.int8)
    return q.reshape(m, k), d.astype(np.float32), (d * q.astype(np.float32).sum(-1)).astype(np.float32)


def main() -> None:
    ops = NumbaOps("f32", threads=1)
    ws = [w for w in packed_weights("smollm2") if w.four_bit and w.scale.dtype == np.uint16 and w.min is not None]
    print(f"{len(ws)} Q4_1 weights, {sum(w.nbytes for w in ws) / 1e6:.1f} MB; load {os.getloadavg()[0]:.2f}")
    rng = np.random.default_rng(0)
    for m in (1, 8):
        xs = [rng.standard_normal((m, w.shape[1])).astype(np.float32) for w in ws]
        qs = [quantize(x) for x in xs]
        ys = [np.empty((m, w.shape[0]), np.float32) for w in ws]
        err = 0.0
        for x, q, w, y in list(zip(xs, qs, ws, ys, strict=True))[:4]:
            matmul_vnni(w.values, w.scale, w.min, *q, y)
            err = max(err, float(np.max(np.abs(y - ops.packed_matmul(x, w)) / (np.abs(x) @ np.abs(w.dequantize()).T))))
        fns = {
            "row_dot": lambda xs=xs: [ops.packed_matmul(x, w, by_row=True) for x, w in zip(xs, ws, strict=True)],
            "rows_dot": lambda xs=xs: [ops.packed_matmul(x, w, by_row=False) for x, w in zip(xs, ws, strict=True)],
            "vnni": lambda qs=qs, ys=ys: [matmul_vnni(w.values, w.scale, w.min, *q, y) for q, w, y in zip(qs, ws, ys, strict=True)],
        }  # fmt: skip
        best = dict.fromkeys(fns, float("inf"))
        for _ in range(6):
            for key, fn in fns.items():
                t = time.thread_time()
                fn()
                best[key] = min(best[key], time.thread_time() - t)
        times = ", ".join(f"{key} {dt * 1e3:.2f} ms" for key, dt in best.items())
        print(f"M={m}: {times}; vnni's error {err:.1e} of |x| @ |W|^T (load {os.getloadavg()[0]:.2f})", flush=True)


if __name__ == "__main__":
    main()
