"""`LoadedModel`: what every slot of an engine shares: the settings as they run, the GGUF file, the model's
config, the model family object with its weights, the kernel warm-up and every CUDA graph (each slot's decode
and prefill steps, the slots' batched decode steps: graph.py).

`LoadedModel.load` reads the file once; `with_settings` gives the same weights under other K/V settings
(nothing reloaded). The slots (`slots.SlotSet`) hand it their placements at start-up (`prepare`): it captures
the graphs over them and warms the kernels on the first, then each slot finds its graphs here
(`graphs_of`), and the slot set its batch graphs (`batch_graphs_of`). Graphs live as long as the model.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from .config import ModelConfig
from .errors import GraphCaptureFailed, SettingsError
from .gguf import GGUFFile, read_gguf
from .graph import (
    BatchDecodeGraph,
    StepGraph,
    make_batch_graphs,
    make_step_graph,
    prefill_graph_sizes,
    say_op_by_op,
)
from .kv import PoolArena, PoolPlacement
from .models import Model, build_model
from .models.common import Rows, Span
from .ops import get_ops, resolve_settings
from .settings import EngineSettings

# Tokens of the warm-up's second forward pass: more rows than the packed products take (they go to BLAS:
# numba_ops.PACKED_MAX_ROWS, 64) and more queries than the attention kernel takes (key blocks through
# BLAS), so every path is compiled.
WARM_UP_TOKENS = 72

# What the weights depend on: `with_settings` keeps these as loaded.
WEIGHT_SETTINGS = frozenset(
    {"model_path", "compute_dtype", "backend", "cpu_kernels", "threads", "poll", "batch_invariant"}
)


@attrs.define(eq=False)
class SlotGraphs:
    """One slot's captured steps: its decode step and prefill steps of ascending sizes up to a chunk. A step
    none holds, or one whose capture failed (`drop`), runs op by op."""

    decode: StepGraph | None = None
    prefill: tuple[StepGraph, ...] = ()

    def all(self) -> tuple[StepGraph, ...]:
        return (*self.prefill, *((self.decode,) if self.decode is not None else ()))

    def for_step(self, n_tokens: int, pos0: int, want_logits: bool, n_ctx: int) -> StepGraph | None:
        """The decode graph for one token with logits; else the smallest prefill graph holding the step whose
        padded rows stay inside the slot's n_ctx."""
        if n_tokens == 1 and want_logits and self.decode is not None:
            return self.decode
        for graph in self.prefill:
            if graph.n_tokens >= n_tokens and pos0 + graph.n_tokens <= n_ctx:
                return graph
        return None

    def drop(self, graph: StepGraph, error: GraphCaptureFailed) -> None:
        """A graph whose capture failed: said on stderr; its steps run op by op from now on."""
        say_op_by_op(error)
        if graph is self.decode:
            self.decode = None
        self.prefill = tuple(g for g in self.prefill if g is not graph)


@attrs.define(eq=False)
class BatchGraphs:
    """The batched decode graphs of the slots of one arena, ascending sizes; a step none holds runs op by op."""

    graphs: tuple[BatchDecodeGraph, ...] = ()

    def for_rows(self, n_rows: int) -> BatchDecodeGraph | None:
        return next((g for g in self.graphs if g.n_tokens >= n_rows), None)

    def drop(self, graph: BatchDecodeGraph, error: GraphCaptureFailed) -> None:
        """A batch graph whose capture failed: said on stderr; its steps run op by op from now on."""
        say_op_by_op(error)
        self.graphs = tuple(g for g in self.graphs if g is not graph)


