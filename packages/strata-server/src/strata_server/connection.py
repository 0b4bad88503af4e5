"""Whether the HTTP client is still there, and the engine events of a request watched for its departure.

A client that closes its connection while its completion runs must not keep the slot: llama-server
keeps generating a non-streamed answer nobody will read. Under gunicorn the request's socket is in the
WSGI environ (``gunicorn.socket``); a closed connection reads as end of file without blocking. Where
there is no socket (falcon.testing), the client is taken to be there.
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .engine.client import IDLE_EVENT

WSGI_SOCKET_KEY = "gunicorn.socket"
POLL_INTERVAL_S = 0.1  # how often a silent engine (a long prompt) is interrupted to look at the client


class ClientConnection:
    """The client's end of one request: ``gone()`` is true once it closed the connection."""

    def __init__(self, sock: socket.socket | None) -> None:
        self._sock = sock
        self._gone = False

    @classmethod
    def of(cls, env: Mapping[str, Any]) -> ClientConnection:
        sock = env.get(WSGI_SOCKET_KEY)
        return cls(sock if isinstance(sock, socket.socket) else None)

    def gone(self) -> bool:
        if self._gone or self._sock is None:
            return self._gone
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
            if readable:
                # Readable with nothing to read is the end of the stream; bytes (a pipelined request) are not.
                self._gone = self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            pass
        except (OSError, ValueError):  # reset by the peer, or already closed
            self._gone = True
        return self._gone


def watch_client(
    events: Iterator[dict],
    client: ClientConnection,
    cancel: Callable[[], None],
    *,
    ping_s: float = 0.0,
    poll_s: float = POLL_INTERVAL_S,
) -> Iterator[dict]:
    """``events`` of a command requested with ``idle_s=poll_s``, passed on; ``cancel()`` once the client
    is gone (the engine then ends the command at its next step, and its result still comes through).
    The idle events that only served the polling are dropped; one is passed on each ``ping_s`` of engine
    silence (SSE keep-alives; 0: none)."""
    cancelled = False
    last_event = last_poll = time.monotonic()
    for event in events:
        now = time.monotonic()
        if not cancelled and now - last_poll >= poll_s:
            last_poll = now
            if client.gone():
                cancelled = True
                cancel()
        if event is IDLE_EVENT:
            if ping_s and now - last_event >= ping_s:
                last_event = now
                yield event
            continue
        last_event = now
        yield event
