"""Fixtures of the end-to-end tests (a real strata-server, engine and model: servers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory) -> Path:
    """A folder shared by one module's tests (their servers' logs and slot files)."""
    return tmp_path_factory.mktemp("e2e")


@pytest.fixture(scope="module")
def s3_store(tmp_path_factory):
    """A SeaweedFS S3 endpoint for one module's servers (support/s3.py)."""
    from support.s3 import start_seaweed

    store = start_seaweed(tmp_path_factory.mktemp("s3"))
    yield store
    store.stop()
