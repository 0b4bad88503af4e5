"""The WSGI app gunicorn serves: the Falcon app with response header names cased as llama-server sends
them (``Process-Start-Time-Unix``, ``Access-Control-Allow-Origin``). HTTP header names are
case-insensitive, but Falcon writes them in lower case and clients that read headers into a plain
dictionary exist."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


def peer_header_name(name: str) -> str:
    """``access-control-allow-origin`` -> ``Access-Control-Allow-Origin`` (each dash-separated word capitalized)."""
    return "-".join(word[:1].upper() + word[1:] for word in name.split("-"))


def with_peer_header_case(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    def cased(environ: dict, start_response: Callable[..., Any]) -> Iterable[bytes]:
        def start(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            return start_response(status, [(peer_header_name(k), v) for k, v in headers], exc_info)

        return app(environ, start)

    return cased
