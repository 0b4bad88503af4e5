"""Whether this process compiled any of the engine's numba kernels rather than loading them from numba's disk
cache. A process that compiled keeps LLVM's memory for its life (100-260 MiB: bench/engine/DECISIONS.md,
"Compiled kernels"), so `strata-engine serve` starts itself over (`restart_if_compiled`) once its warm-up has filled the
cache: the process that serves then loaded every kernel from disk."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

# The modules whose module-level dispatchers are the engine's compiled kernels.
KERNEL_MODULES = (
    "strata_engine.ops.numba_kernels",
    "strata_engine.ops.numba_q8",
    "strata_engine.tokenizer.kernels",
)
# Set in the environment of the process started over: it never starts over again (a cache numba cannot
# write would otherwise compile, and restart, forever).
RESTARTED_ENV = "STRATA_ENGINE_RESTARTED_AFTER_COMPILING"


def kernel_dispatchers(modules: Sequence[str] = KERNEL_MODULES) -> Iterator[Any]:
    """The numba dispatchers defined at the top level of those of `modules` imported so far."""
    from numba.core.dispatcher import Dispatcher

    for name in modules:
        module = sys.modules.get(name)
        if module is not None:
            yield from (k for k in vars(module).values() if isinstance(k, Dispatcher))


def compiled_here(modules: Sequence[str] = KERNEL_MODULES) -> int:
    """Kernel signatures this process compiled (numba's cache misses), over `kernel_dispatchers(modules)`."""
    return sum(sum(k.stats.cache_misses.values()) for k in kernel_dispatchers(modules))


def restart_if_compiled(argv: Sequence[str]) -> None:
    """Replace this process with `argv` (the same pid, pipes and environment, `RESTARTED_ENV` added) if it
    compiled a kernel and is not itself such a restart; otherwise return. Called before anything is read
    from stdin or written to stdout, so the restarted process takes both over as they are."""
    if os.name != "posix" or os.environ.get(RESTARTED_ENV) or not (n := compiled_here()):
        return  # elsewhere exec starts a new process: the parent's pipes would not carry over
    print(f"strata-engine: {n} kernel signatures compiled in this process and cached; starting over to load "
          "them from the cache without the compiler's memory", file=sys.stderr, flush=True)  # fmt: skip
    sys.stdout.flush()
    os.environ[RESTARTED_ENV] = "1"
    try:
        os.execv(sys.executable, list(argv))
    except OSError as exc:  # this process is loaded: it serves, the compiler's memory kept
        del os.environ[RESTARTED_ENV]
        print(
            f"strata-engine: could not start over ({exc}); serving from this process",
            file=sys.stderr,
            flush=True,
        )
