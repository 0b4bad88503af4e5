"""Batch invariance on the CPU (issue 41): a slot's logits are the same bits alone, batched with 1, 3 or 7 other
slots at other depths (another slot's prompt evaluated a chunk between each two steps), and with its prompt
evaluated in chunks of any size, which leave the same K/V bytes (`settings.EngineSettings.batch_invariant`, on
by default). numba and numba-q8 kernels (the default); SmolLM2, and gemma3 with its sliding windows shrunk to 8
(rings of 16 slots that wrap in these runs and a chunk too long to attend in place; its global layers attend
over several 64-key splits). The numpy backend (BLAS, the reference) is invariant too, its products in fixed row
groups and a prompt's attention query by query (`NumpyOps.grouped_matmul`): one batched and one chunked comparison
a model, kept cheap; with --no-batch-invariant its plain BLAS products are not."""

from __future__ import annotations

import functools

import pytest
from strata_engine.loaded import LoadedModel
from strata_engine.settings import EngineSettings
from strata_engine.slots import SlotSet
from support.data import gemma3_model_path, smollm2_model_path

from .inprocess import InProcessEngine, staggered_match_alone
from .invariance import (
    PROMPT,
    alone,
    batched,
    first_difference,
    held_kv,
    ids,
    prefill,
    slot_set,
    small_window,
)
from .runners import base_runner

SMALL_WINDOW = 8
CHUNKS = (7, 17, 64)  # a chunk of at most 16 queries takes the decode kernel, a longer one the blocks
# The long runs through the scheduler (issue 41's test): LONG_SLOTS conversations of LONG_PREDICT greedy tokens, each
# sent once the one before has streamed ARRIVE_EVERY tokens. The first runs alone, then beside 1 .. 7 others (their
# prompts evaluated between its steps); a middle one arrives beside 3 others; the last beside 7, then fewer as they
# end. Those three are compared with their runs alone (the others' runs alone would only add CI time).
LONG_SLOTS = 8
LONG_CHECKED = ("c0", "c3", "c7")
LONG_PREDICT = 512
ARRIVE_EVERY = 24
CASES = [("smollm2", "numba-q8"), ("smollm2", "numba"), ("gemma3", "numba-q8"), ("gemma3", "numba")]


@functools.cache
def _loaded(name: str, kernels: str) -> LoadedModel:
    if kernels == "numba":  # the engine tests' loaded model (float32 products)
        return base_runner(name).loaded
    path = smollm2_model_path() if name == "smollm2" else gemma3_model_path()
    return LoadedModel.load(EngineSettings(model_path=path, n_ctx=4096, cpu_kernels=kernels))


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(c))
def case(request):
    """(the case's slot set, its slot 0's logits alone)."""
    name, kernels = request.param
    loaded = _loaded(name, kernels)
    if name == "gemma3":
        loaded = small_window(loaded, SMALL_WINDOW)
    slots = slot_set(loaded, prefill_chunk=512)
    return slots, alone(slots)


@pytest.mark.parametrize("n_others", [1, 3, 7])
def test_a_slot_batched_with_others_gets_the_logits_it_gets_alone(case, n_others):
    slots, solo = case
    assert first_difference(batched(slots, n_others), solo) is None


def test_a_slot_in_another_row_and_slot_gets_the_same_logits(case):
    slots, solo = case
    assert first_difference(batched(slots, 3, slot=5), solo) is None


@pytest.mark.parametrize("chunk", CHUNKS)
def test_prompt_chunks_of_any_size_give_the_same_kv_and_logits(case, chunk):
    slots, solo = case
    runner = slots.runners[0]
    whole = prefill(runner, PROMPT)
    kv = held_kv(runner)
    chunked = prefill(runner, PROMPT, chunk)
    assert first_difference([chunked, whole], [solo[0], solo[0]]) is None
    assert held_kv(runner) == kv


def _numpy_slots(name: str, batch_invariant: bool = True):  # its float32 weights not kept past the test
    path = smollm2_model_path() if name == "smollm2" else gemma3_model_path()
    loaded = LoadedModel.load(
        EngineSettings(model_path=path, n_ctx=4096, cpu_kernels="numpy", batch_invariant=batch_invariant)
    )
    return slot_set(small_window(loaded, SMALL_WINDOW) if name == "gemma3" else loaded, prefill_chunk=512)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_the_numpy_backend_is_batch_invariant(name):
    """Batched with 3 others (the slot in the middle, another prompt's chunks between the steps), and the prompt
    in chunks of 7 (its last chunk one row: BLAS's gemv where a lone row is not grouped)."""
    slots = _numpy_slots(name)
    solo = alone(slots)
    assert first_difference(batched(slots, 3), solo) is None
    runner = slots.runners[0]
    prefill(runner, PROMPT)
    kv = held_kv(runner)
    assert first_difference([prefill(runner, PROMPT, 7)], [solo[0]]) is None
    assert held_kv(runner) == kv


@pytest.mark.slow
def test_without_batch_invariance_the_numpy_backend_depends_on_the_batch():
    """What --no-batch-invariant gives up: plain BLAS products, whose bits change with the rows of the pass."""
    slots = _numpy_slots("smollm2", batch_invariant=False)
    assert first_difference(batched(slots, 1), alone(slots)) is not None


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_long_greedy_generations_alone_equal_those_beside_1_to_7_others_arriving_midway(
    name, tokenizers, templates
):
    """The default kernels (numba-q8) through the scheduler: LONG_CHECKED's LONG_PREDICT tokens equal their runs
    alone, token for token, though their steps were batched with 1, 3 and 7 others (and every count between) and
    others' prompts were evaluated in chunks between them; gemma3's 512-token sliding windows wrap."""
    loaded = _loaded(name, "numba-q8")
    n_ctx = 1024  # a prompt and LONG_PREDICT tokens

    def engine(n_slots: int) -> InProcessEngine:
        slots = SlotSet(loaded.with_settings(n_ctx=n_ctx * n_slots, n_slots=n_slots, kv_type="f16"), n_slots)
        return InProcessEngine(slots, tokenizers[name], templates[name])

    requests = {
        f"c{i}": {"prompt": ids(500 + i, 20 + 37 * i), "n_predict": LONG_PREDICT, "temperature": 0,
                  "ignore_eos": True, "cache_prompt": False}
        for i in range(LONG_SLOTS)
    }  # fmt: skip
    alone_engine, together = engine(1), engine(LONG_SLOTS)
    try:
        rows = staggered_match_alone(alone_engine, together, requests, ARRIVE_EVERY, list(LONG_CHECKED))
    finally:
        alone_engine.close()
        together.close()
    assert {2, 4, 8} <= set(rows), rows  # steps of the 1, 3 and 7 others were taken
