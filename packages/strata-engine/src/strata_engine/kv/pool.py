"""The K/V pool: one preallocated buffer carved into per-layer K, V (and int8 scale) views.

The buffer (`PoolArena`) holds every slot's pool: each part of each layer is [n_slots, capacity, ...] and a
slot's `KVPool` sees its own [capacity, ...] row of each (`PoolLayout`); everything below is per slot.

Storage is token-major: layer i's K is ``[capacity, Hkv, D]`` of the K/V type, so a token range is a
contiguous slice (or two, for a ring that wraps). Full layers map position p to slot p; sliding-window
layers to slot p % capacity.

Running extent (shared by all layers):
  * `n_tokens`: positions [0, n_tokens) are evaluated and held;
  * `ring_start`: the lowest position every ring layer still holds (n_tokens - ring_start <= capacity);
    0 for a model without rings. A full layer holds [0, n_tokens); a ring layer [ring_start, n_tokens).

Positions beyond `n_tokens` may hold stale bytes; nothing reads them.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from ..errors import KVStateError
from ..ops import Ops
from .layout import SCALE_DTYPE, KVGeometry, LayerGeometry

_ALIGN = 64


@attrs.frozen(eq=False)
class KVParts:
    """Encoded K/V of a token range in logical order: k, v ``[n, Hkv, D]`` of the storage dtype; for
    int8, k_scale and v_scale ``[n, Hkv, D / scale_block]`` float32 (value = int8 * scale of its
    block of `scale_block` values along D), else None."""

    k: Any
    v: Any
    k_scale: Any = None
    v_scale: Any = None

    @property
    def n_tokens(self) -> int:
        return int(self.k.shape[0])

    def arrays(self) -> tuple[Any, ...]:
        return tuple(a for a in (self.k, self.v, self.k_scale, self.v_scale) if a is not None)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays())


@attrs.frozen(eq=False)
class LayerKV:
    """One layer's storage in slot order (views into the pool buffer)."""

    geometry: LayerGeometry
    k: Any
    v: Any
    k_scale: Any
    v_scale: Any

    def slot_arrays(self) -> tuple[Any, ...]:
        return tuple(a for a in (self.k, self.v, self.k_scale, self.v_scale) if a is not None)


def wrap_spans(first: int, n: int, period: int) -> list[tuple[int, int, int]]:
    """A run of n consecutive units starting at unit `first` of a circular buffer of `period` units
    (n <= period) as (lo, hi, offset into the run) spans: none, one, or two where it wraps."""
    assert 0 <= n <= period
    if n == 0:
        return []
    s0 = first % period
    if s0 + n <= period:
        return [(s0, s0 + n, 0)]
    head = period - s0
    return [(s0, period, 0), (0, n - head, head)]


def ring_spans(lo: int, hi: int, capacity: int) -> list[tuple[int, int, int]]:
    """Positions [lo, hi) (hi - lo <= capacity) as (slot_lo, slot_hi, offset into the range) spans."""
    return wrap_spans(lo, hi - lo, capacity)


def ring_byte_spans(
    start: int, offset: int, length: int, capacity: int, row_bytes: int
) -> list[tuple[int, int, int]]:
    """Bytes [offset, offset + length) of a part whose logical byte 0 is position `start` (a ring's
    oldest held token; 0 for a full layer), in `capacity` slots of `row_bytes` each, as (slot byte lo,
    slot byte hi, offset into the range) spans: at most two contiguous copies."""
    return wrap_spans(start * row_bytes + offset, length, capacity * row_bytes)


@attrs.frozen
class PoolCapabilities:
    """What a pool offers the session adapter beyond KVPool's own methods, declared per pool type."""

    # `staging_array(nbytes)` gives device memory for a staged restore, bounded by `device_free_bytes()`;
    # without it a staged restore lands in host memory
    device_staging: bool = False
    # `pinned_buffers(count, nbytes)` gives the block buffers (pinned: the pool's copies read them by DMA)
    pinned_buffers: bool = False


class KVCodec:
    """Encode compute-dtype K/V to the storage type and decode it back (int8 through `ops`)."""

    def __init__(self, geometry: KVGeometry, ops: Ops):
        self.storage_dtype = geometry.storage_dtype
        self.has_scales = geometry.has_scales
        self.ops = ops
        self.scale_block = geometry.scale_block

    def encode(self, k: Any, v: Any) -> KVParts:
        if self.has_scales:
            kq, ks = self.ops.quantize_int8(k, self.scale_block)
            vq, vs = self.ops.quantize_int8(v, self.scale_block)
            return KVParts(kq, vq, ks, vs)
        return KVParts(k.astype(self.storage_dtype), v.astype(self.storage_dtype))

    def decode_into(self, parts: KVParts, k_out: Any, v_out: Any) -> None:
        if self.has_scales:
            k_out[...] = self.ops.dequantize_int8(parts.k, parts.k_scale)
            v_out[...] = self.ops.dequantize_int8(parts.v, parts.v_scale)
        else:
            k_out[...] = parts.k
            v_out[...] = parts.v


