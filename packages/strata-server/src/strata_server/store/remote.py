"""The object store of a fleet (`--cache-store s3://BUCKET/PREFIX`). Behind the store's folder: every file the
store saves is uploaded, and a prompt that misses locally is looked up among the objects of the whole fleet.
Without a folder (objects.py): the engine saves to and restores from the objects themselves, and this tier
only lists and reads headers.

Keys: PREFIX/<model fp>/<config fp>/<first block hash>/<file name>, the file name being the folder's content
hash, so the prompt's first 256-token block names the one prefix to list (no shared database). A listing is
cached for LISTING_TTL_S; the tokens of an object are read once (its header and metadata, ranged GETs through
S3Source, the MAC checked with the session key) and kept, since a name never changes content. The longest
verified prefix is downloaded into the folder (boto3's managed transfer into a temporary, then a rename) and
restored from there as a local hit.

At start-up the multipart uploads under the prefix older than STALE_UPLOAD_AGE_S are aborted (the parts of a
server killed during a save or an upload; a live one finishes far sooner). Requests that fail for a moment
(a dropped connection, a 5xx, throttling) are retried with back-off by boto3's standard retry mode
(objstore.s3_client).

Uploads run on a thread of their own from a bounded queue (uploads.py: a conversation's pending upload
superseded by its newer turn, a byte limit); an upload that lands deletes the objects of this server's own
earlier uploads it extends (the conversation's older turns), as objects.py's shelf does: the server never
deletes another's objects.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs
import numpy as np
import strata_sessionfile as sf
from strata_sessionfile import errors as E
from strata_sessionfile.seam import S3_SCHEME

from ..tokens import common_prefix
from ..transcript import Notes, read_notes
from .index import BLOCK_TOKENS, chain_hashes
from .metrics import StoreMetrics
from .names import NAME, Fingerprints, conversation_name
from .uploads import Upload, UploadQueue, UploadResult, holds

log = logging.getLogger("strata_server.store")

LISTING_TTL_S = 2.0  # a conversation another server uploaded is found this soon
MAX_CANDIDATES = 64  # objects whose metadata one lookup reads at most (newest first)
STALE_UPLOAD_AGE_S = (
    3600.0  # an unfinished multipart upload this old is a killed server's: aborted at start-up
)
UPLOAD_QUEUE_BYTES = 1 << 30  # bytes of files waiting for their upload at most (--cache-store-queue)
CATALOG_TTL_S = 5.0  # the listing of every object of this engine (the page's list) is this fresh
MAX_SUMMARIES = 4096  # objects whose header the catalog keeps read (a page's worth is read per request)
SUMMARY_THREADS = 8  # a page's objects read at once (each is two small ranged GETs: latency, not bytes)


@attrs.frozen
class RemoteSettings:
    bucket: str
    prefix: str  # without a trailing slash; may be empty
    endpoint_url: str | None = None
    stale_upload_age_s: float = STALE_UPLOAD_AGE_S
    queue_bytes: int = UPLOAD_QUEUE_BYTES

    @classmethod
    def parse(
        cls, url: str, endpoint_url: str | None = None, queue_bytes: int = UPLOAD_QUEUE_BYTES
    ) -> RemoteSettings:
        """``s3://BUCKET`` or ``s3://BUCKET/PREFIX``; ValueError naming the URL otherwise."""
        bucket, _, prefix = (
            url[len(S3_SCHEME) :].partition("/") if url.startswith(S3_SCHEME) else ("", "", "")
        )
        if not bucket:
            raise ValueError(f"not an s3://BUCKET/PREFIX URL: {url!r}")
        return cls(bucket, prefix.strip("/"), endpoint_url or None, queue_bytes=queue_bytes)


# Refusals that say nothing about an object's bytes (replaced, deleted, the store unreachable): read again later.
TRANSIENT_ERRORS = (E.ObjectReplaced, E.StoreUnavailable, E.ReadFailed, E.NotFound, E.FileChanged)

