"""`strata-engine serve`: the engine's verbs on the protocol of spec/engine-protocol.md.

The generic parts -- registry, line channel, loop, error mapping, exit statuses -- are protocol.py's;
this module has the verbs of the loaded model (`build_registry`; SAVE / RESTORE come from
session/verbs.py), the ready line and `serve`, which loads the model and runs the loop.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any, BinaryIO

import cattrs
import numpy as np
import xxhash

from .chat import ChatTemplate
from .completion import Completer, CompletionResult, PromptProgress, TokenEvent, parse_request
from .embedding import handle_embed, model_pooling
from .errors import ContextOverflow, EngineError, InvalidRequest
from .protocol import (
    ENGINE_NAME,
    PROMPT_PROGRESS_PHASE,
    PROTOCOL_VERSION,
    ArgumentKind,
    CommandRegistry,
    ExitStatus,
    FimToken,
    LineReader,
    LineWriter,
    ServeContext,
    engine_version,
    json_object,
    serve_loop,
)
from .session.verbs import SessionVerbs, register_session_verbs
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

_converter = cattrs.Converter()  # the protocol's boundary: attrs results -> JSON objects


# -- commands -------------------------------------------------------------------------------------------


def _bool_field(obj: Mapping[str, Any], name: str, default: bool, problems: list[str]) -> bool:
    value = obj.get(name, default)
    if not isinstance(value, bool):
        problems.append(f"{name} must be a boolean, got {value!r}")
        return default
    return value


def handle_complete(ctx: ServeContext, argument: Any) -> Mapping[str, Any]:
    request = parse_request(json_object(argument, "COMPLETE"))

    def on_token(event: TokenEvent) -> None:
        line: dict[str, Any] = {"event": "token", "id": event.id, "piece": event.piece, "content": event.content}
        if event.chosen is not None:
            line |= {"logprob": event.chosen.logprob, "prob": event.chosen.prob, "bytes": list(event.chosen.bytes)}
        if event.probs is not None:
            line["probs"] = [_converter.unstructure(p) for p in event.probs]
        ctx.emit(line)

    def cancelled() -> bool:
        while True:
            line = ctx.reader.poll_line()
            if line is None:
                # end of input does not cancel: `printf 'COMPLETE {...}' | strata-engine serve` completes
                return False
            if line.rstrip(b"\r") == b"CANCEL":
                return True
            ctx.deferred.append(line)  # a command sent too early: served after this one

    def on_progress(progress: PromptProgress) -> None:
        ctx.emit({"event": "progress", "phase": PROMPT_PROGRESS_PHASE, **_converter.unstructure(progress)})

    try:
        result: CompletionResult = ctx.completer.complete(request, on_token=on_token, cancelled=cancelled,
                                                          on_progress=on_progress)
    except (EngineError, BrokenPipeError):
        raise  # the runner is between steps: its state is intact
    except Exception:
        # the runner may be half-way through a step: drop the conversation rather than keep K/V we
        # cannot vouch for, and say so
        dropped = ctx.runner.erase()
        log.exception("COMPLETE failed unexpectedly; the held conversation (%d tokens) was erased", dropped)
        raise
    payload = _converter.unstructure(result)
    payload["tokens"] = list(result.tokens)
    return payload


def handle_prompt_tokens(ctx: ServeContext, argument: Any) -> Mapping[str, Any]:
    """The tokens a COMPLETE with this argument would evaluate, checked as COMPLETE checks them (a server
    looks its prompt up in a session store with them, then sends them as the COMPLETE's prompt)."""
    request = parse_request(json_object(argument, "PROMPT_TOKENS"))
    tokens = ctx.completer.prompt_tokens(request)
    if len(tokens) > ctx.runner.n_ctx:
        raise ContextOverflow(len(tokens), ctx.runner.n_ctx)
    return {"tokens": tokens}


def handle_tokenize(ctx: ServeContext, argument: Any) -> Mapping[str, Any]:
    obj = json_object(argument, "TOKENIZE")
    problems: list[str] = []
    content = obj.get("content")
    if not isinstance(content, str):
        problems.append("content must be a string")
    add_special = _bool_field(obj, "add_special", False, problems)
    parse_special = _bool_field(obj, "parse_special", True, problems)
    with_pieces = _bool_field(obj, "with_pieces", False, problems)
    if problems:
        raise InvalidRequest(problems)
    tokens = ctx.tokenizer.encode(content, add_special=add_special, parse_special=parse_special)
    if not with_pieces:
        return {"tokens": tokens}
    pieces = []
    for token in tokens:
        data = ctx.tokenizer.token_bytes(token)
        try:
            piece: str | list[int] = data.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(data)
        pieces.append({"id": token, "piece": piece})
    return {"tokens": pieces}


def handle_detokenize(ctx: ServeContext, argument: Any) -> Mapping[str, Any]:
    obj = json_object(argument, "DETOKENIZE")
    tokens = obj.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise InvalidRequest(["tokens must be a list of token ids"])
    return {"content": ctx.tokenizer.decode(tokens)}


def handle_apply_template(ctx: ServeContext, argument: Any) -> Mapping[str, Any]:
    obj = json_object(argument, "APPLY_TEMPLATE")
    problems: list[str] = []
    add_generation_prompt = _bool_field(obj, "add_generation_prompt", True, problems)
    continue_final_message = _bool_field(obj, "continue_final_message", False, problems)
    if problems:
        raise InvalidRequest(problems)
    return {"prompt": ctx.template.render(obj.get("messages"), add_generation_prompt=add_generation_prompt,
                                          continue_final_message=continue_final_message)}


def tokens_digest(tokens) -> str:
    """XXH3-64 (hex) of the token ids as little-endian int32."""
    return xxhash.xxh3_64_hexdigest(np.asarray(tokens, dtype="<i4").tobytes())


def handle_status(ctx: ServeContext, argument: Any) -> Mapping[str, Any]:
    runner = ctx.runner
    held = runner.tokens_held
    settings = runner.settings
    return {
        "n_ctx": runner.n_ctx,
        "n_past": len(held),
        "n_tokens_held": len(held),
        "tokens_held_digest": tokens_digest(held),
        "is_processing": False,
        "kv_type": settings.kv_type,
        "backend": settings.backend,
        "compute_dtype": settings.compute_dtype,
        "cpu_kernels": settings.cpu_kernels,
        "threads": settings.threads,
        "kv_resident": settings.kv_resident,
        "prompt_cache": settings.prompt_cache,
        "n_checkpoints": len(runner.checkpoints),
        "sampler_seed": ctx.completer.sampler_state.seed,
        "model_path": str(settings.model_path),
    }


def handle_erase(ctx: ServeContext, argument: Any) -> Mapping[str, Any]:
    return {"n_erased": ctx.runner.erase()}


def handle_cancel(ctx: ServeContext, argument: Any) -> None:
    # Nothing is running (a CANCEL during a COMPLETE is consumed by it). No answer: a CANCEL that
    # arrives just after its COMPLETE ended must not leave a line the client would read as the answer
    # to its next command.
    return None


def handle_quit(ctx: ServeContext, argument: Any) -> Mapping[str, Any]:
    ctx.quit_requested = True
    return {}


def build_registry(session_options: Any = None, ctx: ServeContext | None = None) -> CommandRegistry:
    """Every verb; `session_options` (a `session.SessionOptions`, None = defaults) configures SAVE/RESTORE;
    with `ctx`, the session identity (which fingerprints the model files) is computed now, not in the
    first SAVE/RESTORE."""
    return _build_registry(session_options, ctx)[0]


def _build_registry(session_options: Any, ctx: ServeContext | None) -> tuple[CommandRegistry, SessionVerbs]:
    registry = CommandRegistry()
    registry.register("COMPLETE", ArgumentKind.JSON, handle_complete)
    registry.register("PROMPT_TOKENS", ArgumentKind.JSON, handle_prompt_tokens)
    registry.register("TOKENIZE", ArgumentKind.JSON, handle_tokenize)
    registry.register("DETOKENIZE", ArgumentKind.JSON, handle_detokenize)
    registry.register("APPLY_TEMPLATE", ArgumentKind.JSON, handle_apply_template)
    registry.register("EMBED", ArgumentKind.JSON, handle_embed)
    registry.register("STATUS", ArgumentKind.NONE, handle_status)
    registry.register("ERASE", ArgumentKind.NONE, handle_erase)
    registry.register("CANCEL", ArgumentKind.NONE, handle_cancel)
    registry.register("QUIT", ArgumentKind.NONE, handle_quit)
    verbs = register_session_verbs(registry, session_options, ctx)
    return registry, verbs


# -- start-up -----------------------------------------------------------------------------------------


def ready_line(runner: Any, tokenizer: Tokenizer, template: ChatTemplate, identity: Any = None) -> dict[str, Any]:
    """The ready line; `identity` (the session files' `EngineIdentity`) adds the fingerprints a file written
    by this engine carries in its header, so a client can tell its files from other engines'."""
    config, gguf_file, settings = runner.config, runner.gguf, runner.settings
    tensors = gguf_file.tensors.values()

    def text_of(token_id: int | None) -> str:
        return tokenizer.token_text(token_id) if token_id is not None else ""

    return {
        "event": "ready",
        "protocol": PROTOCOL_VERSION,
        "engine": ENGINE_NAME,
        "engine_version": engine_version(),
        "model_path": str(settings.model_path),
        "model_name": str(gguf_file.metadata.get("general.name", "")),
        "architecture": config.architecture,
        "n_ctx": runner.n_ctx,
        "n_ctx_train": config.n_ctx_train,
        "n_vocab": config.n_vocab,
        "n_layer": config.n_layer,
        "n_embd": config.n_embd,
        "n_params": int(sum(t.n_elements for t in tensors)),
        "model_size": int(sum(t.n_bytes for t in tensors)),
        "backend": settings.backend,
        "kv_type": settings.kv_type,
        "compute_dtype": settings.compute_dtype,
        "cpu_kernels": settings.cpu_kernels,
        "threads": settings.threads,
        "kv_resident": settings.kv_resident,
        "bos_token": text_of(tokenizer.bos_id),
        "eos_token": text_of(tokenizer.eos_id),
        "chat_template": template.source,
        "chat_template_origin": template.origin,
        "add_bos": tokenizer.add_bos,
        "prompt_cache": settings.prompt_cache,
        "fim_tokens": {role.value: tokenizer.vocab.fim.get(role) for role in FimToken},
        "pooling": model_pooling(gguf_file.metadata, config.architecture).value,
        **({"session_fingerprints": {"model": identity.model.fingerprint.hex(),
                                     "config": identity.config.fingerprint.hex()}} if identity is not None else {}),
    }


def serve(settings, *, stdin_fd: int | None = None, stdout: BinaryIO | None = None,
          session_options: Any = None) -> ExitStatus:
    """Load the model, write the ready line, serve until QUIT or end of input."""
    from .runner import ModelRunner

    writer = LineWriter(stdout if stdout is not None else sys.stdout.buffer)
    try:
        settings.validate()
        if settings.chat_template is not None:
            ChatTemplate.configured(settings.chat_template)  # a template that does not parse is a bad setting
    except EngineError as exc:
        writer.write({"event": "fatal", "message": str(exc)})
        return ExitStatus.USAGE
    if not settings.model_path.is_file():
        writer.write({"event": "fatal", "message": f"model file not found: {settings.model_path}"})
        return ExitStatus.MODEL_LOAD
    try:
        runner = ModelRunner.load(settings)
        tokenizer = Tokenizer.from_gguf_metadata(runner.gguf.metadata)
        template = ChatTemplate.for_model(runner.gguf.metadata, tokenizer, settings.chat_template)
    except (EngineError, OSError, MemoryError, ValueError) as exc:
        log.exception("the model could not be loaded")
        writer.write({"event": "fatal", "message": f"cannot load {settings.model_path}: {exc}"})
        return ExitStatus.MODEL_LOAD
    ctx = ServeContext(
        runner=runner,
        tokenizer=tokenizer,
        template=template,
        completer=Completer(runner, tokenizer, template),
        reader=LineReader(stdin_fd if stdin_fd is not None else sys.stdin.fileno()),
        writer=writer,
    )
    registry, verbs = _build_registry(session_options, ctx)
    writer.write(ready_line(runner, tokenizer, template, verbs.identity(runner)))
    log.info("ready: %s", settings.model_path)
    return serve_loop(ctx, registry)
