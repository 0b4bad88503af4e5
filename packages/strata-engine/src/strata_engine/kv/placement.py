"""Where the forward pass reads and writes K/V: the pool itself, or a host pool behind a resident ring.

* `PoolPlacement`: the pool is read and written directly (the GPU issue: a device pool).
* `ResidentRingPlacement` (`kv_resident=N`): the pool is the authoritative *host* pool; each layer also
  has an N-token resident ring (the GPU issue: VRAM) holding its most recent tokens. Writes go to both
  (write-through); reads take positions the ring holds from the ring and older ones from the host pool.
  Anything that writes the host pool behind the placement's back (a session restore, a checkpoint
  restore) must call `refill()`, which resets every resident ring from the host pool: otherwise decoding
  would read stale slots while the pool bytes and the token count both look right.

Both hold bytes in the same encoding, so both placements give bit-identical attention inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from .layout import KVGeometry
from .pool import KVParts, KVPool, PoolArena


class PoolPlacement:
    kind = "pool"

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.ops = pool.ops

    def context_start(self, layer: int, pos0: int) -> int:
        """First key position the queries at pos0.. can see in `layer` (window - 1 before pos0)."""
        window = self.pool.geometry.layers[layer].window
        return 0 if window is None else max(0, pos0 - window + 1)

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
        """Store the chunk's K/V [T, Hkv, D] at positions pos0..; with q [T', H, D] (queries at q_pos0..)
        return their attention [T', H*D] over every key they may see; without q, only store."""
        k_ctx, v_ctx, k_pos0 = self.attend_kv(layer, pos0, k_new, v_new)
        if q is None:
            return None
        return self.ops.attention(
            q, k_ctx, v_ctx, q_pos0=q_pos0, k_pos0=k_pos0, window=window, scale=scale, softcap=softcap
        )

    def attend_rows(
        self,
        layer: int,
        spans: Sequence[Any],
        q: Any,
        k_new: Any,
        v_new: Any,
        *,
        window: int | None,
        scale: float,
        softcap: float,
    ) -> Any:
        """A batched decode step's attention: row b of q, k_new, v_new [B, ...] is the one row of spans[b]
        (`models.common.Span`: a slot's placement, this one among them, and its position) -> [B, H * D]. Here
        span by span; a placement with a kernel batched over slots attends them together."""
        out = [
            s.kv.attend(
                layer,
                s.pos0,
                q[b : b + 1],
                k_new[b : b + 1],
                v_new[b : b + 1],
                q_pos0=s.pos0,
                window=window,
                scale=scale,
                softcap=softcap,
            )  # fmt: skip
            for b, s in enumerate(spans)
        ]
        return self.ops.xp.concatenate(out)

    def attend_kv(self, layer: int, pos0: int, k_new: Any, v_new: Any) -> tuple[Any, Any, int]:
        """Store the chunk's K/V [T, Hkv, D] at positions pos0.. and return the keys and values its
        queries attend to, decoded from storage (so prefill, decode and resumed runs all see the same
        rounded values): (k [S, Hkv, D], v [S, Hkv, D], position of the first key). For a full layer
        whose storage dtype is the compute dtype (f32 K/V) they are slices of the pool itself."""
        lo = self.context_start(layer, pos0)
        n_new = k_new.shape[0]
        if self.reads_pool_directly(layer):
            # Storage is the compute dtype and slot = position: the pool slice is the context itself.
            end = pos0 + n_new
            self.write(layer, pos0, self.pool.codec.encode(k_new, v_new))
            views = self.pool.layer(layer)
            return views.k[lo:end], views.v[lo:end], lo
        shape = (pos0 + n_new - lo, *k_new.shape[1:])
        xp = self.ops.xp
        k_ctx = xp.empty(shape, dtype=self.ops.dtype)
        v_ctx = xp.empty(shape, dtype=self.ops.dtype)
        n_old = pos0 - lo
        self.gather_into(layer, lo, pos0, k_ctx[:n_old], v_ctx[:n_old])  # before the write: rings wrap
        parts = self.pool.codec.encode(k_new, v_new)
        self.write(layer, pos0, parts)
        self.pool.codec.decode_into(parts, k_ctx[n_old:], v_ctx[n_old:])
        return k_ctx, v_ctx, lo

    def reads_pool_directly(self, layer: int) -> bool:
        """Whether attention may read the pool's own slots (full layer, storage = compute dtype)."""
        g = self.pool.geometry.layers[layer]
        return not g.is_ring and self.pool.geometry.storage_dtype == self.ops.dtype

    def gather_into(self, layer: int, lo: int, hi: int, k_out: Any, v_out: Any) -> None:
        self.pool.decode_into(layer, lo, hi, k_out, v_out)

    def write(self, layer: int, pos0: int, parts: KVParts) -> None:
        self.pool.write(layer, pos0, parts)

    def truncated(self, r: int) -> None:
        """The conversation was cut back to r tokens."""

    def refill(self) -> None:
        """Nothing to refill: the pool is what is read."""


@attrs.frozen
class ResidencyStats:
    host_tokens_read: int
    resident_tokens_read: int


class ResidentRingPlacement(PoolPlacement):
    kind = "resident"
    resident_pool_type: type[KVPool] = KVPool  # the rings' memory

    def __init__(self, pool: KVPool, n_resident: int, arena: PoolArena | None = None):
        """`arena`: the resident rings of every slot (`resident_geometry`), this pool's slot's region used;
        None: an arena of this pool's own."""
        super().__init__(pool)
        self.n_resident = n_resident
        geo = pool.geometry
        if arena is None:
            arena = PoolArena(self.resident_pool_type, self.resident_geometry(geo, n_resident), pool.ops, 1)
        # The resident ring is itself a pool whose every layer is a ring of min(N, capacity) slots.
        self.resident = self.resident_pool_type(arena.layout.geometry, pool.ops, arena=arena,
                                                slot=pool.slot if arena.n_slots > 1 else 0)  # fmt: skip
        # Per layer: the lowest position the resident ring holds validly (it holds [start, n_tokens)).
        self.resident_start = [0] * geo.n_layers
        self.host_tokens_read = 0
        self.resident_tokens_read = 0

    @staticmethod
    def resident_geometry(geo: KVGeometry, n_resident: int) -> KVGeometry:
        return KVGeometry(
            kv_type=geo.kv_type,
            n_ctx=geo.n_ctx,
            layers=tuple(
                attrs.evolve(g, window=n_resident, capacity=min(n_resident, g.capacity)) for g in geo.layers
            ),
        )

    def reads_pool_directly(self, layer: int) -> bool:
        return False  # reads must go through the resident ring

    def stats(self) -> ResidencyStats:
        return ResidencyStats(self.host_tokens_read, self.resident_tokens_read)

    def gather_into(self, layer: int, lo: int, hi: int, k_out: Any, v_out: Any) -> None:
        split = max(lo, min(hi, self.resident_start[layer]))
        if split > lo:
            self.pool.decode_into(layer, lo, split, k_out[: split - lo], v_out[: split - lo])
            self.host_tokens_read += split - lo
        if hi > split:
            self.resident.decode_into(layer, split, hi, k_out[split - lo :], v_out[split - lo :])
            self.resident_tokens_read += hi - split

    def write(self, layer: int, pos0: int, parts: KVParts) -> None:
        self.pool.write(layer, pos0, parts)
        self.resident.write(layer, pos0, parts)
        cap = self.resident.geometry.layers[layer].capacity
        self.resident_start[layer] = max(self.resident_start[layer], pos0 + parts.n_tokens - cap)

    def truncated(self, r: int) -> None:
        self.resident_start = [min(s, r) for s in self.resident_start]

    def refill(self) -> None:
        """Reset every resident ring from the host pool: it then holds each layer's most recent
        min(N, held) tokens."""
        n = self.pool.n_tokens
        for i, g in enumerate(self.resident.geometry.layers):
            held_lo, _ = self.pool.held_range(i)
            lo = max(held_lo, n - g.capacity)
            self.resident.write(i, lo, self.pool.read_device(i, lo, n))
            self.resident_start[i] = lo
