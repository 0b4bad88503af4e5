"""Robustness of the reader: truncation, header flips, seeded random payload mutations (hypothesis), file
types, files that change between or during the passes, and the gate on both sides of the first block.

The invariant everywhere: only SessionFileError subclasses escape, and an adapter receives nothing
(no begin_apply, copy_in, stage_in, commit) unless the whole file validated first."""

from __future__ import annotations

import errno
import os
import random
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strata_sessionfile import Phase, inspect, restore, save
from strata_sessionfile import errors as E

from .helpers import SMALL, SMALL_STAGING, check_refused_cleanly, mutate, restore_invariant


class _Good(tuple):
    def __repr__(self) -> str:  # keeps hypothesis' failure reports short
        return f"<good file {self[0]}>"


@pytest.fixture(scope="module")
def good_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("good") / "good.ssf"
    save(path, SMALL(1), block_size=4096)
    return _Good((path, path.read_bytes()))


def test_truncation_at_every_section_boundary_and_random_offsets(good_file, tmp_path):
    path, data = good_file
    info = inspect(path)
    lay = info.layout
    cuts = {
        0,
        1,
        63,
        64,
        67,
        68,
        lay.data_offset - 1,
        lay.data_offset,
        lay.trailer_offset,
        lay.trailer_offset + 16,
        lay.file_size - 1,
    }
    for ext in lay.extents:
        cuts |= {lay.data_offset + ext.data_offset, lay.data_offset + ext.data_offset + ext.size - 1}
    rng = random.Random(7)
    cuts |= {rng.randrange(len(data)) for _ in range(150)}
    bad = tmp_path / "t.ssf"
    for cut in sorted(cuts):
        bad.write_bytes(data[:cut])
        check_refused_cleanly(bad, expected=E.Truncated)
        check_refused_cleanly(bad, staging=True, expected=E.Truncated)


def test_every_single_byte_and_bit_flip_in_the_header(good_file, tmp_path):
    path, data = good_file
    bad = tmp_path / "h.ssf"
    for off in range(64):
        for mask in (0xFF, *(1 << b for b in range(8))):
            b = bytearray(data)
            b[off] ^= mask
            bad.write_bytes(bytes(b))
            check_refused_cleanly(bad)


# --- hypothesis: seeded random payload mutations ---------------------------------------------------
_interesting = st.sampled_from(
    [
        0,
        1,
        2,
        3,
        4,
        5,
        255,
        4096,
        65535,
        1 << 16,
        1 << 24,
        1 << 31,
        0xFFFFFFFF,
        1 << 32,
        1 << 48,
        (1 << 64) - 1,
    ]
)
_op = st.tuples(
    st.sampled_from(["flip", "flip", "u32", "u64", "insert", "delete"]),
    st.integers(min_value=0, max_value=1 << 20),
    st.one_of(st.integers(min_value=0, max_value=(1 << 64) - 1), _interesting),
)
# Offsets concentrated in the metadata (where the parser lives) as well as anywhere.
_meta_op = st.tuples(
    st.sampled_from(["flip", "u32", "u64"]),
    st.integers(min_value=64, max_value=700),
    st.one_of(st.integers(min_value=0, max_value=(1 << 64) - 1), _interesting),
)


@settings(
    max_examples=2000,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    ops=st.lists(st.one_of(_op, _meta_op), min_size=1, max_size=4),
    rehash=st.booleans(),
    staging=st.booleans(),
)
def test_random_mutations_only_raise_session_file_errors(good_file, tmp_path, ops, rehash, staging):
    _path, data = good_file
    bad = tmp_path / "m.ssf"
    mutated = mutate(data, ops, rehash)
    if bad.exists():
        bad.unlink()
    bad.write_bytes(mutated)
    try:
        inspect(bad)
    except E.SessionFileError:
        pass
    accepted = restore_invariant(bad, staging)
    if mutated != data and not rehash:
        assert not accepted