@attrs.frozen(eq=False)
class PoolLayout:
    """Where every slot's parts lie in one buffer holding the pools of `n_slots` slots of one geometry.

    Layer-major: each part of each layer is one array [n_slots, capacity, ...] (64-byte aligned), so a
    slot's region of a layer is a contiguous [capacity, ...] view and the slots of a layer sit at one
    stride (what a kernel batched over slots reads)."""

    geometry: KVGeometry
    n_slots: int
    parts: tuple[tuple[tuple[int, tuple[int, ...], np.dtype], ...], ...]  # per layer: (offset, shape, dtype)
    nbytes: int

    @classmethod
    def of(cls, geometry: KVGeometry, n_slots: int) -> PoolLayout:
        layers, total = [], 0
        sdt = geometry.storage_dtype
        for g in geometry.layers:
            shapes = [((n_slots, g.capacity, *g.row_shape), sdt)] * 2
            if geometry.has_scales:
                shapes += [((n_slots, g.capacity, *g.scale_shape), SCALE_DTYPE)] * 2
            parts = []
            for shape, dt in shapes:
                parts.append((total, shape, dt))
                total += -(-int(np.prod(shape)) * dt.itemsize // _ALIGN) * _ALIGN
            layers.append(tuple(parts))
        return cls(geometry, n_slots, tuple(layers), total)

    def carve(self, flat: Any, slot: int) -> list[LayerKV]:
        """Slot `slot`'s per-layer views into `flat` (a uint8 array of `nbytes`: host or device)."""
        assert 0 <= slot < self.n_slots
        out = []
        for g, parts in zip(self.geometry.layers, self.parts, strict=True):
            arrays = [
                flat[o : o + int(np.prod(shape)) * dt.itemsize].view(dt).reshape(shape)[slot]
                for o, shape, dt in parts
            ]
            out.append(LayerKV(g, *arrays, *([None, None] if len(arrays) == 2 else [])))
        return out

    def slot_bytes(self) -> int:
        """Bytes one slot's region takes (its share of every layer's parts)."""
        return sum(int(np.prod(shape[1:])) * dt.itemsize for parts in self.parts for _, shape, dt in parts)


class PoolArena:
    """The one preallocated buffer of every slot's pool (`layout`); made by the pool type that carves it
    (`KVPool.allocate`: device memory, host memory, or device-mapped host memory)."""

    def __init__(self, pool_type: type[KVPool], geometry: KVGeometry, ops: Ops, n_slots: int):
        self.pool_type = pool_type
        self.layout = PoolLayout.of(geometry, n_slots)
        self.memory = pool_type.allocate(ops, self.layout.nbytes)

    @property
    def n_slots(self) -> int:
        return self.layout.n_slots

    def pools(self, ops: Ops) -> list[KVPool]:
        """One pool per slot, each over its own region of the buffer."""
        return [self.pool_type(self.layout.geometry, ops, arena=self, slot=s) for s in range(self.n_slots)]


class KVPool:
    """A slot's K/V: per-layer views into its region of one preallocated buffer (`PoolArena`, shared by
    every slot; a pool made alone gets an arena of one slot); the authoritative K/V of its conversation."""

    capabilities = PoolCapabilities()

    def __init__(self, geometry: KVGeometry, ops: Ops, arena: PoolArena | None = None, slot: int = 0):
        if arena is None:
            arena = PoolArena(type(self), geometry, ops, 1)
        if arena.layout.geometry != geometry:
            raise KVStateError("the arena was laid out for another K/V geometry")
        self.geometry = geometry
        self.ops = ops
        self.codec = KVCodec(geometry, ops)
        self.arena = arena
        self.slot = slot
        self.nbytes = arena.layout.slot_bytes()
        self.buffer = self._flat(arena.memory)  # every slot's bytes: write only through this slot's views
        self._layers: list[LayerKV] = arena.layout.carve(self.buffer, slot)
        self._n_tokens = 0
        self._ring_start = 0
        self._pending_ring_start: int | None = None
        self._part_bytes: dict[tuple[int, str], Any] = {}
        self._arena_layers: dict[int, list[Any]] = {}

    @staticmethod
    def allocate(ops: Ops, nbytes: int) -> Any:
        """The arena's memory: zeroed backend memory."""
        return ops.xp.zeros(nbytes, dtype=ops.xp.uint8)

    @staticmethod
    def _flat(memory: Any) -> Any:
        """The arena's memory as the flat uint8 array the forward pass reads."""
        return memory

    # ---- extent --------------------------------------------------------------------------------
    @property
    def n_tokens(self) -> int:
        return self._n_tokens

    @property
    def ring_start(self) -> int:
        return self._ring_start

    def layer(self, i: int) -> LayerKV:
        return self._layers[i]

    def arena_layer(self, i: int) -> list[Any]:
        """Layer i's parts (K, V, and with int8 their scales) of every slot of the arena, [n_slots, capacity,
        ...] each: what a kernel batched over slots reads and writes, slot `pool.slot` at index pool.slot."""
        if i not in self._arena_layers:  # views made once: a batched step asks for them every layer (~20 us)
            self._arena_layers[i] = [
                self.buffer[o : o + int(np.prod(shape)) * dt.itemsize].view(dt).reshape(shape)
                for o, shape, dt in self.arena.layout.parts[i]
            ]
        return self._arena_layers[i]

    def io_layer(self, i: int) -> LayerKV:
        """Layer i's arrays that session files are copied to and from: here the pool's own."""
        return self._layers[i]

    def part_bytes(self, i: int, attr: str) -> Any:
        """Layer i's `attr` part ("k", "v", "k_scale", "v_scale") of `io_layer(i)` as one flat byte array over
        the same memory, or None where the part does not exist. Made once per pool: a device view costs
        tens of microseconds to make."""
        key = (i, attr)
        if key not in self._part_bytes:
            arr = getattr(self.io_layer(i), attr)
            self._part_bytes[key] = None if arr is None else arr.reshape(-1).view(np.uint8)
        return self._part_bytes[key]

    def warm(self) -> None:
        """Start-up work a first SAVE/RESTORE would otherwise pay: every part's flat byte view, and, for a
        host pool that holds nothing, its pages faulted in (allocated lazily zeroed, a restored
        conversation would pay a page fault per page it lands; writing zeros changes no state)."""
        for i in range(self.geometry.n_layers):
            for attr in ("k", "v", "k_scale", "v_scale"):
                self.part_bytes(i, attr)
        if isinstance(self.buffer, np.ndarray) and self._n_tokens == 0:
            for i in range(self.geometry.n_layers):
                for arr in self._layers[i].slot_arrays():
                    arr.fill(0)  # this slot's region only: the others may hold conversations

    def held_range(self, i: int) -> tuple[int, int]:
        """Positions [start, end) layer i holds, in logical order."""
        g = self.geometry.layers[i]
        return (self._ring_start if g.is_ring else 0, self._n_tokens)

    def can_resume(self, r: int) -> bool:
        """Whether the pool alone can continue from position r (0 <= r <= n_tokens): every ring layer
        must still hold the window-1 positions before r."""
        if not 0 <= r <= self._n_tokens:
            return False
        window = self.geometry.max_window
        if window is None or r == 0:
            return True
        return max(0, r - window + 1) >= self._ring_start

    def truncate(self, r: int) -> None:
        """Drop positions >= r (r must be a resume point)."""
        if not self.can_resume(r):
            raise KVStateError(f"cannot resume the K/V pool at position {r} (held {self.held_summary()})")
        if r == 0:
            self.reset()
        self._n_tokens = r

    def reset(self) -> None:
        self._n_tokens = 0
        self._ring_start = 0

    def set_extent(self, n_tokens: int, ring_start: int) -> None:
        """Declare what the pool holds after K/V was written into it directly (restore paths)."""
        problems = []
        if not 0 <= n_tokens <= self.geometry.n_ctx:
            problems.append(f"n_tokens {n_tokens} outside [0, {self.geometry.n_ctx}]")
        cap = self.geometry.ring_capacity
        if cap is None:
            if ring_start != 0:
                problems.append(f"ring_start {ring_start} given for a pool without rings")
        elif not (0 <= ring_start <= n_tokens and n_tokens - ring_start <= cap):
            problems.append(
                f"ring_start {ring_start} invalid for n_tokens {n_tokens} and ring capacity {cap}"
            )
        if problems:
            raise KVStateError("; ".join(problems))
        self._n_tokens = n_tokens
        self._ring_start = ring_start

    def held_summary(self) -> str:
        return f"n_tokens={self._n_tokens}, ring_start={self._ring_start}"

    # ---- appends (the forward pass writes positions [n_tokens, n_tokens + n)) -------------------
    def begin_append(self, pos0: int, n: int) -> None:
        if pos0 != self._n_tokens:
            raise KVStateError(f"append at position {pos0} but the pool holds {self._n_tokens} tokens")
        if pos0 + n > self.geometry.n_ctx:
            raise KVStateError(f"append of {n} tokens at {pos0} exceeds the context {self.geometry.n_ctx}")
        cap = self.geometry.ring_capacity
        self._pending_ring_start = self._ring_start if cap is None else max(self._ring_start, pos0 + n - cap)

    def commit_append(self, n: int) -> None:
        assert self._pending_ring_start is not None
        self._n_tokens += n
        self._ring_start = self._pending_ring_start
        self._pending_ring_start = None

    def abort_append(self) -> None:
        """After a failed forward: positions >= n_tokens are garbage and the rings may have been
        overwritten up to the pending start, so n_tokens may no longer be a resume point (the runner
        then falls back to a checkpoint or to 0; see `can_resume`)."""
        if self._pending_ring_start is not None:
            self._ring_start = min(self._pending_ring_start, self._n_tokens)
            self._pending_ring_start = None

    # ---- token-range reads and writes (logical order) -------------------------------------------
    def _spans(self, i: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
        g = self.geometry.layers[i]
        return ring_spans(lo, hi, g.capacity) if g.is_ring else ([(lo, hi, 0)] if hi > lo else [])

    def _check_range(self, i: int, lo: int, hi: int, *, writing: bool) -> None:
        if not 0 <= i < self.geometry.n_layers:
            raise KVStateError(f"layer {i} outside [0, {self.geometry.n_layers})")
        g = self.geometry.layers[i]
        if not 0 <= lo <= hi <= self.geometry.n_ctx:
            raise KVStateError(
                f"layer {i}: token range [{lo}, {hi}) outside the context {self.geometry.n_ctx}"
            )
        if g.is_ring and hi - lo > g.capacity:
            raise KVStateError(f"layer {i}: token range [{lo}, {hi}) is longer than the ring ({g.capacity})")

    def read(self, i: int, lo: int, hi: int) -> KVParts:
        """Copies of the encoded K/V of positions [lo, hi) of layer i, in logical order."""
        self._check_range(i, lo, hi, writing=False)
        layer = self._layers[i]
        spans = self._spans(i, lo, hi)
        xp = self.ops.xp

        def take(arr: Any) -> Any:
            if arr is None:
                return None
            if len(spans) == 1:
                return arr[spans[0][0] : spans[0][1]].copy()
            if not spans:
                return arr[0:0].copy()
            return xp.concatenate([arr[a:b] for a, b, _ in spans])

        return KVParts(take(layer.k), take(layer.v), take(layer.k_scale), take(layer.v_scale))

    def read_device(self, i: int, lo: int, hi: int) -> KVParts:
        """Copies of positions [lo, hi) of layer i in the backend's own arrays (what stays beside the pool,
        as checkpoints do); a host pool's are `read`'s."""
        return self.read(i, lo, hi)

    def write(self, i: int, pos0: int, parts: KVParts) -> None:
        """Store encoded K/V for positions [pos0, pos0 + n) of layer i (a ring keeps the last capacity)."""
        n = parts.n_tokens
        layer = self._layers[i]
        g = layer.geometry
        expected = (n, *g.row_shape)
        sdt = self.geometry.storage_dtype
        for name, arr, shape, dt in (
            ("k", parts.k, expected, sdt),
            ("v", parts.v, expected, sdt),
            ("k_scale", parts.k_scale, (n, *g.scale_shape), SCALE_DTYPE),
            ("v_scale", parts.v_scale, (n, *g.scale_shape), SCALE_DTYPE),
        ):
            if name.endswith("scale") and not self.geometry.has_scales:
                if arr is not None:
                    raise KVStateError(f"layer {i}: {name} given for K/V type {self.geometry.kv_type.value}")
                continue
            if arr is None or tuple(arr.shape) != shape or arr.dtype != dt:
                got = None if arr is None else (tuple(arr.shape), str(arr.dtype))
                raise KVStateError(f"layer {i}: {name} must be {shape} {dt}, got {got}")
        skip = max(0, n - g.capacity) if g.is_ring else 0
        self._check_range(i, pos0 + skip, pos0 + n, writing=True)
        for a, b, off in self._spans(i, pos0 + skip, pos0 + n):
            src = slice(skip + off, skip + off + (b - a))
            layer.k[a:b] = parts.k[src]
            layer.v[a:b] = parts.v[src]
            if layer.k_scale is not None:
                layer.k_scale[a:b] = parts.k_scale[src]
                layer.v_scale[a:b] = parts.v_scale[src]

    def decode_into(self, i: int, lo: int, hi: int, k_out: Any, v_out: Any) -> None:
        """Decode positions [lo, hi) of layer i into compute-dtype arrays [hi - lo, Hkv, D]."""
        layer = self._layers[i]
        for a, b, off in self._spans(i, lo, hi):
            n = b - a
            parts = KVParts(
                layer.k[a:b],
                layer.v[a:b],
                None if layer.k_scale is None else layer.k_scale[a:b],
                None if layer.v_scale is None else layer.v_scale[a:b],
            )
            self.codec.decode_into(parts, k_out[off : off + n], v_out[off : off + n])
