"""Restores that read with several threads, and saves that start the kernel's writeback block by block.

Several readers: the same bytes whatever their number, in every mode; a read error of block k surfaces in
file order (every block before k delivered, none after), whichever read failed first in time; when the
restore returns or raises, no reader thread is alive and no read is still writing into memory.
Writeback: the hint is given once per written block, over contiguous ranges that end at the data's end,
and a failing hint fails nothing (the final fsync is the authority).
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import sys
import threading
import time

import pytest
import xxhash
from strata_sessionfile import ReadThreads, _fileio, default_read_threads, inspect, pipelines, restore, save
from strata_sessionfile import errors as E
from strata_sessionfile.testing import MemoryAdapter, run_conformance

from .helpers import COPYING, COPYING_STAGING, LANDING, LANDING_STAGING, trailer_digest
from .helpers import helpers_alive as _helpers_alive

BLOCK = 4096  # the `good` fixture's block size
FACTORIES = {
    "streaming-copy": (COPYING, "streaming"),
    "streaming-land": (LANDING, "streaming"),
    "staged-copy": (COPYING_STAGING, "staged"),
    "staged-land": (LANDING_STAGING, "staged"),
}


@pytest.mark.parametrize("cores,readers", [(1, 1), (2, 1), (3, 2), (5, 4), (64, 4)])
def test_default_read_threads_leaves_a_core_for_the_hash(monkeypatch, cores, readers):
    monkeypatch.setattr(pipelines, "available_cpus", lambda: cores)
    assert default_read_threads() == readers
    with pytest.raises(ValueError, match="read_threads"):
        inspect(os.devnull, read_threads=0)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_every_number_of_readers_restores_the_same_bytes(good, name):
    factory, mode = FACTORIES[name]
    expected = COPYING(1).live_digest()
    n_blocks = -(-inspect(good).layout.data_length // BLOCK)
    assert n_blocks > 8  # more blocks than readers: the ring of buffers is reused many times
    for threads in (1, 2, 4):
        target = factory(2)
        assert target.live_digest() != expected
        report = restore(good, target, mode=mode, block_size=BLOCK, read_threads=threads)
        assert report.mode.value == mode and target.live_digest() == expected, threads
    assert not _helpers_alive()


class _DeferredCopies(MemoryAdapter):
    """copy_in / stage_in keep `src` and copy it only later, as a device DMA queued from a pinned buffer
    does: at wait_copies() (AsyncCopyTarget), or, for the control without it, at the commit."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.queued: list = []
        self.waits = 0

    def copy_in(self, layer, part, offset, src):
        self.queued.append((lambda: self.parts[layer][part], offset, src))

    def stage_in(self, layer, part, offset, src):
        self.queued.append((lambda: self._staged[1][layer][part], offset, src))

    def _run_queued(self) -> None:
        for dest, offset, src in self.queued:
            dest()[offset : offset + len(src)] = src
        self.queued.clear()

    def commit(self, state):
        self._run_queued()
        super().commit(state)

    def commit_staged(self, state):
        self._run_queued()
        super().commit_staged(state)


class _WaitsForCopies(_DeferredCopies):
    def wait_copies(self) -> None:
        self.waits += 1
        self._run_queued()


def _deferring(cls, staging: bool):
    base = COPYING_STAGING if staging else COPYING

    def factory(seed: int):
        template = base(seed)
        adapter = cls(template.identity(), template.specs, staging=staging)
        adapter.state, adapter.layers, adapter.parts = template.state, template.layers, template.parts
        return adapter

    return factory


