"""`Ops`: the interface every backend's numeric operations implement (`NumpyOps`, `CupyOps`).

Models, the K/V code and the session adapter are written against this type; a backend is one class
that implements it (`ops.OPS_OF_BACKEND`). Shapes: T tokens, S key positions, H query heads, Hkv K/V
heads, D head dim, E embedding; weights as ggml stores them, [out, in].
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ..config import Activation, RopeStyle


class Ops(Protocol):
    name: str  # the backend (settings.Backend)
    xp: Any  # the array module: numpy or cupy
    dtype: np.dtype  # the compute dtype
    packs_weights: bool  # weights are `packed.PackedWeight`s made from the GGUF blocks
    attends_in_place: bool  # `attention` reads the pool's storage (f16, int8 + scales) itself (kv/cpu.py)
    compiles_kernels: bool  # the first call of a kernel compiles it (or loads it from disk): warm up first
    # the pool's copies (a SAVE's reads, a restore's writes) run on a stream of their own, beside the steps:
    # a session verb holds the steps from its start
    copies_beside_steps: bool

    # ---- data movement ---------------------------------------------------------------------------
    def asarray(self, host: np.ndarray, dtype: Any = None) -> Any:
        """A host array on the backend (converted to `dtype` first when given)."""

    def to_host(self, arr: Any) -> np.ndarray: ...

    def weight(self, host_f32: np.ndarray) -> Any:
        """A dequantized weight in the compute dtype on the backend."""

    def packed_layout(self, w: Any) -> Any:
        """With `packs_weights`: a packed weight in the layout this backend's products read (made once at load)."""

    def copy_bytes(self, dest: Any, offset: int, src: Any) -> None:
        """dest[offset:offset + src.nbytes] = src for flat uint8 arrays; a copy into device memory may only
        be queued (it has run after `flush_copies` and `synchronize`)."""

    def flush_copies(self) -> None:
        """Start every copy `copy_bytes` still holds back."""

    def synchronize(self) -> None:
        """Wait for all queued backend work (before host memory it writes is read or reused)."""

    def take_row(self, a: Any, row: Any) -> Any:
        """Row `row` (an int32 [1] array, read at run time) of a [T, ...] as a [1, ...] array."""

    # ---- the forward pass ------------------------------------------------------------------------
    def embed(self, table: Any, ids: Any, scale: float = 1.0) -> Any:
        """Rows of `table` [V, E] for `ids` [T] -> [T, E], times `scale`."""

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any: ...

    def add_rms_norm(self, x: Any, y: Any, w_post: Any | None, w_next: Any, eps: float) -> tuple[Any, Any]:
        """x' = x + (rms_norm(y) * w_post, or y), and rms_norm(x') * w_next."""

    def silu(self, x: Any) -> Any: ...

    def gelu_tanh(self, x: Any) -> Any: ...

    def matmul(self, x: Any, w: Any) -> Any:
        """x [T, in] @ W^T for W [out, in] -> [T, out] in the compute dtype."""

    def project(self, x: Any, w_fused: Any, sizes: tuple[int, ...], bias: Any | None = None) -> list[Any]:
        """x @ W^T (+ bias) for W = [W_1; W_2; ...] (blocks of `sizes` rows) and a fused bias [sum(sizes)]
        where given: one [T, size] array per block."""

    def gated_mlp(self, x: Any, w_gate_up: Any, w_down: Any, activation: Activation) -> Any: ...

    def rope_tables(
        self, pos0: int, n: int, base: float, rope_dim: int, factors: tuple[float, ...] | None = None,
        scale: float = 1.0,
    ) -> tuple[Any, Any]:  # fmt: skip
        """cos, sin [n, rope_dim / 2] for positions pos0 .. pos0 + n - 1, frequency i divided by factors[i]
        where given, both multiplied by `scale`."""

    def rope(self, x: Any, cos: Any, sin: Any, style: RopeStyle) -> Any: ...

    def qk_norm_rope(
        self, q: Any, k: Any, head_dim: int, q_norm: Any | None, k_norm: Any | None, cos: Any, sin: Any,
        style: RopeStyle, eps: float,
    ) -> tuple[Any, Any]:  # fmt: skip
        """Projections q [T, H*D], k [T, Hkv*D] -> rotated (and, with the norms, per-head normalised)
        q [T, H, D], k [T, Hkv, D]."""

    def store_kv(self, k: Any, v: Any, k_pool: Any, v_pool: Any, pos0: int, ring_capacity: int = 0) -> None:
        """k, v [T, Hkv, D] into pool slots in the pool's dtype (slot = position, or position % capacity)."""

    def attention(
        self, q: Any, k: Any, v: Any, *, q_pos0: int, k_pos0: int, window: int | None, scale: float,
        softcap: float = 0.0, ring_capacity: int = 0,
    ) -> Any:  # fmt: skip
        """Causal (optionally sliding-window) GQA attention: q [T, H, D] over k, v [S, Hkv, D] -> [T, H*D].
        Scores are q k^T * scale, then softcap * tanh(s / softcap) where softcap > 0 (gemma2), then masked."""

    def warm_attention(self, k: Any, v: Any, k_scale: Any = None, v_scale: Any = None) -> None:
        """With `compiles_kernels`: compile (or load) the attention kernels for this storage that a warm-up's
        short forward passes do not reach (their parallel twins)."""

    def logits(self, x: Any, w_out: Any, softcap: float = 0.0) -> np.ndarray:
        """x [T, E] @ W_out^T accumulated in float32 whatever the compute dtype -> host float32 [T, V],
        soft-capped (softcap * tanh(z / softcap)) where softcap > 0."""

    # ---- int8 K/V --------------------------------------------------------------------------------
    def quantize_int8(self, x: Any, group: int | None = None) -> tuple[Any, Any]: ...

    def dequantize_int8(self, q: Any, scale: Any) -> Any: ...


class InPlaceOps(Ops, Protocol):
    """`Ops` with `attends_in_place` (`NumbaOps`): also a batched decode step's stores and attention over a
    layer's arena of every slot's storage [n_slots, capacity, Hkv, D] (what `kv.cpu.InPlacePlacement` calls)."""

    def attention(
        self, q: Any, k: Any, v: Any, *, q_pos0: int, k_pos0: int, window: int | None, scale: float,
        softcap: float = 0.0, ring_capacity: int = 0, k_scale: Any = None, v_scale: Any = None,
    ) -> Any:  # fmt: skip
        """`Ops.attention` where k and v may also be the pool's storage (f16; int8 with k_scale, v_scale)."""

    def store_kv_rows(
        self, k: Any, v: Any, k_arena: Any, v_arena: Any, slots: list[int], positions: list[int]
    ) -> None:
        """Row b of k, v [B, Hkv, D] into position positions[b] of slot slots[b]."""

    def attention_rows(
        self, q: Any, k: Any, v: Any, k_scale: Any, v_scale: Any, *, slots: list[int], q_pos: list[int],
        k_lo: list[int], capacity: int, window: int, scale: float, softcap: float = 0.0,
    ) -> np.ndarray:  # fmt: skip
        """Row b's query q[b] [H, D] at q_pos[b] over keys [k_lo[b], q_pos[b]] of slot slots[b] -> [B, H * D]."""