class LoadedModel:
    """See the module docstring. `settings` are resolved (`ops.resolve_settings`): they name the backend,
    compute dtype and chunk actually running. Not thread-safe: the scheduler uses it from one thread."""

    def __init__(self, settings: EngineSettings, gguf_file: GGUFFile, config: ModelConfig, model: Model):
        self.settings = settings
        self.gguf = gguf_file
        self.config = config
        self.model = model
        # graphs by the placement (a slot) and the arena (a slot set) they were captured over
        self._slot_graphs: dict[PoolPlacement, SlotGraphs] = {}
        self._batch_graphs: dict[PoolArena, BatchGraphs] = {}
        self.graph_capture_s = 0.0
        self.kernel_warm_s = 0.0

    @classmethod
    def load(cls, settings: EngineSettings) -> LoadedModel:
        """Read the GGUF file and build the model. "auto" and the defaults for the backend and the model are
        resolved here, so the settings held (and the config fingerprint) name what actually runs."""
        gguf_file = read_gguf(settings.model_path)
        config = ModelConfig.from_gguf(gguf_file)
        if (problem := settings.slot_problem(settings.n_ctx_total(config.n_ctx_train))) is not None:
            raise SettingsError([problem])  # the model's default context, shared by too many slots
        config = config.for_context(settings.n_ctx_slot(config.n_ctx_train))
        settings = resolve_settings(settings, config.architecture)
        assert settings.compute_dtype is not None and settings.cpu_kernels is not None  # resolved just above
        ops = get_ops(
            settings.backend, settings.compute_dtype, settings.cpu_kernels, settings.threads, settings.poll,
            batch_invariant=settings.batch_invariant,
        )  # fmt: skip
        return cls(settings, gguf_file, config, build_model(config, ops, gguf_file))

    def with_settings(self, **changes: Any) -> LoadedModel:
        """The same weights (nothing reloaded) under other K/V settings (n_ctx, n_slots, kv_type, kv_resident,
        prompt_cache, prefill_chunk, max_checkpoints, cuda_graphs), validated; its own graphs."""
        if fixed := WEIGHT_SETTINGS & set(changes):
            raise SettingsError([f"{name} cannot differ from the loaded model's" for name in sorted(fixed)])
        settings = attrs.evolve(self.settings, **changes)
        if self.config.for_context(settings.n_ctx_slot(self.config.n_ctx_train)) != self.config:
            raise SettingsError(["n_ctx crosses the model's longrope original context: load the model anew"])
        return type(self)(settings, self.gguf, self.config, self.model)

    @property
    def prefill_chunk(self) -> int:
        """Tokens a prefill step takes (the settings' default resolved when the model loaded)."""
        assert self.settings.prefill_chunk is not None
        return self.settings.prefill_chunk

    # ---- start-up --------------------------------------------------------------------------------
    def prepare(self, placements: Sequence[PoolPlacement]) -> None:
        """Start-up of the slots over `placements` (regions of one arena, nothing held): each slot's step graphs
        made and captured, the kernels warmed on the first (they serve every slot), the batch graphs captured.
        `graph_capture_s`: the seconds the captures took."""
        enabled = self.settings.cuda_graphs
        capture_s = 0.0
        for i, placement in enumerate(placements):
            made = (
                make_step_graph(self.model, placement, enabled, n)
                for n in prefill_graph_sizes(self.prefill_chunk)
            )
            graphs = SlotGraphs(
                make_step_graph(self.model, placement, enabled, 1), tuple(g for g in made if g)
            )
            if graphs.all():  # only where there are graphs: a CPU model keeps no record of its slots
                self._slot_graphs[placement] = graphs
                capture_s += self._capture(placement, graphs)
            if i == 0:
                self.warm_kernels(placement)
        batch = make_batch_graphs(self.model, placements, enabled)
        if batch:
            self._batch_graphs[placements[0].pool.arena] = batch_graphs = BatchGraphs(batch)
            t0 = time.perf_counter()
            for graph in batch:
                try:
                    graph.prepare()  # its capture stores nothing: the pool is untouched
                except GraphCaptureFailed as e:
                    batch_graphs.drop(graph, e)
            capture_s += time.perf_counter() - t0
        self.graph_capture_s = capture_s

    def graphs_of(self, placement: PoolPlacement) -> SlotGraphs:
        """The step graphs captured over `placement` (none where it has none)."""
        return self._slot_graphs.get(placement) or SlotGraphs()

    def batch_graphs_of(self, arena: PoolArena) -> BatchGraphs:
        """The batched decode graphs captured over `arena`'s slots (none where it has none)."""
        return self._batch_graphs.get(arena) or BatchGraphs()

    @staticmethod
    def _capture(placement: PoolPlacement, graphs: SlotGraphs) -> float:
        """Capture the step graphs now (start-up: vLLM does the same) rather than in the first decode step and
        the first full chunk a request brings, which would pay the capture (bench/gpu/DECISIONS.md "Decode as a
        CUDA graph"). Each runs once on placeholder tokens at position 0, whose K/V are then dropped (the pool
        holds nothing before and after). A capture that fails is said once on stderr and that step runs op by op.
        Returns the seconds spent."""
        t0 = time.perf_counter()
        pool = placement.pool
        for graph in graphs.all():
            if graph.graph is not None:
                continue
            pool.begin_append(0, graph.n_tokens)
            try:
                graph.prepare()
            except GraphCaptureFailed as e:
                graphs.drop(graph, e)
            finally:
                pool.abort_append()
                pool.reset()
                placement.truncated(0)
        return time.perf_counter() - t0

    def warm_kernels(self, placement: PoolPlacement) -> float:
        """Compile (or load from numba's disk cache) the kernels a request would run, now, over an empty slot's
        `placement`: a forward pass of one token, one of a short prompt past the packed products' row limit and
        one shaped as a batched decode step of two rows, on placeholder tokens at position 0 whose K/V are then
        dropped, and the attention kernels over the pool's storage and over an embedding's scratch K/V that
        those short passes do not reach (`Ops.warm_attention`). Nothing for ops without compiled kernels.
        Returns the seconds spent."""
        t0 = time.perf_counter()
        ops = self.model.ops
        if not ops.compiles_kernels:
            return 0.0
        pool = placement.pool
        n_ctx = pool.geometry.n_ctx
        passes = [Rows.chunk(placement, 0, n) for n in sorted({1, min(WARM_UP_TOKENS, n_ctx)})]
        if n_ctx >= 2:  # a batched decode step's shape (two one-row spans: `attend_rows`), in this slot alone
            passes.append(Rows((Span(placement, 0, 1), Span(placement, 1, 1))))
        for rows in passes:
            pool.begin_append(0, rows.n_rows)
            try:
                self.model.forward(np.zeros(rows.n_rows, dtype=np.int64), rows, want_logits=True)
            finally:
                pool.abort_append()
                pool.reset()
                placement.truncated(0)
        views = pool.layer(0)
        ops.warm_attention(views.k, views.v, views.k_scale, views.v_scale)
        # EMBED attends over scratch K/V in the compute dtype (embedding.ScratchKV), not the pool's storage
        scratch = ops.xp.zeros((1, *views.k.shape[1:]), dtype=ops.dtype)
        ops.warm_attention(scratch, scratch)
        self.kernel_warm_s = time.perf_counter() - t0
        return self.kernel_warm_s
