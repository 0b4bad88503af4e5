"""Where the host time of a GPU prefill and decode goes: cProfile of the engine on the cupy backend.

    python3 bench/profile_gpu.py --model PATH [--dtype bf16] [--prompt 512] [--steps 32]

Prints, for a warm runner: the wall time of one prefill and of decode steps replayed from the CUDA
graph and run op by op, then the 25 functions with the most own time in the profiled prefill and in
the op-by-op decode steps. Host time above the device's time is launch overhead.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np


def main() -> int:
    from strata_engine.runner import ModelRunner
    from strata_engine.settings import EngineSettings

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()
    settings = EngineSettings(
        model_path=Path(args.model), n_ctx=8192, backend="cupy", compute_dtype=args.dtype
    )
    graphed = ModelRunner.load(settings)
    eager = graphed.sibling(cuda_graphs=False)
    tokens = np.random.default_rng(0).integers(100, 5000, args.prompt).tolist()
    ops = graphed.model.ops

    def prefill_and_decode(runner, steps: int) -> tuple[float, float]:
        runner.erase()
        ops.synchronize()
        t0 = time.perf_counter()
        tok = int(np.argmax(runner.prefill(tokens).logits))
        t1 = time.perf_counter()
        for _ in range(steps):
            tok = int(np.argmax(runner.decode(tok)))
        return t1 - t0, (time.perf_counter() - t1) / max(steps, 1)

    for runner in (graphed, eager):  # warm-up: kernels, cuBLAS, the graph's capture
        prefill_and_decode(runner, 4)
    for name, runner in (("graph", graphed), ("op by op", eager)):
        pf, dc = prefill_and_decode(runner, args.steps)
        print(
            f"{name:9s} prefill {args.prompt} tokens {pf * 1e3:8.2f} ms   decode {dc * 1e3:7.3f} ms/token",
            flush=True,
        )
    for title, steps in (("prefill", 0), ("decode op by op", args.steps)):
        prof = cProfile.Profile()
        eager.erase()
        prof.enable()
        prefill_and_decode(eager, steps)
        prof.disable()
        print(f"---- {title} (profiled, prefill included) ----")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
