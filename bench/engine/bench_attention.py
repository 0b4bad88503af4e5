"""The attention kernel alone at depth (`NumbaOps.attention` over stored K/V), against the same call in an
earlier revision's kernels, in one run: a decode step's (or a short prompt's) attention over every layer of
a model's layout, each layer its own K/V in one pool-like buffer (token-major [slots, Hkv, D], so the step
reads the context from memory as a real one does), on 1 and on all threads; beside it the time to merely
read the same K/V bytes once. The numbers behind bench/engine/DECISIONS.md "Decode attention".

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/engine/bench_attention.py [--baseline main]
        [--threads 1 2] [--held 4096 8192] [--tokens 1 5 16] [--parallel-min-scores 16384]

The baseline's numba_kernels.py is taken from git (`git show REV:...`) and loaded as a module of its own
(its kernels compile into a cache folder of their own).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numba
import numpy as np

REPO = Path(__file__).resolve().parents[2]
KERNELS = "packages/strata-engine/src/strata_engine/ops/numba_kernels.py"
F32 = np.float32
# Layouts: (K/V heads, query heads, head dim, full layers, sliding-window layers, window).
MODELS = {"smollm2": (3, 9, 64, 30, 0, 0), "gemma3": (1, 4, 256, 3, 15, 512)}
BASELINE_PARALLEL_MIN_SCORES = 1 << 20  # the threshold before attention ran over both threads


@numba.njit(cache=False)
def _read(a):
    """Sum of a's 8-byte words: every byte read once."""
    s = np.uint64(0)
    for i in range(a.size):
        s += a[i]
    return s


def load_baseline(rev: str, folder: Path):
    """The revision's numba_kernels.py as a module (it imports numpy, numba and llvmlite only)."""
    text = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{KERNELS}"], check=True, capture_output=True,
                          text=True).stdout  # fmt: skip
    path = folder / "baseline_numba_kernels.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("baseline_numba_kernels", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def baseline_call(nk, threads: int):
    """The revision's kernels called as its NumbaOps.attention_kernel called them (the kernels before the tiled rewrite:
    work items per K/V head and split, then a merge call)."""

    def call(q, k, v, *, q_pos0, k_lo, window, scale):
        n_tok, n_head, d = q.shape
        n_kv = k.shape[1]
        span = max(1, q_pos0 + n_tok - k_lo)
        parallel = threads > 1 and span * n_head * n_tok >= BASELINE_PARALLEL_MIN_SCORES
        n_split = max(1, min(-(-2 * threads // n_kv), span // 64)) if parallel else 1
        rows = (n_head // n_kv) * n_tok
        acc = np.empty((n_kv, n_split, rows, d), dtype=F32)
        m = np.empty((n_kv, n_split, rows), dtype=F32)
        l_sum = np.empty((n_kv, n_split, rows), dtype=F32)
        qs = np.ascontiguousarray(q, dtype=F32) * F32(scale)
        kernel = nk.attention_partials if parallel else nk.attention_partials_serial
        dummy = np.zeros((1, 1, 1), dtype=F32)
        kernel(qs, k.view(np.uint16), v.view(np.uint16), dummy, dummy, False, q_pos0, k_lo, k_lo, 0, window,
               n_split, acc, m, l_sum)  # fmt: skip
        out = np.empty((n_tok, n_head * d), dtype=F32)
        nk.attention_merge(acc, m, l_sum, n_tok, out)
        return out

    return call


def current_call(ops):
    def call(q, k, v, *, q_pos0, k_lo, window, scale):
        n_tok = q.shape[0]
        return ops.attention_kernel(q, k, v, None, None, q_pos0=q_pos0, k_lo=k_lo, k_hi=q_pos0 + n_tok, base=k_lo,
                                    capacity=0, window=window, scale=scale, softcap=0.0)  # fmt: skip

    return call


def best_of(fns, reps: int, clock=time.perf_counter) -> list[float]:
    """Each function's best time over `reps` rounds, the functions taking turns within a round (so a
    stretch of load on the shared machine slows both sides)."""
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t = clock()
            fn()
            best[i] = min(best[i], clock() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--baseline",
        default="dc96dc5",
        help="git revision whose kernels to compare with (default: the last before the rewrite; its API is the one this script calls)",
    )
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--held", nargs="+", type=int, default=[4096, 8192])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1], help="query tokens per call (<= 16)")
    ap.add_argument("--threads", nargs="+", type=int, default=sorted({1, len(os.sched_getaffinity(0))}))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument(
        "--parallel-min-scores",
        type=int,
        default=None,
        help="this tree's PARALLEL_MIN_SCORES for the run (e.g. 16384: decode at depth over all threads)",
    )
    args = ap.parse_args()
    if args.parallel_min_scores is not None:
        from strata_engine.ops import numba_ops

        numba_ops.PARALLEL_MIN_SCORES = args.parallel_min_scores

    from strata_engine.ops.numba_ops import NumbaOps

    tmp = Path(tempfile.mkdtemp(prefix="bench-attention-"))
    os.environ.setdefault("NUMBA_CACHE_DIR", str(tmp / "cache"))
    base = load_baseline(args.baseline, tmp)
    rng = np.random.default_rng(0)
    print(
        f"baseline {args.baseline}; load average {os.getloadavg()[0]:.2f}; f16 K/V; ms per step (all layers)"
    )
    print("| model | held | tokens | threads | read K/V once | baseline | this tree | baseline / this |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.models:
        n_kv, n_head, d, n_full, n_ring, window = MODELS[name]
        for held in args.held:
            for n_tok in args.tokens:
                s = held + n_tok
                layers = [(0, 0)] * n_full + [(max(0, held - window + 1), window)] * n_ring
                pool = rng.standard_normal((len(layers), 2, s, n_kv, d)).astype(np.float16)
                q = rng.standard_normal((n_tok, n_head, d)).astype(F32)

                def step(call, pool=pool, layers=layers, q=q, held=held):
                    for i, (lo, win) in enumerate(layers):
                        call(
                            q, pool[i, 0, lo:], pool[i, 1, lo:], q_pos0=held, k_lo=lo, window=win, scale=0.125
                        )

                def read(pool=pool, layers=layers):
                    for i, (lo, _) in enumerate(layers):
                        _read(pool[i, :, lo:].reshape(-1).view(np.uint64))

                (t_read,) = best_of([read], args.reps)
                for threads in args.threads:
                    ops = NumbaOps("f32", threads=threads)
                    # one thread: its CPU time (the other helpers' processes share these cores); more: wall time
                    clock = time.thread_time if threads == 1 else time.perf_counter
                    t_base, t_new = best_of(
                        [lambda: step(baseline_call(base, threads)), lambda: step(current_call(ops))],  # noqa: B023
                        args.reps, clock,
                    )  # fmt: skip
                    print(f"| {name} | {held} | {n_tok} | {threads} | {t_read * 1e3:.2f} | {t_base * 1e3:.2f} | "
                          f"{t_new * 1e3:.2f} | {t_base / t_new:.2f} |", flush=True)  # fmt: skip
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
