"""Decode steps and prefill steps (padded to a few fixed sizes) replayed as CUDA graphs: the cupy
backend's answer to launch overhead.

A step of a small model is ~12 kernels per layer, each a few microseconds of GPU work (a decode step)
or tens (a 4,096-token chunk of smollm2) behind tens of microseconds of Python and CuPy dispatch; op by
op, the GPU waits on the interpreter. So each slot's decode step, and prefill steps of
32, 64, ... tokens up to a full chunk (`prefill_graph_sizes`), are captured once each into a CUDA graph
(`cupy.cuda.Stream.begin_capture`) when the slots are built (`loaded.LoadedModel.prepare`: start-up, on
placeholder tokens; the loaded model holds them); a prefill chunk then replays the smallest graph that
holds it, padded, and each step is one graph launch plus one small copy.

What makes one graph serve every position: nothing in the captured step depends on a host value.
The position (and the last real token's position and row), and the token ids live in one device
buffer (`_StepInputs`) written by a single host-to-device copy before each launch; the RoPE rows are gathered on the device
from the backend's tables at that position; the K/V store and the attention kernels read the position
there (`dyn`), attending from slot 0 of a full layer's pool, or from the window's start in a ring,
with key splits sized for the most keys a step can see. Buffers the step allocates come from a memory
pool private to the graph and kept for its life, so their addresses stay valid.

Several slots decoding together (`slots.SlotSet.decode`) replay a `BatchDecodeGraph` of the smallest
batch-size bucket holding the step (2, 4, 8, ... n_slots: `batch_graph_sizes`), captured at start-up: each
row's slot, position and token live in one device buffer (`_BatchInputs`); per layer one kernel stores every
row's K/V into its slot's region of the layer's arena (the slots' pools lie at one stride) and one attends
every row over its own slot (`_BatchRows`); rows padding a step to its bucket store nothing.

Eligible (`make_step_graph`): the cupy backend, f16/bf16 compute, a device pool placement, a float
K/V type; prefill steps only for models without sliding-window rings (see `make_step_graph`). Padded
rows store their K/V past the conversation's end, in slots the next tokens overwrite before any query
can see them (causal attention), and their results are never read.
Anything else runs op by op. A graph's logits equal the op-by-op step's up to the order the key splits are merged
(tests/engine/test_gpu_model.py checks greedy identity and the logits).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from .errors import GraphCaptureFailed
from .kv.device import DevicePoolPlacement
from .kv.placement import PoolPlacement
from .models import Model
from .models.common import Rows
from .ops.attention_tiling import FLASH_HEAD_DIMS
from .sampling import Argmax

if TYPE_CHECKING:
    from .ops.cupy_ops import CupyOps

# Padding of a step shorter than its graph: any valid id (its K/V land past the conversation's end, in
# slots the next tokens overwrite before anything attends to them; its rows' results are never read).
PAD_TOKEN = 0
# Prefill graph sizes: powers of two from this up to the prefill chunk (and the chunk itself).
MIN_PREFILL_GRAPH = 32


def say_op_by_op(error: GraphCaptureFailed) -> None:
    """Said once when a graph is dropped: its steps run op by op from now on."""
    print(f"strata-engine: {error}; running such steps op by op", file=sys.stderr, flush=True)


class _StepKV:
    """The K/V access of a captured step: store at, and attend up to, the positions on the device."""

    def __init__(self, placement: DevicePoolPlacement, position: Any, last_position: Any):
        self.pool = placement.pool
        self.ops = cast("CupyOps", placement.ops)  # graphs are captured on the GPU only
        self.position = position  # device int32 [1]: the step's first token
        self.last_position = last_position  # device int32 [1]: its last (the logits' row)

    def attend(
        self, layer: int, pos0: int, q: Any | None, k_new: Any, v_new: Any, *, q_pos0: int, window: int | None,
        scale: float,
        softcap: float,
    ) -> Any | None:  # fmt: skip
        views = self.pool.layer(layer)
        g = self.pool.geometry.layers[layer]
        ring = g.capacity if g.is_ring else 0
        self.ops.store_kv(k_new, v_new, views.k, views.v, 0, ring_capacity=ring, dyn=self.position)
        if q is None:
            return None
        # Every query row of the step, or the last one alone (the last layer keeps only the logits' row).
        assert q.shape[0] in (k_new.shape[0], 1)
        dyn = self.position if q.shape[0] == k_new.shape[0] else self.last_position
        return self.ops.flash_attention(
            q, views.k, views.v, q_pos0=0, k_pos0=0, window=window, scale=scale, softcap=softcap, ring_capacity=ring, dyn=dyn,
        )  # fmt: skip


class _StepInputs:
    """Position, last token's position, last token's row and the token ids (padded) of one step as int32
    words: one pinned host buffer, one device buffer, one copy between them per step."""

    def __init__(self, n_tokens: int):
        import cupy as cp
        import cupyx

        self.host = cupyx.empty_pinned((3 + n_tokens,), dtype=np.int32)
        self.device = cp.zeros(3 + n_tokens, dtype=cp.int32)
        self.position, self.last_position, self.last_row = (
            self.device[0:1],
            self.device[1:2],
            self.device[2:3],
        )
        self.tokens = self.device[3:]

    def stage(self, tokens: Sequence[int], pos: int, stream: Any) -> None:
        n = len(tokens)
        self.host[0], self.host[1], self.host[2] = pos, pos + n - 1, n - 1
        self.host[3 : 3 + n] = tokens
        self.host[3 + n :] = PAD_TOKEN
        self.device.set(self.host, stream=stream)


class _CapturedStep:
    """What a captured step holds: its stream, its private memory pool, the graph and its logits buffer; the
    capture itself (`_capture`) of what `_run` launches."""

    def __init__(self, model: Model, placement: DevicePoolPlacement, n_tokens: int):
        import cupy as cp

        self.model = model
        self.ops = cast("CupyOps", model.ops)  # graphs are captured on the GPU only
        self.n_tokens = n_tokens
        self.n_ctx = placement.pool.geometry.n_ctx
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.memory = cp.cuda.MemoryPool()  # the step's buffers: their addresses are in the graph
        self.graph: Any = None
        self.logits: Any = None
        self.best: Any = None  # each logits row's argmax and its value, computed in the graph (`argmax_rows`)
        self._host_best: Any = None  # pinned: where `best` is downloaded
        self._host_logits: Any = (
            None  # pinned [rows, V], made on first use: where rows of logits are downloaded
        )
        self.tables: dict[float, tuple[Any, Any]] = {}
        self.launches = 0

    def _what(self) -> str:
        raise NotImplementedError

    def _run(self) -> Any:
        raise NotImplementedError

    def _run_step(self) -> tuple[Any, Any]:
        logits = self._run()
        return logits, self.ops.argmax_rows(logits)

    def _download(self, rows: int, logits_rows: Sequence[int]) -> tuple[list[Argmax], Any]:
        """After a launch: the first `rows` rows' argmax, and the rows `logits_rows` of the logits into the
        pinned buffer (valid until the next launch), each one copy on the step's stream; waits for them."""
        import cupyx

        cp = self.ops.xp
        to_host, stream = cp.cuda.runtime.memcpyDeviceToHost, self.stream.ptr
        if self._host_best is None:
            self._host_best = cupyx.empty_pinned(self.best.shape, dtype=np.int32)
        cp.cuda.runtime.memcpyAsync(
            self._host_best.ctypes.data, self.best.data.ptr, self.best.nbytes, to_host, stream
        )
        if logits_rows and self._host_logits is None:
            self._host_logits = cupyx.empty_pinned(self.logits.shape, dtype=np.float32)
        row_bytes = self.logits.shape[1] * 4
        for i in logits_rows:
            cp.cuda.runtime.memcpyAsync(self._host_logits[i].ctypes.data, self.logits.data.ptr + i * row_bytes,
                                        row_bytes, to_host, stream)  # fmt: skip
        self.stream.synchronize()
        return Argmax.of_words(self._host_best, rows), self._host_logits

    def _download_row(self, row: int) -> np.ndarray:
        """After a launch: row `row` of the logits, downloaded into an array of CuPy's pinned memory pool (a
        pageable download is staged by the driver, and a copy out of one reused pinned buffer costs a pass
        over the row: ~0.12 ms for gemma3's 1 MiB, bench/gpu/DECISIONS.md "Logits downloaded"), the caller's to keep; waits for it."""
        import cupyx

        cp = self.ops.xp
        out = cupyx.empty_pinned((self.logits.shape[1],), dtype=np.float32)
        cp.cuda.runtime.memcpyAsync(out.ctypes.data, self.logits.data.ptr + row * out.nbytes, out.nbytes,
                                    cp.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)  # fmt: skip
        self.stream.synchronize()
        return out

    def _capture(self) -> None:
        try:
            self._capture_once()
        except Exception as e:  # noqa: BLE001 - any CUDA or CuPy refusal means: no graph here
            raise GraphCaptureFailed(f"{self._what()} capture failed: {type(e).__name__}: {e}") from e

    def _capture_once(self) -> None:
        cp, c = self.ops.xp, self.model.config
        # The backend's RoPE tables over the whole context, made (on the default allocator) before the
        # capture: the step gathers its rows from them, so they must outlive the graph unchanged.
        self.tables = {base: self.ops.rope_tables(0, self.n_ctx, base, c.rope_dim, c.rope_factors, c.rope_scale)
                       for base in sorted({lc.rope_base for lc in c.layers})}  # fmt: skip
        with cp.cuda.using_allocator(self.memory.malloc), self.stream:
            # A first run on the stream compiles the kernels, creates cuBLAS's state for this stream
            # and fills the private pool, so the capture allocates nothing new. It computes the very
            # step about to be replayed (the same K/V into the same slots), so it changes nothing.
            self._run_step()
            self.stream.synchronize()
            self.stream.begin_capture()
            try:
                self.logits, self.best = self._run_step()
            finally:
                graph = self.stream.end_capture()
        assert self.logits.dtype == np.float32 and self.logits.flags.c_contiguous
        graph.upload(self.stream)
        self.graph = graph


