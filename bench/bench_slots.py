"""Batched decode of several slots (`SlotSet.decode`) against one slot decoding alone, in one run: aggregate
decode tok/s with B = 1, 2, 4, 8 slots advancing together (one forward pass per step), each slot first
holding a prompt of --prompt tokens, and the ratio to B = 1. The engine's compute alone (no protocol, no
sampling): what the scheduler's steps can reach at best. With the numba kernels each B runs twice in turn:
the packed products a token row at a time (`row_dot`, what one slot alone runs) and each weight block
decoded once for the B rows (`rows_dot`, the engine's choice), with the ratio and the largest logit
difference between the two (the batched step against each slot decoded alone).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/bench_slots.py --model smollm2

The 1-minute load average is printed with the figures (these machines are shared), and the process's CPU time
per step beside the wall time (on a loaded machine, what the steps would take alone: a ratio of CPU times
holds better than one of rates).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from bench_engine import model_path
from strata_engine.ops import numba_ops
from strata_engine.ops.numba_ops import BY_ROW_MAX_ROWS, PACKED_MAX_ROWS
from strata_engine.settings import CpuKernels, EngineSettings
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
    numba = s.cpu_kernels == CpuKernels.NUMBA
    modes = {"by row": PACKED_MAX_ROWS, "grouped": BY_ROW_MAX_ROWS} if numba else {"": BY_ROW_MAX_ROWS}
    base = None
    for b in batches:
        rates, cpu_ms, logits = {}, {}, {}
        for mode, by_row_max in modes.items():
            numba_ops.BY_ROW_MAX_ROWS = by_row_max
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
        numba_ops.BY_ROW_MAX_ROWS = modes[list(modes)[-1]]
        rate = rates[list(modes)[-1]]
        base = base or rate
        cpu = cpu_ms[list(modes)[-1]]
        line = (f"B={b:2}: {rate:7.1f} tok/s aggregate, {1000 * b / rate:6.1f} ms/step ({cpu:6.1f} ms of CPU), "
                f"x{rate / base:.2f} of B=1")  # fmt: skip
        if numba:
            same = np.array_equal(logits["by row"].argmax(-1), logits["grouped"].argmax(-1))
            line += (f"; by row {rates['by row']:7.1f} tok/s ({cpu_ms['by row']:6.1f} ms of CPU), grouped "
                     f"x{rate / rates['by row']:.2f} of it (CPU x{cpu_ms['by row'] / cpu:.2f}), "
                     f"max |logit difference| {np.abs(logits['by row'] - logits['grouped']).max():.2e}, "
                     f"greedy tokens {'identical' if same else 'DIFFER'}")  # fmt: skip
        print(f"{line} (load {os.getloadavg()[0]:.2f})", flush=True)

if __name__ == "__main__":
    main()
