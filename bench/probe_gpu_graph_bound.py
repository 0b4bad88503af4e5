"""Where the decode graph's logits leave op by op's (tests/engine/test_gpu_model.py
test_cuda_graph_decode_matches_op_by_op): per step, the graph replay against the same captured code run
uncaptured (the capture itself), that code against op by op (the key splits sized for the whole pool, and
the position read on the device), and both against an f32-compute runner fed the same tokens (how far
each lies from the exact result: round-off or a bug).

    python3 bench/probe_gpu_graph_bound.py --model gemma3=/tmp/gemma3.gguf --dtype bf16 --prompt 1500
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from strata_engine.runner import ModelRunner
from strata_engine.settings import EngineSettings


def rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def uncaptured(graph, cp):  # noqa: ANN001, ANN202 - the decode graph's own step, run op by op
    def step(tokens, pos, want_logits=True):  # noqa: ANN001, ANN202
        graph.inputs.stage(tokens, pos, graph.stream)
        cp.cuda.Stream.null.synchronize()
        with graph.stream:
            out = graph._run()
        return out.get(stream=graph.stream)[0]

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="NAME=PATH")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--prompt", type=int, default=1500)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--seeds", default="1500,1,2,3")
    args = parser.parse_args()
    import cupy as cp

    name, path = args.model.split("=", 1)
    load = lambda dtype: ModelRunner.load(EngineSettings(Path(path), n_ctx=2048, backend="cupy",  # noqa: E731
                                                         compute_dtype=dtype, kv_type="f16"))  # fmt: skip
    graphed = load(args.dtype)
    graphed.prefill_graphs = ()
    code = graphed.sibling()
    code.prefill_graphs = ()
    code.decode_graph.step = uncaptured(code.decode_graph, cp)
    eager = graphed.sibling(cuda_graphs=False)
    exact = load("f32")
    print(f"{name} {args.dtype}, prompt {args.prompt}; per seed: max over {args.steps} steps (step of the max)")
    print("  seed  graph/uncaptured  uncaptured/op-by-op  graph/op-by-op  graph/f32  op-by-op/f32  op-by-op/f32 median")
    for seed in (int(s) for s in args.seeds.split(",")):
        prompt = np.random.default_rng(seed).integers(100, 5000, args.prompt).tolist()
        for r in (graphed, code, eager, exact):
            r.erase()
        outs = [r.prefill(prompt).logits for r in (graphed, code, eager, exact)]
        token = int(np.argmax(outs[2]))
        errs = []
        for _ in range(args.steps):
            g, c, e, x = (r.decode(token) for r in (graphed, code, eager, exact))
            errs.append((rel(g, c), rel(c, e), rel(g, e), rel(g, x), rel(e, x)))
            token = int(np.argmax(e))
        errs = np.asarray(errs)
        worst = [f"{errs[:, i].max():.4f} ({int(errs[:, i].argmax())})" for i in range(5)]
        print(f"  {seed:5d}  " + "  ".join(f"{w:>16}" for w in worst) + f"  {np.median(errs[:, 4]):.4f}")


if __name__ == "__main__":
    main()