class StepGraph(_CapturedStep):
    """A step of up to `n_tokens` tokens of `model` over `placement`'s pool, captured once (`prepare`, at
    start-up; else on first use) and replayed."""

    def __init__(self, model: Model, placement: DevicePoolPlacement, n_tokens: int):
        super().__init__(model, placement, n_tokens)
        self.inputs = _StepInputs(n_tokens)
        self.kv = _StepKV(placement, self.inputs.position, self.inputs.last_position)

    def _what(self) -> str:
        return "decode step" if self.n_tokens == 1 else f"{self.n_tokens}-token prefill chunk"

    def step(self, tokens: Sequence[int], pos: int, want_logits: bool = True,
             argmax_only: bool = False) -> np.ndarray | Argmax | None:  # fmt: skip
        """Logits [V] (float32, host) of the last of `tokens` at positions pos..; their K/V are stored.
        `argmax_only`: their argmax alone (computed in the graph; the logits stay on the device).
        Fewer tokens than the graph's size are padded (`PAD_TOKEN`); the caller keeps pos + n_tokens
        within the pool."""
        self.launch(tokens, pos)
        if not want_logits:
            self.stream.synchronize()  # later work on the default stream reads what the step stored
            return None
        if argmax_only:
            return self.argmax()
        return self._download_row(0)  # waits for the step

    def launch(self, tokens: Sequence[int], pos: int) -> None:
        """Start the step on the device and return at once (`argmax` or `step`'s downloads wait for it)."""
        assert 0 < len(tokens) <= self.n_tokens
        cp = self.ops.xp
        self.inputs.stage(tokens, pos, self.stream)
        cp.cuda.Stream.null.synchronize()  # work queued on the default stream (prefill, restores) is done
        if self.graph is None:
            self._capture()
        self.graph.launch(self.stream)
        self.launches += 1

    def argmax(self) -> Argmax:
        """After `launch`: the last token's logits' argmax (computed in the graph); waits for the step."""
        return self._download(1, ())[0][0]

    def prepare(self) -> None:
        """Capture now, on placeholder tokens at position 0 (start-up, not the first request): the capture's
        warm-up run stores their K/V, so the caller appends them to the pool's positions [0, n) and drops
        them afterwards. Raises GraphCaptureFailed."""
        if self.graph is None:
            self.inputs.stage([0] * self.n_tokens, 0, self.stream)
            self.ops.xp.cuda.Stream.null.synchronize()
            self._capture()
            self.stream.synchronize()

    def _run(self) -> Any:
        """The step itself: what the graph holds."""
        ops, n = self.ops, self.n_tokens
        tables = {}
        for base, (cos, sin) in self.tables.items():
            tables[base] = tuple(
                ops.kernels.rows_at(self.inputs.position, t.ravel(), np.int32(t.shape[1]),
                                    ops.xp.empty((n, t.shape[1]), dtype=t.dtype))
                for t in (cos, sin)
            )  # fmt: skip
        # A step padded past its last token names that row on the device; a decode step's only row is it.
        last_row = self.inputs.last_row if n > 1 else None
        rows = Rows.chunk(self.kv, 0, n)  # the position is on the device (`_StepKV`), not this 0
        h = self.model.hidden(self.inputs.tokens, rows, tables, want_logits=True, last_row=last_row)
        return ops.logits_f32(h, self.model.output, self.model.config.final_softcap)  # [1, V]


