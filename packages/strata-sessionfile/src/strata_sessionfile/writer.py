"""save(): stream an adapter's snapshot into a new file, crash-safely.

Steps (spec "Writing"): encode the metadata; create ``.<name>.<random>.strata-tmp`` in the target's
folder with O_CREAT|O_EXCL (mode 0600); reserve the space (posix_fallocate, so a full disk fails
before any copy); write header, metadata and padding; stream the data section in blocks (the adapter
fills one buffer while the helper thread hashes and writes the other, starting the kernel's writeback
of each block once written); write the trailer; fsync the file; rename it over the target; fsync the folder. Before the rename any failure removes the
temporary and leaves the old file untouched; a failed folder fsync after it raises DirSyncFailed
(the new file is in place).

Compressed (``compression=``, spec section 3.3): each block is encoded into one frame on the helper
thread; the compression header follows the padding, the block table follows the frames, and the
64-byte header (which holds the payload length, known only at the end, and is not hashed) is written
last, before the fsync. No space is reserved up front (the size is unknown); a full disk still fails
before the rename and keeps the old file.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import time
from collections.abc import Callable

import xxhash

from . import _fileio
from . import errors as E
from .adapter import BufferProvider, SessionSource
from .codec import compute_layout, encode_header, encode_metadata, encode_trailer, payload_length_of
from .compression import (
    CODECS,
    Compression,
    as_compression,
    encode_block_table,
    encode_compression_header,
    n_blocks_for,
)
from .format import DEFAULT_BLOCK_SIZE, HEADER_SIZE, LIMIT, TRAILER_SIZE, Flags
from .records import Phase, Progress, SaveReport

TEMP_SUFFIX = ".strata-tmp"
NAME_MAX = 255  # bytes in one path component on Linux filesystems


def _temporary_name(name: str) -> str:
    """``.<name>.<12 hex>.strata-tmp``, the name cut (on a character boundary) so the whole fits NAME_MAX.

    A target name near NAME_MAX is valid, so its temporary must not be longer than the limit.
    """
    tail = f".{secrets.token_hex(6)}{TEMP_SUFFIX}"
    room = NAME_MAX - 1 - len(tail)
    stem = os.fsencode(name)[:room]
    return "." + os.fsdecode(stem.decode("utf-8", "ignore").encode("utf-8")) + tail
MIN_BLOCK_SIZE = 4096


def _adapter_call(fn, *args):
    try:
        return fn(*args)
    except E.SessionFileError:
        raise
    except Exception as exc:
        raise E.AdapterFailed(f"adapter {getattr(fn, '__name__', fn)} raised {type(exc).__name__}: {exc}") from exc


class BlockBuffers:
    """Block buffers (anonymous memory maps) that a caller may keep and pass to every save/restore, so no
    call pays for allocating and faulting in fresh buffers. A save uses two; a restore with N reader
    threads N + 1 (with fewer it reads with fewer threads)."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, count: int = 2) -> None:
        if block_size < MIN_BLOCK_SIZE:
            raise ValueError(f"block_size must be at least {MIN_BLOCK_SIZE}")
        if count < 2:
            raise ValueError("count must be at least 2")
        self.block_size = block_size
        self._maps = [mmap.mmap(-1, block_size) for _ in range(count)]
        self.views = [memoryview(m) for m in self._maps]

    def close(self) -> None:
        for v in self.views:
            v.release()
        for m in self._maps:
            m.close()


def block_buffers(adapter, block_size: int, buffers: BlockBuffers | None = None, count: int = 2) -> list[memoryview]:
    """``count`` block buffers: the caller's (BlockBuffers: all it has, which may be fewer), the adapter's own
    (BufferProvider), or fresh maps."""
    if buffers is not None:
        if buffers.block_size < block_size:
            raise ValueError(f"the given buffers hold {buffers.block_size} bytes, block_size is {block_size}")
        return buffers.views[:count]
    if isinstance(adapter, BufferProvider):
        bufs = list(_adapter_call(adapter.block_buffers, count, block_size))
        if len(bufs) < count or any(len(b) < block_size or b.readonly for b in bufs[:count]):
            raise E.AdapterFailed(f"block_buffers must return {count} writable memoryviews of {block_size} bytes")
        return [memoryview(b).cast("B") for b in bufs[:count]]
    return BlockBuffers(block_size, count).views


