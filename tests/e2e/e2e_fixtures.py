"""End-to-end fixtures (imported by the test modules; no conftest.py so the root one's module is not shadowed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

__all__ = ["module_tmp"]

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("e2e")