class _BatchInputs:
    """A batched decode step's rows as int32 words [n_real, position[B], slot[B], token[B]] (padded): one
    pinned host buffer, one device buffer, one copy between them per step. `rows` (the first 1 + 2B words)
    is what the K/V store and attention kernels read."""

    def __init__(self, n_rows: int):
        import cupy as cp
        import cupyx

        self.n_rows = n_rows
        self.host = cupyx.empty_pinned((1 + 3 * n_rows,), dtype=np.int32)
        self.device = cp.zeros(1 + 3 * n_rows, dtype=cp.int32)
        self.rows = self.device[: 1 + 2 * n_rows]
        self.positions = self.device[1 : 1 + n_rows]
        self.tokens = self.device[1 + 2 * n_rows :]

    def stage(self, steps: Sequence[tuple[int, int, int]], stream: Any, stores: bool = True) -> None:
        """steps: (slot, position, token) per real row (`stores` False: none of them stores its K/V). Padding
        rows repeat the first row's slot and position (attention reads valid keys there; they store nothing)
        with `PAD_TOKEN`."""
        n, b = len(steps), self.n_rows
        slot0, pos0, _ = steps[0]
        self.host[0] = n if stores else 0
        self.host[1 : 1 + b] = pos0
        self.host[1 + b : 1 + 2 * b] = slot0
        self.host[1 + 2 * b :] = PAD_TOKEN
        for i, (slot, pos, token) in enumerate(steps):
            self.host[1 + i], self.host[1 + b + i], self.host[1 + 2 * b + i] = pos, slot, token
        self.device.set(self.host, stream=stream)


