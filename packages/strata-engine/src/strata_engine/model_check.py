"""What a model file must pass before anything starts on it: a GGUF of a supported architecture whose
every metadata key and tensor the engine computes (the server checks it before it binds its port)."""

from __future__ import annotations

from pathlib import Path

from .config import ARCHITECTURES, ModelConfig
from .gguf import read_gguf
from .models import MODEL_FAMILIES, account_tensors


def supported_architectures() -> tuple[str, ...]:
    """The `general.architecture` values the engine loads: a config builder and a model family each."""
    return tuple(sorted(set(ARCHITECTURES) & set(MODEL_FAMILIES)))


def check_model_file(path: Path) -> ModelConfig:
    """The file's configuration, read from its header alone (no weight is read); raises the engine's
    refusal (`UnsupportedArchitecture`, `UncomputedModelPart`, `ModelConfigError`, `GGUFError`) or OSError."""
    gguf_file = read_gguf(path)
    config = ModelConfig.from_gguf(gguf_file)
    account_tensors(config, gguf_file)
    return config
