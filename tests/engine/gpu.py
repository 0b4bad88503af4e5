"""What the GPU tests share: the model files and the transformers reference (from the PyPI packages and
tests/reference, or from $STRATA_SMOLLM2_PATH / $STRATA_GEMMA3_PATH / $STRATA_REFERENCE_DIR on a GPU
machine without them), greedy runs, and their error measures."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from support.data import REFERENCE_DIR, gemma3_model_path, smollm2_model_path

from .runners import top2_margin

# model -> (the environment variable naming its file, its reference files' name)
MODELS = {
    "smollm2": ("STRATA_SMOLLM2_PATH", "smollm2-135m"),
    "gemma3": ("STRATA_GEMMA3_PATH", "gemma3-270m"),
}


def model_path(name: str) -> Path:
    env, _ = MODELS[name]
    if os.environ.get(env):
        return Path(os.environ[env])
    try:
        return smollm2_model_path() if name == "smollm2" else gemma3_model_path()
    except Exception as e:  # noqa: BLE001 - model package not installed here
        pytest.skip(f"model {name} not available (set {env}): {e}")


def reference(name: str) -> list[dict]:
    """transformers' greedy runs: per prompt its tokens, the continuation and each step's top-2 margin."""
    folder = Path(os.environ.get("STRATA_REFERENCE_DIR", REFERENCE_DIR))
    path = folder / f"transformers-{MODELS[name][1]}.json"
    if not path.is_file():
        pytest.skip(f"reference {path} not found")
    out = []
    for case in json.loads(path.read_text(encoding="utf-8"))["complete"]:
        decode = lambda v: json.loads(v) if isinstance(v, str) else v  # noqa: E731
        out.append(
            {
                "prompt_tokens": decode(case["prompt_tokens"]),
                "tokens": decode(case["tokens"]),
                "margins": [top2_margin(step) for step in decode(case["top5_logits"])],
            }
        )
    return out


def greedy(runner, prompt: list[int], n: int) -> tuple[list[int], list[float], np.ndarray]:
    """n greedy tokens, the top-1 margin at each step, and the prompt's last-token logits."""
    first = logits = runner.prefill(prompt).logits
    tokens, margins = [], []
    while True:
        top2 = np.partition(logits, -2)[-2:]
        margins.append(float(top2[1] - top2[0]))
        tokens.append(int(np.argmax(logits)))
        if len(tokens) == n:
            return tokens, margins, first
        logits = runner.decode(tokens[-1])


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    """||got - ref|| / ||ref|| in float64; a non-finite output fails."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert np.all(np.isfinite(got)), "non-finite output"
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def long_prompt(seed: int, n: int = 700) -> list[int]:
    """Deterministic token ids (700 > gemma3's 512 window: its rings wrap)."""
    return np.random.default_rng(seed).integers(100, 5000, n).tolist()


def prefill_twins(first, second, lengths, seed: int) -> list[int]:
    """Slot i of two slot sets on one model prefilled with the same random prompt of lengths[i] tokens (their
    logits asserted equal); each slot's greedy next token."""
    rng = np.random.default_rng(seed)
    last = []
    for slot, n in enumerate(lengths):
        prompt = [int(t) for t in rng.integers(100, 5000, n)]
        la, lb = first.runners[slot].prefill(prompt).logits, second.runners[slot].prefill(prompt).logits
        np.testing.assert_array_equal(la, lb)
        last.append(int(np.argmax(lb)))
    return last
