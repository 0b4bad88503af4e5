"""Helpers for the session file tests: a small multi-layer session in a MemoryAdapter."""

from __future__ import annotations

import pytest
from strata_sessionfile.testing import memory_adapter_factory


@pytest.fixture
def factory():
    """seed -> MemoryAdapter holding a ~60 KB session (6 layers: f16, sliding window, int8+extra, draft)."""
    return memory_adapter_factory(n_tokens=200)


@pytest.fixture
def staging_factory():
    return memory_adapter_factory(n_tokens=200, staging=True)


def files_in(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())
