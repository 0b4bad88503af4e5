"""One anonymous mapping that holds a model's packed weights, advised to be backed by 2 MiB pages.

A decode step streams every weight from memory once. Packed one by one, most weights are numpy arrays under
numpy's 4 MiB huge-page threshold, on 4 KiB pages: the hardware prefetcher stops at every page boundary and
every page costs a TLB miss. In one mapping with MADV_HUGEPAGE (Linux's transparent huge pages, where the
system allows them) SmolLM2's decode ran ~4 % faster, paired in one process (bench/engine/DECISIONS.md,
"Weights on huge pages").
"""

from __future__ import annotations

import mmap

import numpy as np

from .packed import PackedWeight

ALIGN = 64  # a cache line: no vector load of a weight row straddles two for want of alignment


class WeightArena:
    """Bump allocation in a reserved anonymous mapping (untouched pages cost nothing); a weight that no
    longer fits keeps its own arrays."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0
        self._map = mmap.mmap(-1, max(capacity, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux only; elsewhere the arena is one mapping of normal pages
            self._map.madvise(mmap.MADV_HUGEPAGE)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)

    def array(self, a: np.ndarray) -> np.ndarray:
        """A C-contiguous copy of `a` in the arena (the views keep the mapping alive), or `a` itself."""
        start = -(-self.used // ALIGN) * ALIGN
        if start + a.nbytes > self.capacity:
            return a
        out = self._bytes[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
        out[...] = a
        self.used = start + a.nbytes
        return out

    def weight(self, w: PackedWeight) -> PackedWeight:
        """The packed weight with its arrays in the arena."""
        mins = None if w.min is None else self.array(w.min)
        high = None if w.high is None else self.array(w.high)
        return PackedWeight(self.array(w.values), self.array(w.scale), mins, w.block, w.tiled, high)
