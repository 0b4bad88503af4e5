"""Fixtures of the server's tests: a fake model file, a slot folder, and a falcon test client over the
in-process fake engine (fake_engine.py, fakes.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def fake_model(tmp_path: Path) -> Path:
    path = tmp_path / "fake-model-A.gguf"
    path.write_text("fake-model-A\n", encoding="utf-8")
    return path


@pytest.fixture
def slot_dir(tmp_path: Path) -> Path:
    path = tmp_path / "slots"
    path.mkdir()
    return path


@pytest.fixture
def make_api(fake_model: Path):
    """make_api(n_ctx, fim, **settings) -> (falcon TestClient, FakeEngineClient, ServerConfig); fim: the fake
    model has fill-in-the-middle tokens."""
    import falcon.testing
    from strata_server import build_config, create_app

    from .fake_engine import FakeEngine
    from .fakes import FakeEngineClient

    def make(n_ctx: int = 512, fim: bool = False, **settings):
        config = build_config({}, {"model": str(fake_model), "slot_wait": 0.3, **settings})
        engine = FakeEngineClient(
            FakeEngine(str(fake_model), n_ctx=n_ctx, kv_type=config.engine.kv_type, fim=fim),
            n_slots=config.engine.n_slots,
            similarity=config.slot_prompt_similarity,
        )
        app = create_app(engine, config)
        client = falcon.testing.TestClient(app, headers={"Host": "127.0.0.1:8080"})
        return client, engine, config

    return make
