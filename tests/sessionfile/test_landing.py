"""Restores that read straight into the adapter's memory (LandingTarget): the same bytes, checks, gate and
fail-stop as the copying path, and no helper thread left behind. The MemoryAdapter with zero_copy=True
hands every piece over as two views, and asserts that live views are asked for only after the gate."""

from __future__ import annotations

import os

import pytest
from strata_sessionfile import _fileio, inspect, restore, save
from strata_sessionfile import errors as E
from strata_sessionfile.testing import run_conformance

from .helpers import COPYING, COPYING_STAGING, LANDING, LANDING_STAGING, LIVE_TOUCH
from .helpers import helpers_alive as _helpers_alive


@pytest.mark.parametrize("factory", [LANDING, LANDING_STAGING], ids=["streaming", "staged"])
def test_conformance_with_landing(tmp_path, factory):
    assert "gate_after" in run_conformance(factory, tmp_path)
    assert not _helpers_alive()


@pytest.mark.parametrize("mode", ["streaming", "staged"])
@pytest.mark.parametrize("block_size", [4096, 8192, 1 << 20])
def test_landing_restores_the_same_session_as_copying(tmp_path, good, mode, block_size):
    factory = LANDING_STAGING if mode == "staged" else LANDING
    landed, copied = factory(2), (COPYING_STAGING if mode == "staged" else COPYING)(2)
    report = restore(good, landed, block_size=block_size, mode=mode)
    restore(good, copied, block_size=block_size, mode=mode)
    assert landed.live_digest() == copied.live_digest()
    assert "landing_views" in landed.events and not {"copy_in", "stage_in"} & set(landed.events)
    # Streaming: the gate comes before the first live view; staged: the live session only at the switch.
    first_landing = landed.events.index("landing_views")
    if mode == "streaming":
        assert landed.events.index("begin_apply") < first_landing
    else:
        assert landed.events.index("begin_staging") < first_landing < landed.events.index("commit_staged")
    size = good.stat().st_size  # staged reads the file once; streaming all but the header twice
    assert report.bytes_read == (size if mode == "staged" else 2 * size - 64)
    again = tmp_path / "again.ssf"
    save(again, landed, block_size=4096)
    assert again.read_bytes() == good.read_bytes()


def test_a_corrupt_payload_staged_by_landing_never_reaches_the_live_session(tmp_path, good):
    data = bytearray(good.read_bytes())
    lay = inspect(good).layout
    data[lay.data_offset + lay.data_length // 2] ^= 0x40
    bad = tmp_path / "bad.ssf"
    bad.write_bytes(bytes(data))
    target = LANDING_STAGING(2)
    before = target.live_digest()
    with pytest.raises(E.PayloadCorrupt):
        restore(bad, target, block_size=4096, mode="staged")
    assert "landing_views" in target.events and target.events[-1] == "discard_staged"
    assert not LIVE_TOUCH & set(target.events) and target.live_digest() == before
    assert not _helpers_alive()


def test_a_corrupt_payload_landed_in_streaming_mode_is_refused_in_the_read_pass(tmp_path, good):
    data = bytearray(good.read_bytes())
    data[inspect(good).layout.data_offset] ^= 1
    bad = tmp_path / "bad.ssf"
    bad.write_bytes(bytes(data))
    target = LANDING(2)
    before = target.live_digest()
    with pytest.raises(E.PayloadCorrupt):
        restore(bad, target, block_size=4096, mode="streaming")
    assert target.events == [] and target.live_digest() == before


def test_a_read_error_while_landing_after_the_gate_fail_stops_and_joins_the_helper(good, monkeypatch):
    target = LANDING(2)
    real = _fileio.pread_into

    def failing(fd, buf, offset):
        if "begin_apply" in target.events:  # a data read of the apply pass
            raise OSError(5, "Input/output error")
        return real(fd, buf, offset)

    monkeypatch.setattr(_fileio, "pread_into", failing)
    with pytest.raises(E.FailStop) as info:
        restore(good, target, block_size=4096, mode="streaming")
    assert info.value.cause_reason == "read_failed"
    assert target.events.count("fail_stop") == 1 and "commit" not in target.events
    assert not _helpers_alive()


@pytest.mark.parametrize("mode", ["streaming", "staged"])
@pytest.mark.parametrize("bad_views", ["short", "readonly"])
def test_views_the_library_cannot_fill_are_an_adapter_failure(good, mode, bad_views):
    factory = LANDING_STAGING if mode == "staged" else LANDING
    target = factory(2)
    before = target.live_digest()
    real = target.landing_views

    def landing_views(layer, part, offset, length):
        views = real(layer, part, offset, length)
        return views[:1] if bad_views == "short" and length > 1 else [v.toreadonly() for v in views]

    target.landing_views = landing_views
    if mode == "streaming":  # after the gate: a fail-stop
        with pytest.raises(E.FailStop) as info:
            restore(good, target, block_size=4096, mode=mode)
        assert info.value.cause_reason == "adapter_failed" and "commit" not in target.events
    else:  # staged: a clean refusal, the live session untouched
        with pytest.raises(E.AdapterFailed):
            restore(good, target, block_size=4096, mode=mode)
        assert target.events[-1] == "discard_staged" and target.live_digest() == before
    assert not _helpers_alive()


def test_a_file_truncated_during_the_landing_pass_is_caught(tmp_path, good):
    path = tmp_path / "t.ssf"
    path.write_bytes(good.read_bytes())
    target = LANDING_STAGING(2)
    real = target.landing_views
    cut = []

    def landing_views(*args):
        if not cut:
            cut.append(True)
            os.truncate(path, inspect(good).layout.data_offset + 100)
        return real(*args)

    target.landing_views = landing_views
    before = target.live_digest()
    with pytest.raises(E.FileChanged):
        restore(path, target, block_size=4096, mode="staged")
    assert target.live_digest() == before and not _helpers_alive()


def test_compressed_files_never_land(tmp_path):
    pytest.importorskip("zstandard")
    path = tmp_path / "z.ssf"
    save(path, COPYING(1), block_size=4096, compression="zstd")
    target = LANDING(2)
    restore(path, target, block_size=4096, mode="streaming")
    assert "copy_in" in target.events and "landing_views" not in target.events
