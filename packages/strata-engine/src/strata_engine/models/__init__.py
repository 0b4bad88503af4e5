"""Model families, one module each; `MODEL_FAMILIES` maps `general.architecture` to the class."""

from __future__ import annotations

from ..config import ModelConfig
from ..errors import UncomputedModelPart, UnsupportedArchitecture
from ..gguf import GGUFFile
from ..ops import Ops
from .common import TensorCensus, WeightLoader
from .gemma3 import Gemma3Model
from .llama import LlamaModel

Model = LlamaModel | Gemma3Model

MODEL_FAMILIES: dict[str, type[Model]] = {"llama": LlamaModel, "gemma3": Gemma3Model}


def _family(config: ModelConfig) -> type[Model]:
    try:
        return MODEL_FAMILIES[config.architecture]
    except KeyError:
        raise UnsupportedArchitecture(f"no model family for architecture {config.architecture!r}") from None


def account_tensors(config: ModelConfig, gguf_file: GGUFFile) -> None:
    """Check every tensor the family needs (present, shaped) and refuse a file holding any tensor the family
    does not compute (a Llama 3 file's `rope_freqs`, biases, expert routers, ...), before a weight is read."""
    census = TensorCensus(gguf_file)
    _family(config)(config, None, census)  # type: ignore[arg-type]  # a census needs no ops
    if unread := census.unread():
        raise UncomputedModelPart(
            [
                f"{gguf_file.path}: tensor {name!r}: the {config.architecture} family does not compute it"
                for name in unread
            ]
        )


def build_model(config: ModelConfig, ops: Ops, gguf_file: GGUFFile) -> Model:
    account_tensors(config, gguf_file)
    return _family(config)(config, ops, WeightLoader(gguf_file, ops))


__all__ = ["MODEL_FAMILIES", "Gemma3Model", "LlamaModel", "Model", "account_tensors", "build_model"]
