"""The whole engine on the GPU (CuPy backend) against the NumPy backend and the reference outputs.

Bounds:
  * f32: greedy tokens identical to transformers' (tests/reference, 32 steps of every prompt) and
    to the NumPy backend's; last-prompt-token logits within 1e-3 relative L2 of NumPy's.
  * f16 / bf16: last-prompt-token logits within 2e-2 / 6e-2 relative L2 of the f32 GPU logits, and
    the greedy tokens identical to f32's up to the first step where f32's top-1 margin is below 0.5
    logits (a near-tie that one rounding may flip). gemma3 in f16 overflows (NaN logits, seen on the
    H200): a strict xfail records it; gemma3 runs in bf16 or f32.
  * default settings (the compute dtype per architecture: f16 for smollm2, bf16 for gemma3; f32 logits):
    greedy tokens identical to transformers' f32 ones on every reference prompt up to the first step
    where the reference's own top-2 logit margin is below 0.1.
  * K/V placements: a host-mapped pool behind a VRAM ring gives bit-identical logits to the device
    pool; a pool restored by writing K/V then `restore_state` continues bit-identically, and the same
    restore with the residency refill skipped does not (so the first test fails if refill is skipped).

Model files and the reference come from gpu.py (the PyPI packages and tests/reference, or the
$STRATA_* paths a GPU machine without them sets).
"""

from __future__ import annotations

import numpy as np
import pytest

from .gpu import MODELS, greedy, long_prompt, model_path, prefill_twins, reference, rel_err
from .runners import load_runner, sharing, sibling

pytestmark = pytest.mark.gpu

N_CTX = 2048
LOGIT_BOUND = {"f16": 2e-2, "bf16": 6e-2}
# Graph-replayed decode vs op by op: round-off, about what op by op itself is from f32 compute (measured on the
# H200, bench/gpu/DECISIONS.md "Graph bounds": f16 graph/op by op <= 0.0031 where op by op/f32 <= 0.0021; bf16 <= 0.0496,
# batched 0.091, where op by op/f32 <= 0.104; the replay equals the same code run uncaptured exactly; a wrong
# position or ring slot gave 0.31).
GRAPH_BOUND = {"f16": 5e-3, "bf16": 0.12}
# A batched decode step vs each slot alone: steps of more than GEMV_ROWS rows take cuBLAS's products (another
# summation order than one row's strata_gemv), so round-off as above (measured 0.0070 f16, 0.067 bf16 at 3 rows).
BATCH_BOUND = {"f16": 2e-2, "bf16": 0.12}
NEAR_TIE = 0.5
REFERENCE_NEAR_TIE = 0.1  # transformers' top-2 logit margin below which one rounding may flip its token


@pytest.fixture(scope="session")
def runners():
    """A cache of loaded runners keyed by (model, backend, dtype, kv_type, kv_resident)."""
    pytest.importorskip("cupy")
    from strata_engine.runner import ModelRunner
    from strata_engine.settings import EngineSettings

    cache: dict[tuple, ModelRunner] = {}

    def get(model, backend="cupy", dtype="f32", kv_type="f16", resident=None, instance=0):
        key = (model, backend, dtype, kv_type, resident, instance)
        if key not in cache:
            settings = EngineSettings(
                model_path=model_path(model),
                n_ctx=N_CTX,
                backend=backend,
                compute_dtype=dtype,
                kv_type=kv_type,
                kv_resident=resident,
                # the CPU twin with float32 products (the default q8 products quantize the activations)
                cpu_kernels="numba" if backend == "numpy" else None,
            )
            try:
                cache[key] = load_runner(settings)
            except Exception as e:
                if dtype in ("bf16", None) and "not available" in str(e):
                    pytest.skip(str(e))
                raise
        runner = cache[key]
        runner.erase()
        return runner

    return get


@pytest.mark.parametrize("model", list(MODELS))
def test_f32_greedy_matches_reference_and_numpy(runners, model):
    gpu, cpu = runners(model), runners(model, backend="numpy")
    assert gpu.settings.backend == "cupy" and type(gpu.pool).__name__ == "DevicePool"
    for case in reference(model):
        want = case["tokens"]
        got, _, logits_gpu = greedy(gpu, case["prompt_tokens"], len(want))
        ref_np, _, logits_np = greedy(cpu, case["prompt_tokens"], len(want))
        assert rel_err(logits_gpu, logits_np) < 1e-3
        assert got == ref_np, f"cupy vs numpy backend on {case['prompt_tokens']}"
        assert got == want, f"cupy vs transformers on {case['prompt_tokens']}"


