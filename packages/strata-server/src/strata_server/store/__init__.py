"""The session store (`--cache-disk DIR`, `--cache-ram MiB` in a private tmpfs folder, or `--cache-store s3://...`
alone): every conversation kept as a format v1 session file (or object), the longest stored prefix of each prompt
restored into the slot.

* names.py: the content-hash names of files and objects (a leaf).
* index.py: the in-memory index (chained token-block hashes, longest prefix, least-recently-used by bytes).
* shelf.py: the `Shelf` protocol, what the store keeps conversations on:
  * folder.py: the folder (reading headers and metadata, committing, moving bad files aside);
  * objects.py: without --cache-disk, the objects themselves (saved to and restored from).
* remote.py: the object store of a fleet (`--cache-store s3://BUCKET/PREFIX`): listing, headers, uploads.
* policy.py: when to save and restore (pure decisions).
* uploads.py: the object store's upload queue (pure: supersede, byte limit).
* writebehind.py: with --cache-store, each conversation a completion extends saved and uploaded off its path.
* saving.py: the saves, their commits (a thread of their own), the pending saves a lookup waits for, eviction.
* store.py: `SessionStore`: the start-up scan, the request path's lookup, fetch and restore, shutdown.
* settings.py: `StoreSettings`; metrics.py: its Prometheus series.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import strata_sessionfile as sf

from ..config import ServerConfig
from ..engine.client import EngineClient
from .index import BLOCK_TOKENS, StoreIndex
from .names import Fingerprints
from .remote import RemoteSettings
from .settings import MIB, StoreSettings
from .store import SessionStore
from .trust import ram_folder

UNBOUNDED = 1 << 62
RAM_FOLDER_ROOT = Path("/dev/shm")  # tmpfs: a RAM-only store's files live in memory


def session_key(config: ServerConfig) -> sf.SessionKey | None:
    return sf.SessionKey.from_file(config.session_key_file) if config.session_key_file is not None else None


def store_settings(config: ServerConfig) -> StoreSettings | None:
    """The store the config asks for, or None."""
    key, require_mac = session_key(config), not config.session_key_optional
    remote = (
        RemoteSettings.parse(config.cache_store, config.cache_store_endpoint, config.cache_store_queue * MIB)
        if config.cache_store is not None
        else None
    )
    if config.cache_disk is not None:
        return StoreSettings(
            folder=config.cache_disk,
            max_bytes=config.cache_disk_max * MIB,
            min_reuse=config.cache_min_reuse,
            idle_s=config.cache_idle_seconds,
            key=key,
            require_mac=require_mac,
            remote=remote,
            write_behind=config.cache_write_behind,
        )
    if config.cache_ram > 0:
        root = RAM_FOLDER_ROOT if RAM_FOLDER_ROOT.is_dir() else Path(tempfile.gettempdir())
        # Like llama-server's RAM cache it dies with the server: no idle or shutdown saves.
        return StoreSettings(
            folder=ram_folder(root, config.port),
            max_bytes=config.cache_ram * MIB,
            min_reuse=config.cache_min_reuse,
            idle_s=0.0,
            ephemeral=True,
            key=key,
            require_mac=require_mac,
        )
    if remote is not None:  # the object store alone: no byte limit of this server's (a lifecycle rule's)
        return StoreSettings(
            folder=None,
            max_bytes=UNBOUNDED,
            min_reuse=config.cache_min_reuse,
            idle_s=config.cache_idle_seconds,
            key=key,
            require_mac=require_mac,
            remote=remote,
            write_behind=config.cache_write_behind,
        )
    return None


def build_store(config: ServerConfig, engine: EngineClient) -> SessionStore | None:
    settings = store_settings(config)
    return SessionStore(settings, engine, engine.slots.ledger) if settings is not None else None


__all__ = [
    "BLOCK_TOKENS",
    "Fingerprints",
    "SessionStore",
    "StoreIndex",
    "StoreSettings",
    "build_store",
    "store_settings",
]
