"""Activations quantized to int8 per block for integer dot products (`--cpu-kernels numba-q8`), as llama.cpp's
Q8_0 / Q8_1 activations: a token row x ~ dx * qx per QX-value block, qx = rint(x / dx) in -127..127,
dx = max|x| / 127. A weight block's dot product is then exact in integers:

    sum_j (q_j * d + m) * (qx_j * dx) = d * dx * sum_j q_j qx_j + m * dx * sum_j qx_j

This file is the numpy oracle of that math (`quantize_rows`, `matmul_q8`); the compiled kernels are
`numba_q8.py`.
"""

from __future__ import annotations

import numpy as np

from .packed import PackedWeight

F32 = np.float32
QX = 32  # values per activation block (one scale dx)


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
    dxb = (
        np.repeat(dx, QX // w.block, axis=1) if w.block < QX else dx
    )  # the activation scale of each weight block
    scale, mins = w.float_scales()
    y = np.einsum("mnb,nb,mb->mn", dots, scale.astype(np.float64), dxb.astype(np.float64))
    if mins is not None:
        sums = qxb.sum(axis=-1).astype(np.float64)
        y += np.einsum("nb,mb->mn", mins.astype(np.float64), sums * dxb)
    return y.astype(F32)
