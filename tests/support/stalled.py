"""Clients that send half a request and stall (a slowloris), against a running server."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"
# the rest of each stalled request, which completes it: (after half a head, after a head without its body)
REST = {False: b"Agent: t\r\nConnection: close\r\n\r\n", True: b'"x", "n_predict": 1}' + b" " * 79}


def half_requests(port: int, n: int, body: bool) -> list[socket.socket]:
    """n connections that each send part of a request and stall: half a head, or a whole head whose
    announced body (100 bytes) never comes."""
    host = f"Host: {LOOPBACK}:{port}\r\n".encode()
    part = (
        b"POST /completion HTTP/1.1\r\n" + host + b"Content-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"prompt": '
        if body
        else b"GET /health HTTP/1.1\r\n" + host + b"User-"
    )
    socks = []
    for _ in range(n):
        sock = socket.create_connection((LOOPBACK, port), timeout=10)
        sock.sendall(part)
        socks.append(sock)
    return socks
