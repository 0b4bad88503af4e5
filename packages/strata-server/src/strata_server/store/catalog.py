"""The store's conversations as a person sees them (the web page and `/conversations`): listing, deleting,
the file of one, and an uploaded session file adopted into the store.

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

import attrs
import numpy as np
import strata_sessionfile as sf
from strata_sessionfile import llamacpp

from ..errors import ServerError
from ..tokens import common_prefix
from ..transcript import Notes
from .folder import StoreFolder
from .index import StoredConversation
from .metrics import SaveTrigger
from .names import SUFFIX, Fingerprints, conversation_name
from .retitle import CompressedFile, retitled
from .saving import PendingSave
from .store import SessionStore

log = logging.getLogger("strata_server.store")

ID = re.compile(r"^[0-9a-f]{32}$")
UPLOAD_PREFIX = ".upload-"  # a temporary upload: never a NAME, so no scan reads it
UPLOAD_SLOT = -1  # the slot of a PendingSave that no slot wrote (an upload, a rename; log lines only)
CHUNK = 1 << 20


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


@attrs.frozen
class Entry:
    """One stored conversation as the list shows it."""

    id: str
    conversation: StoredConversation
    used_at: float  # seconds since the epoch (the file's mtime: the store's least-recently-used clock)
    slots: tuple[int, ...]  # the slots holding it (or more of it)
    places: tuple[str, ...]  # "disk" / "ram", "object store"

    @property
    def where(self) -> tuple[str, ...]:
        return tuple(f"slot {s}" for s in self.slots) + self.places


def conversation_id(name: str) -> str:
    return name.removesuffix(SUFFIX)


def name_of(conversation_id: str) -> str:
    if not ID.match(conversation_id):
        raise UnknownConversation(
            f"'id' must be 32 lowercase hex digits, got {conversation_id[:64]!r}", "invalid_id"
        )
    return conversation_id + SUFFIX


class Catalog:
    """The conversations one `SessionStore` keeps, for people."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store

    def _fingerprints(self) -> Fingerprints:
        # A request right after start-up waits briefly for the scan, as a completion does.
        if not self.store.wait_ready() or self.store.fingerprints is None:
            raise NotSupported("the session store is still starting (the engine is loading)", "loading")
        return self.store.fingerprints

    def _places(self) -> tuple[str, ...]:
        settings = self.store.settings
        places = []
        if settings.folder is not None:
            places.append("ram" if settings.ephemeral else "disk")
        if settings.remote is not None:
            places.append("object store")
        return tuple(places)

    def entries(self) -> list[Entry]:
        """Every conversation the index holds, most recently used first."""
        self._fingerprints()
        held = [(slot, record.tokens) for slot, record in enumerate(self.store.ledger.snapshot())]
        places = self._places()
        found = []
        for conversation in self.store.index.snapshot():
            slots = tuple(
                slot
                for slot, tokens in held
                if tokens is not None and common_prefix(tokens, conversation.tokens) == conversation.n_tokens
            )
            used_at = self.store.shelf.used_at(conversation.name)
            found.append(Entry(conversation_id(conversation.name), conversation, used_at, slots, places))
        found.sort(key=lambda e: -e.used_at)
        return found

    def get(self, conversation_id: str) -> Entry:
        name = name_of(conversation_id)
        for entry in self.entries():
            if entry.conversation.name == name:
                return entry
        raise UnknownConversation(f"no stored conversation with id {conversation_id!r}", "not_found")

    def notes(self, entry: Entry) -> Notes | None:
        """The notes of a conversation's file (a chat's messages, a title), read from its header and metadata
        under the store's key; None on the object store alone (its text is read from tokens)."""
        shelf = self.store.shelf
        return shelf.notes(entry.conversation.name) if isinstance(shelf, StoreFolder) else None

    def retitle(self, conversation_id: str, title: str) -> Entry:
        """The conversation's file written again with `title` in its notes (same tokens, same id), committed
        as a save; a later save that extends it inherits the title."""
        entry = self.get(conversation_id)
        folder = self.folder()
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

    def _convert_slot_file(self, slot_file: Path, out: Path) -> None:
        """A llama.cpp slot file converted against this server's model, carrying the config identity of a
        conversation this engine saved (the slot file has no identity of its own: `strata-sessionfile convert
        --like`); validated afterwards like any upload."""
        model = dict(self.store.engine.status().info or {}).get("model_path")
        kept = self.store.index.snapshot()
        if not isinstance(model, str) or not kept:
            raise UploadRefused(
                "a llama.cpp slot file is converted with the identity of a conversation this server keeps; "
                "it keeps none yet (restore the slot file through /slots/0?action=restore instead)",
                "no_reference_file",
            )
        folder = self.folder()
        try:
            config = llamacpp.config_of(folder.file(kept[-1].name))
            llamacpp.slot_to_session(slot_file, model, out, config=config)
        except sf.SessionFileError as exc:
            raise UploadRefused(f"the llama.cpp slot file does not convert: {exc}", str(exc.reason)) from None
        except FileNotFoundError:
            raise UploadRefused(
                "the reference conversation was removed meanwhile; upload again", "retry"
            ) from None

    def folder(self) -> StoreFolder:
        shelf = self.store.shelf
        if not isinstance(shelf, StoreFolder):
            raise NotSupported(
                "downloads and uploads need a store folder (--cache-disk or --cache-ram); this server keeps "
                "its conversations in the object store only",
                "no_folder",
            )
        return shelf

    def path(self, conversation_id: str) -> Path:
        """The committed file of a conversation (for a download)."""
        entry = self.get(conversation_id)
        return self.folder().file(entry.conversation.name)

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
        self.store.remove(name)
        remote = self.store.remote
        prefix = remote.block_prefix(self._fingerprints(), entry.conversation.tokens) if remote else None
        if remote is not None and prefix is not None:
            try:
                remote.client.delete_object(Bucket=remote.settings.bucket, Key=prefix + name)
            except Exception as exc:  # noqa: BLE001 -- the local file is gone; the bucket's lifecycle rules remain
                log.warning("session store: deleting the object %s%s failed: %s", prefix, name, exc)
            remote.forget(prefix + name)
        return entry

    def upload(self, chunks: Iterable[bytes], max_bytes: int) -> tuple[Entry, bool]:
        """A session file (format v1) from a client, validated in full like any restore (hashes, MAC,
        fingerprints of this engine) and committed under its content name; (entry, whether it was new).
        A refused file leaves nothing behind."""
        fingerprints = self._fingerprints()
        folder = self.folder()
        fd, tmp_name = tempfile.mkstemp(prefix=UPLOAD_PREFIX, dir=folder.path)
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
                    self._convert_slot_file(tmp, converted)
                    os.replace(converted, tmp)
                finally:
                    converted.unlink(missing_ok=True)
            try:
                inspection = sf.inspect(
                    tmp,
                    verify=True,
                    read_threads=1,
                    key=folder.key,
                    require_mac=folder.require_mac,
                )
            except sf.SessionFileError as exc:
                raise UploadRefused(f"not a valid session file: {exc}", str(exc.reason)) from None
            if not fingerprints.match(inspection.header):
                raise UploadRefused(
                    "the session file was written for another model or engine setting than this server's",
                    "fingerprint_mismatch",
                )
            tokens = np.frombuffer(inspection.metadata.state.tokens, dtype="<i4")
            name = conversation_name(fingerprints, tokens)
            if self.store.index.get(name) is not None:
                return self.get(conversation_id(name)), False
            os.replace(tmp, folder.pending(name))
        finally:
            tmp.unlink(missing_ok=True)
        # Committed as a save is (synced, room made, indexed, shared): the upload is one more save.
        self.store.saves.commit(
            PendingSave(UPLOAD_SLOT, SaveTrigger.UPLOAD, name, tokens.copy(), fingerprints, size, 0.0)
        )
        try:
            return self.get(conversation_id(name)), True
        except UnknownConversation:
            raise UploadRefused(
                "the session file is valid but the store did not keep it (larger than its byte limit?)",
                "not_kept",
            ) from None
