"""The engine's session adapter in-process: the format package's conformance kit, the file's layout
(rings in logical order, int8 sub-heads, the deepest checkpoint), round trips in both restore modes, the
gate (faults before and after it), refusals of plans the engine cannot take, and the residency refill.

Most tests run on "synthetic" runners: the real models' configurations (gemma3 with its windows shrunk
to 8 so rings wrap within a few dozen tokens) over a real K/V pool filled with random bytes, without
weights; the refill test runs the real SmolLM2 model.
"""

from __future__ import annotations

import array
import json
import os

import attrs
import numpy as np
import pytest
import strata_sessionfile as sf
from strata_engine.config import ModelConfig
from strata_engine.gguf import read_gguf
from strata_engine.kv import KVGeometry, KVParts, KVPool, make_placement, take_checkpoint
from strata_engine.ops import get_ops
from strata_engine.runner import ModelRunner, RunnerState
from strata_engine.sampling import SamplerState
from strata_engine.session import (
    BlockBufferCache,
    EngineSession,
    FaultPoint,
    SamplerAccess,
    SessionOptions,
    config_mapping,
    runner_identity,
)
from strata_engine.settings import EngineSettings, KVType
from strata_sessionfile import Part
from strata_sessionfile import errors as E
from strata_sessionfile.testing import run_conformance
from support.data import gemma3_model_path, smollm2_model_path

from .runners import bare_runner

SMALL_WINDOW = 8  # synthetic gemma3: ring capacity 16


@pytest.fixture(scope="module")
def models():
    out = {}
    for name, path in (("gemma3", gemma3_model_path()), ("smollm2", smollm2_model_path())):
        gguf = read_gguf(path)
        config = ModelConfig.from_gguf(gguf)
        # Fewer layers (gemma3: one period of 5 sliding-window layers and a global one) keep the files
        # small; the conformance kit saves and restores a few hundred of them.
        layers = config.layers[:6] if name == "gemma3" else config.layers[:4]
        if name == "gemma3":
            layers = tuple(
                attrs.evolve(lc, window=SMALL_WINDOW if lc.window is not None else None) for lc in layers
            )
        out[name] = (path, gguf, attrs.evolve(config, layers=tuple(layers), n_layer=len(layers)))
    return out


@pytest.fixture
def tmp_path(tmp_path):
    """A scratch folder on tmpfs where there is one: the library fsyncs every save, which on a disk
    dominates these tests' time without testing anything the sessionfile tests do not."""
    shm = "/dev/shm"
    if not (os.path.isdir(shm) and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    import shutil
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp(prefix="strata-session-test-", dir=shm))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def synthetic_runner(
    models, name: str, kv_type: str = "f16", n_ctx: int = 64, kv_resident: int | None = None
) -> ModelRunner:
    path, gguf, config = models[name]
    settings = EngineSettings(path, n_ctx=n_ctx, kv_type=kv_type, kv_resident=kv_resident)
    pool = KVPool(KVGeometry.from_config(config, n_ctx, KVType(kv_type)), get_ops("numpy", "f32"))
    return bare_runner(settings, gguf, config, make_placement(pool, kv_resident))


def _random_parts(rng: np.random.Generator, pool: KVPool, i: int, m: int) -> KVParts:
    layer = pool.layer(i)
    row = layer.k.shape[1:]
    if layer.k_scale is None:

        def values():
            return rng.standard_normal((m, *row)).astype(layer.k.dtype)

        return KVParts(values(), values())

    def q():
        return rng.integers(-127, 128, (m, *row), dtype=np.int8)

    def s():
        return rng.random((m, *layer.k_scale.shape[1:]), dtype=np.float32)

    return KVParts(q(), q(), s(), s())


def fill(runner: ModelRunner, n: int, seed: int, checkpoint_at: int | None = None) -> ModelRunner:
    """Give the runner a conversation of n random tokens with random K/V (and a ring checkpoint)."""
    rng = np.random.default_rng(seed)
    runner.erase()
    pool = runner.pool
    tokens = tuple(int(t) for t in rng.integers(0, 1000, n))
    checkpoints = []

    def append(lo: int, hi: int) -> None:
        for pos in range(lo, hi, 5):
            m = min(5, hi - pos)
            pool.begin_append(pos, m)
            for i in range(pool.geometry.n_layers):
                pool.write(i, pos, _random_parts(rng, pool, i, m))
            pool.commit_append(m)

    cut = n if checkpoint_at is None else checkpoint_at
    append(0, cut)
    if checkpoint_at is not None and pool.geometry.max_window is not None:
        checkpoints.append(take_checkpoint(pool))
    append(cut, n)
    runner.restore_state(RunnerState(tokens, pool.ring_start, tuple(checkpoints)))
    return runner


