"""The store's conversations as a person sees them (the web page and `/conversations`): listing, renaming,
deleting, the file of one, and an uploaded session file adopted into the store. With an object store, every
object of this engine there is one too (the fleet's, fetched by this server or not): listed from the tier's
cached listing, read from its header only for the page shown; on the object store alone each action works on
the object itself.

A conversation's id is its file name without the suffix: a content hash of the engine's fingerprints and
its tokens (names.py), so it is the same after a restart and on every server of a fleet sharing one object
store. A conversation that a turn extends is saved under a new id (the older file is dropped as its prefix).
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

import attrs
import numpy as np
import strata_sessionfile as sf
from strata_sessionfile import ConfigIdentity, llamacpp

from ..errors import ServerError
from ..tokens import common_prefix
from ..transcript import Notes
from .folder import StoreFolder
from .index import BLOCK_TOKENS, StoredConversation
from .metrics import SaveTrigger
from .names import SUFFIX, Fingerprints, conversation_name
from .objects import ObjectShelf
from .remote import Listed, RemoteTier, missing
from .retitle import CompressedFile, retitled
from .saving import PendingSave
from .store import SessionStore

log = logging.getLogger("strata_server.store")

ID = re.compile(r"^[0-9a-f]{32}$")
UPLOAD_PREFIX = ".upload-"  # a temporary upload: never a NAME, so no scan reads it
UPLOAD_SLOT = -1  # the slot of a PendingSave that no slot wrote (an upload, a rename; log lines only)
CHUNK = 1 << 20
MAX_SEARCHED_OBJECTS = 1000  # a search reads the headers of the newest objects only (kept once read)
REFERENCE_TRIES = 4  # objects tried for a slot file's config identity


class CatalogError(ServerError):
    """A request on the store's conversations that cannot be served; `reason` names why."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class UnknownConversation(CatalogError):
    pass


class UploadRefused(CatalogError):
    pass


class NotSupported(CatalogError):
    pass


class StoreUnreachable(CatalogError):
    """The object store did not answer (or refused a put): nothing changed."""


@attrs.frozen
class Row:
    """One conversation as a listing finds it, before any read of an object's bytes (paging comes first)."""

    id: str
    used_at: float  # epoch seconds: the file's mtime (the store's LRU clock), else the object's upload
    local: StoredConversation | None  # the index's (the folder's file, or an object this server holds)
    listed: Listed | None  # the object store's object, as listed


@attrs.frozen
class Entry:
    """One stored conversation as the list shows it."""

    id: str
    conversation: StoredConversation
    used_at: float  # as its Row's
    slots: tuple[int, ...]  # the slots holding it (or more of it)
    places: tuple[str, ...]  # "disk" / "ram", "object store"
    local: bool = True  # the index holds it (else only the object store's listing does)
    listed: Listed | None = None

    @property
    def where(self) -> tuple[str, ...]:
        return tuple(f"slot {s}" for s in self.slots) + self.places

    @property
    def version(self) -> str:
        """What names this content and its notes: a local file's are renamed through this server (which
        forgets its text), an object's by any server of the fleet (a new ETag)."""
        return "" if self.local or self.listed is None else self.listed.etag


def conversation_id(name: str) -> str:
    return name.removesuffix(SUFFIX)


def name_of(conversation_id: str) -> str:
    if not ID.match(conversation_id):
        raise UnknownConversation(
            f"'id' must be 32 lowercase hex digits, got {conversation_id[:64]!r}", "invalid_id"
        )
    return conversation_id + SUFFIX


