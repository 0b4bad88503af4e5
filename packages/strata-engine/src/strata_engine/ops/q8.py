"""Activations quantized to int8 per block for integer dot products (`--cpu-kernels numba-q8`), as llama.cpp's
Q8_0 / Q8_1 activations: a token row x ~ dx * qx per QX-value block, qx = rint(x / dx) in -127..127,
dx = max|x| / 127. A weight block's dot product is then exact in integers:

    sum_j (q_j * d + m) * (qx_j * dx) = d * dx * sum_j q_j qx_j + m * dx * sum_j qx_j

This file is the numpy oracle of that math (`quantize_rows`, `matmul_q8`) and the layout the compiled
kernels (`numba_q8.py`) read the quantized rows in (`layout`).
"""

from __future__ import annotations

import functools

import attrs
import numpy as np

from .packed import PackedWeight

F32 = np.float32
QX = 32  # values per activation block (one scale dx)
UNIT_BYTES = 16  # bytes of a weight row a kernel lane column covers: a 4-bit block of 32 values, or 16 int8 values
GROUP_UNITS = 16  # units of a main group: four 64-byte loads, transposed so that lane l holds one unit
TAIL_UNITS = 4  # units of a tail group: one 64-byte load, 4 lanes a unit
LANES = 16  # int32 / float32 lanes of a vector (AVX-512)


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] float32 -> (qx int8 [M, K], dx float32 [M, K / QX]): v = x * (1 / dx) rounded half away from
    zero (llama.cpp's roundf) as trunc(v +- 0.5) in float32, every operation as the kernel does it."""
    m, k = x.shape
    blocks = x.reshape(m, k // QX, QX)
    dx = (np.abs(blocks).max(axis=-1) / F32(127)).astype(F32)
    inv = np.divide(F32(1), dx, out=np.zeros_like(dx), where=dx > 0)
    v = blocks * inv[..., None]
    q = (v + np.where(v >= 0, F32(0.5), F32(-0.5))).astype(np.int32).astype(np.int8)
    return q.reshape(m, k), dx


def matmul_q8(x: np.ndarray, w: PackedWeight) -> np.ndarray:
    """The oracle: x [M, K] quantized by `quantize_rows` times the packed weight, per weight block
    d * dx * (q . qx) + m * dx * sum(qx) summed in float64 -> [M, N] float32."""
    qx, dx = quantize_rows(x)
    m, k = x.shape
    n = w.shape[0]
    nb = k // w.block
    qw = w.int_values().astype(np.int64).reshape(n, nb, w.block)
    qxb = qx.astype(np.int64).reshape(m, nb, w.block)
    dots = np.einsum("nbj,mbj->mnb", qw, qxb).astype(np.float64)
    dxb = np.repeat(dx, QX // w.block, axis=1) if w.block < QX else dx  # the activation scale of each weight block
    scale, mins = w.float_scales()
    y = np.einsum("mnb,nb,mb->mn", dots, scale.astype(np.float64), dxb.astype(np.float64))
    if mins is not None:
        sums = qxb.sum(axis=-1).astype(np.float64)
        y += np.einsum("nb,mb->mn", mins.astype(np.float64), sums * dxb)
    return y.astype(F32)


def group_lanes(units: int, nibbles: bool, vector: int, lane: int) -> tuple[int, int]:
    """For a group of `units` (GROUP_UNITS or TAIL_UNITS), the unit (in the group) and the first value
    (in the unit) of the 4 consecutive values that lane `lane` of the group's vector `vector` multiplies.
    Main groups: the kernel transposes four 64-byte loads (a unit per 128-bit lane) so lane 4i + k holds
    unit 4k + i and vector j its dword j (4-bit: vectors 0-3 the low nibbles, 4-7 the high ones, values
    16 on); tail groups: lane l holds dword l % 4 of unit l // 4 (4-bit: vector 1 the high nibbles)."""
    if units == GROUP_UNITS:
        unit, dword = 4 * (lane % 4) + lane // 4, vector % 4
    else:
        unit, dword = lane // 4, lane % 4
    high = vector // 4 if units == GROUP_UNITS else vector
    return unit, (16 * high if nibbles else 0) + 4 * dword


@attrs.frozen(eq=False)
class Q8Layout:
    """Where the quantized values of a K-value row go for the kernels of one weight kind (4-bit or int8),
    4 values (a dword) at a time: `perm` [dwords] the source dword of each (K / 4: zeros, padding the last
    tail group), `lane_of` [dwords] its lane (16 a group: group * 16 + lane), and per lane `lane_block` the
    activation block its values lie in (-1: padding)."""

    perm: np.ndarray
    lane_of: np.ndarray
    lane_block: np.ndarray


@functools.cache
def layout(k: int, nibbles: bool) -> Q8Layout:
    """The kernels' layout of a K-value row for 4-bit (nibbles) or int8 weights (cached per K)."""
    unit_values = 2 * UNIT_BYTES if nibbles else UNIT_BYTES
    n_units = k // unit_values
    main = n_units // GROUP_UNITS * GROUP_UNITS
    groups = [(u0, GROUP_UNITS) for u0 in range(0, main, GROUP_UNITS)]
    groups += [(u0, TAIL_UNITS) for u0 in range(main, n_units, TAIL_UNITS)]
    perm, lane_of, lane_block = [], [], []
    for g, (u0, units) in enumerate(groups):
        n_vec = (8 if nibbles else 4) if units == GROUP_UNITS else (2 if nibbles else 1)
        for v in range(n_vec):
            for lane in range(LANES):
                unit, first = group_lanes(units, nibbles, v, lane)
                perm.append(((u0 + unit) * unit_values + first) // 4 if u0 + unit < n_units else k // 4)
                lane_of.append(g * LANES + lane)
        for lane in range(LANES):
            unit, _ = group_lanes(units, nibbles, 0, lane)
            lane_block.append((u0 + unit) * unit_values // QX if u0 + unit < n_units else -1)
    return Q8Layout(*(np.asarray(a, dtype=np.int32) for a in (perm, lane_of, lane_block)))
