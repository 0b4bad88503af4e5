"""Injected faults during a save (ENOSPC, EIO on write, fsync, rename, fallocate, folder fsync): the old
file stays byte for byte and no temporary is left, except after the rename where the new file is in place
and DirSyncFailed says exactly that."""

from __future__ import annotations

import errno
import os
import stat

import pytest
from strata_sessionfile import _fileio, inspect, save
from strata_sessionfile import errors as E

from .helpers import files_in, trailer_digest


@pytest.fixture
def old_file(factory, tmp_path):
    path = tmp_path / "s.ssf"
    save(path, factory(1), block_size=4096)
    return path, path.read_bytes()


def _failing_write(after_bytes: int, err: int):
    real = _fileio.write
    written = [0]

    def write(fd, data):
        if written[0] + len(data) > after_bytes:
            raise OSError(err, os.strerror(err))
        n = real(fd, data)
        written[0] += n
        return n

    return write


@pytest.mark.parametrize("after", [0, 100, 5000, 30000])
@pytest.mark.parametrize(
    "err,cls", [(errno.ENOSPC, E.NoSpace), (errno.EIO, E.WriteFailed), (errno.EDQUOT, E.NoSpace)]
)
def test_write_failure_keeps_old_file(factory, old_file, monkeypatch, after, err, cls):
    path, old = old_file
    monkeypatch.setattr(_fileio, "write", _failing_write(after, err))
    with pytest.raises(cls) as info:
        save(path, factory(2), block_size=4096)
    assert type(info.value) is cls and info.value.path == str(path)
    assert path.read_bytes() == old and files_in(path.parent) == ["s.ssf"]


def test_fsync_failure_keeps_old_file(factory, old_file, monkeypatch):
    path, old = old_file

    def fsync(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_fileio, "fsync", fsync)
    with pytest.raises(E.WriteFailed, match="flushing"):
        save(path, factory(2))
    assert path.read_bytes() == old and files_in(path.parent) == ["s.ssf"]


def test_rename_failure_keeps_old_file(factory, old_file, monkeypatch):
    path, old = old_file

    def replace(a, b):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(_fileio, "replace", replace)
    with pytest.raises(E.WriteFailed, match="renaming"):
        save(path, factory(2))
    assert path.read_bytes() == old and files_in(path.parent) == ["s.ssf"]


def test_fallocate_enospc_fails_before_any_copy(factory, old_file, monkeypatch):
    path, old = old_file
    copies = []
    adapter = factory(2)
    adapter.copy_out = lambda *a: copies.append(a)

    def fallocate(fd, off, n):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    with pytest.raises(E.NoSpace):
        save(path, adapter)
    assert copies == [] and path.read_bytes() == old and files_in(path.parent) == ["s.ssf"]


def test_folder_fsync_failure_is_reported_as_exactly_that(factory, old_file, monkeypatch):
    path, old = old_file
    real = _fileio.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(_fileio, "fsync", fsync)
    with pytest.raises(E.DirSyncFailed) as info:
        save(path, factory(2))
    report = info.value.report
    assert report.bytes_written == path.stat().st_size and report.payload_hash == trailer_digest(path)
    assert path.read_bytes() != old and inspect(path).payload_verified  # the new file is in place, complete
    assert files_in(path.parent) == ["s.ssf"]


def test_unwritable_folder_is_a_write_failure(factory, tmp_path):
    with pytest.raises(E.WriteFailed):
        save(tmp_path / "no-such-dir" / "s.ssf", factory(1))


def test_an_unsynced_sink_writes_the_same_file_without_any_fsync(factory, old_file, monkeypatch):
    """FileSink(sync=False) (the engine's SAVE with "sync": false): the same bytes, renamed in place, no fsync; a write
    failure still keeps the old file."""
    path, old = old_file
    synced = path.with_name("synced.ssf")
    save(synced, factory(2), block_size=4096)
    calls = []
    monkeypatch.setattr(_fileio, "fsync", calls.append)
    save(_fileio.FileSink(str(path), sync=False), factory(2), block_size=4096)
    assert calls == [] and path.read_bytes() == synced.read_bytes() != old
    assert files_in(path.parent) == ["s.ssf", "synced.ssf"]
    monkeypatch.setattr(_fileio, "write", _failing_write(5000, errno.EIO))
    with pytest.raises(E.WriteFailed):
        save(_fileio.FileSink(str(synced), sync=False), factory(3), block_size=4096)
    assert path.read_bytes() == synced.read_bytes() and files_in(path.parent) == ["s.ssf", "synced.ssf"]
