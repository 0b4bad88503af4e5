"""The cuBLAS binding the GPU backend's matrix products go through (`Cublas`); cupy is passed in."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

# cuBLAS enums (cublas_api.h, library_types.h).
_CUBLAS_OP_N, _CUBLAS_OP_T = 0, 1
_CUDA_TYPES = {"float32": 0, "float16": 2, "bfloat16": 14}  # CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF
_CUBLAS_COMPUTE_32F = 68  # float32 accumulation, no TF32 (what cupy.matmul does by default)
_CUBLAS_GEMM_DEFAULT = -1
CUBLAS_WORKSPACE_BYTES = 32 << 20


@functools.cache
def _cuda_type_of(dtype: np.dtype) -> int:
    return _CUDA_TYPES[dtype.name]


class Cublas:
    """cublasGemmEx called through ctypes on a handle of our own.

    CuPy refuses cuBLAS calls while a stream is being captured (cupy/cupy#6290), yet cuBLAS itself
    supports capture; and `cupy.matmul` spends tens of microseconds in Python per call, which is most
    of a small model's decode step. A fixed workspace keeps cuBLAS from allocating inside a capture."""

    def __init__(self, cp: Any):
        import ctypes

        import cupy_backends.cuda.libs.cublas  # noqa: F401 - loads the library CuPy itself uses
        from cuda import pathfinder

        self.ctypes = ctypes
        loaded = pathfinder.load_nvidia_dynamic_lib("cublas")
        # The handle pathfinder holds is the library CuPy uses; dlopen by path (or soname) reuses it.
        self.lib = ctypes.CDLL(loaded.abs_path or "libcublas.so.13")
        handle = ctypes.c_void_p()
        self._check(self.lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
        self.handle = handle
        self.workspace = cp.empty(CUBLAS_WORKSPACE_BYTES, dtype=cp.uint8)
        self._check(
            self.lib.cublasSetWorkspace_v2(
                handle, ctypes.c_void_p(self.workspace.data.ptr), ctypes.c_size_t(CUBLAS_WORKSPACE_BYTES)
            ),
            "cublasSetWorkspace",
        )
        self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.one_ref, self.zero_ref = ctypes.byref(self.one), ctypes.byref(self.zero)
        self.gemm_ex = self.lib.cublasGemmEx
        self.gemm_ex.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 5 + [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
            ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
            ctypes.c_int, ctypes.c_int,
        ]  # fmt: skip
        self.stream = None

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed with cuBLAS status {status}")

    def linear(self, cp: Any, x: Any, w: Any, out_dtype: Any = None) -> Any:
        """x [T, in] (rows may be strided) @ w^T for w [out, in] (C order) -> [T, out] in `out_dtype` (None:
        x's dtype), accumulated in float32 either way (float32 out of f16 / bf16 inputs is one of
        cublasGemmEx's own type combinations: no rounding to the input dtype on the way).
        Column-major, that is C [out, T] = W^T' X': transa = T over w's rows, transb = N over x's."""
        n_tok, n_in = x.shape
        n_out = w.shape[0]
        out = cp.empty((n_tok, n_out), dtype=out_dtype or x.dtype)
        stream = cp.cuda.get_current_stream().ptr
        if stream != self.stream:
            self._check(
                self.lib.cublasSetStream_v2(self.handle, self.ctypes.c_void_p(stream)), "cublasSetStream"
            )
            self.stream = stream
        dt, out_dt = _cuda_type_of(x.dtype), _cuda_type_of(out.dtype)
        status = self.gemm_ex(
            self.handle, _CUBLAS_OP_T, _CUBLAS_OP_N, n_out, n_tok, n_in, self.one_ref,
            w.data.ptr, dt, n_in, x.data.ptr, dt, x.strides[0] // x.itemsize, self.zero_ref,
            out.data.ptr, out_dt, n_out, _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT,
        )  # fmt: skip
        self._check(status, "cublasGemmEx")
        return out