class _BatchRows:
    """The `Rows` of a captured batched decode step: row b is one token of slot rows[1 + B + b] at position
    rows[1 + b] (read on the device), stored into and attended over that slot's region of each layer's
    arena by one launch per layer for all rows (`store_kv_rows`, `flash_attention_rows`)."""

    def __init__(self, placement: DevicePoolPlacement, inputs: _BatchInputs):
        pool = placement.pool
        self.n_rows = inputs.n_rows
        self.rows = inputs.rows
        self.layers = [(*pool.arena_layer(i)[:2], g.capacity if g.is_ring else 0)
                       for i, g in enumerate(pool.geometry.layers)]  # fmt: skip

    def attend(
        self, ops: Any, layer: int, q: Any | None, k: Any, v: Any, *, window: int | None, scale: float,
        softcap: float, last_only: bool = False,
    ) -> Any | None:  # fmt: skip
        k_arena, v_arena, ring = self.layers[layer]
        ops.store_kv_rows(k, v, k_arena, v_arena, self.rows, ring_capacity=ring)
        if q is None:
            return None
        return ops.flash_attention_rows(q, k_arena, v_arena, self.rows, window=window, scale=scale, softcap=softcap,
                                        ring_capacity=ring)  # fmt: skip

    def last_of_each(self, ops: Any, a: Any, row: Any | None = None) -> Any:
        return a  # every row is its slot's last


