"""Batch invariance on the GPU (issue 41; the CPU's in test_batch_invariance.py): a slot's logits alone, batched
with 1, 3 or 7 others, and with its prompt in chunks of other sizes, bit for bit, on the CuPy backend with its
default compute dtypes (SmolLM2 f16, gemma3 bf16). The GPU path is not made invariant beyond GEMV_ROWS (2) rows: a
batched step of more rows takes cuBLAS's products and the flash kernels split keys by the launch. Strict xfails say
so and turn into failures the day it is; two rows (one other) take strata_gemv as one row does and match (seen on
an H100 for SmolLM2; gemma3's pieces did not travel, so its case is a non-strict xfail until it is run)."""

from __future__ import annotations

import functools

import pytest

from .gpu import model_path
from .invariance import PROMPT, alone, batched, first_difference, held_kv, prefill, slot_set

pytestmark = pytest.mark.gpu

_NOT_INVARIANT = pytest.mark.xfail(
    raises=AssertionError,
    reason="the GPU path is not batch-invariant beyond GEMV_ROWS rows (issue 41: not built)",
)


@functools.cache
def _loaded(name: str):
    from strata_engine.loaded import LoadedModel
    from strata_engine.settings import EngineSettings

    return LoadedModel.load(EngineSettings(model_path=model_path(name), n_ctx=4096, backend="cupy"))


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def case(request):
    pytest.importorskip("cupy")
    slots = slot_set(_loaded(request.param))
    return slots, alone(slots)


@pytest.mark.parametrize(
    "n_others", [1, pytest.param(3, marks=_NOT_INVARIANT), pytest.param(7, marks=_NOT_INVARIANT)]
)
def test_gpu_slot_batched_with_others_gets_the_logits_it_gets_alone(request, case, n_others):
    if n_others == 1 and request.node.callspec.params["case"] == "gemma3":
        request.applymarker(
            pytest.mark.xfail(raises=AssertionError, strict=False, reason="not yet run on a GPU")
        )
    slots, solo = case
    assert first_difference(batched(slots, n_others), solo) is None


@_NOT_INVARIANT
@pytest.mark.parametrize("chunk", [7, 64])
def test_gpu_prompt_chunks_give_the_same_kv_and_logits(case, chunk):
    slots, solo = case
    runner = slots.runners[0]
    prefill(runner, PROMPT)
    kv = held_kv(runner)
    chunked = prefill(runner, PROMPT, chunk)
    assert first_difference([chunked], [solo[0]]) is None
    assert held_kv(runner) == kv
