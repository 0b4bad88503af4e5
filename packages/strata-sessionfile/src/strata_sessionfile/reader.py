"""inspect() and restore(): open a session file's byte source (a local path, or any ``seam.ByteSource``
such as ``objstore.S3Source``), run the read pass, choose and run an apply mode.

Read pass (spec "Reading"): ``validate.open_metadata`` checks everything before the data section (size,
header and its hash, both fingerprints, the metadata, the layout, the padding, the end marker, the
engine's exact limits), then a RAM preflight, then ``datapass.hash_pass`` streams the data section,
hashing it without keeping it, and compares with the trailer; the file must not have changed meanwhile.
The apply modes (streaming: a second pass behind the gate; staged: one pass into a staging area) are in
``apply``. A compressed data section (spec 3.3) is read frame by frame by every pass, each frame hashed as
stored and decoded into exactly its block's size, so a frame that would fail to decode is refused before
the gate.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import attrs

from . import errors as E
from . import memory, pipelines
from .adapter import LandingTarget, SessionTarget, StagingTarget, adapter_call
from .apply import apply_staged, apply_streaming
from .auth import SessionKey, as_key
from .datapass import hash_pass, read_ahead
from .format import DEFAULT_BLOCK_SIZE
from .memory import MIN_BLOCK_SIZE, BlockBuffers, block_buffers
from .pipelines import ReadThreads
from .records import (
    EngineIdentity,
    EngineLimits,
    Inspection,
    Progress,
    RestoreMode,
    RestorePlan,
    RestoreReport,
)
from .seam import ByteSource, open_source
from .validate import open_metadata, preflight


def _auth(key: SessionKey | bytes | None, require_mac: bool | None) -> tuple[SessionKey | None, bool]:
    """The reader's key and whether it accepts only authenticated files (by default: when it has a key)."""
    key = as_key(key)
    require = key is not None if require_mac is None else require_mac
    if require and key is None:
        raise ValueError("require_mac needs a key")
    return key, require


def _readers(read_threads: int | ReadThreads | None, target) -> tuple[ReadThreads, bool]:
    """The threads a call reads with, and whether the call made them (and closes them). Unnamed: the
    default, or more for a source whose reads wait on the network (its ``read_threads``)."""
    if isinstance(read_threads, ReadThreads):
        return read_threads, False
    if read_threads is None:
        read_threads = max(pipelines.default_read_threads(), getattr(target, "read_threads", 1))
    return ReadThreads(read_threads), True


def inspect(
    path: str | os.PathLike | ByteSource,
    *,
    verify: bool = True,
    identity: EngineIdentity | None = None,
    limits: EngineLimits | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    read_threads: int | ReadThreads | None = None,
    key: SessionKey | bytes | None = None,
    require_mac: bool | None = None,
) -> Inspection:
    """The read pass alone: validate the file (and, if given, its binding to an engine) without applying it.

    ``path``: a local file, or a ``ByteSource`` (e.g. ``objstore.S3Source``; the caller's, not closed here).
    ``read_threads``: threads reading the file at once (None: ``default_read_threads()``), or a
    ``ReadThreads`` to read with (kept open). ``key``: verify the file's MAC (rules K1-K3; K4 with ``verify``);
    ``require_mac`` (default: True when a key is given) refuses a file without one."""
    key, require = _auth(key, require_mac)
    readers, own_readers = _readers(read_threads, path)
    try:
        source, own_source = open_source(path)
        try:
            opened = open_metadata(
                source,
                identity,
                limits,
                readers,
                require_codec=verify,
                hash_prefix=verify,
                key=key,
                require_mac=require,
            )
            digest = None
            if verify:
                views = (
                    BlockBuffers(block_size, readers.threads + 1).views
                    if opened.layout.compressed is None
                    else None
                )
                digest = hash_pass(opened, views, block_size, None, readers)
            info = Inspection(
                source.path,
                opened.header,
                opened.metadata,
                opened.layout,
                verify,
                digest,
                opened.auth_digest is not None,
            )
            return attrs.evolve(info, key_id=bytes(opened.trailer[16:32])) if info.authenticated else info
        finally:
            if own_source:
                source.close()
    finally:
        if own_readers:
            readers.close()


