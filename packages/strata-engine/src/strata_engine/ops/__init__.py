"""The engine's numeric operations behind one interface, `get_ops(backend, compute_dtype)`.

`NumpyOps` (numpy_ops.py) is the reference; `CupyOps` (cupy_ops.py) is its GPU twin with the same
methods. Models and the K/V code receive an ops object and never call an array library for heavy work.
"auto" resolves to "cupy" when CuPy sees a CUDA device, else "numpy" (`resolve_backend`).
"""

from __future__ import annotations

from ..errors import SettingsError
from .numpy_ops import NumpyOps


def _cupy_ops(compute_dtype: str) -> NumpyOps:
    from .cupy_ops import CupyOps  # imports cupy only when the GPU backend is asked for

    return CupyOps(compute_dtype)


BACKENDS = {"numpy": NumpyOps, "cupy": _cupy_ops}


def resolve_backend(backend: str) -> str:
    """ "auto" -> "cupy" where a CUDA device is usable, else "numpy"; other names unchanged."""
    if backend != "auto":
        return backend
    from .cupy_ops import cuda_available

    return "cupy" if cuda_available() else "numpy"


def get_ops(backend: str = "numpy", compute_dtype: str = "f32") -> NumpyOps:
    backend = resolve_backend(backend)
    try:
        cls = BACKENDS[backend]
    except KeyError:
        raise SettingsError([f"backend {backend!r} is not available (have: {', '.join(BACKENDS)})"]) from None
    return cls(compute_dtype)


__all__ = ["BACKENDS", "NumpyOps", "get_ops", "resolve_backend"]