MISSING_CODES = frozenset({"404", "NoSuchKey", "NotFound"})  # S3's answers for an object that is not there


def missing(exc: BaseException) -> bool:
    """Whether `exc` is the object store saying the object is not there (deleted since it was listed)."""
    response = getattr(exc, "response", None)
    return isinstance(response, dict) and str(response.get("Error", {}).get("Code")) in MISSING_CODES


@attrs.frozen
class Candidate:
    key: str
    name: str  # the file name in the folder
    tokens: np.ndarray
    n_match: int  # prompt tokens it holds
    nbytes: int  # the object's size


@attrs.frozen
class Listed:
    """An object of this engine's, as a listing gives it (no read of its bytes)."""

    key: str
    name: str  # the file name in the folder
    nbytes: int
    modified: float  # seconds since the epoch: its upload (the fleet's last save of it)
    etag: str  # its version: a rename writes the same key again


@attrs.frozen
class Summary:
    """What the page lists of an object: read from its header and metadata (one ranged GET under
    HEAD_BYTES; the MAC checked with the session key), kept per version."""

    tokens: np.ndarray
    notes: Notes | None


@attrs.frozen
class Search:
    """What a lookup in the object store found for a prompt."""

    candidate: Candidate | None  # the best object, if any holds enough of the prompt
    refused: int  # objects under the prompt's first block refused for their bytes (a MAC, a bad header)