def restore(
    path: str | os.PathLike | ByteSource,
    adapter: SessionTarget,
    *,
    mode: RestoreMode | str = RestoreMode.AUTO,
    block_size: int = DEFAULT_BLOCK_SIZE,
    progress: Callable[[Progress], None] | None = None,
    memory_available: Callable[[], int | None] | None = memory.memory_available,
    buffers: BlockBuffers | None = None,
    read_threads: int | ReadThreads | None = None,
    key: SessionKey | bytes | None = None,
    require_mac: bool | None = None,
) -> RestoreReport:
    """Validate ``path`` against the adapter's engine and apply it (see the module docstring).

    ``path``: a local file, or a ``ByteSource`` (e.g. ``objstore.S3Source``, whose object version is pinned
    from the read pass on; the caller's, not closed here).
    ``buffers``: block buffers to reuse (else the adapter's, if it is a BufferProvider, else fresh ones).
    ``memory_available``: a probe of the free RAM in bytes for the preflight (None skips it).
    ``read_threads``: threads reading the file at once (None: ``default_read_threads()``), or a
    ``ReadThreads`` to read with (kept open: an engine that restores often starts its threads once);
    blocks are still hashed and delivered in file order, on the calling thread. Block buffers: the readers
    + 1 (given ``buffers`` with fewer views mean fewer reads at once). A compressed data section uses its
    decode workers instead.
    ``key`` (a ``SessionKey`` or its 32 bytes): the file's MAC is checked before anything reaches the adapter
    and its payload digest in every pass (spec 4.1); ``require_mac`` (default: True when a key is given)
    refuses a file without a MAC. Without a key, an authenticated file restores like any other.
    """
    if block_size < MIN_BLOCK_SIZE:
        raise ValueError(f"block_size must be at least {MIN_BLOCK_SIZE}")
    auth = _auth(key, require_mac)
    readers, own_readers = _readers(read_threads, path)
    try:
        return _restore(
            path, adapter, RestoreMode(mode), block_size, progress, memory_available, buffers, readers, auth
        )
    finally:
        if own_readers:
            readers.close()


def _restore(
    path,
    adapter: SessionTarget,
    mode: RestoreMode,
    block_size: int,
    progress,
    memory_available,
    buffers: BlockBuffers | None,
    readers: ReadThreads,
    auth: tuple[SessionKey | None, bool],
) -> RestoreReport:
    threads = readers.threads
    t0 = time.perf_counter()
    identity = adapter_call(adapter.identity)
    limits = adapter_call(adapter.limits)
    source, own_source = open_source(path)
    path = source.path
    opened = None
    try:
        opened = open_metadata(source, identity, limits, readers, key=auth[0], require_mac=auth[1])
        preflight(opened, block_size, threads + 1, memory_available)
        stager: StagingTarget | None = None  # the adapter, where it stages this session
        if mode is not RestoreMode.STREAMING and isinstance(adapter, StagingTarget):
            probe = RestorePlan(
                path, opened.header, opened.metadata, opened.layout, opened.stamp, RestoreMode.STAGED
            )
            if adapter_call(adapter.can_stage, probe):
                stager = adapter
        if mode is RestoreMode.STAGED and stager is None:
            raise E.StagingUnavailable(
                "staged restore requested but the adapter cannot stage this session", path=path
            )
        plan = RestorePlan(
            path,
            opened.header,
            opened.metadata,
            opened.layout,
            opened.stamp,
            RestoreMode.STAGED if stager is not None else RestoreMode.STREAMING,
        )
        # Zero-copy: the adapter's memory takes the bytes straight from the file (never compressed data).
        lander = (
            adapter
            if opened.layout.compressed is None
            and isinstance(adapter, LandingTarget)
            and adapter_call(adapter.can_land, plan)
            else None
        )
        if opened.layout.compressed is not None or (stager is not None and lander is not None):
            views = None  # decode workers read frames into their own buffers; landing needs none
        else:
            views = block_buffers(adapter, block_size, buffers, threads + 1)
            # Read the first blocks while the engine checks the plan: the pass starts on blocks in memory.
            opened.ahead = read_ahead(opened, views, block_size, readers).start()
        if stager is not None:
            adapter_call(stager.check_plan, plan)
            t_read = time.perf_counter()
            apply_staged(opened, stager, plan, views, block_size, progress, lander, readers)
        else:
            hash_pass(opened, views, block_size, progress, readers)
            adapter_call(adapter.check_plan, plan)
            t_read = time.perf_counter()
            apply_streaming(opened, adapter, plan, views, block_size, progress, lander, readers)
        t_end = time.perf_counter()
        return RestoreReport(
            path,
            plan.mode,
            plan.state.n_tokens,
            opened.bytes_read,
            opened.stamp.size,
            t_end - t0,
            t_read - t0,
            t_end - t_read,
        )
    finally:
        if opened is not None and opened.ahead is not None:  # a refusal before the first pass: stop its reads
            opened.ahead.close()
        if own_source:
            source.close()
