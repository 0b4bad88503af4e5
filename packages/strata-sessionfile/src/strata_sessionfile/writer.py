"""save(): stream an adapter's snapshot into a new file, crash-safely, as a fixed sequence of stages.

``SessionWriter`` is a small state machine (as gguf-py's GGUFWriter is): one method per stage, each
allowed only right after the one before it; a failure is reported with the stage it happened in
("flushing the temporary file failed: ...").

PLAN         the adapter's identity and frozen snapshot; the metadata encoded, the layout computed
CREATE       the byte sink made: for a path ``.<name>.<random>.strata-tmp`` created exclusively in the
             target's folder; for an object (``objstore.S3Sink``) a multipart upload started
WRITE        space reserved; header, metadata, padding; the data section block by block (the adapter
             fills one buffer while a helper thread hashes and writes the other, starting the kernel's
             writeback of each block); the trailer. Progress: ``copy``, per block
FLUSH        the temporary fsynced and closed. Progress: ``flush``
RENAME       the temporary renamed over the target. Progress: ``rename``
SYNC_FOLDER  the folder fsynced; a failure raises DirSyncFailed (the new file is in place)
DONE

A failure in WRITE, FLUSH or RENAME removes the temporary (aborts the upload) and leaves the old file
(object) untouched. The target is a path or any ``seam.ByteSink``.

Compressed (``compression=``, spec section 3.3): each block is encoded into one frame on the helper
thread; the compression header follows the padding, the block table follows the frames, and the
64-byte header (which holds the payload length, known only at the end, and is not hashed) is written
last, before the fsync. No space is reserved up front (the size is unknown); a full disk still fails
before the rename and keeps the old file.
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Callable

from . import errors as E
from .adapter import SessionSource, adapter_call
from .auth import AuthenticatedHasher, SessionKey, as_key, auth_extension, payload_hasher
from .codec import compute_layout, encode_header, encode_metadata, encode_trailer, payload_length_of
from .compression import (
    CODECS,
    Compression,
    as_compression,
    encode_block_table,
    encode_compression_header,
    n_blocks_for,
)
from .format import DEFAULT_BLOCK_SIZE, HEADER_SIZE, LIMIT, Flags, trailer_size
from .memory import MIN_BLOCK_SIZE, BlockBuffers, block_buffers
from .pipelines import WriteBehind, iter_blocks
from .records import Phase, Progress, SaveReport
from .seam import ByteSink, as_sink, target_name


class Stage(enum.Enum):
    """A save's stages, in the order every save goes through them; the value is the verb a failure in
    that stage is reported with."""

    PLAN = "planning"
    CREATE = "creating"
    WRITE = "writing"
    FLUSH = "flushing"
    RENAME = "renaming"
    SYNC_FOLDER = "flushing the folder"
    DONE = "done"


STAGES = tuple(Stage)


class SessionWriter:
    """One save of ``adapter``'s session to ``path``: call ``plan``, ``create``, ``write``, ``flush``,
    ``rename``, ``sync_folder`` in this order (``save`` does), then ``report``; ``discard`` after a failure
    before ``rename`` completed removes the temporary. ``stage`` is the stage running or last run."""

    def __init__(
        self,
        path: str | os.PathLike | ByteSink,
        adapter: SessionSource,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        progress: Callable[[Progress], None] | None = None,
        buffers: BlockBuffers | None = None,
        compression: Compression | str | None = None,
        key: SessionKey | bytes | None = None,
    ) -> None:
        if block_size < MIN_BLOCK_SIZE:
            raise ValueError(f"block_size must be at least {MIN_BLOCK_SIZE}")
        self.options = as_compression(compression)
        self.encode = None
        if self.options is not None:
            if block_size > LIMIT["MAX_COMPRESSED_BLOCK_BYTES"]:
                raise ValueError(
                    f"a compressed save's block_size must be at most {LIMIT['MAX_COMPRESSED_BLOCK_BYTES']}"
                )
            self.encode = CODECS[self.options.code].encoder(
                self.options
            )  # CompressionUnavailable before any file
        self.path_arg, self.adapter, self.block_size = path, adapter, block_size
        self.progress, self.buffers = progress, buffers
        self.key = as_key(key)
        self.auth_flag = Flags.AUTHENTICATED if self.key is not None else Flags.NONE
        self.stage: Stage | None = None
        self.sink: ByteSink | None = None
        self.pipeline: WriteBehind | None = None

    def _enter(self, stage: Stage) -> None:
        want = STAGES[STAGES.index(self.stage) + 1] if self.stage is not None else STAGES[0]
        if stage is not want:
            raise RuntimeError(
                f"save stage {stage.name} cannot follow {self.stage.name if self.stage else 'nothing'}"
            )
        self.stage = stage

    def plan(self) -> None:
        """PLAN: everything the file holds before its K/V, encoded; nothing on disk yet."""
        self._enter(Stage.PLAN)
        self.t0 = time.perf_counter()
        self.path = path = target_name(self.path_arg)
        self.identity = identity = adapter_call(self.adapter.identity)
        self.snapshot = snapshot = adapter_call(self.adapter.snapshot)
        try:
            metadata = encode_metadata(identity.model, identity.config, snapshot.state, snapshot.layers)
        except E.SessionFileError as exc:
            exc.path = path
            raise
        self.layout = layout = compute_layout(
            len(metadata) - 4, snapshot.layers, trailer_size(self.auth_flag)
        )
        padding = bytes(layout.data_offset - HEADER_SIZE - len(metadata))
        self.total = layout.file_size  # progress total: the uncompressed file's size
        if self.options is None:
            self.header = encode_header(
                identity.model.fingerprint,
                identity.config.fingerprint,
                payload_length_of(layout),
                flags=self.auth_flag,
            )
            self.prefix = [
                self.header,
                metadata,
                padding,
            ]  # written piece by piece: no copy of a large metadata
        else:
            n_blocks = n_blocks_for(layout.data_length, self.block_size)
            if n_blocks > LIMIT["MAX_COMPRESSED_BLOCKS"]:
                raise E.InvalidSnapshot(
                    f"{layout.data_length} data bytes in blocks of {self.block_size} make "
                    f"{n_blocks} blocks, over MAX_COMPRESSED_BLOCKS: use a larger block_size",
                    path=path,
                    field="block_size",
                )
            # The header is not hashed and holds the final payload length: a placeholder now, written last.
            self.prefix = [
                bytes(HEADER_SIZE)
                + metadata
                + padding
                + encode_compression_header(self.options, self.block_size, n_blocks)
            ]

    def create(self) -> None:
        """CREATE: the temporary file, exclusively (an object's multipart upload)."""
        self._enter(Stage.CREATE)
        sink = as_sink(self.path_arg)
        try:
            sink.create()
        except OSError as exc:
            raise E.write_error_from_os(exc, "creating the temporary file", self.path) from exc
        self.sink = sink

    def _created(self) -> ByteSink:
        """The sink CREATE made (``_enter`` lets no later stage run before it)."""
        assert self.sink is not None, "a stage after CREATE runs before create()"
        return self.sink

    def write(self) -> None:
        """WRITE: the whole file into the temporary (progress: copy, per block)."""
        self._enter(Stage.WRITE)
        sink, layout, total, progress = self._created(), self.layout, self.total, self.progress
        options = self.options
        if options is None:
            sink.reserve(total)
        hasher = payload_hasher(self.key is not None)
        pipeline = None
        if layout.data_length:
            views = block_buffers(self.adapter, self.block_size, self.buffers)
            self.pipeline = pipeline = WriteBehind(sink, views, hasher, self.encode)
        unhashed = HEADER_SIZE  # the payload hash starts after the header
        for piece in self.prefix:  # the helper writes the prefix while this thread fills the first block
            if pipeline is not None:
                pipeline.submit_raw(piece, unhashed)
            else:
                hasher.update(memoryview(piece)[unhashed:])
                sink.write(piece)
            unhashed = max(0, unhashed - len(piece))
        done = layout.data_offset
        if progress:
            progress(Progress(Phase.COPY, done, total))
        frame_sizes = []
        if pipeline is not None:
            copy_out = self.adapter.copy_out
            for _start, length, segments in iter_blocks(layout.extents, layout.data_length, self.block_size):
                buf = pipeline.acquire()
                for layer, part, part_offset, seg_len, buf_offset in segments:
                    adapter_call(copy_out, layer, part, part_offset, buf[buf_offset : buf_offset + seg_len])
                pipeline.submit(length)
                done += length
                if progress:
                    progress(Progress(Phase.COPY, done, total))
            pipeline.finish()
            frame_sizes = pipeline.frame_sizes
            self.pipeline = None
        prefix_length = sum(len(p) for p in self.prefix)
        written = prefix_length + sum(frame_sizes) if options is not None else layout.trailer_offset
        if options is not None:
            table = encode_block_table(frame_sizes)
            hasher.update(table)
            sink.write(table)
            written += len(table)
            identity = self.identity
            self.header = encode_header(
                identity.model.fingerprint,
                identity.config.fingerprint,
                written - HEADER_SIZE,
                flags=Flags.DATA_COMPRESSED | self.auth_flag,
            )
        self.digest = hasher.digest()
        extension = b""
        if self.key is not None:
            assert isinstance(hasher, AuthenticatedHasher)  # payload_hasher's for an authenticated file
            extension = auth_extension(self.key, self.header, self.digest, hasher.payload_digest())
        trailer = encode_trailer(self.digest, extension)
        sink.write(trailer)
        if options is not None:
            sink.write_at(self.header, 0)
        self.bytes_written = written + len(trailer)
        self._announce(Phase.COPY)
        self.t_copy = time.perf_counter()

    def _announce(self, phase: Phase) -> None:
        if self.progress:
            self.progress(Progress(phase, self.total, self.total))

    def flush(self) -> None:
        """FLUSH: the temporary durable (progress: flush)."""
        self._enter(Stage.FLUSH)
        self._announce(Phase.FLUSH)
        self._created().flush()
        self.t_flush = time.perf_counter()

    def rename(self) -> None:
        """RENAME: the temporary becomes the target (progress: rename)."""
        self._enter(Stage.RENAME)
        self._announce(Phase.RENAME)
        self._created().publish()
        self.t_rename = time.perf_counter()

    def sync_folder(self) -> None:
        """SYNC_FOLDER: the rename durable; a failure here raises DirSyncFailed (the new file is in place)."""
        self._enter(Stage.SYNC_FOLDER)
        try:
            self._created().sync_folder()
        except OSError as exc:
            raise E.DirSyncFailed(
                f"the new file is in place but flushing its folder failed: {exc.strerror or exc}",
                path=self.path,
                report=self.report(),
            ) from exc
        self._enter(Stage.DONE)

    def discard(self) -> None:
        """After a failure before the rename completed: stop the helper, remove the temporary."""
        if self.pipeline is not None:
            self.pipeline.abort()
            self.pipeline = None
        if self.sink is not None:
            self.sink.discard()

    def report(self) -> SaveReport:
        options = self.options
        return SaveReport(
            path=self.path,
            n_tokens=self.snapshot.state.n_tokens,
            bytes_written=self.bytes_written,
            elapsed_s=time.perf_counter() - self.t0,
            copy_s=self.t_copy - self.t0,
            flush_s=self.t_flush - self.t_copy,
            rename_s=self.t_rename - self.t_flush,
            payload_hash=self.digest,
            compression=options.codec if options is not None else None,
            kv_bytes=self.layout.data_length,
        )


def save(
    path: str | os.PathLike | ByteSink,
    adapter: SessionSource,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    progress: Callable[[Progress], None] | None = None,
    buffers: BlockBuffers | None = None,
    compression: Compression | str | None = None,
    key: SessionKey | bytes | None = None,
) -> SaveReport:
    """Write the adapter's session to ``path`` (atomically replacing any file there): a local path, or a
    ``ByteSink`` (e.g. ``objstore.S3Sink``: the object appears when its multipart upload completes).

    ``buffers``: block buffers to reuse (else the adapter's, if it is a BufferProvider, else fresh ones).
    ``compression``: None (default: not compressed), ``"zstd"`` (its default level), or a ``Compression``
    (codec, level, threads). A compressed file's blocks hold ``block_size`` uncompressed bytes each
    (at most MAX_COMPRESSED_BLOCK_BYTES). Progress then counts uncompressed bytes.
    ``key`` (a ``SessionKey`` or its 32 bytes): the file is authenticated (flag AUTHENTICATED, spec 4.1): its
    trailer carries the key id, the payload's SHA-256 and the MAC.
    """
    writer = SessionWriter(
        path,
        adapter,
        block_size=block_size,
        progress=progress,
        buffers=buffers,
        compression=compression,
        key=key,
    )
    writer.plan()
    writer.create()
    try:
        writer.write()
        writer.flush()
        writer.rename()
    except BaseException as exc:
        writer.discard()
        if isinstance(exc, OSError):
            assert writer.stage is not None  # plan() above entered the first stage
            raise E.write_error_from_os(exc, f"{writer.stage.value} the temporary file", writer.path) from exc
        if isinstance(exc, E.SessionFileError) and exc.path is None:
            exc.path = writer.path
        raise
    writer.sync_folder()
    return writer.report()
