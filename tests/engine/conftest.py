"""Fixtures of the engine's tests: each real model's GGUF metadata, tokenizer and chat template, read
once per test process and keyed by model ("smollm2", "gemma3"); the tiny random-weight models of the other
families (support/families.py) come from the root conftest.py's family_files. Loaded runners: runners.py.

The engine is imported inside the fixtures: the GPU tests collect on a machine that lacks what only
these need (jinja2 for the templates)."""

from __future__ import annotations

import pytest
from support.data import gemma3_model_path, smollm2_model_path

MODEL_PATHS = {"smollm2": smollm2_model_path, "gemma3": gemma3_model_path}


@pytest.fixture(scope="session")
def metadata() -> dict[str, dict]:
    from strata_engine.gguf.reader import read_gguf

    return {name: read_gguf(path()).metadata for name, path in MODEL_PATHS.items()}


@pytest.fixture(scope="session")
def tokenizers(metadata) -> dict:
    from strata_engine.tokenizer import Tokenizer

    return {name: Tokenizer.from_gguf_metadata(meta) for name, meta in metadata.items()}


@pytest.fixture(scope="session")
def templates(metadata, tokenizers) -> dict:
    from strata_engine.chat import ChatTemplate

    return {name: ChatTemplate.for_model(metadata[name], tokenizers[name]) for name in MODEL_PATHS}


@pytest.fixture(scope="session")
def model_files(smollm2_path, gemma3_path):
    """Each model's GGUF file, read (its tensors mapped, not loaded)."""
    from strata_engine.gguf import read_gguf

    return {"smollm2": read_gguf(smollm2_path), "gemma3": read_gguf(gemma3_path)}