# --- file types ------------------------------------------------------------------------------------
def test_symlink_hardlink_fifo_directory_device_refused(good_file, tmp_path):
    path, data = good_file
    own = tmp_path / "own.ssf"
    own.write_bytes(data)
    link = tmp_path / "link.ssf"
    os.symlink(own, link)
    check_refused_cleanly(link, expected=E.SymlinkRefused)
    with pytest.raises(E.SymlinkRefused):
        inspect(link)
    dirlink = tmp_path / "dirlink"
    os.symlink(tmp_path, dirlink)
    check_refused_cleanly(dirlink, expected=E.SymlinkRefused)
    hard = tmp_path / "hard.ssf"
    os.link(own, hard)
    check_refused_cleanly(own, expected=E.MultipleLinks)
    check_refused_cleanly(hard, expected=E.MultipleLinks)
    os.unlink(hard)
    restore(own, SMALL(2), block_size=4096)  # one name again: accepted
    fifo = tmp_path / "fifo.ssf"
    os.mkfifo(fifo)
    done = threading.Event()

    def guarded():  # a FIFO without a writer must not block the open
        try:
            check_refused_cleanly(fifo, expected=E.NotRegularFile)
        finally:
            done.set()

    t = threading.Thread(target=guarded, daemon=True)
    t.start()
    assert done.wait(10), "opening a FIFO blocked"
    t.join()
    check_refused_cleanly(tmp_path, expected=E.NotRegularFile)
    check_refused_cleanly("/dev/null", expected=E.NotRegularFile)
    check_refused_cleanly(tmp_path / "absent.ssf", expected=E.NotFound)


def test_unreadable_file_is_refused(good_file, tmp_path, monkeypatch):
    path, data = good_file
    p = tmp_path / "locked.ssf"
    p.write_bytes(data)
    p.chmod(0)
    if os.geteuid() == 0:  # root reads everything: the open's EACCES is injected instead
        real_open = os.open

        def open_(name, flags, *args, **kwargs):
            if os.fspath(name) == str(p):
                raise PermissionError(errno.EACCES, "Permission denied", str(p))
            return real_open(name, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", open_)
    check_refused_cleanly(p, expected=E.PermissionDenied)


# --- files that change -----------------------------------------------------------------------------
def _flip_at(path, offset: int, keep_mtime: bool = False) -> None:
    st_before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))
    if keep_mtime:
        os.utime(path, ns=(st_before.st_atime_ns, st_before.st_mtime_ns))


@pytest.mark.parametrize("change", ["grow", "shrink", "modify", "modify_keep_mtime", "replace_metadata"])
def test_file_changed_between_the_passes_is_refused_before_the_gate(good_file, tmp_path, change):
    _path, data = good_file
    p = tmp_path / "c.ssf"
    p.write_bytes(data)
    info = inspect(p)
    target = SMALL(2)
    before = target.live_digest()

    def check_plan(plan):
        target.events.append("check_plan")
        if change == "grow":
            with open(p, "ab") as f:
                f.write(b"\0")
        elif change == "shrink":
            os.truncate(p, len(data) - 1)
        elif change == "modify":
            _flip_at(p, info.layout.data_offset + 10)
        elif change == "modify_keep_mtime":
            _flip_at(p, info.layout.data_offset + 10, keep_mtime=True)
        else:
            _flip_at(p, 80, keep_mtime=True)

    target.check_plan = check_plan
    with pytest.raises(E.FileChanged):
        restore(p, target, block_size=4096, mode="streaming")
    assert target.events == ["check_plan"] and target.live_digest() == before


def test_file_changed_during_the_read_pass_is_refused(good_file, tmp_path):
    _path, data = good_file
    p = tmp_path / "c.ssf"
    p.write_bytes(data)
    info = inspect(p)
    target = SMALL(2)
    flipped = []

    def progress(ev):
        if ev.phase == Phase.READ and not flipped:
            flipped.append(1)
            _flip_at(p, info.layout.trailer_offset - 1)

    with pytest.raises((E.PayloadCorrupt, E.FileChanged)):
        restore(p, target, block_size=4096, progress=progress, mode="streaming")
    assert target.events == []


