"""How many CPU threads the kernels and BLAS run on (`--threads`), set once per process."""

from __future__ import annotations

import os
import sys


def default_threads() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def set_threads(n: int) -> int:
    """Run BLAS, and numba's kernels where numba is loaded, on n threads (numba: at most the threads it
    started with); returns the number numba runs on, or n."""
    if "numba" in sys.modules:
        import numba

        n = max(1, min(n, numba.config.NUMBA_NUM_THREADS))
        numba.set_num_threads(n)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # BLAS keeps OPENBLAS_NUM_THREADS or its own default
        return n
    threadpool_limits(n, user_api="blas")
    return n