class RemoteTier:
    def __init__(
        self,
        settings: RemoteSettings,
        key: sf.SessionKey | None,
        require_mac: bool,
        metrics: StoreMetrics | None = None,
    ) -> None:
        from strata_sessionfile.objstore import s3_client

        self.settings = settings
        self.metrics = metrics or StoreMetrics()
        self.key, self.require_mac = key, require_mac
        self.client = s3_client(settings.endpoint_url)
        self._lock = threading.Lock()
        self._listings: dict[str, tuple[float, list[str]]] = {}  # prefix -> (time listed, keys newest first)
        self._tokens: dict[str, np.ndarray | None] = {}  # key -> its tokens (None: not ours or bad)
        self._refused: set[str] = set()  # keys of objects refused for their bytes (a lookup's `refused`)
        self._sizes: dict[str, int] = {}  # key -> the object's size, as listed
        self._queued = threading.Condition()  # guards _queue, _uploading, _closed
        self._queue = UploadQueue(settings.queue_bytes)
        self._uploading = 0  # uploads taken from the queue, not finished
        self._closed = False
        self._uploaded: dict[
            str, np.ndarray
        ] = {}  # key -> tokens of this server's objects (deleted when extended)
        self._catalog: tuple[float, list[Listed]] | None = None  # (time listed, newest first)
        self._summaries: dict[tuple[str, str], Summary | None] = {}  # (key, etag) -> None: refused
        self.metrics.upload_queue(0, settings.queue_bytes)
        self._uploader = threading.Thread(target=self._upload_loop, name="session-store-upload", daemon=True)
        self._uploader.start()
        threading.Thread(
            target=self._abort_stale_uploads, name="session-store-stale-uploads", daemon=True
        ).start()

    def _abort_stale_uploads(self) -> None:
        from strata_sessionfile.objstore import abort_stale_uploads

        prefix = f"{self.settings.prefix}/" if self.settings.prefix else ""
        try:
            aborted = abort_stale_uploads(
                self.client, self.settings.bucket, prefix, older_than_s=self.settings.stale_upload_age_s
            )
        except Exception as exc:  # noqa: BLE001 -- the store unreachable now: its parts wait for the next start
            log.warning("session store: listing unfinished uploads failed: %s", exc)
            return
        if aborted:
            log.info(
                "session store: aborted %d unfinished uploads older than %.0f s under %s",
                aborted,
                self.settings.stale_upload_age_s,
                prefix or "the bucket",
            )

    # --- keys ---------------------------------------------------------------------------------

    def block_prefix(self, fingerprints: Fingerprints, tokens: np.ndarray) -> str | None:
        hashes = chain_hashes(tokens[:BLOCK_TOKENS])
        if not hashes:
            return None
        parts = [self.settings.prefix] if self.settings.prefix else []
        return "/".join([*parts, fingerprints.model, fingerprints.config, f"{hashes[0]:016x}"]) + "/"

    # --- uploads (a thread of their own: a save never waits on the network) -------------------

    def upload(self, path: Path, fingerprints: Fingerprints, tokens: np.ndarray) -> None:
        prefix = self.block_prefix(fingerprints, tokens)
        if prefix is None:
            return
        try:
            nbytes = path.stat().st_size
        except FileNotFoundError:
            self.metrics.uploaded(UploadResult.GONE)
            return
        with self._queued:
            offered = self._queue.offer(Upload(path, prefix + path.name, tokens, nbytes))
            self.metrics.upload_queue(self._queue.bytes, self._queue.max_bytes)
            self._queued.notify_all()
        for _ in offered.superseded:
            self.metrics.uploaded(UploadResult.SUPERSEDED)
        for dropped in offered.dropped:
            self.metrics.uploaded(UploadResult.DROPPED)
            log.warning(
                "session store: upload of %s (%.1f MiB) dropped: the upload queue's %.0f MiB are full",
                dropped.key,
                dropped.nbytes / (1 << 20),
                self._queue.max_bytes / (1 << 20),
            )

    def _next_upload(self) -> Upload | None:
        """The next upload (waiting for one); None once closed."""
        with self._queued:
            while (upload := self._queue.take()) is None and not self._closed:
                self._queued.wait()
            if upload is not None:
                self._uploading += 1
                self.metrics.upload_queue(self._queue.bytes, self._queue.max_bytes)
            return upload

    def _upload_loop(self) -> None:
        while (upload := self._next_upload()) is not None:
            try:
                self._upload(upload)
            finally:
                with self._queued:
                    self._uploading -= 1
                    self._queued.notify_all()

    def _upload(self, upload: Upload) -> None:
        t0 = time.perf_counter()
        try:
            # boto3's managed transfer: multipart for large files, the object appears only when complete.
            self.client.upload_file(str(upload.path), self.settings.bucket, upload.key)
        except FileNotFoundError:
            self.metrics.uploaded(UploadResult.GONE)  # evicted or replaced before its upload
            return
        except Exception as exc:  # noqa: BLE001 -- the store's server keeps serving; the file stays local
            self.metrics.uploaded(UploadResult.FAILED)
            log.warning("session store: uploading %s failed: %s", upload.key, exc)
            return
        seconds = time.perf_counter() - t0
        self.metrics.uploaded(UploadResult.UPLOADED, upload.nbytes, seconds)
        log.info(
            "session store: uploaded %s (%.1f MiB) in %.0f ms",
            upload.key,
            upload.nbytes / (1 << 20),
            seconds * 1000,
        )
        self._delete_extended(upload)

    def _delete_extended(self, upload: Upload) -> None:
        """The objects of this server's earlier uploads that `upload` extends (older turns): deleted."""
        folder = upload.key.rpartition("/")[0]
        with self._lock:
            older = [
                k
                for k, t in self._uploaded.items()
                if k != upload.key and k.rpartition("/")[0] == folder and holds(upload.tokens, t)
            ]
            self._uploaded[upload.key] = upload.tokens
            for key in older:
                del self._uploaded[key]
        for key in older:
            try:
                self.client.delete_object(Bucket=self.settings.bucket, Key=key)
            except Exception as exc:  # noqa: BLE001 -- the object stays; a lifecycle rule removes it
                log.warning("session store: deleting %s failed: %s", key, exc)
            self.forget(key)

    def drain(self, budget_s: float) -> bool:
        """Wait (at most budget_s) for the queued uploads; whether all finished."""
        deadline = time.monotonic() + budget_s
        with self._queued:
            while len(self._queue) or self._uploading:
                if not self._queued.wait(max(0.0, deadline - time.monotonic())):
                    break
            return not (len(self._queue) or self._uploading)

    def unfinished(self) -> int:
        with self._queued:
            return len(self._queue) + self._uploading

    def close(self, budget_s: float) -> None:
        if not self.drain(budget_s):
            log.warning("session store: %d uploads unfinished at shutdown", self.unfinished())
        with self._queued:
            self._closed = True
            self._queued.notify_all()

    # --- lookups ------------------------------------------------------------------------------

    def _list(self, prefix: str) -> list[str]:
        now = time.monotonic()
        with self._lock:
            cached = self._listings.get(prefix)
        if cached is not None and now - cached[0] < LISTING_TTL_S:
            return cached[1]
        objects = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.settings.bucket, Prefix=prefix
        ):
            objects += [o for o in page.get("Contents", []) if NAME.match(o["Key"].rpartition("/")[2])]
        keys = [o["Key"] for o in sorted(objects, key=lambda o: o["LastModified"], reverse=True)]
        with self._lock:
            self._listings[prefix] = (now, keys)
            self._sizes.update((o["Key"], int(o["Size"])) for o in objects)
        return keys

    def _object_tokens(self, key: str, fingerprints: Fingerprints) -> np.ndarray | None:
        with self._lock:
            if key in self._tokens:
                return self._tokens[key]
        from strata_sessionfile.objstore import S3Source

        tokens = None
        try:
            with S3Source(self.client, self.settings.bucket, key) as source:
                inspection = sf.inspect(
                    source, verify=False, read_threads=1, key=self.key, require_mac=self.require_mac
                )
            if fingerprints.match(inspection.header):
                tokens = np.frombuffer(inspection.metadata.state.tokens, dtype="<i4").copy()
        except sf.SessionFileError as exc:
            log.warning("session store: object %s refused (%s); not used", key, exc.reason)
            self.metrics.bad_file(str(exc.reason))
            with self._lock:
                self._refused.add(key)
        with self._lock:
            self._tokens[key] = tokens
        return tokens

    def best(self, prompt: np.ndarray, fingerprints: Fingerprints, at_least: int) -> Search:
        """The object sharing the longest prefix with `prompt`, if it holds at least `at_least` of its tokens;
        and how many objects that could have matched were refused."""
        prefix = self.block_prefix(fingerprints, prompt)
        if prefix is None:
            return Search(None, 0)
        best: Candidate | None = None
        refused = 0
        for key in self._list(prefix)[:MAX_CANDIDATES]:
            tokens = self._object_tokens(key, fingerprints)
            with self._lock:
                refused += key in self._refused
            name = key.rpartition("/")[2]
            if tokens is None or name != conversation_name(fingerprints, tokens):
                continue  # not ours, refused, or named for other tokens: never downloaded
            n = common_prefix(prompt, tokens)
            if n >= max(at_least, BLOCK_TOKENS) and (
                best is None or (n, -len(tokens)) > (best.n_match, -len(best.tokens))
            ):
                with self._lock:
                    nbytes = self._sizes.get(key, 0)
                best = Candidate(key, name, tokens, n, nbytes)
        return Search(best, refused)

    def forget(self, key: str) -> None:
        """What was read of an object (replaced, deleted, or unreadable for a moment): read again when listed."""
        with self._lock:
            self._tokens.pop(key, None)
            self._refused.discard(key)
            self._listings.clear()
            self._catalog = None

    # --- the catalog (every object of this engine, for the page) ------------------------------

    def engine_prefix(self, fingerprints: Fingerprints) -> str:
        parts = [self.settings.prefix] if self.settings.prefix else []
        return "/".join([*parts, fingerprints.model, fingerprints.config]) + "/"

    def listed(self, fingerprints: Fingerprints) -> list[Listed]:
        """Every object of this engine's model and config under the prefix, newest first: one listing
        (paginated by S3, 1,000 keys a request) per CATALOG_TTL_S, whatever the number of requests; a listing
        that fails keeps the last one (or none) for that long."""
        now = time.monotonic()
        with self._lock:
            cached = self._catalog
        if cached is not None and now - cached[0] < CATALOG_TTL_S:
            return cached[1]
        found = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.settings.bucket, Prefix=self.engine_prefix(fingerprints)
            ):
                for o in page.get("Contents", []):
                    name = o["Key"].rpartition("/")[2]
                    if NAME.match(name):
                        modified = o["LastModified"].timestamp()
                        found.append(Listed(o["Key"], name, int(o["Size"]), modified, str(o["ETag"])))
        except Exception as exc:  # noqa: BLE001 -- the store unreachable: the last listing stands for the TTL
            log.warning("session store: listing the object store for the page failed: %s", exc)
            found = cached[1] if cached is not None else []
        found.sort(key=lambda o: -o.modified)
        with self._lock:
            self._catalog = (now, found)
        return found

    def summary(self, listed: Listed, fingerprints: Fingerprints) -> Summary | None:
        """An object's tokens and notes (its header and metadata, the MAC checked); None when it is refused,
        named for other tokens, or gone. Kept per version: a renamed object is read again."""
        version = (listed.key, listed.etag)
        with self._lock:
            if version in self._summaries:
                return self._summaries[version]
        from strata_sessionfile.objstore import S3Source

        summary = None
        try:
            with S3Source(self.client, self.settings.bucket, listed.key) as source:
                inspection = sf.inspect(
                    source, verify=False, read_threads=1, key=self.key, require_mac=self.require_mac
                )
            tokens = np.frombuffer(inspection.metadata.state.tokens, dtype="<i4").copy()
            if fingerprints.match(inspection.header) and listed.name == conversation_name(
                fingerprints, tokens
            ):
                summary = Summary(tokens, read_notes(inspection.metadata.state.engine_fields))
        except sf.SessionFileError as exc:
            if isinstance(exc, TRANSIENT_ERRORS):
                return None  # deleted or replaced since listed: not remembered
            log.warning("session store: object %s refused (%s); not listed", listed.key, exc.reason)
        with self._lock:
            if len(self._summaries) >= MAX_SUMMARIES:
                self._summaries.clear()
            self._summaries[version] = summary
        return summary

    def summaries(self, objects: list[Listed], fingerprints: Fingerprints) -> list[Summary | None]:
        """`summary` of each, SUMMARY_THREADS at once (bench/server/DECISIONS.md, "The fleet's objects")."""
        if len(objects) <= 1:
            return [self.summary(o, fingerprints) for o in objects]
        with ThreadPoolExecutor(
            min(SUMMARY_THREADS, len(objects)), thread_name_prefix="catalog-read"
        ) as pool:
            return list(pool.map(lambda o: self.summary(o, fingerprints), objects))

    def find(self, name: str, fingerprints: Fingerprints) -> Listed | None:
        """The listed object named `name`, if the (cached) listing holds it."""
        return next((o for o in self.listed(fingerprints) if o.name == name), None)

    def mark_bad(self, key: str) -> None:
        """An object refused for its bytes: never a candidate again."""
        with self._lock:
            self._tokens[key] = None

    def download(self, candidate: Candidate, folder: Path) -> Path:
        """The object into the folder under its name (a temporary renamed into place)."""
        target = folder / candidate.name
        temporary = folder / f".{candidate.name}.{os.getpid()}.download"
        try:
            self.client.download_file(self.settings.bucket, candidate.key, str(temporary))
            os.replace(temporary, target)
        finally:
            temporary.unlink(missing_ok=True)
        return target
