"""The engine protocol's generic parts (spec/engine-protocol.md): its vocabulary (protocol and engine
version, exit statuses, error kinds and reasons), its two errors, the command registry and the line
channel.

Of the rest of the engine this module imports only the exceptions (errors.py, which imports nothing):
the verbs register into a `CommandRegistry` from outside (serve.py, session/verbs.py), and strata-server
imports the vocabulary from here without loading the engine. tests/engine/test_protocol_spec.py binds
the spec's tables to these constants. The loop that serves the lines is loop.py's.

A handler gets the `ServeContext` and the `Request` (its object, id and slot), writes its non-terminal
lines through `request.emit` and returns the terminal `result` payload; what it raises becomes the error
line (`error_payload`, the one place errors are mapped). `Request.tag` puts the id (and a slot verb's
slot) on every line written for it.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import json
import logging
import os
import select
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any, BinaryIO

import attrs

from .errors import (
    ChatTemplateError,
    ContextOverflow,
    EngineError,
    InvalidGrammar,
    InvalidJsonSchema,
    InvalidRequest,
    InvalidToken,
    TokenizerError,
)

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 2
ENGINE_NAME = "strata-engine"
MAX_LINE_BYTES = 256 * 1024 * 1024
READ_BLOCK_BYTES = 1 << 20  # per read of the command lines: a 50 MB line in 50 reads


def engine_version() -> str:
    """The installed strata-engine's version (the ready line's and the config fingerprint's)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(ENGINE_NAME)
    except PackageNotFoundError:
        return "0+unknown"


PROMPT_PROGRESS_PHASE = (
    "prompt"  # a COMPLETE's `progress` lines (return_progress); SAVE/RESTORE's are the format's
)


class FimToken(enum.StrEnum):
    """The fill-in-the-middle tokens a vocabulary may have (llama.cpp's `llama_vocab_fim_*`): the keys of the
    ready line's `fim_tokens`."""

    PRE = "pre"  # before the prefix
    SUF = "suf"  # before the suffix
    MID = "mid"  # after both: the model writes the middle
    PAD = "pad"
    REP = "rep"  # before the repository name
    SEP = "sep"  # before a file name


class SaveFormat(enum.StrEnum):
    """What a SAVE writes: a format v1 session file, or llama.cpp's slot file (spec/llama-cpp-slot.md)."""

    STRATA = "strata"
    LLAMA_CPP = "llama.cpp"


class ExitStatus(enum.IntEnum):
    """How `strata-engine serve` ends (spec "Exit statuses")."""

    CLEAN = 0
    FATAL = 1
    USAGE = 2
    MODEL_LOAD = 3
    FAIL_STOP = 4

    @property
    def meaning(self) -> str:
        return _EXIT_MEANINGS[self]


_EXIT_MEANINGS = {
    ExitStatus.CLEAN: "clean exit",
    ExitStatus.FATAL: "fatal error",
    ExitStatus.USAGE: "bad command-line settings",
    ExitStatus.MODEL_LOAD: "the model could not be loaded",
    ExitStatus.FAIL_STOP: "fail-stop after a restore had begun writing",
}


class ErrorKind(enum.StrEnum):
    """The `type` of an error line (spec "Errors")."""

    INVALID_REQUEST = "invalid_request"
    EXCEED_CONTEXT_SIZE = "exceed_context_size"
    SLOT_BUSY = (
        "slot_busy"  # the slot named runs a COMPLETE: the client chooses slots, the engine queues nothing
    )
    SESSION_REFUSED = "session_refused"
    SESSION_WRITE_FAILED = "session_write_failed"
    SLOT_FAILED = (
        "slot_failed"  # a restore failed after the slot's gate: that slot erased, the others untouched
    )
    FAIL_STOP = "fail_stop"
    CANCELLED = "cancelled"  # an EMBED ended by CANCEL before its last chunk (a COMPLETE's is a result)
    INTERNAL = "internal"


class Reason(enum.StrEnum):
    """The `reason`s the protocol itself gives, each under one kind (`REASON_KINDS`). The session kinds
    and `fail_stop` carry the format package's reasons instead; `internal` an engine exception's class
    name, or `unexpected`."""

    BAD_LINE = "bad_line"
    LINE_TOO_LONG = "line_too_long"
    UNKNOWN_VERB = "unknown_verb"
    BAD_ARGUMENT = "bad_argument"
    BAD_JSON = "bad_json"
    BAD_FIELD = "bad_field"
    DUPLICATE_ID = "duplicate_id"
    SLOT_BUSY = "slot_busy"
    BAD_TOKEN = "bad_token"
    CHAT_TEMPLATE = "chat_template"
    TOKENIZER = "tokenizer"
    BAD_GRAMMAR = "bad_grammar"
    BAD_JSON_SCHEMA = "bad_json_schema"
    PROMPT_TOO_LONG = "prompt_too_long"
    PREFIX_UNREACHABLE = "prefix_unreachable"
    CANCELLED = "cancelled"
    UNEXPECTED = "unexpected"


