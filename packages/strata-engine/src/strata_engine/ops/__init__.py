"""The engine's numeric operations behind one interface, `get_ops(backend, compute_dtype)`.

`NumpyOps` (numpy_ops.py) is the reference; `CupyOps` (cupy_ops.py) is its GPU twin with the same
methods. Models and the K/V code receive an ops object and never call an array library for heavy work.
"auto" resolves to "cupy" when CuPy sees a CUDA device, else "numpy" (`resolve_backend`).
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import SettingsError
from ..settings import Backend
from .numpy_ops import NumpyOps


def _cupy_ops(compute_dtype: str) -> NumpyOps:
    from .cupy_ops import CupyOps  # imports cupy only when the GPU backend is asked for

    return CupyOps(compute_dtype)


# A backend (settings.Backend, "auto" resolved) -> the ops class (or factory) computing on it.
OPS_OF_BACKEND: dict[str, Callable[[str], NumpyOps]] = {Backend.NUMPY: NumpyOps, Backend.CUPY: _cupy_ops}


def resolve_backend(backend: str) -> str:
    """ "auto" -> "cupy" where a CUDA device is usable, else "numpy"; other names unchanged."""
    if backend != Backend.AUTO:
        return backend
    from .cupy_ops import cuda_available

    return Backend.CUPY.value if cuda_available() else Backend.NUMPY.value


def get_ops(backend: str = Backend.NUMPY, compute_dtype: str = "f32") -> NumpyOps:
    backend = resolve_backend(backend)
    try:
        make = OPS_OF_BACKEND[backend]
    except KeyError:
        raise SettingsError([f"backend {backend!r} is not available (have: {', '.join(OPS_OF_BACKEND)})"]) from None
    return make(compute_dtype)


__all__ = ["OPS_OF_BACKEND", "NumpyOps", "get_ops", "resolve_backend"]