class Catalog:
    """The conversations one `SessionStore` keeps, for people: its index, and with an object store every object
    of this engine there (the fleet's, fetched by this server or not)."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store

    def _fingerprints(self) -> Fingerprints:
        # A request right after start-up waits briefly for the scan, as a completion does.
        if not self.store.wait_ready() or self.store.fingerprints is None:
            raise NotSupported("the session store is still starting (the engine is loading)", "loading")
        return self.store.fingerprints

    def _auth(self) -> tuple[sf.SessionKey | None, bool]:
        """The session key and whether a file must carry its MAC (as every restore reads)."""
        settings = self.store.settings
        return settings.key, settings.require_mac and settings.key is not None

    def _remote(self) -> RemoteTier:
        if self.store.remote is None:
            raise NotSupported("this server has no object store (--cache-store)", "no_object_store")
        return self.store.remote

    def _listed(self, fingerprints: Fingerprints) -> dict[str, Listed]:
        """The object store's objects of this engine by name (the tier's cached listing); {} without one."""
        remote = self.store.remote
        return {o.name: o for o in remote.listed(fingerprints)} if remote is not None else {}

    def rows(self) -> list[Row]:
        """Every conversation the index holds and every object of this engine, most recently used first;
        no object's bytes are read."""
        fingerprints = self._fingerprints()
        listed = self._listed(fingerprints)
        shelf = self.store.shelf
        local = self.store.index.snapshot()
        found = []
        for conversation in local:
            seen = listed.get(conversation.name)
            used_at = shelf.used_at(conversation.name) or (seen.modified if seen is not None else 0.0)
            found.append(Row(conversation_id(conversation.name), used_at, conversation, seen))
        held = {c.name for c in local}
        found += [
            Row(conversation_id(o.name), o.modified, None, o) for o in listed.values() if o.name not in held
        ]
        found.sort(key=lambda r: -r.used_at)
        return found

    def searchable(self, rows: list[Row]) -> tuple[list[Row], bool]:
        """The rows a search reads: every local one and the newest MAX_SEARCHED_OBJECTS objects only (their
        headers read once, then kept); whether some were left out."""
        kept, objects = [], 0
        for row in rows:
            if row.local is None:
                objects += 1
                if objects > MAX_SEARCHED_OBJECTS:
                    continue
            kept.append(row)
        return kept, objects > MAX_SEARCHED_OBJECTS

    def entries(self, rows: list[Row]) -> list[Entry]:
        """The entries of `rows` (a page): an object the index does not hold read for its tokens and notes
        (its header, once per version); one refused or gone since listed is left out."""
        fingerprints = self._fingerprints()
        held = [(slot, record.tokens) for slot, record in enumerate(self.store.ledger.snapshot())]
        shelf = self.store.shelf
        folder_place = (
            ("ram" if self.store.settings.ephemeral else "disk",) if isinstance(shelf, StoreFolder) else ()
        )
        only_listed = [r.listed for r in rows if r.local is None and r.listed is not None]
        remote = self.store.remote
        read = (
            dict(zip(only_listed, remote.summaries(only_listed, fingerprints), strict=True)) if remote else {}
        )
        found = []
        for row in rows:
            conversation = row.local
            if conversation is None:
                listed = row.listed
                summary = read.get(listed) if listed is not None else None
                if listed is None or summary is None:
                    continue
                conversation = StoredConversation(listed.name, listed.nbytes, summary.tokens)
            slots = tuple(
                slot
                for slot, tokens in held
                if tokens is not None and common_prefix(tokens, conversation.tokens) == conversation.n_tokens
            )
            in_bucket = row.listed is not None or (row.local is not None and isinstance(shelf, ObjectShelf))
            places = (folder_place if row.local is not None else ()) + (
                ("object store",) if in_bucket else ()
            )
            found.append(
                Entry(row.id, conversation, row.used_at, slots, places, row.local is not None, row.listed)
            )
        return found

    def get(self, conversation_id: str) -> Entry:
        name = name_of(conversation_id)
        for entry in self.entries([r for r in self.rows() if r.id == conversation_id]):
            if entry.conversation.name == name:
                return entry
        raise UnknownConversation(f"no stored conversation with id {conversation_id!r}", "not_found")

    def notes(self, entry: Entry) -> Notes | None:
        """The notes of a conversation's file or object (a chat's messages, a title), read from its header and
        metadata under the store's key."""
        shelf = self.store.shelf
        if entry.local and isinstance(shelf, StoreFolder):
            return shelf.notes(entry.conversation.name)
        if entry.listed is not None and self.store.remote is not None:
            summary = self.store.remote.summary(entry.listed, self._fingerprints())
            return summary.notes if summary is not None else None
        return shelf.notes(entry.conversation.name)  # an object this server holds, not listed yet

    def _object_key(self, entry: Entry) -> str:
        if entry.listed is not None:
            return entry.listed.key
        shelf = self.store.shelf
        key = shelf.key_of(entry.conversation.name) if isinstance(shelf, ObjectShelf) else None
        if key is None:
            raise UnknownConversation(f"{entry.id!r} was just removed", "not_found")
        return key

    def _on_folder(self, entry: Entry) -> StoreFolder | None:
        """The folder holding the conversation's file, if it is there (else it is an object)."""
        shelf = self.store.shelf
        return shelf if entry.local and isinstance(shelf, StoreFolder) else None

    def retitle(self, conversation_id: str, title: str) -> Entry:
        """The conversation's file (or object) written again with `title` in its notes (same tokens, same
        id): a file committed as a save, an object put again under its key; a later save that extends it
        inherits the title."""
        entry = self.get(conversation_id)
        folder = self._on_folder(entry)
        if folder is None:
            self._retitle_object(entry, title)
            return self.get(conversation_id)
        name = entry.conversation.name
        pending = folder.pending(name)
        try:
            n_written = retitled(folder.file(name), pending, title, folder.key, folder.require_mac)
        except (sf.SessionFileError, CompressedFile, ValueError) as exc:
            pending.unlink(missing_ok=True)
            raise UploadRefused(f"the conversation's file cannot be renamed: {exc}", "not_renamed") from None
        except FileNotFoundError:
            pending.unlink(missing_ok=True)
            raise UnknownConversation(f"{conversation_id!r} was just removed", "not_found") from None
        tokens = entry.conversation.tokens
        self.store.saves.commit(
            PendingSave(UPLOAD_SLOT, SaveTrigger.RENAME, name, tokens, self._fingerprints(), n_written, 0.0)
        )
        return self.get(conversation_id)

    def _retitle_object(self, entry: Entry, title: str) -> None:
        """An object renamed: downloaded, written again with the title (verified in full first), put under
        its key (the title lives in the metadata, under the hashes and MAC: no metadata-only copy)."""
        remote = self._remote()
        key = self._object_key(entry)
        fd, tmp_name = tempfile.mkstemp(prefix=UPLOAD_PREFIX, dir=self._scratch())
        os.close(fd)
        old = Path(tmp_name)
        new = old.with_name(old.name + SUFFIX)
        try:
            try:
                remote.client.download_file(remote.settings.bucket, key, str(old))
                retitled(old, new, title, *self._auth())
            except (sf.SessionFileError, CompressedFile, ValueError) as exc:
                raise UploadRefused(
                    f"the conversation's object cannot be renamed: {exc}", "not_renamed"
                ) from None
            except Exception as exc:  # noqa: BLE001 -- botocore's: deleted since listed, or unreachable
                if missing(exc):
                    raise UnknownConversation(f"{entry.id!r} was just removed", "not_found") from None
                raise StoreUnreachable(f"the object store did not answer: {exc}", "object_store") from None
            self._put(new, key)
        finally:
            old.unlink(missing_ok=True)
            new.unlink(missing_ok=True)
        remote.forget(key)

    def _put(self, path: Path, key: str) -> None:
        remote = self._remote()
        try:
            remote.client.upload_file(str(path), remote.settings.bucket, key)
        except Exception as exc:  # noqa: BLE001 -- botocore's: nothing was stored
            raise StoreUnreachable(f"the object store did not take the file: {exc}", "object_store") from None

    def _scratch(self) -> Path:
        """Where an upload or a renamed object is written before it is kept: the store's folder (the same
        file system as its commits), else the system's temporary folder (a private file)."""
        shelf = self.store.shelf
        return shelf.path if isinstance(shelf, StoreFolder) else Path(tempfile.gettempdir())

    def _reference_config(self, fingerprints: Fingerprints) -> ConfigIdentity | None:
        """The config identity of a conversation this server keeps (a file, else an object of this engine)."""
        shelf = self.store.shelf
        key, require_mac = self._auth()
        if isinstance(shelf, StoreFolder):
            for kept in reversed(self.store.index.snapshot()):
                try:
                    return sf.inspect(
                        shelf.file(kept.name), verify=False, key=key, require_mac=require_mac
                    ).metadata.config
                except (sf.SessionFileError, OSError):
                    continue
        remote = self.store.remote
        if remote is None:
            return None
        from strata_sessionfile.objstore import S3Source

        for listed in list(self._listed(fingerprints).values())[:REFERENCE_TRIES]:
            try:
                with S3Source(remote.client, remote.settings.bucket, listed.key) as source:
                    inspection = sf.inspect(
                        source, verify=False, read_threads=1, key=key, require_mac=require_mac
                    )
            except sf.SessionFileError:
                continue
            if fingerprints.match(inspection.header):
                return inspection.metadata.config
        return None

    def _convert_slot_file(self, slot_file: Path, out: Path, fingerprints: Fingerprints) -> None:
        """A llama.cpp slot file converted against this server's model, carrying the config identity of a
        conversation this engine saved (the slot file has no identity of its own: `strata-sessionfile convert
        --like`) and, under --session-key-file, the server's MAC (the server holds the key, as SAVE does);
        validated afterwards like any upload."""
        model = dict(self.store.engine.status().info or {}).get("model_path")
        config = self._reference_config(fingerprints)
        if not isinstance(model, str) or config is None:
            raise UploadRefused(
                "a llama.cpp slot file is converted with the identity of a conversation this server keeps; "
                "it keeps none yet (restore the slot file through /slots/0?action=restore instead)",
                "no_reference_file",
            )
        try:
            llamacpp.slot_to_session(slot_file, model, out, config=config, key=self._auth()[0])
        except sf.SessionFileError as exc:
            raise UploadRefused(f"the llama.cpp slot file does not convert: {exc}", str(exc.reason)) from None

    def open(self, conversation_id: str) -> tuple[BinaryIO, int]:
        """The committed file of a conversation, or its object streamed from the store (a download), and
        its size."""
        entry = self.get(conversation_id)
        folder = self._on_folder(entry)
        if folder is not None:
            path = folder.file(entry.conversation.name)
            try:
                stream = path.open("rb")
                return stream, os.fstat(stream.fileno()).st_size
            except FileNotFoundError:
                raise UnknownConversation(f"{conversation_id!r} was just removed", "not_found") from None
        remote = self._remote()
        try:
            reply = remote.client.get_object(Bucket=remote.settings.bucket, Key=self._object_key(entry))
        except Exception as exc:  # noqa: BLE001 -- botocore's
            if missing(exc):
                raise UnknownConversation(f"{conversation_id!r} was just removed", "not_found") from None
            raise StoreUnreachable(f"the object store did not answer: {exc}", "object_store") from None
        return reply["Body"], int(reply["ContentLength"])

    def delete(self, conversation_id: str, slot_wait_s: float) -> Entry:
        """The file goes (and its object, with an object store); the index forgets it; a slot holding it is
        erased (else the store would save it again when that slot idles)."""
        entry = self.get(conversation_id)
        name = entry.conversation.name
        for slot in entry.slots:
            with self.store.engine.acquire(slot_wait_s, id_slot=slot) as lease:
                lease.used = False
                held = self.store.ledger.tokens(slot)
                if (
                    held is not None
                    and common_prefix(held, entry.conversation.tokens) == entry.conversation.n_tokens
                ):
                    lease.call("ERASE", {})
                    self.store.ledger.erased(slot)
        if entry.local:
            self.store.remove(name)
        remote = self.store.remote
        prefix = remote.block_prefix(self._fingerprints(), entry.conversation.tokens) if remote else None
        if remote is not None and prefix is not None:
            key = entry.listed.key if entry.listed is not None else prefix + name
            try:
                remote.client.delete_object(Bucket=remote.settings.bucket, Key=key)
            except Exception as exc:  # noqa: BLE001 -- the local file is gone; the bucket's lifecycle rules remain
                log.warning("session store: deleting the object %s failed: %s", key, exc)
            remote.forget(key)
        return entry

    def upload(self, chunks: Iterable[bytes], max_bytes: int) -> tuple[Entry, bool]:
        """A session file (format v1) from a client, validated in full like any restore (hashes, MAC,
        fingerprints of this engine) and kept under its content name: committed into the folder as a save,
        or, on the object store alone, put as an object; (entry, whether it was new). A refused file leaves
        nothing behind."""
        fingerprints = self._fingerprints()
        key, require_mac = self._auth()
        fd, tmp_name = tempfile.mkstemp(prefix=UPLOAD_PREFIX, dir=self._scratch())
        tmp = Path(tmp_name)
        try:
            size = 0
            with os.fdopen(fd, "wb") as out:
                for chunk in chunks:
                    size += len(chunk)
                    if size > max_bytes:
                        raise UploadRefused(f"the upload is over the limit of {max_bytes} bytes", "too_large")
                    out.write(chunk)
            if size == 0:
                raise UploadRefused("the upload is empty; send a session file as the body", "empty")
            if llamacpp.is_slot_file(tmp):
                converted = tmp.with_name(tmp.name + SUFFIX)
                try:
                    self._convert_slot_file(tmp, converted, fingerprints)
                    os.replace(converted, tmp)
                finally:
                    converted.unlink(missing_ok=True)
                size = tmp.stat().st_size
            try:
                inspection = sf.inspect(tmp, verify=True, read_threads=1, key=key, require_mac=require_mac)
            except sf.SessionFileError as exc:
                raise UploadRefused(f"not a valid session file: {exc}", str(exc.reason)) from None
            if not fingerprints.match(inspection.header):
                raise UploadRefused(
                    "the session file was written for another model or engine setting than this server's",
                    "fingerprint_mismatch",
                )
            tokens = np.frombuffer(inspection.metadata.state.tokens, dtype="<i4").copy()
            name = conversation_name(fingerprints, tokens)
            if self.store.index.get(name) is not None:
                return self.get(conversation_id(name)), False
            shelf = self.store.shelf
            if isinstance(shelf, ObjectShelf):
                return self._put_upload(shelf, tmp, name, tokens, size, fingerprints)
            assert isinstance(shelf, StoreFolder)
            os.replace(tmp, shelf.pending(name))
        finally:
            tmp.unlink(missing_ok=True)
        # Committed as a save is (synced, room made, indexed, shared): the upload is one more save.
        self.store.saves.commit(
            PendingSave(UPLOAD_SLOT, SaveTrigger.UPLOAD, name, tokens, fingerprints, size, 0.0)
        )
        return self._kept(name), True

    def _put_upload(
        self,
        shelf: ObjectShelf,
        path: Path,
        name: str,
        tokens: np.ndarray,
        size: int,
        fingerprints: Fingerprints,
    ) -> tuple[Entry, bool]:
        """A validated upload on the object store alone: put under the key a lookup for its tokens lists."""
        remote = self._remote()
        prefix = remote.block_prefix(fingerprints, tokens)
        if prefix is None:
            raise UploadRefused(
                f"the conversation holds {len(tokens)} tokens; the object store keeps those of at least "
                f"{BLOCK_TOKENS} (a key is named by the first block)",
                "too_short",
            )
        existing = self._listed(fingerprints).get(name)
        if existing is not None:
            return self.get(conversation_id(name)), False
        self._put(path, prefix + name)
        stored = StoredConversation(name, size, tokens)
        shelf.held(prefix + name, stored)
        self.store.index.add(stored)
        remote.forget(prefix + name)  # listed at once
        return self._kept(name), True

    def _kept(self, name: str) -> Entry:
        try:
            return self.get(conversation_id(name))
        except UnknownConversation:
            raise UploadRefused(
                "the session file is valid but the store did not keep it (larger than its byte limit?)",
                "not_kept",
            ) from None
