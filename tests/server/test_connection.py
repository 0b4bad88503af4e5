"""ClientConnection: a closed client reads as gone, a pipelined request does not; no socket: never gone."""

from __future__ import annotations

import socket

from strata_server.connection import ClientConnection


def test_closed_peer_is_gone_pipelined_bytes_are_not():
    ours, theirs = socket.socketpair()
    try:
        client = ClientConnection(ours)
        assert not client.gone()
        theirs.sendall(b"GET /health HTTP/1.1\r\n")  # the next request of a keep-alive client
        assert not client.gone()
        assert ours.recv(100).startswith(b"GET")  # peeking left the bytes in place
        theirs.close()
        assert client.gone() and client.gone()
    finally:
        ours.close()


def test_without_a_socket_the_client_is_there():
    assert not ClientConnection.of({}).gone()
    assert not ClientConnection.of({"gunicorn.socket": "not a socket"}).gone()
