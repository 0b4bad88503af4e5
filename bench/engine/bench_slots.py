"""Batched decode of several slots (`SlotSet.decode`) against one slot decoding alone, in one run: aggregate
decode tok/s with B = 1, 2, 4, 8 slots advancing together (one forward pass per step), each slot first
holding a prompt of --prompt tokens, and the ratio to B = 1. The engine's compute alone (no protocol, no
sampling): what the scheduler's steps can reach at best. With `--cpu-kernels numba` each B runs in turn
the packed products a token row at a time (`row_dot`, what one slot alone runs) and each weight block
decoded once for the B rows (`rows_dot`, numba's choice), with the ratio and the largest logit difference
between the two (the batched step against each slot decoded alone); with `numba-q8` (the default where
the CPU has AVX512-VNNI: tiled weights) the q8 products alone.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/engine/bench_slots.py --model smollm2

The 1-minute load average is printed with the figures (these machines are shared), and the process's CPU time
per step beside the wall time (on a loaded machine, what the steps would take alone: a ratio of CPU times
holds better than one of rates).
"""

from __future__ import annotations

import argparse
import os
import time

# the engine's package before numpy, as in the engine's own process: it sets OpenBLAS's thread timeout,
# read when numpy loads OpenBLAS (imported after numpy, BLAS threads spin ~0.1 s after each call, slowing the
# kernels that follow: gemma3's prefill at 4,096 held by ~25 %, bench/engine/DECISIONS.md "Compiled kernels")
import strata_engine.process_env  # noqa: F401  (first: the engine's environment precedes numpy's OpenBLAS)

# isort: split
import numpy as np
from bench_engine import model_path
from strata_engine.ops import numba_ops
from strata_engine.ops.numba_ops import BY_ROW_MAX_ROWS, PACKED_MAX_ROWS
from strata_engine.settings import NUMBA_KERNELS, EngineSettings
from strata_engine.slots import SlotSet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("smollm2", "gemma3"), default="smollm2")
    parser.add_argument("--batches", default="1,2,4,8,16", help="slots decoding together, comma-separated")
    parser.add_argument("--prompt", type=int, default=128, help="tokens each slot holds before decoding")
    parser.add_argument("--gen", type=int, default=32, help="decode steps per batch size")
    parser.add_argument("--n-ctx-slot", type=int, default=1024)
    parser.add_argument("--kv-type", default="f16")
    parser.add_argument("--cpu-kernels", default=None)
    parser.add_argument("--backend", default="numpy")
    parser.add_argument("--threads", type=int, default=None, help="default: the cores this process may use")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    n_slots = max(batches)
    settings = EngineSettings(model_path(args.model), n_ctx=n_slots * args.n_ctx_slot, n_slots=n_slots,
                              kv_type=args.kv_type, cpu_kernels=args.cpu_kernels, backend=args.backend,
                              threads=args.threads)  # fmt: skip
    slots = SlotSet.load(settings)
    s = slots.runners[0].settings
    print(f"{args.model}: backend {s.backend}, kernels {s.cpu_kernels}, threads {s.threads}, K/V {s.kv_type}, "
          f"{n_slots} slots of {slots.n_ctx_slot} tokens; prompt {args.prompt}, {args.gen} steps")  # fmt: skip
    rng = np.random.default_rng(0)
    first = {}
    for slot in range(n_slots):
        prompt = [int(t) for t in rng.integers(100, 20000, args.prompt)]
        first[slot] = int(np.argmax(slots.runners[slot].prefill(prompt).logits))
    numba = s.cpu_kernels in NUMBA_KERNELS
    ops = slots.runners[0].model.ops
    # mode -> (BY_ROW_MAX_ROWS, q8 products); the kernels asked for run last and give the main figures
    modes = {"": (BY_ROW_MAX_ROWS, False)}
    if (
        numba and ops.q8
    ):  # tiled weights: the q8 kernels only (the float32 ones would read an untiled copy a call)
        modes = {"q8": (BY_ROW_MAX_ROWS, True)}
    elif numba:
        modes = {"by row": (PACKED_MAX_ROWS, False), "grouped": (BY_ROW_MAX_ROWS, False)}
    main_mode = list(modes)[-1]
    base = None
    for b in batches:
        rates, cpu_ms, logits = {}, {}, {}
        for mode, (by_row_max, q8) in modes.items():
            numba_ops.BY_ROW_MAX_ROWS = by_row_max
            if numba:
                ops.q8 = q8
            for slot in range(b):
                slots.runners[slot].cut_back(args.prompt)
            tokens = [first[slot] for slot in range(b)]
            slots.decode(list(enumerate(tokens)))  # warm: first step allocates
            steps = []
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.gen):
                steps.append(slots.decode(list(enumerate(tokens))))
                tokens = [int(np.argmax(row)) for row in steps[-1]]
            rates[mode] = b * args.gen / (time.perf_counter() - t0)
            cpu_ms[mode] = 1000 * (time.process_time() - c0) / args.gen
            logits[mode] = np.stack(steps)
        numba_ops.BY_ROW_MAX_ROWS, q8 = modes[main_mode]
        if numba:
            ops.q8 = q8
        rate = rates[main_mode]
        base = base or rate
        cpu = cpu_ms[main_mode]
        line = (f"B={b:2}: {main_mode or 'numpy'} {rate:7.1f} tok/s aggregate, {1000 * b / rate:6.1f} ms/step "
                f"({cpu:6.1f} ms of CPU), x{rate / base:.2f} of B=1")  # fmt: skip
        for mode in list(modes)[:-1]:
            same = np.array_equal(logits[mode].argmax(-1), logits[main_mode].argmax(-1))
            line += (f"; {mode} {rates[mode]:7.1f} tok/s ({cpu_ms[mode]:6.1f} ms of CPU): {main_mode} x"
                     f"{rate / rates[mode]:.2f} of it (CPU x{cpu_ms[mode] / cpu:.2f}), max |logit difference| "
                     f"{np.abs(logits[mode] - logits[main_mode]).max():.2e}, greedy tokens "
                     f"{'identical' if same else 'DIFFER'}")  # fmt: skip
        print(f"{line} (load {os.getloadavg()[0]:.2f})", flush=True)


if __name__ == "__main__":
    main()
