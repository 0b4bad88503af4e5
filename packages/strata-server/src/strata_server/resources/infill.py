"""``POST /infill``: fill in the middle, on a model with FIM tokens (infill.py lays the prompt out)."""

from __future__ import annotations

import functools

import falcon

from ..batch import BatchRun, TaskSpec, build_runs, check_task_count, choice_count
from ..connection import ClientConnection
from ..context import ServerContext
from ..defaults import server_options
from ..generation import NativeCompletionFormat, RunInfo
from ..infill import extra_context, fim_tokens, infill_tokens, parse_infill
from ..params import parse_options, read_json
from ..tokenization import tokenize_mixed
from .completions import prompt_text, stream_fields


class InfillResource:
    """As the peer: its checks (the model's FIM tokens first), its prompt layout, the native completion's
    answer (streamed too), ``n`` choices."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        info = self.ctx.engine_info()
        fim = fim_tokens(info)
        body = read_json(req, self.ctx.config.max_body_bytes)
        request = parse_infill(body)
        n_choices = choice_count(body)
        check_task_count(1, n_choices)
        options = parse_options(
            body, n_vocab=self.ctx.engine_info().get("n_vocab"), n_slots=self.ctx.n_slots()
        )
        options = server_options(options, self.ctx.config, self.ctx.engine_info().get("eog_tokens"))
        with self.ctx.engine.command() as lease:

            def text(content: str | list, parse_special: bool = False) -> list[int]:
                return tokenize_mixed(lease, content, add_special=False, parse_special=parse_special)

            bos = (
                tokenize_mixed(lease, "", add_special=True, parse_special=False)[:1]
                if info.get("add_bos")
                else []
            )
            tokens = infill_tokens(
                fim,
                prefix=text(request.input_prefix),
                suffix=text(request.input_suffix),
                prompt=text(request.prompt, parse_special=True),
                extra=extra_context(fim, request.input_extra, text),
                bos=bos[0] if bos else None,
                n_predict=self.ctx.config.n_predict,
                n_ctx=self.ctx.n_ctx_slot(),
            )
        run_info = RunInfo(
            model=self.ctx.model_id(), options=options, system_fingerprint=self.ctx.build_info()
        )
        echo = functools.partial(prompt_text, tokens)
        spec = TaskSpec(
            {"prompt": tokens, **options.engine_fields(), **stream_fields(body, options.stream)},
            lambda own: NativeCompletionFormat(own, echo),
        )
        client = ClientConnection.of(req.env)
        BatchRun(self.ctx, build_runs(self.ctx, run_info, client, [spec], n_choices), client).respond(resp)
