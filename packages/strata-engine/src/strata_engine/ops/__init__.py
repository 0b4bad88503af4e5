"""The engine's numeric operations behind one interface, `get_ops(backend, compute_dtype)`.

`Ops` (base.py) is the interface; `NumpyOps` (numpy_ops.py) is the reference, `NumbaOps` (numba_ops.py:
packed weights, compiled kernels, `--cpu-kernels numba`) its faster CPU twin and `CupyOps` (cupy_ops.py)
its GPU twin. Models and the K/V code receive an `Ops` and never call an array library for heavy work.
"auto" resolves to "cupy" when CuPy sees a CUDA device, else "numpy" (`resolve_backend`).
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import SettingsError
from ..settings import DEFAULT_POLL, Backend, CpuKernels, EngineSettings
from .base import Ops
from .numpy_ops import NumpyOps
from .threads import default_threads, set_poll, set_threads


def _numpy_ops(compute_dtype: str, threads: int | None, batch_invariant: bool) -> Ops:
    """BLAS's products and numpy's sums; batch-invariant in fixed row groups (`NumpyOps.grouped_matmul`)."""
    if threads is not None:
        set_threads(threads)
    return NumpyOps(compute_dtype, batch_invariant)


def _numba_ops(compute_dtype: str, threads: int | None, batch_invariant: bool, q8: bool = False) -> Ops:
    from .numba_ops import NumbaOps  # imports numba only when its kernels are asked for

    return NumbaOps(compute_dtype, threads, q8=q8, batch_invariant=batch_invariant)


def _numba_q8_ops(compute_dtype: str, threads: int | None, batch_invariant: bool) -> Ops:
    return _numba_ops(compute_dtype, threads, batch_invariant, q8=True)


def _cupy_ops(compute_dtype: str, threads: int | None, batch_invariant: bool) -> Ops:
    from .cupy_ops import CupyOps  # imports cupy only when the GPU backend is asked for

    return CupyOps(compute_dtype)


# The numpy backend's kernels (settings.CpuKernels) -> the ops factory (compute dtype, threads, batch-invariant).
CPU_OPS: dict[str, Callable[[str, int | None, bool], Ops]] = {
    CpuKernels.NUMPY: _numpy_ops, CpuKernels.NUMBA: _numba_ops, CpuKernels.NUMBA_Q8: _numba_q8_ops,
}  # fmt: skip
# A backend (settings.Backend, "auto" resolved) -> the ops factory computing on it, given the CPU kernels.
OPS_OF_BACKEND: dict[str, Callable[[str, str, int | None, bool], Ops]] = {
    Backend.NUMPY: lambda dtype, kernels, threads, invariant: CPU_OPS[kernels](dtype, threads, invariant),
    Backend.CUPY: lambda dtype, kernels, threads, invariant: _cupy_ops(dtype, threads, invariant),
}


def resolve_backend(backend: str) -> str:
    """ "auto" -> "cupy" where a CUDA device is usable, else "numpy"; other names unchanged."""
    if backend != Backend.AUTO:
        return backend
    from .cupy_ops import cuda_available

    return Backend.CUPY.value if cuda_available() else Backend.NUMPY.value


def resolve_settings(settings: EngineSettings, architecture: str) -> EngineSettings:
    """The settings as they run here: "auto" resolved (`resolve_backend`), every None default filled in for
    the backend and the architecture, the threads this process may use where none were given."""
    backend = Backend(resolve_backend(settings.backend))
    return settings.with_backend_defaults(architecture, backend=backend, threads=default_threads())


def get_ops(
    backend: str = Backend.NUMPY, compute_dtype: str = "f32", cpu_kernels: str = CpuKernels.NUMPY,
    threads: int | None = None, poll: int = DEFAULT_POLL, *, batch_invariant: bool = True,
) -> Ops:  # fmt: skip
    """The ops of a backend; on numpy, of `cpu_kernels`, on `threads` threads (None: as they are) polling
    `poll` (`threads.set_poll`) where their threads are not started yet; batch_invariant: a row's arithmetic
    never depends on the other rows of its pass (`settings.EngineSettings.batch_invariant`)."""
    backend = resolve_backend(backend)
    try:
        make = OPS_OF_BACKEND[backend]
    except KeyError:
        raise SettingsError(
            [f"backend {backend!r} is not available (have: {', '.join(OPS_OF_BACKEND)})"]
        ) from None
    set_poll(poll)
    return make(compute_dtype, cpu_kernels, threads, batch_invariant)


__all__ = ["CPU_OPS", "OPS_OF_BACKEND", "NumpyOps", "Ops", "get_ops", "resolve_backend", "resolve_settings"]
