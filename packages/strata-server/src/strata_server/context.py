"""What every resource receives: the engine client, the config, metrics, the session store."""

from __future__ import annotations

from typing import Any

import attrs

from .config import ServerConfig
from .engine.client import EngineClient
from .ledger import SlotLedger
from .metrics import Metrics
from .security import SecurityPolicy
from .store import SessionStore


def _server_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("strata-server")
    except PackageNotFoundError:
        return "0+unknown"


SERVER_VERSION = _server_version()


@attrs.frozen
class ServerContext:
    engine: EngineClient
    config: ServerConfig
    policy: SecurityPolicy
    metrics: Metrics = attrs.Factory(Metrics)
    store: SessionStore | None = None  # --cache-disk / --cache-ram

    @property
    def ledger(self) -> SlotLedger:
        """What each slot holds (the slot manager's ledger)."""
        return self.engine.slots.ledger

    def engine_info(self) -> dict[str, Any]:
        return dict(self.engine.status().info or {})

    def n_slots(self) -> int:
        return self.engine.slots.n_slots

    def n_ctx_slot(self) -> int:
        """Each slot's context: the engine's ``n_ctx_slot`` (the total over the slots, as llama-server)."""
        info = self.engine_info()
        if info.get("n_ctx_slot") is not None:
            return int(info["n_ctx_slot"])
        return int(info.get("n_ctx") or 0) // self.n_slots()

    def model_id(self) -> str:
        if self.config.alias:
            return self.config.model_aliases()[0]
        return str(self.engine_info().get("model_path") or self.config.engine.model_path)

    def build_info(self) -> str:
        return (
            f"strata-server-{SERVER_VERSION}+{self.engine_info().get('engine', 'engine')}-"
            f"{self.engine_info().get('engine_version', '?')}"
        )
