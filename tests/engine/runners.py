"""Loaded real models for the engine's numerics, model and prompt-cache tests, once per test process,
and reading the reference runs.

`base_runner(name)` loads a model once (f32 compute, f32 K/V, numba's float32 products: the engine's
math closest to transformers'; the default q8 products have their own reference tests in test_q8.py);
tests take `sibling(runner, ...)` runners (one slot) and `sharing(runner, ...)` slot sets that share its
weights with their own K/V pool, so several K/V settings cost one load. Every slot comes from a `SlotSet`
(`bare_runner`, a slot on no weights, excepted).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from strata_engine.config import ModelConfig
from strata_engine.gguf import GGUFFile
from strata_engine.kv import PoolPlacement
from strata_engine.loaded import LoadedModel
from strata_engine.ops import resolve_settings
from strata_engine.runner import ModelRunner
from strata_engine.settings import EngineSettings
from strata_engine.slots import SlotSet
from support.data import gemma3_model_path, load_reference, smollm2_model_path

MODELS = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m"}
N_PREDICT = 32


@functools.cache
def base_runner(name: str) -> ModelRunner:
    path = smollm2_model_path() if name == "smollm2" else gemma3_model_path()
    return load_runner(EngineSettings(model_path=path, kv_type="f32", n_ctx=4096, cpu_kernels="numba"))


def load_runner(settings: EngineSettings) -> ModelRunner:
    """The one slot of an engine loaded from `settings` (n_slots 1)."""
    assert settings.n_slots == 1, "several slots: SlotSet.load"
    return SlotSet.load(settings).runners[0]


def sharing(runner: ModelRunner, slot_set: type[SlotSet] = SlotSet, **changes: Any) -> SlotSet:
    """Slots on the model `runner` runs on (weights shared, nothing reloaded): its settings (its slot's context,
    one slot) with `changes` (n_slots, n_ctx: the total, and the K/V settings `LoadedModel.with_settings` takes)."""
    settings = {"n_ctx": runner.n_ctx, "n_slots": 1, **changes}
    return slot_set(runner.loaded.with_settings(**settings), settings["n_slots"])


def sibling(runner: ModelRunner, **changes: Any) -> ModelRunner:
    """A one-slot runner on the model `runner` runs on, with its own K/V pool (`sharing`)."""
    return sharing(runner, **changes).runners[0]


def bare_runner(
    settings: EngineSettings, gguf: GGUFFile, config: ModelConfig, placement: PoolPlacement
) -> ModelRunner:
    """A slot over `placement` on a model whose weights are not loaded (model None): for the session adapter's
    tests, which move K/V and running state without evaluating anything."""
    loaded = LoadedModel(resolve_settings(settings, config.architecture), gguf, config, None)  # type: ignore[arg-type]
    return ModelRunner(loaded, placement)


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
    runner = sibling(base_runner(name), kv_type=kv_type)
    return tuple(
        greedy(runner, case["prompt_tokens"]) for case in reference("transformers", name)["complete"]
    )
