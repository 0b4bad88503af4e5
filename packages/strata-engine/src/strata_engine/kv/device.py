"""K/V pools for the CuPy backend: in device memory, or in device-mapped pinned host memory.

* `DevicePool`: the pool buffer is device memory (the forward pass reads and writes it with kernels).
* `HostMappedPool`: the pool buffer is pinned host memory mapped into the device's address space
  (`cudaHostAlloc(..., cudaHostAllocMapped)`): kernels read and write it over PCIe (~51 GB/s on the
  H200 against ~4,000 GB/s for VRAM), the host reads and writes it with plain memcpy. It stands behind
  a `DeviceResidentRingPlacement` (`--kv-resident N`), whose ring is device memory: attention reads
  the ring's N most recent tokens from VRAM and streams older ones from the host pool.

Both keep `KVPool`'s layout and semantics (layer views, rings, extent). The host side of the engine
(the session adapter, ring checkpoints, the placement's refill) deals in host arrays: `read` returns
numpy copies, `write` takes numpy or device parts, and `host_layer(i)` gives the host pool's
slot-order numpy views for zero-copy I/O. Device work is ordered before any host access by a stream
synchronisation (the kernels that wrote mapped memory must have finished before the host reads it).
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Any

import numpy as np

from ..ops import Ops
from .layout import KVGeometry
from .placement import PoolPlacement, ResidentRingPlacement
from .pool import KVParts, KVPool, LayerKV, PoolArena, PoolCapabilities

CUDA_HOST_ALLOC_MAPPED = 2  # cudaHostAllocMapped


def _is_device_array(ops: Ops, arr: Any) -> bool:
    return arr is not None and isinstance(arr, ops.xp.ndarray) and ops.xp is not np


def _map_parts(parts: KVParts, fn: Any) -> KVParts:
    return KVParts(*(None if a is None else fn(a) for a in (parts.k, parts.v, parts.k_scale, parts.v_scale)))


class DevicePool(KVPool):
    """`KVPool` in device memory; `read` gives host copies, `write` accepts host or device parts."""

    capabilities = PoolCapabilities(device_staging=True, pinned_buffers=True)

    def __init__(self, geometry: KVGeometry, ops: Ops, arena: PoolArena | None = None, slot: int = 0):
        super().__init__(geometry, ops, arena, slot)
        self._pinned: list[Any] = []

    def read_device(self, i: int, lo: int, hi: int) -> KVParts:
        """Device copies of positions [lo, hi) of layer i in logical order."""
        return super().read(i, lo, hi)

    def read(self, i: int, lo: int, hi: int) -> KVParts:
        return _map_parts(self.read_device(i, lo, hi), self.ops.xp.asnumpy)

    def write(self, i: int, pos0: int, parts: KVParts) -> None:
        cp = self.ops.xp
        super().write(i, pos0, _map_parts(parts, cp.asarray))

    # ---- what the session adapter uses on the GPU ------------------------------------------------
    def pinned_buffers(self, count: int, nbytes: int) -> list[memoryview]:
        """Block buffers in pinned host memory: device<->host copies into them run as DMA at PCIe
        speed (~55 GB/s on the H200) instead of through the driver's pageable bounce buffer.
        Kept for the pool's life (the engine runs one SAVE or RESTORE at a time), so a restore pays
        neither the pinning nor the page faults of fresh buffers. Grow-only: a buffer too small is
        replaced, missing ones are added, none is dropped, so a save (2 buffers) and a restore (one per
        reader thread + 1, maybe smaller) alternate without pinning anything again."""
        import cupyx

        def pin() -> Any:
            b = cupyx.empty_pinned((nbytes,), dtype=np.uint8)
            b.fill(0)  # fault the pages in now
            return b

        for i, b in enumerate(self._pinned[:count]):
            if b.nbytes < nbytes:
                self._pinned[i] = pin()
        while len(self._pinned) < count:
            self._pinned.append(pin())
        return [memoryview(b[:nbytes]) for b in self._pinned[:count]]

    def staging_array(self, nbytes: int) -> Any:
        """A device byte array for a staged restore (the file's K/V lands in VRAM while it is hashed)."""
        return self.ops.xp.empty(nbytes, dtype=self.ops.xp.uint8)

    def device_free_bytes(self) -> int:
        cp = self.ops.xp
        free, _ = cp.cuda.runtime.memGetInfo()
        return int(free) + int(cp.get_default_memory_pool().free_bytes())


class MappedHostBuffer:
    """`nbytes` of pinned, device-mapped host memory seen as a cupy array (`device`) and a numpy
    array (`host`) over the same bytes. Freed with cudaFreeHost when this object is collected."""

    def __init__(self, nbytes: int):
        import cupy as cp

        self.nbytes = nbytes
        ptr = cp.cuda.runtime.hostAlloc(max(nbytes, 1), CUDA_HOST_ALLOC_MAPPED)
        self._finalizer = weakref.finalize(self, cp.cuda.runtime.freeHost, ptr)
        self.ptr = ptr
        mem = cp.cuda.UnownedMemory(ptr, max(nbytes, 1), self, cp.cuda.Device().id)
        self.device = cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
        self.host = np.frombuffer(
            memoryview((ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr)), dtype=np.uint8
        )[:nbytes]


class HostMappedPool(KVPool):
    """`KVPool` whose buffer is device-mapped pinned host memory (see the module docstring); the arena's
    memory is one `MappedHostBuffer`, each slot's views carved from its device and its host side."""

    def __init__(self, geometry: KVGeometry, ops: Ops, arena: PoolArena | None = None, slot: int = 0):
        super().__init__(geometry, ops, arena, slot)  # the device views (`_flat`: the mapping's device side)
        self.mapped = self.arena.memory
        self.host_buffer = self.mapped.host
        self._host_layers = self.arena.layout.carve(self.mapped.host, slot)

    @staticmethod
    def allocate(ops: Ops, nbytes: int) -> MappedHostBuffer:
        mapped = MappedHostBuffer(nbytes)
        mapped.host[:] = 0
        return mapped

    @staticmethod
    def _flat(memory: MappedHostBuffer) -> Any:
        return memory.device

    def host_layer(self, i: int) -> LayerKV:
        """Layer i's slot-order numpy views of the host pool (synchronise before reading them)."""
        return self._host_layers[i]

    def io_layer(self, i: int) -> LayerKV:
        """Session files are copied to and from the host side (`host_layer`): plain memcpy, no device call."""
        return self._host_layers[i]

    def read_device(self, i: int, lo: int, hi: int) -> KVParts:
        """Device copies of positions [lo, hi) of layer i in logical order, read through the mapping (DMA over
        PCIe from the pinned pool: no host copy, no pageable upload; bench/gpu/DECISIONS.md "Work kept on the device")."""
        return super().read(i, lo, hi)

    def read(self, i: int, lo: int, hi: int) -> KVParts:
        self._check_range(i, lo, hi, writing=False)
        self.ops.synchronize()
        layer = self._host_layers[i]
        spans = self._spans(i, lo, hi)

        def take(arr: Any) -> Any:
            if arr is None:
                return None
            if not spans:
                return arr[0:0].copy()
            return np.concatenate([arr[a:b] for a, b, _ in spans])

        return KVParts(take(layer.k), take(layer.v), take(layer.k_scale), take(layer.v_scale))

    def write(self, i: int, pos0: int, parts: KVParts) -> None:
        if _is_device_array(self.ops, parts.k):
            super().write(i, pos0, parts)  # kernels write through the mapping
            return
        # Host parts (a restore, a checkpoint): memcpy on the host, after queued device writes.
        self.ops.synchronize()
        device_layers = self._layers
        self._layers = self._host_layers  # KVPool.write validates and copies into these views
        try:
            super().write(i, pos0, _map_parts(parts, np.asarray))
        finally:
            self._layers = device_layers


class DevicePoolPlacement(PoolPlacement):
    """`PoolPlacement` over a `DevicePool` that hands attention the pool's own storage where it can.

    A full-attention layer of a float K/V type keeps position p in slot p, so the keys and values a
    chunk attends to are a contiguous slice of the pool: the new K/V are stored with one casting copy
    each and the slice [context_start, end) is returned as it is stored (f16 or f32; attention reads
    it in float32). That skips the per-step gather into compute-dtype copies, the separate encode
    and decode of the new rows (each a kernel launch per layer and token, which is most of a decode
    step's cost on a model this small). Values are the same as the generic path's: f16 -> f32 is
    exact, and the store rounds as `KVCodec.encode` does.

    A ring layer (sliding window) is attended in place too when the chunk cannot overwrite a key its
    own first query still sees (T <= capacity - window + 1: every decode step, chunks up to 513 tokens
    for a 512 window in a 1,024-slot ring): the new K/V go to their slots and attention addresses the
    ring by position % capacity. A longer chunk attends a context made of the ring's last window - 1
    keys before it and its own K/V stored in the pool's type (`_attend_long_ring_chunk`). int8 takes the
    generic path (gather, then write)."""

    def attend(
        self,
        layer: int,
        pos0: int,
        q: Any | None,
        k_new: Any,
        v_new: Any,
        *,
        q_pos0: int,
        window: int | None,
        scale: float,
        softcap: float,
    ) -> Any | None:
        g = self.pool.geometry.layers[layer]
        n_new = k_new.shape[0]
        if g.window is None or self.pool.geometry.has_scales:  # not a ring
            return super().attend(
                layer, pos0, q, k_new, v_new, q_pos0=q_pos0, window=window, scale=scale, softcap=softcap
            )
        if n_new > g.capacity - g.window + 1:
            return self._attend_long_ring_chunk(layer, pos0, q, k_new, v_new, q_pos0, window, scale, softcap)
        views = self.pool.layer(layer)
        self.ops.store_kv(k_new, v_new, views.k, views.v, pos0, ring_capacity=g.capacity)  # rounds as encode
        if q is None:
            return None
        return self.ops.attention(
            q,
            views.k,
            views.v,
            q_pos0=q_pos0,
            k_pos0=self.context_start(layer, pos0),
            window=window,
            scale=scale,
            softcap=softcap,
            ring_capacity=g.capacity,
        )

    def _attend_long_ring_chunk(
        self,
        layer: int,
        pos0: int,
        q: Any | None,
        k_new: Any,
        v_new: Any,
        q_pos0: int,
        window: int | None,
        scale: float,
        softcap: float,
    ) -> Any | None:
        """A ring layer's chunk too long to attend in place (its stores would overwrite keys its first
        queries still see). The context [lo, pos0 + T) is made in the pool's storage type: the ring's
        keys [lo, pos0) copied out first (at most window - 1 rows, two slices where the ring wraps),
        then the chunk's K/V stored after them by the same rounding kernel as the pool's; the chunk's
        last `capacity` rows then go to the ring. Attention reads the stored type (f16) directly: the
        same values the generic path decodes, without its encode / decode / gather copies."""
        g = self.pool.geometry.layers[layer]
        views = self.pool.layer(layer)
        xp, cap = self.ops.xp, g.capacity
        n_new = k_new.shape[0]
        lo = self.context_start(layer, pos0)
        n_old = pos0 - lo
        k_ctx = xp.empty((n_old + n_new, *views.k.shape[1:]), dtype=views.k.dtype)
        v_ctx = xp.empty((n_old + n_new, *views.v.shape[1:]), dtype=views.v.dtype)
        if n_old:  # positions [lo, pos0) sit in slots lo % cap ..., wrapping at most once (n_old < cap)
            first = lo % cap
            head = min(n_old, cap - first)
            for ctx, ring in ((k_ctx, views.k), (v_ctx, views.v)):
                ctx[:head] = ring[first : first + head]
                if head < n_old:
                    ctx[head:n_old] = ring[: n_old - head]
        self.ops.store_kv(k_new, v_new, k_ctx, v_ctx, n_old)  # rounds as encode, as into the pool
        keep = min(n_new, cap)  # earlier rows of the chunk would be overwritten by its later ones
        self.ops.store_kv(k_new[n_new - keep :], v_new[n_new - keep :], views.k, views.v, pos0 + n_new - keep,
                          ring_capacity=cap)  # fmt: skip
        if q is None:
            return None
        return self.ops.attention(
            q, k_ctx, v_ctx, q_pos0=q_pos0, k_pos0=lo, window=window, scale=scale, softcap=softcap
        )

    def attend_kv(self, layer: int, pos0: int, k_new: Any, v_new: Any) -> tuple[Any, Any, int]:
        g = self.pool.geometry.layers[layer]
        if g.is_ring or self.pool.geometry.has_scales:
            return super().attend_kv(layer, pos0, k_new, v_new)
        end = pos0 + k_new.shape[0]
        views = self.pool.layer(layer)
        self.ops.store_kv(k_new, v_new, views.k, views.v, pos0)  # rounds to nearest, as encode does
        lo = self.context_start(layer, pos0)
        return views.k[lo:end], views.v[lo:end], lo


class DeviceResidentRingPlacement(ResidentRingPlacement):
    """`ResidentRingPlacement` with the ring in VRAM (a `DevicePool`) in front of a `HostMappedPool`.

    Reads of positions the ring holds come from VRAM; older positions stream from the host pool
    through the mapping. `refill()` (after a restore or a checkpoint restore) resets every layer's
    ring from the host pool, exactly as the CPU placement does."""

    resident_pool_type = DevicePool