# The reasons not under invalid_request; every other one is.
_OTHER_REASON_KINDS: dict[Reason, ErrorKind] = {
    Reason.PROMPT_TOO_LONG: ErrorKind.EXCEED_CONTEXT_SIZE,
    Reason.SLOT_BUSY: ErrorKind.SLOT_BUSY,
    Reason.PREFIX_UNREACHABLE: ErrorKind.SESSION_REFUSED,
    Reason.CANCELLED: ErrorKind.CANCELLED,
    Reason.UNEXPECTED: ErrorKind.INTERNAL,
}
REASON_KINDS: dict[Reason, ErrorKind] = {
    r: _OTHER_REASON_KINDS.get(r, ErrorKind.INVALID_REQUEST) for r in Reason
}


# -- errors --------------------------------------------------------------------------------------------


class ProtocolError(EngineError):
    """An error line of an explicit kind (and, for some kinds, extra fields)."""

    def __init__(
        self, kind: ErrorKind, message: str, *, reason: str = "", extra: Mapping[str, Any] | None = None
    ):
        self.kind = kind
        self.reason = reason
        self.extra = dict(extra or {})
        super().__init__(message)


class FailStop(EngineError):
    """The engine can no longer vouch for its K/V (a RESTORE failed after its gate): exit with status 4."""

    def __init__(self, message: str, reason: str = ""):
        self.reason = reason
        super().__init__(message)


# engine exception -> the kind and reason of its error line (most specific first)
ERROR_LINES: tuple[tuple[type[EngineError], ErrorKind, Reason], ...] = (
    (ContextOverflow, ErrorKind.EXCEED_CONTEXT_SIZE, Reason.PROMPT_TOO_LONG),
    (InvalidRequest, ErrorKind.INVALID_REQUEST, Reason.BAD_FIELD),
    (ChatTemplateError, ErrorKind.INVALID_REQUEST, Reason.CHAT_TEMPLATE),
    (InvalidToken, ErrorKind.INVALID_REQUEST, Reason.BAD_TOKEN),
    (TokenizerError, ErrorKind.INVALID_REQUEST, Reason.TOKENIZER),
    (InvalidGrammar, ErrorKind.INVALID_REQUEST, Reason.BAD_GRAMMAR),
    (InvalidJsonSchema, ErrorKind.INVALID_REQUEST, Reason.BAD_JSON_SCHEMA),
)


def error_payload(exc: BaseException) -> dict[str, Any]:
    """The `error` object of an error line for anything a handler raised (the one place errors are mapped)."""
    if isinstance(exc, ProtocolError):
        return {"type": exc.kind.value, "message": str(exc), "reason": exc.reason, **exc.extra}
    if isinstance(exc, FailStop):
        return {"type": ErrorKind.FAIL_STOP.value, "message": str(exc), "reason": exc.reason}
    for cls, kind, reason in ERROR_LINES:
        if isinstance(exc, cls):
            payload: dict[str, Any] = {"type": kind.value, "message": str(exc), "reason": reason.value}
            if isinstance(exc, ContextOverflow):
                payload |= {
                    "n_prompt_tokens": exc.n_prompt_tokens,
                    "n_ctx": exc.n_ctx,
                    "at_least": exc.at_least,
                }
            return payload
    if isinstance(exc, EngineError):
        return {"type": ErrorKind.INTERNAL.value, "message": str(exc), "reason": type(exc).__name__}
    return {
        "type": ErrorKind.INTERNAL.value,
        "message": f"{type(exc).__name__}: {exc}",
        "reason": Reason.UNEXPECTED.value,
    }


