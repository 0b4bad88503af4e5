"""``/completion``, ``/v1/completions``, ``/v1/chat/completions`` (and their aliases)."""

from __future__ import annotations

import functools

import falcon

from ..batch import BatchRun, TaskSpec, build_runs, check_task_count, choice_count
from ..chat_prompt import parse_chat_prompt
from ..connection import ClientConnection
from ..context import ServerContext
from ..defaults import server_options
from ..engine.client import EngineLease
from ..errors import invalid_request
from ..generation import (
    ChatCompletionFormat,
    NativeCompletionFormat,
    RunInfo,
    TextCompletionFormat,
)
from ..params import parse_chat_logprobs, parse_options, parse_prompts, read_json


def prompt_text(prompt: str | list, lease: EngineLease) -> str:
    """The prompt as text (the peer echoes it detokenized): token ids go through DETOKENIZE."""
    if isinstance(prompt, str):
        return prompt
    parts: list[str] = []
    run: list[int] = []
    for item in [*prompt, None]:
        if isinstance(item, int):
            run.append(item)
            continue
        if run:
            parts.append(str(lease.call("DETOKENIZE", {"tokens": run}).get("content", "")))
            run = []
        if isinstance(item, str):
            parts.append(item)
    return "".join(parts)


def wants_verbose(body: dict, default: bool) -> bool:
    """The peer's ``verbose``: an OpenAI answer also carries the native one as ``__verbose``; the default is
    the server's --verbose, as the peer's."""
    value = body.get("verbose", default)
    if not isinstance(value, bool):
        raise invalid_request("'verbose' must be true or false")
    return value


def stream_fields(body: dict, stream: bool) -> dict:
    """Engine fields a stream asks for: ``return_progress`` (prompt progress chunks; ignored unstreamed)."""
    value = body.get("return_progress")
    if value is not None and not isinstance(value, bool):
        raise invalid_request("'return_progress' must be true or false")
    return {"return_progress": True} if value and stream else {}


def _respond_to_prompt(
    ctx: ServerContext, req: falcon.Request, resp: falcon.Response, make_format, verbose_allowed: bool = True
) -> None:
    """A prompt-based completion: parse the body, run its prompts (n choices each) on slot 0, answer in the
    endpoint's format."""
    body = read_json(req, ctx.config.max_body_bytes)
    n_vocab = ctx.engine_info().get("n_vocab")
    prompts = parse_prompts(body, n_vocab=n_vocab)
    n_choices = choice_count(body)
    check_task_count(len(prompts), n_choices)
    options = parse_options(body, n_vocab=n_vocab, n_slots=ctx.n_slots())
    options = server_options(options, ctx.config, ctx.engine_info().get("eog_tokens"))
    info = RunInfo(model=ctx.model_id(), options=options, system_fingerprint=ctx.build_info())
    verbose = wants_verbose(body, ctx.config.verbose) and verbose_allowed
    extra = stream_fields(body, options.stream)

    def spec(prompt: str | list) -> TaskSpec:
        echo = functools.partial(prompt_text, prompt)
        return TaskSpec(
            {"prompt": prompt, **options.engine_fields(), **extra},
            functools.partial(make_format, prompt=prompt),
            (lambda own: NativeCompletionFormat(own, echo)) if verbose else None,
        )

    client = ClientConnection.of(req.env)
    BatchRun(ctx, build_runs(ctx, info, client, [spec(p) for p in prompts], n_choices), client).respond(resp)


class CompletionResource:
    """``POST /completion``: the peer's native completion."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        _respond_to_prompt(
            self.ctx,
            req,
            resp,
            lambda info, prompt: NativeCompletionFormat(info, functools.partial(prompt_text, prompt)),
            verbose_allowed=False,
        )  # it is the native answer


class TextCompletionResource:
    """``POST /v1/completions``: OpenAI text completion."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        _respond_to_prompt(self.ctx, req, resp, lambda info, prompt: TextCompletionFormat(info))


class ChatCompletionResource:
    """``POST /v1/chat/completions``: the messages go to the engine, which applies the chat template."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body, top_logprobs = parse_chat_logprobs(read_json(req, self.ctx.config.max_body_bytes))
        prompt = parse_chat_prompt(body, self.ctx.config)
        n_choices = choice_count(body)
        check_task_count(1, n_choices)
        options = parse_options(
            body,
            top_logprobs=top_logprobs,
            n_vocab=self.ctx.engine_info().get("n_vocab"),
            chat=True,
            n_slots=self.ctx.n_slots(),
        )
        options = server_options(options, self.ctx.config, self.ctx.engine_info().get("eog_tokens"))
        info = RunInfo(model=self.ctx.model_id(), options=options, system_fingerprint=self.ctx.build_info())

        def verbose(own: RunInfo) -> NativeCompletionFormat:
            # __verbose's prompt is the rendered chat, asked of the engine under the same lease.
            return NativeCompletionFormat(
                own, lambda lease: str(lease.call("APPLY_TEMPLATE", prompt.engine_fields()).get("prompt", ""))
            )

        spec = TaskSpec(
            {**prompt.engine_fields(), **options.engine_fields(), **stream_fields(body, options.stream)},
            ChatCompletionFormat,
            verbose if wants_verbose(body, self.ctx.config.verbose) else None,
        )
        client = ClientConnection.of(req.env)
        BatchRun(self.ctx, build_runs(self.ctx, info, client, [spec], n_choices), client).respond(resp)
