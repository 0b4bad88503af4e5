"""Fixtures every test folder shares: the real models and the reference data (support/data.py), and the
`gpu` mark's skip where no GPU is present. Each folder's conftest.py adds its own."""

from __future__ import annotations

import contextlib

with contextlib.suppress(ImportError):  # absent where strata-sessionfile is tested alone
    import strata_engine.process_env  # noqa: F401  (first: the engine's environment for in-process runners)

# isort: split
from pathlib import Path

import pytest
from support.data import REFERENCE_DIR, gemma3_model_path, smollm2_model_path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return smollm2_model_path()


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return gemma3_model_path()


@pytest.fixture(scope="session")
def family_files(tmp_path_factory):
    """(family, file type) -> the tiny model's GGUF (support/families.py; the WIDE model for the K-quants),
    written on first use: the engine's tests against transformers and the cross-engine tests against llama.cpp
    read the same files."""
    import functools

    from support.families import family_of, hf_model, write_gguf

    folder = tmp_path_factory.mktemp("families")

    @functools.cache
    def file(family: str, file_type: str) -> Path:
        f = family_of(family, file_type)
        return write_gguf(hf_model(f), f, folder / f"{family}-{file_type}.gguf", file_type)

    return file


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
