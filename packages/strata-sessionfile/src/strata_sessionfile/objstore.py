"""The byte seam over an S3-compatible object store (boto3): ``S3Source`` and ``S3Sink``.

``S3Source`` reads an object with ranged GETs. Its version is pinned when it is opened (the ETag, and the
version id on a versioned bucket): every later GET and ``stamp()`` asks for that version only
(``IfMatch``), so an object replaced or deleted between or during the passes is refused as
``ObjectReplaced`` (reason ``object_replaced``) instead of mixing two versions. A read of more than
``range_size`` bytes is split into ranges fetched at once by the source's threads, each read straight
into the caller's buffer in slices of ``READ_SLICE``: a restore holds its block buffers and nothing of
the object's size.

``S3Sink`` writes a multipart upload in parts of ``part_size`` (at most ``concurrency`` parts uploading
at once). The object appears only when ``publish`` completes the upload, the store's atomic rename; any
failure before that (an error, an exception raised inside the save, KeyboardInterrupt) aborts the
upload, so no object and no parts remain. The first part is held until ``flush`` (a compressed save
patches the header at offset 0 last). A process killed during an upload cannot abort it: its parts stay
until ``abort_stale_uploads`` (or the bucket's lifecycle rule for incomplete uploads) removes them;
the object never appears.

Credentials, region and endpoint are resolved the standard AWS way (environment, config files);
``s3_client(endpoint_url)`` makes a client for a non-AWS store. Needs boto3:
``pip install 'strata-sessionfile[s3]'``.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import attrs

try:
    import boto3
    import botocore.config
    import botocore.exceptions
except ImportError as exc:  # the package stands without boto3; only this module needs it
    raise ImportError(
        "strata_sessionfile.objstore needs boto3: pip install 'strata-sessionfile[s3]'"
    ) from exc

from . import errors as E
from .seam import S3_SCHEME, s3_location

READ_SLICE = 1 << 20  # bytes read from a response at once: urllib3 copies through a temporary of this size
DEFAULT_RANGE_SIZE = 8 << 20  # one ranged GET (bench/sessionfile/DECISIONS.md, "Object store")
DEFAULT_READ_CONCURRENCY = 8  # ranged GETs of one source in flight at once
# Reader threads of a restore or inspect of an object when the caller names none: its reads wait on the
# network, not on a core (bench/sessionfile/DECISIONS.md, "Object store"); N + 1 block buffers of RAM.
OBJECT_READ_THREADS = 2
# The object's first bytes, fetched by the request that pins its version: the header, the metadata of most
# sessions and its padding then cost no request of their own (each is a round trip to the store).
HEAD_BYTES = 256 << 10
DEFAULT_PART_SIZE = 8 << 20  # S3: at least 5 MiB, except the last part
DEFAULT_UPLOAD_CONCURRENCY = 4  # parts uploading at once (each held in memory until it is stored)
MIN_PART_SIZE = 5 << 20
MAX_PARTS = 10000  # S3's limit on one multipart upload
PART_GROWTH_EVERY = 1000  # the part size doubles every this many parts, so 10,000 parts hold terabytes


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://BUCKET/KEY`` -> (bucket, key); ValueError for anything else."""
    return s3_location(url)


def s3_client(endpoint_url: str | None = None, *, max_pool_connections: int = 32, **client_args):
    """A boto3 S3 client: credentials and region the standard AWS way; ``endpoint_url`` for a non-AWS
    store. Enough pooled connections for a source's and a sink's threads; bounded retries and timeouts, so a
    store that went away is reported in seconds."""
    config = botocore.config.Config(
        max_pool_connections=max_pool_connections,
        connect_timeout=10,
        read_timeout=60,
        retries={"mode": "standard", "max_attempts": 3},
    )
    # A session of its own: credentials are resolved now, not cached from boto3's default session's first use.
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config, **client_args)


def _status(exc: botocore.exceptions.ClientError) -> tuple[int, str]:
    return (
        exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0),
        str(exc.response.get("Error", {}).get("Code", "")),
    )