@pytest.mark.parametrize("model", list(MODELS))
def test_default_settings_reproduce_transformers_greedy_tokens(runners, model):
    """The defaults (compute dtype per architecture, f32 logits, f16 K/V, graphs) reproduce transformers'
    f32 greedy tokens up to the first step where transformers' own top-2 margin is below
    REFERENCE_NEAR_TIE: logits rounded to bf16 tied exactly there and left its tokens."""
    from strata_engine.settings import DEFAULT_COMPUTE_DTYPE

    runner = runners(model, dtype=None)
    assert runner.settings.compute_dtype == DEFAULT_COMPUTE_DTYPE[runner.config.architecture]["cupy"]
    assert runner.graphs.decode is not None  # the decode steps replay the graph, its logits included
    for case in reference(model):
        want, margins = case["tokens"], case["margins"]
        got, _, logits = greedy(runner, case["prompt_tokens"], len(want))
        assert logits.dtype == np.float32
        close = [i for i, m in enumerate(margins) if m < REFERENCE_NEAR_TIE]
        until = close[0] if close else len(want)
        assert got[:until] == want[:until], (
            f"{runner.settings.compute_dtype} left transformers before step {until} on {case['prompt_tokens']}: "
            f"{got} vs {want}"
        )


GEMMA3_F16_OVERFLOWS = pytest.mark.xfail(
    strict=True, reason="gemma3's residual stream leaves float16's range (NaN logits): run it in bf16"
)


@pytest.mark.parametrize(
    ("model", "dtype"),
    [
        ("smollm2", "f16"),
        ("smollm2", "bf16"),
        ("gemma3", "bf16"),
        pytest.param("gemma3", "f16", marks=GEMMA3_F16_OVERFLOWS),
    ],
)
def test_low_precision_within_stated_bound(runners, model, dtype):
    f32 = runners(model)
    low = runners(model, dtype=dtype)
    for case in reference(model):
        n = len(case["tokens"])
        want, margins, logits32 = greedy(f32, case["prompt_tokens"], n)
        got, _, logits_low = greedy(low, case["prompt_tokens"], n)
        assert rel_err(logits_low, logits32) < LOGIT_BOUND[dtype]
        ties = [i for i, m in enumerate(margins) if m < NEAR_TIE]
        agree_until = ties[0] if ties else n
        assert got[:agree_until] == want[:agree_until], (
            f"{dtype} left f32 before the first near-tie (step {agree_until}): {got} vs {want}"
        )


@pytest.mark.parametrize("model", ["smollm2"])
def test_int8_kv_matches_numpy_backend(runners, model):
    gpu, cpu = runners(model, kv_type="int8"), runners(model, backend="numpy", kv_type="int8")
    for case in reference(model)[:3]:
        got, margins, _ = greedy(gpu, case["prompt_tokens"], 16)
        want, _, _ = greedy(cpu, case["prompt_tokens"], 16)
        assert got == want


@pytest.mark.parametrize("model", list(MODELS))
def test_host_pool_with_vram_ring_matches_device_pool(runners, model):
    dev = runners(model)
    host = runners(model, resident=64)
    assert type(host.pool).__name__ == "HostMappedPool"
    assert type(host.placement.resident).__name__ == "DevicePool"
    a, _, la = greedy(dev, long_prompt(1), 8)
    before = host.placement.stats()
    b, _, lb = greedy(host, long_prompt(1), 8)
    after = host.placement.stats()
    assert np.array_equal(la, lb)
    assert a == b
    assert after.host_tokens_read > before.host_tokens_read  # older tokens did stream from the host pool
    assert after.resident_tokens_read > before.resident_tokens_read


def _restore_into(src, dst, skip_refill: bool = False):
    """Copy src's K/V and running state into dst as a session restore does (pool writes, then commit)."""
    state = src.snapshot_state()
    for i in range(src.kv_geometry.n_layers):
        lo, hi = src.pool.held_range(i)
        dst.pool.write(i, lo, src.pool.read(i, lo, hi))
    if skip_refill:  # the bug this guards against: the ring's bookkeeping and bytes left as they were
        dst.placement.refill = lambda: None
        dst.placement.truncated = lambda r: None
    dst.restore_state(state)


