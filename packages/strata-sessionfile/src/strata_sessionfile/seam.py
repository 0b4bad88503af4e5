"""The byte seam's two interfaces: where a session file's bytes come from (``ByteSource``) and go to
(``ByteSink``), whatever holds them.

``save``, ``restore`` and ``inspect`` take a local path (opened here as ``_fileio.FileSource`` /
``FileSink``) or an object with these methods: ``objstore.S3Source`` / ``S3Sink`` for an S3-compatible
object store. Nothing else in the library reads or writes a session file's bytes. A source or sink the
caller passes stays the caller's: a call opens and closes only what it made from a path.
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from typing import Protocol, runtime_checkable

from . import errors as E
from ._fileio import FileSink, FileSource


class Stamp(Hashable, Protocol):
    """What identifies one version of a source's bytes (a file's fstat, an object's ETag); compared
    between and after the passes. ``size``: the bytes it holds."""

    @property  # read-only: a stamp is a frozen record
    def size(self) -> int: ...


@runtime_checkable
class ByteSource(Protocol):
    """A session file to read. ``path`` names it in errors (a file path, an ``s3://`` URL).

    ``stamp()`` identifies the version read now; a source that pins a version (an object's ETag) raises
    ``FileChanged`` (``ObjectReplaced``) once that version is gone. ``read_into`` fills ``buf`` with the
    bytes at ``offset`` exactly (a short source raises ``short_error``; an I/O failure ``ReadFailed``); it
    is called by several reader threads at once, on disjoint ranges. Optional: ``read_threads``, the reader
    threads a restore of it uses at least when the caller names none (a remote source's reads wait on the
    network, not on a core)."""

    path: str

    def stamp(self) -> Stamp: ...

    def read_into(
        self, buf: memoryview, offset: int, *, short_error: type[E.SessionFileError] = E.Truncated
    ) -> None: ...

    def read(self, n: int, offset: int, *, short_error: type[E.SessionFileError] = E.Truncated) -> bytes: ...

    def close(self) -> None: ...


@runtime_checkable
class ByteSink(Protocol):
    """Where a save writes, as the writer's stages call it (spec section 7). ``path`` names the target.

    ``create`` (CREATE: nothing is visible at the target), ``reserve(n)`` (a hint of the final size),
    ``write`` in order (``position``: bytes written so far), ``write_at`` (patch bytes already written:
    the header of a compressed save), ``start_writeback`` (a hint), ``flush`` (FLUSH: every byte durable,
    still invisible), ``publish`` (RENAME: the new bytes replace the target at once), ``sync_folder``
    (SYNC_FOLDER: the replacement durable). ``discard`` at any point before ``publish`` completed leaves the
    target as it was and nothing else behind. Failures raise OSError or a ``SessionFileError``."""

    path: str
    position: int

    def create(self) -> None: ...

    def reserve(self, n: int) -> None: ...

    def write(self, data) -> None: ...

    def write_at(self, data: bytes, offset: int) -> None: ...

    def start_writeback(self, offset: int, length: int) -> None: ...

    def flush(self) -> None: ...

    def publish(self) -> None: ...

    def sync_folder(self) -> None: ...

    def discard(self) -> None: ...


S3_SCHEME = "s3://"


def s3_location(url: str) -> tuple[str, str]:
    """``s3://BUCKET/KEY`` -> (bucket, key); ValueError for a malformed URL (boto3 not needed)."""
    bucket, _, key = url[len(S3_SCHEME) :].partition("/") if url.startswith(S3_SCHEME) else ("", "", "")
    if not bucket or not key:
        raise ValueError(f"not an s3://BUCKET/KEY URL: {url!r}")
    return bucket, key


def open_source(target: str | os.PathLike | ByteSource) -> tuple[ByteSource, bool]:
    """The source to read ``target`` from, and whether this call made it (and closes it)."""
    if isinstance(target, ByteSource):
        return target, False
    return FileSource(os.fspath(target)), True


def as_sink(target: str | os.PathLike | ByteSink) -> ByteSink:
    """The sink a save of ``target`` writes through (a path: a temporary beside it, renamed over it)."""
    if isinstance(target, ByteSink):
        return target
    return FileSink(os.fspath(target))


def target_name(target: str | os.PathLike | ByteSource | ByteSink) -> str:
    """What error messages and reports call ``target``."""
    return target.path if isinstance(target, (ByteSource, ByteSink)) else os.fspath(target)
