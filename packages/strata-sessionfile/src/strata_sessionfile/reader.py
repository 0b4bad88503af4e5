"""inspect() and restore(): the read pass, the apply pass, and the staged single pass.

Read pass (spec "Reading", rules F*, H*, M*, B*, P*): open safely; check the size against the header;
header and its hash; both fingerprints against the engine; the metadata (every length against the
bytes left and its limit); the layout the geometry implies against the payload length; the zero
padding; the end marker; the engine's exact limits; a RAM preflight; then stream the data section,
hashing it without keeping it, and compare with the trailer; the file must not have changed meanwhile.

Apply pass (streaming mode): the file must be unchanged (fstat) and its metadata, padding and
trailer byte-identical to what the read pass saw; the data section is re-read and handed to the
adapter block by block while the hash is recomputed. The first delivered block is the gate
(``begin_apply``); after it every failure calls ``fail_stop`` and raises ``FailStop``.

Staged mode: the same metadata checks, then one pass into the adapter's staging area while hashing;
``commit_staged`` only after every check, else ``discard_staged``.

Every pass reads the data section with several threads at once (``read_threads``, by default
``default_read_threads()``: at most that many blocks in flight, disjoint) and the calling thread hashes
and hands the blocks over strictly in file order; a read error of block k is raised after every earlier
block was handed over, and no reader is left running when a pass returns or raises. An adapter whose
copies finish after ``copy_in`` / ``stage_in`` return (``AsyncCopyTarget``) is waited for before a block
buffer is refilled and at the end of each pass; one that holds a piece's copy back to merge it with the
next (``MergingCopyTarget``) is told after each block's last piece, so that block's copy runs while it is
hashed.

A compressed data section (header flag DATA_COMPRESSED, spec 3.3): its compression header and block
table are validated with the metadata, before any frame is read; every pass then reads frame by frame,
hashes the frame's bytes as they are on disk, and decodes it into exactly its block's size (a frame
that does not decode or declares another size is refused). The read pass decodes too, so a frame that
would fail to decode is refused before the gate.
"""

from __future__ import annotations

import array
import collections
import mmap
import os
import queue
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import attrs
import xxhash

from . import _fileio
from . import errors as E
from ._fileio import ReadThreads
from .adapter import AsyncCopyTarget, LandingTarget, MergingCopyTarget, SessionTarget, StagingTarget
from .codec import METADATA_OFFSET, compute_layout, decode_header, decode_metadata, decode_trailer
from .compression import CODECS, COMPRESSION_HEADER_SIZE, decode_compressed_section
from .format import DATA_ALIGNMENT, DEFAULT_BLOCK_SIZE, HEADER_SIZE, LIMIT, TRAILER_SIZE, Flags, align_up
from .identity import config_differences, model_differences
from .records import (
    EngineIdentity,
    EngineLimits,
    FileStamp,
    Header,
    Inspection,
    Layout,
    Phase,
    Progress,
    RestoreMode,
    RestorePlan,
    RestoreReport,
    SessionMetadata,
)
from .writer import MIN_BLOCK_SIZE, BlockBuffers, _adapter_call, block_buffers

_U32_SIZE = 4


@attrs.define
class _Opened:
    fd: int
    path: str
    stamp: FileStamp
    header: Header
    metadata: SessionMetadata
    layout: Layout
    prefix: bytearray | mmap.mmap  # payload bytes [64, data_offset): metadata length, metadata, padding
    trailer_digest: bytes
    bytes_read: int
    section_head: bytes = b""  # a compressed data section's 16-byte compression header
    table: bytes = b""  # and its block table, as on disk
    prefix_hasher: object = None  # the payload hash after the prefix (hashed as it was read), copied by each pass
    ahead: _fileio.ReadAhead | None = None  # the data section's first reads, started early (see restore)


