"""Helpers the session file tests share (fixtures are in conftest.py; spec/ files in golden.py)."""

from __future__ import annotations

import struct
import threading

import pytest
from strata_sessionfile import Phase, restore
from strata_sessionfile import errors as E
from strata_sessionfile.testing import memory_adapter_factory

from .golden import refresh

# Small sessions (24 tokens, a few 4 KiB blocks) for the many-files robustness tests.
SMALL = memory_adapter_factory(n_tokens=24)
SMALL_STAGING = memory_adapter_factory(n_tokens=24, staging=True)
# ~60 KB sessions: more blocks of 4 KiB than any number of reader threads.
COPYING = memory_adapter_factory(n_tokens=200)
COPYING_STAGING = memory_adapter_factory(n_tokens=200, staging=True)
LANDING = memory_adapter_factory(n_tokens=200, zero_copy=True)
LANDING_STAGING = memory_adapter_factory(n_tokens=200, staging=True, zero_copy=True)

# Adapter calls that reach the engine's session. Staged mode hands blocks to the staging area before the
# hash is checked (by design); the live session is touched only by LIVE_TOUCH.
TOUCH = {"begin_apply", "copy_in", "commit", "fail_stop", "begin_staging", "stage_in", "commit_staged"}
LIVE_TOUCH = {"begin_apply", "copy_in", "commit", "fail_stop", "commit_staged"}


def files_in(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def helpers_alive() -> list[str]:
    """The library's helper threads still running (readers, decoders, the write helper)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("strata-")]


def trailer_digest(path) -> bytes:
    """The payload hash a file's trailer stores."""
    return path.read_bytes()[-24:-8]


def check_refused_cleanly(path, *, staging: bool = False, expected=E.SessionFileError) -> None:
    """A restore of ``path`` is refused with ``expected`` and leaves the adapter's live session as it was."""
    target = (SMALL_STAGING if staging else SMALL)(2)
    before = target.live_digest()
    with pytest.raises(expected):
        restore(path, target, block_size=4096)
    assert not (LIVE_TOUCH if staging else TOUCH) & set(target.events), target.events
    assert target.live_digest() == before


def mutate(data: bytes, ops, rehash: bool) -> bytes:
    """``data`` with each (kind, position, value) of ``ops`` applied; ``rehash``: hashes made consistent again."""
    b = bytearray(data)
    for kind, pos, value in ops:
        if not b:
            break
        i = pos % len(b)
        if kind == "flip":
            b[i] ^= (value % 255) + 1
        elif kind == "u32" and i + 4 <= len(b):
            b[i : i + 4] = struct.pack("<I", value & 0xFFFFFFFF)
        elif kind == "u64" and i + 8 <= len(b):
            b[i : i + 8] = struct.pack("<Q", value & 0xFFFFFFFFFFFFFFFF)
        elif kind == "insert":
            b[i:i] = bytes([value & 0xFF]) * ((value % 7) + 1)
        elif kind == "delete":
            del b[i : i + (value % 9) + 1]
    if rehash and len(b) >= 64 + 24:
        b = bytearray(refresh(b))
    return bytes(b)


def restore_invariant(path, staging: bool) -> bool:
    """Restore ``path`` (a possibly damaged file): a refusal touched nothing live; an acceptance handed
    blocks over only after validation. Returns whether it was accepted."""
    target = (SMALL_STAGING if staging else SMALL)(2)
    before = target.live_digest()
    phases = []

    def progress(p):
        phases.append(p.phase)

    try:
        restore(path, target, block_size=4096, progress=progress)
    except E.FailStop as exc:
        raise AssertionError("an unchanging file must never fail after the gate") from exc
    except E.SessionFileError:
        assert not (LIVE_TOUCH if staging else TOUCH) & set(target.events), target.events
        assert target.live_digest() == before
        return False
    # Accepted (e.g. K/V bytes mutated and hashes refreshed): the adapter got blocks only after validation.
    first_touch = min(i for i, e in enumerate(target.events) if e in TOUCH)
    assert "check_plan" in target.events[:first_touch]
    if not staging and Phase.APPLY in phases:  # the read pass finished before anything was applied
        assert Phase.READ not in phases[phases.index(Phase.APPLY) :]
    return True
