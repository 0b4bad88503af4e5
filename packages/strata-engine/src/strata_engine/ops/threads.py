"""How many CPU threads the kernels and BLAS run on (`--threads`) and how long an idle kernel thread polls
for work before it sleeps (`--poll`), set once per process."""

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

        started = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]  # numba.config's options are set at run time
        n = max(1, min(n, started))
        numba.set_num_threads(n)
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # BLAS keeps OPENBLAS_NUM_THREADS or its own default
        return n
    threadpool_limits(n, user_api="blas")
    return n


# libgomp spins per poll level (llama-server's --poll, 0-100): a level of 50 spins ~5,000 times, long enough
# to stay awake between the parallel regions of a decode step (a sleeping thread took 25-50 us to wake
# for every product, ~1/4 of a SmolLM2 step), short enough to sleep soon after a step. bench/engine/DECISIONS.md "Idle threads".
SPINS_PER_POLL_LEVEL = 100


def set_poll(level: int) -> bool:
    """Make numba's OpenMP threads poll for `level` x SPINS_PER_POLL_LEVEL spins before they sleep (0: at
    once, for a machine whose cores other work needs). libgomp reads it when numba starts its threads, once
    per process: False where they had started already (the level then is the one they started with)."""
    if "numba" in sys.modules:
        from numba.np.ufunc import parallel

        if parallel._is_initialized:
            return False
    os.environ["GOMP_SPINCOUNT"] = str(level * SPINS_PER_POLL_LEVEL)
    return True