def _binding_check(header: Header, body: bytes, identity: EngineIdentity, path: str) -> None:
    model_ok = header.model_fingerprint == identity.model.fingerprint
    config_ok = header.config_fingerprint == identity.config.fingerprint
    if model_ok and config_ok:
        return
    try:
        file_meta = decode_metadata(body, header=header, path=path)
    except E.SessionFileError:
        file_meta = None
    if not model_ok:
        diffs = model_differences(file_meta.model, identity.model) if file_meta else []
        raise E.ModelMismatch("the file was written for another model", differences=diffs, path=path, offset=16,
                              field="model_fingerprint")
    diffs = config_differences(file_meta.config.mapping, identity.config.mapping) if file_meta else []
    raise E.ConfigMismatch("the file was written with another engine configuration", differences=diffs,
                           path=path, offset=32, field="config_fingerprint")


def _largest_id(tokens) -> int:
    """The largest token id: one vectorised pass where numpy is already loaded (~0.01 ms for 32K ids; an
    engine has it), else max() in C over the ids (~0.7-1.2 ms). numpy is never imported for this: its
    import would cost a process that does not use it ~15 MiB of RSS and tens of milliseconds."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(tokens, array.array) and tokens.itemsize == 4:
        return int(np.frombuffer(tokens, dtype=np.int32).max())
    return max(tokens)


def check_limits(metadata: SessionMetadata, limits: EngineLimits, path: str | None = None) -> None:
    """Every count of the file against the running engine's exact limits (rules B3-B6)."""
    st = metadata.state
    if st.n_tokens > limits.max_tokens:
        raise E.LimitExceeded(f"the file holds {st.n_tokens} tokens; the engine's context is {limits.max_tokens}",
                              path=path, field="state.n_tokens")
    top = _largest_id(st.tokens) if limits.vocab_size is not None and st.n_tokens else None
    if top is not None and top >= limits.vocab_size:
        raise E.LimitExceeded(f"token id {top} is outside the engine's vocabulary of {limits.vocab_size}",
                              path=path, field="state.tokens")
    for field, size, limit in (("state.sampler_state", len(st.sampler_state), limits.max_sampler_state_bytes),
                               ("state.checkpoint.data", len(st.checkpoint.data), limits.max_checkpoint_data_bytes),
                               ("state.engine_fields", len(st.engine_fields), limits.max_engine_fields_bytes)):
        if limit is not None and size > limit:
            raise E.LimitExceeded(f"{size} bytes is over the engine's limit of {limit}", path=path, field=field)
    if limits.layers is None:
        return
    file_layers = metadata.layers
    if len(file_layers) != len(limits.layers):
        raise E.GeometryMismatch(f"the file has {len(file_layers)} layers, the engine {len(limits.layers)}",
                                 path=path, field="layers.count")
    diffs = []
    for i, (g, spec) in enumerate(zip(file_layers, limits.layers, strict=True)):
        if g.spec == spec:
            continue
        for field in attrs.fields(type(spec)):
            a, b = getattr(g.spec, field.name), getattr(spec, field.name)
            if a != b:
                show = (lambda v: v.name.lower()) if hasattr(a, "name") else repr
                diffs.append(f"layer {i} {field.name}: file {show(a)}, engine {show(b)}")
    if diffs:
        more = [f"... and {len(diffs) - 12} more"] if len(diffs) > 12 else []
        raise E.GeometryMismatch("the file's K/V geometry differs from the engine's", differences=diffs[:12] + more,
                                 path=path, field="layers")


