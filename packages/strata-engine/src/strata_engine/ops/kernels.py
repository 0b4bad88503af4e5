"""Loading the GPU kernels: CuPy's element-wise kernels (`ElementwiseKernels`) and the hand-written ones of
kernels.cu (`RawKernels`: NVRTC through cupy.RawModule, one compiled instance per template signature,
cached on disk by CuPy), with the kernels' C type of each dtype. cupy is passed in, never imported here."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .numpy_ops import GELU_C

_ROPE_BODY = r"""
const int d = i % dim;
const int t = i / (dim * heads);
float out;
if (d >= 2 * half) {
    out = (float)x[i];
} else if (neox) {
    const int j = d < half ? d : d - half;
    const float c = cos_t[t * half + j];
    const float s = sin_t[t * half + j];
    if (d < half) {
        out = (float)x[i] * c - (float)x[i + half] * s;
    } else {
        out = (float)x[i] * c + (float)x[i - half] * s;
    }
} else {
    const int j = d >> 1;
    const float c = cos_t[t * half + j];
    const float s = sin_t[t * half + j];
    if ((d & 1) == 0) {
        out = (float)x[i] * c - (float)x[i + 1] * s;
    } else {
        out = (float)x[i] * c + (float)x[i - 1] * s;
    }
}
y = (T)out;
"""


class ElementwiseKernels:
    """The element-wise CuPy kernels (compiled on first use by CuPy's kernel cache); the row kernels
    (norms, RoPE on a fused projection, attention, K/V store) are in kernels.cu (`RawKernels`)."""

    def __init__(self, cp: Any):
        self.silu_mul = cp.ElementwiseKernel(
            "T g, T u",
            "T y",
            "const float gf = (float)g; y = (T)(gf / (1.0f + expf(-gf)) * (float)u)",
            "strata_silu_mul",
        )
        # rows [pos, pos + n) of a flat [rows, width] table, pos read on the device (a captured step)
        self.rows_at = cp.ElementwiseKernel(
            "raw int32 pos, raw T table, int32 width",
            "T out",
            "out = table[pos[0] * width + i]",
            "strata_rows_at",
        )
        self.gelu_tanh_mul = cp.ElementwiseKernel(
            "T g, T u",
            "T y",
            f"const float gf = (float)g;"
            f"y = (T)(0.5f * gf * (1.0f + tanhf({GELU_C!r}f * (gf + 0.044715f * gf * gf * gf))) * (float)u)",
            "strata_gelu_tanh_mul",
        )
        self.rope = cp.ElementwiseKernel(
            "raw T x, raw float32 cos_t, raw float32 sin_t, int32 heads, int32 dim, int32 half, bool neox",
            "T y",
            _ROPE_BODY,
            "strata_rope",
        )
        self.dequant_int8 = cp.ElementwiseKernel(
            "raw int8 q, raw float32 scale, int32 block",
            "T y",
            "y = (T)((float)q[i] * scale[i / block])",
            "strata_dequant_int8",
        )


_C_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}


class RawKernels:
    """strata_* kernels of kernels.cu, one compiled instance per template signature (NVRTC through
    cupy.RawModule; CuPy caches the binaries on disk)."""

    def __init__(self, cp: Any):
        from importlib.resources import files

        self.cp = cp
        self.source = (files(__package__) / "kernels.cu").read_text()
        self._cache: dict[tuple[str, tuple[object, ...]], Any] = {}  # (name, template args) -> kernel
        self._smem_opt_in: dict[int, int] = {}
        self.n_sm = cp.cuda.Device().attributes["MultiProcessorCount"]

    def allow_shared_memory(self, kernel: Any, nbytes: int) -> None:
        """Opt a kernel in to more than 48 KiB of dynamic shared memory (once per kernel and size)."""
        if nbytes > 48 << 10 and self._smem_opt_in.get(id(kernel), 0) < nbytes:
            kernel.max_dynamic_shared_size_bytes = nbytes
            self._smem_opt_in[id(kernel)] = nbytes

    def get(self, name: str, *template_args: object) -> Any:
        key = (name, template_args)  # looked up per launch: no string formatting on a hit
        kernel = self._cache.get(key)
        if kernel is None:
            expr = f"{name}<{', '.join(str(a) for a in template_args)}>"
            module = self.cp.RawModule(code=self.source, options=("--std=c++17",), name_expressions=[expr])
            kernel = self._cache[key] = module.get_function(expr)
        return kernel


@functools.cache
def _c_type_of(dtype: np.dtype) -> str:
    return _C_TYPES[dtype.name]


def c_type(dtype: Any) -> str:
    """The kernels' C type of a dtype (called per launch: cached per dtype object)."""
    return _c_type_of(dtype if isinstance(dtype, np.dtype) else np.dtype(dtype))
