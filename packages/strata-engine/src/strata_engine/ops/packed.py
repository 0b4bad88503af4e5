"""Weights kept compact: a GGUF tensor's quantized blocks repacked once at load into the layout the
compiled CPU kernels read (`numba_kernels.py`), without changing a single weight's value.

    w = q * scale + min (min None: 0), per block of 32 values (16 for Q6_K, whose sub-blocks carry
    their own scale); scale and min [N, K / block] as f16 (their uint16 bits) where every one is an
    f16 (the GGUF's own d and m), else float32.
    4-bit types: q in 0..15, two a byte, uint8 [N, K / 2] (byte j of a block holds value j in its low
        nibble and value j + 16 in its high one, as Q4_0 / Q4_1 store them);
    the others: q int8 [N, K].

Every supported ggml type maps exactly (PACKERS):

    Q4_0 -> 4-bit, min = -8 scale     Q4_1 -> 4-bit, min          Q4_K -> 4-bit, scale = d sc, min = -dmin m
    Q8_0 -> int8                      Q5_0 -> int8 q - 16         Q5_1, Q5_K -> int8, min
    Q6_K -> int8 q - 32, 16-value blocks, scale = d sc

With q8 products (`numba_q8.py`) a weight is kept *tiled* (`PackedWeight.tile`): in each tile of TILE_ROWS rows
the values are stored a dword (4 bytes) of every row at a time, and the scales (mins) a block of every row at a
time, so one 64-byte load holds the same 4 bytes of 16 rows (a vector lane per output); the arrays keep their
[N, ...] shapes, so rows sliced on tile bounds stay views. A tiled int8 weight of 32-value blocks whose values
all lie in -16..15 (Q5_0's) may be kept in 5 bits (`PackedWeight.as_five_bit`): u = q + 16 as 4-bit pairs (the
4-bit layout) and a 32-bit word of high bits per block and row, `high` uint32 [N, K / 32] tiled, bit 8m + j of
it the high bit of the block's value 4j + m (so value 4j + m's bit sits at bit m * 8 of the word shifted
right by j: one shift and mask gives a dword's four high bits in place). Only tiled: `natural()` gives the
int8 weight back.

Each block's scale and min are computed as `gguf.quants`' dequantization computes them (float32 d * sc),
so `PackedWeight.dequantize()` equals `dequantize_tensor` bit for bit (tests/engine/test_ops.py). A
token reads about what the file holds (SmolLM2: 96 MB packed against a 98 MB file). Float tensors
(F32, F16, BF16) are not packed: they stay dense float32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K

from ..errors import UnsupportedTensorType

T = GGMLQuantizationType
F32 = np.float32
QK = 32  # values per block of the 32-value types
TILE_ROWS = 16  # rows interleaved in a tiled weight: a 64-byte vector holds a dword of each


@attrs.frozen(eq=False)
class PackedWeight:
    """A [N, K] weight: `values` int8 [N, K] or 4-bit pairs uint8 [N, K / 2] (block 32); `scale` and `min`
    [N, K / block], float32 or f16 bits (uint16); min None: zero; `high` None, or (5 bits a value, tiled only)
    uint32 [N, K / 32], the high bits of u = q + 16 whose low 4 are the pairs. Row i of the weight is row i of
    every array, or with `tiled` the rows are interleaved in tiles of TILE_ROWS (module docstring)."""

    values: np.ndarray
    scale: np.ndarray
    min: np.ndarray | None
    block: int
    tiled: bool = False
    high: np.ndarray | None = None  # 5 bits a value (module docstring): the high bits; values the low 4

    @property
    def four_bit(self) -> bool:
        return self.values.dtype == np.uint8 and self.high is None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.values.shape[0], self.scale.shape[1] * self.block)

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (self.values, self.scale, self.min, self.high) if a is not None)

    def rows(self, lo: int, hi: int) -> PackedWeight:
        """Rows [lo, hi) (views; a tiled weight's on tile bounds)."""
        if self.tiled and (lo % TILE_ROWS or (hi % TILE_ROWS and hi != self.shape[0])):
            raise ValueError(
                f"rows [{lo}, {hi}) of a tiled weight do not start and end on its {TILE_ROWS}-row tiles"
            )
        mins = None if self.min is None else self.min[lo:hi]
        high = None if self.high is None else self.high[lo:hi]
        return PackedWeight(self.values[lo:hi], self.scale[lo:hi], mins, self.block, self.tiled, high)

    def take(self, rows: np.ndarray) -> PackedWeight:
        """The rows `rows` in row order (copies: an embedding lookup)."""
        if not self.tiled:
            mins = None if self.min is None else self.min[rows]
            return PackedWeight(self.values[rows], self.scale[rows], mins, self.block)
        if self.high is not None:
            return self.natural().take(rows)
        tile, lane = np.divmod(np.asarray(rows), TILE_ROWS)

        def pick(a: np.ndarray) -> np.ndarray:
            return _tiles(a)[tile, :, lane]

        values = pick(self.values.view(np.int32)).view(self.values.dtype)
        return PackedWeight(
            values, pick(self.scale), None if self.min is None else pick(self.min), self.block
        )

    def tile(self) -> PackedWeight:
        """The weight with its rows interleaved in tiles (module docstring): N a multiple of TILE_ROWS, rows of
        whole dwords."""
        if self.tiled:
            return self
        if self.shape[0] % TILE_ROWS or self.values.shape[1] % 4:
            raise ValueError(
                f"a [{self.shape[0]}, {self.shape[1]}] weight cannot be tiled by {TILE_ROWS} rows"
            )
        mins = None if self.min is None else _interleave(self.min)
        return PackedWeight(_interleave(self.values.view(np.int32)).view(self.values.dtype), _interleave(self.scale), mins,
                            self.block, tiled=True)  # fmt: skip

    @property
    def five_bit(self) -> bool:
        return self.high is not None

    def fits_five_bits(self) -> bool:
        """Whether `as_five_bit` takes this weight."""
        plain = self.tiled and self.values.dtype == np.int8 and self.block == QK and self.min is None
        return (
            plain and self.values.size > 0 and int(self.values.min()) >= -16 and int(self.values.max()) <= 15
        )

    def as_five_bit(self) -> PackedWeight:
        """This tiled int8 weight of 32-value blocks, no min, every value in -16..15, in 5 bits a value
        (module docstring); ValueError for any other."""
        if not self.fits_five_bits():
            raise ValueError(
                "only a tiled int8 weight of 32-value blocks, no min, values in -16..15 fits 5 bits"
            )
        n, k = self.shape
        # u = q + 16 (uint8 wraps) by [tile, block, dword j, lane, byte m]: value 4j + m of the lane's row
        u = (self.values.view(np.uint8) + np.uint8(16)).reshape(n // TILE_ROWS, k // QK, 8, TILE_ROWS, 4)
        low = u & 15
        values = np.ascontiguousarray(low[:, :, :4] | (low[:, :, 4:] << 4)).reshape(
            n, k // 2
        )  # the 4-bit pairs
        bits = np.ascontiguousarray((u >> 4).transpose(0, 1, 3, 4, 2))  # [tile, block, lane, m, j]
        high = (
            np.packbits(bits, axis=-1, bitorder="little").reshape(-1, 4).view(np.uint32)
        )  # byte m: bit j (x86: LE)
        return PackedWeight(values, self.scale, None, QK, tiled=True, high=high.reshape(n, k // QK))

    def natural(self) -> PackedWeight:
        """The weight with its rows in order (a copy where it is tiled; int8 where it is in 5 bits)."""
        if not self.tiled:
            return self
        if self.high is not None:
            return PackedWeight(self._five_bit_values(self.high), _deinterleave(self.scale), None, self.block)
        mins = None if self.min is None else _deinterleave(self.min)
        values = _deinterleave(self.values.view(np.int32)).view(self.values.dtype)
        return PackedWeight(values, _deinterleave(self.scale), mins, self.block)

    def _five_bit_values(self, high: np.ndarray) -> np.ndarray:
        """q int8 [N, K] in row order from the 5-bit form (``high``: this weight's fifth bits)."""
        n, k = self.shape
        pairs = self.values.reshape(n // TILE_ROWS, k // QK, 4, TILE_ROWS, 4)
        low = np.concatenate([pairs & 15, pairs >> 4], axis=2)  # [tile, block, dword j, lane, byte m]
        words = high.view(np.uint8).reshape(n // TILE_ROWS, k // QK, TILE_ROWS, 4, 1)
        bits = np.unpackbits(words, axis=-1, bitorder="little").transpose(0, 1, 4, 2, 3)  # [.., j, lane, m]
        q = ((low | (bits << 4)) - np.uint8(16)).view(np.int8)  # u - 16 (uint8 wraps)
        return np.ascontiguousarray(q.transpose(0, 3, 1, 2, 4)).reshape(n, k)

    def int_values(self) -> np.ndarray:
        """q as int8 [N, K] (4-bit pairs unpacked), rows in order."""
        if self.tiled:
            return self.natural().int_values()
        if not self.four_bit:
            return self.values
        n = self.values.shape[0]
        pairs = self.values.reshape(n, -1, 16)
        return np.concatenate([pairs & 15, pairs >> 4], axis=-1).astype(np.int8).reshape(n, -1)

    def float_scales(self) -> tuple[np.ndarray, np.ndarray | None]:
        """scale and min as float32, rows in order."""
        if self.tiled:
            return self.natural().float_scales()
        return _as_f32(self.scale), None if self.min is None else _as_f32(self.min)

    def unpacked(self, block: int, with_min: bool) -> PackedWeight:
        """The same weight as int8 values with float32 scales per `block` values (a divisor of this
        one's block) and a min (zeros where it has none) if asked: every value unchanged, rows in order."""
        if self.tiled:  # one copy in row order, not one per array read below
            return self.natural().unpacked(block, with_min)
        scale, mins = self.float_scales()
        rep = self.block // block
        if with_min and mins is None:
            mins = np.zeros_like(scale)
        if rep > 1:
            scale = np.repeat(scale, rep, axis=1)
            mins = None if mins is None else np.repeat(mins, rep, axis=1)
        return PackedWeight(self.int_values(), scale, mins, block)

    def dequantize(self) -> np.ndarray:
        """float32 [N, K]: q * scale + min per value (numpy; the kernels' twin is NumbaOps.dequantize)."""
        if self.tiled:  # one copy in row order, not one per array read below
            return self.natural().dequantize()
        n, k = self.shape
        scale, mins = self.float_scales()
        w = self.int_values().astype(F32).reshape(n, k // self.block, self.block)
        w *= scale[..., None]
        if mins is not None:
            w += mins[..., None]
        return w.reshape(n, k)


def _tiles(a: np.ndarray) -> np.ndarray:
    """A tiled [N, C] array as [N / TILE_ROWS, C, TILE_ROWS] (element c of tile row l at [t, c, l])."""
    return a.reshape(a.shape[0] // TILE_ROWS, -1, TILE_ROWS)


def _interleave(a: np.ndarray) -> np.ndarray:
    """[N, C] rows in order -> tiled (C order, the same shape)."""
    n = a.shape[0]
    return np.ascontiguousarray(a.reshape(n // TILE_ROWS, TILE_ROWS, -1).transpose(0, 2, 1)).reshape(a.shape)


def _deinterleave(a: np.ndarray) -> np.ndarray:
    """The inverse of `_interleave`."""
    return np.ascontiguousarray(_tiles(a).transpose(0, 2, 1)).reshape(a.shape)


def _as_f32(a: np.ndarray) -> np.ndarray:
    return a.view(np.float16).astype(F32) if a.dtype == np.uint16 else a


def _compact(a: np.ndarray) -> np.ndarray:
    """float32 scales as f16 bits (uint16) where every one is an f16, else as they are."""
    half = a.astype(np.float16)
    return half.view(np.uint16) if np.array_equal(half.astype(F32), a) else a


def _f16(col: np.ndarray) -> np.ndarray:
    return col.copy().view(np.float16).astype(F32)[:, 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_0/Q4_1/Q5 nibble bytes [n, 16] -> values [n, 32]: byte j holds value j low, j + 16 high."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 32 high bits (4 bytes, little-endian) -> [n, 32] of 0 or 16."""
    bits = qh.copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)
    return ((bits & 1) << 4).astype(np.uint8)


# A packer: raw blocks [n, type_size] uint8 -> (values [n_sub, block], scale [n_sub], min [n_sub] or None)
# for the n_sub blocks of `block` values the raw blocks hold.
Packed = tuple[np.ndarray, np.ndarray, np.ndarray | None]


def _q8_0(b: np.ndarray) -> Packed:
    return b[:, 2:].copy().view(np.int8), _f16(b[:, :2]), None


def _q4_0(b: np.ndarray) -> Packed:
    d = _f16(b[:, :2])
    return _nibbles(b[:, 2:]).astype(np.int8), d, d * F32(-8)


def _q4_1(b: np.ndarray) -> Packed:
    return _nibbles(b[:, 4:]).astype(np.int8), _f16(b[:, :2]), _f16(b[:, 2:4])


def _q5_0(b: np.ndarray) -> Packed:
    return (_nibbles(b[:, 6:]) | _high_bits(b[:, 2:6])).astype(np.int8) - np.int8(16), _f16(b[:, :2]), None


def _q5_1(b: np.ndarray) -> Packed:
    return (_nibbles(b[:, 8:]) | _high_bits(b[:, 4:8])).astype(np.int8), _f16(b[:, :2]), _f16(b[:, 2:4])


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K super-block header -> per 32-value sub-block scale d*sc and min -dmin*m, [n * 8]."""
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, m = Q4_K.get_scale_min(b[:, 4:16].copy())
    return (d[:, None] * sc.astype(F32)).reshape(-1), (-(dmin[:, None] * m.astype(F32))).reshape(-1)


def _k_low_bits(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 nibble bytes -> [n, 8, 32]: sub-block 2c is the low nibbles of bytes 32c..32c+31,
    2c + 1 their high nibbles."""
    shifted = qs.reshape(len(qs), 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (shifted & 15).reshape(len(qs), 8, 32)


def _q4_k(b: np.ndarray) -> Packed:
    scale, mins = _k_scales(b)
    return _k_low_bits(b[:, 16:]).astype(np.int8).reshape(-1, 32), scale, mins


def _q5_k(b: np.ndarray) -> Packed:
    qh = b[:, 16:48].reshape(len(b), 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = (_k_low_bits(b[:, 48:]) | ((qh & 1) << 4)).astype(np.int8)
    scale, mins = _k_scales(b)
    return q.reshape(-1, 32), scale, mins


def _q6_k(b: np.ndarray) -> Packed:
    n = len(b)
    ql = b[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    qh = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = ((ql & 15).reshape(n, 2, 4, 32) | ((qh & 3).reshape(n, 2, 4, 32) << 4)).astype(np.int8) - np.int8(32)
    scale = _f16(b[:, 208:210])[:, None] * b[:, 192:208].copy().view(np.int8).astype(F32)
    return q.reshape(-1, 16), scale.reshape(-1), None


# ggml type -> its packer, the values per scale it gives, and whether they are 4-bit (0..15: two a byte).
PACKERS: dict[GGMLQuantizationType, tuple[Callable[[np.ndarray], Packed], int, bool]] = {
    T.Q4_0: (_q4_0, QK, True), T.Q4_1: (_q4_1, QK, True), T.Q4_K: (_q4_k, QK, True),
    T.Q8_0: (_q8_0, QK, False), T.Q5_0: (_q5_0, QK, False), T.Q5_1: (_q5_1, QK, False),
    T.Q5_K: (_q5_k, QK, False), T.Q6_K: (_q6_k, 16, False),
}  # fmt: skip
DENSE_TYPES = frozenset({T.F32, T.F16, T.BF16})  # kept as float32 arrays


def pack_tensor(
    raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...], name: str
) -> PackedWeight | None:
    """A 2-D tensor's raw bytes in the kernels' layout; None for a float tensor (kept dense)."""
    if ggml_type in DENSE_TYPES:
        return None
    if ggml_type not in PACKERS or len(shape) != 2:
        raise UnsupportedTensorType(
            f"tensor {name!r} ({ggml_type.name}, shape {shape}) cannot be packed for the CPU kernels "
            f"(packed: {', '.join(sorted(t.name for t in PACKERS))}, 2-D only)"
        )
    packer, block, four_bit = PACKERS[ggml_type]
    _, type_size = GGML_QUANT_SIZES[ggml_type]
    n, k = shape
    values, scale, mins = packer(np.ascontiguousarray(raw).reshape(-1, type_size))
    if four_bit:  # [n_sub, 32] in 0..15 -> 16 bytes a block
        values = values.astype(np.uint8)
        values = values[:, :16] | (values[:, 16:] << 4)
    scale = _compact(scale.reshape(n, k // block).astype(F32))
    if mins is not None:
        mins = mins.reshape(n, k // block).astype(F32)
        if scale.dtype == np.uint16 and (half_mins := _compact(mins)).dtype == np.uint16:
            mins = half_mins
        else:  # one dtype for both
            scale = _as_f32(scale)
    return PackedWeight(
        np.ascontiguousarray(values.reshape(n, -1)),
        np.ascontiguousarray(scale),
        None if mins is None else np.ascontiguousarray(mins),
        block,
    )


def stack_rows(parts: Sequence[PackedWeight]) -> PackedWeight:
    """[W_1; W_2; ...] in one layout: the parts' own when they share it, else int8 values with float32
    scales per the smallest block and a min where any part has one; every value unchanged (rows in order)."""
    parts = [p.natural() for p in parts]
    layouts = {(p.values.dtype, p.scale.dtype, p.block, p.min is None) for p in parts}
    if len(layouts) > 1:
        block = min(p.block for p in parts)
        with_min = any(p.min is not None for p in parts)
        parts = [p.unpacked(block, with_min) for p in parts]
    return PackedWeight(
        np.concatenate([p.values for p in parts]),
        np.concatenate([p.scale for p in parts]),
        None if parts[0].min is None else np.concatenate([p.min for p in parts]),
        parts[0].block,
    )
