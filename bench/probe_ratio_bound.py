"""How far the batched decode step's ratio (8 slots' aggregate over one slot's, issue 15's x4) could go on this
machine: the engine's 1- and 8-slot decode steps as they are, with the q8 products replaced by a kernel that only
reads their weight bytes, and with the attention replaced too (one that only reads each row's K and V range),
taking turns in one process (the machine's speed swings between minutes: bench/CPU-NOTES.md).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/probe_ratio_bound.py [--held 528] [--rounds 8]

A replaced op returns zeros of its shape after reading the same bytes over both threads as 64-bit integer sums (no
arithmetic to speak of: memory-bound); everything else in the step runs as it is (norms, RoPE, the K/V stores,
the sampling's argmax, the Python between kernels). So "both read only" is the ratio with the step's arithmetic
free, a ceiling for any kernel work at that depth. Printed per variant: the median step times and the paired
ratio 8 T1 / T8 (min, median, max over the rounds). SmolLM2 (the model the x4 is measured on), f16 K/V.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import strata_engine  # noqa: F401  (first: its OPENBLAS_THREAD_TIMEOUT must precede numpy's BLAS)

# isort: split
import numpy as np
from numba import njit, prange

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from strata_engine.ops import numba_q8  # noqa: E402
from strata_engine.settings import EngineSettings  # noqa: E402
from strata_engine.slots import SlotSet  # noqa: E402
from support.data import smollm2_model_path  # noqa: E402

SLOTS = 8


@njit(fastmath=True)
def _read(words):
    """A sum of 64-bit words, 8 lanes at a time: one pass over the bytes."""
    acc = np.zeros(8, np.uint64)
    for i in range(words.shape[0] // 8):
        for j in range(8):
            acc[j] += words[i * 8 + j]
    return acc.sum()


@njit(parallel=True)
def read_halves(words, out):
    half = (words.shape[0] // 16) * 8
    for t in prange(2):
        out[t] = _read(words[t * half : (t + 1) * half])


@njit(parallel=True)
def read_ranges(k, v, slots, lo, hi, out):
    """Row r's K and V words of slots[r], positions [lo[r], hi[r]): 2 items a row over the threads."""
    for item in prange(slots.shape[0] * 2):
        r = item // 2
        src = k if item % 2 == 0 else v
        out[item] = _read(src[slots[r], lo[r] : hi[r]].ravel())


def as_words(storage) -> np.ndarray:
    """A layer's K or V storage ([slots, capacity, Hkv, D] or [capacity, Hkv, D]) as [slots, capacity, words]."""
    a = np.asarray(storage)
    if a.ndim == 3:
        a = a[None]
    return a.reshape(a.shape[0], a.shape[1], -1).view(np.uint64)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--held", type=int, default=528, help="tokens each slot holds (the peer's shape: 512-544)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20, help="decode steps a timing")
    args = ap.parse_args()
    slots = SlotSet.load(EngineSettings(model_path=smollm2_model_path(), n_ctx=SLOTS * 1024, n_slots=SLOTS))
    rng = np.random.default_rng(0)
    for runner in slots.runners:
        runner.prefill([2] + rng.integers(300, 40000, args.held - 1).tolist())
    ops = slots.runners[0].model.ops
    sink = np.zeros(2 * SLOTS, np.uint64)

    def product_reads(x, w, parallel):
        read_halves(w.values.reshape(-1).view(np.uint64), sink)
        return np.zeros((x.shape[0], w.shape[0]), np.float32)

    def rows_read(q, k, v, k_scale, v_scale, *, slots, q_pos, k_lo, capacity, window, scale):
        read_ranges(as_words(k), as_words(v), np.asarray(slots, np.int64), np.asarray(k_lo, np.int64),
                    np.asarray(q_pos, np.int64) + 1, sink)  # fmt: skip
        return np.zeros((q.shape[0], q.shape[1] * q.shape[2]), np.float32)

    def kernel_reads(q, k, v, k_scale, v_scale, *, q_pos0, k_lo, k_hi, base, capacity, window, scale):
        read_ranges(as_words(k), as_words(v), np.zeros(1, np.int64), np.array([k_lo - base]),
                    np.array([k_hi - base]), sink)  # fmt: skip
        return np.zeros((q.shape[0], q.shape[1] * q.shape[2]), np.float32)

    real = (numba_q8.product, ops.attention_rows, ops.attention_kernel)
    variants = {
        "as it is": real,
        "products read only": (product_reads, real[1], real[2]),
        "both read only": (product_reads, rows_read, kernel_reads),
    }

    def use(variant) -> None:
        numba_q8.product, ops.attention_rows, ops.attention_kernel = variant

    def step_ms(rows: int, steps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            slots.decode([(i, 7) for i in range(rows)])
            for i in range(rows):
                slots.runners[i].cut_back(args.held)
        return (time.perf_counter() - t0) / steps * 1e3

    for variant in variants.values():  # compiled (or loaded) and warm before any timing
        use(variant)
        step_ms(1, 3)
        step_ms(SLOTS, 3)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, variant in variants.items():
            use(variant)
            times[name].append((step_ms(1, args.steps), step_ms(SLOTS, args.steps)))
    use(real)
    print(f"SmolLM2, f16 K/V, {args.held} held, {args.rounds} rounds of {args.steps} steps")
    for name, pairs in times.items():
        t1, t8 = (float(np.median([p[i] for p in pairs])) for i in (0, 1))
        ratios = sorted(SLOTS * a / b for a, b in pairs)
        print(f"{name:>20}: T1 {t1:6.2f} ms  T{SLOTS} {t8:6.2f} ms  x {ratios[0]:.2f} / {np.median(ratios):.2f} / "
              f"{ratios[-1]:.2f} (min / median / max)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
