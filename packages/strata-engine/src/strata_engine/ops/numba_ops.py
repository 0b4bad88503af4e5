"""`NumbaOps`: the numpy backend with compiled kernels (`--cpu-kernels numba`, the default with f32 compute).

Weights stay packed (`packed.py`: int8 with float32 scales per block, made once at load from the GGUF's
blocks: a token reads ~1.2 bytes per weight instead of a float32 copy's 4). Products of a few token rows
(decode, short prompts) run in numba kernels over all threads; larger ones dequantize the weight a row
chunk at a time and hand each chunk to BLAS. Attention reads the K/V pool's own storage (f16, int8 with
scales, f32), converting a tile of keys at a time (kv/cpu.py hands it the pool's views). Everything
else is `NumpyOps`, the oracle these kernels are tested against (tests/engine/test_ops.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..config import Activation, RopeStyle
from . import numba_kernels as nk
from . import numba_q8
from .attention_tiling import blocked_attention
from .numpy_ops import NumpyOps
from .packed import TILE_ROWS, PackedWeight
from .threads import default_threads, set_threads

F32 = np.float32
# Token rows up to which a product runs in the packed kernel; above, dequantized chunks through BLAS
# (the multi-row kernel is 1.15-1.6x BLAS's speed at 64 rows, 1.1-1.25x at 128, on 1 and 2 threads:
# bench/engine/DECISIONS.md "Multi-row float32 products"). loaded.WARM_UP_TOKENS exceeds it.
PACKED_MAX_ROWS = 64
# With q8 products (`--cpu-kernels numba-q8`), token rows up to which a product runs in the q8 kernel: a
# prefill chunk too (SmolLM2, 1 thread: 1.9x / 2.3x / 1.6x dequantize + BLAS at 64 / 128 / 512 rows,
# bench/engine/DECISIONS.md "The q8 products: tiled weights").
Q8_MAX_ROWS = 512
# Token rows from which the gated MLP's activation runs over all threads; below, on the calling thread (a parallel
# region costs ~1.5 us; at 16 rows the two break even). bench/engine/DECISIONS.md "The steps between the products".
ACTIVATION_PARALLEL_MIN_ROWS = 16
# Token rows from which a chunk's f16 K/V is stored by `numba_kernels.store_f16` (numpy's float32 -> f16 cast is
# scalar here); a decode step's row by numpy (one kernel signature: a row of a column view is typed 'C').
STORE_KERNEL_MIN_ROWS = 2
# Token rows up to which the packed kernel takes one row at a time (`row_dot`: the fewest operations for
# one row); above, each weight block is decoded once for a group of rows (`rows_dot`).
BY_ROW_MAX_ROWS = 1
# Weight rows dequantized per BLAS call: a float32 chunk of about 2 MiB stays in cache for the product.
DEQUANT_CHUNK_BYTES = 2 << 20
# Work from which a kernel runs over all threads (below, on the calling thread): a parallel region costs
# ~1.5 us here (OpenMP), so every layer product of a decode step runs over all threads (SmolLM2 1.37x from
# 16 MiB, bench/engine/DECISIONS.md "Products over both threads"); only toy weights stay serial. On a machine with other work the join waits for
# a descheduled thread. Products: weight bytes times token rows; attention: keys x query heads x tokens.
PARALLEL_MIN_BYTES = 64 << 10
PARALLEL_MIN_SCORES = (
    1 << 11
)  # decode from ~230 SmolLM2 keys over all threads (with --poll the threads are awake)
# Query tokens up to which attention runs in the tiled kernel; above, key blocks through BLAS.
ATTN_KERNEL_MAX_TOKENS = 16
# A longer chunk attends in the kernel too, blocks of ATTN_KERNEL_MAX_TOKENS queries over all threads (1.3-5x
# BLAS's key blocks, whose softmax is single-threaded numpy), except heads this wide over this many keys held
# before it, where BLAS wins (gemma3's global layers: x1.05 at 8,192 held, x1.1 at 16,000; the kernel x1.09 at
# 4,096; bench/engine/DECISIONS.md "Prompt chunks in the attention kernel").
ATTN_BLAS_MIN_HEAD_DIM = 256
ATTN_BLAS_MIN_HELD = 6144
# Keys per block of the BLAS path (scores [Hkv, G*T, block] float32 stay a few MiB).
ATTN_BLAS_KEY_BLOCK = 512
_DUMMY_2D = np.zeros((1, 1), dtype=F32)
_NO_NORM = np.ones(1, dtype=F32)
_DUMMY_3D = np.zeros((1, 1, 1), dtype=F32)
_DUMMY_4D = np.zeros((1, 1, 1, 1), dtype=F32)


def _mins(w: PackedWeight) -> np.ndarray:
    """The weight's mins, or a placeholder of the scales' dtype (one kernel signature either way)."""
    return w.min if w.min is not None else np.zeros((1, 1), dtype=w.scale.dtype)


def storage_view(a: np.ndarray) -> np.ndarray:
    """A K/V storage array as the kernels read it: f16 as its uint16 bits (numba has no f16 on the CPU)."""
    return a.view(np.uint16) if a.dtype == np.float16 else a


def contiguous_rows(a: np.ndarray) -> np.ndarray:
    """A 2-D float32 array whose rows are contiguous (what `numba_kernels.row_span` reads): a column view as it
    is, anything else copied."""
    return a if a.dtype == F32 and a.strides[-1] == 4 else np.ascontiguousarray(a, dtype=F32)


class StoredRows:
    """Rows [n, Hkv, D] of stored K or V in logical order, decoded to float32 a slice at a time (what
    `blocked_attention` reads): `values` [slots, Hkv, D] of the storage type with int8 `scales`
    [slots, Hkv, D / block] or None; logical row i is slot (first + i) % capacity, or first + i."""

    def __init__(self, values: np.ndarray, scales: np.ndarray | None, first: int, n: int, capacity: int):
        self.values, self.scales = values, scales
        self.first, self.capacity = first, capacity
        self.shape = (n, *values.shape[1:])

    def __getitem__(self, rows: slice) -> np.ndarray:
        """float32 [n, Hkv, D] of logical rows `rows`."""
        lo, hi, _ = rows.indices(self.shape[0])
        where: Any = slice(self.first + lo, self.first + hi)
        if self.capacity:
            where = np.arange(self.first + lo, self.first + hi) % self.capacity
        values = self.values[where]
        scales = None if self.scales is None else self.scales[where]
        out = values.astype(F32)
        if scales is not None:
            n_blocks = scales.shape[-1]
            out = (out.reshape(*out.shape[:-1], n_blocks, -1) * scales[..., None]).reshape(out.shape)
        return out


class NumbaOps(NumpyOps):
    """`NumpyOps` whose weights are `PackedWeight`s and whose products and attention are compiled."""

    packs_weights = True
    attends_in_place = True
    compiles_kernels = True

    def __init__(
        self,
        dtype: str = "f32",
        threads: int | None = None,
        *,
        q8: bool = False,
        batch_invariant: bool = True,
    ):
        super().__init__(dtype)
        # a row's arithmetic never depends on the pass's other rows: one float32 product kernel for every row
        # count (no BLAS, no row_dot, no weight-row pairs), attention always in the kernel (its splits at fixed
        # positions); the q8 products are invariant as they are
        self.batch_invariant = batch_invariant
        if self.dtype != F32:
            raise ValueError(f"the numba kernels compute in f32, not {dtype}")
        self.threads = set_threads(threads if threads is not None else default_threads())
        # activations quantized to int8 for the packed products (`--cpu-kernels numba-q8`) where the CPU can
        self.q8 = q8 and numba_q8.HAS_VNNI

    # ---- weights --------------------------------------------------------------------------------
    def packed_layout(self, w: PackedWeight) -> PackedWeight:
        """Tiled (`PackedWeight.tile`) where the q8 products take the weight, in 5 bits a value where its values
        fit (Q5_0's: a third fewer bytes a token), else as packed."""
        if not (self.q8 and numba_q8.takes(w)):
            return w
        tiled = w.tile()
        return tiled.as_five_bit() if tiled.fits_five_bits() else tiled

    def embed(self, table: Any, ids: np.ndarray, scale: float = 1.0) -> Any:
        if not isinstance(table, PackedWeight):
            return super().embed(table, ids, scale)
        x = table.take(np.asarray(ids)).dequantize()
        if scale != 1.0:
            x *= F32(scale)
        return x

    def dequantize(
        self, w: PackedWeight, out: np.ndarray | None = None, *, parallel: bool = True
    ) -> np.ndarray:
        """float32 [N, K] of a packed weight (into `out` when given), on all threads or this one."""
        if out is None:
            out = np.empty(w.shape, dtype=F32)
        w = w.natural()
        kernel = nk.dequantize_packed if parallel else nk.dequantize_packed_serial
        kernel(w.values, w.scale, _mins(w), w.min is not None, out)
        return out

    # ---- the steps between products ---------------------------------------------------------------
    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        if x.ndim != 2:
            return super().rms_norm(x, weight, eps)
        x = np.ascontiguousarray(x, dtype=F32)
        out = np.empty_like(x)
        nk.rms_norm_rows(x, weight, F32(eps), out)
        return out

    def add_rms_norm(self, x: Any, y: Any, w_post: Any | None, w_next: Any, eps: float) -> tuple[Any, Any]:
        x = np.ascontiguousarray(x, dtype=F32)
        x_out, h_out = np.empty_like(x), np.empty_like(x)
        has_post = w_post is not None
        nk.add_rms_norm_rows(
            x, np.ascontiguousarray(y, dtype=F32), w_post if has_post else w_next, has_post, w_next, F32(eps),
            x_out, h_out,
        )  # fmt: skip
        return x_out, h_out

    def qk_norm_rope(
        self, q: Any, k: Any, head_dim: int, q_norm: Any | None, k_norm: Any | None, cos: Any, sin: Any,
        style: RopeStyle, eps: float,
    ) -> tuple[Any, Any]:  # fmt: skip
        n_tok = q.shape[0]
        q_out = np.empty((n_tok, q.shape[1] // head_dim, head_dim), dtype=F32)
        k_out = np.empty((n_tok, k.shape[1] // head_dim, head_dim), dtype=F32)
        has_norm = q_norm is not None
        nk.qk_norm_rope(
            contiguous_rows(q), contiguous_rows(k), q_norm if has_norm else _NO_NORM, k_norm if has_norm else _NO_NORM,
            has_norm, cos, sin, style is RopeStyle.NEOX, F32(eps), q_out, k_out,
        )  # fmt: skip
        return q_out, k_out

    def gated_mlp(self, x: Any, w_gate_up: Any, w_down: Any, activation: Activation) -> Any:
        if not isinstance(w_gate_up, PackedWeight):
            return super().gated_mlp(x, w_gate_up, w_down, activation)
        gate_up = self.matmul(x, w_gate_up)  # [T, 2F]: one product
        n_tok, n_ff = gate_up.shape[0], gate_up.shape[1] // 2
        act = np.empty((n_tok, n_ff), dtype=F32)
        parallel = self.threads > 1 and n_tok >= ACTIVATION_PARALLEL_MIN_ROWS
        nk.gated_activation(gate_up, activation is Activation.GELU_TANH, parallel, act)
        return self.matmul(act, w_down)

    # ---- products -------------------------------------------------------------------------------
    def packed_matmul(
        self, x: np.ndarray, w: PackedWeight, *, by_row: bool | None = None, q8: bool | None = None
    ) -> np.ndarray:
        """x [M, K] float32 (C order) @ W^T in the packed kernel -> [M, N]: with q8 (default: `self.q8`)
        x quantized to int8 per block and integer dot products (`numba_q8`: a tiled weight); else one token
        row at a time up to BY_ROW_MAX_ROWS rows, above each weight block decoded once for a group of rows
        (by_row and q8 force either: the benchmarks and tests compare them; the float32 kernels read a tiled
        weight's rows in order from a copy)."""
        m, k = x.shape
        parallel = (
            self.threads > 1 and m * w.values.nbytes >= PARALLEL_MIN_BYTES
        )  # the scales' bytes: not worth a sum a call
        if w.tiled and (self.q8 if q8 is None else q8):
            return numba_q8.product(x, w, parallel)
        w = w.natural()
        y = np.empty((m, w.shape[0]), dtype=F32)
        has_min = w.min is not None
        if by_row is None:
            by_row = m <= BY_ROW_MAX_ROWS and not self.batch_invariant
        xsum = x.reshape(m, k // w.block, w.block).sum(axis=-1) if has_min else _DUMMY_2D
        kernel = nk.matmul_packed if parallel else nk.matmul_packed_serial
        kernel(x, xsum, w.values, w.scale, _mins(w), has_min, w.block, by_row, not self.batch_invariant, y)
        return y

    def blas_matmul(self, x: np.ndarray, w: PackedWeight) -> np.ndarray:
        """x @ W^T through BLAS, the weight dequantized a chunk of rows at a time (one buffer reused) on this
        thread: a numba parallel region between BLAS calls would compete with BLAS's spinning threads."""
        n, k = w.shape
        y = np.empty((x.shape[0], n), dtype=F32)
        step = max(1, DEQUANT_CHUNK_BYTES // (4 * k))
        if w.tiled:  # chunks of whole tiles
            step = -(-step // TILE_ROWS) * TILE_ROWS
        buf = np.empty((min(step, n), k), dtype=F32)
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            chunk = self.dequantize(w.rows(lo, hi), buf[: hi - lo], parallel=False)
            np.matmul(x, chunk.T, out=y[:, lo:hi])
        return y

    def matmul(self, x: Any, w: Any) -> Any:
        if not isinstance(w, PackedWeight):
            return super().matmul(x, w)
        x = np.ascontiguousarray(x, dtype=F32)
        m = x.shape[0]
        q8 = self.q8 and w.tiled
        if m <= PACKED_MAX_ROWS or (q8 and m <= Q8_MAX_ROWS) or self.batch_invariant:
            return self.packed_matmul(x, w)
        return self.blas_matmul(x, w)

    def project(self, x: Any, w_fused: Any, sizes: tuple[int, ...], bias: Any | None = None) -> list[Any]:
        """One product over the fused weight (the fused bias added), returned as column views per block."""
        if not isinstance(w_fused, PackedWeight):
            return super().project(x, w_fused, sizes, bias)
        y = self.matmul(x, w_fused)
        if bias is not None:
            y += bias
        out, col = [], 0
        for n in sizes:
            out.append(y[:, col : col + n])
            col += n
        return out

    def quantize_int8(self, x: Any, group: int | None = None) -> tuple[Any, Any]:
        """`NumpyOps.quantize_int8` by `numba_kernels.quantize_int8_blocks` (the same bits) for float32 x."""
        d = x.shape[-1]
        g = d if group is None else group
        if x.dtype != np.float32 or d % g:
            return super().quantize_int8(x, group)
        rows = np.ascontiguousarray(x).reshape(-1, d)
        q = np.empty(rows.shape, dtype=np.int8)
        scale = np.empty((rows.shape[0], d // g), dtype=np.float32)
        nk.quantize_int8_blocks(rows, g, q, scale)
        return q.reshape(x.shape), scale.reshape(*x.shape[:-1], d // g)

    # ---- K/V store and attention ----------------------------------------------------------------
    def store_kv(self, k: Any, v: Any, k_pool: Any, v_pool: Any, pos0: int, ring_capacity: int = 0) -> None:
        """`NumpyOps.store_kv`: a chunk into an f16 pool by `numba_kernels.store_f16` (rounding as numpy's cast),
        else slice copies where the slots are one run (every decode step)."""
        n = k.shape[0]
        first = pos0 % ring_capacity if ring_capacity else pos0
        pools_c = k_pool.flags.c_contiguous and v_pool.flags.c_contiguous
        if n >= STORE_KERNEL_MIN_ROWS and k_pool.dtype == np.float16 and pools_c:
            nk.store_f16(
                contiguous_rows(k.reshape(n, -1)), contiguous_rows(v.reshape(n, -1)), k_pool.view(np.uint16),
                v_pool.view(np.uint16), first, ring_capacity,
            )  # fmt: skip
            return
        if ring_capacity and first + n > ring_capacity:
            super().store_kv(k, v, k_pool, v_pool, pos0, ring_capacity)
            return
        k_pool[first : first + n] = k
        v_pool[first : first + n] = v

    def store_kv_rows(
        self, k: Any, v: Any, k_arena: Any, v_arena: Any, slots: list[int], positions: list[int]
    ) -> None:
        """A batched decode step's K/V, row b of k, v [B, Hkv, D] into position positions[b] of slot slots[b] of
        a layer's arena [n_slots, capacity, Hkv, D] (f16 by `numba_kernels.store_f16_rows`, rounding as numpy's
        cast; f32 by a scatter)."""
        n = k.shape[0]
        if k_arena.dtype == np.float16 and k_arena.flags.c_contiguous and v_arena.flags.c_contiguous:
            nk.store_f16_rows(
                contiguous_rows(k.reshape(n, -1)), contiguous_rows(v.reshape(n, -1)), k_arena.view(np.uint16),
                v_arena.view(np.uint16), np.asarray(slots, dtype=np.int64), np.asarray(positions, dtype=np.int64),
            )  # fmt: skip
            return
        k_arena[slots, positions], v_arena[slots, positions] = k, v

    # ---- attention ------------------------------------------------------------------------------
    def attention(
        self,
        q: Any,
        k: Any,
        v: Any,
        *,
        q_pos0: int,
        k_pos0: int,
        window: int | None,
        scale: float,
        softcap: float = 0.0,
        ring_capacity: int = 0,
        k_scale: Any = None,
        v_scale: Any = None,
    ) -> Any:
        """`NumpyOps.attention` over K/V as stored (f32, f16, or int8 with k_scale / v_scale [S, Hkv,
        D / block]): the tiled kernel (longer chunks in blocks of ATTN_KERNEL_MAX_TOKENS queries), or key
        blocks through BLAS for wide heads deep in a context; neither converts more than a block of keys to
        float32 at once."""
        n_tok = q.shape[0]
        k_hi = q_pos0 + n_tok if ring_capacity else k_pos0 + k.shape[0]
        k_lo = k_pos0 if window is None else max(k_pos0, q_pos0 - window + 1)
        blas = (
            not self.batch_invariant
            and q.shape[2] >= ATTN_BLAS_MIN_HEAD_DIM
            and q_pos0 - k_lo >= ATTN_BLAS_MIN_HELD
        )
        if n_tok > ATTN_KERNEL_MAX_TOKENS and not blas:
            out = np.empty((n_tok, q.shape[1] * q.shape[2]), dtype=F32)
            has_scales = k_scale is not None
            nk.attention_blocks(
                np.ascontiguousarray(q, dtype=F32), F32(scale), F32(softcap), storage_view(k), storage_view(v),
                k_scale if has_scales else _DUMMY_3D, v_scale if has_scales else _DUMMY_3D, has_scales, q_pos0, k_lo,
                k_pos0, ring_capacity, window or 0, ATTN_KERNEL_MAX_TOKENS, out,
            )  # fmt: skip
            return out
        if n_tok > ATTN_KERNEL_MAX_TOKENS:
            n = k_hi - k_pos0
            first = k_pos0 if ring_capacity else 0
            keys = StoredRows(k, k_scale, first, n, ring_capacity)
            values = StoredRows(v, v_scale, first, n, ring_capacity)
            return blocked_attention(
                np, q, keys, values, q_pos0=q_pos0, k_pos0=k_pos0, window=window, scale=scale, softcap=softcap,
                key_block=ATTN_BLAS_KEY_BLOCK, out_dtype=F32, softmax_step=nk.online_softmax_step,
            )  # fmt: skip
        return self.attention_kernel(
            q, k, v, k_scale, v_scale, q_pos0=q_pos0, k_lo=k_lo, k_hi=k_hi, base=k_pos0,
            capacity=ring_capacity, window=window or 0, scale=scale, softcap=softcap,
        )  # fmt: skip

    def attention_kernel(
        self, q: Any, k: Any, v: Any, k_scale: Any, v_scale: Any, *, q_pos0: int, k_lo: int, k_hi: int,
        base: int, capacity: int, window: int, scale: float, softcap: float,
    ) -> np.ndarray:  # fmt: skip
        n_tok, n_head, d = q.shape
        span = max(1, k_hi - k_lo)
        parallel = self.threads > 1 and span * n_head * n_tok >= PARALLEL_MIN_SCORES
        n_split = nk.split_count(k_lo, k_hi)
        out = np.empty((n_tok, n_head * d), dtype=F32)
        has_scales = k_scale is not None
        kernel = nk.attention if parallel else nk.attention_serial
        kernel(
            np.ascontiguousarray(q, dtype=F32), F32(scale), F32(softcap), storage_view(k), storage_view(v),
            k_scale if has_scales else _DUMMY_3D, v_scale if has_scales else _DUMMY_3D, has_scales, q_pos0, k_lo,
            base, capacity, window, n_split, out,
        )  # fmt: skip
        return out

    def attention_rows(
        self, q: Any, k: Any, v: Any, k_scale: Any, v_scale: Any, *, slots: list[int], q_pos: list[int],
        k_lo: list[int], capacity: int, window: int, scale: float, softcap: float = 0.0,
    ) -> np.ndarray:  # fmt: skip
        """A batched decode step's attention in one kernel call: row b's query q[b] [H, D] at q_pos[b] over
        keys [k_lo[b], q_pos[b]] of slot slots[b] of a layer's storage for every slot, k, v [n_slots,
        capacity, Hkv, D] (int8: with k_scale, v_scale), a ring of `capacity` where it is > 0 -> [B, H * D].
        The rows (each cut into key ranges until there are two work items a thread) run over all threads."""
        n_rows, n_head, d = q.shape
        n_split = max(nk.split_count(lo, p + 1) for p, lo in zip(q_pos, k_lo, strict=True))
        out = np.empty((n_rows, n_head * d), dtype=F32)
        has_scales = k_scale is not None
        nk.attention_rows(
            np.ascontiguousarray(q, dtype=F32), F32(scale), F32(softcap), storage_view(k), storage_view(v),
            k_scale if has_scales else _DUMMY_4D, v_scale if has_scales else _DUMMY_4D, has_scales,
            np.asarray(slots, dtype=np.int64), np.asarray(q_pos, dtype=np.int64), np.asarray(k_lo, dtype=np.int64),
            capacity, window, n_split, out,
        )  # fmt: skip
        return out

    def warm_attention(self, k: Any, v: Any, k_scale: Any = None, v_scale: Any = None) -> None:
        """The attention kernels over the first slot of this storage (a layer's views; the batched step's
        over every slot's) and the BLAS path's softmax step: the parallel one runs from PARALLEL_MIN_SCORES only, which no warm-up pass reaches, and would otherwise be compiled or
        loaded in the first request that attends that far (a 16-token prompt at ~7,300 SmolLM2 keys)."""
        n_head = k.shape[1]
        q = np.zeros((1, n_head, k.shape[2]), dtype=F32)
        has_scales = k_scale is not None
        for kernel in (nk.attention, nk.attention_serial):
            kernel(
                q, F32(1), F32(0), storage_view(k[:1]), storage_view(v[:1]), k_scale[:1] if has_scales else _DUMMY_3D,
                v_scale[:1] if has_scales else _DUMMY_3D, has_scales, 0, 0, 0, 0, 0, 1,
                np.empty((1, n_head * k.shape[2]), dtype=F32),
            )  # fmt: skip
        nk.attention_blocks(
            q, F32(1), F32(0), storage_view(k[:1]), storage_view(v[:1]), k_scale[:1] if has_scales else _DUMMY_3D,
            v_scale[:1] if has_scales else _DUMMY_3D, has_scales, 0, 0, 0, 0, 0, ATTN_KERNEL_MAX_TOKENS,
            np.empty((1, n_head * k.shape[2]), dtype=F32),
        )  # fmt: skip
        one = np.zeros(1, dtype=np.int64)
        nk.attention_rows(
            q, F32(1), F32(0), storage_view(k[None, :1]), storage_view(v[None, :1]),
            k_scale[None, :1] if has_scales else _DUMMY_4D, v_scale[None, :1] if has_scales else _DUMMY_4D,
            has_scales, one, one, one, 0, 0, 1, np.empty((1, n_head * k.shape[2]), dtype=F32),
        )  # fmt: skip
        # the BLAS key blocks' softmax (a wide head deep in a context: gemma3's global layers)
        nk.online_softmax_step(
            np.zeros((1, 1), F32), np.full(1, -np.inf, F32), np.zeros(1, F32), np.zeros((1, 1), F32)
        )
