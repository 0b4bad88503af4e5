"""Low-level file I/O: safe open, exact reads and writes, the two-buffer pipelines, block planning.

``write``, ``pwrite``, ``fsync``, ``replace``, ``pread_into`` are module attributes on purpose: the fault-injection
tests (ENOSPC, EIO) replace them.
"""

from __future__ import annotations

import errno
import os
import queue
import stat
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

from . import errors as E
from .records import FileStamp, PartExtent

write = os.write
pwrite = os.pwrite
fsync = os.fsync
replace = os.replace


def pread_into(fd: int, buf: memoryview, offset: int) -> int:
    return os.preadv(fd, [buf], offset)


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


def pread_bytes(fd: int, n: int, offset: int, path: str, *, short_error=E.Truncated) -> bytes:
    buf = bytearray(n)
    read_exact(fd, memoryview(buf), offset, path, short_error=short_error)
    return bytes(buf)


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


# --- two-buffer pipelines ---------------------------------------------------------------------------
_STOP = object()
_RAW = object()  # a WriteBehind job of bytes to write as they are


HASH_SLICE = 1 << 20  # the write helper hashes a slice while it is cache-hot, then writes it


def block_chunks(file_offset: int, length: int, block_size: int) -> Iterator[tuple[int, int]]:
    """(file offset, length) of each block of [file_offset, file_offset + length)."""
    for pos in range(0, length, block_size):
        yield file_offset + pos, min(block_size, length - pos)


class ReadAhead:
    """A helper thread reads chunk k+1 into one buffer while the caller consumes chunk k from the other.

    ``chunks``: (file offset, length) pairs in order, each at most the buffers' size (fixed blocks of the
    data section, or the frames of a compressed one). Iterate to get (file offset, memoryview) in order;
    a view is valid until the next iteration.
    """

    def __init__(self, fd: int, buffers: Sequence[memoryview], chunks: Iterable[tuple[int, int]], path: str) -> None:
        assert len(buffers) >= 2
        self.fd, self.buffers, self.chunks, self.path = fd, buffers[:2], chunks, path
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        self.full: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(2):
            self.free.put(i)
        self.thread = threading.Thread(target=self._run, name="strata-read-ahead", daemon=True)
        self.started = False

    def _run(self) -> None:
        try:
            for offset, n in self.chunks:
                idx = self.free.get()
                if idx is _STOP:
                    return
                assert n <= len(self.buffers[idx])
                view = self.buffers[idx][:n]
                read_exact(self.fd, view, offset, self.path, short_error=E.FileChanged)
                self.full.put((offset, idx, n))
            self.full.put(_STOP)
        except BaseException as exc:  # handed to the consumer, which raises it on its own thread
            self.full.put(exc)

    def __iter__(self) -> Iterator[tuple[int, memoryview]]:
        self.thread.start()
        self.started = True
        while True:
            item = self.full.get()
            if item is _STOP:
                return
            if isinstance(item, BaseException):
                raise item
            offset, idx, n = item
            yield offset, self.buffers[idx][:n]
            self.free.put(idx)

    def close(self) -> None:
        if self.started:
            self.free.put(_STOP)
            self.free.put(_STOP)
            self.thread.join()


class WriteBehind:
    """A helper thread hashes and writes block k while the caller fills block k+1 in the other buffer.

    With ``encode`` (a compressed save) the helper first encodes the block into one frame, frees the
    buffer, then hashes and writes the frame; ``frame_sizes`` lists every frame's size in order.
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
        self.thread = threading.Thread(target=self._run, name="strata-write-behind", daemon=True)
        self.thread.start()

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
                        write_all(self.fd, data)
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
                        write_all(self.fd, piece)
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


class ReadInto:
    """A helper thread reads file ranges straight into their final memory (the engine's K/V or staging
    area), while the caller hashes what already landed and asks the engine where the next bytes go.

    ``submit(file_offset, views)`` queues one job: the views filled in order from ``file_offset``;
    ``wait()`` returns the oldest job's views once read (raising the read's error, if any, in order).
    ``close()`` stops the helper after its current job and joins it, so nothing is written after it
    returns. A short file raises FileChanged (the read pass or the metadata promised these bytes).
    """

    def __init__(self, fd: int, path: str) -> None:
        self.fd, self.path = fd, path
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="strata-read-into", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is _STOP or self.stopping:
                return
            offset, views = job
            try:
                for view in views:
                    read_exact(self.fd, view, offset, self.path, short_error=E.FileChanged)
                    offset += len(view)
            except BaseException as exc:  # handed to the consumer, which raises it on its own thread
                self.done.put(exc)
                return
            self.done.put(views)

    def submit(self, file_offset: int, views: Sequence[memoryview]) -> None:
        self.jobs.put((file_offset, views))

    def wait(self) -> Sequence[memoryview]:
        item = self.done.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self.stopping = True
        self.jobs.put(_STOP)
        self.thread.join()
