"""Batched decode on the GPU (cupy backend): step time per batch size B op by op against the batched CUDA
graphs (`graph.BatchDecodeGraph`), and aggregate decode tok/s of B slots decoding together with the ratio
to one slot, in one run per model. The engine alone, greedy, three ways: "logits" (`SlotSet.decode`, every
row's logits downloaded, np.argmax on the host: the path before the device argmax), "rows" (`decode_rows`
with every row asking for its logits: pinned, as a sampled row gets them) and "argmax" (`decode_rows` with
argmax_only rows: the argmax in the graph, B token ids downloaded: the scheduler's greedy path). What the
scheduler's decode steps can reach at B concurrent streams.

    python3 bench/gpu/bench_gpu_slots.py --model smollm2=/tmp/smollm2.gguf --model gemma3=/tmp/gemma3.gguf

Each slot first holds its own --prompt random tokens (prefilled op by op on both sides); every B decodes
--gen steps from there (cut back to the prompt before each B). The goal: x6 at B = 8 on the H200.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from strata_engine.sampling import Argmax
from strata_engine.settings import EngineSettings
from strata_engine.slots import SlotSet

PATHS = ("logits", "rows", "argmax")

DTYPES = {"smollm2": "f16", "gemma3": "bf16"}  # the engine's default compute dtype per model on the GPU


def _step(slots: SlotSet, steps: list[tuple[int, int]], path: str) -> list:
    if path == "logits":
        return list(slots.decode(steps))
    return slots.decode_rows(steps, [path == "argmax"] * len(steps))


def run(slots: SlotSet, b: int, first: list[int], n_prompt: int, gen: int,
        path: str = "logits") -> tuple[float, float, list[list[int]]]:  # fmt: skip
    """Seconds per step of slots 0..b-1 decoding together (greedy, by `path`), of it the host's argmax, and
    each slot's tokens."""
    for slot in range(b):
        slots.runners[slot].cut_back(n_prompt)
    tokens = [[first[slot]] for slot in range(b)]
    _step(slots, [(s, tokens[s][-1]) for s in range(b)], path)  # warm: the first step of a size
    for slot in range(b):
        slots.runners[slot].cut_back(n_prompt)
    t0 = time.perf_counter()
    sampling = 0.0
    for _ in range(gen):
        out = _step(slots, [(s, tokens[s][-1]) for s in range(b)], path)
        t1 = time.perf_counter()
        for s, row in enumerate(out):
            tokens[s].append(row.token if isinstance(row, Argmax) else int(np.argmax(row)))
        sampling += time.perf_counter() - t1
    return (time.perf_counter() - t0) / gen, sampling / gen, tokens


def same(x: list[list[int]], y: list[list[int]]) -> int:
    """How many tokens of two runs' slots are equal, position by position."""
    return sum(a == c for p, q in zip(x, y, strict=True) for a, c in zip(p, q, strict=True))


