"""Batch invariance checks (issue 41) shared by the CPU and GPU tests: a slot's logits alone, batched with
others at other depths (and with another slot's prompt evaluated chunk by chunk between the steps), and its
prompt evaluated in chunks of other sizes, compared bit for bit, the prompt's K/V bytes too."""

from __future__ import annotations

import copy
from collections.abc import Generator
from typing import Any

import attrs
import numpy as np
from strata_engine.loaded import LoadedModel
from strata_engine.runner import ModelRunner
from strata_engine.slots import SlotSet

N_SLOTS = 8
N_CTX_SLOT = 320
DECODE_STEPS = 4
# The slot under test: its prompt crosses four 64-key attention splits and is deep enough for its step alone to
# attend over both threads (before the fixed splits, cut in two there and whole in a batch: other bits); the others'
# depths put the batch's rows in other splits (a row of 3 keys, one at a split's edge, several splits long).
PROMPT_LEN = 260
OTHER_LENS = (3, 64, 65, 200, 20, 129, 7)
INTERLEAVED_LEN = 90  # the prompt evaluated chunk by chunk between the batched steps
INTERLEAVED_CHUNK = 16


def ids(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(100, 20000, n)]


PROMPT = [1, *ids(41, PROMPT_LEN - 1)]


def small_window(loaded: LoadedModel, window: int) -> LoadedModel:
    """`loaded`'s weights with every sliding window shrunk to `window` (a model object sharing the weights,
    with its own config): rings that wrap within a short run."""
    config = attrs.evolve(loaded.config, layers=tuple(
        attrs.evolve(lc, window=window if lc.window is not None else None) for lc in loaded.config.layers
    ))  # fmt: skip
    model = copy.copy(loaded.model)
    model.config = config
    return LoadedModel(loaded.settings, loaded.gguf, config, model)


def slot_set(loaded: LoadedModel, **settings: Any) -> SlotSet:
    """N_SLOTS slots of N_CTX_SLOT tokens on `loaded`'s weights (f16 K/V, the default, unless asked)."""
    changes = {"n_ctx": N_SLOTS * N_CTX_SLOT, "kv_type": "f16", **settings}
    return SlotSet(
        LoadedModel(attrs.evolve(loaded.settings, **changes), loaded.gguf, loaded.config, loaded.model),
        N_SLOTS,
    )


def prefill(runner: ModelRunner, tokens: list[int], chunk: int | None = None) -> np.ndarray:
    """The prompt evaluated from an empty slot (in chunks of `chunk` tokens where given): its logits."""
    runner.erase()
    steps = runner.prefill_steps(tokens, chunk_size=None if chunk is None else (lambda: chunk))
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return np.asarray(done.value.logits)


def held_kv(runner: ModelRunner) -> list[bytes]:
    """The bytes of every layer's K/V part of the slot's positions held (a ring whole once it wrapped)."""
    n = runner.n_held
    pool = runner.pool
    return [
        np.ascontiguousarray(pool.ops.to_host(a[:n])).tobytes()
        for i in range(pool.geometry.n_layers)
        for a in pool.layer(i).slot_arrays()
    ]


def alone(slots: SlotSet, slot: int = 0) -> list[np.ndarray]:
    """Slot `slot`'s logits alone: the prompt's, then DECODE_STEPS greedy steps' (the other slots empty)."""
    for r in slots.runners:
        r.erase()
    runner = slots.runners[slot]
    out = [prefill(runner, PROMPT)]
    for _ in range(DECODE_STEPS):
        out.append(np.asarray(runner.decode(int(np.argmax(out[-1])))))
    return out


def _interleaved(runner: ModelRunner) -> Generator[None, None, Any]:
    runner.erase()
    return runner.prefill_steps(ids(7, INTERLEAVED_LEN), chunk_size=lambda: INTERLEAVED_CHUNK)


def batched(slots: SlotSet, n_others: int, slot: int = 0) -> list[np.ndarray]:
    """Slot `slot`'s logits as `alone` gives them, its steps batched with n_others slots held at OTHER_LENS
    (the slot in the middle of the rows), and the last slot's prompt evaluated a chunk between each two steps."""
    for r in slots.runners:
        r.erase()
    others = [s for s in range(N_SLOTS) if s != slot][:n_others]
    for s, n in zip(others, OTHER_LENS, strict=False):
        prefill(slots.runners[s], [1, *ids(100 + s, n - 1)])
    last = slots.runners[N_SLOTS - 1]
    chunks = _interleaved(last) if N_SLOTS - 1 not in others and N_SLOTS - 1 != slot else None
    runner = slots.runners[slot]
    out = [prefill(runner, PROMPT)]
    tokens = {s: int(np.argmax(np.asarray(slots.runners[s].decode(5)))) for s in others}  # each at its depth
    rows = others[: len(others) // 2] + [slot] + others[len(others) // 2 :]
    for _ in range(DECODE_STEPS):
        tokens[slot] = int(np.argmax(out[-1]))
        logits = slots.decode([(s, tokens[s]) for s in rows])
        for s, row in zip(rows, logits, strict=True):
            tokens[s] = int(np.argmax(row))
        out.append(np.asarray(logits[rows.index(slot)]))
        if chunks is not None:
            next(chunks, None)
    return out


def first_difference(a: list[np.ndarray], b: list[np.ndarray]) -> str | None:
    """None where every step's logits are the same bits; else the first step that differs, and by how much."""
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x.tobytes() != y.tobytes():
            return f"step {i}: logits differ, max |diff| {float(np.max(np.abs(x - y))):.3g}"
    return None
