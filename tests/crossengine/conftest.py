"""Fixtures of the cross-engine tests: llama.cpp's own server in-process (llama_server.py), its slot folder,
and a strata-engine runner of the same GGUF file with an f16 cache (llama.cpp's default).
"""

from __future__ import annotations

import importlib.util

import pytest

# Where llama.cpp's wheel is not installed (the alone venvs) these tests are not collected.
collect_ignore_glob = [] if importlib.util.find_spec("xllamacpp") else ["test_*.py"]


@pytest.fixture(scope="module", params=["v_rows", "v_trans"])
def llama(request, smollm2_path, tmp_path_factory):
    """llama-server with V transposed (flash attention off) and with V rows (flash attention on)."""
    from .llama_server import FLASH_ATTN, LlamaServer

    slots = tmp_path_factory.mktemp("slots")
    server = LlamaServer(smollm2_path, slots, FLASH_ATTN[request.param])
    server.v_trans = request.param == "v_trans"  # type: ignore[attr-defined]
    return server


@pytest.fixture(scope="module")
def runner(smollm2_path):
    from strata_engine.settings import EngineSettings
    from strata_engine.slots import SlotSet

    return SlotSet.load(EngineSettings(model_path=smollm2_path, kv_type="f16", n_ctx=2048)).runners[0]