def _second_runner(runners, model, resident):
    """A second, independent runner with the same settings (its own pool and ring)."""
    return runners(model, resident=resident, instance=1)


@pytest.mark.parametrize("resident", [None, 64])
@pytest.mark.parametrize("model", list(MODELS))
def test_restore_then_next_turn_is_identical(runners, model, resident):
    src = runners(model, resident=resident)
    dst = _second_runner(runners, model, resident)
    greedy(dst, long_prompt(7), 4)  # dst holds another conversation: its ring is stale
    prompt = long_prompt(3)
    turn1, _, _ = greedy(src, prompt, 6)
    held = list(src.tokens_held)
    _restore_into(src, dst)
    assert list(dst.tokens_held) == held
    # next turn: the held conversation plus the last reply token and a new user message
    nxt = held + [turn1[-1]] + long_prompt(11, 40)
    r_src, r_dst = src.prefill(nxt), dst.prefill(nxt)
    assert r_dst.cache_n == r_src.cache_n == len(held)  # the whole restored conversation is reused
    assert np.array_equal(r_src.logits, r_dst.logits)
    t = int(np.argmax(r_src.logits))
    assert np.array_equal(src.decode(t), dst.decode(t))


@pytest.mark.parametrize("model", list(MODELS))
def test_skipping_the_residency_refill_is_detected(runners, model):
    src = runners(model, resident=64)
    dst = _second_runner(runners, model, 64)
    greedy(dst, long_prompt(7, 720), 4)  # a longer conversation: its ring covers src's last tokens
    greedy(src, long_prompt(3), 6)
    _restore_into(src, dst, skip_refill=True)
    t = 321
    assert not np.array_equal(src.decode(t), dst.decode(t)), "stale VRAM ring went unnoticed"


@pytest.mark.parametrize(("model", "dtype", "n_prompt"), [("smollm2", "f16", 300), ("gemma3", "bf16", 1500)])
def test_cuda_graph_decode_matches_op_by_op(runners, model, dtype, n_prompt):
    """Decode steps replayed from the captured graph against the same steps run op by op: greedy
    tokens identical while the top-1 margin is clear, logits within GRAPH_BOUND relative L2. Only the
    number of key splits differs (the graph sizes them for the whole context), so the order of the
    float32 merge; one flipped rounding of a bf16 activation moves bf16 logits by ~0.4 % (seen on the
    H200: 0.0085 for gemma3, step 0). gemma3's 1,500-token prompt makes the steps cross its 1,024-slot
    ring's wrap, read by position in the graph."""
    graphed = sibling(runners(model, dtype=dtype))
    graphed.graphs.prefill = ()  # the prompt op by op on both: the decode steps start from the same K/V
    eager = sibling(graphed, cuda_graphs=False)
    assert graphed.graphs.decode is not None and eager.graphs.decode is None
    prompt = np.random.default_rng(n_prompt).integers(100, 5000, n_prompt).tolist()
    launches = graphed.graphs.decode.launches
    lg, le = graphed.prefill(prompt).logits, eager.prefill(prompt).logits
    np.testing.assert_array_equal(lg, le)  # prefill is the same code on both
    token = int(np.argmax(le))
    for step in range(24):
        lg, le = graphed.decode(token), eager.decode(token)
        assert rel_err(lg, le) < GRAPH_BOUND[dtype], f"step {step}"
        top2 = np.partition(le, -2)[-2:]
        if top2[1] - top2[0] > NEAR_TIE:
            assert int(np.argmax(lg)) == int(np.argmax(le)), f"step {step}"
        token = int(np.argmax(le))
    assert graphed.graphs.decode.launches == launches + 24
    assert list(graphed.tokens_held) == list(eager.tokens_held)


GEMMA3_CHUNK_GRAPH = pytest.param(
    "gemma3", "bf16", 1500,
    marks=pytest.mark.xfail(strict=True, reason="gemma3 chunk graphs disagree with op by op (logits 0.31 "
                            "relative L2 on the H200); not enabled for models with rings (graph.py)"),
)  # fmt: skip


