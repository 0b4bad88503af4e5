"""`strata-engine serve`: the engine protocol of spec/engine-protocol.md on stdin/stdout.

One command per line in, JSON lines out. Verbs live in a `CommandRegistry` (verb -> handler); the loop
only reads lines, looks the verb up, parses the argument the way the verb declares, runs the handler and
maps what it raises to an error line in one place (`error_payload`). New verbs (the session adapter's
SAVE / RESTORE) are registered in `build_registry` without touching the loop.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import select
import sys
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, BinaryIO

import attrs
import cattrs
import numpy as np
import xxhash

from .chat import ChatTemplate
from .errors import ChatTemplateError
from .completion import Completer, CompletionResult, TokenEvent, parse_request
from .errors import InvalidRequest
from .errors import ContextOverflow, EngineError
from .errors import InvalidToken as InvalidTokenId
from .errors import TokenizerError
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
ENGINE_NAME = "strata-engine"
MAX_LINE_BYTES = 256 * 1024 * 1024


class ExitStatus(enum.IntEnum):
    CLEAN = 0
    FATAL = 1
    USAGE = 2
    MODEL_LOAD = 3
    FAIL_STOP = 4


def engine_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(ENGINE_NAME)
    except PackageNotFoundError:
        return "0+unknown"


# -- errors --------------------------------------------------------------------------------------------


class ProtocolError(EngineError):
    """An error line with an explicit type (and, for some types, extra fields)."""

    def __init__(self, type_: str, message: str, *, reason: str = "", extra: Mapping[str, Any] | None = None):
        self.type = type_
        self.reason = reason
        self.extra = dict(extra or {})
        super().__init__(message)


class FailStop(EngineError):
    """The engine can no longer vouch for its K/V (a RESTORE failed after its gate): exit with status 4."""

    def __init__(self, message: str, reason: str = ""):
        self.reason = reason
        super().__init__(message)


# exception -> the `reason` of its invalid_request error line (most specific first)
_INVALID_REQUEST_REASONS: tuple[tuple[type[Exception], str], ...] = (
    (InvalidRequest, "bad_field"),
    (ChatTemplateError, "chat_template"),
    (InvalidTokenId, "bad_token"),
    (TokenizerError, "tokenizer"),
)


def error_payload(exc: BaseException) -> dict[str, Any]:
    """The `error` object of an error line for anything a handler raised (the one place errors are mapped)."""
    if isinstance(exc, ProtocolError):
        return {"type": exc.type, "message": str(exc), "reason": exc.reason, **exc.extra}
    if isinstance(exc, ContextOverflow):
        return {
            "type": "exceed_context_size",
            "message": str(exc),
            "reason": "prompt_too_long",
            "n_prompt_tokens": exc.n_prompt_tokens,
            "n_ctx": exc.n_ctx,
        }
    for kind, reason in _INVALID_REQUEST_REASONS:
        if isinstance(exc, kind):
            return {"type": "invalid_request", "message": str(exc), "reason": reason}
    if isinstance(exc, FailStop):
        return {"type": "fail_stop", "message": str(exc), "reason": exc.reason}
    if isinstance(exc, EngineError):
        return {"type": "internal", "message": str(exc), "reason": type(exc).__name__}
    return {"type": "internal", "message": f"{type(exc).__name__}: {exc}", "reason": "unexpected"}


# -- input and output ---------------------------------------------------------------------------------


class OverlongLine(bytes):
    """Stands for a line longer than MAX_LINE_BYTES (its first bytes); the rest of it is discarded."""


class LineReader:
    """Lines from a file descriptor with our own buffer, so that `poll` (select with no wait) sees
    exactly what has arrived; Python's buffered stdin would hide lines from select."""

    def __init__(self, fd: int, max_line_bytes: int = MAX_LINE_BYTES):
        self._fd = fd
        self._max = max_line_bytes
        self._buffer = bytearray()
        self._lines: deque[bytes] = deque()
        self._discarding = False  # inside an overlong line: drop bytes up to its newline
        self.eof = False

    def _fill(self, block: bool) -> None:
        if self.eof:
            return
        if not block:
            ready, _, _ = select.select([self._fd], [], [], 0)
            if not ready:
                return
        data = os.read(self._fd, 1 << 16)
        if not data:
            self.eof = True
            if self._buffer and not self._discarding:  # a last line without its newline
                self._lines.append(bytes(self._buffer))
            self._buffer.clear()
            return
        self._buffer += data
        while True:
            cut = self._buffer.find(b"\n")
            if cut < 0:
                break
            if self._discarding:
                self._discarding = False
            elif cut > self._max:
                self._lines.append(OverlongLine(self._buffer[:64]))
            else:
                self._lines.append(bytes(self._buffer[:cut]))
            del self._buffer[: cut + 1]
        if len(self._buffer) > self._max:
            if not self._discarding:
                self._lines.append(OverlongLine(self._buffer[:64]))
                self._discarding = True
            self._buffer.clear()

    def read_line(self) -> bytes | None:
        """The next line (without its newline), blocking; None at end of input."""
        while not self._lines and not self.eof:
            self._fill(block=True)
        return self._lines.popleft() if self._lines else None

    def poll_line(self) -> bytes | None:
        """A line that has already arrived, or None; never blocks."""
        if not self._lines:
            self._fill(block=False)
        return self._lines.popleft() if self._lines else None