@pytest.mark.parametrize("mode", ["streaming", "staged"])
def test_copies_that_finish_later_are_waited_for_before_their_buffer_is_refilled(good, mode):
    expected = COPYING(1).live_digest()
    n_blocks = -(-inspect(good).layout.data_length // BLOCK)
    for threads in (1, 2, 4):
        target = _deferring(_WaitsForCopies, mode == "staged")(2)
        restore(good, target, mode=mode, block_size=BLOCK, read_threads=threads)
        assert target.live_digest() == expected, threads
        assert target.waits >= n_blocks - threads - 1  # before each refill, and at the end
    # The control: the same deferred copies without wait_copies read buffers already refilled.
    control = _deferring(_DeferredCopies, mode == "staged")(2)
    restore(good, control, mode=mode, block_size=BLOCK, read_threads=2)
    assert control.live_digest() != expected


class _MergesCopies(_WaitsForCopies):
    """Holds each piece back until flush_copies or wait_copies (MergingCopyTarget), logging the order of the
    pieces, the flushes and the library's hash updates."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[str] = []

    def copy_in(self, layer, part, offset, src):
        self.log.append("piece")
        super().copy_in(layer, part, offset, src)

    def stage_in(self, layer, part, offset, src):
        self.log.append("piece")
        super().stage_in(layer, part, offset, src)

    def flush_copies(self) -> None:
        self.log.append("flush")
        self._run_queued()


@pytest.mark.parametrize("mode", ["streaming", "staged"])
def test_a_merging_adapter_is_told_after_each_block_before_its_hash(good, mode, monkeypatch):
    from strata_sessionfile import MergingCopyTarget

    real = xxhash.xxh3_128
    target = _deferring(_MergesCopies, mode == "staged")(2)
    assert isinstance(target, MergingCopyTarget)

    class Logged:  # the payload hash, logging each update into the adapter's log
        def __init__(self, *args):
            self.h = real(*args)

        def update(self, data):
            target.log.append("hash")
            self.h.update(data)

        def copy(self):
            c = Logged.__new__(Logged)
            c.h = self.h.copy()
            return c

        def digest(self):
            return self.h.digest()

    monkeypatch.setattr(xxhash, "xxh3_128", Logged)
    restore(good, target, mode=mode, block_size=BLOCK, read_threads=2)
    applied = "".join("p" if e == "piece" else e[0] for e in target.log)
    monkeypatch.undo()
    assert target.live_digest() == COPYING(1).live_digest()
    applied = applied[applied.index("p") :]  # the pass that hands blocks over (after any read pass)
    n_blocks = -(-inspect(good).layout.data_length // BLOCK)
    blocks = applied.split("fh")
    assert len(blocks) == n_blocks + 1 and blocks[-1] == ""  # pieces, then one flush, then that block's hash
    assert all(b and set(b) == {"p"} for b in blocks[:-1]), applied


def test_a_parallel_read_fills_the_buffer_and_raises_the_first_short_piece(tmp_path):
    data = os.urandom(10 * BLOCK + 123)
    (tmp_path / "f").write_bytes(data)
    with _fileio.FileSource(str(tmp_path / "f")) as source:
        for threads in (1, 2, 4):
            buf, pieces = bytearray(len(data) - 7), []
            with ReadThreads(threads) as readers:
                pipelines.read_exact_parallel(
                    source,
                    memoryview(buf),
                    7,
                    readers,
                    BLOCK,
                    lambda view, pieces=pieces: pieces.append(bytes(view)),
                )  # in order
            assert bytes(buf) == data[7:] == b"".join(pieces), threads
        with ReadThreads(4) as readers, pytest.raises(E.Truncated) as info:  # pieces 10, 11 short: 10's error
            pipelines.read_exact_parallel(source, memoryview(bytearray(12 * BLOCK)), 0, readers, BLOCK)
        assert info.value.offset == len(data)
    assert not _helpers_alive()


def test_kept_read_threads_serve_every_call_and_end_at_close(good):
    """Threads an engine keeps (ReadThreads) are started once: every restore and inspect reads with the same
    threads, none of them is still reading when a call returns, and close() ends them."""
    readers = ReadThreads(3).start()
    started = set(_helpers_alive())
    assert len(started) == 3
    for mode in ("streaming", "staged"):
        target = LANDING_STAGING(2) if mode == "staged" else COPYING(2)
        restore(good, target, mode=mode, block_size=BLOCK, read_threads=readers)
        assert target.live_digest() == COPYING(1).live_digest()
    assert inspect(good, block_size=BLOCK, read_threads=readers).payload_hash == trailer_digest(good)
    assert set(_helpers_alive()) == started  # the same threads, none added, none ended
    readers.close()
    assert not _helpers_alive()
    with pytest.raises(ValueError, match="read_threads"):
        ReadThreads(0)


class _RefusesThePlan(MemoryAdapter):
    def check_plan(self, plan):
        raise E.InconsistentState("refused by the engine", field="state")


@pytest.mark.parametrize("mode", ["streaming", "staged"])
def test_a_refusal_after_the_first_reads_started_leaves_no_reader(good, mode):
    """The data section's first blocks are read while the plan is checked: a refusal there stops them."""
    template = COPYING_STAGING(2)
    target = _RefusesThePlan(template.identity(), template.specs, staging=True)
    target.state, target.layers, target.parts = template.state, template.layers, template.parts
    before = target.live_digest()
    with pytest.raises(E.InconsistentState):
        restore(good, target, mode=mode, block_size=BLOCK, read_threads=4)
    assert not _helpers_alive() and target.live_digest() == before


def test_inspect_verifies_with_several_readers(good):
    digests = {inspect(good, block_size=BLOCK, read_threads=n).payload_hash for n in (1, 3, 4)}
    assert digests == {trailer_digest(good)}


def test_fewer_given_buffers_mean_fewer_readers_not_a_failure(good):
    from strata_sessionfile import BlockBuffers

    for count in (2, 3):
        target = COPYING(2)
        restore(
            good,
            target,
            mode="streaming",
            block_size=BLOCK,
            read_threads=4,
            buffers=BlockBuffers(BLOCK, count),
        )
        assert target.live_digest() == COPYING(1).live_digest()
    with pytest.raises(ValueError):
        BlockBuffers(BLOCK, 1)


@pytest.mark.parametrize("factory", [COPYING, COPYING_STAGING], ids=["streaming", "staged"])
def test_conformance_with_several_readers(tmp_path, monkeypatch, factory):
    monkeypatch.setattr(pipelines, "default_read_threads", lambda: 3)
    assert "gate_after" in run_conformance(factory, tmp_path)
    assert not _helpers_alive()


def test_an_adapter_failure_while_later_blocks_are_read_and_hashed_fail_stops(good):
    target = COPYING(2)
    real = type(target).copy_in

    def copy_in(*args):
        if target.events.count("copy_in") == 3:
            raise RuntimeError("device lost")
        real(target, *args)

    target.copy_in = copy_in
    with pytest.raises(E.FailStop) as info:
        restore(good, target, mode="streaming", block_size=BLOCK, read_threads=4)
    assert info.value.cause_reason == "adapter_failed" and target.events.count("fail_stop") == 1
    assert not _helpers_alive()


def _delivered_extents(target, layout) -> list[tuple[int, int]]:
    """(data offset, length) of every stage_in the target received, in call order."""
    start = {(e.layer, e.part): e.data_offset for e in layout.extents}
    return [(start[(layer, part)] + offset, n) for layer, part, offset, n in target.staged_calls]


def _recording(target):
    target.staged_calls = []
    real = type(target).stage_in

    def stage_in(layer, part, offset, src):
        target.staged_calls.append((layer, part, offset, len(src)))
        real(target, layer, part, offset, src)

    target.stage_in = stage_in
    return target


@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("bad_block", [0, 3, 7])
def test_a_read_error_surfaces_in_file_order_after_every_earlier_block(good, monkeypatch, threads, bad_block):
    layout = inspect(good).layout
    bad_offset = layout.data_offset + bad_block * BLOCK
    real = _fileio.pread_into

    def failing(fd, buf, offset):
        if offset == bad_offset:  # fails at once ...
            raise OSError(errno.EIO, "Input/output error")
        if offset == bad_offset - BLOCK:  # ... while the block before it is still being read
            time.sleep(0.05)
        return real(fd, buf, offset)

    monkeypatch.setattr(_fileio, "pread_into", failing)
    target = _recording(COPYING_STAGING(2))
    before = target.live_digest()
    with pytest.raises(E.ReadFailed) as info:
        restore(good, target, mode="staged", block_size=BLOCK, read_threads=threads)
    assert info.value.offset == bad_offset
    delivered = _delivered_extents(target, layout)
    # Every byte of blocks < k, in file order, and nothing of block k or later.
    assert [lo for lo, _ in delivered] == sorted(lo for lo, _ in delivered)
    assert sum(n for _, n in delivered) == bad_block * BLOCK
    assert all(lo + n <= bad_block * BLOCK for lo, n in delivered)
    assert target.events[-1] == "discard_staged" and target.live_digest() == before
    assert not _helpers_alive()


@pytest.mark.parametrize("mode", ["streaming", "staged"])
def test_nothing_is_written_into_landed_memory_after_the_restore_returns(good, monkeypatch, mode):
    """Block 2 fails while block 3's read into the adapter's memory is still running (slow): the restore
    must wait for that read before it raises, and the reads not started are never started."""
    layout = inspect(good).layout
    data0 = layout.data_offset
    real = _fileio.pread_into
    applying = threading.Event()
    finished_after_return: list[int] = []
    returned = threading.Event()
    started: list[int] = []

    def failing(fd, buf, offset):
        if not applying.is_set() or offset < data0:
            return real(fd, buf, offset)
        started.append(offset)
        if data0 + 2 * BLOCK <= offset < data0 + 3 * BLOCK:
            raise OSError(errno.EIO, "Input/output error")
        if data0 + 3 * BLOCK <= offset < data0 + 4 * BLOCK:
            time.sleep(0.2)
        n = real(fd, buf, offset)
        if returned.is_set():
            finished_after_return.append(offset)
        return n

    factory = LANDING_STAGING if mode == "staged" else LANDING
    target = factory(2)
    gate = "begin_staging" if mode == "staged" else "begin_apply"
    real_gate = getattr(type(target), gate)

    def open_gate(plan):
        applying.set()
        real_gate(target, plan)

    setattr(target, gate, open_gate)
    monkeypatch.setattr(_fileio, "pread_into", failing)
    with pytest.raises((E.ReadFailed, E.FailStop)) as info:
        restore(good, target, mode=mode, block_size=BLOCK, read_threads=4)
    returned.set()
    time.sleep(0.3)  # a read left running would finish now
    assert finished_after_return == [] and not _helpers_alive()
    cause = info.value.cause_reason if isinstance(info.value, E.FailStop) else info.value.reason
    assert cause == "read_failed"
    # Bounded: while block k (2) is waited for, at most blocks k+1..k+threads were handed to readers; the
    # ones not started by then never start.
    assert max(started) < data0 + (2 + 1 + 4) * BLOCK
    if mode == "streaming":
        assert target.events.count("fail_stop") == 1 and "commit" not in target.events
    else:
        assert target.events[-1] == "discard_staged" and "commit_staged" not in target.events


# --- early writeback on save -------------------------------------------------------------------------
def test_the_writeback_hint_follows_every_block(tmp_path, monkeypatch):
    hints: list[tuple[int, int]] = []
    monkeypatch.setattr(_fileio, "start_writeback", lambda fd, offset, length: hints.append((offset, length)))
    path = tmp_path / "s.ssf"
    save(path, COPYING(1), block_size=BLOCK)
    layout = inspect(path).layout
    assert len(hints) == -(-layout.data_length // BLOCK)
    # Contiguous from the file's start (the header and metadata ride with the first block) to the data's end.
    assert hints[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in zip(hints, hints[1:], strict=False))
    assert hints[-1][0] + hints[-1][1] == layout.data_offset + layout.data_length


def test_the_writeback_hint_follows_every_compressed_frame(tmp_path, monkeypatch):
    pytest.importorskip("zstandard")
    hints: list[tuple[int, int]] = []
    monkeypatch.setattr(_fileio, "start_writeback", lambda fd, offset, length: hints.append((offset, length)))
    path = tmp_path / "z.ssf"
    save(path, COPYING(1), block_size=BLOCK, compression="zstd")
    comp = inspect(path).layout.compressed
    assert len(hints) == comp.n_blocks
    assert hints[-1][0] + hints[-1][1] == comp.table_offset  # every frame, up to the block table


@pytest.mark.parametrize("failure", [OSError(errno.EIO, "Input/output error"), OSError(errno.ENOSYS, "no")])
def test_a_failing_writeback_hint_fails_nothing(tmp_path, monkeypatch, failure):
    calls = []

    def failing(fd, offset, length):
        calls.append(offset)
        raise failure

    monkeypatch.setattr(_fileio, "start_writeback", failing)
    path = tmp_path / "s.ssf"
    report = save(path, COPYING(1), block_size=BLOCK)
    assert calls and report.bytes_written == path.stat().st_size
    target = COPYING(2)
    restore(path, target, block_size=BLOCK)
    assert target.live_digest() == COPYING(1).live_digest()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_the_real_writeback_hint_reaches_the_kernel(tmp_path, monkeypatch):
    """Every save's hint is a real sync_file_range(fd, offset, length, SYNC_FILE_RANGE_WRITE) call that the
    kernel accepts (returns 0); its result is ignored: on a bad fd the kernel says EBADF and nothing raises."""
    real = _fileio._SYNC_FILE_RANGE
    assert real is not None
    calls = []

    def spy(fd, offset, length, flags):
        result = real(fd, offset, length, flags)
        calls.append((offset, length, flags, result, ctypes.get_errno() if result else 0))
        return result

    monkeypatch.setattr(_fileio, "_SYNC_FILE_RANGE", spy)
    path = tmp_path / "s.ssf"
    save(path, COPYING(1), block_size=BLOCK)
    layout = inspect(path).layout
    assert len(calls) == -(-layout.data_length // BLOCK)
    assert {(flags, result) for _o, _n, flags, result, _e in calls} == {(_fileio.SYNC_FILE_RANGE_WRITE, 0)}
    assert calls[-1][0] + calls[-1][1] == layout.data_offset + layout.data_length
    calls.clear()
    _fileio.start_writeback(-1, 0, 1)
    assert calls == [(0, 1, _fileio.SYNC_FILE_RANGE_WRITE, -1, errno.EBADF)]


# --- token ids ---------------------------------------------------------------------------------------
def _token_offset(path) -> int:
    """File offset of the first token id (after the model file list and the config)."""
    data = path.read_bytes()
    pos = 68
    (n_files,) = struct.unpack_from("<I", data, pos)
    pos += 4
    for _ in range(n_files):
        (rlen,) = struct.unpack_from("<H", data, pos)
        pos += 2 + rlen + 24
    (cfg_len,) = struct.unpack_from("<I", data, pos)
    return pos + 4 + cfg_len + 12


@pytest.mark.parametrize("index", [0, 1, 57, -1])
def test_a_negative_token_id_anywhere_is_refused(tmp_path, good, index):
    n = inspect(good).metadata.state.n_tokens
    at = _token_offset(good) + 4 * (index % n)
    data = bytearray(good.read_bytes())
    assert struct.unpack_from("<i", data, at)[0] == inspect(good).metadata.state.tokens[index % n]
    for bad in (-1, -(2**31), -300):
        struct.pack_into("<i", data, at, bad)
        path = tmp_path / "bad.ssf"
        path.write_bytes(bytes(data))
        with pytest.raises(E.MetadataInvalid, match="a token id is negative"):
            inspect(path, verify=False)
    struct.pack_into("<i", data, at, 2**31 - 1)  # the largest id is not negative
    path.write_bytes(bytes(data))
    assert max(inspect(path, verify=False).metadata.state.tokens) == 2**31 - 1


@pytest.mark.parametrize("numpy_loaded", [True, False], ids=["numpy", "no-numpy"])
def test_a_token_id_over_the_vocabulary_is_refused_with_the_id(tmp_path, good, monkeypatch, numpy_loaded):
    import attrs
    from strata_sessionfile import check_limits

    if numpy_loaded:
        pytest.importorskip("numpy")  # loaded: the check takes its vectorised pass
    else:
        monkeypatch.setitem(sys.modules, "numpy", None)  # as in a process that never imported it
    meta = inspect(good).metadata
    limits = COPYING(2).limits()
    top = max(meta.state.tokens)
    check_limits(meta, attrs.evolve(limits, vocab_size=top + 1))
    with pytest.raises(E.LimitExceeded, match=f"token id {top} is outside the engine's vocabulary of {top}"):
        check_limits(meta, attrs.evolve(limits, vocab_size=top))
