"""The Falcon app: ``create_app(engine_client, config)``."""

from __future__ import annotations

import falcon

from .config import ServerConfig
from .context import ServerContext
from .engine.client import EngineClient
from .errors import handle_error
from .resources.completions import ChatCompletionResource, CompletionResource, TextCompletionResource
from .resources.conversations import ConversationsResource
from .resources.embeddings import EmbeddingsResource, OpenAIEmbeddingsResource
from .resources.infill import InfillResource
from .resources.info import HealthResource, MetricsResource, ModelsResource, PropsResource
from .resources.slots import SlotsResource
from .resources.text import (
    ApplyTemplateResource,
    ChatInputTokensResource,
    DetokenizeResource,
    TokenizeResource,
)
from .resources.webui import WebUiResource
from .security import SecurityMiddleware, SecurityPolicy
from .store import build_store
from .webui import ASSETS

# route -> resource class; aliases as the peer registers them (tools/server/server.cpp).
ROUTES: tuple[tuple[tuple[str, ...], type], ...] = (
    (("/health", "/v1/health"), HealthResource),
    (("/props",), PropsResource),
    (("/v1/models", "/models"), ModelsResource),
    (("/metrics",), MetricsResource),
    (("/completion", "/completions"), CompletionResource),
    (("/v1/completions",), TextCompletionResource),
    (("/v1/chat/completions", "/chat/completions"), ChatCompletionResource),
    (("/infill",), InfillResource),
    (("/embedding", "/embeddings"), EmbeddingsResource),
    (("/v1/embeddings",), OpenAIEmbeddingsResource),
    (("/tokenize",), TokenizeResource),
    (("/detokenize",), DetokenizeResource),
    (("/apply-template",), ApplyTemplateResource),
    (("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"), ChatInputTokensResource),
)


def create_app(
    engine_client: EngineClient, config: ServerConfig, *, context: ServerContext | None = None
) -> falcon.App:
    ctx = context or ServerContext(
        engine=engine_client,
        config=config,
        policy=SecurityPolicy(config),
        store=build_store(config, engine_client),
    )
    engine_client.add_exit_listener(ctx.metrics.record_engine_exit)
    app = falcon.App(middleware=[SecurityMiddleware(ctx.policy, engine_client)])
    for paths, resource_class in ROUTES:
        resource = resource_class(ctx)
        for path in paths:
            app.add_route(path, resource)
    slots = SlotsResource(ctx)
    app.add_route("/slots", slots)
    app.add_route("/slots/{id_slot}", slots, suffix="slot")
    conversations = ConversationsResource(ctx)
    app.add_route("/conversations", conversations)
    app.add_route("/conversations/{conversation_id}", conversations, suffix="one")
    app.add_route("/conversations/{conversation_id}/file", conversations, suffix="file")
    if config.webui:
        webui = WebUiResource(ctx)
        for path in ASSETS:
            app.add_route(path, webui)
    app.add_error_handler(Exception, handle_error)
    app.add_error_handler(falcon.HTTPError, handle_error)
    return app
