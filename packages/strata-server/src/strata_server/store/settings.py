"""What a session store is asked to be (built from the server's config in `store_settings`)."""

from __future__ import annotations

from pathlib import Path

import attrs
import strata_sessionfile as sf

from .remote import RemoteSettings

MIB = 1 << 20
SCAN_BUDGET_S = 60.0  # start-up scan: files not read by then stay unindexed (logged)
SHUTDOWN_BUDGET_S = 20.0  # saving every slot at shutdown (inside gunicorn's 30 s graceful timeout)


@attrs.frozen
class StoreSettings:
    folder: Path | None  # None: the object store alone (`remote`), no local files
    max_bytes: int
    min_reuse: int
    idle_s: float  # 0: no idle saves
    ephemeral: bool = (
        False  # a RAM-only store: emptied at start, removed at shutdown, never saved at shutdown
    )
    key: sf.SessionKey | None = None  # --session-key-file: files are read only when their MAC checks
    require_mac: bool = (
        True  # with a key: a file without a MAC is bad (moved aside), as the engine refuses it
    )
    remote: RemoteSettings | None = None  # --cache-store: the object-store tier behind the folder
    write_behind: bool = True  # with `remote`: save and upload each conversation a completion extends
    shutdown_budget_s: float = SHUTDOWN_BUDGET_S
    scan_budget_s: float = SCAN_BUDGET_S