def read_error(
    exc: Exception,
    what: str,
    path: str,
    *,
    pinned: bool,
    offset: int | None = None,
    short_error: type[E.SessionFileError] = E.Truncated,
) -> E.SessionFileError:
    """The SessionFileError for a failed request of a source: a version gone once pinned is ObjectReplaced."""
    if isinstance(exc, botocore.exceptions.ClientError):
        status, code = _status(exc)
        if status == 412 or (pinned and status == 404):
            return E.ObjectReplaced(
                f"{what}: the object was replaced or deleted since it was opened ({code})",
                path=path,
                offset=offset,
            )
        if status == 404:
            return E.NotFound(f"no such object ({code})", path=path)
        if status == 403:
            return E.PermissionDenied(f"{what}: access denied ({code})", path=path)
        if status == 416:
            return short_error(f"{what}: the range lies past the object's end", path=path, offset=offset)
        if status >= 500:
            return E.StoreUnavailable(
                f"{what}: the store answered {status} ({code})", path=path, offset=offset
            )
        return E.ReadFailed(f"{what}: the store answered {status} ({code})", path=path, offset=offset)
    if isinstance(exc, botocore.exceptions.NoCredentialsError):
        return E.PermissionDenied(f"{what}: no AWS credentials found", path=path)
    return E.StoreUnavailable(f"{what} failed: {exc}", path=path, offset=offset)


_REQUEST_ERRORS = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, OSError)


@attrs.frozen
class ObjectStamp:
    """An object's pinned version (a ``seam.Stamp``)."""

    size: int
    etag: str
    version_id: str | None = None


