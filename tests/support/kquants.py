"""A K-quant quantizer for the test files: gguf-py 0.19 dequantizes Q4_K, Q5_K and Q6_K but does not quantize
them (its `quantize` raises NotImplementedError), so the tiny family models' K-quant files are encoded here.

Any valid encoding serves: strata-engine and llama.cpp read the same file, and transformers is given the weights
the file holds (dequantized by gguf-py). The encoding is the inverse of gguf-py's `dequantize_blocks` (the
layouts below), with plain round-to-nearest scales (llama.cpp's quantizer searches for better ones; that changes
the values written, not what a reader must compute). tests/engine/test_kquants.py checks the round trip through
gguf-py's dequantization.

    Q4_K / Q5_K: 256-value super-blocks of 8 sub-blocks of 32; w = d * sc[j] * q - dmin * m[j], q in 0..15
        (0..31), sc and m 6-bit; Q6_K: 16 sub-blocks of 16, w = d * sc[j] * (q - 32), q in 0..63, sc int8.
"""

from __future__ import annotations

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
QK_K = 256


def _f16(x: np.ndarray) -> np.ndarray:
    """[n] float32 -> [n, 2] bytes of f16, and the f16 value back as float32 (what the reader multiplies by)."""
    h = x.astype(np.float16)
    return h.reshape(-1, 1).view(np.uint8), h.astype(np.float32)


def _six_bit(x: np.ndarray, top: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n, 8] non-negative sub-block values -> their 6-bit multiples of top / 63 and the f16 step top / 63."""
    step_bytes, step = _f16(top / 63)
    safe = np.where(step > 0, step, 1)[:, None]
    return np.clip(np.rint(x / safe), 0, 63).astype(np.uint8), step_bytes


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """[n, 8] 6-bit scales and mins -> Q4_K's 12 bytes (the inverse of gguf's Q4_K.get_scale_min)."""
    lo_sc, hi_sc = sc[:, :4], sc[:, 4:]
    lo_m, hi_m = m[:, :4], m[:, 4:]
    return np.concatenate(
        [lo_sc | ((hi_sc >> 4) << 6), lo_m | ((hi_m >> 4) << 6), (hi_sc & 0x0F) | ((hi_m & 0x0F) << 4)],
        axis=1,
    ).astype(np.uint8)


def _scale_min_blocks(blocks: np.ndarray, top_q: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[n, 256] -> the header bytes (d, dmin, scales: 16), q [n, 8, 32] in 0..top_q."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0)  # a sub-block's min is -dmin * m <= 0
    scale = (sub.max(axis=-1) - lo) / top_q
    sc, d_bytes = _six_bit(scale, scale.max(axis=-1))
    m, dmin_bytes = _six_bit(-lo, (-lo).max(axis=-1))
    d = d_bytes.view(np.float16).astype(np.float32)
    dmin = dmin_bytes.view(np.float16).astype(np.float32)
    step = d * sc.astype(np.float32)  # d [n, 1]
    offset = (dmin * m.astype(np.float32))[..., None]
    q = np.rint((sub + offset) / np.where(step > 0, step, 1)[..., None])
    q = np.clip(q, 0, top_q).astype(np.uint8)
    return np.concatenate([d_bytes, dmin_bytes, _pack_scales(sc, m)], axis=1), q


def _nibbles(q: np.ndarray) -> np.ndarray:
    """q [n, 8, 32] (low 4 bits used) -> 128 bytes: byte 32c + i holds sub-block 2c's value i low, 2c + 1's high."""
    q = q.reshape(q.shape[0], 4, 2, 32) & 0x0F
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(q.shape[0], 128)


def quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    header, q = _scale_min_blocks(blocks, 15)
    return np.concatenate([header, _nibbles(q)], axis=1)


def quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    """Q4_K's with 32 bytes of high bits between header and nibbles: bit j of byte i is sub-block j's value i's."""
    header, q = _scale_min_blocks(blocks, 31)
    high = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    return np.concatenate([header, high, _nibbles(q)], axis=1)


def quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """ql (128: value 128h + 64k + i's low 4 bits in byte 64h + i, nibble k), qh (64: value 128h + 32s + i's
    high 2 bits in byte 32h + i, bits 2s), 16 int8 scales, d."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    amax = np.abs(sub).max(axis=-1)
    scale = amax / 31  # q - 32 in -31..31 holds +-amax
    d_bytes, d = _f16(np.abs(scale).max(axis=-1) / 127)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1)[:, None]), -128, 127).astype(np.int8)
    step = d[:, None] * sc.astype(np.float32)
    q = np.rint(sub / np.where(step != 0, step, 1)[..., None])
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, QK_K)
    low = (q & 0x0F).reshape(n, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    high = (q >> 4).reshape(n, 2, 4, 32)
    qh = (high << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(axis=2, dtype=np.uint8)
    return np.concatenate([ql, qh.reshape(n, 64), sc.view(np.uint8), d_bytes], axis=1)


K_QUANTIZERS = {T.Q4_K: quantize_q4_k, T.Q5_K: quantize_q5_k, T.Q6_K: quantize_q6_k}


def quantize(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """`gguf.quants.quantize`, with the K-quants it lacks: [..., K] float32 -> [..., K / 256 * bytes] uint8."""
    if qtype not in K_QUANTIZERS:
        return gguf.quants.quantize(data, qtype)
    if data.shape[-1] % QK_K:
        raise ValueError(f"{qtype.name}: a row of {data.shape[-1]} values is not whole {QK_K}-value blocks")
    blocks = data.astype(np.float32).reshape(-1, QK_K)
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    out = K_QUANTIZERS[qtype](blocks)
    assert out.shape[1] == type_size, (qtype.name, out.shape)
    return out.reshape(*data.shape[:-1], data.shape[-1] // QK_K * type_size)
