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
    """What ``GET /slots`` shows about each slot's last task, kept without asking the engine."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.id_task = -1  # one counter for the server, as the peer's task ids
        self.last: dict[int, dict[str, Any]] = {}

    def record(self, slot_id: int, result: dict, options: CompletionOptions) -> None:
        timings = result.get("timings") or {}
        tokens = result.get("tokens") or []
        settings = options.settings()
        with self._lock:
            self.id_task += 1
            self.last[slot_id] = {
                "id_task": self.id_task,
                "n_prompt_tokens": result.get("tokens_evaluated", 0),
                "n_prompt_tokens_processed": timings.get("prompt_n", 0),
                "n_prompt_tokens_cache": timings.get("cache_n", 0),
                "params": settings,
                # A recorded task has ended: the peer shows n_remain -1 then, whatever n_predict was.
                "next_token": [{"has_next_token": False, "has_new_line": "\n" in str(result.get("content", "")),
                                "n_remain": -1, "n_decoded": len(tokens)}],
            }

    def forget(self, slot_id: int | None = None) -> None:
        """Slot ``slot_id``'s conversation is gone (erase, restore); None: every slot's (an engine restart)."""
        with self._lock:
            if slot_id is None:
                self.last.clear()
            else:
                self.last.pop(slot_id, None)

    def snapshot(self, slot_id: int) -> dict[str, Any] | None:
        with self._lock:
            last = self.last.get(slot_id)
            return dict(last) if last else None


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
            return self.config.alias[0]
        return str(self.engine_info().get("model_path") or self.config.engine.model_path)

    def build_info(self) -> str:
        return f"strata-server-{SERVER_VERSION}+{self.engine_info().get('engine', 'engine')}-" \
               f"{self.engine_info().get('engine_version', '?')}"