def _open_metadata(fd: int, path: str, identity: EngineIdentity | None, limits: EngineLimits | None,
                   readers: ReadThreads, require_codec: bool = True, hash_prefix: bool = True) -> _Opened:
    stamp = _fileio.stamp_of(fd)
    size = stamp.size
    if size < HEADER_SIZE:
        raise E.Truncated(f"file is {size} bytes, shorter than the {HEADER_SIZE}-byte header", path=path,
                          offset=size)
    header = decode_header(_fileio.pread_bytes(fd, HEADER_SIZE, 0, path), path=path)
    expected = HEADER_SIZE + header.payload_length + TRAILER_SIZE
    if size < expected:
        raise E.Truncated(f"file is {size} bytes; its header promises {expected}", path=path, offset=size)
    if size > expected:
        raise E.TrailingData(f"file is {size} bytes; its header promises {expected}", path=path, offset=expected)
    if header.payload_length < _U32_SIZE:
        raise E.MetadataInvalid(f"payload of {header.payload_length} bytes cannot hold the metadata length",
                                path=path, offset=48, field="payload_length")
    raw_len = _fileio.pread_bytes(fd, _U32_SIZE, METADATA_OFFSET, path)
    mlen = int.from_bytes(raw_len, "little")
    if mlen > LIMIT["MAX_METADATA_BYTES"]:
        raise E.LimitExceeded(f"metadata of {mlen} bytes is over MAX_METADATA_BYTES", path=path,
                              offset=METADATA_OFFSET, field="metadata.length")
    if _U32_SIZE + mlen > header.payload_length:
        raise E.MetadataInvalid(f"metadata of {mlen} bytes runs past the payload of {header.payload_length}",
                                path=path, offset=METADATA_OFFSET, field="metadata.length")
    # The whole prefix [64, data_offset) in one buffer, filled in place in the order the checks need it
    # (the metadata now, the padding after the layout was validated): no copy of a MiB-sized metadata.
    # The padding's length follows from the metadata length alone (data_offset is aligned).
    pad_start = METADATA_OFFSET + _U32_SIZE + mlen
    prefix = _fileio.fresh_buffer(align_up(pad_start, DATA_ALIGNMENT) - METADATA_OFFSET)
    prefix[:_U32_SIZE] = raw_len
    body = memoryview(prefix)[_U32_SIZE:_U32_SIZE + mlen]
    # A large metadata (a gemma3 32K file: 8.4 MB, most of it the ring checkpoint) is read by the reader
    # threads at once, each faulting in and filling its own huge pages (into fresh memory one thread reads
    # it at ~2-3 GB/s on the CPU machine), and this thread hashes each piece, in order, while later ones
    # are still being read (the payload hash starts with the prefix: every pass continues from here).
    hasher = xxhash.xxh3_128(raw_len) if hash_prefix else None
    _fileio.read_exact_parallel(fd, body, METADATA_OFFSET + _U32_SIZE, path, readers, _fileio.HUGE_PAGE,
                                hasher.update if hasher is not None else None)
    if identity is not None:
        _binding_check(header, body, identity, path)
    metadata = decode_metadata(body, header=header, path=path,
                               known_config=identity.config.canonical if identity is not None else None)
    layout = compute_layout(mlen, metadata.layers)
    section_head = table = b""
    if header.flags & Flags.DATA_COMPRESSED:
        trailer_offset = expected - TRAILER_SIZE
        if trailer_offset < layout.data_offset:
            raise E.MetadataInvalid(f"the payload of {header.payload_length} bytes ends before the data section at "
                                    f"{layout.data_offset}", path=path, offset=48, field="payload_length")
        if trailer_offset - layout.data_offset >= COMPRESSION_HEADER_SIZE:
            section_head = _fileio.pread_bytes(fd, COMPRESSION_HEADER_SIZE, layout.data_offset, path)

        def read_table(offset: int, n: int) -> bytes:
            nonlocal table
            table = _fileio.pread_bytes(fd, n, offset, path)
            return table

        compressed = decode_compressed_section(section_head, read_table, data_offset=layout.data_offset,
                                               trailer_offset=trailer_offset, data_length=layout.data_length,
                                               path=path)
        if require_codec:
            CODECS[compressed.codec].require()
        layout = attrs.evolve(layout, trailer_offset=trailer_offset, file_size=expected, compressed=compressed)
    elif layout.file_size != expected:
        raise E.MetadataInvalid(f"the geometry implies a payload of {layout.trailer_offset - HEADER_SIZE} bytes; "
                                f"the header says {header.payload_length}", path=path, offset=48,
                                field="payload_length")
    assert layout.data_offset - METADATA_OFFSET == len(prefix)
    padding = memoryview(prefix)[pad_start - METADATA_OFFSET:]
    _fileio.read_exact(fd, padding, pad_start, path)
    if any(padding):
        raise E.MetadataInvalid("padding before the data section is not all zero", path=path, offset=pad_start,
                                field="padding")
    if hasher is not None:
        hasher.update(padding)
    trailer_digest = decode_trailer(_fileio.pread_bytes(fd, TRAILER_SIZE, layout.trailer_offset, path),
                                    layout.trailer_offset, path=path)
    if limits is not None:
        check_limits(metadata, limits, path)
    return _Opened(fd, path, stamp, header, metadata, layout, prefix, trailer_digest,
                   HEADER_SIZE + len(prefix) + TRAILER_SIZE + len(section_head) + len(table), section_head, table,
                   hasher)


