"""The key dots of a batched decode step's attention (`numba_kernels.key_dots`: three query rows of a K/V head
against each stored key) with the keys as the pool lays them out (token-major [n, Hkv, D], each key's dot a
16-lane sum folded by `_hsum`) and as 16-key tiles would hold them ([Hkv, n / 16, D, 16]: lane j of a vector is
key j of the tile, so the folds become plain vector adds in `_hsum`'s order and the scores are the same bits;
a head's tiles one after the other, each prefetched --prefetch-tiles ahead into L2).
A probe for a layout the engine does not have (bench/CPU-NOTES.md, session 20): one thread, SmolLM2's heads
(3 K/V heads of 64, 3 query rows each), f16 keys, in cache (one slot's layer over and over) and from memory
(30 layers x 8 slots, each its own keys).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/probe_key_layout.py [--held 528]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic
from strata_engine.ops.numba_kernels import (
    _F32,
    _I64,
    EXACT,
    _counted_loop,
    _fma,
    _load_vector,
    _row_ptr,
    _splat,
    key_dots,
)

F32 = np.float32
TILE = 16  # keys a tile: one zmm of float32 lanes
D, ROWS, N_KV = 64, 3, 3


@intrinsic
def tile_dots(typingctx, q, tiles, out, ahead):
    """out[r, 16 t + j] = q[r] . key j of tile t, for tiles [n_tiles, D * 16] (f16 bits, dim-major within a
    tile), q [ROWS, D]: lane j's partial sums over the four 16-dim chunks, then `_hsum`'s folds as vector adds;
    the tile `ahead` (a literal) tiles on prefetched into L2 (locality 2, as the kernels')."""
    if not isinstance(ahead, types.IntegerLiteral):
        return None
    sig = types.void(q, tiles, out, ahead)

    def codegen(context, builder, signature, args):
        qa, ta, oa = (context.make_array(signature.args[i])(context, builder, args[i]) for i in range(3))
        fma, vf = _fma(builder), ir.VectorType(_F32, TILE)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        prefetch = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p] + [i32] * 3), "llvm.prefetch"
        )
        q_rows = [_row_ptr(builder, qa, ir.Constant(_I64, r), _F32) for r in range(ROWS)]
        o_rows = [_row_ptr(builder, oa, ir.Constant(_I64, r), _F32) for r in range(ROWS)]

        def tile(t, carried):
            row = _row_ptr(builder, ta, t, ir.IntType(16))
            if ahead.literal_value:
                later = _row_ptr(
                    builder, ta, builder.add(t, ir.Constant(_I64, ahead.literal_value)), ir.IntType(8)
                )
                for line in range(D * TILE * 2 // 64):
                    at = builder.gep(later, [ir.Constant(_I64, 64 * line)])
                    builder.call(
                        prefetch, [at, ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)]
                    )

            def lane(j):  # lane j of key_dots' accumulator, for the 16 keys at once
                s = [ir.Constant(vf, [0.0] * TILE)] * ROWS
                for c in range(D // TILE):
                    d = c * TILE + j
                    bits = _load_vector(builder, row, ir.Constant(_I64, d * TILE), ir.IntType(16), TILE)
                    kv = builder.fpext(builder.bitcast(bits, ir.VectorType(ir.HalfType(), TILE)), vf)
                    for r in range(ROWS):
                        qv = _splat(
                            builder, builder.load(builder.gep(q_rows[r], [ir.Constant(_I64, d)])), TILE
                        )
                        s[r] = builder.call(fma, [qv, kv, s[r]])
                return s

            def fold(j, width):  # _hsum: lane j plus lane j + 8, those plus j + 4, ...
                a, b = (
                    (lane(j), lane(j + 8)) if width == 8 else (fold(j, 2 * width), fold(j + width, 2 * width))
                )
                return [builder.fadd(x, y, flags=EXACT) for x, y in zip(a, b, strict=True)]

            at = builder.mul(t, ir.Constant(_I64, TILE))
            for r, total in enumerate(fold(0, 1)):
                builder.store(total, builder.bitcast(builder.gep(o_rows[r], [at]), vf.as_pointer()), align=4)
            return []

        _counted_loop(builder, builder.extract_value(ta.shape, 0), tile, [])
        return context.get_dummy_value()

    return sig, codegen


@njit(fastmath=True)
def natural(q, keys, scales, out, reps):
    """keys [M, n, Hkv, D]: every head of every array, `reps` times."""
    n = keys.shape[1]
    for _ in range(reps):
        for m in range(keys.shape[0]):
            for h in range(keys.shape[2]):
                key_dots(q, keys[m, :, h], scales, 0, n, out[m, h], 64, 3)


def tiled_kernel(ahead: int):
    @njit(fastmath=True)
    def tiled(q, tiles, out, reps):
        """tiles [M, Hkv, n / 16, D * 16]."""
        for _ in range(reps):
            for m in range(tiles.shape[0]):
                for h in range(tiles.shape[1]):
                    tile_dots(q, tiles[m, h], out[m, h], ahead)

    return tiled


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--held", type=int, default=528, help="keys a slot holds (a multiple of 16)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--prefetch-tiles", type=int, default=4, help="tiles ahead prefetched (0: none)")
    args = ap.parse_args()
    tiled = tiled_kernel(args.prefetch_tiles)
    n = args.held // TILE * TILE
    rng = np.random.default_rng(0)
    q = rng.standard_normal((ROWS, D)).astype(F32)
    scales = np.ones((n, D // 32), F32)  # read by nothing: f16 keys
    for case, arrays, reps in (("cache", 1, 240), ("memory", 240, 1)):
        keys = rng.standard_normal((arrays, n, N_KV, D)).astype(np.float16)
        tiles = np.ascontiguousarray(keys.reshape(arrays, n // TILE, TILE, N_KV, D).transpose(0, 3, 1, 4, 2))
        tiles = tiles.reshape(arrays, N_KV, n // TILE, D * TILE)
        out_n = np.zeros((arrays, N_KV, ROWS, n + 16), F32)
        out_t = np.zeros_like(out_n)
        bits_n, bits_t = keys.view(np.uint16), tiles.view(np.uint16)
        natural(q, bits_n, scales, out_n, 1)
        tiled(q, bits_t, out_t, 1)
        same = np.array_equal(out_n[..., :n], out_t[..., :n])
        pairs = reps * arrays * N_KV * n
        a, b = [], []
        for _ in range(args.rounds):  # the two take turns: the machine's speed drifts between minutes
            t = time.perf_counter()
            natural(q, bits_n, scales, out_n, reps)
            a.append((time.perf_counter() - t) / pairs * 1e9)
            t = time.perf_counter()
            tiled(q, bits_t, out_t, reps)
            b.append((time.perf_counter() - t) / pairs * 1e9)
        ratios = sorted(x / y for x, y in zip(a, b, strict=True))
        print(
            f"{case:6s} {n} keys x {N_KV} heads x {arrays} arrays: token-major {statistics.median(a):.2f} ns a "
            f"(key, head), 16-key tiles {statistics.median(b):.2f}: x{statistics.median(ratios):.2f} "
            f"[{ratios[len(ratios) // 4]:.2f}-{ratios[3 * len(ratios) // 4]:.2f}], same bits: {same}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
