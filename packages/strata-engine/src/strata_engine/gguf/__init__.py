"""GGUF loading: a lean validated reader (`read_gguf`) and float32 dequantization (`dequantize_tensor`)."""

from .dequant import SUPPORTED_TYPES, dequantize_raw, dequantize_tensor
from .reader import GGUFFile, TensorInfo, read_gguf, tensor_n_bytes

__all__ = [
    "GGUFFile",
    "SUPPORTED_TYPES",
    "TensorInfo",
    "dequantize_raw",
    "dequantize_tensor",
    "read_gguf",
    "tensor_n_bytes",
]
