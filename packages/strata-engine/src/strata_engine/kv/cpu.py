"""`InPlacePlacement`: the host pool read where it lies by ops that attend over stored K/V
(`Ops.attends_in_place`: the numba kernels).

Each chunk's K/V is stored into the pool first (rounded to f16 by a casting copy, or int8 with its scales
by `KVCodec.encode`: the bytes every placement stores) and attention then reads the pool's own storage: a full
layer's slots [context start, end), or a ring whole, addressed by position % capacity. No float32 copy
of the context is made; the kernels convert a tile of keys at a time (ops/numba_kernels.py). A ring
chunk too long to attend in place (its stores would overwrite keys its first query still sees: more
than capacity - window + 1 tokens) takes the generic path (gather, then write).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..ops.base import InPlaceOps
from .placement import PoolPlacement


class InPlacePlacement(PoolPlacement):
    ops: InPlaceOps  # the factory places a pool in place only for ops that attend in place

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
        if g.window is not None and n_new > g.capacity - g.window + 1:  # a ring chunk too long
            return super().attend(
                layer, pos0, q, k_new, v_new, q_pos0=q_pos0, window=window, scale=scale, softcap=softcap
            )
        views = self.pool.layer(layer)
        if self.pool.geometry.has_scales:
            self.write(layer, pos0, self.pool.codec.encode(k_new, v_new))
        else:  # a casting copy into the slots, rounding as KVCodec.encode does
            self.ops.store_kv(
                k_new, v_new, views.k, views.v, pos0, ring_capacity=g.capacity if g.is_ring else 0
            )
        if q is None:
            return None
        lo = self.context_start(layer, pos0)
        if g.is_ring:
            k, v, k_scale, v_scale, capacity = views.k, views.v, views.k_scale, views.v_scale, g.capacity
        else:
            end = pos0 + n_new
            k, v, capacity = views.k[lo:end], views.v[lo:end], 0
            k_scale = None if views.k_scale is None else views.k_scale[lo:end]
            v_scale = None if views.v_scale is None else views.v_scale[lo:end]
        return self.ops.attention(
            q, k, v, q_pos0=q_pos0, k_pos0=lo, window=window, scale=scale, softcap=softcap, ring_capacity=capacity,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip

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
        """`PoolPlacement.attend_rows` in one kernel call where every span's placement is one of this arena's
        (the slots' pools at one stride): each row's K/V stored in its slot, then every row attends over its
        own slot's keys, the rows over all threads (span by span, a 512-token SmolLM2 step at 8 slots left
        one thread idle for a quarter of the step)."""
        arena = self.pool.arena
        if not all(type(s.kv) is type(self) and s.kv.pool.arena is arena for s in spans):
            return super().attend_rows(
                layer, spans, q, k_new, v_new, window=window, scale=scale, softcap=softcap
            )
        g = self.pool.geometry.layers[layer]
        parts = self.pool.arena_layer(layer)
        k, v = parts[0], parts[1]
        k_scale, v_scale = (parts[2], parts[3]) if len(parts) == 4 else (None, None)
        slots = [s.kv.pool.slot for s in spans]
        positions = [s.pos0 % g.capacity if g.is_ring else s.pos0 for s in spans]
        if k_scale is None:  # every row's K/V into its slot in one call (rounding as `ops.store_kv`)
            self.ops.store_kv_rows(k_new, v_new, k, v, slots, positions)
        else:  # int8: every row encoded in one call (its scale blocks are its own), then each into its slot
            rows = self.pool.codec.encode(k_new, v_new)
            self.ops.store_kv_rows(rows.k, rows.v, k, v, slots, positions)
            self.ops.store_kv_rows(rows.k_scale, rows.v_scale, k_scale, v_scale, slots, positions)
        k_lo = []
        for s in spans:
            lo = self.context_start(layer, s.pos0)
            k_lo.append(lo if window is None else max(lo, s.pos0 - window + 1))
        return self.ops.attention_rows(
            q, k, v, k_scale, v_scale, slots=slots, q_pos=[s.pos0 for s in spans],
            k_lo=k_lo, capacity=g.capacity if g.is_ring else 0, window=window or 0, scale=scale, softcap=softcap,
        )  # fmt: skip