@pytest.mark.parametrize(("model", "dtype", "n_prompt"), [("smollm2", "f16", 700), GEMMA3_CHUNK_GRAPH])
def test_cuda_graph_prefill_chunks_match_op_by_op(runners, model, dtype, n_prompt):
    """Prefill chunks replayed from the captured prefill graphs against the same chunks run op by op
    (both runners on 256-token chunks; the last, partial chunk replays the next graph size, padded):
    the logits must agree within GRAPH_BOUND;
    the K/V held within LOGIT_BOUND (a later layer's K/V carry the earlier layers' rounding flips:
    0.0021 seen at smollm2's layer 13); greedy decoding must continue identically while the top-1
    margin is clear. gemma3 (rings: no chunk graph by default) gets one made directly; its 1,500 tokens
    cross the ring's wrap inside graphed chunks."""
    from strata_engine.graph import StepGraph

    base = runners(model, dtype=dtype)
    graphed = sibling(base, prefill_chunk=256)
    eager = sibling(base, prefill_chunk=256, cuda_graphs=False)
    if graphed.kv_geometry.ring_layers:
        assert graphed.graphs.prefill == ()
        graphed.graphs.prefill = (StepGraph(graphed.model, graphed.placement, 256),)
    assert [g.n_tokens for g in graphed.graphs.prefill][-1] == 256 and eager.graphs.prefill == ()
    prompt = np.random.default_rng(n_prompt + 1).integers(100, 5000, n_prompt).tolist()
    lg, le = graphed.prefill(prompt).logits, eager.prefill(prompt).logits
    # every chunk replayed a graph: the full ones and the last, padded to the next size
    assert sum(g.launches for g in graphed.graphs.prefill) == -(-n_prompt // 256)
    assert rel_err(lg, le) < GRAPH_BOUND[dtype]
    for i in range(graphed.kv_geometry.n_layers):
        lo, hi = graphed.pool.held_range(i)
        a, b = graphed.pool.read(i, lo, hi), eager.pool.read(i, lo, hi)
        for x, y in ((a.k, b.k), (a.v, b.v)):
            assert (
                rel_err(
                    graphed.model.ops.to_host(x).astype(np.float32),
                    eager.model.ops.to_host(y).astype(np.float32),
                )
                < LOGIT_BOUND[dtype]
            ), f"layer {i}"
    token = int(np.argmax(le))
    for step in range(8):
        lg, le = graphed.decode(token), eager.decode(token)
        top2 = np.partition(le, -2)[-2:]
        if top2[1] - top2[0] > NEAR_TIE:
            assert int(np.argmax(lg)) == int(np.argmax(le)), f"step {step}"
        token = int(np.argmax(le))


@pytest.mark.parametrize(("model", "dtype"), [("smollm2", "f32"), ("smollm2", "f16"), ("gemma3", "bf16")])
def test_embeddings_match_the_numpy_backend(runners, model, dtype):
    """EMBED's pass on scratch K/V (several chunks; past gemma3's 512-token window) against NumPy's: every
    token's output-normed state, and the mean-pooled, normalized embedding."""
    from strata_engine.embedding import embed, hidden_states
    from strata_engine.settings import Pooling

    gpu, cpu = runners(model, dtype=dtype), runners(model, backend="numpy")
    tokens = long_prompt(11)
    bound = LOGIT_BOUND.get(dtype, 1e-3)
    assert rel_err(hidden_states(gpu.model, tokens, 256), hidden_states(cpu.model, tokens, 256)) < bound
    assert rel_err(embed(gpu, tokens, Pooling.MEAN), embed(cpu, tokens, Pooling.MEAN)) < bound


@pytest.mark.parametrize("graphs", [False, True], ids=["op-by-op", "graphs"])
@pytest.mark.parametrize("model", list(MODELS))
def test_batched_decode_of_three_slots_matches_each_slot_alone(runners, model, graphs):
    """`SlotSet.decode` on the cupy backend (default compute dtype, f16 K/V; op by op, or through the batched
    decode graph of 4 rows, padded): three slots at different depths decoded together give each slot's
    greedy tokens decoded alone (where the top-1 margin is clear), logits within BATCH_BOUND, and a fourth
    slot's bytes are untouched (the padding row stores nothing)."""

    base = runners(model, dtype=None)
    dtype = base.settings.compute_dtype
    # Alone op by op; the prompts op by op on both sides.
    slots = sharing(base, n_slots=4, n_ctx=4 * 256, cuda_graphs=graphs)
    assert [g.n_tokens for g in slots.batch_graphs.graphs] == ([2, 4] if graphs else [])
    for runner in slots.runners:
        runner.graphs.prefill = ()
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(100, 5000, n)] for n in (7, 40, 130)]
    alone = sibling(base, n_ctx=256, cuda_graphs=False)
    first = [slots.runners[s].prefill(p).logits for s, p in enumerate(prompts)]
    slots.runners[3].prefill([int(t) for t in rng.integers(100, 5000, 30)])
    idle = [
        slots.runners[3].model.ops.to_host(a).copy() for a in slots.runners[3].pool.layer(0).slot_arrays()
    ]
    tokens = [[int(np.argmax(lg))] for lg in first]
    batched: list[list[np.ndarray]] = [[], [], []]
    for _ in range(6):
        out = slots.decode([(s, tokens[s][-1]) for s in range(3)])
        for s in range(3):
            batched[s].append(out[s])
            tokens[s].append(int(np.argmax(out[s])))
    now = [slots.runners[3].model.ops.to_host(a) for a in slots.runners[3].pool.layer(0).slot_arrays()]
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(idle, now, strict=True))
    assert [g.launches for g in slots.batch_graphs.graphs] == ([0, 6] if graphs else [])
    for s, prompt in enumerate(prompts):
        alone.erase()
        logits = alone.prefill(prompt).logits
        assert int(np.argmax(logits)) == tokens[s][0]
        for step in range(6):
            logits = alone.decode(tokens[s][step])
            top2 = np.partition(logits, -2)[-2:]
            if top2[1] - top2[0] > NEAR_TIE:  # round-off (BATCH_BOUND) may flip a near-tie
                assert int(np.argmax(logits)) == tokens[s][step + 1], (s, step)
            assert rel_err(batched[s][step], logits) < BATCH_BOUND[dtype], (s, step)


