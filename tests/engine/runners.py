"""Loaded real models for the engine's numerics, model and prompt-cache tests, once per test process,
and reading the reference runs.

`base_runner(name)` loads a model once (f32 compute, f32 K/V, numba's float32 products: the engine's
math closest to transformers'; the default q8 products have their own reference tests in test_q8.py);
tests take `.sibling(...)` runners that share its weights with their own K/V pool, so several K/V settings
cost one load.
"""

from __future__ import annotations

import functools

import numpy as np
from strata_engine.runner import ModelRunner
from strata_engine.settings import EngineSettings
from support.data import gemma3_model_path, load_reference, smollm2_model_path

MODELS = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}
N_PREDICT = 32


@functools.cache
def base_runner(name: str) -> ModelRunner:
    path = smollm2_model_path() if name == "smollm2" else gemma3_model_path()
    return ModelRunner.load(EngineSettings(model_path=path, kv_type="f32", n_ctx=4096, cpu_kernels="numba"))


def reference(kind: str, name: str) -> dict:
    return load_reference(f"{kind}-{MODELS[name]}.json")


def top2_margin(top5: list[list[float]]) -> float:
    """How far a reference step's best candidate is ahead of the next: top5 = [[token, value], ...]."""
    values = sorted((v for _, v in top5), reverse=True)
    return values[0] - values[1]


def greedy(runner: ModelRunner, prompt: list[int], n: int = N_PREDICT) -> tuple[list[int], list[np.ndarray]]:
    """Greedy continuation from a cold start: tokens and the logits at every step."""
    runner.erase()
    logits = runner.prefill(prompt).logits
    tokens, steps = [], []
    for _ in range(n):
        steps.append(logits)
        tokens.append(int(np.argmax(logits)))
        logits = runner.decode(tokens[-1])
    return tokens, steps


@functools.cache
def greedy_runs(name: str, kv_type: str) -> tuple[tuple[list[int], list[np.ndarray]], ...]:
    """Greedy runs of every reference prompt with the given K/V type (cached for the process)."""
    runner = base_runner(name).sibling(kv_type=kv_type)
    return tuple(
        greedy(runner, case["prompt_tokens"]) for case in reference("transformers", name)["complete"]
    )
