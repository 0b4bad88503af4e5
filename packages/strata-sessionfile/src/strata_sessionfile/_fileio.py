"""Low-level file I/O: safe open, exact reads and writes, the block pipelines, block planning.

``write``, ``pwrite``, ``fsync``, ``replace``, ``pread_into``, ``start_writeback`` are module attributes on
purpose: the fault-injection tests (ENOSPC, EIO) replace them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import errno
import mmap
import os
import queue
import stat
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from . import errors as E
from .records import FileStamp, PartExtent

write = os.write
pwrite = os.pwrite
fsync = os.fsync
replace = os.replace


def pread_into(fd: int, buf: memoryview, offset: int) -> int:
    return os.preadv(fd, [buf], offset)


SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writeback of the range's dirty pages, do not wait for it


def _sync_file_range() -> Callable[..., int] | None:
    """libc's sync_file_range through ctypes (Linux only; the os module does not expose it), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start the kernel's writeback of [offset, offset + length) now, without waiting for it, so the save's
    final fsync finds most bytes on their way to the disk instead of starting all of them itself (measured:
    116 MiB write + fsync 91-110 ms -> 63 ms on the H200 machine, 75-106 -> 50-68 ms on the CPU machine).

    A hint only: its result is ignored on purpose. It changes neither what is durable nor when (the fsync
    before the rename still decides that, and it reports any writeback error, including one of these
    pages). Where sync_file_range does not exist this does nothing. The ctypes call releases the GIL."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, length, SYNC_FILE_RANGE_WRITE)