def invalid_request(message: str, reason: Reason) -> ProtocolError:
    return ProtocolError(ErrorKind.INVALID_REQUEST, message, reason=reason.value)


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
        data = os.read(self._fd, READ_BLOCK_BYTES)
        if not data:
            self.eof = True
            if self._buffer and not self._discarding:  # a last line without its newline
                self._lines.append(bytes(self._buffer))
            self._buffer.clear()
            return
        scan = len(self._buffer)  # what was there before has no newline: a 50 MB line is read in linear time
        self._buffer += data
        while True:
            cut = self._buffer.find(b"\n", scan)
            if cut < 0:
                break
            scan = 0
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

    def widen_pipe(self) -> None:
        """Where the input is a pipe (Linux), make it hold a whole read block, so a huge line takes a few
        reads, not one per 64 KiB (the default pipe size); elsewhere nothing."""
        set_size = getattr(fcntl, "F_SETPIPE_SZ", None)
        if set_size is None:
            return
        try:
            fcntl.fcntl(self._fd, set_size, READ_BLOCK_BYTES)
        except OSError:  # not a pipe, or above /proc/sys/fs/pipe-max-size
            pass

    def read_line(self) -> bytes | None:
        """The next line (without its newline), blocking; None at end of input."""
        while not self._lines and not self.eof:
            self._fill(block=True)
        return self._lines.popleft() if self._lines else None

    def wait(self, other_fd: int) -> None:
        """Block until a line has arrived, the end of input is seen, or `other_fd` is readable; after the
        end of input, until `other_fd` is readable."""
        if self.eof:
            if not self._lines:
                select.select([other_fd], [], [])
            return
        while not self._lines and not self.eof:
            ready, _, _ = select.select([self._fd, other_fd], [], [])
            if self._fd in ready:
                self._fill(block=True)
            if other_fd in ready:
                return

    def has_line(self) -> bool:
        """Whether a whole line is waiting (poll_line would return it)."""
        return bool(self._lines)

    def poll_line(self) -> bytes | None:
        """A line that has already arrived, or None; never blocks."""
        if not self._lines:
            self._fill(block=False)
        return self._lines.popleft() if self._lines else None


class LineWriter:
    def __init__(self, stream: BinaryIO):
        self._stream = stream
        self._held: list[bytes] | None = None  # inside `held()`: the lines written so far

    def write(self, obj: Mapping[str, Any]) -> None:
        data = (
            json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
            + b"\n"
        )
        if self._held is not None:
            self._held.append(data)
            return
        self._stream.write(data)
        self._stream.flush()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The lines written meanwhile go out together at the end, in one write: a decode step's token lines
        cost the engine one system call and wake the client's reader once, not once per slot."""
        self._held = []
        try:
            yield
        finally:
            data, self._held = b"".join(self._held), None
            if data:
                self._stream.write(data)
                self._stream.flush()


# -- commands -------------------------------------------------------------------------------------------

MAX_ID_CHARS = 256  # a request id's length


class ArgumentKind(enum.Enum):
    """A verb's argument (spec "Lines", the table's `argument` column starts with the value)."""

    JSON = "JSON object"  # required
    OPTIONAL = "optional JSON object"  # the verb alone is the same as {}


class Dispatch(enum.Enum):
    """Where the serve loop runs a verb's handler (spec "Scheduling")."""

    NOW = "now"  # in the loop, between two steps (it touches a slot or the loop's state)
    WORKER = (
        "worker"  # on the worker thread beside the steps (it touches no slot); answered at a step boundary
    )
    JOB = "job"  # the handler returns a job the steps advance; the job writes the terminal line
    SESSION = "session"  # on the session thread, one at a time, its slot busy; it writes the live pool only
    # after `request.gate.enter()`, which waits for a step boundary and holds the steps until it ends