def live_digest(runner: ModelRunner, sampler: SamplerAccess | None = None) -> tuple:
    """Everything a restore could change: tokens, extent, checkpoints, every held K/V byte, the sampler."""
    pool = runner.pool
    held = []
    for i in range(pool.geometry.n_layers):
        lo, hi = pool.held_range(i)
        held.append(b"".join(a.tobytes() for a in pool.read(i, lo, hi).arrays()))
    cps = [
        (c.position, c.start, b"".join(a.tobytes() for p in c.layers.values() for a in p.arrays()))
        for c in runner.checkpoints
    ]
    return (
        tuple(runner.tokens_held),
        pool.n_tokens,
        pool.ring_start,
        tuple(held),
        tuple(cps),
        sampler.get().to_bytes() if sampler else None,
    )


def _factory(models, name: str, kv_type: str, staging: bool):
    identity = runner_identity(synthetic_runner(models, name, kv_type))

    def factory(seed: int) -> EngineSession:
        n = 40 + seed % 7
        runner = fill(synthetic_runner(models, name, kv_type), n, seed, checkpoint_at=n - 2 - seed % 3)
        return EngineSession(
            runner, SamplerAccess.holder(SamplerState.seeded(seed)), identity=identity, staging=staging
        )

    return factory


@pytest.mark.parametrize(
    ("name", "kv_type", "staging"), [("gemma3", "f16", True), ("smollm2", "int8", False)]
)
def test_conformance_kit_passes(models, tmp_path, name, kv_type, staging):
    ran = run_conformance(
        _factory(models, name, kv_type, staging), tmp_path, random_truncations=8, random_flips=24
    )
    assert {"round_trip", "truncation", "binding", "gate_before", "gate_after", "file_types"} <= set(ran)
    assert ("staged" in ran) == staging


def test_file_layout_rings_in_logical_order_and_deepest_checkpoint(models, tmp_path):
    runner = fill(synthetic_runner(models, "gemma3"), 50, seed=3, checkpoint_at=46)
    pool = runner.pool
    ring = pool.geometry.ring_layers[0]
    start = 50 - SMALL_WINDOW
    assert start % pool.geometry.layers[ring].capacity + SMALL_WINDOW > pool.geometry.layers[ring].capacity, (
        "the saved window must wrap around the ring for this test to mean something"
    )
    path = tmp_path / "s.ssf"
    sf.save(path, EngineSession(runner))
    info = sf.inspect(path)
    data = path.read_bytes()
    by_layer = {}
    for ext in info.layout.extents:
        a = info.layout.data_offset + ext.data_offset
        by_layer[(ext.layer, ext.part)] = data[a : a + ext.size]
    for i, g in enumerate(info.metadata.layers):
        expect_lo = start if g.spec.window else 0
        assert g.spec.window == (SMALL_WINDOW if i in pool.geometry.ring_layers else 0)
        assert g.tokens_held == 50 - expect_lo
        parts = pool.read(i, expect_lo, 50)
        assert by_layer[(i, Part.K)] == parts.k.tobytes() and by_layer[(i, Part.V)] == parts.v.tobytes()
    state = info.metadata.state
    fields = json.loads(state.engine_fields)
    assert fields == {
        "layout": 1,
        "ring_start": start,
        "checkpoint": {"position": 46, "start": 46 - SMALL_WINDOW + 1},
    }
    cp = runner.checkpoints[-1]
    assert state.checkpoint.token_index == 46
    assert state.checkpoint.data == b"".join(
        cp.layers[i].k.tobytes() + cp.layers[i].v.tobytes() for i in pool.geometry.ring_layers
    )
    assert tuple(state.tokens) == tuple(runner.tokens_held) and state.position == 50


def test_int8_layers_are_sub_heads_of_one_scale_each(models, tmp_path):
    runner = fill(synthetic_runner(models, "smollm2", "int8"), 20, seed=1)
    geometry = runner.kv_geometry.layers[0]
    n_scales = int(np.prod(runner.pool.layer(0).k_scale.shape[1:]))
    spec = EngineSession(runner).specs[0]
    assert spec.k_dtype is sf.DType.I8 and spec.n_kv_heads == n_scales
    assert spec.n_kv_heads * spec.head_dim_k == geometry.n_kv_heads * geometry.head_dim
    sf.save(tmp_path / "q.ssf", EngineSession(runner))
    g = sf.inspect(tmp_path / "q.ssf").metadata.layers[0]
    assert g.part_size(Part.K_SCALES) == runner.pool.read(0, 0, 20).k_scale.nbytes
    assert (
        config_mapping(runner)["kv_int8_scale_block"] == geometry.n_kv_heads * geometry.head_dim // n_scales
    )