# Frames read and decoded at once on worker threads, each holding one frame and one decoded block. One
# worker overlaps reading and decoding frame k+1 with hashing and handing over block k. More decode
# faster on idle cores (zstd releases the GIL) but each adds a frame and a block, and glibc's per-thread
# arenas keep more: measured +80 MiB peak with 2 workers against +32 MiB with 1 (16 MiB blocks).
MAX_DECODE_WORKERS = 1


def decode_workers() -> int:
    return max(1, min(MAX_DECODE_WORKERS, os.cpu_count() or 1))


def _preflight(opened: _Opened, block_size: int, n_buffers: int,
               memory_available: Callable[[], int | None] | None) -> None:
    if memory_available is None:
        return
    need = 2 * len(opened.prefix) + opened.metadata.state.n_tokens * 32
    comp = opened.layout.compressed
    if comp is None:
        need += n_buffers * block_size
    else:  # per decode worker a frame and its decoded block; the decoder's state (at most a block); the table
        need += decode_workers() * (comp.max_frame + comp.block_size) + comp.block_size + 2 * len(opened.table)
    have = memory_available()
    if have is not None and need > have:
        raise E.InsufficientMemory(f"this restore needs about {need} bytes of RAM; {have} are available",
                                   path=opened.path)


def _read_ahead(opened: _Opened, buffers, block_size: int, readers: ReadThreads) -> _fileio.ReadAhead:
    layout = opened.layout
    return _fileio.ReadAhead(opened.fd, buffers, _fileio.block_chunks(layout.data_offset, layout.data_length,
                                                                      block_size), opened.path, readers)


def _stream_data(opened: _Opened, buffers, block_size: int, hasher, deliver, progress, phase: Phase,
                 readers: ReadThreads, wait_copies: Callable[[], None] | None = None) -> int:
    """Read the data section in blocks (the ``readers``, at most one block each in flight); on this
    thread, per block in file order, call deliver(view, segments) and hash it. Returns the bytes read from
    the file. ``wait_copies`` (an AsyncCopyTarget's): called before a delivered block's memory is reused
    or freed, and once at the end, also when the pass fails."""
    if opened.layout.compressed is not None:
        try:
            return _stream_frames(opened, hasher, deliver, progress, phase, wait_copies)
        finally:
            if wait_copies is not None:
                wait_copies()
    layout = opened.layout
    blocks = _fileio.iter_blocks(layout.extents, layout.data_length, block_size)
    reader, opened.ahead = opened.ahead or _read_ahead(opened, buffers, block_size, readers), None
    reader.before_refill = wait_copies
    done = 0
    try:
        for (start, view), (b_start, b_len, segments) in zip(reader, blocks, strict=False):
            assert start == layout.data_offset + b_start and len(view) == b_len
            if deliver is not None:
                deliver(view, segments)  # first: an adapter's asynchronous copy then runs beside the hash
            hasher.update(view)  # on this thread, while the helpers read the next blocks
            done += len(view)
            if progress:
                progress(Progress(phase, done, layout.data_length))
    finally:
        reader.close()
        if wait_copies is not None:
            wait_copies()
    return done


