"""The CPU attention kernels of this tree against another tree's, in one process, taking turns: the machine's speed
swings +-20 % between minutes (bench/CPU-NOTES.md), more than most kernel changes, and one process with both
trees sees the same minutes.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/ab_attention.py --other ../main [--rounds 21]

The other tree's `strata_engine` package is copied to a temporary folder as `strata_engine_b` (the package imports
itself relatively only). Cases (numba-q8 ops, 2 threads, f16 K/V): a batched decode step's attention (8 slots at
~700 held, SmolLM2's heads), one-row decode at 4,096 held (SmolLM2's and gemma3's heads), each over 30 / 18
layers' own K/V so it comes from memory as in the engine; a 512-token chunk's attention with gemma3's heads
(windowed at 0 and 4,096 held, global at 4,096). Printed: each tree's median, the paired ratio (this tree's speed
over the other's: > 1 is faster here) with its quartiles, and the largest difference of the outputs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import strata_engine  # noqa: F401  (first: its OPENBLAS_THREAD_TIMEOUT must precede numpy's BLAS)

# isort: split
import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def load_other(tree: Path, folder: Path):
    """The other tree's engine package, imported as strata_engine_b: its `get_ops`."""
    src = tree / "packages" / "strata-engine" / "src" / "strata_engine"
    shutil.copytree(src, folder / "strata_engine_b", ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, str(folder))
    from strata_engine_b.ops import get_ops

    return get_ops


def cases(rng: np.random.Generator):
    """(name, make(ops) -> a function running the case once)."""
    out = []
    # a batched step: 8 rows, SmolLM2's heads (3 K/V, 9 query, 64 wide), 30 layers' K/V (from memory)
    n_kv, n_head, d, rows, held, layers = 3, 9, 64, 8, 700, 30
    ks = [rng.standard_normal((rows, held + 64, n_kv, d)).astype(np.float16) for _ in range(layers)]
    vs = [rng.standard_normal((rows, held + 64, n_kv, d)).astype(np.float16) for _ in range(layers)]
    q = rng.standard_normal((rows, n_head, d)).astype(np.float32)
    kw = dict(slots=list(range(rows)), q_pos=[held - 1 - 7 * b for b in range(rows)], k_lo=[0] * rows, capacity=0,
              window=0, scale=0.125)  # fmt: skip

    def batched(ops, ks=ks, vs=vs, q=q, kw=kw):
        return lambda: [ops.attention_rows(q, k, v, None, None, **kw) for k, v in zip(ks, vs, strict=True)][-1]

    out.append(("batched step, 8 x ~700 held, 30 layers", batched))
    for name, (n_kv, n_head, d, layers) in (("SmolLM2", (3, 9, 64, 30)), ("gemma3", (1, 4, 256, 18))):
        held = 4096
        ks1 = [rng.standard_normal((held, n_kv, d)).astype(np.float16) for _ in range(layers)]
        vs1 = [rng.standard_normal((held, n_kv, d)).astype(np.float16) for _ in range(layers)]
        q1 = rng.standard_normal((1, n_head, d)).astype(np.float32)

        def one(ops, ks=ks1, vs=vs1, q=q1, held=held):
            return lambda: [
                ops.attention(q, k, v, q_pos0=held - 1, k_pos0=0, window=None, scale=0.125)
                for k, v in zip(ks, vs, strict=True)
            ][-1]

        out.append((f"{name} decode, 4,096 held, {layers} layers", one))
    for held, window in ((0, 512), (4096, 512), (4096, None)):
        k = (rng.standard_normal((held + 512, 1, 256)) * 2).astype(np.float16)
        v = rng.standard_normal((held + 512, 1, 256)).astype(np.float16)
        qc = rng.standard_normal((512, 4, 256)).astype(np.float32)
        lo = 0 if window is None else max(0, held - window + 1)

        def chunk(ops, k=k[lo:], v=v[lo:], q=qc, held=held, lo=lo, window=window):
            return lambda: ops.attention(q, k, v, q_pos0=held, k_pos0=lo, window=window, scale=0.0625)

        out.append((f"gemma3 512-token chunk, {held} held, {'window 512' if window else 'global'}", chunk))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", type=Path, required=True, help="the other checkout's root")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        from strata_engine.ops import get_ops

        other_ops = load_other(a.other.resolve(), Path(tmp))
        ops = {"here": get_ops("numpy", "f32", "numba-q8", a.threads),
               "other": other_ops("numpy", "f32", "numba-q8", a.threads)}  # fmt: skip
        print(f"this tree {ROOT} against {a.other.resolve()}; load {os.getloadavg()[0]:.2f}")
        for name, make in cases(np.random.default_rng(0)):
            run = {side: make(o) for side, o in ops.items()}
            outs = {side: f() for side, f in run.items()}  # compiles or loads each tree's kernels
            diff = float(np.max(np.abs(outs["here"] - outs["other"])))
            times = {"here": [], "other": []}
            for rnd in range(a.rounds):
                for side in ("here", "other") if rnd % 2 == 0 else ("other", "here"):
                    t = time.perf_counter()
                    run[side]()
                    times[side].append(time.perf_counter() - t)
            med = {side: sorted(v)[len(v) // 2] * 1e3 for side, v in times.items()}
            ratio = sorted(o / h for h, o in zip(times["here"], times["other"], strict=True))
            n = len(ratio)
            print(f"{name:48s} here {med['here']:8.2f} ms  other {med['other']:8.2f} ms  "
                  f"x{ratio[n // 2]:.3f} [{ratio[n // 4]:.2f}-{ratio[3 * n // 4]:.2f}]  max|diff| {diff:.1e}")  # fmt: skip
        print(f"load {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
