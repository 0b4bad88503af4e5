"""strata_sessionfile.hf stands alone: it imports without torch, transformers or numpy, and a call that needs
them is refused by name (`cache_unsupported`) where they are missing (here: hidden from the import system)."""

from __future__ import annotations

import sys

import pytest
from strata_sessionfile import errors as E
from strata_sessionfile import hf


@pytest.mark.parametrize("missing", ["torch", "transformers", "numpy"])
def test_calls_refused_without_their_libraries(missing, monkeypatch):
    monkeypatch.setitem(sys.modules, missing, None)  # None in sys.modules: `import` raises ImportError
    if missing == "transformers":
        monkeypatch.setitem(sys.modules, "transformers.cache_utils", None)
    with pytest.raises(E.CacheUnsupported, match="need numpy, torch and transformers"):
        hf.new_cache(None)  # type: ignore[arg-type]
    with pytest.raises(E.CacheUnsupported):
        hf.load_model("model.gguf")
