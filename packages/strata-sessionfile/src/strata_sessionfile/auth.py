"""Keyed authentication of session files (spec section 4.1): the session key, its key id, the MAC, and the
payload hashers of an authenticated file.

A file written with a key sets the header flag AUTHENTICATED; its trailer carries the key id, the SHA-256
of the payload and HMAC-SHA256(key, MAC_DOMAIN || header || trailer bytes [0, 64)), so the MAC covers the
header, the payload hash and a cryptographic digest of the payload. A reader holding the key checks the key
id and the MAC from the header and the trailer alone, before it parses the metadata (rules K1-K3), and the
payload's SHA-256 at the end of every pass over the data, with the payload hash (K4).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from typing import TYPE_CHECKING, Protocol

import xxhash

from . import errors as E
from .format import (
    AUTH_EXTENSION_STRUCT,
    HEADER_SIZE,
    KEY_ID_DOMAIN,
    KEY_SIZE,
    MAC_COVERED_TRAILER,
    MAC_DOMAIN,
    Flags,
)

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer


class SessionKey:
    """A 32-byte key that authenticates session files; ``key_id`` (16 bytes) names it in files and errors
    without revealing it. ``SessionKey.from_file(path)`` reads a key file of exactly 32 bytes."""

    __slots__ = ("_secret", "key_id")

    def __init__(self, secret: bytes) -> None:
        if len(secret) != KEY_SIZE:
            raise ValueError(f"a session key is {KEY_SIZE} bytes, not {len(secret)}")
        self._secret = bytes(secret)
        self.key_id = hmac.digest(self._secret, KEY_ID_DOMAIN, "sha256")[:16]

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> SessionKey:
        """The key in ``path``: exactly 32 bytes (e.g. ``head -c 32 /dev/urandom > key``). OSError if unreadable,
        ValueError naming the file if it holds another number of bytes."""
        with open(path, "rb") as f:
            secret = f.read(KEY_SIZE + 1)
        if len(secret) != KEY_SIZE:
            raise ValueError(
                f"{os.fspath(path)}: a session key file holds exactly {KEY_SIZE} bytes, this one "
                f"{'more' if len(secret) > KEY_SIZE else len(secret)}"
            )
        return cls(secret)

    @classmethod
    def generate(cls) -> SessionKey:
        return cls(secrets.token_bytes(KEY_SIZE))

    def mac(self, header: bytes, trailer_head: bytes) -> bytes:
        """HMAC-SHA256 over the domain tag, the 64 header bytes and trailer bytes [0, 64)."""
        assert len(header) == HEADER_SIZE and len(trailer_head) == MAC_COVERED_TRAILER
        return hmac.digest(self._secret, MAC_DOMAIN + bytes(header) + bytes(trailer_head), "sha256")

    def __repr__(self) -> str:
        return f"SessionKey(id {self.key_id.hex()})"


def as_key(key: SessionKey | bytes | None) -> SessionKey | None:
    return key if key is None or isinstance(key, SessionKey) else SessionKey(key)


def auth_extension(key: SessionKey, header: bytes, payload_hash: bytes, payload_digest: bytes) -> bytes:
    """The 80 bytes between a written file's payload hash and its end marker: key id, payload digest, MAC."""
    covered = payload_hash + key.key_id + payload_digest
    return AUTH_EXTENSION_STRUCT.pack(key.key_id, payload_digest, key.mac(header, covered))


class PayloadHasher(Protocol):
    """What a pass hashes the payload with: ``xxhash.xxh3_128`` or an ``AuthenticatedHasher``."""

    def update(self, data: ReadableBuffer) -> None: ...

    def digest(self) -> bytes: ...

    def copy(self) -> PayloadHasher: ...


class AuthenticatedHasher:
    """The payload hash (XXH3-128) and the payload digest (SHA-256) of an authenticated file, over the same
    bytes in one ``update``."""

    __slots__ = ("xxh", "sha")

    def __init__(self, xxh, sha) -> None:
        self.xxh, self.sha = xxh, sha

    def update(self, data) -> None:
        self.xxh.update(data)
        self.sha.update(data)

    def copy(self) -> AuthenticatedHasher:
        return AuthenticatedHasher(self.xxh.copy(), self.sha.copy())

    def digest(self) -> bytes:
        return self.xxh.digest()

    def payload_digest(self) -> bytes:
        return self.sha.digest()


def payload_hasher(authenticated: bool, initial: bytes = b"") -> PayloadHasher:
    """What a pass hashes the payload with: XXH3-128 alone, or with SHA-256 for an authenticated file."""
    if not authenticated:
        return xxhash.xxh3_128(initial)
    return AuthenticatedHasher(xxhash.xxh3_128(initial), hashlib.sha256(initial))


def check_authentication(
    header_raw: bytes,
    flags: int,
    trailer_raw: bytes,
    trailer_offset: int,
    key: SessionKey | None,
    require_mac: bool,
    path: str,
) -> bytes | None:
    """Rules K1-K3, from the header and the trailer alone. Returns the authenticated payload digest that every
    pass must reproduce (rule K4), or None when nothing is to be checked (no key, or no MAC allowed)."""
    if not flags & Flags.AUTHENTICATED:
        if require_mac:
            raise E.MacMissing(
                "the file carries no MAC; this reader accepts only files authenticated by its key",
                path=path,
                offset=10,
                field="flags",
            )
        return None
    if key is None:
        return None
    key_id, payload_digest, mac = AUTH_EXTENSION_STRUCT.unpack_from(trailer_raw, 16)
    if key_id != key.key_id:
        raise E.MacWrongKey(
            f"the file was authenticated with key {key_id.hex()}, not with this reader's key "
            f"{key.key_id.hex()}",
            path=path,
            offset=trailer_offset + 16,
            field="key_id",
        )
    if not hmac.compare_digest(key.mac(header_raw, trailer_raw[:MAC_COVERED_TRAILER]), mac):
        raise E.MacMismatch(
            "the MAC does not match the header and the payload hashes under this reader's key",
            path=path,
            offset=trailer_offset + 64,
            field="mac",
        )
    return payload_digest
