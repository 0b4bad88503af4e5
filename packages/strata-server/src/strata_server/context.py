"""What every resource receives: the engine client, the config, metrics, the slot's last task."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import attrs

from .config import ServerConfig
from .engine.client import EngineClient
from .metrics import Metrics
from .security import SecurityPolicy
from .store import SessionStore

if TYPE_CHECKING:
    from .params import CompletionOptions

def _server_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("strata-server")
    except PackageNotFoundError:
        return "0+unknown"


SERVER_VERSION = _server_version()


class SlotView:
    """What ``GET /slots`` shows about slot 0's last task, kept without asking the busy engine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.id_task = -1
        self.last: dict[str, Any] | None = None

    def record(self, result: dict, options: CompletionOptions) -> None:
        timings = result.get("timings") or {}
        tokens = result.get("tokens") or []
        settings = options.settings()
        with self._lock:
            self.id_task += 1
            self.last = {
                "id_task": self.id_task,
                "n_prompt_tokens": result.get("tokens_evaluated", 0),
                "n_prompt_tokens_processed": timings.get("prompt_n", 0),
                "n_prompt_tokens_cache": timings.get("cache_n", 0),
                "params": settings,
                # A recorded task has ended: the peer shows n_remain -1 then, whatever n_predict was.
                "next_token": [{"has_next_token": False, "has_new_line": "\n" in str(result.get("content", "")),
                                "n_remain": -1, "n_decoded": len(tokens)}],
            }

    def forget(self) -> None:
        with self._lock:
            self.last = None

    def snapshot(self) -> dict[str, Any] | None:
        with self._lock:
            return dict(self.last) if self.last else None


@attrs.frozen
class ServerContext:
    engine: EngineClient
    config: ServerConfig
    policy: SecurityPolicy
    metrics: Metrics = attrs.Factory(Metrics)
    slot_view: SlotView = attrs.Factory(SlotView)
    store: SessionStore | None = None  # --cache-disk / --cache-ram

    def engine_info(self) -> dict[str, Any]:
        return dict(self.engine.status().info or {})

    def model_id(self) -> str:
        if self.config.alias:
            return self.config.alias[0]
        return str(self.engine_info().get("model_path") or self.config.model)

    def build_info(self) -> str:
        return f"strata-server-{SERVER_VERSION}+{self.engine_info().get('engine', 'engine')}-" \
               f"{self.engine_info().get('engine_version', '?')}"