def _stream_frames(opened: _Opened, hasher, deliver, progress, phase: Phase,
                   wait_copies: Callable[[], None] | None) -> int:
    """A compressed data section: frames are read and decoded by up to ``decode_workers()`` threads at once
    (zstd releases the GIL), each into exactly its block's size; in file order this thread hashes each
    frame's bytes as they are on disk and calls deliver(decoded, segments). A frame's failure is raised in
    file order, after every earlier block was delivered. The compression header and the block table were
    validated with the metadata; they are hashed here in file order."""
    layout = opened.layout
    comp = layout.compressed
    codec = CODECS[comp.codec]
    workers = decode_workers()
    decoders: queue.SimpleQueue = queue.SimpleQueue()  # a decoder context is not thread-safe: one per task
    for _ in range(workers):
        decoders.put(codec.decoder(comp.block_size, opened.path))
    fd, path = opened.fd, opened.path

    def read_and_decode(index: int, offset: int, size: int, expected: int) -> tuple[bytearray, bytes]:
        frame = bytearray(size)  # filled in place: no second copy of the frame
        _fileio.read_exact(fd, memoryview(frame), offset, path, short_error=E.FileChanged)
        decode = decoders.get()
        try:
            return frame, decode(memoryview(frame), expected, index, offset)
        finally:
            decoders.put(decode)

    hasher.update(opened.section_head)
    work = enumerate(zip(comp.frames(), _fileio.iter_blocks(layout.extents, layout.data_length, comp.block_size),
                         strict=True))
    pending: collections.deque = collections.deque()
    done = read = 0
    pool = ThreadPoolExecutor(workers, thread_name_prefix="strata-decode")

    def submit_next() -> None:
        item = next(work, None)
        if item is not None:
            index, ((offset, size), (_start, b_len, segments)) = item
            pending.append((pool.submit(read_and_decode, index, offset, size, b_len), b_len, segments))

    try:
        for _ in range(workers):
            submit_next()
        while pending:
            future, b_len, segments = pending.popleft()
            frame, block = future.result()
            hasher.update(frame)
            if deliver is not None:
                deliver(memoryview(block), segments)
                if wait_copies is not None:
                    wait_copies()  # the decoded block is freed next
            read += len(frame)
            done += b_len
            del frame, block, future  # before the next task: at most `workers` frames and blocks alive
            submit_next()
            if progress:
                progress(Progress(phase, done, layout.data_length))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    hasher.update(opened.table)
    return read


def _landing_views(landing_views, layer: int, part, offset: int, length: int) -> list[memoryview]:
    """The adapter's views of one piece as flat writable byte views; their lengths must add up to ``length``."""
    out = []
    for v in _adapter_call(landing_views, layer, part, offset, length):
        mv = memoryview(v)
        if not mv.c_contiguous or mv.readonly:
            raise E.AdapterFailed("landing_views must return writable contiguous memoryviews")
        out.append(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv)
    if sum(len(v) for v in out) != length:
        raise E.AdapterFailed(f"landing_views returned {sum(len(v) for v in out)} bytes for a piece of {length}")
    return out


def _land_data(opened: _Opened, landing_views, block_size: int, hasher, progress, phase: Phase,
               readers: ReadThreads) -> int:
    """Read the data section straight into the adapter's memory (``landing_views`` per piece), hashing each
    block there once it landed: the readers read blocks k+1..k+threads while this thread hashes
    block k (in file order). Returns the bytes read. No read is in flight once this returns or raises."""
    layout = opened.layout
    lander = _fileio.ReadInto(opened.fd, opened.path, readers)
    threads = readers.threads
    pending: collections.deque = collections.deque()
    done = 0

    def settle_oldest() -> None:
        nonlocal done
        length = pending.popleft()
        for view in lander.wait():
            hasher.update(view)
        done += length
        if progress:
            progress(Progress(phase, done, layout.data_length))

    try:
        for start, length, segments in _fileio.iter_blocks(layout.extents, layout.data_length, block_size):
            views: list[memoryview] = []
            for layer, part, part_offset, seg_len, _buf_offset in segments:
                views.extend(_landing_views(landing_views, layer, part, part_offset, seg_len))
            lander.submit(layout.data_offset + start, views)
            pending.append(length)
            if len(pending) > threads:
                settle_oldest()
        while pending:
            settle_oldest()
    finally:
        lander.close()
    return done


