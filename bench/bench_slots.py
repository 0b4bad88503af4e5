"""Batched decode of several slots (`SlotSet.decode`) against one slot decoding alone, in one run: aggregate
decode tok/s with B = 1, 2, 4, 8 slots advancing together (one forward pass per step), each slot first
holding a prompt of --prompt tokens, and the ratio to B = 1. The engine's compute alone (no protocol, no
sampling): what the scheduler's steps can reach at best.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/bench_slots.py --model smollm2

The 1-minute load average is printed with the figures (these machines are shared).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from bench_engine import model_path
from strata_engine.settings import EngineSettings
from strata_engine.slots import SlotSet


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("smollm2", "gemma3"), default="smollm2")
    parser.add_argument("--batches", default="1,2,4,8", help="slots decoding together, comma-separated")
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
    base = None
    for b in batches:
        for slot in range(b):
            slots.runners[slot].cut_back(args.prompt)
        tokens = [first[slot] for slot in range(b)]
        slots.decode(list(enumerate(tokens)))  # warm: first step allocates
        t0 = time.perf_counter()
        for _ in range(args.gen):
            logits = slots.decode(list(enumerate(tokens)))
            tokens = [int(np.argmax(row)) for row in logits]
        dt = time.perf_counter() - t0
        rate = b * args.gen / dt
        base = base or rate
        print(f"B={b}: {rate:7.1f} tok/s aggregate, {1000 * dt / args.gen:6.1f} ms/step, x{rate / base:.2f} of B=1 "
              f"(load {os.getloadavg()[0]:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
