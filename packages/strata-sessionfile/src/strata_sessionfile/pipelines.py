"""The block pipelines: how the data section is cut into blocks, and the threads that read or write
them while the calling thread hashes and hands blocks over in file order.

Reads go through a byte source (``_fileio.FileSource``: ``read_into(view, offset, short_error=...)``),
writes through a byte sink (``_fileio.FileSink``: ``write``, ``position``, ``start_writeback``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

from . import errors as E
from .records import PartExtent

# --- block planning ---------------------------------------------------------------------------------
Segment = tuple[int, int, int, int, int]  # layer, part, part_offset, length, buffer_offset
Tag = TypeVar("Tag")


def iter_blocks(
    extents: Sequence[PartExtent], data_length: int, block_size: int
) -> Iterator[tuple[int, int, list[Segment]]]:
    """Split the data section into blocks; yield (block_start, block_length, segments) in file order."""
    ei = 0
    start = 0
    while start < data_length:
        end = min(start + block_size, data_length)
        segments: list[Segment] = []
        while ei < len(extents):
            ext = extents[ei]
            ext_end = ext.data_offset + ext.size
            lo = max(start, ext.data_offset)
            hi = min(end, ext_end)
            if lo < hi:
                segments.append((ext.layer, ext.part, lo - ext.data_offset, hi - lo, lo - start))
            if ext_end <= end:
                ei += 1
            else:
                break
        yield start, end - start, segments
        start = end


def block_chunks(file_offset: int, length: int, block_size: int) -> Iterator[tuple[int, int]]:
    """(file offset, length) of each block of [file_offset, file_offset + length)."""
    for pos in range(0, length, block_size):
        yield file_offset + pos, min(block_size, length - pos)


# --- how many threads -------------------------------------------------------------------------------
# Enough readers that the in-order hash never waits for a read (bench/sessionfile/DECISIONS.md, "Reader threads").
MAX_READ_THREADS = 4
# Frames decoded at once; each holds a frame and a block (bench/sessionfile/DECISIONS.md, "Decode workers").
MAX_DECODE_WORKERS = 1


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_read_threads() -> int:
    """Reader threads of a restore when the caller names none: min(MAX_READ_THREADS, cores - 1), at least 1."""
    return max(1, min(MAX_READ_THREADS, available_cpus() - 1))


def decode_workers() -> int:
    return max(1, min(MAX_DECODE_WORKERS, os.cpu_count() or 1))


class ReadThreads:
    """The threads that read a restore's file: ``threads`` of them, started on first use and kept until
    ``close()`` (also a context manager). ``restore`` / ``inspect`` make their own for one call when given a
    number; an engine that restores more than once passes one it keeps (``read_threads=``), so no restore
    pays for starting threads (bench/sessionfile/DECISIONS.md, "Reader threads"). ``start()`` starts them all now. Shared by calls one after the other, or at
    once."""

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError("read_threads must be at least 1")
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="strata-read")

    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        return self._pool.submit(fn, *args)

    def start(self) -> ReadThreads:
        # A pool starts a thread only when a job finds none idle: n jobs that wait for each other start n.
        gate = threading.Barrier(self.threads + 1)
        jobs = [self._pool.submit(gate.wait) for _ in range(self.threads)]
        gate.wait()
        concurrent.futures.wait(jobs)
        return self

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> ReadThreads:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --- reading ----------------------------------------------------------------------------------------
def read_exact_parallel(
    source,
    buf: memoryview,
    offset: int,
    readers: ReadThreads,
    piece: int,
    on_piece: Callable[[memoryview], None] | None = None,
) -> None:
    """``source.read_into`` by the ``readers`` at once, each filling whole ``piece``-sized pieces of ``buf`` (a
    fresh buffer's pages are faulted in and zeroed by the thread that first writes them: with huge pages
    one piece per 2 MiB page). ``on_piece(view)``: called on this thread with each piece in buffer order
    once it was read (e.g. to hash it while later pieces are still being read). The first failing
    piece's error, in buffer order, is raised after every piece finished: nothing writes into ``buf``
    after this returns."""
    n = len(buf)
    if readers.threads <= 1 or n <= piece:
        source.read_into(buf, offset)
        if on_piece is not None:
            on_piece(buf)
        return
    jobs = [readers.submit(source.read_into, buf[lo : lo + piece], offset + lo) for lo in range(0, n, piece)]
    try:
        for lo, job in zip(range(0, n, piece), jobs, strict=True):
            job.result()
            if on_piece is not None:
                on_piece(buf[lo : lo + piece])
    finally:
        for job in jobs:
            job.cancel()
        concurrent.futures.wait(jobs)


class OrderedReads(Generic[Tag]):
    """Reads of the ``source`` in flight on the ``readers``, taken back in submission order.

    ``submit(offset, views, tag)`` queues one read: ``views`` filled in order from ``offset`` by one helper
    (reads of different submissions must not overlap in memory). ``take()`` waits for the oldest read and
    returns its tag, or raises its error: errors surface in submission order, after every earlier read was
    taken. ``close()`` cancels the reads not started and waits for the running ones, so nothing is written
    into any submitted view after it returns. A short file raises FileChanged (the read pass or the
    metadata promised these bytes).
    """

    def __init__(self, source, readers: ReadThreads) -> None:
        self.source, self.readers = source, readers
        self.pending: collections.deque = collections.deque()

    def _read(self, offset: int, views: Sequence[memoryview]) -> None:
        for view in views:
            self.source.read_into(view, offset, short_error=E.FileChanged)
            offset += len(view)

    def submit(self, offset: int, views: Sequence[memoryview], tag: Tag) -> None:
        self.pending.append((self.readers.submit(self._read, offset, views), tag))

    def __len__(self) -> int:
        return len(self.pending)

    def take(self) -> Tag:
        future, tag = self.pending.popleft()
        future.result()
        return tag

    def close(self) -> None:
        futures = [future for future, _tag in self.pending]
        for future in futures:
            future.cancel()
        concurrent.futures.wait(futures)  # a cancelled one is done; a running one finishes its read
        self.pending.clear()


class ReadAhead:
    """Helper threads read the next chunks into block buffers while the caller consumes one.

    ``chunks``: (file offset, length) pairs in order, each at most the buffers' size (fixed blocks of the
    data section). Iterate to get (file offset, memoryview) in file order; a view is valid until the next
    iteration. ``readers.threads`` readers need that many buffers + 1 (the caller holds one while the others
    are being read); fewer buffers mean fewer reads in flight. ``start()``
    queues the first reads before the iteration does (e.g. while the caller still checks the metadata).
    ``close()`` stops every read (see OrderedReads). ``before_refill``: called before a buffer
    the caller was given is read into again (e.g. to wait for asynchronous copies out of it).
    """

    def __init__(
        self,
        source,
        buffers: Sequence[memoryview],
        chunks: Iterable[tuple[int, int]],
        readers: ReadThreads,
        before_refill: Callable[[], None] | None = None,
    ) -> None:
        assert len(buffers) >= 2
        self.threads = min(readers.threads, len(buffers) - 1)
        self.readers = readers
        self.source, self.buffers, self.chunks = source, buffers[: self.threads + 1], iter(chunks)
        self.before_refill = before_refill
        self.reads: OrderedReads[tuple[int, int, int]] | None = None  # tags: (offset, buffer, length)
        self.free = list(range(len(self.buffers)))
        self.given: set[int] = set()  # buffers the caller has had

    def _submit_next(self, reads: OrderedReads[tuple[int, int, int]]) -> None:
        item = next(self.chunks, None)
        if item is not None:
            offset, n = item
            idx = self.free.pop()
            assert n <= len(self.buffers[idx])
            if idx in self.given and self.before_refill is not None:
                self.before_refill()
            reads.submit(offset, (self.buffers[idx][:n],), (offset, idx, n))

    def start(self) -> ReadAhead:
        if self.reads is None:
            reads = self.reads = OrderedReads(self.source, self.readers)
            for _ in range(self.threads):
                self._submit_next(reads)
        return self

    def __iter__(self) -> Iterator[tuple[int, memoryview]]:
        reads = self.start().reads
        while reads:
            offset, idx, n = reads.take()
            self._submit_next(
                reads
            )  # into the buffer the caller gave back: `threads` reads in flight while it works
            self.given.add(idx)
            yield offset, self.buffers[idx][:n]
            self.free.append(idx)

    def close(self) -> None:
        if self.reads is not None:
            self.reads.close()


class ReadInto:
    """Helper threads read file ranges straight into their final memory (the engine's K/V or staging area),
    while the caller hashes what already landed and asks the engine where the next bytes go.

    ``submit(file_offset, views)`` queues one job: the views filled in order from ``file_offset`` by one
    helper; ``wait()`` returns the oldest job's views once read (raising the read's error, if any, in
    order); ``len()`` is the jobs submitted and not yet waited for (the caller keeps it at most ``threads``
    once it waits). ``close()`` cancels the jobs not started and waits for the running ones, so nothing is
    written after it returns.
    """

    def __init__(self, source, readers: ReadThreads) -> None:
        self.threads = readers.threads
        self.reads: OrderedReads[Sequence[memoryview]] = OrderedReads(source, readers)

    def submit(self, file_offset: int, views: Sequence[memoryview]) -> None:
        self.reads.submit(file_offset, views, views)

    def __len__(self) -> int:
        return len(self.reads)

    def wait(self) -> Sequence[memoryview]:
        return self.reads.take()

    def close(self) -> None:
        self.reads.close()


# --- writing ----------------------------------------------------------------------------------------
_STOP = object()
_RAW = object()  # a WriteBehind job of bytes to write as they are
HASH_SLICE = 1 << 20  # the write helper hashes a slice while it is cache-hot, then writes it


class WriteBehind:
    """A helper thread hashes and writes block k to the ``sink`` while the caller fills block k+1 in the
    other buffer.

    With ``encode`` (a compressed save) the helper first encodes the block into one frame, frees the
    buffer, then hashes and writes the frame; ``frame_sizes`` lists every frame's size in order. After each
    block it starts the kernel's writeback of what it wrote since the last block.
    """

    def __init__(
        self, sink, buffers: Sequence[memoryview], hasher, encode: Callable[[memoryview], bytes] | None = None
    ) -> None:
        self.sink, self.buffers, self.hasher, self.encode = sink, buffers[:2], hasher, encode
        self.frame_sizes: list[int] = []
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        self.full: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(2):
            self.free.put(i)
        self.error: BaseException | None = None
        self.flushed = sink.position  # writeback started for [.., flushed)
        self.thread = threading.Thread(target=self._run, name="strata-write-behind", daemon=True)
        self.thread.start()

    def _start_writeback(self) -> None:
        position = self.sink.position
        self.sink.start_writeback(self.flushed, position - self.flushed)
        self.flushed = position

    def _run(self) -> None:
        write, update = self.sink.write, self.hasher.update
        while True:
            item = self.full.get()
            if item is _STOP:
                return
            if item[0] is _RAW:
                _, data, hashed_from = item
                if self.error is None:
                    try:
                        update(memoryview(data)[hashed_from:])
                        write(data)
                    except BaseException as exc:
                        self.error = exc
                continue
            idx, n = item
            freed = False
            if self.error is None:
                try:
                    view = self.buffers[idx][:n]
                    if self.encode is not None:
                        view = memoryview(self.encode(view))
                        self.frame_sizes.append(len(view))
                        self.free.put(idx)  # the caller may refill it while this frame is written
                        freed = True
                    for lo in range(
                        0, len(view), HASH_SLICE
                    ):  # hash each slice while cache-hot, then write it
                        piece = view[lo : lo + HASH_SLICE]
                        update(piece)
                        write(piece)
                    self._start_writeback()
                except BaseException as exc:
                    self.error = exc
            if not freed:
                self.free.put(idx)

    def submit_raw(self, data: bytes, hashed_from: int = 0) -> None:
        """Write ``data`` (e.g. the header and metadata, so the caller starts on the first block at once),
        hashing ``data[hashed_from:]``."""
        self.full.put((_RAW, data, hashed_from))

    def acquire(self) -> memoryview:
        """A free buffer to fill (blocks while both are in flight); raises the helper's error if any."""
        idx = self.free.get()
        if self.error is not None:
            self.free.put(idx)
            raise self.error
        self._current = idx
        return self.buffers[idx]

    def submit(self, n: int) -> None:
        self.full.put((self._current, n))

    def finish(self) -> None:
        """Wait for every submitted block; raise the helper's error if any."""
        self.full.put(_STOP)
        self.thread.join()
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        if self.thread.is_alive():
            self.full.put(_STOP)
            self.thread.join()
