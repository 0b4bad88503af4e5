"""Fixtures of the end-to-end tests (a real strata-server, engine and model: servers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory) -> Path:
    """A folder shared by one module's tests (their servers' logs and slot files)."""
    return tmp_path_factory.mktemp("e2e")
