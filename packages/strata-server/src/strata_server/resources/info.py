"""``/health``, ``/props``, ``/v1/models``, ``/metrics``: answered without taking the slot."""

from __future__ import annotations

import falcon

from ..context import ServerContext
from ..defaults import sampling_defaults
from ..engine.client import EngineState
from ..errors import ApiError, EngineUnavailable, ErrorType
from ..metrics import CONTENT_TYPE, render_rows
from ..params import ENGINE_DEFAULTS


class HealthResource:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        status = self.ctx.engine.status()
        if status.state is not EngineState.READY:
            raise EngineUnavailable(status.message if status.state is EngineState.FAILED else "Loading model")
        resp.media = {"status": "ok"}


class PropsResource:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        info = self.ctx.engine_info()
        config = self.ctx.config
        resp.media = {
            "default_generation_settings": {
                "params": {**ENGINE_DEFAULTS, **sampling_defaults(config)},
                "n_ctx": self.ctx.n_ctx_slot(),
            },
            "total_slots": self.ctx.n_slots(),
            "model_alias": self.ctx.model_id(),
            "model_path": info.get("model_path"),
            "model_ftype": info.get("model_ftype"),
            "modalities": {"vision": False, "video": False, "audio": False},
            "media_marker": None,
            "endpoint_slots": config.slots,
            "endpoint_props": False,
            "endpoint_metrics": config.metrics,
            "ui": False,
            "ui_settings": {},
            "chat_template": info.get("chat_template", ""),
            "chat_template_caps": {},
            "bos_token": info.get("bos_token", ""),
            "eos_token": info.get("eos_token", ""),
            "build_info": self.ctx.build_info(),
            "is_sleeping": False,
            "cors_proxy_enabled": False,
            # Strata's own: what a session file is bound to.
            "strata": {
                "engine": info.get("engine"),
                "engine_version": info.get("engine_version"),
                "backend": info.get("backend"),
                "kv_type": info.get("kv_type"),
                "prompt_cache": info.get("prompt_cache"),
                "slot_save_enabled": config.slot_save_path is not None,
                "engine_restarts": self.ctx.engine.status().restarts,
            },
        }


class ModelsResource:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        info = self.ctx.engine_info()
        model_id = self.ctx.model_id()
        aliases, tags = list(self.ctx.config.model_aliases()), list(self.ctx.config.tags)
        meta = {
            "vocab_type": info.get("vocab_type"),
            "n_vocab": info.get("n_vocab"),
            "n_ctx": info.get("n_ctx"),
            "n_ctx_train": info.get("n_ctx_train"),
            "n_embd": info.get("n_embd"),
            "n_params": info.get("n_params"),
            "size": info.get("model_size"),
            "ftype": info.get("model_ftype"),
        }
        resp.media = {
            "models": [
                {
                    "name": model_id,
                    "model": model_id,
                    "modified_at": "",
                    "size": "",
                    "digest": "",
                    "type": "model",
                    "description": "",
                    "tags": tags,
                    "capabilities": ["completion"],
                    "parameters": "",
                    "details": {
                        "parent_model": "",
                        "format": "gguf",
                        "family": "",
                        "families": [],
                        "parameter_size": "",
                        "quantization_level": "",
                    },
                }
            ],
            "object": "list",
            "data": [
                {
                    "id": model_id,
                    "aliases": aliases,
                    "tags": tags,
                    "object": "model",
                    "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
                    "created": int(self.ctx.metrics.start_time),
                    "owned_by": "strata",
                    "meta": meta,
                }
            ],
        }


class MetricsResource:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        if not self.ctx.config.metrics:
            raise ApiError(
                ErrorType.NOT_SUPPORTED,
                "This server does not support metrics endpoint. Start it with `--metrics`",
            )
        resp.content_type = CONTENT_TYPE
        resp.set_header("Process-Start-Time-Unix", str(int(self.ctx.metrics.start_time)))
        status = self.ctx.engine.status()
        resp.text = self.ctx.metrics.render(self.ctx.engine.slots, status.restarts, status.n_forward)
        if self.ctx.store is not None:
            resp.text += render_rows(self.ctx.store.metric_rows())
