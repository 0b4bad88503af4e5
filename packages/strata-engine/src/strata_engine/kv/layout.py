"""K/V geometry: the storage type and the per-layer slot counts of the pool.

Full-attention layers get `n_ctx` slots, slot = position. Sliding-window layers get a ring of
`ring_capacity(window, n_ctx)` = min(n_ctx, 2 * window) slots, slot = position % capacity: the window
itself plus `window` tokens of slack, so a next turn may resume up to ~window tokens before the end of
the held conversation without a checkpoint. llama.cpp keeps window + ubatch rounded up (1,536 slots for
gemma3's 512-token window), so a ring here is never larger than llama.cpp's for the same conversation.
"""

from __future__ import annotations

import functools

import attrs
import numpy as np
from strata_sessionfile import DType

from ..config import ModelConfig
from ..settings import KVType

RING_SLACK_WINDOWS = 1  # ring = window * (1 + slack)


@attrs.frozen
class KVStorage:
    """How one K/V type is stored: the pool's values, whether float32 scales go beside them, and the
    session format's code for those values (a file holds the pool's own bytes)."""

    dtype: np.dtype
    has_scales: bool
    file_dtype: DType


KV_STORAGE: dict[KVType, KVStorage] = {
    KVType.F32: KVStorage(np.dtype(np.float32), False, DType.F32),
    KVType.F16: KVStorage(np.dtype(np.float16), False, DType.F16),
    KVType.INT8: KVStorage(np.dtype(np.int8), True, DType.I8),
}
SCALE_DTYPE = np.dtype(np.float32)
INT8_SCALE_BLOCK = 32


def int8_scale_block(head_dim: int) -> int:
    """Values per int8 scale: blocks of 32 along the head dimension (as ggml's q8_0), or the whole
    head when D is not a multiple of 32. One scale per head is too coarse for gemma3, whose keys and
    values carry fixed outlier channels (errors of 2-3 % flipped its greedy tokens within 10 steps)."""
    return INT8_SCALE_BLOCK if head_dim % INT8_SCALE_BLOCK == 0 else head_dim


def ring_capacity(window: int, n_ctx: int) -> int:
    return min(n_ctx, window * (1 + RING_SLACK_WINDOWS))


@attrs.frozen
class LayerGeometry:
    index: int
    n_kv_heads: int
    head_dim: int
    window: int | None  # None: full attention
    capacity: int  # token slots
    scale_block: int = 0  # int8: values per scale along D (0 for float types)

    @property
    def is_ring(self) -> bool:
        return self.window is not None

    @property
    def row_shape(self) -> tuple[int, int]:
        """Shape of one token's K (or V): [Hkv, D]."""
        return (self.n_kv_heads, self.head_dim)

    @property
    def scale_shape(self) -> tuple[int, int]:
        """Shape of one token's int8 scales for K (or V): [Hkv, D / scale_block]."""
        return (self.n_kv_heads, self.head_dim // self.scale_block if self.scale_block else 0)


@attrs.frozen
class KVGeometry:
    kv_type: KVType
    n_ctx: int
    layers: tuple[LayerGeometry, ...]

    @classmethod
    def from_config(cls, config: ModelConfig, n_ctx: int, kv_type: KVType) -> KVGeometry:
        scale_block = int8_scale_block(config.head_dim) if KV_STORAGE[kv_type].has_scales else 0
        layers = tuple(
            LayerGeometry(
                index=i,
                n_kv_heads=config.n_head_kv,
                head_dim=config.head_dim,
                window=lc.window if lc.window is not None and lc.window < n_ctx else None,
                capacity=ring_capacity(lc.window, n_ctx)
                if lc.window is not None and lc.window < n_ctx
                else n_ctx,
                scale_block=scale_block,
            )
            for i, lc in enumerate(config.layers)
        )
        return cls(kv_type=kv_type, n_ctx=n_ctx, layers=layers)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def storage_dtype(self) -> np.dtype:
        return KV_STORAGE[self.kv_type].dtype

    @property
    def has_scales(self) -> bool:
        return KV_STORAGE[self.kv_type].has_scales

    @property
    def file_dtype(self) -> DType:
        return KV_STORAGE[self.kv_type].file_dtype

    @property
    def scale_block(self) -> int:
        """int8: values per scale along D, shared by every layer (0 for float types)."""
        blocks = {g.scale_block for g in self.layers}
        assert len(blocks) <= 1, "one int8 scale block size for the whole pool"
        return blocks.pop() if blocks else 0

    @property
    def ring_layers(self) -> tuple[int, ...]:
        return tuple(g.index for g in self.layers if g.is_ring)

    @functools.cached_property  # read at every step's begin (a pass over the layers: ~1 us a row)
    def max_window(self) -> int | None:
        windows = [g.window for g in self.layers if g.window is not None]
        return max(windows) if windows else None

    @functools.cached_property  # as max_window
    def ring_capacity(self) -> int | None:
        caps = {g.capacity for g in self.layers if g.is_ring}
        assert len(caps) <= 1, "all ring layers share one capacity"
        return caps.pop() if caps else None

    def token_bytes(self, layer: int) -> int:
        """Bytes of one token of one layer: K and V values plus their scales (int8)."""
        g = self.layers[layer]
        n = g.n_kv_heads * g.head_dim * self.storage_dtype.itemsize
        if self.has_scales:
            n += g.scale_shape[0] * g.scale_shape[1] * SCALE_DTYPE.itemsize
        return 2 * n

    def layer_bytes(self, layer: int) -> int:
        return self.layers[layer].capacity * self.token_bytes(layer)

    @property
    def total_bytes(self) -> int:
        return sum(self.layer_bytes(i) for i in range(self.n_layers))
