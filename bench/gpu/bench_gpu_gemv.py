"""A decode step's products on the GPU, each timed inside a CUDA graph as the decode step's graph runs them:
strata_gemv (the decode kernel) against cuBLAS and against a device-to-device copy of the weight's bytes.

    python3 bench/gpu/bench_gpu_gemv.py

Shapes are the real models' (smollm2 f16, gemma3 bf16): the fused Q/K/V, the attention output, the fused
gate/up with its activation (strata_gemv only), the down product and the output head (float32 out), at 1, 2,
4 and 8 token rows. A time is a graph of 50 back-to-back launches replayed, divided by 50 (median of 20 rounds of 10
replays: no host launch cost). GB/s counts the weight's bytes read once; the copy's, its bytes read and
written.
"""

from __future__ import annotations

import sys
from functools import partial

import numpy as np
from bench_gpu_decode_attn import capture, replay_us

SHAPES = {  # model: (dtype, [(name, n_out, n_in, act)]); gate_up: n_out columns of act(gate) * up, 2 rows each
    "smollm2": ("f16", [("qkv", 960, 576, -1), ("o", 576, 576, -1), ("gate_up", 1536, 576, 0),
                        ("down", 576, 1536, -1), ("head", 49_152, 576, -1)]),
    "gemma3": ("bf16", [("qkv", 1536, 640, -1), ("o", 640, 1024, -1), ("gate_up", 2048, 640, 1),
                        ("down", 640, 2048, -1), ("head", 262_144, 640, -1)]),
}  # fmt: skip
GRAPH_LAUNCHES = 50


def timed(fn, cp, repeat: int = 20) -> float:
    """us a call inside a CUDA graph of GRAPH_LAUNCHES calls, the median of `repeat` rounds of replays."""
    graph, stream, _pool, _ = capture(cp, lambda: [fn() for _ in range(GRAPH_LAUNCHES)])
    return replay_us(cp, graph, stream, repeat) / GRAPH_LAUNCHES


def main() -> int:
    import cupy as cp
    from strata_engine.ops.cupy_ops import CupyOps

    rng = np.random.default_rng(0)
    print(f"{'model':8} {'product':8} {'rows':>4} {'gemv us':>8} {'cuBLAS us':>9} {'gemv GB/s':>9} "
          f"{'copy GB/s':>9} {'cuBLAS/gemv':>11}")  # fmt: skip
    for model, (dtype, shapes) in SHAPES.items():
        ops = CupyOps(dtype)
        for name, n_out, n_in, act in shapes:
            n_rows = 2 * n_out if act >= 0 else n_out
            w = ops.asarray(rng.standard_normal((n_rows, n_in)).astype(np.float32) * 0.05, ops.dtype)
            copy_us = timed(partial(cp.copyto, cp.empty_like(w), w), cp)
            out_dtype = cp.float32 if name == "head" else ops.dtype
            for n_tok in (1, 2, 4, 8):
                x = ops.asarray(rng.standard_normal((n_tok, n_in)).astype(np.float32), ops.dtype)
                gemv = timed(partial(ops._gemv, x, w, n_out, out_dtype, act), cp)
                blas = (
                    timed(partial(ops.cublas.linear, cp, x, w, out_dtype=out_dtype), cp)
                    if act < 0
                    else np.nan
                )
                print(f"{model:8} {name:8} {n_tok:4} {gemv:8.1f} {blas:9.1f} {w.nbytes / gemv / 1e3:9.0f} "
                      f"{2 * w.nbytes / copy_us / 1e3:9.0f} {blas / gemv:11.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