def save(path: str | os.PathLike, adapter: SessionSource, *, block_size: int = DEFAULT_BLOCK_SIZE,
         progress: Callable[[Progress], None] | None = None, buffers: BlockBuffers | None = None,
         compression: Compression | str | None = None) -> SaveReport:
    """Write the adapter's session to ``path`` (atomically replacing any file there).

    ``buffers``: block buffers to reuse (else the adapter's, if it is a BufferProvider, else fresh ones).
    ``compression``: None (default: not compressed), ``"zstd"`` (its default level), or a ``Compression``
    (codec, level, threads). A compressed file's blocks hold ``block_size`` uncompressed bytes each
    (at most MAX_COMPRESSED_BLOCK_BYTES). Progress then counts uncompressed bytes.
    """
    if block_size < MIN_BLOCK_SIZE:
        raise ValueError(f"block_size must be at least {MIN_BLOCK_SIZE}")
    options = as_compression(compression)
    encode = None
    if options is not None:
        if block_size > LIMIT["MAX_COMPRESSED_BLOCK_BYTES"]:
            raise ValueError(f"a compressed save's block_size must be at most {LIMIT['MAX_COMPRESSED_BLOCK_BYTES']}")
        encode = CODECS[options.code].encoder(options)  # CompressionUnavailable before any file exists
    t0 = time.perf_counter()
    path = os.fspath(path)
    identity = _adapter_call(adapter.identity)
    snapshot = _adapter_call(adapter.snapshot)
    try:
        metadata = encode_metadata(identity.model, identity.config, snapshot.state, snapshot.layers)
    except E.SessionFileError as exc:
        exc.path = path
        raise
    layout = compute_layout(len(metadata) - 4, snapshot.layers)
    padding = bytes(layout.data_offset - HEADER_SIZE - len(metadata))
    total = layout.file_size  # progress total: the uncompressed file's size
    if options is None:
        header = encode_header(identity.model.fingerprint, identity.config.fingerprint, payload_length_of(layout))
        prefix = [header, metadata, padding]  # written piece by piece: no copy of a large metadata
    else:
        n_blocks = n_blocks_for(layout.data_length, block_size)
        if n_blocks > LIMIT["MAX_COMPRESSED_BLOCKS"]:
            raise E.InvalidSnapshot(f"{layout.data_length} data bytes in blocks of {block_size} make {n_blocks} "
                                    "blocks, over MAX_COMPRESSED_BLOCKS: use a larger block_size",
                                    path=path, field="block_size")
        # The header is not hashed and holds the final payload length: a placeholder now, written last.
        prefix = [bytes(HEADER_SIZE) + metadata + padding + encode_compression_header(options, block_size, n_blocks)]
    prefix_length = sum(len(p) for p in prefix)

    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, _temporary_name(name))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise E.write_error_from_os(exc, "creating the temporary file", path) from exc
    pipeline = None
    stage = "writing"
    try:
        if options is None:
            try:
                os.posix_fallocate(fd, 0, total)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    raise
        hasher = xxhash.xxh3_128()
        if layout.data_length:
            views = block_buffers(adapter, block_size, buffers)
            pipeline = _fileio.WriteBehind(fd, views, hasher, encode)
        unhashed = HEADER_SIZE  # the payload hash starts after the header
        for piece in prefix:  # the helper writes the prefix while this thread fills the first block
            if pipeline is not None:
                pipeline.submit_raw(piece, unhashed)
            else:
                hasher.update(memoryview(piece)[unhashed:])
                _fileio.write_all(fd, piece)
            unhashed = max(0, unhashed - len(piece))
        done = layout.data_offset
        if progress:
            progress(Progress(Phase.COPY, done, total))
        if layout.data_length:
            for _start, length, segments in _fileio.iter_blocks(layout.extents, layout.data_length, block_size):
                buf = pipeline.acquire()
                for layer, part, part_offset, seg_len, buf_offset in segments:
                    _adapter_call(adapter.copy_out, layer, part, part_offset,
                                  buf[buf_offset:buf_offset + seg_len])
                pipeline.submit(length)
                done += length
                if progress:
                    progress(Progress(Phase.COPY, done, total))
            pipeline.finish()
            frame_sizes = pipeline.frame_sizes
            pipeline = None
        else:
            frame_sizes = []
        written = prefix_length + sum(frame_sizes) if options is not None else total - TRAILER_SIZE
        if options is not None:
            table = encode_block_table(frame_sizes)
            hasher.update(table)
            _fileio.write_all(fd, table)
            written += len(table)
        digest = hasher.digest()
        _fileio.write_all(fd, encode_trailer(digest))
        if options is not None:
            header = encode_header(identity.model.fingerprint, identity.config.fingerprint,
                                   written - HEADER_SIZE, flags=Flags.DATA_COMPRESSED)
            _fileio.pwrite_all(fd, header, 0)
        bytes_written = written + TRAILER_SIZE
        if progress:
            progress(Progress(Phase.COPY, total, total))
        t_copy = time.perf_counter()
        stage = "flushing"
        if progress:
            progress(Progress(Phase.FLUSH, total, total))
        _fileio.fsync(fd)
        t_flush = time.perf_counter()
        os.close(fd)
        fd = -1
        stage = "renaming"
        if progress:
            progress(Progress(Phase.RENAME, total, total))
        _fileio.replace(tmp, path)
        t_rename = time.perf_counter()
    except BaseException as exc:
        if pipeline is not None:
            pipeline.abort()
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise E.write_error_from_os(exc, f"{stage} the temporary file", path) from exc
        if isinstance(exc, E.SessionFileError) and exc.path is None:
            exc.path = path
        raise
    def report() -> SaveReport:
        return SaveReport(path=path, n_tokens=snapshot.state.n_tokens, bytes_written=bytes_written,
                          elapsed_s=time.perf_counter() - t0, copy_s=t_copy - t0, flush_s=t_flush - t_copy,
                          rename_s=t_rename - t_flush, payload_hash=digest,
                          compression=options.codec if options is not None else None,
                          kv_bytes=layout.data_length)

    try:
        dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            _fileio.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError as exc:
        raise E.DirSyncFailed(f"the new file is in place but flushing its folder failed: {exc.strerror or exc}",
                              path=path, report=report()) from exc
    return report()
