"""`strata-engine` run as a command, for the tests of its exit statuses and fatal lines."""

from __future__ import annotations

import subprocess
import sys


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "strata_engine.cli", *args],
        capture_output=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
