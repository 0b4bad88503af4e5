"""The K/V cache: geometry, the preallocated pool, placements, and ring checkpoints.

For the session adapter (save / restore), everything goes through these objects:

* `KVGeometry` (`runner.kv_geometry`): K/V type, n_ctx, per layer `LayerGeometry` (Hkv, D, window,
  capacity); `token_bytes(i)`, `layer_bytes(i)`, `total_bytes`.
* `KVPool` (`runner.pool`): the authoritative storage.
  - `n_tokens`, `ring_start`; `held_range(i) -> (start, end)`: layer i holds positions [start, end) in
    logical order (full layers start at 0, ring layers at `ring_start`, at most `capacity` tokens).
  - `read(i, lo, hi) -> KVParts`: copies of encoded K/V in logical order (rings unrolled):
    k, v ``[n, Hkv, D]`` of dtype `geometry.storage_dtype` (float32 / float16 / int8), and for
    int8 k_scale, v_scale ``[n, Hkv]`` float32 (value = int8 * scale). Read in blocks of tokens to bound RAM.
  - `write(i, pos0, KVParts)`: store encoded K/V for positions [pos0, pos0 + n) (validated: layer,
    range, shapes, dtypes; `KVStateError` otherwise).
  - `layer(i) -> LayerKV`: the raw slot-order views (k, v, k_scale, v_scale) for zero-copy byte access.
* Placement (`runner.placement`): `PoolPlacement` or `ResidentRingPlacement`; after writing the pool
  directly call `placement.refill()` (the runner's `restore_state` does it).
* Running state: `runner.snapshot_state() -> RunnerState` (tokens held, position, ring_start, checkpoints
  incl. the deepest one) and `runner.restore_state(state)` (validates, sets the pool's extent, refills).
"""

from .checkpoints import RingCheckpoint, restore_checkpoint, take_checkpoint
from .cpu import InPlacePlacement
from .factory import make_arena, make_placement, make_placements, make_pool
from .layout import KV_STORAGE, SCALE_DTYPE, KVGeometry, KVStorage, LayerGeometry, ring_capacity
from .placement import PoolPlacement, ResidencyStats, ResidentRingPlacement
from .pool import KVCodec, KVParts, KVPool, LayerKV, PoolArena, PoolCapabilities, PoolLayout

__all__ = [
    "KV_STORAGE",
    "SCALE_DTYPE",
    "KVCodec",
    "KVGeometry",
    "KVParts",
    "KVPool",
    "InPlacePlacement",
    "KVStorage",
    "LayerGeometry",
    "LayerKV",
    "PoolArena",
    "PoolCapabilities",
    "PoolLayout",
    "PoolPlacement",
    "ResidencyStats",
    "ResidentRingPlacement",
    "RingCheckpoint",
    "make_arena",
    "make_placement",
    "make_placements",
    "make_pool",
    "restore_checkpoint",
    "ring_capacity",
    "take_checkpoint",
]
