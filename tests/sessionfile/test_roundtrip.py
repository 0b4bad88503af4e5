"""Writer and reader together: round trips in every mode and block size, reports, progress, binding and
limit refusals, the crash-safe write protocol's visible effects."""

from __future__ import annotations

import os
import stat

import attrs
import pytest
from strata_sessionfile import Phase, inspect, restore, save
from strata_sessionfile import errors as E
from strata_sessionfile.identity import config_fingerprint
from strata_sessionfile.records import EngineIdentity, LayerSpec
from strata_sessionfile.testing import MemoryAdapter, fake_identity, memory_adapter_factory

from .helpers import files_in


@pytest.mark.parametrize("block_size", [4096, 5000, 65536, 1 << 20])
@pytest.mark.parametrize("mode", ["streaming", "staged", "auto"])
def test_round_trip_every_mode_and_block_size(factory, staging_factory, tmp_path, block_size, mode):
    source = factory(1)
    path = tmp_path / "s.ssf"
    report = save(path, source, block_size=block_size)
    assert report.bytes_written == path.stat().st_size
    assert report.n_tokens == source.state.n_tokens
    target = (staging_factory if mode != "streaming" else factory)(2)
    assert target.live_digest() != source.live_digest()
    rr = restore(path, target, mode=mode, block_size=block_size)
    assert target.live_digest() == source.live_digest()
    assert rr.mode == ("streaming" if mode == "streaming" else "staged")
    info = inspect(path)
    if rr.mode == "streaming":
        assert target.events[0] == "check_plan" and target.events[1] == "begin_apply"
        assert target.events[-1] == "commit"
        assert rr.bytes_read == 2 * (info.layout.file_size - 64) + 64
    else:
        assert target.events[:2] == ["check_plan", "begin_staging"] and target.events[-1] == "commit_staged"
        assert rr.bytes_read == info.layout.file_size


def test_empty_session_round_trips(tmp_path):
    f = memory_adapter_factory(n_tokens=0)
    source = f(0)
    source.load_snapshot(
        attrs.evolve(
            source.snapshot(),
            state=attrs.evolve(
                source.state,
                tokens=[],
                position=0,
                checkpoint=attrs.evolve(source.state.checkpoint, token_index=0),
            ),
        )
    )
    source.layers = tuple(attrs.evolve(g, tokens_held=0) for g in source.layers)
    source.load_snapshot(source.snapshot())
    path = tmp_path / "empty.ssf"
    save(path, source)
    info = inspect(path)
    assert info.metadata.state.n_tokens == 0
    target = f(3)
    assert target.live_digest() != source.live_digest()
    restore(path, target)
    assert target.state.n_tokens == 0 and target.events[-1] == "commit"
    assert target.live_digest() == source.live_digest()  # every layer empty, the extra parts restored


def test_save_progress_phases_and_restore_progress(factory, tmp_path):
    events = []
    path = tmp_path / "s.ssf"
    save(path, factory(1), block_size=4096, progress=events.append)
    phases = [e.phase for e in events]
    assert phases[0] == Phase.COPY and phases[-2:] == [Phase.FLUSH, Phase.RENAME]
    copies = [e.bytes_done for e in events if e.phase == Phase.COPY]
    assert copies == sorted(copies) and copies[-1] == events[-1].bytes_total == path.stat().st_size
    assert len(copies) > 5
    events.clear()
    restore(path, factory(2), block_size=4096, progress=events.append, mode="streaming")
    assert {e.phase for e in events} == {Phase.READ, Phase.APPLY}
    assert events[-1].phase == Phase.APPLY and events[-1].bytes_done == events[-1].bytes_total


