"""The byte seam's local files: a ``seam.ByteSource`` and ``seam.ByteSink`` over a path.

Save, restore and inspect open, read and write a local session file only here. A restore or ``inspect``
reads from a ``FileSource`` (opened safely, rules F1-F5; its ``stamp()`` tells whether it changed; exact
positional reads); a save writes to a ``FileSink`` (an exclusively created temporary beside the target,
written in order, flushed, renamed over the target, the folder flushed). ``objstore`` is the other store:
an S3-compatible object store's ranged reads and multipart upload, behind the same two interfaces.

``write``, ``pwrite``, ``fsync``, ``replace``, ``pread_into``, ``start_writeback`` are module attributes on
purpose: the fault-injection tests (ENOSPC, EIO) replace them.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import stat
import sys
from collections.abc import Callable

from . import errors as E
from .records import FileStamp

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
    """Start the kernel's writeback of [offset, offset + length) now, without waiting for it, so the final
    fsync waits for less (bench/sessionfile/DECISIONS.md, "Early writeback"). A hint: its result is ignored; the
    fsync before the rename decides what is durable and reports any writeback error."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, length, SYNC_FILE_RANGE_WRITE)


# --- reading --------------------------------------------------------------------------------------
def _open_regular(path: str) -> int:
    """Open for reading without following a final symlink; only a regular file with one link (rules F1-F5)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise E.NotFound("no such file", path=path) from None
    except PermissionError:
        raise E.PermissionDenied("permission denied", path=path) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise E.SymlinkRefused(
                "the path is a symbolic link; session files are opened without following links", path=path
            ) from None
        if exc.errno in (errno.ENXIO, errno.ENODEV):  # sockets, FIFOs without a writer on some systems
            raise E.NotRegularFile("not a regular file", path=path) from None
        raise E.ReadFailed(f"cannot open: {exc.strerror}", path=path) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = (
                "a directory"
                if stat.S_ISDIR(st.st_mode)
                else "a FIFO"
                if stat.S_ISFIFO(st.st_mode)
                else "a device"
                if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                else "not a regular file"
            )
            raise E.NotRegularFile(f"the path is {kind}, not a regular file", path=path)
        if st.st_nlink != 1:
            raise E.MultipleLinks(
                f"the file has {st.st_nlink} names (hard links); exactly one is required", path=path
            )
        os.set_blocking(fd, True)  # O_NONBLOCK only kept a FIFO without a writer from blocking the open
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError):
            pass
    except BaseException:
        os.close(fd)
        raise
    return fd


class FileSource:
    """A session file opened for reading (rules F1-F5 checked on open). ``read_into`` is called by the
    reader threads at once, on disjoint ranges."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = _open_regular(path)

    def stamp(self) -> FileStamp:
        """What identifies this version of the file: compared between and after the passes."""
        st = os.fstat(self.fd)
        return FileStamp(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def read_into(self, buf: memoryview, offset: int, *, short_error=E.Truncated) -> None:
        """Fill ``buf`` from ``offset``; a short file raises ``short_error``, an OS error ReadFailed."""
        fd = self.fd
        done = 0
        n = len(buf)
        while done < n:
            try:
                got = pread_into(fd, buf[done:], offset + done)
            except InterruptedError:
                continue
            except OSError as exc:
                raise E.ReadFailed(
                    f"read of {n - done} bytes failed: {exc.strerror or exc}",
                    path=self.path,
                    offset=offset + done,
                ) from None
            if got == 0:
                raise short_error(
                    f"file ends at offset {offset + done}, {n - done} bytes short",
                    path=self.path,
                    offset=offset + done,
                )
            done += got

    def read(self, n: int, offset: int, *, short_error=E.Truncated) -> bytes:
        buf = bytearray(n)
        self.read_into(memoryview(buf), offset, short_error=short_error)
        return bytes(buf)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> FileSource:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --- writing --------------------------------------------------------------------------------------
TEMP_SUFFIX = ".strata-tmp"
NAME_MAX = 255  # bytes in one path component on Linux filesystems


def discard_writes(fd: int) -> None:
    """Point `fd` at /dev/null: what is still written to it (the interpreter's flush at exit of a stream whose
    reader left) goes nowhere instead of meeting a closed pipe (Python's documented recipe)."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


def temporary_name(name: str) -> str:
    """``.<name>.<12 hex>.strata-tmp``, the name cut (on a character boundary) so the whole fits NAME_MAX:
    a target name near NAME_MAX is valid, so its temporary must not be longer than the limit."""
    tail = f".{secrets.token_hex(6)}{TEMP_SUFFIX}"
    room = NAME_MAX - 1 - len(tail)
    stem = os.fsencode(name)[:room]
    return "." + os.fsdecode(stem.decode("utf-8", "ignore").encode("utf-8")) + tail


def _write_all(fd: int, data) -> None:
    view = memoryview(data)
    while view:
        try:
            n = write(fd, view)
        except InterruptedError:
            continue
        view = view[n:]


class FileSink:
    """Where a save writes: ``create`` makes a new temporary in the target's folder with
    O_CREAT|O_EXCL|O_NOFOLLOW (mode 0600). Written in order (``write``; ``write_at`` patches bytes already
    written), then ``flush`` (fsync, close), ``publish`` (rename over the target) and ``sync_folder``.
    ``discard`` removes the temporary (the target untouched) at any point before ``publish``. Raises
    OSError; the writer names the stage it happened in. ``sync=False``: neither fsync (the file appears
    complete, and is durable once the caller fsyncs it and its folder)."""

    def __init__(self, path: str, *, sync: bool = True) -> None:
        self.path = path
        self.sync = sync
        self.folder, self.name = os.path.split(os.path.abspath(path))
        self.tmp: str | None = None
        self.fd = -1
        self.position = 0  # bytes written in order so far

    def create(self) -> None:
        tmp = os.path.join(self.folder, temporary_name(self.name))
        self.fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        self.tmp = tmp

    def reserve(self, n: int) -> None:
        """Reserve ``n`` bytes now, so a full disk fails before any copy (where the filesystem can)."""
        try:
            os.posix_fallocate(self.fd, 0, n)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise

    def write(self, data) -> None:
        _write_all(self.fd, data)
        self.position += len(data)

    def write_at(self, data: bytes, offset: int) -> None:
        view = memoryview(data)
        while view:
            try:
                n = pwrite(self.fd, view, offset)
            except InterruptedError:
                continue
            view = view[n:]
            offset += n

    def start_writeback(self, offset: int, length: int) -> None:
        try:
            start_writeback(self.fd, offset, length)
        except OSError:  # a hint: flush() is the authority and reports any writeback error
            pass

    def flush(self) -> None:
        if self.sync:
            fsync(self.fd)
        os.close(self.fd)
        self.fd = -1

    def publish(self) -> None:
        assert self.tmp is not None, "publish follows create"
        replace(self.tmp, self.path)
        self.tmp = None

    def sync_folder(self) -> None:
        if not self.sync:
            return
        dfd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fsync(dfd)
        finally:
            os.close(dfd)

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.tmp is not None:
            try:
                os.unlink(self.tmp)
            except OSError:
                pass
            self.tmp = None
