"""The K/V pool, rings, placements and checkpoints on a small synthetic geometry (no model needed)."""

from __future__ import annotations

import numpy as np
import pytest
from strata_engine.config import ModelConfig
from strata_engine.errors import KVStateError
from strata_engine.gguf import read_gguf
from strata_engine.kv import (
    KV_STORAGE,
    InPlacePlacement,
    KVGeometry,
    KVParts,
    KVPool,
    LayerGeometry,
    PoolArena,
    PoolPlacement,
    ResidentRingPlacement,
    restore_checkpoint,
    take_checkpoint,
)
from strata_engine.ops import get_ops
from strata_engine.settings import KVType

HKV, D, WINDOW, CAP, NCTX = 2, 32, 8, 16, 64


def _geometry(kv_type: KVType) -> KVGeometry:
    block = 32 if kv_type is KVType.INT8 else 0
    return KVGeometry(
        kv_type=kv_type,
        n_ctx=NCTX,
        layers=(
            LayerGeometry(0, HKV, D, window=None, capacity=NCTX, scale_block=block),
            LayerGeometry(1, HKV, D, window=WINDOW, capacity=CAP, scale_block=block),
        ),
    )


def _kv_for(positions) -> np.ndarray:
    """Distinct, exactly representable (f16 and int8 with block scales) values per position."""
    p = np.asarray(positions, dtype=np.float32)[:, None, None]
    base = np.arange(HKV * D, dtype=np.float32).reshape(1, HKV, D) % 7 - 3
    return (base * (p + 1)).astype(np.float32)


def _append(placement, pool, pos0, n):
    pool.begin_append(pos0, n)
    k = _kv_for(range(pos0, pos0 + n))
    for layer in range(2):
        placement.attend_kv(layer, pos0, k, -k)
    pool.commit_append(n)


