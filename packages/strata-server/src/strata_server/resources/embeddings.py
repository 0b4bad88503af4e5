"""``/embedding``, ``/embeddings`` (llama-server's own answer) and ``/v1/embeddings`` (OpenAI's), with
``--embedding``: each input tokenized as the peer does, then the engine's EMBED (which leaves the slot's
conversation as it was). A client that leaves stops the engine's work for it: its EMBED in flight is
cancelled (the engine ends it between two chunks) and the inputs after it are never sent."""

from __future__ import annotations

import base64
import struct
from typing import Any

import falcon
from strata_engine.settings import Pooling

from ..connection import POLL_INTERVAL_S, ClientConnection, watch_client
from ..context import ServerContext
from ..engine.client import EngineLease
from ..errors import ApiError, ErrorType, invalid_request
from ..params import parse_prompts, read_json
from ..tokenization import tokenize_mixed

EUCLIDEAN = 2  # llama-server's default embd_normalize
ENCODINGS = ("float", "base64")


def embed_watched(lease: EngineLease, argument: dict, client: ClientConnection) -> dict:
    """One EMBED's result, cancelled by its id once the client has gone (its ``cancelled`` error then raises)."""
    for event in watch_client(lease.request("EMBED", argument, idle_s=POLL_INTERVAL_S), client, lease.cancel):
        if event["event"] == "result":
            return event
    raise AssertionError("request() ends with a result or raises")


def encode_base64(vector: list[float]) -> str:
    """OpenAI's ``encoding_format: base64``: the float32 values' little-endian bytes."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


class EmbeddingsResource:
    """The peer's checks in its order, then one EMBED per input, under one lease."""

    openai = False  # /embeddings; the /v1 subclass answers OpenAI's shape

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def pooling(self) -> str:
        return self.ctx.config.pooling or str(self.ctx.engine_info().get("pooling") or Pooling.NONE)

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        if not self.ctx.config.embedding:
            raise ApiError(
                ErrorType.NOT_SUPPORTED,
                "This server does not support embeddings. Start it with `--embeddings`",
            )
        pooling = self.pooling()
        if self.openai and pooling == Pooling.NONE:
            raise invalid_request(
                "Pooling type 'none' is not OAI compatible. Please use a different pooling type"
            )
        body = read_json(req, self.ctx.config.max_body_bytes)
        openai = self.openai
        if "input" in body:
            key = "input"
        elif "content" in body:
            key, openai = "content", False  # the peer's own field: its own answer, on /v1 too
        else:
            raise invalid_request('"input" or "content" must be provided')
        encoding = body.get("encoding_format", "float")
        if encoding not in ENCODINGS:
            raise invalid_request("The format to return the embeddings in. Can be either float or base64")
        normalize = body.get("embd_normalize", EUCLIDEAN)
        if isinstance(normalize, bool) or not isinstance(normalize, int):
            raise invalid_request("'embd_normalize' must be an integer")
        prompts = parse_prompts(body, n_vocab=self.ctx.engine_info().get("n_vocab"), key=key)
        client = ClientConnection.of(req.env)
        with self.ctx.engine.command() as lease:
            inputs = [tokenize_mixed(lease, p, add_special=True, parse_special=True) for p in prompts]
            if any(not tokens for tokens in inputs):
                raise invalid_request("Input content cannot be empty")
            rows = [
                embed_watched(lease, {"tokens": tokens, "pooling": pooling, "normalize": normalize}, client)[
                    "embedding"
                ]
                for tokens in inputs
            ]
        if not openai:
            resp.media = [{"index": i, "embedding": embedding} for i, embedding in enumerate(rows)]
            return
        resp.media = self._openai(body, rows, [len(tokens) for tokens in inputs], encoding == "base64")

    def _openai(
        self, body: dict, rows: list[list[list[float]]], n_tokens: list[int], as_base64: bool
    ) -> dict:
        def item(index: int, vector: list[float]) -> dict[str, Any]:
            if as_base64:
                return {
                    "embedding": encode_base64(vector),
                    "index": index,
                    "object": "embedding",
                    "encoding_format": "base64",
                }
            return {"embedding": vector, "index": index, "object": "embedding"}

        model = body.get("model")
        return {
            "model": model if isinstance(model, str) and model else self.ctx.model_id(),
            "object": "list",
            "usage": {"prompt_tokens": sum(n_tokens), "total_tokens": sum(n_tokens)},
            "data": [item(i, embedding[0]) for i, embedding in enumerate(rows)],
        }


class OpenAIEmbeddingsResource(EmbeddingsResource):
    """``POST /v1/embeddings``."""

    openai = True