class BatchDecodeGraph(_CapturedStep):
    """A decode step of `n_rows` slots together (`SlotSet.decode`), captured once (`prepare`: start-up) and
    replayed with the slots, positions and tokens in one device buffer (`_BatchInputs`); a step of fewer
    slots is padded with rows that store nothing and whose logits are dropped. One graph per batch-size
    bucket (`batch_graph_sizes`)."""

    def __init__(self, model: Model, placement: DevicePoolPlacement, n_rows: int):
        super().__init__(model, placement, n_rows)
        self.batch_inputs = _BatchInputs(n_rows)
        self.rows = _BatchRows(placement, self.batch_inputs)

    def _what(self) -> str:
        return f"{self.n_tokens}-slot decode step"

    def decode_rows(
        self, steps: Sequence[tuple[int, int, int]], argmax_only: Sequence[bool]
    ) -> list[Argmax | np.ndarray]:
        """One step of steps = [(arena slot, position, token), ...] (distinct slots, at most n_rows; each
        token's K/V stored in its slot at its position): row b's result is its logits' `Argmax` (computed in
        the graph) where argmax_only[b], else its logits [V], a view of a pinned buffer valid until this
        graph's next step. Only those rows of logits are downloaded."""
        self.launch(steps)
        logits_rows = [b for b, only in enumerate(argmax_only) if not only]
        best, host_logits = self._download(len(steps), logits_rows)  # waits for the step
        return [best[b] if only else host_logits[b] for b, only in enumerate(argmax_only)]

    def argmax(self, n_rows: int) -> list[Argmax]:
        """After `launch`: the first n_rows rows' argmax (computed in the graph); waits for the step."""
        return self._download(n_rows, ())[0]

    def launch(self, steps: Sequence[tuple[int, int, int]]) -> None:
        """Start the step of `decode_rows` on the device and return at once (`argmax` waits for it)."""
        assert 0 < len(steps) <= self.n_tokens
        self.batch_inputs.stage(steps, self.stream)
        self.ops.xp.cuda.Stream.null.synchronize()  # work queued on the default stream (prefill, restores) is done
        if self.graph is None:
            self._capture()
        self.graph.launch(self.stream)
        self.launches += 1

    def prepare(self) -> None:
        """Capture now, on rows that store nothing (n_real 0): the pool is not touched. Raises GraphCaptureFailed."""
        if self.graph is None:
            self.batch_inputs.stage([(0, 0, PAD_TOKEN)], self.stream, stores=False)
            self.ops.xp.cuda.Stream.null.synchronize()
            self._capture()
            self.stream.synchronize()

    def _run(self) -> Any:
        ops, positions = self.ops, self.batch_inputs.positions
        tables = {base: tuple(ops.xp.take(t, positions, axis=0) for t in (cos, sin))
                  for base, (cos, sin) in self.tables.items()}  # fmt: skip
        h = self.model.hidden(self.batch_inputs.tokens, self.rows, tables, want_logits=True)  # type: ignore[arg-type]
        return ops.logits_f32(h, self.model.output, self.model.config.final_softcap)  # [B, V]


def _graphs_possible(model: Model, placement: PoolPlacement, enabled: bool) -> bool:
    """Whether steps over `placement` can be captured at all (the module docstring)."""
    ops = model.ops
    if not enabled or ops.name != "cupy" or ops.dtype == np.float32:
        return False
    if not isinstance(placement, DevicePoolPlacement) or placement.pool.geometry.has_scales:
        return False
    return model.config.head_dim in FLASH_HEAD_DIMS


def make_batch_graphs(
    model: Model, placements: Sequence[PoolPlacement], enabled: bool
) -> tuple[BatchDecodeGraph, ...]:
    """The batched decode graphs (`batch_graph_sizes`) of slots over `placements` (one arena), where they can be
    captured; none for one slot (its runner's decode graph serves it)."""
    if not placements or not all(_graphs_possible(model, p, enabled) for p in placements):
        return ()
    arena = placements[0].pool.arena
    if any(p.pool.arena is not arena for p in placements):
        return ()
    first = placements[0]
    assert isinstance(first, DevicePoolPlacement)
    return tuple(BatchDecodeGraph(model, first, n) for n in batch_graph_sizes(len(placements)))


def batch_graph_sizes(n_slots: int) -> tuple[int, ...]:
    """Batched decode graphs' sizes: 2, 4, 8, ... below n_slots, and n_slots. A step of B slots replays the
    smallest that holds it, padded: the rows' products cost about the same up to 8 rows (strata_gemv)."""
    sizes, n = [], 2
    while n < n_slots:
        sizes.append(n)
        n *= 2
    return (*sizes, n_slots) if n_slots > 1 else ()


def make_step_graph(model: Model, placement: PoolPlacement, enabled: bool, n_tokens: int) -> StepGraph | None:
    """A `StepGraph` of `n_tokens` tokens where the step can be captured (the module docstring), else None."""
    if n_tokens < 1 or not _graphs_possible(model, placement, enabled):
        return None
    assert isinstance(placement, DevicePoolPlacement)
    geometry = placement.pool.geometry
    if n_tokens > geometry.n_ctx:
        return None
    if n_tokens > 1 and geometry.ring_layers:
        return None  # such graphs left op by op's logits across a ring's wrap: bench/gpu/DECISIONS.md "Prefill graphs"
    return StepGraph(model, placement, n_tokens)


def prefill_graph_sizes(chunk: int) -> tuple[int, ...]:
    """The prefill graphs' sizes: powers of two from MIN_PREFILL_GRAPH below the chunk, and the chunk. A
    chunk of n tokens replays the smallest that holds it, padded: at most twice the device work of n
    tokens, and none of the host's launch overhead (bench/gpu/DECISIONS.md "Prefill graphs")."""
    sizes, n = [], MIN_PREFILL_GRAPH
    while n < chunk:
        sizes.append(n)
        n *= 2
    return (*sizes, chunk) if chunk > 1 else ()
