"""Checks the server's tests share: llama-server's error object, and file names the slot actions refuse."""

from __future__ import annotations

import json

# Names fs_validate_filename refuses (the peer's rules), each for a different reason.
BAD_NAMES = [
    "",
    "../x",
    "/etc/passwd",
    "a/b",
    "a\\b",
    "a..b.bin",
    "..",
    ".",
    "x.",
    " x",
    "x ",
    "a:b",
    "a*b",
    "a?b",
    'a"b',
    "a<b",
    "a>b",
    "a|b",
    "a\x01b",
    "a\x7fb",
    "a\u0085b",
    "a\uff0eb",
    "a\u2215b",
    "a\u2216b",
    "a\ufffdb",
    "a\ufeffb",
    "\ud800x",
    "é" * 128,
]


def assert_error(result, status: int, type_: str, message: str | None = None) -> dict:
    """The response is llama-server's error object with this status and type (and message); returns it."""
    assert result.status_code == status, result.text
    body = result.json
    assert set(body) == {"error"}
    error = body["error"]
    assert error["code"] == status and error["type"] == type_
    if message is not None:
        assert error["message"] == message
    return error


def sse_events(body: str) -> list:
    """Split an SSE body into data payloads; checks the framing (``data: ...\\n\\n``) strictly."""
    assert body.endswith("\n\n")
    frames = body[:-2].split("\n\n")
    out = []
    for frame in frames:
        if frame == ":":
            continue
        assert frame.startswith("data: "), frame
        payload = frame[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out
