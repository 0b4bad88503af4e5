"""The server's exceptions and the one place that turns any of them into llama-server's error object.

Every error response is ``{"error": {"code": int, "message": str, "type": str, ...}}`` with the HTTP
status equal to ``code`` (llama-server's ``format_error_response``). ``ErrorType`` values are the
peer's ``type`` strings; each carries its status code.
"""

from __future__ import annotations

import enum
import json
import logging
from typing import Any

import falcon
from strata_engine.protocol import ErrorKind

log = logging.getLogger("strata_server")


class ErrorType(enum.Enum):
    """llama-server's error types, value = (type string, HTTP status)."""

    INVALID_REQUEST = ("invalid_request_error", 400)
    AUTHENTICATION = ("authentication_error", 401)
    PERMISSION = ("permission_error", 403)
    NOT_FOUND = ("not_found_error", 404)
    SERVER = ("server_error", 500)
    NOT_SUPPORTED = ("not_supported_error", 501)
    UNAVAILABLE = ("unavailable_error", 503)
    EXCEED_CONTEXT_SIZE = ("exceed_context_size_error", 400)

    @property
    def type_name(self) -> str:
        return self.value[0]

    @property
    def status(self) -> int:
        return self.value[1]


class ServerError(Exception):
    """Root of strata-server's exceptions."""


class ApiError(ServerError):
    """An error answered to the client as llama-server's error object.

    ``status`` overrides the type's usual status where HTTP needs another code (413, 415);
    ``extra`` adds fields beside code/message/type (``n_prompt_tokens``, ``reason``, ...).
    """

    def __init__(self, error_type: ErrorType, message: str, *, status: int | None = None, **extra: Any):
        super().__init__(message)
        self.error_type = error_type
        self.message = message
        self.status = status if status is not None else error_type.status
        self.extra = extra

    def body(self) -> dict:
        return {
            "error": {
                "code": self.status,
                "message": self.message,
                "type": self.error_type.type_name,
                **self.extra,
            }
        }


def invalid_request(message: str, **extra: Any) -> ApiError:
    return ApiError(ErrorType.INVALID_REQUEST, message, **extra)


# --- engine-side failures (raised by the engine client, mapped below) -----------------------------


class EngineCallError(ServerError):
    """Root of the failures of a call to the engine process (not the engine's own exceptions, which stay
    in its process: its error lines arrive as `EngineReplyError`)."""


class EngineUnavailable(EngineCallError):
    """The engine is loading, restarting, or gave up; requests get the peer's 503."""

    def __init__(self, message: str = "Loading model"):
        super().__init__(message)
        self.message = message


class SlotBusy(EngineCallError):
    """No slot (or the slot the request named) became idle within the bounded wait."""

    def __init__(self, waited_s: float, slots: str = "slot 0"):
        super().__init__(f"no slot available: {slots} stayed busy for {waited_s:g} s")
        self.waited_s = waited_s


class EngineDied(EngineCallError):
    """The engine process exited (or was killed) while serving a request."""

    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail


class EngineProtocolViolation(EngineCallError):
    """The engine wrote something the protocol does not allow; the server restarts it."""


class EngineReplyError(EngineCallError):
    """A command ended with an ``{"event": "error"}`` line; ``error`` is that line's error object and
    ``kind`` its ``type`` (an ``ErrorKind`` value, compared as a string: a newer engine may add kinds)."""

    def __init__(self, error: dict):
        self.error = error
        self.kind = str(error.get("type", ErrorKind.INTERNAL))
        self.reason = error.get("reason")
        self.message = str(error.get("message", "engine error"))
        super().__init__(f"{self.kind}: {self.message}")


