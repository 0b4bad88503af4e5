"""Model families, one module each; `MODEL_FAMILIES` maps `general.architecture` to the class."""

from __future__ import annotations

from ..config import ModelConfig
from ..errors import UnsupportedArchitecture
from ..gguf import GGUFFile
from ..ops import Ops
from .gemma3 import Gemma3Model
from .llama import LlamaModel

MODEL_FAMILIES = {"llama": LlamaModel, "gemma3": Gemma3Model}

Model = LlamaModel | Gemma3Model


def build_model(config: ModelConfig, ops: Ops, gguf_file: GGUFFile) -> Model:
    try:
        cls = MODEL_FAMILIES[config.architecture]
    except KeyError:
        raise UnsupportedArchitecture(f"no model family for architecture {config.architecture!r}") from None
    return cls(config, ops, gguf_file)


__all__ = ["MODEL_FAMILIES", "Gemma3Model", "LlamaModel", "Model", "build_model"]
