"""What the model families share: weight loading with shape checks, and the K/V access they call."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ..config import ModelConfig
from ..errors import MissingTensor, TensorShapeMismatch
from ..gguf import GGUFFile, dequantize_tensor
from ..ops import Ops
from ..ops.packed import PackedWeight, pack_tensor, stack_rows


class KVAccess(Protocol):
    """What a forward pass needs from the K/V placement (see kv.placement): store the chunk's K/V
    [T, Hkv, D] at positions pos0.., then (q given) attend over everything the queries may see."""

    def attend(
        self,
        layer: int,
        pos0: int,
        q: Any | None,
        k_new: Any,
        v_new: Any,
        *,
        q_pos0: int,
        window: int | None,
        scale: float,
    ) -> Any | None: ...


RopeTables = dict[float, tuple[Any, Any]]  # RoPE base -> (cos, sin) [T, rope_dim / 2]


def logits_row(ops: Ops, a: Any, row: Any | None) -> Any:
    """The row of a [T, ...] whose logits are wanted, as [1, ...]: the last one (row None), or the one
    a device int32 [1] names (a captured step padded past its last token: graph.py)."""
    return a[-1:] if row is None else ops.take_row(a, row)


def rope_tables(ops: Ops, config: ModelConfig, pos0: int, n: int) -> RopeTables:
    """The cos / sin tables of positions pos0 .. pos0 + n - 1 for every RoPE base the layers use."""
    return {
        base: ops.rope_tables(pos0, n, base, config.rope_dim)
        for base in {lc.rope_base for lc in config.layers}
    }


class WeightLoader:
    """Loads named tensors, checking each shape (numpy order): dequantized to the compute dtype, or, for
    ops that pack weights (`Ops.packs_weights`), quantized matrices repacked from their GGUF blocks."""

    def __init__(self, gguf_file: GGUFFile, ops: Ops):
        self.file = gguf_file
        self.ops = ops

    def __call__(self, name: str, shape: tuple[int, ...]) -> Any:
        packed = self._packed(name, shape)
        return packed if packed is not None else self.ops.weight(self._host(name, shape))

    def fused(self, *named: tuple[str, tuple[int, ...]]) -> Any:
        """Weights with one input size stacked by rows ([W_1; W_2; ...]): one product computes all."""
        packed = [self._packed(name, shape) for name, shape in named]
        if all(p is not None for p in packed):
            return stack_rows(packed)
        return self.ops.weight(np.concatenate([self._host(name, shape) for name, shape in named]))

    def _info(self, name: str, shape: tuple[int, ...]) -> Any:
        info = self.file.tensors.get(name)
        if info is None:
            raise MissingTensor(f"{self.file.path}: tensor {name!r} is missing")
        if info.shape != shape:
            raise TensorShapeMismatch(f"{self.file.path}: tensor {name!r} has shape {info.shape}, expected {shape}")
        return info

    def _packed(self, name: str, shape: tuple[int, ...]) -> PackedWeight | None:
        """The tensor packed (None: the ops do not pack, or it is a vector or a float tensor)."""
        info = self._info(name, shape)
        if not self.ops.packs_weights or len(shape) != 2:
            return None
        return pack_tensor(self.file.tensor_bytes(name), info.ggml_type, shape, name)

    def _host(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        self._info(name, shape)
        return dequantize_tensor(self.file, name)