class S3Source:
    """An object to read (a ``seam.ByteSource``), its version pinned now: a missing object raises NotFound
    here. ``version_id``: read that version of a versioned bucket (default: the current one, pinned)."""

    def __init__(
        self,
        client,
        bucket: str,
        key: str,
        *,
        version_id: str | None = None,
        range_size: int = DEFAULT_RANGE_SIZE,
        concurrency: int = DEFAULT_READ_CONCURRENCY,
    ) -> None:
        self.client, self.bucket, self.key = client, bucket, key
        self.path = f"{S3_SCHEME}{bucket}/{key}"
        self.range_size, self.concurrency = range_size, concurrency
        self._version = {"VersionId": version_id} if version_id else {}
        reply, self._first = self._open()
        version_id = version_id or reply.get("VersionId")
        if version_id:
            self._version = {"VersionId": version_id}
        size = int(reply["ContentRange"].rpartition("/")[2]) if "ContentRange" in reply else len(self._first)
        self._stamp = ObjectStamp(size, reply["ETag"], version_id)
        self._pin = {"IfMatch": reply["ETag"], **self._version}
        self._fresh = True  # the version was seen just now: the first stamp() needs no request
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.read_threads = OBJECT_READ_THREADS

    @classmethod
    def from_url(cls, client, url: str, **kw) -> S3Source:
        return cls(client, *parse_s3_url(url), **kw)

    def _open(self) -> tuple[dict, bytes]:
        """One GET of the first HEAD_BYTES: the version (ETag, version id), the size and those bytes."""
        try:
            try:
                reply = self.client.get_object(
                    Bucket=self.bucket, Key=self.key, Range=f"bytes=0-{HEAD_BYTES - 1}", **self._version
                )
            except botocore.exceptions.ClientError as exc:
                if _status(exc)[0] != 416:
                    raise
                return self.client.head_object(
                    Bucket=self.bucket, Key=self.key, **self._version
                ), b""  # empty
            with reply["Body"] as body:
                return reply, body.read()
        except _REQUEST_ERRORS as exc:
            raise read_error(exc, "opening the object", self.path, pinned=False) from None

    def stamp(self) -> ObjectStamp:
        """The pinned version, after asking the store that it still holds it (ObjectReplaced if not)."""
        if self._fresh:
            self._fresh = False
            return self._stamp
        try:
            self.client.head_object(Bucket=self.bucket, Key=self.key, **self._pin)
        except _REQUEST_ERRORS as exc:
            raise read_error(exc, "checking the object's version", self.path, pinned=True) from None
        return self._stamp

    def _get(self, buf: memoryview, offset: int, short_error) -> None:
        n = len(buf)
        what = f"reading {n} bytes"
        try:
            body = self.client.get_object(
                Bucket=self.bucket, Key=self.key, Range=f"bytes={offset}-{offset + n - 1}", **self._pin
            )["Body"]
            try:
                done = 0
                while done < n:
                    got = body.readinto(buf[done : done + READ_SLICE])
                    if not got:
                        break
                    done += got
            finally:
                body.close()
        except _REQUEST_ERRORS as exc:
            raise read_error(
                exc, what, self.path, pinned=True, offset=offset, short_error=short_error
            ) from None
        if done < n:
            raise short_error(
                f"the object ends at offset {offset + done}, {n - done} bytes short",
                path=self.path,
                offset=offset + done,
            )

    def _threads(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="strata-s3-read")
            return self._pool

    def read_into(self, buf: memoryview, offset: int, *, short_error=E.Truncated) -> None:
        """Fill ``buf`` from ``offset`` of the pinned version: ranges of ``range_size`` fetched at once."""
        n = len(buf)
        if offset + n > self._stamp.size:
            raise short_error(
                f"the object is {self._stamp.size} bytes; {n} bytes at offset {offset} run past its end",
                path=self.path,
                offset=self._stamp.size,
            )
        if offset + n <= len(self._first):  # fetched with the version
            buf[:] = self._first[offset : offset + n]
            return
        if n <= self.range_size:
            if n:
                self._get(buf, offset, short_error)
            return
        pool = self._threads()
        jobs = [
            pool.submit(self._get, buf[lo : lo + self.range_size], offset + lo, short_error)
            for lo in range(0, n, self.range_size)
        ]
        try:
            for job in jobs:
                job.result()
        finally:  # nothing writes into buf once this returns
            for job in jobs:
                job.cancel()
            concurrent.futures.wait(jobs)

    def read(self, n: int, offset: int, *, short_error=E.Truncated) -> bytes:
        buf = bytearray(n)
        self.read_into(memoryview(buf), offset, short_error=short_error)
        return bytes(buf)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> S3Source:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class S3Sink:
    """Where a save writes an object (a ``seam.ByteSink``): a multipart upload, completed by ``publish``.

    Raises ``WriteFailed`` (the store's error in the message); the writer then calls ``discard``, which
    aborts the upload."""

    def __init__(
        self,
        client,
        bucket: str,
        key: str,
        *,
        part_size: int = DEFAULT_PART_SIZE,
        concurrency: int = DEFAULT_UPLOAD_CONCURRENCY,
    ) -> None:
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size must be at least {MIN_PART_SIZE} (S3's minimum part)")
        self.client, self.bucket, self.key = client, bucket, key
        self.path = f"{S3_SCHEME}{bucket}/{key}"
        self.part_size, self.concurrency = part_size, concurrency
        self.position = 0
        self.upload_id: str | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._slots = threading.BoundedSemaphore(concurrency)
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._first: bytearray | None = None  # part 1, held until flush
        self._buf = bytearray()  # the part being filled (allocated by create), ``_fill`` bytes of it so far
        self._fill = 0
        self._number = 1

    @classmethod
    def from_url(cls, client, url: str, **kw) -> S3Sink:
        return cls(client, *parse_s3_url(url), **kw)

    def _fail(self, exc: Exception, what: str) -> E.WriteFailed:
        detail = (
            f"the store answered {_status(exc)[0]} ({_status(exc)[1]})"
            if isinstance(exc, botocore.exceptions.ClientError)
            else str(exc)
        )
        return E.WriteFailed(f"{what} failed: {detail}", path=self.path)

    def _part_capacity(self, number: int) -> int:
        return self.part_size << ((number - 1) // PART_GROWTH_EVERY)

    def create(self) -> None:
        try:
            self.upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=self.key)["UploadId"]
        except _REQUEST_ERRORS as exc:
            raise self._fail(exc, "starting the multipart upload") from None
        self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="strata-s3-upload")
        self._buf = bytearray(self._part_capacity(1))

    def reserve(self, n: int) -> None:
        """The final size is known: parts large enough that the object fits S3's part count (before the first
        byte is written)."""
        size = max(self.part_size, -(-n // (MAX_PARTS // 2)))
        if size != self.part_size and self.position == 0:
            self.part_size = size
            self._buf = bytearray(self._part_capacity(1))

    def _upload(self, number: int, data: bytearray) -> dict:
        try:
            reply = self.client.upload_part(
                Bucket=self.bucket, Key=self.key, UploadId=self.upload_id, PartNumber=number, Body=data
            )
        except _REQUEST_ERRORS as exc:
            raise self._fail(exc, f"uploading part {number}") from None
        finally:
            self._slots.release()
        return {"PartNumber": number, "ETag": reply["ETag"]}

    def _raise_failed(self) -> None:
        for future in self._futures.values():
            failure = future.exception() if future.done() else None
            if failure is not None:
                raise failure

    def _submit(self, number: int, data: bytearray) -> None:
        if number > MAX_PARTS:
            raise E.WriteFailed(f"the object needs more than {MAX_PARTS} parts", path=self.path)
        assert self._pool is not None, "parts are uploaded between create and publish or discard"
        self._slots.acquire()  # at most `concurrency` parts in memory and in flight
        try:
            self._raise_failed()
            self._futures[number] = self._pool.submit(self._upload, number, data)
        except BaseException:
            self._slots.release()
            raise

    def _part_done(self) -> None:
        """The part being filled is complete: part 1 is kept (``write_at``), any other uploaded."""
        buf = self._buf
        del buf[self._fill :]  # a short last part: truncated in place, not copied
        if self._number == 1:
            self._first = buf
        else:
            self._submit(self._number, buf)
        self._number += 1
        self._buf, self._fill = bytearray(self._part_capacity(self._number)), 0

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        self.position += len(view)
        while view:
            buf = self._buf
            take = min(len(view), len(buf) - self._fill)
            buf[self._fill : self._fill + take] = view[:take]
            self._fill += take
            view = view[take:]
            if self._fill == len(buf):
                self._part_done()

    def write_at(self, data: bytes, offset: int) -> None:
        held = self._first if self._first is not None else self._buf if self._number == 1 else None
        if held is None or offset + len(data) > (len(held) if held is self._first else self._fill):
            raise ValueError("an object sink patches only bytes of its first part")
        held[offset : offset + len(data)] = data

    def start_writeback(self, offset: int, length: int) -> None:
        pass  # parts are sent as they fill

    def flush(self) -> None:
        """Every part stored (still invisible): the last one, then part 1."""
        if self._number == 1 or self._fill:
            self._part_done()
        assert self._first is not None, "part 1 is held from its _part_done until the one flush"
        self._submit(1, self._first)
        self._buf, self._first = bytearray(), None
        self.parts = [future.result() for _number, future in sorted(self._futures.items())]

    def publish(self) -> None:
        """The object appears, whole (CompleteMultipartUpload)."""
        try:
            self.client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self.upload_id,
                MultipartUpload={"Parts": self.parts},
            )
        except _REQUEST_ERRORS as exc:
            raise self._fail(exc, "completing the multipart upload") from None
        self.upload_id = None
        self._stop()

    def sync_folder(self) -> None:
        pass  # a completed upload is durable in the store

    def _stop(self) -> None:
        if self._pool is not None:
            for future in self._futures.values():
                future.cancel()
            self._pool.shutdown(wait=True)  # no part is uploading once this returns
            self._pool = None

    def discard(self) -> None:
        """Abort the upload (after the parts in flight finished): no object, no parts."""
        self._stop()
        self._buf, self._first = bytearray(), None
        if self.upload_id is not None:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=self.key, UploadId=self.upload_id)
            except _REQUEST_ERRORS:  # the failure being reported matters more; abort_stale_uploads cleans up
                pass
            self.upload_id = None


def abort_stale_uploads(client, bucket: str, prefix: str = "", *, older_than_s: float = 24 * 3600) -> int:
    """Abort the multipart uploads under ``prefix`` started more than ``older_than_s`` ago (left by processes
    killed during a save); returns how many. A bucket lifecycle rule (AbortIncompleteMultipartUpload) does the
    same on AWS."""
    cutoff = time.time() - older_than_s
    aborted = 0
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix):
        for upload in page.get("Uploads", []):
            if upload["Initiated"].timestamp() <= cutoff:
                client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                aborted += 1
    return aborted
