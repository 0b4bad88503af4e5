"""The engine's numeric operations on an NVIDIA GPU through CuPy: `CupyOps`, the twin of `NumpyOps`.

Same methods, same shapes, same meaning; `xp` is `cupy`. Weights live on the device in the compute
dtype (f32, f16, or bf16 where this CuPy has a bfloat16 dtype). Matrix products go to cuBLAS
(cublas.py; a fused [Wq; Wk; Wv] or [Wg; Wu] weight is one product); normalisation, RoPE and the
residual steps are hand-written kernels in `kernels.cu` (loaded by kernels.py), fused so that a decode
step issues about a dozen launches per layer; they compute in float32 whatever the storage dtype.

Attention in f16 / bf16 runs `strata_flash_attn` on the tensor cores (f16 operands, f32 accumulation
and softmax; keys read where the pool stores them, rings included); in f32 it keeps the exact path,
`blocked_attention` (attention_tiling.py: float32 matmuls over key blocks with an online softmax, so a
32K-token prefill never materialises a [H, T, S] score matrix larger than `ATTENTION_SCORE_BUDGET`).

`cupy` is imported when a `CupyOps` is made, never at module import, so this module imports on
machines without CuPy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..config import Activation, RopeStyle
from ..errors import SettingsError
from .attention_tiling import (
    ATTENTION_SCORE_BUDGET,
    FLASH_DECODE_MIN_TILES,
    FLASH_HEAD_DIMS,
    FLASH_MIN_TILES,
    blocked_attention,
    flash_splits,
    flash_tiles,
    key_block_for,
    soft_cap,
)
from .cublas import Cublas
from .kernels import ElementwiseKernels, RawKernels, c_type
from .numpy_ops import NumpyOps, rope_angles

_LOG2E = 1.4426950408889634  # the flash kernel keeps scores in base 2 (exp2)
_NULL = np.uint64(0)  # a null pointer argument for the raw kernels
MEMCPY_HOST_TO_DEVICE = 1  # cudaMemcpyKind
MEMCPY_DEVICE_TO_DEVICE = 3
# strata_gated_act's ACT template argument per activation
_GATED_ACT = {Activation.SILU: 0, Activation.GELU_TANH: 1}
WARP_ROWS_PER_BLOCK = 8  # the row kernels run one warp per row, 8 warps per block
# Steps of at most this many token rows (decode) take the decode-sized kernels: one warp per row leaves a
# norm latency-bound, and cuBLAS's products of a row leave most of the device idle (bench/gpu/DECISIONS.md "Small-row products").
SMALL_STEP_ROWS = 8
_ROW_THREADS = 256  # strata_add_rms_norm_row: one block per row
# strata_argmax_parts: a block of 256 threads per span of ~2,048 values of a row, at most 128 spans (one block per
# row of gemma3's 262K logits took 27 us of a 907 us decode step: bench/gpu/DECISIONS.md "Greedy rows decided on the device")
_ARGMAX_THREADS = 256
_ARGMAX_PART_VALUES = 2048
_ARGMAX_PARTS = 128
_ROW_VALUES = (1, 2, 4, 8, 16)  # values per thread it is compiled for (rows up to 4,096 values)
_GEMV_ROWS = (1, 2, 4, 8)  # token rows strata_gemv is compiled for
_GEMV_WARPS = 8
_COMBINE_GROUPS = 16  # strata_attn_combine_wide: thread groups per output row, each summing every 16th split
# Output rows up to which the splits merge in parallel per row (decode); a prefill chunk's many rows fill the
# device with a thread per value (gemma3's 512-row chunks: 99 vs 77 us a local layer: bench/gpu/DECISIONS.md "Decode attention").
_COMBINE_WIDE_ROWS = 512
# The layers' products take strata_gemv up to this many rows (at most SMALL_STEP_ROWS), cuBLAS beyond: at 4 and 8
# rows cuBLAS measured faster (smollm2 B=8 replay 1.45 -> 1.10 ms, gemma3 1.20 -> 0.97; bench/gpu/DECISIONS.md "Small-row products").
GEMV_ROWS = 2
# The output head takes strata_gemv up to this many rows, cuBLAS beyond: gemma3's 262,144 x 640 head at 8 rows
# costs ~0.2 ms more a step by strata_gemv (bench/gpu/DECISIONS.md "Small-row products").
HEAD_GEMV_ROWS = 2


# strata_flash_attn's CAPPED template argument: a soft-capped instance of its own, so the kernel of a model
# without a cap is the one it was.
_CAPPED = {True: "true", False: "false"}


def _device_dtypes(cp: Any) -> dict[str, np.dtype]:
    out: dict[str, np.dtype] = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16)}
    try:  # bfloat16 needs ml_dtypes and a CuPy that accepts it
        import ml_dtypes

        bf16 = np.dtype(ml_dtypes.bfloat16)
        probe = cp.ones((2, 2), dtype=bf16)
        cp.matmul(probe, probe)
        out["bf16"] = bf16
    except Exception:  # noqa: BLE001 - any failure means: not available here
        pass
    return out


class CupyOps(NumpyOps):
    """`NumpyOps` on the GPU. Host inputs (token ids, float32 weights) are uploaded; `logits` and
    `to_host` download. Internal arithmetic is float32 where the dtype is f16/bf16."""

    name = "cupy"
    copies_beside_steps = True

    def __init__(self, dtype: str = "f32"):
        try:
            import cupy as cp
        except ImportError as e:  # pragma: no cover - exercised on machines without CuPy
            raise SettingsError([f"backend 'cupy' needs the cupy package: {e}"]) from None
        if cp.cuda.runtime.getDeviceCount() < 1:  # pragma: no cover
            raise SettingsError(["backend 'cupy' found no CUDA device"])
        self.xp = cp
        dtypes = _device_dtypes(cp)
        if dtype not in dtypes:
            raise SettingsError(
                [f"compute dtype {dtype!r} is not available on the cupy backend (have: {', '.join(dtypes)})"]
            )
        self.dtype = dtypes[dtype]
        self.kernels = ElementwiseKernels(cp)
        self.raw = RawKernels(cp)
        self.cublas = Cublas(cp)
        self._memcpy_async = cp.cuda.runtime.memcpyAsync  # looked up once: copy_bytes runs per block piece
        self._pending_copy: list[int] | None = None  # [dest, src, nbytes, kind] not yet queued (copy_bytes)
        self.score_budget = ATTENTION_SCORE_BUDGET  # bytes of float32 scores per attention key block
        self.flash_min_tiles = FLASH_DECODE_MIN_TILES  # key tiles per split of a decode launch at least
        self._rope_cache: dict[tuple[float, int, tuple[float, ...] | None, float], tuple[Any, Any]] = {}

    # ---- data movement -------------------------------------------------------------------------
    def asarray(self, host: np.ndarray, dtype: Any = None) -> Any:
        host = np.asarray(host)
        if dtype is not None and host.dtype != dtype:
            host = host.astype(dtype)  # convert on the host: half the bytes cross the bus for f16
        return self.xp.ascontiguousarray(self.xp.asarray(host))

    def to_host(self, arr: Any) -> np.ndarray:
        return self.xp.asnumpy(arr) if isinstance(arr, self.xp.ndarray) else np.asarray(arr)

    def weight(self, host_f32: np.ndarray) -> Any:
        return self.asarray(host_f32, self.dtype)

    def take_row(self, a: Any, row: Any) -> Any:
        """Row `row` (a device int32 [1], read at run time) of a [T, ...] as a new [1, ...] array."""
        flat = self.xp.ascontiguousarray(a).reshape(a.shape[0], -1)
        out = self.xp.empty((1, flat.shape[1]), dtype=a.dtype)
        self.kernels.rows_at(row, flat.ravel(), np.int32(flat.shape[1]), out)
        return out.reshape(1, *a.shape[1:])

    def synchronize(self) -> None:
        """Wait for all queued device work (before a host clock is read or host memory is shared)."""
        self.flush_copies()
        self.xp.cuda.get_current_stream().synchronize()

    def flush_copies(self) -> None:
        """Queue the copy that copy_bytes is still extending, if any."""
        pending = self._pending_copy
        if pending is not None:
            self._pending_copy = None
            self._memcpy_async(*pending, self.xp.cuda.get_current_stream().ptr)

    def copy_bytes(self, dest: Any, offset: int, src: Any) -> None:
        """dest[offset:offset + src.nbytes] = src for flat contiguous uint8 arrays. Into device memory
        (from host or device) the copy is queued on the current stream, after the work before it, at the
        latest by the next `copy_bytes` that does not continue it or by `flush_copies` / `synchronize`:
        a copy whose source and destination both continue the previous one's extends it instead (a
        session block's pieces are contiguous on both sides: one DMA per block, and one call that lets
        the reader threads take the GIL instead of two or three). It may still be reading a pinned host
        `src` after this returns, until `synchronize`; a pageable one the driver has staged by then.
        Into host memory (a mapped pool's host side) it is a memcpy, done when this returns."""
        n = int(src.nbytes)
        if isinstance(dest, np.ndarray):
            dest[offset : offset + n] = src
            return
        if offset < 0 or offset + n > dest.nbytes:
            raise ValueError(f"{n} bytes at offset {offset} do not fit a {dest.nbytes}-byte array")
        if not n:
            return
        # Both sides are flat byte arrays (the pool's flat slot views, staging slices, numpy views of the
        # block buffers): contiguous by construction. Pointers are read without numpy's `ctypes` object.
        if isinstance(src, np.ndarray):
            assert src.flags.c_contiguous
            ptr, kind = src.__array_interface__["data"][0], MEMCPY_HOST_TO_DEVICE
        else:
            ptr, kind = src.data.ptr, MEMCPY_DEVICE_TO_DEVICE
        target = dest.data.ptr + offset
        pending = self._pending_copy
        if (
            pending is not None
            and pending[3] == kind
            and pending[0] + pending[2] == target
            and pending[1] + pending[2] == ptr
        ):
            pending[2] += n
            return
        self.flush_copies()
        self._pending_copy = [target, ptr, n, kind]

    # ---- elementwise and normalisation ---------------------------------------------------------
    def _row_grid(self, n_rows: int) -> tuple[tuple[int], tuple[int]]:
        return ((n_rows + WARP_ROWS_PER_BLOCK - 1) // WARP_ROWS_PER_BLOCK,), (32 * WARP_ROWS_PER_BLOCK,)

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        cp = self.xp
        x = cp.ascontiguousarray(x)
        n = x.shape[-1]
        out = cp.empty_like(x)
        n_rows = x.size // n
        kernel = self.raw.get("strata_rms_norm", c_type(x.dtype))
        w = cp.ascontiguousarray(weight.astype(x.dtype, copy=False))
        kernel(
            *self._row_grid(n_rows), (x, w, out, np.int32(n_rows), np.int32(n), np.int32(n), np.float32(eps))
        )
        return out

    def add_rms_norm(self, x: Any, y: Any, w_post: Any | None, w_next: Any, eps: float) -> tuple[Any, Any]:
        cp = self.xp
        x = cp.ascontiguousarray(x)
        y = cp.ascontiguousarray(y, dtype=x.dtype)
        n = x.shape[-1]
        n_rows = x.size // n
        x_out, h = cp.empty_like(x), cp.empty_like(x)
        post = _NULL if w_post is None else w_post
        if n_rows <= SMALL_STEP_ROWS and n <= _ROW_THREADS * _ROW_VALUES[-1]:
            nv = next(v for v in _ROW_VALUES if v * _ROW_THREADS >= n)
            kernel = self.raw.get("strata_add_rms_norm_row", c_type(x.dtype), nv)
            args: tuple[Any, ...] = (x, y, post, w_next, x_out, h, np.int32(n), np.int32(n), np.float32(eps))
            kernel((n_rows,), (_ROW_THREADS,), args)
            return x_out, h
        kernel = self.raw.get("strata_add_rms_norm", c_type(x.dtype))
        args = (x, y, post, w_next, x_out, h, np.int32(n_rows), np.int32(n), np.int32(n), np.float32(eps))
        kernel(*self._row_grid(n_rows), args)
        return x_out, h

    def silu(self, x: Any) -> Any:
        return self.kernels.silu_mul(x, self.xp.ones_like(x))

    def gelu_tanh(self, x: Any) -> Any:
        return self.kernels.gelu_tanh_mul(x, self.xp.ones_like(x))

    def matmul(self, x: Any, w: Any) -> Any:
        """x [T, in] @ W^T through cublasGemmEx (see cublas.py); other layouts through cupy.matmul."""
        if (
            x.ndim == 2 and w.ndim == 2 and x.dtype == w.dtype and x.strides[1] == x.itemsize
            and w.flags.c_contiguous and x.shape[1] == w.shape[1] and x.shape[0] > 0
        ):  # fmt: skip
            if self._gemv_fits(x, w):
                return self._gemv(x, w, w.shape[0], x.dtype, -1)
            return self.cublas.linear(self.xp, x, w)
        return x @ w.T

    def _gemv_fits(self, x: Any, w: Any) -> bool:
        """Whether strata_gemv takes x [T, in] @ w^T: a few rows of f16 / bf16, 16-byte aligned rows."""
        return (
            x.shape[0] <= min(GEMV_ROWS, SMALL_STEP_ROWS) and x.dtype != np.float32 and x.dtype == w.dtype and x.shape[1] % 8 == 0
            and x.strides[1] == x.itemsize and x.strides[0] % 16 == 0 and x.data.ptr % 16 == 0
            and w.flags.c_contiguous and w.data.ptr % 16 == 0
        )  # fmt: skip

    def _gemv(self, x: Any, w: Any, n_out: int, out_dtype: Any, act: int) -> Any:
        n_tok, n_in = x.shape
        y = self.xp.empty((n_tok, n_out), dtype=out_dtype)
        rows = next(r for r in _GEMV_ROWS if r >= n_tok)
        kernel = self.raw.get("strata_gemv", c_type(x.dtype), c_type(y.dtype), rows, act)
        args = (
            x,
            w,
            y,
            np.int32(n_tok),
            np.int32(n_in),
            np.int32(n_out),
            np.int32(x.strides[0] // x.itemsize),
        )
        kernel((-(-n_out // _GEMV_WARPS),), (32 * _GEMV_WARPS,), args)
        return y

    def project(self, x: Any, w_fused: Any, sizes: tuple[int, ...], bias: Any | None = None) -> list[Any]:
        y = self.matmul(x, w_fused)  # one product; the parts are column views of it
        if bias is not None:
            y += bias  # in place: nothing allocated inside a captured step
        out, col = [], 0
        for n in sizes:
            out.append(y[:, col : col + n])
            col += n
        return out

    def gated_mlp(self, x: Any, w_gate_up: Any, w_down: Any, activation: Activation) -> Any:
        if self._gemv_fits(x, w_gate_up) and x.shape[1] == w_gate_up.shape[1]:
            act = self._gemv(x, w_gate_up, w_down.shape[1], x.dtype, _GATED_ACT[activation])  # act(g) * u
            return self.matmul(act, w_down)
        gate_up = self.matmul(x, w_gate_up)  # [T, 2F]: gate | up, one product
        n_rows, n_ff = gate_up.shape[0], w_down.shape[1]
        act = self.xp.empty((n_rows, n_ff), dtype=gate_up.dtype)
        kernel = self.raw.get("strata_gated_act", c_type(gate_up.dtype), _GATED_ACT[activation])
        grid = (-(-n_ff // 256), max(1, min(n_rows, 65535)))
        kernel(grid, (256,), (gate_up, act, np.int32(n_rows), np.int32(n_ff), np.int32(gate_up.shape[1])))
        return self.matmul(act, w_down)  # act(gate) * up in one kernel, then the down product

    # ---- rotary position embedding -------------------------------------------------------------
    def rope_tables(
        self, pos0: int, n: int, base: float, rope_dim: int, factors: tuple[float, ...] | None = None,
        scale: float = 1.0,
    ) -> tuple[Any, Any]:  # fmt: skip
        """float32 device tables whatever the compute dtype (the kernel rotates in float32): slices of
        per-base tables made on the device (float64 angles and cos/sin, rounded once), grown by
        doubling (made on the host they cost a chunk milliseconds: bench/gpu/DECISIONS.md "Work kept on the device")."""
        key = (base, rope_dim, factors, scale)
        cos_all, sin_all = self._rope_cache.get(key, (None, None))
        if cos_all is None or cos_all.shape[0] < pos0 + n:
            cp = self.xp
            rows = max(4096, 1 << (pos0 + n - 1).bit_length())
            # float64: position 1's angles
            inv_freq = cp.asarray(rope_angles(1, 1, base, rope_dim, factors)[0])
            angles = cp.arange(rows, dtype=cp.float64)[:, None] * inv_freq[None, :]
            cos_all, sin_all = (
                (scale * cp.cos(angles)).astype(cp.float32),
                (scale * cp.sin(angles)).astype(cp.float32),
            )
            self._rope_cache[key] = (cos_all, sin_all)
        return cos_all[pos0 : pos0 + n], sin_all[pos0 : pos0 + n]

    def rope(self, x: Any, cos: Any, sin: Any, style: RopeStyle) -> Any:
        cp = self.xp
        x = cp.ascontiguousarray(x)
        n_tok, heads, dim = x.shape
        half = cos.shape[-1]
        assert cos.shape[0] == n_tok and 2 * half <= dim
        out = cp.empty_like(x)
        self.kernels.rope(x, cos, sin, heads, dim, half, style is RopeStyle.NEOX, out)
        return out

    def qk_norm_rope(
        self,
        q: Any,
        k: Any,
        head_dim: int,
        q_norm: Any | None,
        k_norm: Any | None,
        cos: Any,
        sin: Any,
        style: RopeStyle,
        eps: float,
    ) -> tuple[Any, Any]:
        cp = self.xp
        n_tok = q.shape[0]
        q, k = self._fused_columns(q, k)
        stride = q.strides[0] // q.itemsize
        n_head, n_kv = q.shape[1] // head_dim, k.shape[1] // head_dim
        q_out = cp.empty((n_tok, n_head, head_dim), dtype=q.dtype)
        k_out = cp.empty((n_tok, n_kv, head_dim), dtype=q.dtype)
        half = cos.shape[-1]
        assert cos.shape[0] == n_tok and 2 * half <= head_dim
        kernel = self.raw.get("strata_qk_norm_rope", c_type(q.dtype))
        args = (
            q, k, q_out, k_out,
            _NULL if q_norm is None else q_norm, _NULL if k_norm is None else k_norm,
            cp.ascontiguousarray(cos, dtype=cp.float32), cp.ascontiguousarray(sin, dtype=cp.float32),
            np.int32(n_tok), np.int32(n_head), np.int32(n_kv), np.int32(head_dim), np.int32(half),
            np.int32(style is RopeStyle.NEOX), np.int32(stride), np.float32(eps),
        )  # fmt: skip
        kernel(*self._row_grid(n_tok * (n_head + n_kv)), args)
        return q_out, k_out

    def _fused_columns(self, q: Any, k: Any) -> tuple[Any, Any]:
        """q, k as the kernel reads them: unit column stride and one row stride for both (the views
        `project` returns); anything else is copied into that form."""
        if q.strides[1] == q.itemsize and k.strides[1] == k.itemsize and q.strides[0] == k.strides[0]:
            return q, k
        both = self.xp.concatenate([q, k], axis=1)
        return both[:, : q.shape[1]], both[:, q.shape[1] :]

    # ---- K/V store -----------------------------------------------------------------------------
    def store_kv(
        self, k: Any, v: Any, k_pool: Any, v_pool: Any, pos0: int, ring_capacity: int = 0, dyn: Any = None
    ) -> None:
        n_tok = k.shape[0]
        assert not ring_capacity or n_tok <= ring_capacity, "two positions of one store would share a slot"
        row = k_pool.shape[1] * k_pool.shape[2]
        k2, v2 = (a.reshape(n_tok, row) for a in (k, v))  # views: rows of Hkv*D values, any row stride
        for a in (k2, v2):
            assert a.strides[1] == a.itemsize, "K/V rows must be contiguous within a token"
        kernel = self.raw.get("strata_store_kv", c_type(k.dtype), c_type(k_pool.dtype))
        total = n_tok * row
        args = (
            k2, v2, k_pool, v_pool, np.int32(n_tok), np.int32(row), np.int32(k2.strides[0] // k2.itemsize),
            np.int32(v2.strides[0] // v2.itemsize), np.int32(pos0), np.int32(ring_capacity),
            _NULL if dyn is None else dyn,
        )  # fmt: skip
        kernel((-(-total // 256),), (256,), args)

    def store_kv_rows(
        self, k: Any, v: Any, k_arena: Any, v_arena: Any, rows: Any, ring_capacity: int = 0
    ) -> None:
        """A batched decode step's K/V: row t of k, v [B, Hkv, D] into slot rows[1 + B + t]'s region of the
        layer's arena k_arena, v_arena [n_slots, capacity, Hkv, D] at position rows[1 + t], for t < rows[0]
        (rows: a device int32 [1 + 2B], read at run time; the rows past rows[0] pad a captured step)."""
        n_tok = k.shape[0]
        row = k_arena.shape[2] * k_arena.shape[3]
        k2, v2 = (a.reshape(n_tok, row) for a in (k, v))
        for a in (k2, v2):
            assert a.strides[1] == a.itemsize, "K/V rows must be contiguous within a token"
        assert k_arena.flags.c_contiguous and v_arena.strides == k_arena.strides
        kernel = self.raw.get("strata_store_kv_rows", c_type(k.dtype), c_type(k_arena.dtype))
        args = (
            k2, v2, k_arena, v_arena, np.int32(n_tok), np.int32(row), np.int32(k2.strides[0] // k2.itemsize),
            np.int32(v2.strides[0] // v2.itemsize), np.int64(k_arena.strides[0] // k_arena.itemsize),
            np.int32(ring_capacity), rows,
        )  # fmt: skip
        kernel((-(-n_tok * row // 256),), (256,), args)

    # ---- attention -----------------------------------------------------------------------------
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
    ) -> Any:
        n_q, n_head, d = q.shape
        n_kv = k.shape[1]
        if self.dtype != np.float32 and d in FLASH_HEAD_DIMS and n_head % n_kv == 0:
            return self.flash_attention(
                q,
                k,
                v,
                q_pos0=q_pos0,
                k_pos0=k_pos0,
                window=window,
                scale=scale,
                softcap=softcap,
                ring_capacity=ring_capacity,
            )
        if ring_capacity:  # the exact path reads a contiguous context: gather it from the ring
            slots = self.xp.arange(k_pos0, q_pos0 + n_q) % ring_capacity
            k, v = k[slots], v[slots]
        block = key_block_for(n_kv, (n_head // n_kv) * n_q, self.score_budget)
        return blocked_attention(
            self.xp,
            q,
            k,
            v,
            q_pos0=q_pos0,
            k_pos0=k_pos0,
            window=window,
            scale=scale,
            softcap=softcap,
            key_block=block,
            out_dtype=self.dtype,
        )

    def flash_attention(
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
        tiles: tuple[int, int] | None = None,
        dyn: Any = None,
    ) -> Any:
        """`attention` on the tensor cores (strata_flash_attn; f16 operands, f32 accumulation), with a
        split over the keys merged by strata_attn_combine when the query rows alone cannot fill the
        device. Same arguments and result (the scores soft-capped in the kernel where softcap > 0); k, v may be
        f16, bf16 or f32 whatever the compute dtype.
        `tiles` (warps, keys per tile) overrides `flash_tiles` (for benchmarks comparing shapes).
        `dyn` (a device int32 [1] holding the first query's position) makes the call position-free for
        a CUDA graph: the kernel reads q_pos0 there, and attends from slot 0 of a full layer's pool `k`
        (or the window's start in a ring); splits are sized for the most keys the step could see."""
        if dyn is not None:
            n_keys = (
                min(ring_capacity, (window or ring_capacity) + q.shape[0] - 1)
                if ring_capacity
                else k.shape[0]
            )
        else:
            n_keys = q_pos0 + q.shape[0] - k_pos0 if ring_capacity else k.shape[0]
        return self._flash(
            q, k, v, q_pos0, k_pos0, n_keys, window, scale, softcap, ring_capacity, tiles, dyn, None, 0
        )

    def flash_attention_rows(
        self,
        q: Any,
        k_arena: Any,
        v_arena: Any,
        rows: Any,
        *,
        window: int | None,
        scale: float,
        softcap: float = 0.0,
        ring_capacity: int = 0,
    ) -> Any:
        """A batched decode step's attention in one launch: query row b of q [B, H, D] (position rows[1 + b])
        over its slot's keys (slot rows[1 + B + b] of k_arena, v_arena [n_slots, capacity, Hkv, D]), as
        `flash_attention` with `dyn` attends one slot; rows: a device int32 [1 + 2B] (`store_kv_rows`).
        Key splits are sized for the most keys a row could see. Returns [B, H*D]."""
        cap = k_arena.shape[1]
        n_keys = min(ring_capacity, window or ring_capacity) if ring_capacity else cap
        return self._flash(q, k_arena, v_arena, 0, 0, n_keys, window, scale, softcap, ring_capacity, None, None,
                           rows, k_arena.strides[0] // k_arena.itemsize)  # fmt: skip

    def _flash(
        self, q: Any, k: Any, v: Any, q_pos0: int, k_pos0: int, n_keys: int, window: int | None, scale: float,
        softcap: float, ring_capacity: int, tiles: tuple[int, int] | None, dyn: Any, batch: Any, slot_stride: int,
    ) -> Any:  # fmt: skip
        """strata_flash_attn (and strata_attn_combine) over q [T, H, D], or, with `batch`, over B rows of one
        query each (q [B, H, D], k, v the arena's [n_slots, capacity, Hkv, D])."""
        cp = self.xp
        n_batch = q.shape[0] if batch is not None else 1
        n_q, n_head, d = (1, *q.shape[1:]) if batch is not None else q.shape
        n_kv = k.shape[-2]
        # The kernel moves 16-byte vectors: contiguous rows starting on a 16-byte boundary.
        q, k, v = (a if a.flags.c_contiguous and a.data.ptr % 16 == 0 else a.copy() for a in (q, k, v))
        v = v.astype(k.dtype, copy=False)
        rows = (n_head // n_kv) * n_q
        warps, key_tile = tiles or flash_tiles(d, rows)
        block_rows = 16 * warps
        row_tiles = -(-rows // block_rows)
        # A one-warp block (decode) gets a split per key tile: the parallel merge costs less than a longer walk.
        min_tiles = self.flash_min_tiles if warps == 1 else FLASH_MIN_TILES
        splits = flash_splits(row_tiles * n_kv * n_batch, n_keys, key_tile, self.raw.n_sm, min_tiles)
        out = cp.empty((n_batch * n_q, n_head * d), dtype=self.dtype)
        rows_pad = row_tiles * block_rows
        part_o = part_ml = _NULL
        if splits > 1:
            part_o = cp.empty((n_batch * splits, n_kv, rows_pad, d), dtype=cp.float32)
            part_ml = cp.empty((n_batch * splits, n_kv, rows_pad, 2), dtype=cp.float32)
        kernel = self.raw.get(
            "strata_flash_attn", c_type(q.dtype), c_type(k.dtype), c_type(out.dtype), d, warps, key_tile,
            _CAPPED[softcap > 0],
        )  # fmt: skip
        smem = (block_rows + 4 * key_tile) * (d + 8) * 2  # Q tile, two K and two V tiles, f16
        self.raw.allow_shared_memory(kernel, smem)
        args: tuple[Any, ...] = (
            q, k, v, out, part_o, part_ml, np.int32(n_q), np.int32(n_head), np.int32(n_kv), np.int32(q_pos0),
            np.int32(k_pos0), np.int32(n_keys), np.int32(ring_capacity), np.int32(window or 0),
            np.float32(scale * _LOG2E), np.float32(softcap * _LOG2E), np.int32(splits), np.int32(rows_pad),
            _NULL if dyn is None else dyn,
            _NULL if batch is None else batch, np.int64(slot_stride),
        )  # fmt: skip
        kernel((row_tiles, n_kv, splits * n_batch), (32 * warps,), args, shared_mem=smem)
        if splits > 1:
            args = (part_o, part_ml, out, np.int32(n_q), np.int32(n_head), np.int32(n_kv), np.int32(d),
                    np.int32(splits), np.int32(rows_pad), np.int32(n_batch))  # fmt: skip
            out_rows = n_batch * n_kv * rows
            if out_rows <= _COMBINE_WIDE_ROWS:
                # A block per output row: up to 16 groups of D / 4 float4 columns (no more groups than splits,
                # rounded up to a power of two so a block is whole warps).
                groups = min(_COMBINE_GROUPS, 1 << (splits - 1).bit_length())
                combine = self.raw.get("strata_attn_combine_wide", c_type(out.dtype))
                combine(
                    (out_rows,), (groups * d // 4,), args, shared_mem=4 * (-(-splits // 4) * 4 + groups * d)
                )
            else:
                combine = self.raw.get("strata_attn_combine", c_type(out.dtype))
                combine((-(-out_rows * d // 256),), (256,), args)
        return out

    # ---- int8 K/V ------------------------------------------------------------------------------
    def dequantize_int8(self, q: Any, scale: Any) -> Any:
        cp = self.xp
        block = q.shape[-1] // scale.shape[-1]
        out = cp.empty(q.shape, dtype=self.dtype)
        self.kernels.dequant_int8(
            cp.ascontiguousarray(q), cp.ascontiguousarray(scale, dtype=cp.float32), block, out
        )
        return out

    # ---- output --------------------------------------------------------------------------------
    def logits(self, x: Any, w_out: Any, softcap: float = 0.0) -> np.ndarray:
        return self.to_host(self.logits_f32(x, w_out, softcap))

    def logits_f32(self, x: Any, w_out: Any, softcap: float = 0.0) -> Any:
        """x [T, E] @ W_out^T on the device, accumulated and returned in float32 whatever the compute dtype:
        rounded to bf16, close candidates tie exactly and greedy decoding leaves f32's tokens. Soft-capped
        (softcap * tanh(z / softcap), in place: a captured step's too) where softcap > 0."""
        cp = self.xp
        x = cp.ascontiguousarray(x)
        assert x.dtype == w_out.dtype and w_out.flags.c_contiguous and x.shape[1] == w_out.shape[1]
        if x.shape[0] <= HEAD_GEMV_ROWS and self._gemv_fits(x, w_out):
            out = self._gemv(x, w_out, w_out.shape[0], cp.float32, -1)
        else:
            out = self.cublas.linear(cp, x, w_out, out_dtype=cp.float32)
        return soft_cap(cp, out, softcap)

    def argmax_rows(self, logits: Any) -> Any:
        """Each row of float32 logits [B, V]: its first maximal index (np.argmax's, NaN first) and that value,
        as one int32 device buffer [2B]: indices, then the values' bits (`sampling.Argmax.of_words`)."""
        cp = self.xp
        logits = cp.ascontiguousarray(logits, dtype=cp.float32)
        rows, n = logits.shape
        parts = max(1, min(_ARGMAX_PARTS, -(-n // _ARGMAX_PART_VALUES)))
        part_val = cp.empty((rows, parts), dtype=cp.float32)
        part_idx = cp.empty((rows, parts), dtype=cp.int32)
        out = cp.empty(2 * rows, dtype=cp.int32)
        stage = self.raw.get("strata_argmax_parts", _ARGMAX_THREADS)
        stage((parts, rows), (_ARGMAX_THREADS,), (logits, np.int32(n), part_val, part_idx))
        reduce = self.raw.get("strata_argmax_rows", _ARGMAX_THREADS)
        reduce((rows,), (_ARGMAX_THREADS,), (part_val, part_idx, np.int32(parts), out))
        return out


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy as cp

        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no cupy, no driver, no device: all mean "no"
        return False