class _CopyingSession(EngineSession):
    """The copying restore path (the one a device pool takes): nothing lands straight in host memory."""

    def can_land(self, plan) -> bool:
        return False


class _Spy:
    """Records which byte-moving calls a restore made."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for name in ("copy_in", "stage_in", "landing_views"):
            real = getattr(EngineSession, name)

            def spy(session, *args, _real=real, _name=name):
                self.calls.append(_name)
                return _real(session, *args)

            monkeypatch.setattr(EngineSession, name, spy)


@pytest.mark.parametrize("landing", [True, False], ids=["landing", "copying"])
@pytest.mark.parametrize("mode", ["streaming", "staged"])
def test_round_trip_restores_pool_state_checkpoint_and_sampler(models, tmp_path, mode, landing, monkeypatch):
    source = fill(synthetic_runner(models, "gemma3", kv_resident=4), 50, seed=5, checkpoint_at=47)
    source_sampler = SamplerAccess.holder(SamplerState.seeded(1234))
    sf.save(tmp_path / "s.ssf", EngineSession(source, source_sampler))
    target = fill(synthetic_runner(models, "gemma3"), 37, seed=6, checkpoint_at=30)
    target_sampler = SamplerAccess.holder(SamplerState.seeded(99))
    spy = _Spy(monkeypatch)
    session = (EngineSession if landing else _CopyingSession)(
        target, target_sampler, buffers=BlockBufferCache()
    )
    report = sf.restore(tmp_path / "s.ssf", session, mode=mode, block_size=4096)
    assert report.mode.value == mode and report.n_tokens == 50
    expected = "landing_views" if landing else ("stage_in" if mode == "staged" else "copy_in")
    assert set(spy.calls) == {expected}
    restored = live_digest(target, target_sampler)
    original = live_digest(source, source_sampler)
    # Only the last `window` tokens of a ring layer are saved: compare the ranges the file holds.
    assert restored[0] == original[0] and restored[1] == 50 and restored[2] == 50 - SMALL_WINDOW
    for i in range(source.kv_geometry.n_layers):
        lo, _ = target.pool.held_range(i)
        a, b = source.pool.read(i, lo, 50), target.pool.read(i, lo, 50)
        assert all(x.tobytes() == y.tobytes() for x, y in zip(a.arrays(), b.arrays(), strict=True))
    assert restored[4] == original[4][-1:]  # the deepest checkpoint, byte for byte
    assert restored[5] == original[5]


def test_notes_are_kept_in_the_engine_fields_and_a_restore_ignores_them(models, tmp_path):
    source = fill(synthetic_runner(models, "smollm2"), 20, seed=7)
    notes = '{"v":1,"messages":[{"role":"user","content":"<b>é</b>"}]}'
    sf.save(tmp_path / "n.ssf", EngineSession(source, notes=notes))
    fields = json.loads(sf.inspect(tmp_path / "n.ssf", verify=True).metadata.state.engine_fields)
    assert fields["notes"] == notes
    sf.save(tmp_path / "plain.ssf", EngineSession(source))
    assert "notes" not in json.loads(sf.inspect(tmp_path / "plain.ssf").metadata.state.engine_fields)
    target = synthetic_runner(models, "smollm2")
    sf.restore(tmp_path / "n.ssf", EngineSession(target))
    assert tuple(target.tokens_held) == tuple(source.tokens_held)


def test_empty_conversation_saves_and_restores_as_empty(models, tmp_path):
    empty = synthetic_runner(models, "smollm2")
    report = sf.save(tmp_path / "e.ssf", EngineSession(empty))
    assert report.n_tokens == 0
    target = fill(synthetic_runner(models, "smollm2"), 12, seed=2)
    sf.restore(tmp_path / "e.ssf", EngineSession(target))
    assert target.n_held == 0 and target.pool.n_tokens == 0


def test_save_failure_keeps_the_old_file(models, tmp_path):
    runner = fill(synthetic_runner(models, "smollm2"), 30, seed=4)
    path = tmp_path / "s.ssf"
    sf.save(path, EngineSession(runner))
    before = path.read_bytes()
    with pytest.raises(E.AdapterFailed, match="injected"):
        sf.save(path, EngineSession(fill(runner, 31, seed=5), fault=FaultPoint.SAVE_DURING_COPY))
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["s.ssf"]


@pytest.mark.parametrize("mode", ["streaming", "staged"])
def test_fault_before_the_gate_leaves_the_live_conversation_exactly(models, tmp_path, mode):
    sf.save(
        tmp_path / "s.ssf",
        EngineSession(fill(synthetic_runner(models, "gemma3"), 44, seed=7, checkpoint_at=40)),
    )
    live = fill(synthetic_runner(models, "gemma3", kv_resident=4), 33, seed=8, checkpoint_at=31)
    sampler = SamplerAccess.holder(SamplerState.seeded(5))
    before = live_digest(live, sampler)
    session = EngineSession(live, sampler, fault=FaultPoint.RESTORE_BEFORE_GATE)
    with pytest.raises(E.AdapterFailed, match="before the gate"):
        sf.restore(tmp_path / "s.ssf", session, mode=mode)
    assert live_digest(live, sampler) == before and not session.live_touched


@pytest.mark.parametrize(
    ("mode", "fault"),
    [("streaming", FaultPoint.RESTORE_AFTER_GATE), ("streaming", FaultPoint.RESTORE_AT_COMMIT)],
)
def test_fault_after_the_gate_fail_stops_and_drops_the_conversation(models, tmp_path, mode, fault):
    sf.save(tmp_path / "s.ssf", EngineSession(fill(synthetic_runner(models, "smollm2"), 44, seed=7)))
    live = fill(synthetic_runner(models, "smollm2"), 33, seed=8)
    session = EngineSession(live, fault=fault)
    with pytest.raises(E.FailStop):
        sf.restore(tmp_path / "s.ssf", session, mode=mode, block_size=64 << 10)
    assert session.fail_stopped is not None and live.n_held == 0 and live.pool.n_tokens == 0


def test_staged_restores_reuse_one_staging_area_and_a_refused_one_keeps_the_live_conversation(
    models, tmp_path
):
    """The staging area is mapped once (sized for the whole pool) and reused; a file that fails its hash
    lands in it, never in the pool."""
    buffers = BlockBufferCache()
    short, deep = tmp_path / "short.ssf", tmp_path / "deep.ssf"
    sf.save(short, EngineSession(fill(synthetic_runner(models, "smollm2"), 20, seed=1)))
    sf.save(deep, EngineSession(fill(synthetic_runner(models, "smollm2"), 60, seed=2)))
    live = fill(synthetic_runner(models, "smollm2"), 33, seed=3)
    sf.restore(short, EngineSession(live, buffers=buffers), mode="staged", block_size=4096)
    area = buffers.staging(1).ctypes.data
    sf.restore(deep, EngineSession(live, buffers=buffers), mode="staged", block_size=4096)
    assert buffers.staging(1).ctypes.data == area and live.n_held == 60
    data = bytearray(deep.read_bytes())
    lay = sf.inspect(deep).layout
    data[lay.data_offset + lay.data_length - 5] ^= 0x10
    bad = tmp_path / "bad.ssf"
    bad.write_bytes(bytes(data))
    live = fill(live, 41, seed=4)
    before = live_digest(live)
    session = EngineSession(live, buffers=buffers)
    with pytest.raises(E.PayloadCorrupt):
        sf.restore(bad, session, mode="staged", block_size=4096)
    assert live_digest(live) == before and not session.live_touched
    assert buffers.staging(1).ctypes.data == area


def _resident_bytes(address: int) -> int:
    """Rss of the mapping holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) << 10
    raise AssertionError(f"no mapping holds {address:#x}")


