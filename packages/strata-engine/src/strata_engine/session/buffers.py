"""Host memory a SAVE / RESTORE works in, kept for the engine's life: the block buffers and the staging
area of a staged restore into host memory (fresh anonymous memory costs a page fault per page on first
touch, more than the read itself: bench/engine/DECISIONS.md "Kept host memory")."""

from __future__ import annotations

import mmap
import sys
from typing import Any

import numpy as np


class BlockBufferCache:
    """The block buffers (2 for a save, readers + 1 for a restore) and the staging area of a staged restore
    into host memory (K/V-sized; mapped on the first staged restore, reused by the next ones). The engine
    serves one command at a time, so one set is enough."""

    def __init__(self) -> None:
        self._buffers: list[memoryview] = []
        self._staging_map: mmap.mmap | None = None
        self._staging: np.ndarray | None = None

    def get(self, count: int, nbytes: int) -> list[memoryview]:
        """`count` buffers of `nbytes`. Grow-only: a buffer too small is replaced, missing ones are added,
        none is dropped, so a save (2 buffers) and a restore (one per reader thread + 1) alternate
        without allocating."""
        for i, b in enumerate(self._buffers[:count]):
            if len(b) < nbytes:
                self._buffers[i] = memoryview(bytearray(nbytes))
        while len(self._buffers) < count:
            self._buffers.append(memoryview(bytearray(nbytes)))
        return [b[:nbytes] for b in self._buffers[:count]]

    def staging(self, nbytes: int, reserve: int = 0) -> np.ndarray:
        """`nbytes` of the kept staging area; a larger area is mapped when it is too small (`reserve`: the
        size to map then, e.g. the pool's, so a deeper conversation later fits: only the pages a restore
        writes become resident)."""
        if self._staging is None or len(self._staging) < nbytes:
            self._staging = self._staging_map = None  # unmapped once the last view of it is gone
            size = max(nbytes, reserve, 1)
            # Normal pages: huge ones (MADV_HUGEPAGE) made a process's first staged restore 0.4-0.5 s (fresh 2 MiB
            # pages took 280-450 ms for 182 MB on first touch in a VM), later ones ~25 ms faster (bench/engine/DECISIONS.md "Kept host memory")
            self._staging_map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self._staging = np.frombuffer(self._staging_map, dtype=np.uint8)
        if nbytes > 0:  # faulted in with one call: ~0.7x a fault per page on first write
            assert self._staging_map is not None  # mapped with _staging, above or before
            _madvise(self._staging_map, _POPULATE_WRITE, nbytes)
        return self._staging[:nbytes]

    def staging_done(self) -> None:
        """After a staged restore: the kernel may take the staged pages back under memory pressure (MADV_FREE: the
        next restore populates them again, ~10 ms for 180 MB where they were kept)."""
        if self._staging_map is not None:
            _madvise(self._staging_map, getattr(mmap, "MADV_FREE", None))


def block_buffers(pool: Any, cache: BlockBufferCache | None, count: int, nbytes: int) -> list[memoryview]:
    """The library's block buffers for a SAVE / RESTORE on `pool`: the pool's pinned ones where it has them
    (its copies run as DMA), else the kept host ones (`cache`), else fresh memory."""
    if pool.capabilities.pinned_buffers:
        return pool.pinned_buffers(count, nbytes)
    if cache is not None:
        return cache.get(count, nbytes)
    return [memoryview(bytearray(nbytes)) for _ in range(count)]


# MADV_POPULATE_WRITE (Linux 5.14; Python names it from 3.12 on where the headers have it)
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None)


def _madvise(area: mmap.mmap, advice: int | None, nbytes: int = 0) -> None:
    """madvise over the whole area, or its first `nbytes`; an advice this system lacks (None) or its kernel
    refuses only costs speed."""
    if advice is None:
        return
    try:
        if nbytes:
            area.madvise(advice, 0, nbytes)
        else:
            area.madvise(advice)
    except OSError:
        pass
