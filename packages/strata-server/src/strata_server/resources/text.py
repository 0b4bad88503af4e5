"""``/tokenize`` and ``/detokenize``."""

from __future__ import annotations

import falcon

from ..chat_prompt import parse_chat_prompt
from ..context import ServerContext
from ..errors import invalid_request
from ..params import read_json


def _flag(body: dict, key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise invalid_request(f"'{key}' must be true or false")
    return value


class TokenizeResource:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = read_json(req, self.ctx.config.max_body_bytes)
        content = body.get("content", "")
        if not isinstance(content, str):
            raise invalid_request("'content' must be a string")
        command = {
            "content": content,
            "add_special": _flag(body, "add_special", False),
            "parse_special": _flag(body, "parse_special", True),
            "with_pieces": _flag(body, "with_pieces", False),
        }
        with self.ctx.engine.command() as lease:
            result = lease.call("TOKENIZE", command)
        resp.media = {"tokens": result.get("tokens", [])}


class DetokenizeResource:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = read_json(req, self.ctx.config.max_body_bytes)
        tokens = body.get("tokens", [])
        n_vocab = self.ctx.engine_info().get("n_vocab")
        if not isinstance(tokens, list):
            raise invalid_request("'tokens' must be an array of token ids")
        for index, token in enumerate(tokens):
            if isinstance(token, bool) or not isinstance(token, int):
                raise invalid_request(f"'tokens'[{index}] must be an integer token id")
            if token < 0 or (n_vocab is not None and token >= n_vocab):
                raise invalid_request(f"'tokens'[{index}]: token id {token} is out of range [0, {n_vocab})")
        with self.ctx.engine.command() as lease:
            result = lease.call("DETOKENIZE", {"tokens": tokens})
        resp.media = {"content": result.get("content", "")}


class ApplyTemplateResource:
    """``POST /apply-template``: the chat template applied, without generating (the peer's endpoint)."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = read_json(req, self.ctx.config.max_body_bytes)
        prompt = parse_chat_prompt(body, self.ctx.config)
        with self.ctx.engine.command() as lease:
            result = lease.call("APPLY_TEMPLATE", prompt.engine_fields())
        resp.media = {"prompt": result.get("prompt", "")}


class ChatInputTokensResource:
    """``POST /chat/completions/input_tokens``: how many tokens a chat request's prompt is (the peer's)."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = read_json(req, self.ctx.config.max_body_bytes)
        prompt = parse_chat_prompt(body, self.ctx.config)
        add_bos = bool(self.ctx.engine_info().get("add_bos"))
        with self.ctx.engine.command() as lease:
            rendered = lease.call("APPLY_TEMPLATE", prompt.engine_fields()).get("prompt", "")
            # Tokenized as COMPLETE tokenizes a rendered chat: the model's BOS rule, special tokens parsed.
            tokens = lease.call(
                "TOKENIZE", {"content": rendered, "add_special": add_bos, "parse_special": True}
            )["tokens"]
        resp.media = {"input_tokens": len(tokens)}
