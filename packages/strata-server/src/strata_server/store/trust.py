"""The store's trust boundary on one machine: its folder belongs to the server's user and no one else may
write in it, and only files of that user are indexed or restored. Without --session-key-file nothing else
tells a planted file from one this server wrote (the hashes detect corruption, not authorship).

* `--cache-disk DIR`: a folder owned by another user or writable by group or others is refused at start-up,
  as OpenSSH refuses a key file with loose permissions (`--cache-disk-loose-permissions` makes it a warning).
* `--cache-ram`: a folder of an unpredictable name, created 0700 by this server (never an existing one:
  a symlink or folder planted at its name is refused), locked while the server lives; the folders of
  servers of this user that died without removing theirs are removed by the next one.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import stat
import time
from pathlib import Path

from ..errors import ServerError

log = logging.getLogger("strata_server.store")

PRIVATE_MODE = 0o700
LOOSE_BITS = stat.S_IWGRP | stat.S_IWOTH  # another user could plant, replace or remove files
RAM_PREFIX = "strata-cache-ram-"
STALE_AFTER_S = 60.0  # a RAM folder this old whose lock nobody holds was left by a dead server


class StoreFolderRefused(ServerError):
    """The store's folder is not private to the server's user."""


def owner() -> int:
    """The user the store trusts: the server's own (effective) user."""
    return os.geteuid()


def folder_problems(path: Path) -> list[str]:
    """Why an existing store folder is not private to the server's user (empty when it is)."""
    info = os.stat(path)
    problems = []
    if info.st_uid != owner():
        problems.append(
            f"{path} is owned by uid {info.st_uid}, not by the server's user (uid {owner()}): that user "
            "could read every kept conversation and plant files the store would restore"
        )
    if info.st_mode & LOOSE_BITS:
        problems.append(
            f"{path} is writable by group or others (mode {stat.S_IMODE(info.st_mode):04o}): another user "
            f"could plant files the store would restore; chmod 700 {path}"
        )
    return problems


def ram_folder(root: Path, port: int) -> Path:
    """A RAM store's folder: a name no other user can guess before the server creates it."""
    return root / f"{RAM_PREFIX}{owner()}-{port}-{secrets.token_hex(8)}"


def create_private(path: Path) -> int:
    """Create `path` 0700 (it must not exist: whatever is there was not made by this server), check that it
    is a real folder of this user with mode 0700, and lock it for the server's life; the lock's descriptor.
    StoreFolderRefused otherwise."""
    remove_stale(path.parent)
    try:
        path.mkdir(mode=PRIVATE_MODE)
    except FileExistsError:
        raise StoreFolderRefused(
            f"session store: {path} exists already (a link or folder this server did not create); refused"
        ) from None
    except OSError as exc:
        raise StoreFolderRefused(f"session store: cannot create {path}: {exc}") from None
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    info = os.fstat(fd)
    if info.st_uid != owner() or stat.S_IMODE(info.st_mode) != PRIVATE_MODE:
        os.close(fd)
        raise StoreFolderRefused(
            f"session store: {path} is not a folder of uid {owner()} with mode 0700 "
            f"(uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o}); refused"
        )
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def remove_stale(root: Path) -> None:
    """Remove the RAM folders of this user's servers that died without removing theirs (no lock held, older
    than a minute); links, other users' folders and live servers' are left alone."""
    prefix = f"{RAM_PREFIX}{owner()}-"
    stale: list[str] = []
    with contextlib.suppress(OSError), os.scandir(root) as entries:
        stale = [e.path for e in entries if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False)]
    for path in stale:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            if info.st_uid != owner() or time.time() - info.st_mtime < STALE_AFTER_S:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by a live server: BlockingIOError
            shutil.rmtree(path, ignore_errors=True)
            log.info("session store: removed %s, the RAM folder of a server that died", path)
        except OSError:
            continue
        finally:
            os.close(fd)


def owned(path: Path) -> bool:
    """Whether a file in the store is the server's user's (a file of another user is never read)."""
    try:
        return os.lstat(path).st_uid == owner()
    except OSError:
        return False
