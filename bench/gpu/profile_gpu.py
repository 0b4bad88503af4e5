"""Where the host time of a GPU prefill and decode goes: cProfile of the engine on the cupy backend.

    python3 bench/gpu/profile_gpu.py --model PATH [--dtype bf16] [--prompt 512] [--steps 32]

Prints, for a warm runner: the wall time of one prefill and of decode steps replayed from the CUDA
graph and run op by op; the device time of one prefill per operation (`gpu_time_by_op`: the work is
queued behind a ~0.3 s spin kernel, so the device runs it back to back and the events between the
operations measure device time, not the host's launch gaps); then the 25 functions with the most own
time in the profiled prefill and in the op-by-op decode steps. Host time above the device's time is
launch overhead. `--op-cost`: instead, each operation's cost inside the decode graph: the graph is captured
again with that operation launched twice (its first result dropped) and the replay's growth is its cost
(launch gaps included, which the op-by-op events cannot separate).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np

# Operations of CupyOps timed by gpu_time_by_op (a call inside another is subtracted from it: self time).
TIMED_OPS = (
    "embed",
    "rms_norm",
    "add_rms_norm",
    "project",
    "matmul",
    "gated_mlp",
    "qk_norm_rope",
    "store_kv",
    "attention",
    "flash_attention",
    "logits",
)
SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {}
}
"""


def gpu_time_by_op(ops, run) -> tuple[float, float, dict[str, tuple[int, float]]]:
    """(wall s of run() from its first launch, device ms of the whole run, {op: (calls, self device ms)})."""
    import cupy as cp

    spin = cp.RawKernel(SPIN, "spin")
    records: list = []  # (name, start event, end event, depth)
    depth = [0]

    def timed(name, fn):
        def call(*a, **k):
            start = cp.cuda.Event()
            start.record()
            depth[0] += 1
            try:
                return fn(*a, **k)
            finally:
                depth[0] -= 1
                end = cp.cuda.Event()
                end.record()
                records.append((name, start, end, depth[0]))

        return call

    saved = {name: getattr(ops, name) for name in TIMED_OPS}
    for name, fn in saved.items():
        setattr(ops, name, timed(name, fn))
    try:
        ops.synchronize()
        spin((1,), (1,), (np.int64(600_000_000),))  # ~0.3 s: the host queues the whole run meanwhile
        first = cp.cuda.Event()
        first.record()
        t0 = time.perf_counter()
        run()
        wall = time.perf_counter() - t0
        last = cp.cuda.Event()
        last.record()
        last.synchronize()
    finally:
        for name in saved:
            delattr(ops, name)
    total = cp.cuda.get_elapsed_time(first, last)
    out: dict[str, list] = {}
    # Self time: a record's time minus that of the calls one level deeper made inside it (records are
    # appended as calls end, so those are the deeper records just before it).
    for i, (name, start, end, d) in enumerate(records):
        inner = 0.0
        for _inner_name, s2, e2, d2 in records[:i][::-1]:
            if d2 <= d:
                break
            if d2 == d + 1:
                inner += cp.cuda.get_elapsed_time(s2, e2)
        entry = out.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += cp.cuda.get_elapsed_time(start, end) - inner
    return wall, total, {k: (v[0], v[1]) for k, v in out.items()}


def decode_device_profile(graphed, eager, ops, depth: int, steps: int = 64) -> None:
    """One decode step at `depth` held tokens: the device time of a graph replay (events around
    `steps` replays queued back to back) against the device time per op of the same step run op by op
    (queued behind the spin kernel, so launch gaps are not counted)."""
    import cupy as cp

    tokens = np.random.default_rng(1).integers(100, 5000, depth).tolist()
    for runner in (graphed, eager):
        runner.erase()
        runner.prefill(tokens)
    tok = 7
    graphed.decode(tok)
    graphed.cut_back(depth)
    ops.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        graphed.decode(tok)
        graphed.cut_back(depth)
    ops.synchronize()
    wall = (time.perf_counter() - t0) / steps
    spin = cp.RawKernel(SPIN, "spin")
    graph = graphed.graphs.decode
    if graph is None:  # f32 compute: no graphs (graph.py); the op-by-op step alone
        eager = graphed
    with graph.stream if graph is not None else cp.cuda.Stream() as stream:
        spin((1,), (1,), (np.int64(600_000_000),))
        first = cp.cuda.Event()
        first.record(stream)
        for _ in range(steps if graph is not None else 0):  # the replays alone, queued behind the spin
            graph.graph.launch(stream)
        last = cp.cuda.Event()
        last.record(stream)
    last.synchronize()
    replay = cp.cuda.get_elapsed_time(first, last) / steps if graph is not None else float("nan")
    eager.decode(tok)
    eager.cut_back(depth)
    ops.synchronize()
    _wall, total, by_op = gpu_time_by_op(ops, lambda: eager.decode(tok))
    eager.cut_back(depth)
    print(
        f"---- decode at {depth} held: {wall * 1e3:.3f} ms/token graphed (host loop), one graph replay "
        f"{replay * 1e3:.1f} us on the device; the same step op by op, queued back to back: "
        f"{total * 1e3:.1f} us of device time ----"
    )
    for name, (calls, ms) in sorted(by_op.items(), key=lambda kv: -kv[1][1]):
        print(
            f"  {name:16s} {calls:5d} calls  {ms * 1e3:8.1f} us  {ms * 1e3 / calls:6.2f} us/call  "
            f"{ms / total * 100:5.1f} %"
        )
    rest = total - sum(ms for _calls, ms in by_op.values())
    print(f"  {'(between ops)':16s}              {rest * 1e3:8.1f} us  {rest / total * 100:5.1f} %")