def _kernel_at_least(major: int, minor: int) -> bool:
    parts = os.uname().release.split(".")
    return os.uname().sysname == "Linux" and (int(parts[0]), int(parts[1].split("-")[0])) >= (major, minor)


@pytest.mark.skipif(not _kernel_at_least(5, 14), reason="MADV_POPULATE_WRITE needs Linux 5.14")
def test_the_staging_area_is_populated_at_once_and_a_kernel_without_the_advice_still_stages(
    models, tmp_path, monkeypatch
):
    """`staging(n)` faults its first n bytes in with one call (resident before anything writes them; the rest
    of a pool-sized mapping not); where the kernel refuses the advice a staged restore still lands."""
    from strata_engine.session import buffers as module

    area = BlockBufferCache().staging(8 << 20, reserve=64 << 20)
    assert 8 << 20 <= _resident_bytes(area.ctypes.data) < 64 << 20 and not area[:: 1 << 20].any()
    monkeypatch.setattr(module, "_POPULATE_WRITE", 0x7FFF)  # an advice no kernel knows: EINVAL, ignored
    sf.save(tmp_path / "s.ssf", EngineSession(fill(synthetic_runner(models, "smollm2"), 40, seed=21)))
    live = fill(synthetic_runner(models, "smollm2"), 25, seed=22)
    sf.restore(
        tmp_path / "s.ssf", EngineSession(live, buffers=BlockBufferCache()), mode="staged", block_size=4096
    )
    assert live.n_held == 40


