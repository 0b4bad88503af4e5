"""The engine's numeric operations behind one interface, `get_ops(backend, compute_dtype)`.

`Ops` (base.py) is the interface; `NumpyOps` (numpy_ops.py) is the reference and `CupyOps`
(cupy_ops.py) its GPU twin. Models and the K/V code receive an `Ops` and never call an array library for
heavy work.
"auto" resolves to "cupy" when CuPy sees a CUDA device, else "numpy" (`resolve_backend`).
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import SettingsError
from ..settings import Backend
from .base import Ops
from .numpy_ops import NumpyOps


def _cupy_ops(compute_dtype: str) -> Ops:
    from .cupy_ops import CupyOps  # imports cupy only when the GPU backend is asked for

    return CupyOps(compute_dtype)


# A backend (settings.Backend, "auto" resolved) -> the ops class (or factory) computing on it.
OPS_OF_BACKEND: dict[str, Callable[[str], Ops]] = {Backend.NUMPY: NumpyOps, Backend.CUPY: _cupy_ops}


def resolve_backend(backend: str) -> str:
    """ "auto" -> "cupy" where a CUDA device is usable, else "numpy"; other names unchanged."""
    if backend != Backend.AUTO:
        return backend
    from .cupy_ops import cuda_available

    return Backend.CUPY.value if cuda_available() else Backend.NUMPY.value


def get_ops(backend: str = Backend.NUMPY, compute_dtype: str = "f32") -> Ops:
    backend = resolve_backend(backend)
    try:
        make = OPS_OF_BACKEND[backend]
    except KeyError:
        raise SettingsError([f"backend {backend!r} is not available (have: {', '.join(OPS_OF_BACKEND)})"]) from None
    return make(compute_dtype)


__all__ = ["OPS_OF_BACKEND", "NumpyOps", "Ops", "get_ops", "resolve_backend"]