@pytest.mark.parametrize("model", list(MODELS))
def test_graphed_batched_decode_matches_op_by_op(runners, model):
    """Batched decode steps of 8, 5, 3 and 2 of 8 slots replayed from the batch-size buckets' graphs (8, 8
    padded, 4 padded, 2) against the same steps op by op (`SlotSet.decode`), from the same K/V: logits within
    GRAPH_BOUND, greedy tokens identical while the top-1 margin is clear, the slots left out of a step (and
    the padding rows) write nothing, and both hold the same tokens. The slots hold 5 to 1,500 tokens:
    gemma3's deeper ones decode across their 1,024-slot ring's wrap, read by position in the graph."""

    base = runners(model, dtype=None)
    dtype = base.settings.compute_dtype
    graphed = sharing(base, n_slots=8, n_ctx=8 * 2048)
    eager = sharing(base, n_slots=8, n_ctx=8 * 2048, cuda_graphs=False)
    assert [g.n_tokens for g in graphed.batch_graphs.graphs] == [2, 4, 8] and eager.batch_graphs.graphs == ()
    rng = np.random.default_rng(15)
    last = []
    for slot, n in enumerate((5, 300, 1100, 1500, 40, 700, 1030, 90)):
        prompt = [int(t) for t in rng.integers(100, 5000, n)]
        graphed.runners[slot].graphs.prefill = ()  # op by op on both sides: the same K/V
        lg, le = graphed.runners[slot].prefill(prompt).logits, eager.runners[slot].prefill(prompt).logits
        np.testing.assert_array_equal(lg, le)
        last.append(int(np.argmax(le)))
    worst = 0.0
    for batch in ((0, 1, 2, 3, 4, 5, 6, 7), (7, 2, 4, 0, 3), (6, 1, 3), (5, 2)):
        left_out = next(s for s in range(8) if s not in batch) if len(batch) < 8 else None
        if left_out is not None:
            before = [
                base.model.ops.to_host(a).copy()
                for a in graphed.runners[left_out].pool.layer(0).slot_arrays()
            ]
        for step in range(4):
            steps = [(s, last[s]) for s in batch]
            lg, le = graphed.decode(steps), eager.decode(steps)
            for row, s in enumerate(batch):
                err = rel_err(lg[row], le[row])
                worst = max(worst, err)
                assert err < GRAPH_BOUND[dtype], (batch, step, s)
                top2 = np.partition(le[row], -2)[-2:]
                if top2[1] - top2[0] > NEAR_TIE:
                    assert int(np.argmax(lg[row])) == int(np.argmax(le[row])), (batch, step, s)
                last[s] = int(np.argmax(le[row]))
        if left_out is not None:
            after = [base.model.ops.to_host(a) for a in graphed.runners[left_out].pool.layer(0).slot_arrays()]
            assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(before, after, strict=True))
    assert [g.launches for g in graphed.batch_graphs.graphs] == [4, 4, 8]
    for s in range(8):
        assert list(graphed.runners[s].tokens_held) == list(eager.runners[s].tokens_held)
    print(f"{model} {dtype}: worst graph vs op by op logits {worst:.2e} relative L2")