def _check_digest(opened: _Opened, hasher, when: str) -> bytes:
    digest = hasher.digest()
    if digest != opened.trailer_digest:
        raise E.PayloadCorrupt(f"payload hash {digest.hex()} does not match the trailer's "
                               f"{opened.trailer_digest.hex()} ({when})", path=opened.path,
                               offset=opened.layout.trailer_offset, field="payload_hash")
    return digest


def _check_unchanged(opened: _Opened, when: str) -> None:
    now = _fileio.stamp_of(opened.fd)
    if now != opened.stamp:
        what = ("grew" if now.size > opened.stamp.size else "shrank" if now.size < opened.stamp.size
                else "was modified")
        raise E.FileChanged(f"the file {what} {when} (size {opened.stamp.size} -> {now.size})", path=opened.path)


def _hash_pass(opened: _Opened, buffers, block_size: int, progress, readers: ReadThreads) -> bytes:
    hasher = opened.prefix_hasher.copy()
    opened.bytes_read += _stream_data(opened, buffers, block_size, hasher, None, progress, Phase.READ, readers)
    digest = _check_digest(opened, hasher, "read pass")
    _check_unchanged(opened, "during the read pass")
    return digest


def _readers(read_threads: int | ReadThreads | None) -> tuple[ReadThreads, bool]:
    """The threads a call reads with, and whether the call made them (and closes them)."""
    if isinstance(read_threads, ReadThreads):
        return read_threads, False
    return ReadThreads(_fileio.default_read_threads() if read_threads is None else read_threads), True


def inspect(path: str | os.PathLike, *, verify: bool = True, identity: EngineIdentity | None = None,
            limits: EngineLimits | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
            read_threads: int | ReadThreads | None = None) -> Inspection:
    """The read pass alone: validate the file (and, if given, its binding to an engine) without applying it.

    ``read_threads``: threads reading the file at once (None: ``default_read_threads()``), or a
    ``ReadThreads`` to read with (kept open)."""
    path = os.fspath(path)
    readers, own_readers = _readers(read_threads)
    try:
        fd = _fileio.open_session_file(path)
        try:
            opened = _open_metadata(fd, path, identity, limits, readers, require_codec=verify,
                                    hash_prefix=verify)
            digest = None
            if verify:
                views = (BlockBuffers(block_size, readers.threads + 1).views if opened.layout.compressed is None
                         else None)
                digest = _hash_pass(opened, views, block_size, None, readers)
            return Inspection(path, opened.header, opened.metadata, opened.layout, verify, digest)
        finally:
            os.close(fd)
    finally:
        if own_readers:
            readers.close()


def _fail_stop(adapter: SessionTarget, exc: BaseException, path: str) -> E.FailStop:
    if not isinstance(exc, E.SessionFileError):
        exc = E.AdapterFailed(f"{type(exc).__name__}: {exc}", path=path)
    try:
        adapter.fail_stop(exc)
    except Exception:  # the engine is going down anyway; the original error is what matters
        pass
    return E.FailStop(exc, path=path)


def _copy_waiter(adapter) -> Callable[[], None] | None:
    if not isinstance(adapter, AsyncCopyTarget):
        return None
    return lambda: _adapter_call(adapter.wait_copies)


def _block_handed_over(adapter) -> Callable[[], None]:
    """What to call after a block's last piece went to copy_in / stage_in: a MergingCopyTarget's flush."""
    if not isinstance(adapter, MergingCopyTarget):
        return lambda: None
    return lambda: _adapter_call(adapter.flush_copies)


