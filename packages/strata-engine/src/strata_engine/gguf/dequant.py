"""Dequantization of GGUF tensors to float32 (vectorized numpy, via `gguf.quants`).

`SUPPORTED_TYPES` is the table of ggml types this engine loads; anything else is refused with an
`UnsupportedTensorType` naming the type and the tensor.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as _gguf_dequantize

from ..errors import UnsupportedTensorType
from .reader import GGUFFile, TensorInfo

T = GGMLQuantizationType
SUPPORTED_TYPES: frozenset[GGMLQuantizationType] = frozenset(
    {T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K}
)
# Rows per dequantization batch: bounds the temporary memory of the block decoders.
_ROWS_PER_BATCH = 8192


def dequantize_tensor(gguf_file: GGUFFile, name: str, rows: np.ndarray | None = None) -> np.ndarray:
    """The tensor `name` as float32 in numpy shape order; `rows` selects rows of a 2-D tensor."""
    info = gguf_file.tensors.get(name)
    if info is None:
        raise UnsupportedTensorType(f"{gguf_file.path}: no tensor named {name!r}")
    raw = gguf_file.tensor_bytes(name)
    return dequantize_raw(raw, info, rows)


def dequantize_raw(raw: np.ndarray, info: TensorInfo, rows: np.ndarray | None = None) -> np.ndarray:
    if info.ggml_type not in SUPPORTED_TYPES:
        raise UnsupportedTensorType(
            f"tensor {info.name!r} uses ggml type {info.ggml_type.name}, which this engine cannot dequantize "
            f"(supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))})"
        )
    row_len = info.shape[-1]
    n_rows = info.n_elements // row_len
    row_bytes = info.n_bytes // n_rows
    byte_rows = raw.reshape(n_rows, row_bytes)
    if rows is not None:
        byte_rows = byte_rows[np.asarray(rows)]
        out_shape: tuple[int, ...] = (len(byte_rows), row_len)
    else:
        out_shape = info.shape
    out = np.empty((len(byte_rows), row_len), dtype=np.float32)
    for start in range(0, len(byte_rows), _ROWS_PER_BATCH):
        chunk = np.ascontiguousarray(byte_rows[start : start + _ROWS_PER_BATCH])
        out[start : start + len(chunk)] = _gguf_dequantize(chunk, info.ggml_type).reshape(len(chunk), row_len)
    return out.reshape(out_shape)
