"""The store's folder (a `shelf.Shelf`): reading a file's identity and tokens (header and metadata only,
through strata-sessionfile), committing a pending file, moving a bad file aside, and removing one; with
--cache-store, the object store's tier behind it (committed files uploaded, found objects downloaded).

A save lands in two steps: the engine writes `<name>.pending` without fsync (SAVE with "sync": false, in the
request's path), then the store fsyncs it (`sync_pending`), renames it to `<name>` and fsyncs the folder (`publish`),
off the request's path.
Only committed files are read by a scan or restored.

Names are content hashes (names.py), never anything a client sent; a scan reads only names of that form,
so nothing else in the folder is opened, and another server's files (another model or setting, told apart
by the header's fingerprints) are left alone.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import strata_sessionfile as sf

from ..transcript import Notes, read_notes
from .index import StoredConversation
from .names import NAME, PENDING, PENDING_SUFFIX, Fingerprints
from .remote import Candidate, RemoteTier
from .shelf import Adoption
from .trust import create_private, owned, owner

log = logging.getLogger("strata_server.store")

BAD_FOLDER = ".bad"  # files that failed validation are moved here, never restored
FOLDER_MODE = 0o700


class StoreFolder:
    def __init__(
        self,
        path: Path,
        key: sf.SessionKey | None = None,
        require_mac: bool = False,
        remote: RemoteTier | None = None,
        private: bool = False,
    ) -> None:
        self.path = path
        self.key = key  # a file whose MAC does not check under it (or that has none, when required) is bad
        self.require_mac = require_mac
        self.remote = remote  # --cache-store: the object store behind the folder
        self.private = private  # --cache-ram: a folder this server creates (trust.create_private)
        self._lock: int | None = None  # the private folder's locked descriptor, held for the server's life

    def create(self) -> None:
        """The folder, created 0700 if missing (an existing one keeps its mode: the config refused a loose
        one); a private one is created new (trust.StoreFolderRefused when something is at its name)."""
        if self.private:
            self._lock = create_private(self.path)
        else:
            self.path.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)

    def trusted(self, name: str) -> bool:
        """Whether a committed file is the server's user's: another user's is never indexed or restored."""
        return owned(self.file(name))

    def file(self, name: str) -> Path:
        assert NAME.match(name), name
        return self.path / name

    def pending(self, name: str) -> Path:
        """Where the engine writes `name` before its commit."""
        return self.file(name).with_name(name + PENDING_SUFFIX)

    def target(self, name: str, fingerprints: Fingerprints, tokens: np.ndarray) -> dict[str, Any]:
        """SAVE's object (less the slot) for `tokens`: the pending file, not fsynced (the store commits it);
        objects.ObjectShelf's is an object."""
        return {"path": str(self.pending(name)), "sync": False}

    def adopt(self, candidate: Candidate, fingerprints: Fingerprints) -> Adoption:
        """An object the store's lookup found: downloaded into the folder, then read as any file of it."""
        assert self.remote is not None, "only a folder with an object store behind it finds objects"
        path = self.remote.download(candidate, self.path)
        return Adoption(self.conversation(candidate.name, fingerprints), path.stat().st_size)

    def share(self, name: str, fingerprints: Fingerprints, tokens: np.ndarray) -> None:
        """A committed file uploaded to the object store behind the folder (off this thread), if any."""
        if self.remote is not None:
            self.remote.upload(self.file(name), fingerprints, tokens)

    def names(self) -> Iterator[str]:
        with os.scandir(self.path) as entries:
            for entry in entries:
                if NAME.match(entry.name) and self._ours(entry):
                    yield entry.name

    def pending_names(self) -> Iterator[str]:
        """The names of pending files (left by a server killed before their commit)."""
        with os.scandir(self.path) as entries:
            for entry in entries:
                found = PENDING.match(entry.name)
                if found and self._ours(entry):
                    yield found.group(1)

    @staticmethod
    def _ours(entry: os.DirEntry) -> bool:
        """A regular file (not a link) of the server's user; another user's is logged and left alone."""
        if not entry.is_file(follow_symlinks=False):
            return False
        uid = entry.stat(follow_symlinks=False).st_uid
        if uid != owner():
            log.warning(
                "session store: %s belongs to uid %d, not to this server's user: ignored", entry.path, uid
            )
            return False
        return True

    def read(self, name: str, pending: bool = False, verify: bool = False) -> tuple[sf.Inspection, int]:
        """Header and metadata of one file (with `verify`, its payload hash too) and its size;
        SessionFileError when they are not valid."""
        path = self.pending(name) if pending else self.file(name)
        inspection = sf.inspect(
            path, verify=verify, read_threads=1, key=self.key, require_mac=self.require_mac
        )
        return inspection, path.stat().st_size

    def conversation(
        self, name: str, fingerprints: Fingerprints, pending: bool = False, verify: bool = False
    ) -> StoredConversation | None:
        """The stored conversation of one file, or None when it belongs to another engine."""
        inspection, size = self.read(name, pending, verify)
        if not fingerprints.match(inspection.header):
            return None
        return StoredConversation(name, size, np.frombuffer(inspection.metadata.state.tokens, dtype="<i4"))

    def notes(self, name: str) -> Notes | None:
        """The notes a committed file keeps (a chat's messages, a title); None: none, or unreadable now."""
        try:
            return read_notes(self.read(name)[0].metadata.state.engine_fields)
        except (sf.SessionFileError, OSError):
            return None

    def sync_pending(self, name: str) -> None:
        """fsync a pending file's bytes (the slow part of a commit; OSError: it stays pending)."""
        fd = os.open(self.pending(name), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def publish(self, name: str) -> None:
        """A synced pending file renamed to its final name at once, then the folder fsynced (a failure of
        that last fsync is logged: the file is in place). OSError from the rename: nothing changed."""
        os.replace(self.pending(name), self.file(name))
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning("session store: %s is in place but fsyncing the folder failed: %s", name, exc)

    def remove_pending(self, name: str) -> None:
        try:
            os.unlink(self.pending(name))
        except FileNotFoundError:
            pass

    def used_at(self, name: str) -> float:
        try:
            return self.file(name).stat().st_mtime
        except OSError:
            return 0.0

    def touch(self, name: str) -> None:
        """Record a use in the file's mtime: the least-recently-used order survives a restart."""
        try:
            os.utime(self.file(name))
        except OSError:
            pass

    def remove(self, name: str) -> bool:
        try:
            os.unlink(self.file(name))
            return True
        except FileNotFoundError:
            return False

    def move_aside(self, name: str, reason: str) -> None:
        """A file that failed validation goes to .bad/ (removed if that fails): never restored again."""
        bad = self.path / BAD_FOLDER
        try:
            bad.mkdir(mode=FOLDER_MODE, exist_ok=True)
            os.replace(self.file(name), bad / f"{name}.{int(time.time())}.{reason}")
            log.warning("session store: %s failed validation (%s); moved to %s", name, reason, bad)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning(
                "session store: %s failed validation (%s) and could not be moved aside (%s); removing it",
                name,
                reason,
                exc,
            )
            self.remove(name)
