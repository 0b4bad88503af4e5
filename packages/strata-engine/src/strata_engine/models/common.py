"""What the model families share: weight loading with shape checks, and the K/V access they call."""

from __future__ import annotations

from typing import Any, Protocol

from ..errors import MissingTensor
from ..gguf import GGUFFile, dequantize_tensor
from ..ops import NumpyOps


class KVAccess(Protocol):
    """What a forward pass needs from the K/V placement (see kv.placement)."""

    def attend_kv(self, layer: int, pos0: int, k_new: Any, v_new: Any) -> tuple[Any, Any, int]: ...


class WeightLoader:
    """Dequantizes named tensors to the compute dtype, checking each shape (numpy order)."""

    def __init__(self, gguf_file: GGUFFile, ops: NumpyOps):
        self.file = gguf_file
        self.ops = ops

    def __call__(self, name: str, shape: tuple[int, ...]) -> Any:
        info = self.file.tensors.get(name)
        if info is None:
            raise MissingTensor(f"{self.file.path}: tensor {name!r} is missing")
        if info.shape != shape:
            raise MissingTensor(f"{self.file.path}: tensor {name!r} has shape {info.shape}, expected {shape}")
        return self.ops.weight(dequantize_tensor(self.file, name))