def open_session_file(path: str) -> int:
    """Open for reading without following a final symlink; only a regular file with one link (rule F1-F4)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise E.NotFound("no such file", path=path) from None
    except PermissionError:
        raise E.PermissionDenied("permission denied", path=path) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise E.SymlinkRefused("the path is a symbolic link; session files are opened without following "
                                   "links", path=path) from None
        if exc.errno in (errno.ENXIO, errno.ENODEV):  # sockets, FIFOs without a writer on some systems
            raise E.NotRegularFile("not a regular file", path=path) from None
        raise E.ReadFailed(f"cannot open: {exc.strerror}", path=path) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                    else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a regular file")
            raise E.NotRegularFile(f"the path is {kind}, not a regular file", path=path)
        if st.st_nlink != 1:
            raise E.MultipleLinks(f"the file has {st.st_nlink} names (hard links); exactly one is required",
                                  path=path)
        os.set_blocking(fd, True)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError):
            pass
    except BaseException:
        os.close(fd)
        raise
    return fd


def stamp_of(fd: int) -> FileStamp:
    st = os.fstat(fd)
    return FileStamp(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def read_exact(fd: int, buf: memoryview, offset: int, path: str, *, short_error=E.Truncated) -> None:
    """Fill ``buf`` from ``offset``; a short file raises ``short_error``, an OS error ReadFailed."""
    done = 0
    n = len(buf)
    while done < n:
        try:
            got = pread_into(fd, buf[done:], offset + done)
        except InterruptedError:
            continue
        except OSError as exc:
            raise E.ReadFailed(f"read of {n - done} bytes failed: {exc.strerror or exc}", path=path,
                               offset=offset + done) from None
        if got == 0:
            raise short_error(f"file ends at offset {offset + done}, {n - done} bytes short", path=path,
                              offset=offset + done)
        done += got


def read_exact_parallel(fd: int, buf: memoryview, offset: int, path: str, readers: ReadThreads, piece: int,
                        on_piece: Callable[[memoryview], None] | None = None) -> None:
    """``read_exact`` by the ``readers`` at once, each filling whole ``piece``-sized pieces of ``buf`` (a fresh
    buffer's pages are faulted in and zeroed by the thread that first writes them: with huge pages one
    piece per 2 MiB page). ``on_piece(view)``: called on this thread with each piece in buffer order once
    it was read (e.g. to hash it while later pieces are still being read). The first failing piece's
    error, in buffer order, is raised after every piece finished: nothing writes into ``buf`` after this
    returns."""
    n = len(buf)
    if readers.threads <= 1 or n <= piece:
        read_exact(fd, buf, offset, path)
        if on_piece is not None:
            on_piece(buf)
        return
    jobs = [readers.submit(read_exact, fd, buf[lo:lo + piece], offset + lo, path) for lo in range(0, n, piece)]
    try:
        for lo, job in zip(range(0, n, piece), jobs, strict=True):
            job.result()
            if on_piece is not None:
                on_piece(buf[lo:lo + piece])
    finally:
        for job in jobs:
            job.cancel()
        concurrent.futures.wait(jobs)


def pread_bytes(fd: int, n: int, offset: int, path: str, *, short_error=E.Truncated) -> bytes:
    buf = bytearray(n)
    read_exact(fd, memoryview(buf), offset, path, short_error=short_error)
    return bytes(buf)


HUGE_PAGE = 2 << 20


def fresh_buffer(n: int) -> bytearray | mmap.mmap:
    """``n`` zero bytes to read into. From 2 MiB on an anonymous map asking for transparent huge pages:
    fresh memory costs a page fault per 4 KiB page on first touch (measured ~2 us each in the H200
    machine's VM: ~4.5 ms for a gemma3 32K file's 8.4 MB metadata), a 2 MiB page one fault; where huge
    pages are off the advice does nothing."""
    if n < HUGE_PAGE:
        return bytearray(n)
    area = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            area.madvise(advice)
        except OSError:
            pass
    return area


def write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = write(fd, view)
        except InterruptedError:
            continue
        view = view[n:]


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        try:
            n = pwrite(fd, view, offset)
        except InterruptedError:
            continue
        view = view[n:]
        offset += n


def memory_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes, or None where unknown."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


# --- block planning ---------------------------------------------------------------------------------
Segment = tuple[int, int, int, int, int]  # layer, part, part_offset, length, buffer_offset


def iter_blocks(extents: Sequence[PartExtent], data_length: int, block_size: int
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


# --- pipelines -------------------------------------------------------------------------------------
_STOP = object()
_RAW = object()  # a WriteBehind job of bytes to write as they are


HASH_SLICE = 1 << 20  # the write helper hashes a slice while it is cache-hot, then writes it

# Restores read with several threads at once: one thread reads a page-cache-warm file at ~8 GB/s, four
# at ~26 GB/s (measured on the H200 machine, 4 MiB blocks), while the payload hash (one core, in file
# order, on the calling thread) runs at ~17-26 GB/s on blocks just read (xxhash 4.1): with one reader the
# hash waits for the reads, with several it does not. Hashing on the readers instead (each its own block,
# in turn) measured slower there (10.3 against 8.7 ms for 116 MiB): every block then waits for a thread
# to wake. Beyond four readers the gain is small and each reader holds a block buffer.
MAX_READ_THREADS = 4


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_read_threads() -> int:
    """Reader threads of a restore when the caller names none: min(MAX_READ_THREADS, cores - 1), at least 1."""
    return max(1, min(MAX_READ_THREADS, available_cpus() - 1))


class ReadThreads:
    """The threads that read a restore's file: ``threads`` of them, started on first use and kept until
    ``close()`` (also a context manager). ``restore`` / ``inspect`` make their own for one call when given a
    number; an engine that restores more than once passes one it keeps (``read_threads=``), so no restore
    pays for starting threads (measured ~0.25 ms a thread on the H200 machine's VM; a gemma3 restore
    started 4 twice). ``start()`` starts them all now. Shared by calls one after the other, or at once."""

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


def block_chunks(file_offset: int, length: int, block_size: int) -> Iterator[tuple[int, int]]:
    """(file offset, length) of each block of [file_offset, file_offset + length)."""
    for pos in range(0, length, block_size):
        yield file_offset + pos, min(block_size, length - pos)


class OrderedReads:
    """File reads in flight on the ``readers``, taken back in submission order.

    ``submit(offset, views, tag)`` queues one read: ``views`` filled in order from ``offset`` by one helper
    (reads of different submissions must not overlap in memory). ``take()`` waits for the oldest read and
    returns its tag, or raises its error: errors surface in submission order, after every earlier read was
    taken. ``close()`` cancels the reads not started and waits for the running ones, so nothing is written
    into any submitted view after it returns. A short file raises FileChanged (the read pass or the
    metadata promised these bytes).
    """

    def __init__(self, fd: int, path: str, readers: ReadThreads) -> None:
        self.fd, self.path, self.readers = fd, path, readers
        self.pending: collections.deque = collections.deque()

    def _read(self, offset: int, views: Sequence[memoryview]) -> None:
        for view in views:
            read_exact(self.fd, view, offset, self.path, short_error=E.FileChanged)
            offset += len(view)

    def submit(self, offset: int, views: Sequence[memoryview], tag: object = None) -> None:
        self.pending.append((self.readers.submit(self._read, offset, views), tag))

    def __len__(self) -> int:
        return len(self.pending)

    def take(self) -> object:
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

    def __init__(self, fd: int, buffers: Sequence[memoryview], chunks: Iterable[tuple[int, int]], path: str,
                 readers: ReadThreads, before_refill: Callable[[], None] | None = None) -> None:
        assert len(buffers) >= 2
        self.threads = min(readers.threads, len(buffers) - 1)
        self.readers = readers
        self.fd, self.buffers, self.chunks, self.path = fd, buffers[:self.threads + 1], iter(chunks), path
        self.before_refill = before_refill
        self.reads: OrderedReads | None = None
        self.free = list(range(len(self.buffers)))
        self.given: set[int] = set()  # buffers the caller has had

    def _submit_next(self) -> None:
        item = next(self.chunks, None)
        if item is not None:
            offset, n = item
            idx = self.free.pop()
            assert n <= len(self.buffers[idx])
            if idx in self.given and self.before_refill is not None:
                self.before_refill()
            self.reads.submit(offset, (self.buffers[idx][:n],), (offset, idx, n))

    def start(self) -> ReadAhead:
        if self.reads is None:
            self.reads = OrderedReads(self.fd, self.path, self.readers)
            for _ in range(self.threads):
                self._submit_next()
        return self

    def __iter__(self) -> Iterator[tuple[int, memoryview]]:
        reads = self.start().reads
        while reads:
            offset, idx, n = reads.take()
            self._submit_next()  # into the buffer the caller gave back: `threads` reads in flight while it works
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

    def __init__(self, fd: int, path: str, readers: ReadThreads) -> None:
        self.threads = readers.threads
        self.reads = OrderedReads(fd, path, readers)

    def submit(self, file_offset: int, views: Sequence[memoryview]) -> None:
        self.reads.submit(file_offset, views, views)

    def __len__(self) -> int:
        return len(self.reads)

    def wait(self) -> Sequence[memoryview]:
        return self.reads.take()

    def close(self) -> None:
        self.reads.close()


class WriteBehind:
    """A helper thread hashes and writes block k while the caller fills block k+1 in the other buffer.

    With ``encode`` (a compressed save) the helper first encodes the block into one frame, frees the
    buffer, then hashes and writes the frame; ``frame_sizes`` lists every frame's size in order. After each
    block it starts the kernel's writeback of what it wrote since the last block (``start_writeback``).
    """

    def __init__(self, fd: int, buffers: Sequence[memoryview], hasher,
                 encode: Callable[[memoryview], bytes] | None = None) -> None:
        self.fd, self.buffers, self.hasher, self.encode = fd, buffers[:2], hasher, encode
        self.frame_sizes: list[int] = []
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        self.full: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(2):
            self.free.put(i)
        self.error: BaseException | None = None
        self.position = os.lseek(fd, 0, os.SEEK_CUR)  # where the next write lands (writes are sequential)
        self.flushed = self.position  # writeback started for [.., flushed)
        self.thread = threading.Thread(target=self._run, name="strata-write-behind", daemon=True)
        self.thread.start()

    def _write(self, data: memoryview | bytes) -> None:
        write_all(self.fd, data)
        self.position += len(data)

    def _start_writeback(self) -> None:
        try:
            start_writeback(self.fd, self.flushed, self.position - self.flushed)
        except OSError:  # a hint: the final fsync is the authority and reports any writeback error
            pass
        self.flushed = self.position

    def _run(self) -> None:
        while True:
            item = self.full.get()
            if item is _STOP:
                return
            if item[0] is _RAW:
                _, data, hashed_from = item
                if self.error is None:
                    try:
                        self.hasher.update(memoryview(data)[hashed_from:])
                        self._write(data)
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
                    for lo in range(0, len(view), HASH_SLICE):  # hash each slice while cache-hot, then write it
                        piece = view[lo:lo + HASH_SLICE]
                        self.hasher.update(piece)
                        self._write(piece)
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