GRAPH_OPS = (
    "rms_norm",
    "add_rms_norm",
    "project",
    "matmul",
    "gated_mlp",
    "qk_norm_rope",
    "store_kv",
    "flash_attention",
    "logits_f32",
    "argmax_rows",
)


def replay_us(runner, depth: int, steps: int = 64) -> float:
    """Device us of one decode-graph replay at `depth` held, the graph captured anew (median of 5 rounds of
    `steps` replays queued back to back behind a spin kernel)."""
    import cupy as cp

    graph = runner.graphs.decode
    graph.graph = None  # the next step captures again, with whatever the ops do now
    runner.decode(7)
    runner.cut_back(depth)
    spin = cp.RawKernel(SPIN, "spin")
    rounds = []
    for _ in range(5):
        with graph.stream as stream:
            spin((1,), (1,), (np.int64(100_000_000),))
            first = cp.cuda.Event()
            first.record(stream)
            for _ in range(steps):
                graph.graph.launch(stream)
            last = cp.cuda.Event()
            last.record(stream)
        last.synchronize()
        rounds.append(cp.cuda.get_elapsed_time(first, last) * 1e3 / steps)
    return float(np.median(rounds))


def op_costs(runner, ops, depth: int) -> None:
    """Each of GRAPH_OPS's cost in the decode graph: its replay with the op launched twice, less the plain one."""
    runner.erase()
    runner.prefill(np.random.default_rng(1).integers(100, 5000, depth).tolist())
    calls: dict[str, int] = {}

    def counted(name, fn):
        def call(*a, **k):
            calls[name] = calls.get(name, 0) + 1
            return fn(*a, **k)

        return call

    for name in GRAPH_OPS:
        setattr(ops, name, counted(name, getattr(type(ops), name).__get__(ops)))
    base = replay_us(runner, depth)  # the capture's run and the captured one: calls counted twice
    for name in GRAPH_OPS:
        delattr(ops, name)
    print(f"---- decode graph at {depth} held: one replay {base:.1f} us; each op's cost in it (replayed with the "
          f"op twice) ----")  # fmt: skip
    for name in GRAPH_OPS:
        fn = getattr(type(ops), name).__get__(ops)

        def twice(*a, _fn=fn, **k):
            _fn(*a, **k)
            return _fn(*a, **k)

        setattr(ops, name, twice)
        try:
            extra = replay_us(runner, depth) - base
        finally:
            delattr(ops, name)
        n = calls.get(name, 0) // 2
        print(f"  {name:16s} {n:5d} calls  {extra:8.1f} us  {extra / max(n, 1):6.2f} us/call  "
              f"{extra / base * 100:5.1f} %")  # fmt: skip
    replay_us(runner, depth)  # the plain graph again


def main() -> int:
    from strata_engine.settings import EngineSettings
    from strata_engine.slots import SlotSet

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--decode-depths", type=int, nargs="*", default=[512, 4096])
    ap.add_argument("--op-cost", action="store_true")
    args = ap.parse_args()
    settings = EngineSettings(
        model_path=Path(args.model), n_ctx=8192, backend="cupy", compute_dtype=args.dtype
    )
    graphed = SlotSet.load(settings).runners[0]
    eager = SlotSet(graphed.loaded.with_settings(cuda_graphs=False), 1).runners[0]
    tokens = np.random.default_rng(0).integers(100, 5000, args.prompt).tolist()
    ops = graphed.model.ops

    def prefill_and_decode(runner, steps: int) -> tuple[float, float]:
        runner.erase()
        ops.synchronize()
        t0 = time.perf_counter()
        tok = int(np.argmax(runner.prefill(tokens).logits))
        t1 = time.perf_counter()
        for _ in range(steps):
            tok = int(np.argmax(runner.decode(tok)))
        return t1 - t0, (time.perf_counter() - t1) / max(steps, 1)

    for runner in (graphed, eager):  # warm-up: kernels, cuBLAS, the graph's capture
        prefill_and_decode(runner, 4)
    if args.op_cost:
        for depth in args.decode_depths:
            op_costs(graphed, ops, depth)
        return 0
    for name, runner in (("graph", graphed), ("op by op", eager)):
        pf, dc = prefill_and_decode(runner, args.steps)
        print(
            f"{name:9s} prefill {args.prompt} tokens {pf * 1e3:8.2f} ms   decode {dc * 1e3:7.3f} ms/token",
            flush=True,
        )
    eager.erase()
    ops.synchronize()
    wall, total, by_op = gpu_time_by_op(ops, lambda: eager.prefill(tokens))
    print(
        f"---- device time of one {args.prompt}-token prefill, queued back to back: {total:.2f} ms "
        f"(host queued it in {wall * 1e3:.2f} ms) ----"
    )
    for name, (calls, ms) in sorted(by_op.items(), key=lambda kv: -kv[1][1]):
        print(f"  {name:16s} {calls:5d} calls  {ms:8.3f} ms  {ms / total * 100:5.1f} %")
    rest = total - sum(ms for _calls, ms in by_op.values())
    print(f"  {'(between ops)':16s}              {rest:8.3f} ms  {rest / total * 100:5.1f} %")
    for depth in args.decode_depths:
        decode_device_profile(graphed, eager, ops, depth)
    for title, steps in (("prefill", 0), ("decode op by op", args.steps)):
        prof = cProfile.Profile()
        eager.erase()
        prof.enable()
        prefill_and_decode(eager, steps)
        prof.disable()
        print(f"---- {title} (profiled, prefill included) ----")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