class LineWriter:
    def __init__(self, stream: BinaryIO):
        self._stream = stream

    def write(self, obj: Mapping[str, Any]) -> None:
        data = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        self._stream.write(data.encode("utf-8") + b"\n")
        self._stream.flush()


_converter = cattrs.Converter()  # the protocol's boundary: attrs results -> JSON objects


# -- commands -------------------------------------------------------------------------------------------


class ArgumentKind(enum.Enum):
    NONE = "none"  # the verb alone
    JSON = "json"  # a JSON object
    PATH = "path"  # the rest of the line, verbatim


@attrs.define
class ServeContext:
    """What handlers work with. `emit` writes a non-terminal line (token, progress)."""

    runner: Any  # ModelRunner
    tokenizer: Tokenizer
    template: ChatTemplate
    completer: Completer
    reader: LineReader
    writer: LineWriter
    quit_requested: bool = False
    deferred: list[bytes] = attrs.Factory(list)  # lines that arrived during a COMPLETE

    def emit(self, obj: Mapping[str, Any]) -> None:
        self.writer.write(obj)


# A handler returns the terminal `result` payload, or None for a verb that is never answered (CANCEL).
Handler = Callable[[ServeContext, Any], Mapping[str, Any] | None]


@attrs.frozen
class Command:
    verb: str
    argument: ArgumentKind
    handler: Handler


class CommandRegistry:
    def __init__(self) -> None:
        self._commands: dict[str, Command] = {}

    def register(self, verb: str, argument: ArgumentKind, handler: Handler) -> None:
        """Add or replace a verb."""
        if not verb.isupper() or " " in verb:
            raise ValueError(f"verbs are upper-case words, got {verb!r}")
        self._commands[verb] = Command(verb, argument, handler)

    def get(self, verb: str) -> Command | None:
        return self._commands.get(verb)

    @property
    def verbs(self) -> list[str]:
        return sorted(self._commands)


def _json_object(argument: Any, verb: str) -> Mapping[str, Any]:
    if not isinstance(argument, Mapping):
        raise ProtocolError("invalid_request", f"{verb} takes a JSON object", reason="bad_argument")
    return argument


def _bool_field(obj: Mapping[str, Any], name: str, default: bool, problems: list[str]) -> bool:
    value = obj.get(name, default)
    if not isinstance(value, bool):
        problems.append(f"{name} must be a boolean, got {value!r}")
        return default
    return value


def handle_complete(ctx: ServeContext, argument: Any) -> Mapping[str, Any]:
    request = parse_request(_json_object(argument, "COMPLETE"))

    def on_token(event: TokenEvent) -> None:
        line: dict[str, Any] = {"event": "token", "id": event.id, "piece": event.piece, "content": event.content}
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

    try:
        result: CompletionResult = ctx.completer.complete(request, on_token=on_token, cancelled=cancelled)
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


def handle_tokenize(ctx: ServeContext, argument: Any) -> Mapping[str, Any]:
    obj = _json_object(argument, "TOKENIZE")
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
    obj = _json_object(argument, "DETOKENIZE")
    tokens = obj.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise InvalidRequest(["tokens must be a list of token ids"])
    return {"content": ctx.tokenizer.decode(tokens)}


def handle_apply_template(ctx: ServeContext, argument: Any) -> Mapping[str, Any]:
    obj = _json_object(argument, "APPLY_TEMPLATE")
    problems: list[str] = []
    add_generation_prompt = _bool_field(obj, "add_generation_prompt", True, problems)
    if problems:
        raise InvalidRequest(problems)
    return {"prompt": ctx.template.render(obj.get("messages"), add_generation_prompt=add_generation_prompt)}


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
    registry = CommandRegistry()
    registry.register("COMPLETE", ArgumentKind.JSON, handle_complete)
    registry.register("TOKENIZE", ArgumentKind.JSON, handle_tokenize)
    registry.register("DETOKENIZE", ArgumentKind.JSON, handle_detokenize)
    registry.register("APPLY_TEMPLATE", ArgumentKind.JSON, handle_apply_template)
    registry.register("STATUS", ArgumentKind.NONE, handle_status)
    registry.register("ERASE", ArgumentKind.NONE, handle_erase)
    registry.register("CANCEL", ArgumentKind.NONE, handle_cancel)
    registry.register("QUIT", ArgumentKind.NONE, handle_quit)
    # SAVE / RESTORE come from the session adapter (imported here: it imports this module).
    from .session.verbs import register_session_verbs

    register_session_verbs(registry, session_options, ctx)
    return registry