@pytest.mark.parametrize("session_class", [EngineSession, _CopyingSession], ids=["landing", "copying"])
def test_a_fresh_engine_stages_into_its_own_pool(models, tmp_path, session_class):
    """An engine that holds nothing (the restart case) restores a staged file straight into its pool: no
    staging area is mapped, rings and checkpoint included; the result is what staging gives."""
    source = fill(synthetic_runner(models, "gemma3", n_ctx=256), 200, seed=11, checkpoint_at=190)
    sf.save(tmp_path / "s.ssf", EngineSession(source), block_size=4096)
    staged_once = fill(synthetic_runner(models, "gemma3", n_ctx=256), 30, seed=12)  # holds a conversation
    sf.restore(
        tmp_path / "s.ssf",
        session_class(staged_once, buffers=BlockBufferCache()),
        mode="staged",
        block_size=4096,
    )
    fresh, buffers = synthetic_runner(models, "gemma3", n_ctx=256), BlockBufferCache()
    report = sf.restore(
        tmp_path / "s.ssf", session_class(fresh, buffers=buffers), mode="staged", block_size=4096
    )
    assert report.mode is sf.RestoreMode.STAGED and buffers._staging is None
    # (a restore's rings hold the window the file has, not the source's whole ring: compare restores)
    assert live_digest(fresh) == live_digest(staged_once) and fresh.tokens_held == source.tokens_held


@pytest.mark.parametrize(
    "fault", [None, FaultPoint.RESTORE_AT_COMMIT], ids=["corrupt-file", "fault-at-commit"]
)
def test_a_fresh_engine_refuses_a_bad_file_and_still_holds_nothing(models, tmp_path, fault):
    """Staged into its own pool, a fresh engine that meets a corrupt file (or fails at the commit) has lost
    nothing: a clean refusal, not a fail-stop; it holds nothing and restores a good file next."""
    good = tmp_path / "good.ssf"
    sf.save(good, EngineSession(fill(synthetic_runner(models, "smollm2"), 44, seed=7)), block_size=4096)
    data = bytearray(good.read_bytes())
    lay = sf.inspect(good).layout
    if fault is None:
        data[lay.data_offset + lay.data_length // 2] ^= 0x01
    bad = tmp_path / "bad.ssf"
    bad.write_bytes(bytes(data))
    fresh = synthetic_runner(models, "smollm2")
    session = EngineSession(fresh, fault=fault)
    with pytest.raises((E.PayloadCorrupt, E.AdapterFailed)) as info:
        sf.restore(bad, session, mode="staged", block_size=4096)
    assert (
        not isinstance(info.value, E.FailStop) and not session.live_touched and session.fail_stopped is None
    )
    assert fresh.n_held == 0 and fresh.pool.n_tokens == 0 and not fresh.checkpoints
    sf.restore(good, EngineSession(fresh), mode="staged", block_size=4096)
    assert fresh.n_held == 44


def test_landing_after_the_gate_only(models, tmp_path):
    """The adapter refuses to hand out the live pool's memory before begin_apply."""
    sf.save(tmp_path / "s.ssf", EngineSession(fill(synthetic_runner(models, "smollm2"), 20, seed=1)))
    session = EngineSession(fill(synthetic_runner(models, "smollm2"), 10, seed=2))
    with pytest.raises(E.AdapterFailed, match="before the gate"):
        session.landing_views(0, Part.K, 0, 16)


def test_kv_bytes_before_check_plan_are_refused(models):
    """copy_in before check_plan prepared a plan: the adapter's own error, and the live pool untouched."""
    session = EngineSession(fill(synthetic_runner(models, "smollm2"), 10, seed=2))
    before = live_digest(session.runner)
    with pytest.raises(E.AdapterFailed, match="did not check"):
        session.copy_in(0, Part.K, 0, memoryview(bytes(16)))
    assert live_digest(session.runner) == before and not session.live_touched


def test_staged_commit_failure_marks_the_live_pool_touched(models, tmp_path):
    """A staged restore whose switch fails after writing the pool is no clean refusal: the serve verb
    turns it into a fail-stop because `live_touched` says the live K/V was written."""
    sf.save(tmp_path / "s.ssf", EngineSession(fill(synthetic_runner(models, "smollm2"), 44, seed=7)))
    live = fill(synthetic_runner(models, "smollm2"), 33, seed=8)
    session = EngineSession(live, fault=FaultPoint.RESTORE_AT_COMMIT)
    with pytest.raises(E.AdapterFailed, match="at the commit"):
        sf.restore(tmp_path / "s.ssf", session, mode="staged")
    assert session.live_touched


class _Tampered:
    """Writes the source's session with a modified running state (valid hashes: only the engine can tell)."""

    def __init__(self, inner: EngineSession, change):
        self.inner, self.change = inner, change

    def identity(self):
        return self.inner.identity()

    def snapshot(self):
        snap = self.inner.snapshot()
        return attrs.evolve(snap, state=self.change(snap.state))

    def copy_out(self, *args):
        return self.inner.copy_out(*args)


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(
            lambda st: attrs.evolve(st, engine_fields=b'{"layout":1,"ring_start":0,"checkpoint":null}'),
            id="ring_start",
        ),
        pytest.param(
            lambda st: attrs.evolve(
                st, checkpoint=sf.Checkpoint(st.checkpoint.token_index, st.checkpoint.data[:-4])
            ),
            id="checkpoint_size",
        ),
        pytest.param(lambda st: attrs.evolve(st, sampler_state=b"\x00" * 45), id="sampler_state"),
        pytest.param(lambda st: attrs.evolve(st, position=st.position + 1), id="position"),
        pytest.param(lambda st: attrs.evolve(st, engine_fields=b"not json"), id="engine_fields"),
    ],
)
def test_plans_the_engine_cannot_take_are_refused_before_the_gate(models, tmp_path, change):
    source = EngineSession(fill(synthetic_runner(models, "gemma3"), 44, seed=7, checkpoint_at=41))
    sf.save(tmp_path / "t.ssf", _Tampered(source, change))
    live = fill(synthetic_runner(models, "gemma3"), 30, seed=8, checkpoint_at=29)
    before = live_digest(live)
    with pytest.raises(E.InconsistentState):
        sf.restore(tmp_path / "t.ssf", EngineSession(live))
    assert live_digest(live) == before