def test_file_changed_during_the_apply_pass_fail_stops(good_file, tmp_path):
    _path, data = good_file
    p = tmp_path / "c.ssf"
    p.write_bytes(data)
    info = inspect(p)
    assert info.layout.data_length > 3 * 4096
    target = SMALL(2)
    orig = type(target).copy_in

    def copy_in(layer, part, offset, src):
        if target.events.count("copy_in") == 0:
            _flip_at(p, info.layout.trailer_offset - 1, keep_mtime=True)
        orig(target, layer, part, offset, src)

    target.copy_in = copy_in
    with pytest.raises(E.FailStop) as exc:
        restore(p, target, block_size=4096, mode="streaming")
    assert exc.value.cause_reason in ("payload_corrupt", "file_changed")
    assert target.events.count("fail_stop") == 1 and "commit" not in target.events
    assert target.fail_stopped is exc.value.cause


def test_file_changed_during_a_staged_pass_keeps_the_live_session(good_file, tmp_path):
    _path, data = good_file
    p = tmp_path / "c.ssf"
    p.write_bytes(data)
    info = inspect(p)
    target = SMALL_STAGING(2)
    before = target.live_digest()
    orig = type(target).stage_in

    def stage_in(layer, part, offset, src):
        if target.events.count("stage_in") == 0:
            _flip_at(p, info.layout.trailer_offset - 1, keep_mtime=True)
        orig(target, layer, part, offset, src)

    target.stage_in = stage_in
    with pytest.raises((E.PayloadCorrupt, E.FileChanged)):
        restore(p, target, block_size=4096)
    assert target.events[-1] == "discard_staged" and "commit_staged" not in target.events
    assert "fail_stop" not in target.events and target.live_digest() == before


# --- the gate ----------------------------------------------------------------------------------------
def test_failures_before_the_gate_are_clean(good_file, monkeypatch):
    path, _data = good_file
    from strata_sessionfile import _fileio

    target = SMALL(2)
    before = target.live_digest()
    real = _fileio.pread_into
    calls = []

    def failing(fd, buf, offset):
        calls.append(offset)
        if len(calls) > 6:  # header, metadata, padding, trailer read; then fail inside the read pass
            raise OSError(5, "Input/output error")
        return real(fd, buf, offset)

    monkeypatch.setattr(_fileio, "pread_into", failing)
    with pytest.raises(E.ReadFailed):
        restore(path, target, block_size=4096)
    assert target.events == [] and target.live_digest() == before


@pytest.mark.parametrize("where", ["begin_apply", "copy_in_2", "commit", "eio_apply"])
def test_failures_after_the_gate_fail_stop(good_file, monkeypatch, where):
    path, _data = good_file
    from strata_sessionfile import _fileio

    target = SMALL(2)
    cls = type(target)

    def boom(*a):
        raise RuntimeError("device lost")

    if where == "begin_apply":
        target.begin_apply = boom
    elif where == "copy_in_2":

        def copy_in(*a):
            if target.events.count("copy_in") == 2:
                boom()
            cls.copy_in(target, *a)

        target.copy_in = copy_in
    elif where == "commit":
        target.commit = boom
    else:
        real = _fileio.pread_into
        seen = {"applying": False}
        orig_begin = cls.begin_apply

        def begin_apply(plan):
            seen["applying"] = True
            orig_begin(target, plan)

        def failing(fd, buf, offset):
            if seen["applying"]:
                raise OSError(5, "Input/output error")
            return real(fd, buf, offset)

        target.begin_apply = begin_apply
        monkeypatch.setattr(_fileio, "pread_into", failing)
    with pytest.raises(E.FailStop) as exc:
        restore(path, target, block_size=4096, mode="streaming")
    assert target.events.count("fail_stop") == 1 and "commit" not in target.events
    assert exc.value.cause_reason == ("read_failed" if where == "eio_apply" else "adapter_failed")
