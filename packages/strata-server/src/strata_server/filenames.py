"""Slot file names: the peer's ``fs_validate_filename`` (subdirectories disallowed), plus a symlink check.

A valid name is one plain file name inside ``--slot-save-path``; ``resolve_slot_file`` additionally
refuses a name that is, inside that folder, a symbolic link (the peer follows it: llama.cpp #26315).
The engine opens restores with O_NOFOLLOW and saves by renaming over the name, so a link planted
between this check and the engine's open is still never followed.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import ServerError

MAX_FILENAME_BYTES = 255

# Code points the peer rejects anywhere in a name (besides the C0/C1 control ranges below).
_FORBIDDEN_CODE_POINTS = frozenset({0x7F, 0xFF0E, 0x2215, 0x2216, 0xFFFD, 0xFEFF})
_FORBIDDEN_CHARACTERS = frozenset(':*?"<>|/\\')


class InvalidFilename(ServerError, ValueError):
    """The name is not one plain file name; the message says what is wrong."""


def validate_filename(name: str) -> None:
    """Raise ``InvalidFilename`` unless ``name`` passes the peer's ``fs_validate_filename``."""
    if not name:
        raise InvalidFilename("the name is empty")
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidFilename(
            f"the name is not valid UTF-8 (code point U+{ord(name[exc.start]):04X})"
        ) from None
    if len(encoded) > MAX_FILENAME_BYTES:
        raise InvalidFilename(f"the name is {len(encoded)} bytes long, the limit is {MAX_FILENAME_BYTES}")
    for index, char in enumerate(name):
        code = ord(char)
        if code <= 0x1F or 0x80 <= code <= 0x9F or code in _FORBIDDEN_CODE_POINTS or 0xD800 <= code <= 0xDFFF:
            raise InvalidFilename(f"the name contains the forbidden code point U+{code:04X} at index {index}")
        if char in _FORBIDDEN_CHARACTERS:
            raise InvalidFilename(f"the name contains the forbidden character {char!r} at index {index}")
    if name[0] == " " or name[-1] == " ":
        raise InvalidFilename("the name starts or ends with a space")
    if name == ".":
        raise InvalidFilename("the name is '.'")
    if ".." in name:
        raise InvalidFilename("the name contains '..'")
    if name[-1] == ".":
        raise InvalidFilename("the name ends with '.'")


def resolve_slot_file(folder: Path, name: str, *, must_exist: bool) -> Path:
    """The path of slot file ``name`` inside ``folder``; refuses links and non-regular files.

    Raises ``InvalidFilename`` for a bad name, a symbolic link or something that is not a regular
    file, and ``FileNotFoundError`` when ``must_exist`` and there is nothing under that name.
    """
    validate_filename(name)
    path = folder / name
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        if must_exist:
            raise
        return path
    if stat.S_ISLNK(info.st_mode):
        raise InvalidFilename(
            f"'{name}' is a symbolic link in the slot save folder; links are never followed"
        )
    if not stat.S_ISREG(info.st_mode):
        raise InvalidFilename(f"'{name}' is not a regular file")
    return path
