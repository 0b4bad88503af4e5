"""Which K/V pool and placement a runner gets, by backend and `--kv-resident` (the one place that decides).

numpy: a `KVPool`, read directly (by the numba kernels where it lies: `InPlacePlacement`) or behind a
host-memory resident ring. cupy: a `DevicePool`, read by the device placement that attends in place; with
a resident ring, a `HostMappedPool` behind a VRAM ring.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..ops import Ops
from ..settings import Backend
from .cpu import InPlacePlacement
from .device import DevicePool, DevicePoolPlacement, DeviceResidentRingPlacement, HostMappedPool
from .layout import KVGeometry
from .placement import PoolPlacement, ResidentRingPlacement
from .pool import KVPool, PoolArena

# (pool type, whether the ops attend over stored K/V) -> (its placement without a resident ring, its
# placement with one)
PLACEMENTS: dict[tuple[type[KVPool], bool], tuple[type[PoolPlacement], type[ResidentRingPlacement]]] = {
    (KVPool, False): (PoolPlacement, ResidentRingPlacement),
    (KVPool, True): (InPlacePlacement, ResidentRingPlacement),
    (DevicePool, False): (DevicePoolPlacement, ResidentRingPlacement),
    (HostMappedPool, False): (PoolPlacement, DeviceResidentRingPlacement),
}


def pool_type(ops: Ops, kv_resident: int | None) -> type[KVPool]:
    """The authoritative pool's type for a backend and placement."""
    if ops.name != Backend.CUPY:
        return KVPool
    if kv_resident is not None:
        return HostMappedPool
    return DevicePool  # the serve verbs pin its block buffers at start-up (SessionVerbs.warm)


def make_arena(geometry: KVGeometry, ops: Ops, kv_resident: int | None, n_slots: int = 1) -> PoolArena:
    """The one preallocated buffer of `n_slots` slots' pools (`PoolArena.pools` carves them)."""
    return PoolArena(pool_type(ops, kv_resident), geometry, ops, n_slots)


def make_pool(geometry: KVGeometry, ops: Ops, kv_resident: int | None) -> KVPool:
    """The authoritative pool of a single slot."""
    return make_arena(geometry, ops, kv_resident).pools(ops)[0]


def make_placement(pool: KVPool, kv_resident: int | None) -> PoolPlacement:
    """The placement the forward pass reads `pool` through: directly, or behind an N-token resident ring."""
    return make_placements([pool], kv_resident)[0]


def make_placements(pools: Sequence[KVPool], kv_resident: int | None) -> list[PoolPlacement]:
    """The placements of the slots' pools (regions of one arena); their resident rings, if any, are regions of
    one arena too."""
    ops = pools[0].ops
    plain, with_ring = PLACEMENTS[type(pools[0]), ops.attends_in_place]
    if kv_resident is None:
        return [plain(pool) for pool in pools]
    geometry = with_ring.resident_geometry(pools[0].geometry, kv_resident)
    arena = PoolArena(with_ring.resident_pool_type, geometry, ops, len(pools))
    return [with_ring(pool, kv_resident, arena) for pool in pools]
