"""A decode step's attention alone: strata_flash_attn and strata_attn_combine for one query token, per layer,
timed as a CUDA graph of every layer's call (each layer its own K/V pool, so the L2 cache holds all the K/V at
short lengths and not at long ones, as in the model's step).

    python3 bench/gpu/bench_gpu_decode_attn.py [--min-tiles 4,2,1] [--repeat 20]

Cases: smollm2 (9 / 3 heads of 64, f16, 30 layers; pools of 4,168 and 8,192 slots, bench_gpu.py's and
profile_gpu.py's n_ctx) and gemma3 (4 / 1 heads of 256, bf16, 18 layers: 3 global over a 32,776-slot pool,
15 local over a 1,024-slot ring with a 512 window); f16 pools (the engine's default K/V type). Per held length and `CupyOps.flash_min_tiles`: us per
layer of one replay (median of --repeat timings of 10 replays between two events), of the same graph with
the combine left out (the flash kernel alone), and the key splits of the global layers. Each case's last
layer is checked against the same attention with the positions as arguments (no graph, the held keys only).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def replay_us(cp, graph, stream, repeat: int) -> float:
    graph.launch(stream)
    stream.synchronize()
    times = []
    for _ in range(repeat):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(10):
            graph.launch(stream)
        stop.record(stream)
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) * 100.0)  # ms for 10 -> us for one
    return float(np.median(times))


def capture(cp, run):
    """(graph, stream, pool, result) of run() captured after one uncaptured run on the same private pool."""
    stream, pool = cp.cuda.Stream(non_blocking=True), cp.cuda.MemoryPool()
    with cp.cuda.using_allocator(pool.malloc), stream:
        run()
        stream.synchronize()
        stream.begin_capture()
        try:
            out = run()
        finally:
            graph = stream.end_capture()
    graph.upload(stream)
    return graph, stream, pool, out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--min-tiles", default="4,2,1")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--prefill", action="store_true", help="time prefill chunks' attention instead")
    args = ap.parse_args()
    import cupy as cp
    from strata_engine.ops.attention_tiling import flash_splits, flash_tiles
    from strata_engine.ops.cupy_ops import CupyOps

    rng = np.random.default_rng(0)
    if args.prefill:
        return prefill(cp, CupyOps, rng, args.repeat)
    # name, dtype, H, Hkv, D, layers [(pool slots, ring capacity, window)], held lengths
    cases = [
        ("smollm2 n_ctx 4168", "f16", 9, 3, 64, [(4168, 0, 0)] * 30, (512, 4096)),
        ("smollm2 n_ctx 8192", "f16", 9, 3, 64, [(8192, 0, 0)] * 30, (512, 4096, 8000)),
        (
            "gemma3 n_ctx 32776",
            "bf16",
            4,
            1,
            256,
            ([(1024, 1024, 512)] * 5 + [(32776, 0, 0)]) * 3,
            (512, 4096, 32768),
        ),
    ]
    print(
        f"{'case':<20} {'held':>6} {'min_tiles':>9} {'splits':>6} {'us/layer':>9} {'flash only':>10} {'check':>8}"
    )
    for name, dtype, n_head, n_kv, d, layers, helds in cases:
        ops = CupyOps(dtype)
        pools = [
            tuple(ops.asarray(rng.standard_normal((slots, n_kv, d)).astype(np.float16)) for _ in "kv")
            for slots, _, _ in layers
        ]
        q = ops.asarray(rng.standard_normal((1, n_head, d)).astype(np.float32), ops.dtype)
        dyn = cp.zeros(1, dtype=cp.int32)

        def step(ops=ops, pools=pools, layers=layers, q=q, dyn=dyn, d=d):
            out = None
            for (k, v), (_, ring, window) in zip(pools, layers, strict=True):
                out = ops.flash_attention(q, k, v, q_pos0=0, k_pos0=0, window=window or None, scale=d**-0.5,
                                          ring_capacity=ring, dyn=dyn)  # fmt: skip
            return out

        for mt in (int(x) for x in args.min_tiles.split(",")):
            ops.flash_min_tiles = mt
            _, tile = flash_tiles(d, n_head // n_kv)
            try:
                splits = flash_splits(n_kv, layers[-1][0], tile, ops.raw.n_sm, mt)
            except TypeError:  # a checkout before min_tiles: its fixed policy
                splits = flash_splits(n_kv, layers[-1][0], tile, ops.raw.n_sm)
            graph, stream, _pool, out = capture(cp, step)
            get = ops.raw.get

            def no_combine(name_, *t, get=get):
                kernel = get(name_, *t)
                return (lambda *a, **k: None) if name_.startswith("strata_attn_combine") else kernel

            ops.raw.get = no_combine
            try:
                graph_f, stream_f, _pool_f, _ = capture(cp, step)
            finally:
                ops.raw.get = get
            for held in helds:
                pos = held  # the new token's position: `held` keys before it
                dyn.set(np.array([pos], dtype=np.int32))
                cp.cuda.Device().synchronize()  # the graphs' streams do not wait for the default one
                us = replay_us(cp, graph, stream, args.repeat)
                us_f = replay_us(cp, graph_f, stream_f, args.repeat)
                graph.launch(stream)
                stream.synchronize()
                k, v = pools[-1]
                want = ops.flash_attention(q, k[: pos + 1], v[: pos + 1], q_pos0=pos, k_pos0=0, window=None,
                                           scale=d**-0.5)  # fmt: skip
                a, b = (ops.to_host(x).astype(np.float32) for x in (out, want))
                err = float(np.linalg.norm(a - b) / np.linalg.norm(b))
                print(f"{name:<20} {held:>6} {mt:>9} {splits:>6} {us / len(layers):>9.2f} "
                      f"{us_f / len(layers):>10.2f} {err:>8.1e}", flush=True)  # fmt: skip
    return 0


def prefill(cp, CupyOps, rng, repeat: int) -> int:
    """Prefill chunks' attention (several query rows, key splits merged by the combine where the row tiles
    alone do not fill the device): us per call, 10 calls of one case replayed as a graph."""
    # name, dtype, H, Hkv, D, chunk rows, first position, window
    cases = [
        ("smollm2 chunk", "f16", 9, 3, 64, 32, 4000, None),
        ("smollm2 chunk", "f16", 9, 3, 64, 128, 3968, None),
        ("smollm2 chunk", "f16", 9, 3, 64, 512, 0, None),
        ("smollm2 chunk", "f16", 9, 3, 64, 512, 3584, None),
        ("gemma3 global", "bf16", 4, 1, 256, 512, 0, None),
        ("gemma3 global", "bf16", 4, 1, 256, 512, 3584, None),
        ("gemma3 global", "bf16", 4, 1, 256, 2048, 30720, None),
        ("gemma3 local", "bf16", 4, 1, 256, 512, 3584, 512),
    ]
    print(f"{'case':<14} {'rows':>5} {'pos':>6} {'us/call':>8}")
    for name, dtype, n_head, n_kv, d, n_q, pos, window in cases:
        ops = CupyOps(dtype)
        k0 = max(0, pos - window + 1) if window else 0
        n_k = pos + n_q - k0
        k, v = (ops.asarray(rng.standard_normal((n_k, n_kv, d)).astype(np.float16)) for _ in "kv")
        q = ops.asarray(rng.standard_normal((n_q, n_head, d)).astype(np.float32), ops.dtype)

        def run(ops=ops, q=q, k=k, v=v, pos=pos, k0=k0, window=window, d=d):
            return [ops.flash_attention(q, k, v, q_pos0=pos, k_pos0=k0, window=window, scale=d**-0.5)
                    for _ in range(10)]  # fmt: skip

        graph, stream, _pool, _ = capture(cp, run)
        print(f"{name:<14} {n_q:>5} {pos:>6} {replay_us(cp, graph, stream, repeat) / 10:>8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