def _apply_streaming(opened: _Opened, adapter: SessionTarget, plan: RestorePlan, buffers, block_size, progress,
                     landing: bool, readers: ReadThreads):
    # Before the gate: the file must be exactly what the read pass validated.
    _check_unchanged(opened, "between the read pass and the apply pass")
    # A bytearray on the left compares with memcmp (a memoryview compares item by item: ~25 ms for a gemma3
    # file's 8.4 MB prefix); read by the reader threads like the first time.
    prefix_again = bytearray(len(opened.prefix))
    try:
        _fileio.read_exact_parallel(opened.fd, memoryview(prefix_again), METADATA_OFFSET, opened.path, readers,
                                    _fileio.HUGE_PAGE)
    except E.Truncated as exc:
        raise E.FileChanged(f"the file shrank between the read pass and the apply pass ({exc})",
                            path=opened.path) from None
    trailer_again = _fileio.pread_bytes(opened.fd, TRAILER_SIZE, opened.layout.trailer_offset, opened.path,
                                        short_error=E.FileChanged)
    comp = opened.layout.compressed
    head_again = table_again = b""
    if comp is not None:
        head_again = _fileio.pread_bytes(opened.fd, len(opened.section_head), comp.header_offset, opened.path,
                                         short_error=E.FileChanged)
        table_again = _fileio.pread_bytes(opened.fd, len(opened.table), comp.table_offset, opened.path,
                                          short_error=E.FileChanged)
    if prefix_again != opened.prefix or decode_trailer(trailer_again, opened.layout.trailer_offset) != \
            opened.trailer_digest or head_again != opened.section_head or table_again != opened.table:
        raise E.FileChanged("the metadata, compression header, block table or trailer changed between the read "
                            "pass and the apply pass", path=opened.path)
    del prefix_again
    opened.bytes_read += len(opened.prefix) + TRAILER_SIZE + len(head_again) + len(table_again)
    # The prefix re-read is byte-identical to the one the read pass hashed (checked above): start from there.
    hasher = opened.prefix_hasher.copy()
    gate = [False]
    handed_over = _block_handed_over(adapter)

    def open_gate() -> None:
        gate[0] = True
        _adapter_call(adapter.begin_apply, plan)

    def deliver(view: memoryview, segments) -> None:
        if not gate[0]:
            open_gate()
        for layer, part, part_offset, length, buf_offset in segments:
            _adapter_call(adapter.copy_in, layer, part, part_offset,
                          view[buf_offset:buf_offset + length].toreadonly())
        handed_over()

    try:
        if landing:  # the gate first: from here on the file's bytes land in the live K/V
            open_gate()
            opened.bytes_read += _land_data(opened, adapter.landing_views, block_size, hasher, progress,
                                            Phase.APPLY, readers)
        else:
            opened.bytes_read += _stream_data(opened, buffers, block_size, hasher, deliver, progress, Phase.APPLY,
                                              readers, _copy_waiter(adapter))
        if not gate[0]:
            open_gate()
        _check_digest(opened, hasher, "apply pass")
        _check_unchanged(opened, "during the apply pass")
        _adapter_call(adapter.commit, plan.state)
    except BaseException as exc:
        if gate[0]:
            raise _fail_stop(adapter, exc, opened.path) from exc
        raise


def _apply_staged(opened: _Opened, adapter: StagingTarget, plan: RestorePlan, buffers, block_size, progress,
                  landing: bool, readers: ReadThreads):
    hasher = opened.prefix_hasher.copy()
    handed_over = _block_handed_over(adapter)

    def deliver(view: memoryview, segments) -> None:
        for layer, part, part_offset, length, buf_offset in segments:
            _adapter_call(adapter.stage_in, layer, part, part_offset,
                          view[buf_offset:buf_offset + length].toreadonly())
        handed_over()

    try:
        _adapter_call(adapter.begin_staging, plan)
        if landing:  # straight into the staging area
            opened.bytes_read += _land_data(opened, adapter.landing_views, block_size, hasher, progress,
                                            Phase.APPLY, readers)
        else:
            opened.bytes_read += _stream_data(opened, buffers, block_size, hasher, deliver, progress, Phase.APPLY,
                                              readers, _copy_waiter(adapter))
        _check_digest(opened, hasher, "staged pass")
        _check_unchanged(opened, "during the staged pass")
        _adapter_call(adapter.commit_staged, plan.state)
    except BaseException:
        try:
            adapter.discard_staged()
        except Exception:
            pass
        raise


