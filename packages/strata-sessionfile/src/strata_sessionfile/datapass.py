"""The passes over the data section: every pass reads it with several threads at once and, on the calling
thread, hashes each block and hands it over strictly in file order.

``stream_data`` reads blocks into block buffers (or, for a compressed section, reads and decodes frames
on worker threads) and calls ``deliver(view, segments)`` per block; ``land_data`` reads straight into the
adapter's memory (``LandingTarget``); ``hash_pass`` is the read pass (hash only). A read error of block k
is raised after every earlier block was handed over, and no read is in flight once a pass returns or
raises.
"""

from __future__ import annotations

import collections
import queue
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from . import errors as E
from .adapter import adapter_call
from .compression import CODECS, CompressedLayout
from .pipelines import ReadAhead, ReadInto, ReadThreads, block_chunks, decode_workers, iter_blocks
from .records import Phase, Progress
from .validate import OpenedFile, check_digest, check_unchanged


def read_ahead(opened: OpenedFile, buffers, block_size: int, readers: ReadThreads) -> ReadAhead:
    layout = opened.layout
    return ReadAhead(
        opened.source, buffers, block_chunks(layout.data_offset, layout.data_length, block_size), readers
    )


def stream_data(
    opened: OpenedFile,
    buffers,
    block_size: int,
    hasher,
    deliver,
    progress,
    phase: Phase,
    readers: ReadThreads,
    wait_copies: Callable[[], None] | None = None,
) -> int:
    """Read the data section in blocks (the ``readers``, at most one block each in flight); on this
    thread, per block in file order, call deliver(view, segments) and hash it. Returns the bytes read from
    the file. ``wait_copies`` (an AsyncCopyTarget's): called before a delivered block's memory is reused
    or freed, and once at the end, also when the pass fails."""
    comp = opened.layout.compressed
    if comp is not None:
        try:
            return stream_frames(opened, comp, hasher, deliver, progress, phase, wait_copies)
        finally:
            if wait_copies is not None:
                wait_copies()
    layout = opened.layout
    blocks = iter_blocks(layout.extents, layout.data_length, block_size)
    reader, opened.ahead = opened.ahead or read_ahead(opened, buffers, block_size, readers), None
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


def stream_frames(
    opened: OpenedFile,
    comp: CompressedLayout,
    hasher,
    deliver,
    progress,
    phase: Phase,
    wait_copies: Callable[[], None] | None,
) -> int:
    """A compressed data section: frames are read and decoded by up to ``decode_workers()`` threads at once
    (zstd releases the GIL), each into exactly its block's size; in file order this thread hashes each
    frame's bytes as they are on disk and calls deliver(decoded, segments). A frame's failure is raised in
    file order, after every earlier block was delivered. The compression header and the block table were
    validated with the metadata; they are hashed here in file order."""
    layout = opened.layout
    codec = CODECS[comp.codec]
    workers = decode_workers()
    decoders: queue.SimpleQueue = queue.SimpleQueue()  # a decoder context is not thread-safe: one per task
    for _ in range(workers):
        decoders.put(codec.decoder(comp.block_size, opened.path))
    source = opened.source

    def read_and_decode(index: int, offset: int, size: int, expected: int) -> tuple[bytearray, bytes]:
        frame = bytearray(size)  # filled in place: no second copy of the frame
        source.read_into(memoryview(frame), offset, short_error=E.FileChanged)
        decode = decoders.get()
        try:
            return frame, decode(memoryview(frame), expected, index, offset)
        finally:
            decoders.put(decode)

    hasher.update(opened.section_head)
    work = enumerate(
        zip(comp.frames(), iter_blocks(layout.extents, layout.data_length, comp.block_size), strict=True)
    )
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
    for v in adapter_call(landing_views, layer, part, offset, length):
        mv = memoryview(v)
        if not mv.c_contiguous or mv.readonly:
            raise E.AdapterFailed("landing_views must return writable contiguous memoryviews")
        out.append(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv)
    if sum(len(v) for v in out) != length:
        raise E.AdapterFailed(
            f"landing_views returned {sum(len(v) for v in out)} bytes for a piece of {length}"
        )
    return out


def land_data(
    opened: OpenedFile, landing_views, block_size: int, hasher, progress, phase: Phase, readers: ReadThreads
) -> int:
    """Read the data section straight into the adapter's memory (``landing_views`` per piece), hashing each
    block there once it landed: the readers read blocks k+1..k+threads while this thread hashes
    block k (in file order). Returns the bytes read. No read is in flight once this returns or raises."""
    layout = opened.layout
    lander = ReadInto(opened.source, readers)
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
        for start, length, segments in iter_blocks(layout.extents, layout.data_length, block_size):
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


def hash_pass(opened: OpenedFile, buffers, block_size: int, progress, readers: ReadThreads) -> bytes:
    """The read pass over the data section: hash it (rule P1), the file unchanged meanwhile (P2)."""
    hasher = opened.pass_hasher()
    opened.bytes_read += stream_data(opened, buffers, block_size, hasher, None, progress, Phase.READ, readers)
    digest = check_digest(opened, hasher, "read pass")
    check_unchanged(opened, "during the read pass")
    return digest
