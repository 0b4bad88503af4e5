"""Several slots in one K/V pool (`SlotSet`): a batched decode step gives each slot what it gets decoded
alone; a slot's K/V bytes are never touched by another slot's steps; a file saved from one slot restores
into another and into a one-slot engine; refusals and failures stay within the batch; `prefill_steps`
evaluates a chunk per step.

Models: SmolLM2 and gemma3 with its sliding windows shrunk to 8 (rings of 16 slots, so the
rings wrap within these short runs; the same weights, another model, run the same way batched and alone).
"""

from __future__ import annotations

import copy

import attrs
import numpy as np
import pytest
import strata_sessionfile as sf
from strata_engine.errors import (
    ContextOverflow,
    GraphCaptureFailed,
    InvalidRequest,
    InvalidToken,
    SettingsError,
)
from strata_engine.graph import BatchDecodeGraph, StepGraph
from strata_engine.loaded import LoadedModel
from strata_engine.runner import ModelRunner
from strata_engine.sampling import Argmax
from strata_engine.session import EngineSession
from strata_engine.settings import EngineSettings
from strata_engine.slots import SlotSet

from .runners import base_runner, sharing

# The batch's products sum B rows where a slot alone sums one (other BLAS kernels, other summation
# orders), so logits agree to float round-off, not bit for bit: with f32 K/V within LOGIT_ATOL (measured:
# ~5e-5 on SmolLM2, ~1e-4 on gemma3, logits of magnitude ~20-30), and the greedy tokens are identical.
LOGIT_ATOL = 1e-3
# int8 K/V: a K/V value the batch's round-off puts on the other side of a rounding boundary moves a whole
# quantization step (measured: logits within 0.11 on SmolLM2, 0.12 on gemma3); a row stored in the
# wrong slot or position changes the logits by whole units and the greedy tokens.
LOGIT_ATOL_INT8 = 0.5
N_CTX_SLOT = 96
SMALL_WINDOW = 8
DECODE_STEPS = 8


def _ids(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(100, 20000, n)]


def _small_window_gemma3(runner: ModelRunner) -> tuple:
    """gemma3's loaded weights with every sliding window shrunk to SMALL_WINDOW (a model object sharing
    the weights, with its own config)."""
    config = attrs.evolve(runner.config, layers=tuple(
        attrs.evolve(lc, window=SMALL_WINDOW if lc.window is not None else None) for lc in runner.config.layers
    ))  # fmt: skip
    model = copy.copy(runner.model)
    model.config = config
    return config, model


# gemma3 at N_CTX_SLOT has no rings (its 512-token windows cover the context): its shrunk-window twin covers
# gemma3's arithmetic and the rings at once.
MODEL_CASES = ["smollm2", "gemma3-rings"]


@pytest.fixture(scope="module", params=MODEL_CASES)
def make(request):
    """make(n_slots[, kv_type]) -> a SlotSet of n_slots slots of N_CTX_SLOT tokens (f32 K/V unless asked), on the
    case's model."""
    name = request.param
    base = base_runner(name.split("-")[0])
    settings = base.loaded.with_settings(kv_type="f32", prefill_chunk=16).settings
    if name == "gemma3-rings":
        config, model = _small_window_gemma3(base)
    else:
        config, model = base.config, base.model

    def make(n_slots: int, kv_type: str = "f32") -> SlotSet:
        settings_n = attrs.evolve(settings, n_ctx=n_slots * N_CTX_SLOT, kv_type=kv_type)
        return SlotSet(LoadedModel(settings_n, base.gguf, config, model), n_slots)

    make.name = name
    return make


def _region_bytes(runner: ModelRunner) -> bytes:
    """Every byte of the slot's region of the pool (all layers, all parts, held or not)."""
    pool = runner.pool
    return b"".join(a.tobytes() for i in range(pool.geometry.n_layers) for a in pool.layer(i).slot_arrays())