def test_save_replaces_atomically_and_leaves_no_temporary(factory, tmp_path):
    path = tmp_path / "s.ssf"
    path.write_bytes(b"old")
    save(path, factory(1))
    assert files_in(tmp_path) == ["s.ssf"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert inspect(path).payload_verified


def test_the_writer_runs_its_stages_in_order_only(factory, tmp_path):
    from strata_sessionfile.writer import SessionWriter, Stage

    writer = SessionWriter(tmp_path / "s.ssf", factory(1))
    with pytest.raises(RuntimeError, match="save stage CREATE cannot follow nothing"):
        writer.create()
    writer.plan()
    with pytest.raises(RuntimeError, match="save stage WRITE cannot follow PLAN"):
        writer.write()
    assert writer.stage is Stage.PLAN and files_in(tmp_path) == []  # nothing on disk before CREATE
    writer.create()
    with pytest.raises(RuntimeError, match="save stage CREATE cannot follow CREATE"):
        writer.create()
    writer.discard()
    assert files_in(tmp_path) == []


class _Boom(Exception):
    pass


def test_adapter_failure_during_copy_keeps_old_file(factory, tmp_path):
    path = tmp_path / "s.ssf"
    save(path, factory(1))
    old = path.read_bytes()
    broken = factory(2)
    calls = []

    def copy_out(*a):
        calls.append(a)
        if len(calls) == 3:
            raise _Boom("device lost")
        return MemoryAdapter.copy_out(broken, *a)

    broken.copy_out = copy_out
    with pytest.raises(E.AdapterFailed) as info:
        save(path, broken, block_size=4096)
    assert isinstance(info.value.__cause__, _Boom)
    assert path.read_bytes() == old and files_in(tmp_path) == ["s.ssf"]


def test_invalid_snapshot_is_refused_before_any_write(factory, tmp_path):
    a = factory(1)
    a.state = attrs.evolve(a.state, position=1)  # below the tokens held
    with pytest.raises(E.InvalidSnapshot, match="position"):
        save(tmp_path / "s.ssf", a)
    assert files_in(tmp_path) == []


def test_buffer_provider_buffers_are_used(factory, tmp_path):
    provided = []

    class Pinned(MemoryAdapter):
        def block_buffers(self, count, nbytes):
            bufs = [memoryview(bytearray(nbytes)) for _ in range(count)]
            provided.extend(bufs)
            return bufs

    src = factory(1)
    a = Pinned(src.identity(), src.specs)
    a.load_snapshot(src.snapshot(), 1)
    seen = []
    orig = MemoryAdapter.copy_out

    def spy(layer, part, offset, dest):
        seen.append(dest.obj)
        return orig(a, layer, part, offset, dest)

    a.copy_out = spy
    save(tmp_path / "s.ssf", a, block_size=8192)
    assert len(provided) == 2 and seen and {id(o) for o in seen} <= {id(b.obj) for b in provided}


# --- binding and limits --------------------------------------------------------------------------------
def test_model_mismatch_names_the_file(factory, tmp_path):
    path = tmp_path / "s.ssf"
    save(path, factory(1))
    other = factory(2)
    other._identity = fake_identity("another-model")
    with pytest.raises(E.ModelMismatch, match=r"model file 0 \(model\) sampled digest differs") as info:
        restore(path, other)
    assert info.value.reason == "model_mismatch" and other.events == []


def test_config_mismatch_names_the_key(factory, tmp_path):
    path = tmp_path / "s.ssf"
    save(path, factory(1))
    other = factory(2)
    ident = other.identity()
    other._identity = EngineIdentity(
        ident.model, config_fingerprint({**ident.config.mapping, "kv_type": "i8"})
    )
    with pytest.raises(E.ConfigMismatch) as info:
        restore(path, other)
    assert info.value.differences == ("kv_type: file 'f16', engine 'i8'",)
    assert "kv_type: file 'f16', engine 'i8'" in str(info.value) and other.events == []


def test_geometry_mismatch_names_layer_and_field(factory, tmp_path):
    path = tmp_path / "s.ssf"
    save(path, factory(1))
    other = factory(2)
    other.specs = (attrs.evolve(other.specs[0], n_kv_heads=3),) + other.specs[1:]
    with pytest.raises(E.GeometryMismatch, match="layer 0 n_kv_heads: file 2, engine 3"):
        restore(path, other)
    other.specs = other.specs[:-1]
    with pytest.raises(E.GeometryMismatch, match="the file has 6 layers, the engine 5"):
        restore(path, other)
    assert other.events == []


@pytest.mark.parametrize(
    "attr,value,field", [("max_tokens", 100, "state.n_tokens"), ("vocab_size", 10, "state.tokens")]
)
def test_engine_limits_are_enforced(factory, tmp_path, attr, value, field):
    path = tmp_path / "s.ssf"
    save(path, factory(1))
    other = factory(2)
    setattr(other, attr, value)
    with pytest.raises(E.LimitExceeded) as info:
        restore(path, other)
    assert info.value.field == field and other.events == []


def test_ram_preflight_refuses_cleanly(factory, tmp_path):
    path = tmp_path / "s.ssf"
    save(path, factory(1))
    other = factory(2)
    before = other.live_digest()
    with pytest.raises(E.InsufficientMemory):
        restore(path, other, memory_available=lambda: 1 << 20)
    assert other.events == [] and other.live_digest() == before


def test_staged_mode_needs_a_staging_adapter(factory, tmp_path):
    path = tmp_path / "s.ssf"
    save(path, factory(1))
    with pytest.raises(E.StagingUnavailable):
        restore(path, factory(2), mode="staged")


def test_check_plan_refusal_in_staged_mode_stages_nothing(staging_factory, tmp_path):
    path = tmp_path / "s.ssf"
    save(path, staging_factory(1))
    other = staging_factory(2)
    before = other.live_digest()

    def refuse(plan):
        raise E.GeometryMismatch("no")

    other.check_plan = refuse
    with pytest.raises(E.GeometryMismatch):
        restore(path, other)
    assert other.events == [] and other.live_digest() == before


def test_layer_spec_converts_codes():
    spec = LayerSpec(0, 1, 2, 3, 4, 2, 4)
    assert spec.role.name == "DRAFT" and spec.k_dtype.name == "F16" and spec.v_dtype.name == "I8"


def test_inspect_does_not_need_an_engine(factory, tmp_path):
    path = tmp_path / "s.ssf"
    save(path, factory(1))
    info = inspect(path, verify=False)
    assert not info.payload_verified and info.payload_hash is None
    assert info.layout.data_offset % 4096 == 0
    assert os.path.getsize(path) == info.layout.file_size


def test_reused_block_buffers(factory, tmp_path):
    from strata_sessionfile import BlockBuffers

    bufs = BlockBuffers(8192)
    path = tmp_path / "s.ssf"
    save(path, factory(1), block_size=8192, buffers=bufs)
    target = factory(2)
    restore(path, target, block_size=8192, buffers=bufs)
    restore(path, factory(3), block_size=4096, buffers=bufs)  # smaller blocks fit too
    assert target.live_digest() == factory(1).live_digest()
    with pytest.raises(ValueError):
        save(path, factory(1), block_size=16384, buffers=bufs)
    with pytest.raises(ValueError):
        BlockBuffers(100)


def test_reference_adapter_satisfies_every_protocol(factory):
    from strata_sessionfile import SessionAdapter, SessionSource, SessionTarget, StagingTarget

    a = factory(1)
    assert isinstance(a, SessionSource) and isinstance(a, SessionTarget)
    assert isinstance(a, StagingTarget) and isinstance(a, SessionAdapter)


@pytest.mark.parametrize("name", ["x" * 255, "é" * 127 + "x"])
def test_a_target_name_of_the_full_255_bytes_saves(factory, tmp_path, name):
    # The temporary's name is cut to fit NAME_MAX (on a character boundary), not the target's.
    source = factory(1)
    path = tmp_path / name
    report = save(path, source)
    assert path.stat().st_size == report.bytes_written
    assert [p.name for p in tmp_path.iterdir()] == [name]
    target = factory(2)
    restore(path, target)
    assert target.live_digest() == source.live_digest()