@pytest.mark.parametrize("model", list(MODELS))
def test_device_argmax_steps_give_the_logits_paths_greedy_tokens(runners, model):
    """Steps of 8, 5, 3, 2 and 1 of 8 slots with argmax_only rows (`SlotSet.decode_rows`: the argmax computed
    in the batched graph, or the one-slot decode graph) against the same steps' logits (`decode`) and
    np.argmax on the host, from the same K/V in twin slot sets: the same token and logit in every row, and
    the rows of a mixed step that ask for logits get exactly `decode`'s (the same replays: equality, no bound)."""
    from strata_engine.sampling import Argmax

    base = runners(model, dtype=None)
    fast = sharing(base, n_slots=8, n_ctx=8 * 512)
    plain = sharing(base, n_slots=8, n_ctx=8 * 512)
    assert [g.n_tokens for g in fast.batch_graphs.graphs] == [2, 4, 8]
    last = prefill_twins(fast, plain, (5, 300, 110, 450, 40, 70, 230, 90), seed=21)
    checked = 0
    for batch in ((0, 1, 2, 3, 4, 5, 6, 7), (7, 2, 4, 0, 3), (6, 1, 3), (5, 2), (4,)):
        for step in range(4):
            flags = [True] * len(batch) if step % 2 == 0 else [row % 2 == 0 for row in range(len(batch))]
            steps = [(s, last[s]) for s in batch]
            out, want = fast.decode_rows(steps, flags), plain.decode(steps)
            for row, (s, only) in enumerate(zip(batch, flags, strict=True)):
                if only:
                    assert isinstance(out[row], Argmax), (batch, step, s)
                    assert out[row].token == int(np.argmax(want[row])), (batch, step, s)
                    assert out[row].logit == float(want[row][out[row].token])
                    checked += 1
                else:
                    np.testing.assert_array_equal(out[row], want[row])
                last[s] = int(np.argmax(want[row]))
    assert [g.launches for g in fast.batch_graphs.graphs] == [4, 4, 8]
    assert fast.runners[4].graphs.decode is not None and fast.runners[4].graphs.decode.launches == 4
    for s in range(8):
        assert list(fast.runners[s].tokens_held) == list(plain.runners[s].tokens_held)
    print(f"{model}: {checked} device-argmax rows equal to the host's argmax of the logits")