def _greedy_alone(runner: ModelRunner, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    runner.erase()
    logits = runner.prefill(prompt).logits
    tokens, steps = [], []
    for _ in range(n):
        tokens.append(int(np.argmax(logits)))
        logits = runner.decode(tokens[-1])
        steps.append(logits)
    return tokens, steps


def test_slots_are_regions_of_one_pool_with_the_slot_share_of_the_context(make):
    slots = make(3)
    assert slots.n_slots == 3 and slots.settings.n_ctx == 3 * N_CTX_SLOT and slots.n_ctx_slot == N_CTX_SLOT
    pools = [r.pool for r in slots.runners]
    assert all(r.n_ctx == N_CTX_SLOT and r.settings.n_ctx == N_CTX_SLOT for r in slots.runners)
    assert len({id(p.arena) for p in pools}) == 1 and pools[0].arena.layout.nbytes >= 3 * pools[0].nbytes
    buffer = pools[0].arena.memory
    for i in range(pools[0].geometry.n_layers):
        views = [p.layer(i).slot_arrays() for p in pools]
        for a, b in ((0, 1), (0, 2), (1, 2)):
            assert not any(np.shares_memory(x, y) for x in views[a] for y in views[b])
        assert all(np.shares_memory(x, buffer) for v in views for x in v)
    if make.name == "gemma3-rings":
        assert pools[0].geometry.ring_capacity == 2 * SMALL_WINDOW


@pytest.mark.parametrize("kv_type", ["f32", "int8"])
def test_batched_decode_equals_each_slot_decoded_alone(make, kv_type):
    """int8: the batch's rows are encoded in one call and scattered into their slots (`InPlacePlacement.
    attend_rows`), each slot alone encodes its own row."""
    slots = make(4, kv_type)
    alone = make(1, kv_type).runners[0]
    prompts = [[1, *_ids(10 + s, n)] for s, n in enumerate((5, 23, 40))]
    # slots 0-2 at different depths decode together; slot 3 holds a conversation and sits out every step
    first = [slots.runners[s].prefill(p).logits for s, p in enumerate(prompts)]
    slots.runners[3].prefill(_ids(99, 30))
    idle = _region_bytes(slots.runners[3])
    tokens = [[int(np.argmax(lg))] for lg in first]
    logits: list[list[np.ndarray]] = [[], [], []]
    for step in range(DECODE_STEPS):
        batch = [0, 1, 2] if step % 3 else [2, 0]  # sometimes a subset, in another order
        out = slots.decode([(s, tokens[s][-1]) for s in batch])
        assert out.shape == (len(batch), slots.config.n_vocab) and out.dtype == np.float32
        for row, s in zip(out, batch, strict=True):
            logits[s].append(row)
            tokens[s].append(int(np.argmax(row)))
    assert _region_bytes(slots.runners[3]) == idle
    bound = LOGIT_ATOL if kv_type == "f32" else LOGIT_ATOL_INT8
    for s, prompt in enumerate(prompts):
        expected_tokens, expected_logits = _greedy_alone(alone, prompt, len(tokens[s]) - 1)
        # a near tie (top-2 margin within twice the bound) may flip with the summation order; past it the two
        # continuations differ and nothing more compares
        n = _until_near_tie(expected_logits, 2 * bound)
        k = min(n + 1, len(expected_tokens))  # the tokens that follow clear margins
        assert tokens[s][:k] == expected_tokens[:k], (s, n)
        # the logits of step n still follow equal tokens
        worst = max(
            float(np.abs(a - b).max()) for a, b in zip(logits[s][:k], expected_logits[:k], strict=True)
        )
        assert worst <= bound, (s, worst)
        assert slots.runners[s].tokens_held == (*prompt, *tokens[s][:-1])


def _until_near_tie(steps: list[np.ndarray], margin: float) -> int:
    """How many decode steps' logits come before the first whose top-2 margin is within `margin`."""
    for i, row in enumerate(steps):
        top2 = np.partition(row, -2)[-2:]
        if top2[1] - top2[0] <= margin:
            return i
    return len(steps)


def test_decode_rows_hand_the_argmax_or_the_logits_per_row(make):
    """`decode_rows`: a row flagged argmax_only gets np.argmax of the logits `decode` gives (and that logit),
    the others their logits, in one step; one slot alone goes through its runner's `decode_row`."""
    rows, plain = make(3), make(3)
    prompts = [[1, *_ids(30 + s, n)] for s, n in enumerate((6, 19, 33))]
    last = []
    for s, p in enumerate(prompts):
        rows.runners[s].prefill(p)
        last.append(int(np.argmax(plain.runners[s].prefill(p).logits)))
    for flags in ((True, False, True), (False, True), (True,), (False, False, False)):
        batch = [2, 0, 1][: len(flags)]
        steps = [(s, last[s]) for s in batch]
        expected = plain.decode(steps)
        out = rows.decode_rows(steps, flags)
        for b, (s, only) in enumerate(zip(batch, flags, strict=True)):
            if only:
                assert isinstance(out[b], Argmax) and out[b].token == int(np.argmax(expected[b]))
                assert out[b].logit == float(expected[b][out[b].token])
            else:
                np.testing.assert_array_equal(out[b], expected[b])
            last[s] = int(np.argmax(expected[b]))
    assert [r.tokens_held for r in rows.runners] == [r.tokens_held for r in plain.runners]
    with pytest.raises(InvalidRequest, match="2 argmax_only flags for 1 decode rows"):
        rows.decode_rows([(0, 5)], [True, True])


def test_a_prompt_evaluated_chunk_by_chunk_between_decode_steps_gives_what_it_gives_alone(make):
    slots = make(3)
    alone = make(1).runners[0]
    prompts = {0: [1, *_ids(40, 9)], 1: [1, *_ids(41, 20)]}
    tokens = {s: [int(np.argmax(slots.runners[s].prefill(p).logits))] for s, p in prompts.items()}
    long_prompt = [1, *_ids(42, 50)]  # 4 chunks of 16: a decode step of slots 0 and 1 between each two
    steps = slots.runners[2].prefill_steps(long_prompt)
    decoded: dict[int, list[np.ndarray]] = {0: [], 1: []}
    while True:
        out = slots.decode([(s, tokens[s][-1]) for s in (0, 1)])
        for row, s in zip(out, (0, 1), strict=True):
            decoded[s].append(row)
            tokens[s].append(int(np.argmax(row)))
        try:
            next(steps)
        except StopIteration as done:
            result = done.value
            break
    assert result.prompt_n == len(long_prompt) and len(decoded[0]) == 4
    alone.erase()
    assert float(np.abs(result.logits - alone.prefill(long_prompt).logits).max()) <= LOGIT_ATOL
    for s, prompt in prompts.items():
        expected_tokens, expected_logits = _greedy_alone(alone, prompt, len(decoded[s]))
        assert tokens[s][:-1] == expected_tokens
        assert (
            max(float(np.abs(a - b).max()) for a, b in zip(decoded[s], expected_logits, strict=True))
            <= LOGIT_ATOL
        )


def test_prefill_steps_asks_chunk_size_before_each_chunk_and_gives_what_full_chunks_give(make):
    runner = make(1).runners[0]
    alone = make(1).runners[0]
    prompt = [1, *_ids(43, 60)]
    sizes = iter([5, 1, 100, 7] + [3] * 20)  # 100: more than the prefill chunk (16), so 16
    held: list[int] = []
    steps = runner.prefill_steps(
        prompt, on_chunk=lambda cache_n, n_held: held.append(n_held), chunk_size=lambda: next(sizes)
    )
    while True:
        try:
            next(steps)
        except StopIteration as done:
            result = done.value
            break
    # first the progress before evaluation (what the cache holds: nothing), then one after each chunk
    assert held[:6] == [0, 5, 6, 22, 29, 32] and held[-1] == len(prompt)
    assert set(np.diff(held[5:]).tolist()) <= {1, 2, 3}  # the last chunk takes what is left
    assert result.prompt_n == len(prompt) and list(runner.tokens_held) == prompt
    assert float(np.abs(result.logits - alone.prefill(prompt).logits).max()) <= LOGIT_ATOL


def test_a_slot_region_is_untouched_by_the_other_slots_steps(make):
    slots = make(3)
    slots.runners[1].prefill(_ids(5, 20))
    before = _region_bytes(slots.runners[1])
    for s in (0, 2):
        slots.runners[s].prefill(_ids(s, 25))
    token = 42
    for _ in range(SMALL_WINDOW):  # the rings (16 slots) wrap again
        slots.decode([(0, token), (2, token)])
    steps = slots.runners[2].prefill_steps(_ids(7, 40))
    for _ in steps:
        pass
    slots.runners[0].erase()
    assert _region_bytes(slots.runners[1]) == before
    assert slots.runners[1].n_held == 20


def test_refusals_name_the_slot_and_evaluate_nothing(make):
    slots = make(2)
    slots.runners[0].prefill(_ids(1, 10))
    slots.runners[1].prefill(_ids(2, N_CTX_SLOT))  # full
    held = [r.tokens_held for r in slots.runners]
    regions = [_region_bytes(r) for r in slots.runners]
    with pytest.raises(ContextOverflow) as overflow:
        slots.decode([(0, 5), (1, 5)])
    assert overflow.value.slot == 1 and "slot 1" in str(overflow.value)
    with pytest.raises(InvalidToken) as bad:
        slots.decode([(0, slots.config.n_vocab), (1, 5)])
    assert bad.value.slot == 0 and "slot 0" in str(bad.value)
    for steps in ([(0, 5), (0, 6)], [(2, 5)], []):
        with pytest.raises(InvalidRequest):
            slots.decode(steps)
    assert [r.tokens_held for r in slots.runners] == held
    assert [_region_bytes(r) for r in slots.runners] == regions


def test_a_failure_in_the_forward_pass_cuts_back_only_the_batch(make, monkeypatch):
    slots = make(3)
    for s in range(3):
        slots.runners[s].prefill(_ids(20 + s, 12 + s))
    expected = [slots.runners[s].snapshot_state().tokens for s in range(3)]
    idle = _region_bytes(slots.runners[2])
    calls = []

    placement = slots.runners[0].placement  # the batch's first row: its placement attends every row

    def failing(layer, *args, **kwargs):
        calls.append(layer)
        if layer == 3:  # layers 0-2 stored both rows' K/V
            raise RuntimeError("injected")
        return type(placement).attend_rows(placement, layer, *args, **kwargs)

    monkeypatch.setattr(placement, "attend_rows", failing)
    with pytest.raises(RuntimeError, match="injected"):
        slots.decode([(0, 7), (1, 7)])
    monkeypatch.undo()
    assert calls and [slots.runners[s].tokens_held for s in range(3)] == [tuple(e) for e in expected]
    assert _region_bytes(slots.runners[2]) == idle
    # both slots go on from where they were, as a slot alone does
    alone = make(1).runners[0]
    out = slots.decode([(0, 7), (1, 7)])
    for row, s in enumerate((0, 1)):
        alone.erase()
        alone.prefill(list(expected[s]))
        assert float(np.abs(out[row] - alone.decode(7)).max()) <= LOGIT_ATOL


class _FailingBatchGraph(BatchDecodeGraph):
    """A batch graph whose launch fails as a capture on the device may (no device here: never built)."""

    def __init__(self, n_rows: int):  # nothing of the parent's: it is never captured
        self.n_tokens = n_rows
        self.launches = 0

    def launch(self, steps) -> None:
        self.launches += 1
        raise GraphCaptureFailed(f"{self.n_tokens}-slot decode step capture failed: injected")


class _FailingStepGraph(StepGraph):
    def __init__(self):
        self.n_tokens = 1
        self.launches = 0

    def launch(self, tokens, pos0) -> None:
        self.launches += 1
        raise GraphCaptureFailed("decode step capture failed: injected")


def test_a_graph_whose_launch_fails_is_dropped_at_once_and_the_step_runs_op_by_op(make, capfd):
    slots, reference = make(3), make(3)
    for s in range(3):
        for target in (slots, reference):
            target.runners[s].prefill(_ids(40 + s, 10 + s))
    batch, single = _FailingBatchGraph(3), _FailingStepGraph()
    slots.batch_graphs.graphs = (batch,)
    slots.runners[2].graphs.decode = single
    for steps in ([(0, 7), (1, 7)], [(0, 9), (1, 9)], [(2, 7)], [(2, 9)]):
        launched = slots.launch(steps)
        assert launched.graph is None  # deferred: collect evaluates the rows op by op
        got = launched.collect([True] * len(steps))
        assert got == reference.decode_rows(steps, [True] * len(steps))
    assert (batch.launches, single.launches) == (1, 1)  # dropped at the first failure, never tried again
    assert slots.batch_graphs.graphs == () and slots.runners[2].graphs.decode is None
    said = capfd.readouterr().err
    assert said.count("capture failed: injected; running such steps op by op") == 2


def test_a_file_saved_from_slot_1_restores_into_slot_0_and_into_a_one_slot_engine(make, tmp_path):
    slots = make(2)
    prompt = [1, *_ids(3, 30)]
    logits = slots.runners[1].prefill(prompt).logits
    for _ in range(3):
        logits = slots.decode([(1, int(np.argmax(logits)))])[0]
    sf.save(tmp_path / "slot1.ssf", EngineSession(slots.runners[1]))
    continuation = []
    for _ in range(4):
        continuation.append(int(np.argmax(logits)))
        logits = slots.runners[1].decode(continuation[-1])

    slots.runners[0].prefill(_ids(4, 50))  # a conversation the restore replaces
    single = make(1).runners[0]
    for target in (slots.runners[0], single):
        sf.restore(tmp_path / "slot1.ssf", EngineSession(target))
        assert target.tokens_held[: len(prompt)] == tuple(prompt) and target.n_held == len(prompt) + 3
        # the restored conversation continues as the original did: its last token re-evaluated through the
        # prompt cache (as a next turn's prompt would), then greedy steps
        lg = target.prefill(list(target.tokens_held)).logits
        tokens = []
        for _ in range(4):
            tokens.append(int(np.argmax(lg)))
            lg = target.decode(tokens[-1])
        assert tokens == continuation


def test_prefill_steps_evaluate_one_chunk_per_step_and_equal_prefill(make):
    slots = make(2)
    prompt = [1, *_ids(8, 40)]  # chunks of 16: 16, 16, 9
    progress = []
    steps = slots.runners[0].prefill_steps(prompt, on_chunk=lambda c, n: progress.append((c, n)))
    assert slots.runners[0].n_held == 0  # nothing evaluated before the first step
    held = []
    with pytest.raises(StopIteration) as done:
        while True:
            next(steps)
            held.append(slots.runners[0].n_held)
    # told once before the first chunk (nothing held to reuse: 0), then after each chunk
    assert held == [16, 32] and progress == [(0, 0), (0, 16), (0, 32), (0, 41)]
    result = done.value.value
    assert result.cache_n == 0 and result.prompt_n == 41
    reference = slots.runners[1].prefill(prompt)
    assert float(np.abs(result.logits - reference.logits).max()) <= LOGIT_ATOL

    # closed early: the chunks evaluated stay held and the next prefill reuses them
    slots.runners[1].erase()
    steps = slots.runners[1].prefill_steps(prompt)
    next(steps)
    steps.close()
    assert slots.runners[1].tokens_held == tuple(prompt[:16])
    again = slots.runners[1].prefill(prompt)
    assert again.cache_n == 16 and again.prompt_n == 25


def test_prefill_steps_refuse_bad_prompts_before_anything_changes(make):
    runner = make(1).runners[0]
    runner.prefill(_ids(1, 10))
    with pytest.raises(ContextOverflow):
        runner.prefill_steps(_ids(2, N_CTX_SLOT + 1))
    with pytest.raises(InvalidToken):
        runner.prefill_steps([1, runner.config.n_vocab])
    assert runner.tokens_held == tuple(_ids(1, 10))


def test_settings_share_the_context_among_the_slots():
    path = base_runner("smollm2").settings.model_path
    assert EngineSettings(path, n_ctx=4096, n_slots=4).n_ctx_slot(8192) == 1024
    assert EngineSettings(path, n_slots=4).n_ctx_slot(2048) == 512
    for bad in (0, -1, 1.5, True):
        with pytest.raises(SettingsError) as info:
            EngineSettings(path, n_slots=bad)
        assert any("n_slots" in p for p in info.value.problems)
    with pytest.raises(SettingsError, match="fewer than 16"):
        EngineSettings(path, n_ctx=60, n_slots=4)
    assert EngineSettings(path, n_ctx=64, n_slots=4).n_ctx_slot(8192) == 16  # 16 tokens each: enough
    loaded = base_runner("smollm2").loaded
    with pytest.raises(SettingsError):
        SlotSet(loaded, 0)
    with pytest.raises(SettingsError, match="fewer than 16"):
        SlotSet(loaded.with_settings(n_ctx=64), 5)  # 12 tokens each
    with pytest.raises(SettingsError):
        loaded.with_settings(cpu_kernels="numpy")  # what the weights depend on stays as loaded
    with pytest.raises(SettingsError, match="fewer than 16"):
        SlotSet.load(EngineSettings(path, n_slots=1000))  # the model's default context, shared by too many


def test_load_reads_the_model_once_for_every_slot():
    path = base_runner("smollm2").settings.model_path
    slots = SlotSet.load(EngineSettings(path, n_ctx=100, n_slots=3))
    assert slots.settings.n_ctx == 100 and slots.settings.n_slots == 3 and slots.settings.backend == "numpy"
    assert [r.n_ctx for r in slots.runners] == [33, 33, 33]
    assert all(r.model is slots.model and r.pool.arena is slots.runners[0].pool.arena for r in slots.runners)
    assert all(r.settings.n_slots == 1 and r.settings.n_ctx == 33 for r in slots.runners)
    assert all(r.loaded is slots.loaded for r in slots.runners)  # one loaded model under every slot
    other = slots.loaded.with_settings(kv_type="f32", n_ctx=64)  # other K/V settings: the same weights
    assert other.model is slots.model and other.settings.kv_type == "f32" and slots.settings.kv_type == "f16"


def test_resident_rings_of_the_slots_share_one_arena_and_read_what_the_pool_holds():
    base = base_runner("smollm2")
    direct = sharing(base, n_slots=2, n_ctx=2 * N_CTX_SLOT, kv_type="f16")
    resident = sharing(base, n_slots=2, n_ctx=2 * N_CTX_SLOT, kv_type="f16", kv_resident=8)
    rings = [r.placement.resident for r in resident.runners]
    assert rings[0].arena is rings[1].arena and rings[0].arena.n_slots == 2
    assert not np.shares_memory(rings[0].layer(0).k, rings[1].layer(0).k)
    outs = []
    for slots in (direct, resident):
        tokens = [int(np.argmax(slots.runners[s].prefill(_ids(30 + s, 10 + 7 * s)).logits)) for s in range(2)]
        steps = []
        for _ in range(12):  # past the 8-token resident rings
            steps.append(slots.decode(list(enumerate(tokens))))
            tokens = [int(np.argmax(row)) for row in steps[-1]]
        outs.append(np.stack(steps))
    assert np.array_equal(outs[0], outs[1])  # the same K/V bytes reach attention either way