@attrs.frozen
class Request:
    """One command line, read: its verb, its object, the client's `id` and, for a slot verb, the slot."""

    verb: str
    args: Mapping[str, Any] = attrs.field(factory=dict)
    id: str | None = None
    slot: int | None = None  # a slot verb's slot; None for the others
    writer: LineWriter | None = attrs.field(default=None, eq=False, repr=False)
    gate: Any = attrs.field(default=None, eq=False, repr=False)  # Dispatch.SESSION: the loop's Gate

    def tag(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """A line for this request: its `event` first, then its id (and slot on terminal lines)."""
        head: dict[str, Any] = {"event": obj["event"]}
        if self.id is not None:
            head["id"] = self.id
        if self.slot is not None and obj["event"] in TERMINAL_EVENTS:
            head["slot"] = self.slot
        return head | dict(obj)

    def emit(self, obj: Mapping[str, Any]) -> None:
        """A non-terminal line (token, progress); written by the loop's thread only."""
        assert self.writer is not None
        self.writer.write(self.tag(obj))

    def answer(self, payload: Mapping[str, Any]) -> None:
        self.emit({"event": "result", **payload})

    def fail(self, exc: BaseException, **fields: Any) -> None:
        """The terminal error line; `fields` go beside `error` (a job's `n_forward`)."""
        self.emit({"event": "error", "error": error_payload(exc), **fields})


TERMINAL_EVENTS = ("result", "error")
CANCELLABLE_VERBS = frozenset(
    {"COMPLETE", "EMBED"}
)  # the verbs a CANCEL ends: the stepped jobs (Dispatch.JOB)


@attrs.define
class Flight:
    """The requests in flight, kept by the serve loop (loop.py, jobs.py); STATUS reads them."""

    busy: dict[int, Any] = attrs.Factory(dict)  # slot -> the job holding it (a COMPLETE or a session verb)
    # forward passes run (a batched decode, a prompt's or an EMBED's chunk), failed ones included:
    # llama-server's n_decode_total, on the terminal lines of COMPLETE and EMBED and in STATUS
    forward_passes: int = 0


@attrs.define
class ServeContext:
    """What handlers work with: the engine's parts the verbs act on (typed loosely: this module imports
    no engine code). Slot i's runner is `slots.runners[i]`, its completer (which holds its sampler state)
    `completers[i]`. A handler answers; a JOB verb's handler returns its job instead (jobs.py), CANCEL's and
    QUIT's an order to the loop (loop.py)."""

    slots: Any  # slots.SlotSet
    tokenizer: Any  # tokenizer.Tokenizer
    template: Any  # chat.ChatTemplate
    completers: tuple[Any, ...] = ()  # completion.Completer per slot
    flight: Flight = attrs.Factory(Flight)

    @property
    def n_slots(self) -> int:
        return len(self.slots.runners)

    def runner_of(self, slot: int) -> Any:
        return self.slots.runners[slot]

    def completer_of(self, slot: int) -> Any:
        return self.completers[slot]


# A handler returns the terminal `result` payload, or (a JOB verb) its job, or (CANCEL, QUIT) an order to the loop.
Handler = Callable[[ServeContext, Request], Any]


@attrs.frozen
class Command:
    verb: str
    argument: ArgumentKind
    handler: Handler
    dispatch: Dispatch = Dispatch.NOW
    slotted: bool = (
        False  # it acts on one slot: its object may name `slot`, it is refused while the slot is busy
    )


class CommandRegistry:
    def __init__(self) -> None:
        self._commands: dict[str, Command] = {}

    def register(
        self,
        verb: str,
        argument: ArgumentKind,
        handler: Handler,
        dispatch: Dispatch = Dispatch.NOW,
        *,
        slotted: bool = False,
    ) -> None:
        """Add or replace a verb."""
        if not verb.isupper() or " " in verb:
            raise ValueError(f"verbs are upper-case words, got {verb!r}")
        self._commands[verb] = Command(verb, argument, handler, dispatch, slotted)

    def get(self, verb: str) -> Command | None:
        return self._commands.get(verb)

    @property
    def verbs(self) -> list[str]:
        return sorted(self._commands)


@attrs.frozen
class ParsedLine:
    """A line read: the command and its request, or the error to answer (with the id when it was read)."""

    command: Command | None
    request: Request
    error: ProtocolError | None = None


def _is_slot(value: Any, n_slots: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < n_slots


def parse_line(
    line: bytes, registry: CommandRegistry, n_slots: int = 1, writer: LineWriter | None = None
) -> ParsedLine:
    """The command and its request; a malformed line gives the error to answer instead."""

    def refused(message: str, reason: Reason, request: Request | None = None) -> ParsedLine:
        return ParsedLine(None, request or Request("", writer=writer), invalid_request(message, reason))

    if isinstance(line, OverlongLine):
        return refused(f"line longer than {MAX_LINE_BYTES} bytes", Reason.LINE_TOO_LONG)
    try:
        text = line.decode("utf-8").rstrip("\r")
    except UnicodeDecodeError as exc:
        return refused(f"line is not UTF-8 (byte {exc.start})", Reason.BAD_LINE)
    verb, sep, rest = text.partition(" ")
    if not verb:
        return refused("empty line: expected VERB or VERB ARGUMENT", Reason.BAD_LINE)
    args: Any = {}
    if rest:
        try:
            args = json.loads(rest)
        except json.JSONDecodeError as exc:
            return refused(f"{verb[:64]}: bad JSON at character {exc.pos}: {exc.msg}", Reason.BAD_JSON)
        if not isinstance(args, Mapping):
            return refused(f"{verb[:64]} takes a JSON object", Reason.BAD_ARGUMENT)
    raw_id = args.get("id")
    if raw_id is not None and not (isinstance(raw_id, str) and 1 <= len(raw_id) <= MAX_ID_CHARS):
        return refused(
            f"id must be a string of 1 to {MAX_ID_CHARS} characters, got {str(raw_id)[:64]!r}",
            Reason.BAD_FIELD,
        )
    command = registry.get(verb)
    if command is None:
        return refused(
            f"unknown verb {verb[:64]!r} (verbs: {', '.join(registry.verbs)})",
            Reason.UNKNOWN_VERB,
            Request(verb, args, raw_id, writer=writer),
        )
    slot = None
    if command.slotted:
        slot = args.get("slot", 0)
        if not _is_slot(slot, n_slots):
            return refused(
                f"slot must be an integer in [0, {n_slots}), got {str(slot)[:64]}",
                Reason.BAD_FIELD,
                Request(verb, args, raw_id, writer=writer),
            )
    request = Request(verb, args, raw_id, slot, writer)
    if command.argument is ArgumentKind.JSON and not (sep and rest):
        return refused(f"{verb} needs an argument", Reason.BAD_ARGUMENT, request)
    return ParsedLine(command, request)