@pytest.mark.parametrize("model", list(MODELS))
def test_launched_steps_give_the_synchronous_tokens_and_dropped_rows_keep_their_slots(runners, model):
    """`SlotSet.launch` then `LaunchedStep.collect` (the scheduler's step launched ahead: the batched graphs of 8,
    4 and 2 rows and a slot's own decode graph) against `decode` of the kept rows only, in a twin slot set from
    the same K/V: each kept row's argmax where the margin is clear and its logit within the loosest graph bound; a
    dropped row's slot holds what it held (its K/V was stored past the conversation's end), and every slot then
    decodes on to the same tokens -- gemma3's slots 700-900 deep across their 1,024-slot rings, whose slot a
    dropped row overwrote."""

    base = runners(model, dtype=None)
    ahead = sharing(base, n_slots=8, n_ctx=8 * 1024)
    plain = sharing(base, n_slots=8, n_ctx=8 * 1024)
    last = prefill_twins(ahead, plain, (5, 700, 130, 900, 40, 810, 230, 60), seed=23)
    dropped = 0
    for batch in ((0, 1, 2, 3, 4, 5, 6, 7), (7, 3, 5, 0, 1), (6, 1, 3), (5, 3), (1,), (3,)):
        for step in range(3):
            keep = [step != 1 or row != len(batch) // 2 for row in range(len(batch))]
            held = {s: list(ahead.runners[s].tokens_held) for s in batch}
            out = ahead.launch([(s, last[s]) for s in batch]).collect(keep)
            kept = [s for s, k in zip(batch, keep, strict=True) if k]
            want = plain.decode([(s, last[s]) for s in kept]) if kept else []
            rows = iter(want)
            for s, k, got in zip(batch, keep, out, strict=True):
                if not k:
                    assert got is None and list(ahead.runners[s].tokens_held) == held[s], (batch, step, s)
                    dropped += 1
                    continue
                logits = next(rows)
                top2 = np.partition(logits, -2)[-2:]
                if top2[1] - top2[0] > NEAR_TIE:
                    assert got.token == int(np.argmax(logits)), (batch, step, s)
                assert abs(got.logit - float(logits.max())) <= GRAPH_BOUND["bf16"] * max(
                    1.0, abs(float(logits.max()))
                )
                last[s] = int(np.argmax(logits))
    assert dropped == 6  # step 1 of each batch drops its middle row (a lone row: the step)
    for s in range(8):
        assert list(ahead.runners[s].tokens_held) == list(plain.runners[s].tokens_held)
    for _ in range(3):  # on from there, every slot (the dropped rows' too): the same tokens
        out, want = (
            ahead.decode_rows([(s, last[s]) for s in range(8)], [True] * 8),
            plain.decode([(s, last[s]) for s in range(8)]),
        )
        for s in range(8):
            top2 = np.partition(want[s], -2)[-2:]
            if top2[1] - top2[0] > NEAR_TIE:
                assert out[s].token == int(np.argmax(want[s])), s
            last[s] = int(np.argmax(want[s]))
    assert all(g.launches > 0 for g in ahead.batch_graphs.graphs)
    assert ahead.runners[1].graphs.decode is not None and ahead.runners[1].graphs.decode.launches == 3


@pytest.mark.parametrize("model", list(MODELS))
def test_the_scheduler_launching_ahead_gives_each_stream_its_tokens_alone(runners, model):
    """The serve loop on the GPU (greedy rows: each step launched before the last one's tokens are accepted):
    two streams at once -- one ended by a stop word (its row dropped), the other by n_predict (known: left out
    of the last launch) -- give the tokens, content and held conversation each gets alone on a one-slot engine
    of the same backend. Two rows, as one: strata_gemv's products (more rows take cuBLAS's, another summation
    order that may flip a near-tie)."""
    from strata_engine.chat import ChatTemplate
    from strata_engine.gguf import read_gguf
    from strata_engine.tokenizer import Tokenizer

    from .inprocess import InProcessEngine, alone_then_together

    meta = read_gguf(model_path(model)).metadata
    tok = Tokenizer.from_gguf_metadata(meta)
    template = ChatTemplate.for_model(meta, tok)
    base = runners(model, dtype=None)
    engines = [InProcessEngine(sharing(base, n_slots=n, n_ctx=n * 1024), tok, template) for n in (1, 2)]
    alone, e = engines
    try:
        rng = np.random.default_rng(24)
        prompts = [[int(t) for t in rng.integers(100, 5000, n)] for n in (9, 600)]

        def greedy_request(rid, p, n, **more):
            return {"id": rid, "prompt": p, "n_predict": n, "temperature": 0, "ignore_eos": True,
                    "cache_prompt": False, **more}  # fmt: skip

        plain = alone.command("COMPLETE", greedy_request("p", prompts[0], 40))
        stop = plain["content"][len(plain["content"]) // 2 :][:3]
        requests = {
            "w": greedy_request("w", prompts[0], 40, stop=[stop]),
            "l": greedy_request("l", prompts[1], 50),
        }
        expected = alone_then_together(alone, e, requests)
        assert expected["w"]["stop_type"] == "word"
    finally:
        for engine in engines:
            engine.close()