def test_token_checks_refuse_a_bad_id_with_the_first_bad_ids(models, tmp_path):
    runner = synthetic_runner(models, "smollm2")
    v = runner.config.n_vocab
    assert runner.state_problems(RunnerState((0, 5, v - 1), 0)) == []
    bad = RunnerState((3, v, -1, 7, v + 3, v + 4, v + 5, v + 6), 0)
    assert runner.state_problems(bad) == [f"token ids outside the vocabulary: {[v, -1, v + 3, v + 4, v + 5]}"]
    # A restored file's int32 array is checked in one numpy pass, with the same answers.
    assert runner.state_problems(RunnerState(array.array("i", bad.tokens), 0)) == runner.state_problems(bad)
    assert runner.state_problems(RunnerState(array.array("i", (0, 5, v - 1)), 0)) == []
    # In a file, the library's limits check refuses it first, naming the id, before the gate.
    source = EngineSession(fill(synthetic_runner(models, "smollm2"), 20, seed=5))
    sf.save(tmp_path / "t.ssf", _Tampered(source, lambda st: attrs.evolve(st, tokens=[*st.tokens[:-1], v])))
    live = fill(synthetic_runner(models, "smollm2"), 30, seed=6)
    before = live_digest(live)
    with pytest.raises(E.LimitExceeded, match=f"token id {v} is outside the engine's vocabulary of {v}"):
        sf.restore(tmp_path / "t.ssf", EngineSession(live))
    assert live_digest(live) == before


@pytest.mark.parametrize("landing", [True, False], ids=["landing", "copying"])
@pytest.mark.parametrize("mode", ["staged", "streaming"])
def test_every_number_of_readers_restores_the_same_pool_bytes(models, tmp_path, mode, landing):
    source = fill(synthetic_runner(models, "gemma3", n_ctx=256), 200, seed=11, checkpoint_at=190)
    sf.save(tmp_path / "s.ssf", EngineSession(source), block_size=4096)
    pools, digests = [], []
    for threads in (1, 2, 4):
        live = fill(synthetic_runner(models, "gemma3", n_ctx=256), 30, seed=12, checkpoint_at=29)
        session = (EngineSession if landing else _CopyingSession)(live, buffers=BlockBufferCache())
        report = sf.restore(tmp_path / "s.ssf", session, mode=mode, block_size=4096, read_threads=threads)
        assert report.mode.value == mode and live.n_held == 200
        for i in range(source.kv_geometry.n_layers):
            lo, _ = live.pool.held_range(i)
            a, b = source.pool.read(i, lo, 200), live.pool.read(i, lo, 200)
            assert all(x.tobytes() == y.tobytes() for x, y in zip(a.arrays(), b.arrays(), strict=True))
        pools.append(bytes(live.pool.buffer))
        digests.append(live_digest(live))
    assert pools[0] == pools[1] == pools[2] and digests[0] == digests[1] == digests[2]