def restore(path: str | os.PathLike, adapter: SessionTarget, *, mode: RestoreMode | str = RestoreMode.AUTO,
            block_size: int = DEFAULT_BLOCK_SIZE, progress: Callable[[Progress], None] | None = None,
            memory_available: Callable[[], int | None] | None = _fileio.memory_available,
            buffers: BlockBuffers | None = None, read_threads: int | ReadThreads | None = None) -> RestoreReport:
    """Validate ``path`` against the adapter's engine and apply it (see the module docstring).

    ``buffers``: block buffers to reuse (else the adapter's, if it is a BufferProvider, else fresh ones).
    ``memory_available``: a probe of the free RAM in bytes for the preflight (None skips it).
    ``read_threads``: threads reading the file at once (None: ``default_read_threads()``), or a
    ``ReadThreads`` to read with (kept open: an engine that restores often starts its threads once);
    blocks are still hashed and delivered in file order, on the calling thread. Block buffers: the readers
    + 1 (given ``buffers`` with fewer views mean fewer reads at once). A compressed data section uses its
    decode workers instead.
    """
    if block_size < MIN_BLOCK_SIZE:
        raise ValueError(f"block_size must be at least {MIN_BLOCK_SIZE}")
    readers, own_readers = _readers(read_threads)
    try:
        return _restore(path, adapter, RestoreMode(mode), block_size, progress, memory_available, buffers, readers)
    finally:
        if own_readers:
            readers.close()


def _restore(path, adapter: SessionTarget, mode: RestoreMode, block_size: int, progress, memory_available,
             buffers: BlockBuffers | None, readers: ReadThreads) -> RestoreReport:
    threads = readers.threads
    t0 = time.perf_counter()
    path = os.fspath(path)
    identity = _adapter_call(adapter.identity)
    limits = _adapter_call(adapter.limits)
    fd = _fileio.open_session_file(path)
    opened = None
    try:
        opened = _open_metadata(fd, path, identity, limits, readers)
        _preflight(opened, block_size, threads + 1, memory_available)
        staged = False
        if mode is not RestoreMode.STREAMING and isinstance(adapter, StagingTarget):
            probe = RestorePlan(path, opened.header, opened.metadata, opened.layout, opened.stamp, RestoreMode.STAGED)
            staged = bool(_adapter_call(adapter.can_stage, probe))
        if mode is RestoreMode.STAGED and not staged:
            raise E.StagingUnavailable("staged restore requested but the adapter cannot stage this session",
                                       path=path)
        plan = RestorePlan(path, opened.header, opened.metadata, opened.layout, opened.stamp,
                           RestoreMode.STAGED if staged else RestoreMode.STREAMING)
        # Zero-copy: the adapter's memory takes the bytes straight from the file (never compressed data).
        landing = (opened.layout.compressed is None and isinstance(adapter, LandingTarget)
                   and bool(_adapter_call(adapter.can_land, plan)))
        if opened.layout.compressed is not None or (staged and landing):
            views = None  # decode workers read frames into their own buffers; landing needs none
        else:
            views = block_buffers(adapter, block_size, buffers, threads + 1)
            # The first blocks are read while the engine checks the plan and the prefix is hashed: the
            # pass then starts on blocks already in memory instead of waiting for the first read.
            opened.ahead = _read_ahead(opened, views, block_size, readers).start()
        if staged:
            _adapter_call(adapter.check_plan, plan)
            t_read = time.perf_counter()
            _apply_staged(opened, adapter, plan, views, block_size, progress, landing, readers)
        else:
            _hash_pass(opened, views, block_size, progress, readers)
            _adapter_call(adapter.check_plan, plan)
            t_read = time.perf_counter()
            _apply_streaming(opened, adapter, plan, views, block_size, progress, landing, readers)
        t_end = time.perf_counter()
        return RestoreReport(path, plan.mode, plan.state.n_tokens, opened.bytes_read, opened.stamp.size,
                             t_end - t0, t_read - t0, t_end - t_read)
    finally:
        if opened is not None and opened.ahead is not None:  # a refusal before the first pass: stop its reads
            opened.ahead.close()
        os.close(fd)