# Engine error kind -> how the client sees it (spec/engine-protocol.md "Errors"); a kind missing here is
# a server error.
_ENGINE_ERROR_TYPES: dict[str, ErrorType] = {
    ErrorKind.INVALID_REQUEST: ErrorType.INVALID_REQUEST,
    ErrorKind.EXCEED_CONTEXT_SIZE: ErrorType.EXCEED_CONTEXT_SIZE,
    ErrorKind.SESSION_REFUSED: ErrorType.INVALID_REQUEST,
    ErrorKind.SESSION_WRITE_FAILED: ErrorType.SERVER,
    ErrorKind.SLOT_BUSY: ErrorType.UNAVAILABLE,  # the server chooses idle slots: only a lost race gets here
    ErrorKind.SLOT_FAILED: ErrorType.SERVER,
    ErrorKind.FAIL_STOP: ErrorType.SERVER,
    ErrorKind.CANCELLED: ErrorType.SERVER,  # the server cancels an EMBED only when its client has gone
    ErrorKind.INTERNAL: ErrorType.SERVER,
}


def _from_engine_reply(exc: EngineReplyError) -> ApiError:
    error_type = _ENGINE_ERROR_TYPES.get(exc.kind, ErrorType.SERVER)
    extra: dict[str, Any] = {}
    if error_type is ErrorType.EXCEED_CONTEXT_SIZE:
        for key in ("n_prompt_tokens", "n_ctx"):
            if key in exc.error:
                extra[key] = exc.error[key]
        message = exc.message
        if "n_prompt_tokens" in extra and "n_ctx" in extra:
            # refused before tokenizing: the count is a lower bound (engine-protocol.md), said so
            count = (
                f"at least {extra['n_prompt_tokens']}"
                if exc.error.get("at_least")
                else extra["n_prompt_tokens"]
            )
            message = (
                f"request ({count} tokens) exceeds the available context size "
                f"({extra['n_ctx']} tokens), try increasing it"
            )
        return ApiError(error_type, message, **extra)
    if exc.reason:
        extra["reason"] = exc.reason
    return ApiError(error_type, exc.message, **extra)


def _from_falcon(exc: falcon.HTTPError) -> ApiError:
    if exc.status_code in (404, 405):
        # The peer answers 404 for any route/method it does not register.
        return ApiError(ErrorType.NOT_FOUND, "File Not Found")
    if exc.status_code == 413:
        return ApiError(ErrorType.INVALID_REQUEST, exc.description or "request body too large", status=413)
    by_status = {e.status: e for e in ErrorType if e is not ErrorType.EXCEED_CONTEXT_SIZE}
    error_type = by_status.get(
        exc.status_code, ErrorType.INVALID_REQUEST if exc.status_code < 500 else ErrorType.SERVER
    )
    return ApiError(error_type, exc.description or exc.title or "error", status=exc.status_code)


def to_api_error(exc: BaseException) -> ApiError:
    """The single mapping from any exception to the error the client sees."""
    match exc:
        case ApiError():
            return exc
        case EngineUnavailable():
            return ApiError(ErrorType.UNAVAILABLE, exc.message)
        case SlotBusy():
            return ApiError(ErrorType.UNAVAILABLE, str(exc))
        case EngineReplyError():
            return _from_engine_reply(exc)
        case EngineDied():
            return ApiError(
                ErrorType.SERVER,
                f"the engine stopped during this request ({exc.detail}); it is being restarted",
            )
        case EngineProtocolViolation():
            return ApiError(
                ErrorType.SERVER, f"engine protocol violation ({exc}); the engine is being restarted"
            )
        case falcon.HTTPError():
            return _from_falcon(exc)
    return ApiError(ErrorType.SERVER, "Internal server error")


def handle_error(req: falcon.Request, resp: falcon.Response, exc: BaseException, params: dict) -> None:
    """Falcon error handler registered for ``Exception``: every error response goes through here."""
    api_error = to_api_error(exc)
    if api_error.status >= 500 and not isinstance(exc, (EngineCallError, ApiError)):
        log.error("unhandled error on %s %s", req.method, req.path, exc_info=exc)
    resp.status = api_error.status
    resp.content_type = falcon.MEDIA_JSON
    resp.text = json.dumps(api_error.body())
    resp.complete = True


def sse_error_frame(exc: BaseException) -> bytes:
    """An error that happens after an SSE stream started: ``data: {"error": {...}}``."""
    return b"data: " + json.dumps(to_api_error(exc).body()).encode() + b"\n\n"
