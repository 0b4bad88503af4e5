"""Batched decode on the GPU (cupy backend): step time per batch size B op by op against the batched CUDA
graphs (`graph.BatchDecodeGraph`), and aggregate decode tok/s of B slots decoding together with the ratio
to one slot, in one run per model. The engine alone (`SlotSet.decode`, greedy sampling on the host per
row): what the scheduler's decode steps can reach at B concurrent streams.

    python3 bench/bench_gpu_slots.py --model smollm2=/tmp/smollm2.gguf --model gemma3=/tmp/gemma3.gguf

Each slot first holds its own --prompt random tokens (prefilled op by op on both sides); every B decodes
--gen steps from there (cut back to the prompt before each B). Issue 15's goal: x6 at B = 8 on the H200.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from strata_engine.settings import EngineSettings
from strata_engine.slots import SlotSet

DTYPES = {"smollm2": "f16", "gemma3": "bf16"}  # the engine's default compute dtype per model on the GPU


def run(slots: SlotSet, b: int, first: list[int], n_prompt: int, gen: int) -> tuple[float, list[list[int]]]:
    """Seconds per step of slots 0..b-1 decoding together (greedy), and each slot's tokens."""
    for slot in range(b):
        slots.runners[slot].cut_back(n_prompt)
    tokens = [[first[slot]] for slot in range(b)]
    slots.decode([(s, tokens[s][-1]) for s in range(b)])  # warm: the first step of a size
    for slot in range(b):
        slots.runners[slot].cut_back(n_prompt)
    t0 = time.perf_counter()
    for _ in range(gen):
        logits = slots.decode([(s, tokens[s][-1]) for s in range(b)])
        for s, row in enumerate(logits):
            tokens[s].append(int(np.argmax(row)))
    return (time.perf_counter() - t0) / gen, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", required=True, help="NAME=PATH (smollm2 or gemma3)")
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--prompt", type=int, default=128, help="tokens each slot holds before decoding")
    parser.add_argument("--gen", type=int, default=64, help="decode steps per batch size")
    parser.add_argument("--n-ctx-slot", type=int, default=1024)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    n_slots = max(batches)
    results = {}
    for spec in args.model:
        name, path = spec.split("=", 1)
        settings = EngineSettings(Path(path), n_ctx=n_slots * args.n_ctx_slot, n_slots=n_slots, backend="cupy",
                                  compute_dtype=DTYPES[name], kv_type="f16")  # fmt: skip
        t0 = time.perf_counter()
        graphed = SlotSet.load(settings)
        load_s = time.perf_counter() - t0
        eager = SlotSet.sharing(graphed.runners[0], n_slots=n_slots, n_ctx=n_slots * args.n_ctx_slot, cuda_graphs=False)
        print(f"{name} {DTYPES[name]}: {n_slots} slots of {graphed.n_ctx_slot} tokens, prompt {args.prompt}, "
              f"{args.gen} steps; batch graphs {[g.n_tokens for g in graphed.batch_graphs]} captured in "
              f"{graphed.graph_capture_s * 1000:.0f} ms (load {load_s:.1f} s)")  # fmt: skip
        rng = np.random.default_rng(0)
        first = []
        for slot in range(n_slots):
            prompt = [int(t) for t in rng.integers(100, 20000, args.prompt)]
            for slots in (graphed, eager):
                slots.runners[slot].prefill_graphs = ()  # the same K/V on both sides
                logits = slots.runners[slot].prefill(prompt).logits
            first.append(int(np.argmax(logits)))
        rows, base = [], None
        for b in batches:
            t_eager, tok_eager = run(eager, b, first, args.prompt, args.gen)
            t_graph, tok_graph = run(graphed, b, first, args.prompt, args.gen)
            same = sum(a == c for x, y in zip(tok_eager, tok_graph, strict=True) for a, c in zip(x, y, strict=True))
            rate = b / t_graph
            base = base or rate
            rows.append({"b": b, "eager_ms": 1000 * t_eager, "graph_ms": 1000 * t_graph, "tok_s": rate,
                         "tok_s_eager": b / t_eager, "x_one": rate / base})  # fmt: skip
            print(f"  B={b}: step op by op {1000 * t_eager:6.2f} ms, graph {1000 * t_graph:6.3f} ms "
                  f"(x{t_eager / t_graph:.1f}); aggregate {rate:7.0f} tok/s (op by op {b / t_eager:6.0f}), "
                  f"x{rate / base:.2f} of B=1; greedy tokens equal {same}/{b * (args.gen + 1)}")  # fmt: skip
        results[name] = rows
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
