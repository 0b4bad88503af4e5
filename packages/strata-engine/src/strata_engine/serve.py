"""`strata-engine serve`: the engine's verbs on the protocol of spec/engine-protocol.md.

The generic parts -- registry, line channel, error mapping, exit statuses -- are protocol.py's, the loop
is loop.py's; this module has the verbs of the loaded model (`build_registry`; SAVE / RESTORE come
from session/verbs.py), the ready line and `serve`, which loads the slots and runs the loop.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO

import numpy as np
import xxhash

from .chat import ChatTemplate
from .completion import Completer, parse_request
from .constraints import ConstraintCompiler
from .embedding import handle_embed, model_pooling
from .errors import ContextOverflow, EngineError, InvalidRequest
from .jobs import CompleteJob
from .kernel_cache import restart_if_compiled
from .loop import Cancel, Quit, ServeLoop
from .protocol import (
    ENGINE_NAME,
    PROTOCOL_VERSION,
    CommandRegistry,
    ExitStatus,
    FimToken,
    Handler,
    LineReader,
    LineWriter,
    Request,
    ServeContext,
    engine_version,
)
from .session.verbs import SessionVerbs, register_session_verbs
from .tokenizer import Tokenizer
from .wire import (
    VERBS,
    ApplyTemplateArgs,
    DetokenizeArgs,
    TokenizeArgs,
    arguments_of,
    register,
    unstructure,
)

log = logging.getLogger(__name__)

# -- commands -------------------------------------------------------------------------------------------


def handle_complete(ctx: ServeContext, request: Request) -> CompleteJob:
    """COMPLETE's job: prepared on the preparer thread, then admitted to the steps (jobs.py)."""
    assert request.slot is not None
    completer = ctx.completer_of(request.slot)
    return CompleteJob(
        request, request.slot, completer, lambda: completer.prepare(parse_request(request.args))
    )


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
    args: TokenizeArgs = arguments_of(request)
    tokens = ctx.tokenizer.encode(
        args.content, add_special=args.add_special, parse_special=args.parse_special
    )
    if not args.with_pieces:
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
    args: DetokenizeArgs = arguments_of(request)
    return {"content": ctx.tokenizer.decode(args.tokens)}


def handle_apply_template(ctx: ServeContext, request: Request) -> Mapping[str, Any]:
    args: ApplyTemplateArgs = arguments_of(request)
    return {
        "prompt": ctx.template.render(
            args.messages,
            add_generation_prompt=args.add_generation_prompt,
            continue_final_message=args.continue_final_message,
            tools=args.tools,
            chat_template_kwargs=args.chat_template_kwargs,
        )
    }


def tokens_digest(tokens) -> str:
    """XXH3-64 (hex) of the token ids as little-endian int32."""
    return xxhash.xxh3_64_hexdigest(np.asarray(tokens, dtype="<i4").tobytes())


def slot_status(ctx: ServeContext, slot: int) -> dict[str, Any]:
    runner = ctx.runner_of(slot)
    held = runner.tokens_held
    job = ctx.flight.busy.get(slot)
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
        "n_forward": ctx.flight.forward_passes,
        "slots": slots,
    }


def handle_erase(ctx: ServeContext, request: Request) -> Mapping[str, Any]:
    assert request.slot is not None
    return {"n_erased": ctx.runner_of(request.slot).erase()}


def handle_cancel(ctx: ServeContext, request: Request) -> Cancel:
    # No answer: a CANCEL that arrives just after its COMPLETE ended must leave no line behind.
    if request.id is None:
        raise InvalidRequest(["CANCEL needs the id of the COMPLETE to end"])
    return Cancel(request.id)


def handle_quit(ctx: ServeContext, request: Request) -> Quit:
    return Quit(request)  # answered once every request in flight has ended


# verb -> its handler (how the verb is called and where it runs: wire.VERBS); SAVE / RESTORE are session/verbs.py's
HANDLERS: dict[str, Handler] = {
    "COMPLETE": handle_complete,
    "PROMPT_TOKENS": handle_prompt_tokens,
    "TOKENIZE": handle_tokenize,
    "DETOKENIZE": handle_detokenize,
    "APPLY_TEMPLATE": handle_apply_template,
    "EMBED": handle_embed,
    "STATUS": handle_status,
    "ERASE": handle_erase,
    "CANCEL": handle_cancel,
    "QUIT": handle_quit,
}


def build_registry(session_options: Any = None, ctx: ServeContext | None = None) -> CommandRegistry:
    """Every verb; `session_options` (a `session.SessionOptions`, None = defaults) configures SAVE/RESTORE;
    with `ctx`, the session identity (which fingerprints the model files) is computed now, not in the
    first SAVE/RESTORE."""
    return _build_registry(session_options, ctx)[0]


def _build_registry(session_options: Any, ctx: ServeContext | None) -> tuple[CommandRegistry, SessionVerbs]:
    registry = CommandRegistry()
    register(registry, HANDLERS)
    verbs = register_session_verbs(registry, session_options, ctx)
    assert registry.verbs == sorted(VERBS), "every verb of wire.VERBS has its handler"
    return registry, verbs


# -- start-up -----------------------------------------------------------------------------------------


def ready_line(
    slots: Any, tokenizer: Tokenizer, template: ChatTemplate, identity: Any = None
) -> dict[str, Any]:
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
        "eog_tokens": sorted(tokenizer.end_of_generation),
        "chat_template": template.source,
        "chat_template_origin": template.origin,
        "add_bos": tokenizer.add_bos,
        "prompt_cache": settings.prompt_cache,
        "fim_tokens": {role.value: tokenizer.vocab.fim.get(role) for role in FimToken},
        "pooling": model_pooling(gguf_file.metadata, config.architecture).value,
        **(
            {
                "session_fingerprints": {
                    "model": identity.model.fingerprint.hex(),
                    "config": identity.config.fingerprint.hex(),
                }
            }
            if identity is not None
            else {}
        ),
    }


def serve(
    settings,
    *,
    stdin_fd: int | None = None,
    stdout: BinaryIO | None = None,
    session_options: Any = None,
    restart_argv: Sequence[str] | None = None,
) -> ExitStatus:
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
    loop = serve_loop(ctx, registry, reader, writer)
    writer.write(ready_line(slots, tokenizer, template, verbs.identity(runner)))
    log.info("ready: %s, %d slot(s)", settings.model_path, len(slots.runners))
    return loop.run()


def serve_loop(
    ctx: ServeContext, registry: CommandRegistry, reader: LineReader, writer: LineWriter
) -> ServeLoop:
    return ServeLoop(ctx, registry, reader, writer, unstructure)


def serve_context(slots: Any, tokenizer: Tokenizer, template: ChatTemplate) -> ServeContext:
    """The verbs' context over loaded slots: a completer per slot (its own sampler generator), one
    constraint compiler for all."""
    constraints = ConstraintCompiler(tokenizer)
    completers = tuple(
        Completer(runner, tokenizer, template, constraints=constraints) for runner in slots.runners
    )
    return ServeContext(slots=slots, tokenizer=tokenizer, template=template, completers=completers)