def test_block_buffers_grow_and_are_kept():
    """A save asks for 2 block buffers, a restore for readers + 1, maybe smaller: nothing is allocated again."""
    cache = BlockBufferCache()
    two = cache.get(2, 8192)
    five = cache.get(5, 8192)
    assert [b.obj for b in five[:2]] == [b.obj for b in two] and all(len(b) == 8192 for b in five)
    again = cache.get(3, 4096)
    assert [b.obj for b in again] == [b.obj for b in five[:3]] and all(len(b) == 4096 for b in again)
    bigger = cache.get(2, 16384)
    assert all(len(b) == 16384 for b in bigger) and cache.get(5, 8192)[4].obj is five[4].obj


def test_device_pool_pins_its_block_buffers_once(models, monkeypatch):
    """`DevicePool.pinned_buffers` keeps what it pinned: alternating (count, size) requests pin nothing
    again (CuPy's pinned allocator replaced by a counting one, the pool laid out on NumPy)."""
    import sys
    import types

    from strata_engine.kv.device import DevicePool

    pinned = []

    def empty_pinned(shape, dtype):
        pinned.append(shape)
        return np.empty(shape, dtype=dtype)

    monkeypatch.setitem(sys.modules, "cupyx", types.SimpleNamespace(empty_pinned=empty_pinned))
    _path, _gguf, config = models["smollm2"]
    pool = DevicePool(KVGeometry.from_config(config, 16, KVType("f16")), get_ops("numpy", "f32"))
    first = pool.pinned_buffers(2, 16384)  # start-up
    assert len(pinned) == 2
    restore_bufs = pool.pinned_buffers(5, 4096)
    assert len(pinned) == 5 and [len(b) for b in restore_bufs] == [4096] * 5
    for _ in range(3):
        pool.pinned_buffers(2, 16384)
        pool.pinned_buffers(5, 4096)
    assert len(pinned) == 5

    def address(view: memoryview) -> int:
        return np.frombuffer(view, dtype=np.uint8).ctypes.data

    again = pool.pinned_buffers(2, 16384)  # the start-up buffers themselves, not copies or new ones
    assert [address(b) for b in again] == [address(b) for b in first]
    assert [len(b) for b in again] == [16384, 16384]


def test_session_block_size_is_4_mib_for_every_pool(models):
    from strata_engine.session.verbs import SESSION_BLOCK_SIZE, SessionVerbs

    runner = synthetic_runner(models, "smollm2")
    assert SessionVerbs(SessionOptions()).block_size(runner) == SESSION_BLOCK_SIZE == 4 << 20
    assert SessionVerbs(SessionOptions(block_size=1 << 20)).block_size(runner) == 1 << 20
    assert SessionVerbs(SessionOptions()).read_threads() == sf.default_read_threads()
    assert SessionVerbs(SessionOptions(read_threads=3)).read_threads() == 3


def test_progress_lines_are_a_phase_first_and_last_and_at_most_one_per_interval(monkeypatch):
    from strata_engine.session import verbs

    lines: list[dict] = []
    ctx = attrs.make_class("Ctx", {"emit": attrs.field()})(lines.append)
    clock = [100.0]
    monkeypatch.setattr(verbs.time, "monotonic", lambda: clock[0])
    report = verbs.SessionVerbs._progress(ctx)
    total = 30 << 22
    for phase in (sf.Phase.READ, sf.Phase.APPLY):
        for k in range(1, 31):  # 30 blocks, 1 ms apart, then the same report again
            clock[0] += 0.001
            report(sf.Progress(phase, k << 22, total))
            report(sf.Progress(phase, k << 22, total))
    assert [(x["phase"], x["bytes_done"]) for x in lines] == [
        ("read", 1 << 22),
        ("read", total),
        ("apply", 1 << 22),
        ("apply", total),
    ]
    lines.clear()
    for k in range(1, 31):  # 30 blocks, 40 ms apart: a line every 0.1 s at most
        clock[0] += 0.04
        report(sf.Progress(sf.Phase.APPLY, k << 22, total))
    assert 8 <= len(lines) <= 11 and lines[-1]["bytes_done"] == total