def device_ms(slots: SlotSet, b: int, n_prompt: int, first: list[int], replays: int = 50) -> float:
    """Device time of one replay of the graph a step of b slots takes (b back-to-back replays between two
    events: the host's staging, synchronisation and logits download are not counted)."""
    import cupy as cp

    steps = [(slots.runners[s].pool.slot, n_prompt, first[s]) for s in range(b)]
    if b == 1:
        graph = slots.runners[0].graphs.decode
        graph.inputs.stage([first[0]], n_prompt, graph.stream)
    else:
        graph = next(g for g in slots.batch_graphs.graphs if g.n_tokens >= b)
        graph.batch_inputs.stage(steps, graph.stream)
    graph.graph.launch(graph.stream)  # stores the K/V of position n_prompt again: the same values
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(graph.stream)
    for _ in range(replays):
        graph.graph.launch(graph.stream)
    end.record(graph.stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / replays


SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}
"""
OPS = ("embed", "rms_norm", "project", "qk_norm_rope", "store_kv_rows", "flash_attention_rows", "matmul",
       "add_rms_norm", "gated_mlp", "logits_f32")  # fmt: skip


def op_profile(slots: SlotSet, b: int, n_prompt: int, first: list[int]) -> dict[str, float]:
    """Device microseconds per op name of one batched step of b rows run uncaptured (each op between two
    events: ~3 us of event overhead per call included), summed over the layers."""
    import cupy as cp
    from strata_engine.graph import BatchDecodeGraph

    graph = next((g for g in slots.batch_graphs.graphs if g.n_tokens == b), None)
    if graph is None:
        graph = BatchDecodeGraph(slots.model, slots.runners[0].placement, b)
        graph.prepare()
    graph.batch_inputs.stage(
        [(slots.runners[s].pool.slot, n_prompt, first[s]) for s in range(b)], graph.stream
    )
    ops = slots.model.ops
    times: dict[str, list] = {}
    originals = {name: getattr(ops, name) for name in OPS}

    def timed(name, fn):  # noqa: ANN001, ANN202
        def call(*a, **k):  # noqa: ANN002, ANN003, ANN202
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            out = fn(*a, **k)
            e1.record()
            times.setdefault(name, []).append((e0, e1))
            return out

        return call

    for name, fn in originals.items():
        setattr(ops, name, timed(name, fn))
    try:
        with graph.stream:
            cp.RawKernel(SPIN, "spin")(
                (1,), (1,), (np.int64(600_000_000),)
            )  # ~0.3 s: the host queues the step
            graph._run()
            graph.stream.synchronize()
    finally:
        for name in OPS:
            delattr(ops, name)
    return {
        name: sum(cp.cuda.get_elapsed_time(a, z) for a, z in pairs) * 1000 for name, pairs in times.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", required=True, help="NAME=PATH (smollm2 or gemma3)")
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--prompt", type=int, default=128, help="tokens each slot holds before decoding")
    parser.add_argument("--gen", type=int, default=64, help="decode steps per batch size")
    parser.add_argument("--n-ctx-slot", type=int, default=1024)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--profile", action="store_true", help="device time per op of a step, per B")
    parser.add_argument("--head-gemv-rows", default="", help="replay times with the head on strata_gemv up to "
                        "these row counts (comma-separated), cuBLAS beyond")  # fmt: skip
    parser.add_argument("--gemv-rows", default="", help="replay times with the layers' products on strata_gemv "
                        "up to these row counts (comma-separated), cuBLAS beyond")  # fmt: skip
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
        eager = SlotSet(
            graphed.loaded.with_settings(n_ctx=n_slots * args.n_ctx_slot, cuda_graphs=False), n_slots
        )
        print(f"{name} {DTYPES[name]}: {n_slots} slots of {graphed.n_ctx_slot} tokens, prompt {args.prompt}, "
              f"{args.gen} steps; batch graphs {[g.n_tokens for g in graphed.batch_graphs.graphs]}; all graphs captured "
              f"in {graphed.loaded.graph_capture_s * 1000:.0f} ms (load {load_s:.1f} s)")  # fmt: skip
        rng = np.random.default_rng(0)
        first = []
        for slot in range(n_slots):
            prompt = [int(t) for t in rng.integers(100, 20000, args.prompt)]
            for slots in (graphed, eager):
                slots.runners[slot].graphs.prefill = ()  # the same K/V on both sides
                logits = slots.runners[slot].prefill(prompt).logits
            first.append(int(np.argmax(logits)))
        rows, base = [], {}
        for b in batches:
            t_eager, _, tok_eager = run(eager, b, first, args.prompt, args.gen)
            replay = device_ms(graphed, b, args.prompt, first)
            row = {"b": b, "eager_ms": 1000 * t_eager, "tok_s_eager": b / t_eager, "replay_ms": replay}
            print(f"  B={b}: step op by op {1000 * t_eager:6.2f} ms ({b / t_eager:6.0f} tok/s); one graph replay "
                  f"{replay:.3f} ms of device time")  # fmt: skip
            tok_paths = {}
            for path in PATHS:
                t_graph, t_sample, tok_graph = run(graphed, b, first, args.prompt, args.gen, path)
                tok_paths[path] = tok_graph
                rate = b / t_graph
                base.setdefault(path, rate)
                row[path] = {"graph_ms": 1000 * t_graph, "tok_s": rate, "x_one": rate / base[path],
                             "x_one_logits": rate / base["logits"], "host_argmax_ms": 1000 * t_sample,
                             "tokens_equal_op_by_op": same(tok_eager, tok_graph),
                             "tokens_equal_logits_path": same(tok_paths["logits"], tok_graph)}  # fmt: skip
                print(f"    {path:6s}: step {1000 * t_graph:6.3f} ms (x{t_eager / t_graph:4.1f} of op by op; host "
                      f"argmax {1000 * t_sample:.3f} ms); aggregate {rate:7.0f} tok/s, x{rate / base[path]:.2f} of "
                      f"its B=1 (x{rate / base['logits']:.2f} of logits' B=1); greedy tokens equal to op by op "
                      f"{same(tok_eager, tok_graph)}, to the logits path {same(tok_paths['logits'], tok_graph)}, "
                      f"of {b * (args.gen + 1)}")  # fmt: skip
            rows.append(row)
        results[name] = rows
        variants = [("HEAD_GEMV_ROWS", r) for r in args.head_gemv_rows.split(",") if r]
        variants += [("GEMV_ROWS", r) for r in args.gemv_rows.split(",") if r]
        for constant, rows in variants:
            from strata_engine.ops import cupy_ops

            kept = getattr(cupy_ops, constant)
            setattr(cupy_ops, constant, int(rows))
            try:
                other = SlotSet(graphed.loaded.with_settings(n_ctx=n_slots * args.n_ctx_slot), n_slots)
                times = [device_ms(other, b, args.prompt, first) for b in batches]
            finally:
                setattr(cupy_ops, constant, kept)
            print(f"  {constant} = {rows}: one replay " + ", ".join(f"{t:.3f}" for t in times)
                  + f" ms at B = {args.batches}")  # fmt: skip
        if args.profile:
            prof = {b: op_profile(graphed, b, args.prompt, first) for b in batches}
            print("  device us per op of a step run uncaptured (B = " + ", ".join(map(str, batches)) + ")")
            for op in OPS:
                if op in prof[batches[0]]:
                    print(f"    {op:22s}" + "".join(f"{prof[b].get(op, 0):9.1f}" for b in batches))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
