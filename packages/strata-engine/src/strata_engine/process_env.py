"""Importing this module sets the engine process's environment, before numpy loads OpenBLAS: the CLI imports it
first, and so do the tests and benchmarks that run the engine in their own process. The library itself never
changes the environment (the server imports strata_engine's vocabularies and keeps its own).

OpenBLAS's threads spin ~0.1 s after each call before they sleep; the numba kernels that follow a prefill's BLAS
products then share the cores with them (decode fell several-fold). OpenBLAS reads the timeout once, at load.
"""

import os

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