@pytest.mark.parametrize("kv_type", list(KVType))
def test_pool_layout_and_round_trip(kv_type):
    ops = get_ops()
    pool = KVPool(_geometry(kv_type), ops)
    assert pool.nbytes >= pool.geometry.total_bytes
    placement = PoolPlacement(pool)
    _append(placement, pool, 0, 40)
    assert pool.n_tokens == 40
    assert pool.held_range(0) == (0, 40)
    assert pool.held_range(1) == (40 - CAP, 40)
    parts = pool.read(1, 40 - CAP, 40)  # a ring read in logical order (it wraps: 40 % 16 = 8)
    assert parts.k.dtype == KV_STORAGE[kv_type].dtype
    k = np.empty((CAP, HKV, D), np.float32)
    v = np.empty_like(k)
    pool.codec.decode_into(parts, k, v)
    expected = _kv_for(range(24, 40))
    tol = np.abs(expected).max(axis=-1, keepdims=True) / 127 / 2 if kv_type is KVType.INT8 else 0
    assert np.all(np.abs(k - expected) <= tol + 1e-5)
    assert np.all(np.abs(v + expected) <= tol + 1e-5)
    # A write of a read puts back the same bytes.
    before = [a.copy() for a in pool.layer(1).slot_arrays()]
    pool.write(1, 24, parts)
    for a, b in zip(before, pool.layer(1).slot_arrays(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_attend_kv_returns_window_context_for_rings():
    ops = get_ops()
    pool = KVPool(_geometry(KVType.F32), ops)
    placement = PoolPlacement(pool)
    _append(placement, pool, 0, 20)
    pool.begin_append(20, 3)
    k_new = _kv_for([20, 21, 22])
    k_ctx, v_ctx, lo = placement.attend_kv(1, 20, k_new, -k_new)
    assert lo == 20 - WINDOW + 1
    np.testing.assert_array_equal(k_ctx, _kv_for(range(lo, 23)))
    k_ctx, _, lo = placement.attend_kv(0, 20, k_new, -k_new)
    assert lo == 0 and k_ctx.shape[0] == 23
    pool.commit_append(3)


def test_write_validation():
    pool = KVPool(_geometry(KVType.INT8), get_ops())
    good = pool.read(0, 0, 2)
    with pytest.raises(KVStateError, match="k_scale"):
        pool.write(0, 0, KVParts(good.k, good.v, None, None))
    with pytest.raises(KVStateError, match="must be"):
        pool.write(0, 0, KVParts(good.k.astype(np.float16), good.v, good.k_scale, good.v_scale))
    with pytest.raises(KVStateError, match="outside the context"):
        pool.write(0, NCTX - 1, good)
    with pytest.raises(KVStateError, match="layer 5"):
        pool.read(5, 0, 1)
    with pytest.raises(KVStateError, match="longer than the ring"):
        pool.read(1, 0, CAP + 1)


def test_resume_points_and_truncation():
    pool = KVPool(_geometry(KVType.F16), get_ops())
    placement = PoolPlacement(pool)
    _append(placement, pool, 0, 40)  # ring holds [24, 40)
    assert pool.can_resume(40) and pool.can_resume(31)  # needs [r - 7, r) within [24, 40)
    assert not pool.can_resume(30)
    assert pool.can_resume(0)
    with pytest.raises(KVStateError):
        pool.truncate(30)
    pool.truncate(35)
    assert pool.n_tokens == 35 and pool.held_range(1) == (24, 35)
    with pytest.raises(KVStateError):
        pool.begin_append(34, 1)  # appends only at the end


def test_checkpoint_restores_an_overwritten_ring():
    pool = KVPool(_geometry(KVType.F32), get_ops())
    placement = PoolPlacement(pool)
    _append(placement, pool, 0, 12)
    cp = take_checkpoint(pool)
    assert (cp.position, cp.start) == (12, 12 - WINDOW + 1)
    assert set(cp.layers) == {1}
    _append(placement, pool, 12, 30)  # the ring now holds [26, 42)
    assert not pool.can_resume(12)
    restore_checkpoint(pool, cp)
    assert pool.n_tokens == 12 and pool.can_resume(12)
    k = np.empty((WINDOW - 1, HKV, D), np.float32)
    pool.decode_into(1, 5, 12, k, np.empty_like(k))
    np.testing.assert_array_equal(k, _kv_for(range(5, 12)))
    # The checkpoint's arrays are frozen: nothing can change the resume point behind its back.
    with pytest.raises(ValueError):
        cp.layers[1].k[0] = 0


@pytest.mark.parametrize("n_resident", [4, 10, 100])
def test_resident_ring_reads_equal_pool_reads_and_refill(n_resident):
    ops = get_ops()
    pool = KVPool(_geometry(KVType.F16), ops)
    placement = ResidentRingPlacement(pool, n_resident)
    _append(placement, pool, 0, 30)
    for layer in range(2):
        lo, hi = pool.held_range(layer)
        via_ring = np.empty((hi - lo, HKV, D), np.float32)
        via_pool = np.empty_like(via_ring)
        placement.gather_into(layer, lo, hi, via_ring, np.empty_like(via_ring))
        pool.decode_into(layer, lo, hi, via_pool, np.empty_like(via_pool))
        np.testing.assert_array_equal(via_ring, via_pool)
    assert placement.resident_tokens_read > 0
    if n_resident < 30:
        assert placement.host_tokens_read > 0
    # Write the host pool behind the placement's back (what a restore does): the resident ring is stale
    # until refill() resets it from the pool.
    fresh = _kv_for(range(100, 130)).astype(np.float16)
    pool.write(0, 0, KVParts(fresh, fresh))
    pool.set_extent(30, pool.ring_start)
    got = np.empty((30, HKV, D), np.float32)
    placement.gather_into(0, 0, 30, got, np.empty_like(got))
    assert not np.array_equal(got, fresh.astype(np.float32))
    placement.refill()
    placement.gather_into(0, 0, 30, got, np.empty_like(got))
    np.testing.assert_array_equal(got, fresh.astype(np.float32))


# (chunk sizes) appended one after the other: a prefill past the kernel's 16 queries, decode steps that
# wrap the 16-slot ring several times, a short prompt, and a chunk too long for the ring to attend in place.
IN_PLACE_CHUNKS = (20, 1, 1, 5, 1, 3, 1, 1, 12, 1)


@pytest.mark.parametrize("kv_type", list(KVType))
def test_in_place_attention_equals_the_gathered_context(kv_type):
    """The numba ops attend over the pool's own storage (InPlacePlacement: a full layer's slots, a ring
    by position % capacity); the numpy ops over a decoded float32 copy (PoolPlacement). Same stored
    bytes, the same attention within the kernels' bound (tests/engine/test_ops.py)."""
    numba_ops = get_ops("numpy", "f32", "numba")
    oracle_ops = get_ops()
    fast, slow = KVPool(_geometry(kv_type), numba_ops), KVPool(_geometry(kv_type), oracle_ops)
    fast_place, slow_place = InPlacePlacement(fast), PoolPlacement(slow)
    rng = np.random.default_rng(13)
    pos0 = 0
    for n in IN_PLACE_CHUNKS:
        k = rng.standard_normal((n, HKV, D)).astype(np.float32)
        v = rng.standard_normal((n, HKV, D)).astype(np.float32)
        q = rng.standard_normal((n, 2 * HKV, D)).astype(np.float32)
        for pool in (fast, slow):
            pool.begin_append(pos0, n)
        for layer, window in ((0, None), (1, WINDOW)):
            args = dict(q_pos0=pos0, window=window, scale=0.2, softcap=0.0)
            got = fast_place.attend(layer, pos0, q, k, v, **args)
            want = slow_place.attend(layer, pos0, q, k, v, **args)
            np.testing.assert_allclose(
                got, want, rtol=0, atol=1e-5 * np.abs(v).max(), err_msg=f"{pos0} {layer}"
            )
        for pool in (fast, slow):
            pool.commit_append(n)
        pos0 += n
        for layer in range(2):
            lo, hi = slow.held_range(layer)
            for a, b in zip(
                fast.read(layer, lo, hi).arrays(), slow.read(layer, lo, hi).arrays(), strict=True
            ):
                np.testing.assert_array_equal(a, b)
    assert pos0 > 2 * CAP


def test_set_extent_validation():
    pool = KVPool(_geometry(KVType.F32), get_ops())
    with pytest.raises(KVStateError):
        pool.set_extent(NCTX + 1, 0)
    with pytest.raises(KVStateError):
        pool.set_extent(40, 10)  # 30 tokens do not fit a 16-slot ring
    pool.set_extent(40, 24)
    assert pool.held_range(1) == (24, 40)


def test_gemma3_memory_and_file_no_larger_than_llama_cpp(gemma3_path, reference_dir):
    """llama.cpp's slot file for 16,015 tokens of gemma3 with f16 K/V is 73,067,096 bytes: what a session
    file holds here (every layer's held K/V plus the deepest checkpoint) must not exceed it, nor the
    preallocated pool plus one checkpoint llama.cpp's K/V allocation for the same context (its sliding
    window layers hold the cells its file shows: (file - global layers) / 15 layers / 1,024 bytes)."""
    import json

    peer = json.loads((reference_dir / "peer-slots-gemma3-270m.json").read_text())
    config = ModelConfig.from_gguf(read_gguf(gemma3_path))
    geo = KVGeometry.from_config(config, peer["ctx"], KVType.F16)
    assert geo.ring_layers == tuple(i for i in range(18) if i % 6 != 5)
    assert geo.ring_capacity == 1024
    n = peer["save"]["n_saved"]
    checkpoint_bytes = sum((geo.layers[i].window - 1) * geo.token_bytes(i) for i in geo.ring_layers)
    held_bytes = sum(min(n, g.capacity) * geo.token_bytes(g.index) for g in geo.layers)
    assert held_bytes + checkpoint_bytes <= peer["file_bytes"]
    token_bytes = geo.token_bytes(0)  # 1,024: one K/V head of 256 f16 values, K and V
    n_global = len(geo.layers) - len(geo.ring_layers)
    llama_swa_cells = (peer["file_bytes"] - n_global * n * token_bytes) // (
        len(geo.ring_layers) * token_bytes
    )
    assert llama_swa_cells >= 1024
    llama_alloc = (n_global * peer["ctx"] + len(geo.ring_layers) * llama_swa_cells) * token_bytes
    assert geo.total_bytes + checkpoint_bytes <= llama_alloc


def test_ring_byte_spans_are_the_token_spans_in_bytes():
    from strata_engine.kv.pool import ring_byte_spans, ring_spans

    cap, row = 16, 12
    for start in (0, 5, 15, 16, 37):
        for lo in range(0, cap + 1):
            for hi in range(lo, cap + 1):
                by_token = [
                    (a * row, b * row, off * row) for a, b, off in ring_spans(start + lo, start + hi, cap)
                ]
                assert ring_byte_spans(start, lo * row, (hi - lo) * row, cap, row) == by_token
    # a range that starts and ends inside rows: two pieces where it crosses the ring's end
    assert ring_byte_spans(15, 7, 10, cap, row) == [(187, 192, 0), (0, 5, 5)]


@pytest.mark.parametrize("kv_type", list(KVType))
def test_slots_of_one_arena_are_disjoint_regions_at_one_stride_per_layer(kv_type):
    ops = get_ops()
    geometry = _geometry(kv_type)
    arena = PoolArena(KVPool, geometry, ops, 3)
    pools = arena.pools(ops)
    assert arena.layout.nbytes == len(arena.memory) and [p.slot for p in pools] == [0, 1, 2]
    assert all(p.nbytes == geometry.total_bytes for p in pools)
    for i in range(geometry.n_layers):
        for part in ("k", "v", "k_scale", "v_scale"):
            views = [getattr(p.layer(i), part) for p in pools]
            if views[0] is None:
                continue
            addresses = [v.__array_interface__["data"][0] for v in views]
            assert addresses[2] - addresses[1] == addresses[1] - addresses[0] == views[0].nbytes
    # each slot's appends, ring wraps and warm-up land in its own region only
    _append(PoolPlacement(pools[1]), pools[1], 0, 40)
    for p in (pools[0], pools[2]):
        _append(PoolPlacement(p), p, 0, 21)
        p.reset()
        p.warm()  # zeroes an empty pool's pages: its own
    after = [bytes(memoryview(a).cast("B")) for p in (pools[0], pools[2]) for i in range(2)
             for a in p.layer(i).slot_arrays()]  # fmt: skip
    assert all(not any(b) for b in after)
    lone = KVPool(geometry, ops)  # slot 1 holds what a pool of its own holds after the same appends
    _append(PoolPlacement(lone), lone, 0, 40)
    for i in range(2):
        got, expected = pools[1].read(i, *pools[1].held_range(i)), lone.read(i, *lone.held_range(i))
        assert all(a.tobytes() == b.tobytes() for a, b in zip(got.arrays(), expected.arrays(), strict=True))
    with pytest.raises(KVStateError):
        KVPool(KVGeometry(kv_type, NCTX, geometry.layers[:1]), ops, arena=arena, slot=0)
