"""A blocked transpose compiled by numba, imported by ``llamacpp.transpose_into`` only where the process has
numba loaded already: llama.cpp's transposed V ([value][cell]) to rows and back, 8x8 elements at a time
(numpy's strided copy: about 2x slower on SmolLM2's V, bench/sessionfile/DECISIONS.md).
"""

from __future__ import annotations

from numba import njit

TILE = 8  # 8x8 two-byte elements: each source row's 16 bytes read once per tile


@njit(cache=True, nogil=True, boundscheck=False)
def transpose_blocked(dst, src):  # pragma: no cover - compiled; checked against numpy in the tests
    """dst[i, j] = src[j, i] for all i < dst.shape[0], j < dst.shape[1]."""
    n_i, n_j = dst.shape
    full_i, full_j = n_i - n_i % TILE, n_j - n_j % TILE
    for ib in range(0, full_i, TILE):
        for jb in range(0, full_j, TILE):
            for j in range(
                jb, jb + TILE
            ):  # along a source row: 1.6 ms against 1.9 the other way (SmolLM2's V)
                for i in range(ib, ib + TILE):
                    dst[i, j] = src[j, i]
        for i in range(ib, ib + TILE):
            for j in range(full_j, n_j):
                dst[i, j] = src[j, i]
    for i in range(full_i, n_i):
        for j in range(n_j):
            dst[i, j] = src[j, i]
