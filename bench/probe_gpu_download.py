"""A decode step's logits row (gemma3's 262,144 floats) from the device to the host, three ways: into one reused
pinned buffer and copied out (what StepGraph.step did), into an array of CuPy's pinned memory pool (what it
does), into the reused buffer without a copy (the floor). bench/GPU-NOTES.md, v21.

    python3 bench/probe_gpu_download.py
"""

import time

import cupy as cp
import cupyx
import numpy as np

n = 262144
d = cp.random.standard_normal(n, dtype=cp.float32)
s = cp.cuda.Stream(non_blocking=True)
buf = cupyx.empty_pinned((n,), dtype=np.float32)


def reuse():
    cp.cuda.runtime.memcpyAsync(buf.ctypes.data, d.data.ptr, d.nbytes, 2, s.ptr)
    s.synchronize()
    return buf.copy()


def pooled():
    out = cupyx.empty_pinned((n,), dtype=np.float32)
    cp.cuda.runtime.memcpyAsync(out.ctypes.data, d.data.ptr, d.nbytes, 2, s.ptr)
    s.synchronize()
    return out


def nocopy():
    cp.cuda.runtime.memcpyAsync(buf.ctypes.data, d.data.ptr, d.nbytes, 2, s.ptr)
    s.synchronize()
    return buf


for name, f in (
    ("reused pinned + copy", reuse),
    ("pinned pool", pooled),
    ("reused pinned, no copy", nocopy),
) * 2:
    for _ in range(20):
        f()
    t = time.perf_counter()
    for _ in range(500):
        f()
    print(f"{name:24s} {(time.perf_counter() - t) / 500 * 1e6:7.1f} us per 1 MiB row")
