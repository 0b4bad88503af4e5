"""The engine's numeric operations behind one interface, `get_ops(backend, compute_dtype)`.

`NumpyOps` (numpy_ops.py) is the reference; the GPU issue adds a CuPy twin with the same methods.
Models and the K/V code receive an ops object and never call an array library for heavy work.
"""

from __future__ import annotations

from ..errors import SettingsError
from .numpy_ops import NumpyOps

BACKENDS = {"numpy": NumpyOps}


def get_ops(backend: str = "numpy", compute_dtype: str = "f32") -> NumpyOps:
    try:
        cls = BACKENDS[backend]
    except KeyError:
        raise SettingsError([f"backend {backend!r} is not available (have: {', '.join(BACKENDS)})"]) from None
    return cls(compute_dtype)


__all__ = ["BACKENDS", "NumpyOps", "get_ops"]
