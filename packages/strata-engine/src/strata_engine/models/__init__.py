"""Model families, one module each; `MODEL_FAMILIES` maps `general.architecture` to the class."""

from __future__ import annotations

from ..config import ModelConfig
from ..errors import UncomputedModelPart, UnsupportedArchitecture
from ..gguf import GGUFFile
from ..ops import Ops
from .common import Decoder, TensorCensus, WeightLoader
from .gemma2 import Gemma2Model
from .gemma3 import Gemma3Model
from .llama import LlamaModel
from .phi3 import Phi3Model
from .qwen2 import Qwen2Model
from .qwen3 import Qwen3Model

Model = Decoder

MODEL_FAMILIES: dict[str, type[Model]] = {
    "llama": LlamaModel, "qwen2": Qwen2Model, "qwen3": Qwen3Model, "phi3": Phi3Model, "gemma2": Gemma2Model,
    "gemma3": Gemma3Model,
}  # fmt: skip


def _family(config: ModelConfig) -> type[Model]:
    try:
        return MODEL_FAMILIES[config.architecture]
    except KeyError:
        raise UnsupportedArchitecture(f"no model family for architecture {config.architecture!r}") from None


def account_tensors(config: ModelConfig, gguf_file: GGUFFile) -> None:
    """Check every tensor the family needs (present, shaped) and refuse a file holding any tensor the family
    does not compute (biases or QK norms it lacks, expert routers, a layer past block_count, ...), before a weight is read."""
    census = TensorCensus(gguf_file)
    census.read_by_config(config.config_tensors)
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


__all__ = [
    "MODEL_FAMILIES", "Gemma2Model", "Gemma3Model", "LlamaModel", "Model", "Phi3Model", "Qwen2Model", "Qwen3Model", "account_tensors",
    "build_model",
]  # fmt: skip
