"""Decode steps replayed as CUDA graphs: the cupy backend's answer to launch overhead.

A decode step of a small model is ~12 kernels per layer, each a few microseconds of GPU work behind
tens of microseconds of Python and CuPy dispatch; op by op, the GPU waits on the interpreter. So the
first decode step of a runner is captured once into a CUDA graph (`cupy.cuda.Stream.begin_capture`),
and every later step is one graph launch plus two small copies.

What makes one graph serve every position: nothing in the captured step depends on a host value.
The token id, the position and the RoPE rows live in one device buffer (`_StepInputs`) written by a
single host-to-device copy before each launch; the K/V store and the attention kernels read the
position there (`dyn`), attending from slot 0 of a full layer's pool, or from the window's start in a
ring, with key splits sized for the most keys a step can see. Buffers the step allocates come from a
memory pool private to the graph and kept for its life, so their addresses stay valid.

Eligible (`make_decode_graph`): the cupy backend, f16/bf16 compute, a device pool placement, a float
K/V type. Anything else (f32, int8 K/V, the host pool behind a resident ring) decodes op by op.
A graph's logits equal the op-by-op step's up to the order the key splits are merged
(tests/engine/test_gpu_model.py checks greedy identity and the logits).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import EngineError
from .kv.device import DevicePoolPlacement
from .kv.placement import PoolPlacement
from .models import Model
from .ops.cupy_ops import FLASH_HEAD_DIMS
from .ops.numpy_ops import rope_angles


class GraphCaptureFailed(EngineError):
    """The decode step could not be captured; the runner then decodes op by op (and says so once)."""


class _StepKV:
    """The K/V access of a captured step: store at, and attend up to, the position on the device."""

    def __init__(self, placement: DevicePoolPlacement, position: Any):
        self.pool = placement.pool
        self.ops = placement.ops
        self.position = position  # device int32 [1]

    def attend(
        self, layer: int, pos0: int, q: Any | None, k_new: Any, v_new: Any, *, q_pos0: int, window: int | None,
        scale: float,
    ) -> Any | None:  # fmt: skip
        views = self.pool.layer(layer)
        g = self.pool.geometry.layers[layer]
        ring = g.capacity if g.is_ring else 0
        self.ops.store_kv(k_new, v_new, views.k, views.v, 0, ring_capacity=ring, dyn=self.position)
        if q is None:
            return None
        return self.ops.flash_attention(
            q, views.k, views.v, q_pos0=0, k_pos0=0, window=window, scale=scale, ring_capacity=ring,
            dyn=self.position,
        )  # fmt: skip


class _StepInputs:
    """Token id, position and RoPE rows of one step, as int32 words: one pinned host buffer, one
    device buffer, one copy between them per step."""

    def __init__(self, model: Model):
        import cupy as cp
        import cupyx

        c = model.config
        self.bases = sorted({lc.rope_base for lc in c.layers})
        self.half = c.rope_dim // 2
        n_words = 2 + 2 * self.half * len(self.bases)
        self.host = cupyx.empty_pinned((n_words,), dtype=np.int32)
        self.device = cp.zeros(n_words, dtype=cp.int32)
        self.token = self.device[0:1]
        self.position = self.device[1:2]
        rows = self.device[2:].view(cp.float32).reshape(len(self.bases), 2, 1, self.half)
        self.tables = {base: (rows[i, 0], rows[i, 1]) for i, base in enumerate(self.bases)}
        self._host_rows = self.host[2:].view(np.float32).reshape(len(self.bases), 2, self.half)

    def stage(self, token: int, pos: int, rope_dim: int, stream: Any) -> None:
        self.host[0], self.host[1] = token, pos
        for i, base in enumerate(self.bases):  # the values `rope_tables` gives: float64 angles, rounded once
            angles = rope_angles(pos, 1, base, rope_dim)[0]
            self._host_rows[i, 0], self._host_rows[i, 1] = np.cos(angles), np.sin(angles)
        self.device.set(self.host, stream=stream)


class DecodeGraph:
    """One decode step of `model` over `placement`'s pool, captured on first use and replayed."""

    def __init__(self, model: Model, placement: DevicePoolPlacement):
        import cupy as cp

        self.model = model
        self.ops = model.ops
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.memory = cp.cuda.MemoryPool()  # the step's buffers: their addresses are in the graph
        self.inputs = _StepInputs(model)
        self.kv = _StepKV(placement, self.inputs.position)
        self.graph: Any = None
        self.logits: Any = None
        self.launches = 0

    def step(self, token: int, pos: int) -> np.ndarray:
        """Logits [V] (float32, host) of `token` at position `pos`; its K/V are stored in the pool."""
        cp = self.ops.xp
        self.inputs.stage(token, pos, self.model.config.rope_dim, self.stream)
        cp.cuda.Stream.null.synchronize()  # work queued on the default stream (prefill, restores) is done
        if self.graph is None:
            self._capture()
        self.graph.launch(self.stream)
        self.launches += 1
        out = self.logits.get(stream=self.stream)  # waits for the step
        return out[0]

    def _run(self) -> Any:
        """The step itself: what the graph holds."""
        h = self.model.hidden(self.inputs.token, 0, self.inputs.tables, self.kv, want_logits=True)
        return self.ops.matmul(h, self.model.output).astype(self.ops.xp.float32)  # [1, V]

    def _capture(self) -> None:
        try:
            self._capture_once()
        except Exception as e:  # noqa: BLE001 - any CUDA or CuPy refusal means: no graph here
            raise GraphCaptureFailed(f"decode step capture failed: {type(e).__name__}: {e}") from e

    def _capture_once(self) -> None:
        cp = self.ops.xp
        with cp.cuda.using_allocator(self.memory.malloc), self.stream:
            # A first run on the stream compiles the kernels, creates cuBLAS's state for this stream
            # and fills the private pool, so the capture allocates nothing new. It computes the very
            # step about to be replayed (the same K/V into the same slots), so it changes nothing.
            self._run()
            self.stream.synchronize()
            self.stream.begin_capture()
            try:
                self.logits = self._run()
            finally:
                graph = self.stream.end_capture()
        graph.upload(self.stream)
        self.graph = graph


def make_decode_graph(model: Model, placement: PoolPlacement, enabled: bool) -> DecodeGraph | None:
    """A `DecodeGraph` where the step can be captured (see the module docstring), else None."""
    ops = model.ops
    if not enabled or ops.name != "cupy" or ops.dtype == np.float32:
        return None
    if not isinstance(placement, DevicePoolPlacement) or placement.pool.geometry.kv_type.has_scales:
        return None
    if model.config.head_dim not in FLASH_HEAD_DIMS:
        return None
    return DecodeGraph(model, placement)
