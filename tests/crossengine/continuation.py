"""Continuations compared across engines (shared by the slot tests): strata-engine's greedy continuation of a
turn, and how far a continuation from another engine's K/V may leave the cold one (only at a near tie)."""

from __future__ import annotations

import numpy as np

N_REPLY = 12


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - float(np.max(x))
    return x - np.log(np.sum(np.exp(x)))


def best_gap(logits: np.ndarray, cold_logits: np.ndarray, k: int = 10) -> float:
    """The largest log-probability difference over the cold run's k best tokens. llama.cpp's K/V are not
    strata-engine's bit for bit (other kernels, chosen by the CPU's features): the far tail of a 49K-262K
    vocabulary moves by up to ~0.6-1.6 (measured), the tokens that matter by far less."""
    best = np.argsort(cold_logits)[-k:]
    return float(np.max(np.abs(log_softmax(logits)[best] - log_softmax(cold_logits)[best])))


def greedy(runner, tokens: list[int], n: int = N_REPLY) -> tuple[int, list[int], list[np.ndarray]]:
    """(tokens reused from what the runner held, greedy continuation, the logits each token was picked from)."""
    res = runner.prefill(tokens)
    logits = res.logits
    out: list[int] = []
    steps: list[np.ndarray] = []
    for _ in range(n):
        steps.append(logits)
        out.append(int(np.argmax(logits)))
        logits = runner.decode(out[-1])
    return res.cache_n, out, steps


def assert_same_until_a_near_tie(restored: list[int], cold: list[int], cold_steps: list[np.ndarray]) -> None:
    """The continuation from llama.cpp's K/V equals strata-engine's cold one, or leaves it only at a step where
    the cold run's two best tokens were within 0.5 of each other (the K/V differ in their last bits)."""
    differ = next((i for i, (a, b) in enumerate(zip(restored, cold, strict=True)) if a != b), None)
    if differ is not None:
        top2 = np.sort(log_softmax(cold_steps[differ]))[-2:]
        assert top2[1] - top2[0] < 0.5, (differ, top2)
