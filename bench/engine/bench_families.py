"""Each family's tiny model (tests/support/families.py) in strata-engine against llama.cpp b11549 on the same
file in the same run, with SmolLM2 (the shipped Q4_1 file) as the reference row: a family that lands slow is seen.

    prefill 512 tokens at 0 held, decode 32 tokens after one (llama-bench's -p 512 / -n 32 at depth 0)

llama.cpp's side is llama-server in this process (xllamacpp: its /completion `timings`, prompt_per_second and
predicted_per_second); llama-bench itself is not in the xllamacpp wheel. Both engines use --threads threads (2)
and f16 K/V; strata-engine its default kernels. The engines take turns (a repetition of each, --reps times);
every figure is the median of its repetitions (each printed), a ratio the median of each turn's. Every ratio is
printed, and a family is flagged when its ratio is more than 20 % below SmolLM2's.

The tiny models are the tests' of a given file type (default q4_k_m: the WIDE model, E = 256, in llama-quantize's
Q4_K_M mix), with --layers layers (the tests' 2 by default) so that a family's per-layer costs can be scaled past
the per-token ones. Run it with the OpenBLAS variables these machines set removed:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/engine/bench_families.py
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

# the engine's package before numpy (bench_engine.py: OpenBLAS's thread timeout is read when numpy loads it)
import strata_engine.process_env  # noqa: F401

# isort: split
import attrs
import numpy as np
from strata_engine.gguf import read_gguf
from strata_engine.runner import ModelRunner
from strata_engine.settings import EngineSettings
from strata_engine.slots import SlotSet

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from crossengine.llama_server import FLASH_ATTN, LlamaServer  # noqa: E402
from support.data import smollm2_model_path  # noqa: E402
from support.families import ALL_FILE_TYPES, BOS, FAMILIES, family_of, hf_model, write_gguf  # noqa: E402

PROMPT, GEN = 512, 32
SLOW = 0.8  # a family's ratio below this share of SmolLM2's is flagged


def _strata_step(runner: ModelRunner, prompt: list[int], bos: int) -> dict[str, float]:
    runner.erase()
    t = time.perf_counter()
    runner.prefill(prompt)
    prefill = PROMPT / (time.perf_counter() - t)
    runner.erase()
    token = int(np.argmax(runner.prefill([bos]).logits))
    t = time.perf_counter()
    for _ in range(GEN):
        token = int(np.argmax(runner.decode(token)))
    return {"prefill": prefill, "decode": GEN / (time.perf_counter() - t)}


def _llamacpp_step(server: LlamaServer, prompt: list[int], bos: int) -> dict[str, float]:
    fill = server.complete(prompt, 1, cache_prompt=False, ignore_eos=True)["timings"]
    assert fill["prompt_n"] == PROMPT, fill
    gen = server.complete([bos], GEN, cache_prompt=False, ignore_eos=True)["timings"]
    assert gen["predicted_n"] == GEN, gen
    return {"prefill": fill["prompt_per_second"], "decode": gen["predicted_per_second"]}


def rates(path: Path, prompt: list[int], bos: int, threads: int, reps: int) -> dict[str, dict[str, float]]:
    """Both engines on the file, taking turns (a load that comes and goes hits both): engine -> test -> the
    median tok/s, and "ratio" -> test -> the median of each turn's ratio."""
    runner = SlotSet.load(
        EngineSettings(model_path=path, kv_type="f16", n_ctx=PROMPT + GEN + 8, threads=threads)
    ).runners[0]
    runs: dict[str, dict[str, list[float]]] = {"strata": {}, "llama.cpp": {}, "ratio": {}}
    with tempfile.TemporaryDirectory() as slots:
        # flash attention off: llama-bench's default
        server = LlamaServer(path, Path(slots), FLASH_ATTN["v_trans"], threads=threads)
        for _ in range(reps):
            ours, theirs = _strata_step(runner, prompt, bos), _llamacpp_step(server, prompt, bos)
            for kind in ours:
                runs["strata"].setdefault(kind, []).append(ours[kind])
                runs["llama.cpp"].setdefault(kind, []).append(theirs[kind])
                runs["ratio"].setdefault(kind, []).append(ours[kind] / theirs[kind])
        del server
    runner.erase()
    for engine, by_kind in runs.items():
        for kind, v in by_kind.items():
            print(
                f"  {engine:9} {kind:7}: {', '.join(f'{x:.2f}' if engine == 'ratio' else f'{x:.1f}' for x in v)}"
            )
    return {engine: {k: float(np.median(v)) for k, v in by_kind.items()} for engine, by_kind in runs.items()}


def tiny_file(family: str, file_type: str, layers: int, folder: Path) -> Path:
    f = family_of(family, file_type)
    # a context that holds the prompt (llama-server caps its context at the file's)
    f = attrs.evolve(f, config=dict(f.config, num_hidden_layers=layers, max_position_embeddings=2048))
    return write_gguf(hf_model(f), f, folder / f"{family}-{file_type}-{layers}.gguf", file_type)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--file-type", default="q4_k_m", choices=list(ALL_FILE_TYPES))
    ap.add_argument("--layers", type=int, default=2, help="the tiny models' layer count (the tests': 2)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    print(
        f"cpu cores {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}, {args.threads} threads",
        flush=True,
    )
    rows: list[tuple[str, dict[str, dict[str, float]]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        smol = smollm2_model_path()
        bos = int(read_gguf(smol).metadata.get("tokenizer.ggml.bos_token_id", 1))
        prompt = [bos] + np.random.default_rng(3).integers(100, 20000, PROMPT - 1).tolist()
        models = [("smollm2", smol, prompt, bos)]
        for family in args.families:
            path = tiny_file(family, args.file_type, args.layers, Path(tmp))
            tiny = [BOS] + np.random.default_rng(3).integers(0, 256, PROMPT - 1).tolist()  # byte tokens
            models.append((family, path, tiny, BOS))
        for name, path, tokens, bos in models:
            print(f"{name} ({path.name}, {path.stat().st_size / 2**20:.1f} MiB)", flush=True)
            rows.append((name, rates(path, tokens, bos, args.threads, args.reps)))
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    reference = rows[0][1]["ratio"]
    print(f"{'model':14} {'test':12} {'strata':>8} {'llama.cpp':>10} {'ratio':>6} {'/ smollm2':>9}")
    for name, figures in rows:
        for kind in ("prefill", "decode"):
            ratio = figures["ratio"][kind]
            rel = ratio / reference[kind]
            flag = "  SLOW" if rel < SLOW else ""
            test = f"{kind} {PROMPT if kind == 'prefill' else GEN}"
            ours, theirs = figures["strata"][kind], figures["llama.cpp"][kind]
            print(f"{name:14} {test:12} {ours:>8.1f} {theirs:>10.1f} {ratio:>6.2f} {rel:>9.2f}{flag}")


if __name__ == "__main__":
    main()