# -- the loop -------------------------------------------------------------------------------------------


def parse_line(line: bytes, registry: CommandRegistry) -> tuple[Command, Any]:
    """The command and its parsed argument; ProtocolError for a malformed line."""
    if isinstance(line, OverlongLine):
        raise ProtocolError("invalid_request", f"line longer than {MAX_LINE_BYTES} bytes", reason="line_too_long")
    try:
        text = line.decode("utf-8").rstrip("\r")
    except UnicodeDecodeError as exc:
        raise ProtocolError("invalid_request", f"line is not UTF-8 (byte {exc.start})", reason="bad_line") from None
    verb, sep, rest = text.partition(" ")
    if not verb:
        raise ProtocolError("invalid_request", "empty line: expected VERB or VERB ARGUMENT", reason="bad_line")
    command = registry.get(verb)
    if command is None:
        raise ProtocolError(
            "invalid_request", f"unknown verb {verb[:64]!r} (verbs: {', '.join(registry.verbs)})", reason="unknown_verb"
        )
    if command.argument is ArgumentKind.NONE:
        if sep:
            raise ProtocolError("invalid_request", f"{verb} takes no argument", reason="bad_argument")
        return command, None
    if not rest:
        raise ProtocolError("invalid_request", f"{verb} needs an argument", reason="bad_argument")
    if command.argument is ArgumentKind.PATH:
        return command, rest
    try:
        return command, json.loads(rest)
    except json.JSONDecodeError as exc:
        raise ProtocolError(
            "invalid_request", f"{verb}: bad JSON at character {exc.pos}: {exc.msg}", reason="bad_json"
        ) from None


def serve_loop(ctx: ServeContext, registry: CommandRegistry) -> ExitStatus:
    try:
        return _serve_lines(ctx, registry)
    except BrokenPipeError:
        log.info("stdout closed by the client: exiting")
        return ExitStatus.CLEAN


def _serve_lines(ctx: ServeContext, registry: CommandRegistry) -> ExitStatus:
    while not ctx.quit_requested:
        line = ctx.deferred.pop(0) if ctx.deferred else ctx.reader.read_line()
        if line is None:
            return ExitStatus.CLEAN  # end of input is QUIT
        try:
            command, argument = parse_line(line, registry)
            payload = command.handler(ctx, argument)
        except FailStop as exc:
            ctx.writer.write({"event": "error", "error": error_payload(exc)})
            return ExitStatus.FAIL_STOP
        except BrokenPipeError:
            raise
        except Exception as exc:  # every error becomes an error line; the engine keeps serving
            if not isinstance(exc, EngineError):
                log.exception("unexpected failure")
            ctx.writer.write({"event": "error", "error": error_payload(exc)})
            continue
        if payload is not None:
            ctx.writer.write({"event": "result", **payload})
    return ExitStatus.CLEAN


def ready_line(runner: Any, tokenizer: Tokenizer, template: ChatTemplate) -> dict[str, Any]:
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
        "kv_resident": settings.kv_resident,
        "bos_token": text_of(tokenizer.bos_id),
        "eos_token": text_of(tokenizer.eos_id),
        "chat_template": template.source,
        "chat_template_origin": template.origin,
        "add_bos": tokenizer.add_bos,
        "prompt_cache": settings.prompt_cache,
    }


def serve(settings, *, stdin_fd: int | None = None, stdout: BinaryIO | None = None,
          session_options: Any = None) -> ExitStatus:
    """Load the model, write the ready line, serve until QUIT or end of input."""
    from .runner import ModelRunner

    writer = LineWriter(stdout if stdout is not None else sys.stdout.buffer)
    try:
        settings.validate()
    except EngineError as exc:
        writer.write({"event": "fatal", "message": str(exc)})
        return ExitStatus.USAGE
    if not settings.model_path.is_file():
        writer.write({"event": "fatal", "message": f"model file not found: {settings.model_path}"})
        return ExitStatus.MODEL_LOAD
    try:
        runner = ModelRunner.load(settings)
        tokenizer = Tokenizer.from_gguf_metadata(runner.gguf.metadata)
        template = ChatTemplate.for_model(runner.gguf.metadata, tokenizer)
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
    registry = build_registry(session_options, ctx)
    writer.write(ready_line(runner, tokenizer, template))
    log.info("ready: %s", settings.model_path)
    return serve_loop(ctx, registry)
