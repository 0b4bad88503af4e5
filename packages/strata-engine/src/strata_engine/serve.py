"""`strata-engine serve`: the engine's verbs on the protocol of spec/engine-protocol.md.

The generic parts -- registry, line channel, error mapping, exit statuses -- are protocol.py's, the loop
is scheduler.py's; this module has the verbs of the loaded model (`build_registry`; SAVE / RESTORE come
from session/verbs.py), the ready line and `serve`, which loads the slots and runs the scheduler.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO

import cattrs
import numpy as np
import xxhash

from .chat import ChatTemplate
from .completion import Completer, parse_request
from .constraints import ConstraintCompiler
from .embedding import handle_embed, model_pooling
from .errors import ContextOverflow, EngineError, InvalidRequest
from .kernel_cache import restart_if_compiled
from .protocol import (
    ENGINE_NAME,
    PROTOCOL_VERSION,
    ArgumentKind,
    CommandRegistry,
    Dispatch,
    ExitStatus,
    FimToken,
    LineReader,
    LineWriter,
    Request,
    ServeContext,
    engine_version,
)
from .scheduler import Scheduler
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


def handle_complete(ctx: ServeContext, request: Request) -> None:
    ctx.scheduler.start_complete(request)


def handle_prompt_tokens(ctx: ServeContext, request: Request) -> Mapping[str, Any]:
    """The tokens a COMPLETE with this argument would evaluate, checked as COMPLETE checks them (a server
    looks its prompt up in a session store with them, then sends them as the COMPLETE's prompt). Every slot
    has the same context: slot 0's completer measures it."""
    completer = ctx.completer_of(0)
    tokens = completer.prompt_tokens(parse_request(request.args))
    n_ctx = completer.runner.n_ctx
    if len(tokens) > n_ctx:
        raise ContextOverflow(len(tokens), n_ctx)
    return {"tokens": tokens}


def handle_tokenize(ctx: ServeContext, request: Request) -> Mapping[str, Any]:
    obj = request.args
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


def handle_detokenize(ctx: ServeContext, request: Request) -> Mapping[str, Any]:
    tokens = request.args.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise InvalidRequest(["tokens must be a list of token ids"])
    return {"content": ctx.tokenizer.decode(tokens)}


def handle_apply_template(ctx: ServeContext, request: Request) -> Mapping[str, Any]:
    obj = request.args
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


def slot_status(ctx: ServeContext, slot: int) -> dict[str, Any]:
    runner = ctx.runner_of(slot)
    held = runner.tokens_held
    job = ctx.scheduler.busy.get(slot) if ctx.scheduler is not None else None
    return {
        "slot": slot,
        "n_ctx": runner.n_ctx,
        "n_past": len(held),
        "n_tokens_held": len(held),
        "tokens_held_digest": tokens_digest(held),
        "is_processing": job is not None,
        "request_id": None if job is None else job.request.id,
        "n_checkpoints": len(runner.checkpoints),
        "sampler_seed": ctx.completer_of(slot).sampler_state.seed,
    }


def handle_status(ctx: ServeContext, request: Request) -> Mapping[str, Any]:
    slots = [slot_status(ctx, i) for i in range(ctx.n_slots)]
    settings = ctx.runner_of(0).settings
    return {
        "n_ctx": slots[0]["n_ctx"] * len(slots),
        "n_slots": len(slots),
        "n_ctx_slot": slots[0]["n_ctx"],
        "is_processing": any(s["is_processing"] for s in slots),
        "kv_type": settings.kv_type,
        "backend": settings.backend,
        "compute_dtype": settings.compute_dtype,
        "cpu_kernels": settings.cpu_kernels,
        "threads": settings.threads,
        "kv_resident": settings.kv_resident,
        "prompt_cache": settings.prompt_cache,
        "model_path": str(settings.model_path),
        "n_forward": ctx.scheduler.forward_passes if ctx.scheduler is not None else 0,
        "slots": slots,
    }


def handle_erase(ctx: ServeContext, request: Request) -> Mapping[str, Any]:
    return {"n_erased": ctx.runner_of(request.slot).erase()}


def handle_cancel(ctx: ServeContext, request: Request) -> None:
    # No answer: a CANCEL that arrives just after its COMPLETE ended must leave no line behind.
    if request.id is None:
        raise InvalidRequest(["CANCEL needs the id of the COMPLETE to end"])
    ctx.scheduler.cancel(request.id)
    return None


def handle_quit(ctx: ServeContext, request: Request) -> None:
    ctx.scheduler.request_quit(request)  # answered once every request in flight has ended
    return None


# verb -> (argument, handler, where it runs, whether it names a slot)
VERBS: dict[str, tuple[ArgumentKind, Any, Dispatch, bool]] = {
    "COMPLETE": (ArgumentKind.JSON, handle_complete, Dispatch.JOB, True),
    "PROMPT_TOKENS": (ArgumentKind.JSON, handle_prompt_tokens, Dispatch.WORKER, False),
    "TOKENIZE": (ArgumentKind.JSON, handle_tokenize, Dispatch.WORKER, False),
    "DETOKENIZE": (ArgumentKind.JSON, handle_detokenize, Dispatch.WORKER, False),
    "APPLY_TEMPLATE": (ArgumentKind.JSON, handle_apply_template, Dispatch.WORKER, False),
    "EMBED": (ArgumentKind.JSON, handle_embed, Dispatch.JOB, False),
    "STATUS": (ArgumentKind.OPTIONAL, handle_status, Dispatch.NOW, False),
    "ERASE": (ArgumentKind.OPTIONAL, handle_erase, Dispatch.NOW, True),
    "CANCEL": (ArgumentKind.JSON, handle_cancel, Dispatch.NOW, False),
    "QUIT": (ArgumentKind.OPTIONAL, handle_quit, Dispatch.NOW, False),
}


def build_registry(session_options: Any = None, ctx: ServeContext | None = None) -> CommandRegistry:
    """Every verb; `session_options` (a `session.SessionOptions`, None = defaults) configures SAVE/RESTORE;
    with `ctx`, the session identity (which fingerprints the model files) is computed now, not in the
    first SAVE/RESTORE."""
    return _build_registry(session_options, ctx)[0]


def _build_registry(session_options: Any, ctx: ServeContext | None) -> tuple[CommandRegistry, SessionVerbs]:
    registry = CommandRegistry()
    for verb, (argument, handler, dispatch, slotted) in VERBS.items():
        registry.register(verb, argument, handler, dispatch, slotted=slotted)
    verbs = register_session_verbs(registry, session_options, ctx)
    return registry, verbs


# -- start-up -----------------------------------------------------------------------------------------


def ready_line(slots: Any, tokenizer: Tokenizer, template: ChatTemplate, identity: Any = None) -> dict[str, Any]:
    """The ready line; `identity` (the session files' `EngineIdentity`) adds the fingerprints a file written
    by this engine carries in its header, so a client can tell its files from other engines'."""
    runner = slots.runners[0]
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
        "n_ctx": runner.n_ctx * len(slots.runners),
        "n_slots": len(slots.runners),
        "n_ctx_slot": runner.n_ctx,
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
          session_options: Any = None, restart_argv: Sequence[str] | None = None) -> ExitStatus:
    """Load the model into its slots, write the ready line, serve until QUIT or end of input. With
    `restart_argv` (the command line that started this process), a load that compiled kernels starts the
    process over with it before the ready line (`kernel_cache.restart_if_compiled`)."""
    from .slots import SlotSet

    writer = LineWriter(stdout if stdout is not None else sys.stdout.buffer)
    try:
        if settings.chat_template is not None:
            ChatTemplate.configured(settings.chat_template)  # a template that does not parse is a bad setting
    except EngineError as exc:
        writer.write({"event": "fatal", "message": str(exc)})
        return ExitStatus.USAGE
    if not settings.model_path.is_file():
        writer.write({"event": "fatal", "message": f"model file not found: {settings.model_path}"})
        return ExitStatus.MODEL_LOAD
    try:
        slots = SlotSet.load(settings)
        runner = slots.runners[0]
        tokenizer = Tokenizer.from_gguf_metadata(runner.gguf.metadata)
        template = ChatTemplate.for_model(runner.gguf.metadata, tokenizer, settings.chat_template)
    except (EngineError, OSError, MemoryError, ValueError) as exc:
        log.exception("the model could not be loaded")
        writer.write({"event": "fatal", "message": f"cannot load {settings.model_path}: {exc}"})
        return ExitStatus.MODEL_LOAD
    if restart_argv is not None:
        restart_if_compiled(restart_argv)
    ctx = serve_context(slots, tokenizer, template)
    registry, verbs = _build_registry(session_options, ctx)
    reader = LineReader(stdin_fd if stdin_fd is not None else sys.stdin.fileno())
    scheduler = scheduler_for(ctx, registry, reader, writer)
    writer.write(ready_line(slots, tokenizer, template, verbs.identity(runner)))
    log.info("ready: %s, %d slot(s)", settings.model_path, len(slots.runners))
    return scheduler.run()


def scheduler_for(ctx: ServeContext, registry: CommandRegistry, reader: LineReader, writer: LineWriter) -> Scheduler:
    return Scheduler(ctx, registry, reader, writer, _converter.unstructure)


def serve_context(slots: Any, tokenizer: Tokenizer, template: ChatTemplate) -> ServeContext:
    """The verbs' context over loaded slots: a completer per slot (its own sampler generator), one
    constraint compiler for all."""
    constraints = ConstraintCompiler(tokenizer)
    completers = tuple(Completer(runner, tokenizer, template, constraints=constraints) for runner in slots.runners)
    return ServeContext(slots=slots, tokenizer=tokenizer, template=template, completers=completers)
