"""`strata-engine` run as a command, for the tests of its exit statuses and fatal lines."""

from __future__ import annotations

import subprocess
import sys

# A ceiling, not a wait: the first run in a fresh clone compiles the kernels (over 2 minutes without AVX512-VNNI).
CLI_TIMEOUT_S = 600


def run_cli(*args: str, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "strata_engine.cli", *args],
        capture_output=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
