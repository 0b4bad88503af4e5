"""The CuPy backend's attention kernel against torch's scaled_dot_product_attention on the same GPU.

    python3 bench/gpu/bench_gpu_kernels.py

Shapes are the real models' (smollm2: 9 query / 3 K/V heads of 64; gemma3: 4 / 1 of 256), causal, f16
operands. Times are medians of CUDA-event-timed runs after a warm-up; TFLOP/s counts the causal half
(2 products of 2*T*S*D flops per head, halved). torch runs SDPA with its GQA expansion
(`enable_gqa=True`); both read the same K/V. Prints one table.
"""

from __future__ import annotations

import sys
from functools import partial

import numpy as np


def timed(fn, cp, repeat: int = 20) -> float:
    fn()
    cp.cuda.Device().synchronize()
    times = []
    for _ in range(repeat):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return float(np.median(times))


TILE_VARIANTS = {64: [(4, 64), (8, 64), (8, 32)], 256: [(4, 16), (8, 16), (4, 32), (2, 32)]}


def main() -> int:
    import cupy as cp
    from strata_engine.ops.cupy_ops import CupyOps

    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        torch = None
    ops = CupyOps("f16")
    rows = []
    cases = [
        ("smollm2 prefill", 4096, 4096, 9, 3, 64, None),
        ("smollm2 chunk 2048 @ 8K", 2048, 8192, 9, 3, 64, None),
        ("gemma3 global 2048 @ 32K", 2048, 32768, 4, 1, 256, None),
        ("gemma3 local 2048 @ 32K", 2048, 2559, 4, 1, 256, 512),
        ("smollm2 decode @ 4K", 1, 4097, 9, 3, 64, None),
        ("gemma3 decode @ 32K", 1, 32768, 4, 1, 256, None),
    ]
    rng = np.random.default_rng(0)
    for name, n_q, n_k, n_head, n_kv, d, window in cases:
        q = cp.asarray(rng.standard_normal((n_q, n_head, d)), dtype=cp.float16)
        k = cp.asarray(rng.standard_normal((n_k, n_kv, d)), dtype=cp.float16)
        v = cp.asarray(rng.standard_normal((n_k, n_kv, d)), dtype=cp.float16)
        q_pos0 = n_k - n_q
        run = partial(ops.flash_attention, q, k, v, q_pos0=q_pos0, k_pos0=0, window=window, scale=d**-0.5)
        ours = timed(run, cp)
        if n_q > 1:  # the other tile shapes, for the record
            for tiles in TILE_VARIANTS[d]:
                print(
                    f"  {name}: tiles {tiles}: {timed(partial(run, tiles=tiles), cp) * 1e3:.3f} ms",
                    flush=True,
                )
        visible = sum(min(q_pos0 + t + 1, window or 10**9) for t in range(n_q))
        flops = 4 * n_head * d * visible
        theirs = None
        if torch is not None:
            tq = torch.as_tensor(q, device="cuda").permute(1, 0, 2)[None]
            tk = torch.as_tensor(k, device="cuda").permute(1, 0, 2)[None]
            tv = torch.as_tensor(v, device="cuda").permute(1, 0, 2)[None]
            mask = None
            if n_q > 1 or window:
                qp = torch.arange(q_pos0, q_pos0 + n_q, device="cuda")[:, None]
                kp = torch.arange(0, n_k, device="cuda")[None, :]
                vis = kp <= qp
                if window:
                    vis &= (qp - kp) < window
                mask = vis
            sdpa = partial(
                F.scaled_dot_product_attention, tq, tk, tv, attn_mask=mask, enable_gqa=True, scale=d**-0.5
            )
            theirs = timed(sdpa, cp)
        rows.append((name, ours, flops, theirs))
    print(f"{'case':28s} {'strata ms':>10s} {'TFLOP/s':>8s} {'torch sdpa ms':>14s} {'ratio':>6s}")
    for name, ours, flops, theirs in rows:
        r = f"{theirs / ours:6.2f}" if theirs else "   n/a"
        t = f"{theirs * 1e3:14.3f}" if theirs else f"{'n/a':>14s}"
        print(f"{name:28s} {ours * 1e3:10.3f} {flops / ours / 1e12:8.1f} {t} {r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
