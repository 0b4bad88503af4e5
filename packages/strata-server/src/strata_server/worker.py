"""The gunicorn worker: gthread, except that a request is read by the worker's event loop, not a thread.

gunicorn's gthread worker gives a connection a thread as soon as its first bytes arrive; a client that
sends half a request and stalls then holds that thread, and a few dozen of them starve /health. Here
the event loop (the worker's selector) reads each request's head and body without blocking and hands
the connection to the thread pool only once the request is complete, so a stalled client costs a file
descriptor and a buffer, never a thread. A connection whose request is not complete within the read
timeout (`--timeout`) is closed. The gthread worker's keep-alive handling is kept: a kept-alive
connection that becomes readable goes through the same reading first.
"""

from __future__ import annotations

import re
import selectors
import socket
import time
from functools import partial
from typing import Any

import attrs
from gunicorn.workers.gthread import TConn, ThreadWorker

# A head larger than this goes to the thread at once: gunicorn's parser refuses it with its own error.
MAX_HEAD_BYTES = 64 * 1024
RECV_BYTES = 256 * 1024
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length[ \t]*:[ \t]*([^\r\n]*)", re.IGNORECASE)
_CHUNKED = re.compile(rb"\r\ntransfer-encoding[ \t]*:[^\r\n]*chunked", re.IGNORECASE)
_CHUNKED_END = b"0\r\n\r\n"


@attrs.define
class _Reading:
    """A connection whose request the event loop is still reading."""

    conn: TConn
    deadline: float
    data: bytearray = attrs.Factory(bytearray)


def request_complete(data: bytes | bytearray, body_limit: int) -> bool:
    """Whether `data` holds a whole request (head and body), or enough for the thread to refuse it:
    an oversized head, a body larger than the limit, or a Content-Length that is not a number."""
    head_end = data.find(b"\r\n\r\n")
    if head_end < 0:
        return len(data) > MAX_HEAD_BYTES
    head = bytes(data[: head_end + 2])
    body = len(data) - head_end - 4
    if _CHUNKED.search(head):
        return data.endswith(_CHUNKED_END)
    match = _CONTENT_LENGTH.search(head)
    if match is None:
        return True
    try:
        length = int(match.group(1).strip())
    except ValueError:
        return True
    return length < 0 or length > body_limit or body >= length


class StrataWorker(ThreadWorker):
    """gthread with requests read by the event loop (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reading: dict[int, _Reading] = {}

    def accept(self, listener: socket.socket) -> None:
        try:
            client, address = listener.accept()
        except BlockingIOError:
            return
        except OSError:
            return  # ECONNABORTED and the like: the client is gone already
        self.nr_conns += 1
        self._read_request(TConn(self.cfg, client, address, listener.getsockname()))

    def on_client_socket_readable(self, conn: TConn, client: socket.socket) -> None:
        self.poller.unregister(client)
        self.keepalived_conns.remove(conn)
        self._read_request(conn)

    def _read_request(self, conn: TConn) -> None:
        conn.sock.setblocking(False)
        reading = _Reading(conn, time.monotonic() + self.cfg.timeout)
        self.reading[conn.sock.fileno()] = reading
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_request_bytes, reading))

    def _on_request_bytes(self, reading: _Reading, client: socket.socket) -> None:
        try:
            chunk = client.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:  # the client closed before its request was complete
            self._drop(reading)
            return
        reading.data += chunk
        if request_complete(reading.data, self.app.config.max_body_bytes):
            self.poller.unregister(client)
            del self.reading[client.fileno()]
            reading.conn.early = bytes(reading.data)
            self.enqueue_req(reading.conn)

    def _drop(self, reading: _Reading) -> None:
        sock = reading.conn.sock
        self.reading.pop(sock.fileno(), None)
        try:
            self.poller.unregister(sock)
        except (KeyError, ValueError, OSError):
            pass
        self.nr_conns -= 1
        reading.conn.close()

    def murder_pending(self) -> None:
        super().murder_pending()
        # A stopping worker does not wait for requests that have not arrived.
        now = time.monotonic() if self.alive else float("inf")
        for reading in [r for r in self.reading.values() if r.deadline <= now]:
            if self.alive:
                self.log.info(
                    "closing a connection whose request was not complete within %ss", self.cfg.timeout
                )
            self._drop(reading)

    def handle(self, conn: TConn) -> Any:
        early = getattr(conn, "early", None)
        if early is not None:
            # The whole request is in `early`: the parser reads it from there before the socket.
            conn.early = None
            conn.data_ready = True
            conn.sock.setblocking(True)
            conn.init()
            if conn.parser is not None and not conn.is_http2:
                conn.parser.unreader.unread(early)
        return super().handle(conn)