def test_session_options_fault_only_from_the_environment():
    assert SessionOptions.from_environ("streaming", {}).fault is None
    options = SessionOptions.from_environ("staged", {"STRATA_ENGINE_SESSION_FAULT": "restore-after-gate"})
    assert options.fault is FaultPoint.RESTORE_AFTER_GATE and options.restore_mode is sf.RestoreMode.STAGED
    with pytest.raises(ValueError, match="STRATA_ENGINE_SESSION_FAULT"):
        SessionOptions.from_environ("auto", {"STRATA_ENGINE_SESSION_FAULT": "bogus"})


# ---- the residency refill, on the real model ----------------------------------------------------------

N_REFILL = 64
N_RESIDENT = 16


@pytest.fixture(scope="module")
def real_smollm2():
    from .runners import base_runner, sibling  # one load of the weights per test process

    def load(**kw) -> ModelRunner:
        return sibling(base_runner("smollm2"), n_ctx=256, kv_type="f16", **kw)

    return load


def test_residency_refill_is_necessary(real_smollm2, tmp_path):
    rng = np.random.default_rng(11)
    conv_x = [int(t) for t in rng.integers(100, 20000, N_REFILL)]
    conv_y = [int(t) for t in rng.integers(100, 20000, N_REFILL)]
    following = conv_x + [1001, 1002, 1003]

    source = real_smollm2()
    source.prefill(conv_x)
    sf.save(tmp_path / "x.ssf", EngineSession(source))
    expected = source.prefill(following)

    def restored_turn(skip: tuple[str, ...]):
        target = real_smollm2(kv_resident=N_RESIDENT)
        target.prefill(conv_y)  # its resident rings now hold Y's last tokens at the same positions
        for name in skip:
            setattr(target.placement, name, lambda *a, **k: None)
        sf.restore(tmp_path / "x.ssf", EngineSession(target))
        pool_same = all(
            a.tobytes() == b.tobytes()
            for i in range(source.kv_geometry.n_layers)
            for a, b in zip(
                target.pool.read(i, 0, N_REFILL).arrays(),
                source.pool.read(i, 0, N_REFILL).arrays(),
                strict=True,
            )
        )
        return target, pool_same

    target, pool_same = restored_turn(())
    got = target.prefill(following)
    assert pool_same and got.cache_n == expected.cache_n == N_REFILL
    assert np.array_equal(got.logits, expected.logits)

    # Skip the refill (and the reset of the rings' extent): the pool bytes and the reuse count look right,
    # yet decoding reads Y's stale slots.
    target, pool_same = restored_turn(("refill", "truncated"))
    stale = target.prefill(following)
    assert pool_same and stale.cache_n == expected.cache_n
    assert not np.allclose(stale.logits, expected.logits, atol=1e-2)


def test_identity_covers_what_changes_the_kv_bytes_and_nothing_else(models):
    base = synthetic_runner(models, "gemma3")
    ident = runner_identity(base)
    assert ident.model.files[0].role == "model" and len(ident.model.files) == 1
    same = synthetic_runner(models, "gemma3", kv_resident=4)  # the placement does not change the bytes
    assert runner_identity(same).config.fingerprint == ident.config.fingerprint
    path, gguf, config = models["gemma3"]

    def with_config(cfg=config, **settings) -> ModelRunner:
        s = attrs.evolve(base.settings, **settings)
        pool = KVPool(KVGeometry.from_config(cfg, s.n_ctx, KVType(s.kv_type)), get_ops("numpy", "f32"))
        return bare_runner(s, gguf, cfg, make_placement(pool, None))

    rope = attrs.evolve(
        config, layers=tuple(attrs.evolve(lc, rope_base=lc.rope_base * 2) for lc in config.layers)
    )
    # f64 on numpy's own kernels (numba's compute in f32; the kernels are not in the identity)
    for changed, key in (
        (with_config(compute_dtype="f64", cpu_kernels="numpy"), "arithmetic"),
        (with_config(kv_type="int8"), "kv_type"),
        (with_config(n_ctx=128), "n_ctx"),
        (with_config(rope), "rope"),
    ):
        other = config_mapping(changed)
        assert runner_identity(changed).config.fingerprint != ident.config.fingerprint, key
        assert other[key] != config_mapping(base)[key], key
    assert runner_identity(base, engine_version_override="9.9.9").config.mapping["engine_version"] == "9.9.9"
    assert config_mapping(base)["adapters_digest"] == "none"
