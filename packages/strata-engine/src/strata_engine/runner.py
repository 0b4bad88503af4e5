"""ModelRunner: one conversation (a slot; `slots.SlotSet` holds several on one model, each a runner over its
region of one K/V pool) on one model: prefill with prompt-cache reuse, decode, erase.

The runner holds the model (shared by the slots), its K/V pool (its slot's region), the placement and the
ring checkpoints. Its running state is the tokens whose K/V is held (`tokens_held`; position = their count),
the pool's extent and the checkpoints; `snapshot_state` / `restore_state` move that state in and out for the session adapter.

Prompt cache (`prefill`): the request reuses the longest common prefix of its tokens and the held ones
that is a valid resume point (see `_resume_point`), drops the rest of the held conversation, and
evaluates what remains in chunks of `prefill_chunk` tokens, computing logits for the last token only
(`prefill_steps`: one chunk per step, so a scheduler can run other slots' steps between them).
When the whole prompt is already held the last token is evaluated again for its logits
(cache_n = n - 1, prompt_n = 1, as llama-server reports).
"""

from __future__ import annotations

import array
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any

import attrs
import numpy as np

from .config import ModelConfig
from .errors import ContextOverflow, EngineError, InvalidToken, KVStateError, SettingsError
from .gguf import GGUFFile, read_gguf
from .graph import GraphCaptureFailed, StepGraph, make_step_graph, prefill_graph_sizes, say_op_by_op
from .kv import (
    KVGeometry,
    KVPool,
    PoolPlacement,
    RingCheckpoint,
    make_placement,
    make_pool,
    restore_checkpoint,
    take_checkpoint,
)
from .models import Model, build_model
from .models.common import Rows, Span
from .ops import get_ops, resolve_settings
from .sampling import Argmax
from .settings import EngineSettings, KVType

# Tokens of the warm-up's second forward pass: more rows than the packed products take (they go to BLAS:
# numba_ops.PACKED_MAX_ROWS, 64) and more queries than the attention kernel takes (key blocks through
# BLAS), so every path is compiled.
WARM_UP_TOKENS = 72


@attrs.frozen
class PrefillResult:
    # float32 [n_vocab], of the prompt's last token; None when should_stop ended the prefill early
    logits: np.ndarray | None = attrs.field(repr=False)
    cache_n: int  # prompt tokens reused from the held conversation
    prompt_n: int  # prompt tokens evaluated

    @property
    def stopped(self) -> bool:
        return self.logits is None


@attrs.frozen(eq=False)
class RunnerState:
    """The running state besides the K/V bytes: what the session file's running-state section holds.

    tokens: the tokens whose K/V is held (position = len(tokens)): a tuple, or a restored file's int32
        array (array.array "i", read without making 32K Python ints).
    ring_start: the lowest position the sliding-window rings hold (0 without rings).
    checkpoints: ring checkpoints, shallowest first; `deepest_checkpoint` is the next turn's resume point.
    """

    tokens: Sequence[int]
    ring_start: int
    checkpoints: tuple[RingCheckpoint, ...] = ()

    @property
    def position(self) -> int:
        return len(self.tokens)

    @property
    def deepest_checkpoint(self) -> RingCheckpoint | None:
        return self.checkpoints[-1] if self.checkpoints else None


def _id_span(tokens: Sequence[int]) -> tuple[int, int]:
    """(min, max) of token ids: one numpy pass over an int32 buffer (a restored file's array), else min and
    max in C over the Python ints (bench/engine/DECISIONS.md "Token-id checks")."""
    if isinstance(tokens, array.array) and tokens.itemsize == 4 and tokens.typecode in "il":
        ids = np.frombuffer(tokens, dtype=np.int32)
        return int(ids.min()), int(ids.max())
    return min(tokens), max(tokens)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


class ModelRunner:
    """See the module docstring. Not thread-safe: the serve loop calls it from one thread."""

    def __init__(
        self,
        settings: EngineSettings,
        gguf_file: GGUFFile,
        config: ModelConfig,
        model: Model,
        pool: KVPool,
        placement: PoolPlacement,
    ):
        # what runs is what the settings (and files) say
        self.settings = resolve_settings(settings, config.architecture)
        self.gguf = gguf_file
        self.config = config
        self.model = model
        self.pool = pool
        self.placement = placement
        self.kv_geometry = pool.geometry
        self.n_ctx = pool.geometry.n_ctx
        self._tokens: list[int] = []
        self._checkpoints: list[RingCheckpoint] = []
        self._epoch = 0  # bumped by every change of the held conversation (see `_prefill_chunks`)
        # CUDA graphs of a decode step and of prefill steps (ascending sizes up to a chunk): `_assemble`
        # adds them where they can be captured (graph.py); a step none holds, or one whose capture failed,
        # runs op by op.
        self.decode_graph: StepGraph | None = None
        self.prefill_graphs: tuple[StepGraph, ...] = ()
        self.graph_capture_s = 0.0
        self.kernel_warm_s = 0.0

    @property
    def prefill_chunk(self) -> int:
        """Tokens a prefill step takes (the settings' default resolved when the model loaded)."""
        assert self.settings.prefill_chunk is not None
        return self.settings.prefill_chunk

    @classmethod
    def load(cls, settings: EngineSettings) -> ModelRunner:
        """One conversation on a model loaded from `settings` (n_slots 1; several slots: `SlotSet.load`)."""
        if settings.n_slots != 1:
            raise SettingsError(
                [f"a ModelRunner holds one slot, not n_slots {settings.n_slots}: use SlotSet.load"]
            )
        settings, gguf_file, config, model = cls.load_model(settings)
        return cls._assemble(settings, gguf_file, config, model)

    @staticmethod
    def load_model(settings: EngineSettings) -> tuple[EngineSettings, GGUFFile, ModelConfig, Model]:
        """Read the GGUF file and build the model. "auto" and the defaults for the backend and the model are
        resolved here, so the settings held (and the config fingerprint) name the backend, compute dtype and
        chunk actually running."""
        gguf_file = read_gguf(settings.model_path)
        config = ModelConfig.from_gguf(gguf_file)
        if (problem := settings.slot_problem(settings.n_ctx_total(config.n_ctx_train))) is not None:
            raise SettingsError([problem])  # the model's default context, shared by too many slots
        config = config.for_context(settings.n_ctx_slot(config.n_ctx_train))
        settings = resolve_settings(settings, config.architecture)
        assert settings.compute_dtype is not None and settings.cpu_kernels is not None  # resolved just above
        ops = get_ops(
            settings.backend, settings.compute_dtype, settings.cpu_kernels, settings.threads, settings.poll
        )
        return settings, gguf_file, config, build_model(config, ops, gguf_file)

    def sibling(self, **changes: object) -> ModelRunner:
        """A runner on the same loaded model (weights shared, nothing reloaded) with its own K/V pool,
        placement and conversation; `changes` may alter the K/V settings (n_ctx, kv_type,
        kv_resident, prompt_cache, prefill_chunk, max_checkpoints), not what the weights depend on."""
        if changes.get("n_slots", 1) != 1:
            raise SettingsError([f"a sibling holds one slot, not n_slots {changes['n_slots']}"])
        return self._assemble(self.kv_settings(**changes), self.gguf, self.config, self.model)

    def kv_settings(self, **changes: Any) -> EngineSettings:
        """This runner's settings with K/V settings changed (`sibling`), validated."""
        fixed = {"model_path", "compute_dtype", "backend", "cpu_kernels", "threads", "poll"} & set(changes)
        if fixed:
            raise SettingsError([f"{name} cannot differ from the loaded model's" for name in sorted(fixed)])
        settings = attrs.evolve(self.settings, **changes)
        if self.config.for_context(settings.n_ctx_slot(self.config.n_ctx_train)) != self.config:
            raise SettingsError(["n_ctx crosses the model's longrope original context: load the model anew"])
        return settings

    @classmethod
    def _assemble(
        cls, settings: EngineSettings, gguf_file: GGUFFile, config: ModelConfig, model: Model,
        placement: PoolPlacement | None = None, warm: bool = True,
    ) -> ModelRunner:  # fmt: skip
        """A runner over `placement` (a slot's region of a shared pool: `SlotSet`), else over a pool of its own;
        `warm`: its kernels warmed (`warm_kernels`), which a slot after the first of a SlotSet need not repeat."""
        if placement is None:
            geometry = KVGeometry.from_config(
                config, settings.n_ctx_slot(config.n_ctx_train), KVType(settings.kv_type)
            )
            pool = make_pool(geometry, model.ops, settings.kv_resident)  # device / host-mapped pools on cupy
            placement = make_placement(pool, settings.kv_resident)
        runner = cls(settings, gguf_file, config, model, placement.pool, placement)
        enabled = runner.settings.cuda_graphs
        runner.decode_graph = make_step_graph(model, placement, enabled, 1)
        made = (
            make_step_graph(model, placement, enabled, n) for n in prefill_graph_sizes(runner.prefill_chunk)
        )
        runner.prefill_graphs = tuple(g for g in made if g is not None)
        runner.capture_graphs()
        if warm:
            runner.warm_kernels()
        return runner

    def capture_graphs(self) -> float:
        """Capture the CUDA graphs now (start-up: vLLM does the same) rather than in the first decode step
        and the first full chunk a request brings, which would pay the capture (bench/gpu/DECISIONS.md "Decode as a CUDA graph"). Each
        runs once on placeholder tokens at position 0, whose K/V are then dropped (the pool holds nothing
        before and after). A capture that fails is said once on stderr and that step runs op by op.
        Returns the seconds spent."""
        t0 = time.perf_counter()
        if self.n_held:
            raise EngineError("graphs are captured before a conversation is held")
        for graph in (*self.prefill_graphs, self.decode_graph):
            if graph is None or graph.graph is not None:
                continue
            self.pool.begin_append(0, graph.n_tokens)
            try:
                graph.prepare()
            except GraphCaptureFailed as e:
                self.drop_graph(graph, e)
            finally:
                self.pool.abort_append()
                self.erase()
        self.graph_capture_s = time.perf_counter() - t0
        return self.graph_capture_s

    def warm_kernels(self) -> float:
        """Compile (or load from numba's disk cache) the kernels a request would run, now: a forward pass
        of one token, one of a short prompt past the packed products' row limit and one shaped as a batched
        decode step of two rows, on placeholder
        tokens at position 0 whose K/V are then dropped, and the attention kernels over the pool's storage
        and over an embedding's scratch K/V that those short passes do not reach (`Ops.warm_attention`). Nothing for ops without compiled
        kernels. Returns the seconds spent."""
        t0 = time.perf_counter()
        if not self.model.ops.compiles_kernels:
            return 0.0
        if self.n_held:
            raise EngineError("kernels are warmed up before a conversation is held")
        passes = [Rows.chunk(self.placement, 0, n) for n in sorted({1, min(WARM_UP_TOKENS, self.n_ctx)})]
        if (
            self.n_ctx >= 2
        ):  # a batched decode step's shape (two one-row spans: `attend_rows`), in this slot alone
            passes.append(Rows((Span(self.placement, 0, 1), Span(self.placement, 1, 1))))
        for rows in passes:
            self.pool.begin_append(0, rows.n_rows)
            try:
                self.model.forward(np.zeros(rows.n_rows, dtype=np.int64), rows, want_logits=True)
            finally:
                self.pool.abort_append()
                self.erase()
        views = self.pool.layer(0)
        self.model.ops.warm_attention(views.k, views.v, views.k_scale, views.v_scale)
        # EMBED attends over scratch K/V in the compute dtype (embedding.ScratchKV), not the pool's storage
        scratch = self.model.ops.xp.zeros((1, *views.k.shape[1:]), dtype=self.model.ops.dtype)
        self.model.ops.warm_attention(scratch, scratch)
        self.kernel_warm_s = time.perf_counter() - t0
        return self.kernel_warm_s

    # ---- state ---------------------------------------------------------------------------------
    @property
    def tokens_held(self) -> Sequence[int]:
        return tuple(self._tokens)

    @property
    def n_held(self) -> int:
        return len(self._tokens)

    @property
    def checkpoints(self) -> tuple[RingCheckpoint, ...]:
        return tuple(self._checkpoints)

    def snapshot_state(self) -> RunnerState:
        return RunnerState(tuple(self._tokens), self.pool.ring_start, tuple(self._checkpoints))

    def restore_state(self, state: RunnerState) -> None:
        """Adopt `state` after its K/V was written into the pool (`pool.write`): validates it against
        this runner's limits, sets the pool's extent, and refills the placement's resident rings."""
        problems = self.state_problems(state)
        if problems:
            raise KVStateError("; ".join(problems))
        self.pool.set_extent(len(state.tokens), state.ring_start)
        self._epoch += 1
        self._tokens = list(state.tokens)
        self._checkpoints = list(state.checkpoints)
        self.placement.truncated(0)
        self.placement.refill()

    def state_problems(self, state: RunnerState) -> list[str]:
        """Why `restore_state(state)` would refuse `state` (empty: it would adopt it). Touches nothing,
        so the session adapter can check a restore's running state before its gate."""
        problems = []
        if len(state.tokens) > self.n_ctx:
            problems.append(f"{len(state.tokens)} tokens exceed the context size {self.n_ctx}")
        # the list of bad ids (for the message) only when there is one
        tokens, n_vocab = state.tokens, self.config.n_vocab
        if tokens and not (0 <= (span := _id_span(tokens))[0] and span[1] < n_vocab):
            bad = [t for t in tokens if not 0 <= t < n_vocab]
            problems.append(f"token ids outside the vocabulary: {bad[:5]}")
        positions = [c.position for c in state.checkpoints]
        if positions != sorted(set(positions)) or any(p > len(state.tokens) for p in positions):
            problems.append(f"checkpoint positions {positions} are not increasing within the conversation")
        if state.checkpoints and self.kv_geometry.max_window is None:
            problems.append("checkpoints given for a model without sliding-window layers")
        for c in state.checkpoints:
            if set(c.layers) != set(self.kv_geometry.ring_layers):
                problems.append(f"checkpoint at {c.position} does not cover the ring layers")
        cap = self.kv_geometry.ring_capacity
        if cap is None and state.ring_start != 0:
            problems.append(f"ring_start {state.ring_start} given for a pool without rings")
        elif cap is not None and not (
            0 <= state.ring_start <= len(state.tokens) and len(state.tokens) - state.ring_start <= cap
        ):
            problems.append(
                f"ring_start {state.ring_start} invalid for {len(state.tokens)} tokens and ring "
                f"capacity {cap}"
            )
        return problems

    def resume_point(self, state: RunnerState, target: int) -> int:
        """The deepest position <= target the conversation `state` can continue from once adopted (what
        `cut_back(target)` would keep after `restore_state(state)`); touches nothing. Without sliding-window
        layers it is target itself; with them, a position whose window the rings still hold, else the
        deepest checkpoint at or below it, else 0 (the same rule as `_resume_at`)."""
        target = max(0, min(target, len(state.tokens)))
        window = self.kv_geometry.max_window
        if window is None or target == 0 or max(0, target - window + 1) >= state.ring_start:
            return target
        usable = [c.position for c in state.checkpoints if c.position <= target]
        return usable[-1] if usable else 0

    def cut_back(self, target: int) -> int:
        """Keep the held conversation up to the deepest resume point <= target; returns the tokens kept."""
        return self._resume_at(max(0, min(target, self.n_held)))

    def erase(self) -> int:
        """Drop the held conversation (and its checkpoints); returns the number of tokens dropped."""
        n = len(self._tokens)
        self._epoch += 1
        self._tokens = []
        self._checkpoints = []
        self.pool.reset()
        self.placement.truncated(0)
        return n

    # ---- evaluation ----------------------------------------------------------------------------
    def prefill(
        self,
        tokens: Sequence[int],
        should_stop: Callable[[], bool] | None = None,
        on_chunk: Callable[[int, int], None] | None = None,
    ) -> PrefillResult:
        """Evaluate the prompt after the longest reusable held prefix, in chunks of prefill_chunk
        (`prefill_steps`, run to its end).

        should_stop is asked between chunks: when it says yes, the prefill ends there (logits None);
        the chunks already evaluated stay held, so the next request for this prompt reuses them.
        on_chunk(cache_n, n_held) is told after each chunk (prompt progress)."""
        progress: list[int] = []  # cache_n, n_held after the latest chunk

        def told(cache_n: int, n_held: int) -> None:
            progress[:] = (cache_n, n_held)
            if on_chunk is not None:
                on_chunk(cache_n, n_held)

        steps = self.prefill_steps(tokens, told)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value
            if should_stop is not None and should_stop():
                steps.close()
                cache_n, n_held = progress
                return PrefillResult(logits=None, cache_n=cache_n, prompt_n=n_held - cache_n)

    def prefill_steps(
        self,
        tokens: Sequence[int],
        on_chunk: Callable[[int, int], None] | None = None,
        chunk_size: Callable[[], int] | None = None,
    ) -> Generator[None, None, PrefillResult]:
        """`prefill` a chunk at a time, for a scheduler that interleaves other slots' steps between chunks.

        The prompt is checked now (EngineError, ContextOverflow, InvalidToken: nothing held changes); the
        prompt cache's cut-back happens at the first next(). Each next() evaluates one chunk
        (prefill_chunk tokens, or chunk_size()'s, asked before each chunk: a scheduler cuts them smaller
        while other slots generate), tells on_chunk(cache_n, n_held), and yields None; the one that
        evaluates the last chunk returns the PrefillResult (StopIteration.value). Closing the generator early
        keeps the chunks already evaluated (and takes the turn's ring checkpoint), as should_stop does."""
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise EngineError("empty prompt: at least one token is needed")
        if len(tokens) > self.n_ctx:
            raise ContextOverflow(len(tokens), self.n_ctx)
        self._check_tokens(tokens)
        return self._prefill_chunks(tokens, on_chunk, chunk_size)

    def _prefill_chunks(
        self,
        tokens: list[int],
        on_chunk: Callable[[int, int], None] | None,
        chunk_size: Callable[[], int] | None = None,
    ) -> Generator[None, None, PrefillResult]:
        n_common = common_prefix_len(tokens, self._tokens) if self.settings.prompt_cache else 0
        resume = pos = self._resume_at(min(n_common, len(tokens) - 1))
        chunk = self.prefill_chunk
        while True:
            if chunk_size is not None:
                chunk = max(1, min(int(chunk_size()), self.prefill_chunk))
            end = min(pos + chunk, len(tokens))
            logits = self._forward(tokens[pos:end], want_logits=end == len(tokens))
            pos = end
            if on_chunk is not None:
                on_chunk(resume, pos)
            if pos == len(tokens):
                break
            epoch = self._epoch
            try:
                yield
            except GeneratorExit:  # stopped between chunks: what was evaluated stays held
                if self._epoch == epoch:  # not when collected after the conversation moved on
                    self._checkpoint()
                raise
        assert logits is not None and not isinstance(
            logits, Argmax
        )  # a prefill asks for logits, not their argmax
        self._checkpoint()
        return PrefillResult(logits=logits, cache_n=resume, prompt_n=pos - resume)

    def decode(self, token: int) -> np.ndarray:
        """Evaluate one token after the held conversation; returns its logits (float32 [n_vocab])."""
        self.check_decode(token)
        logits = self._forward([int(token)], want_logits=True)
        assert isinstance(logits, np.ndarray)
        return logits

    def decode_row(self, token: int, argmax_only: bool) -> np.ndarray | Argmax:
        """`decode`; with `argmax_only` the logits' `Argmax` instead (computed on the device by the decode
        graph, so only it is downloaded; from the host's logits elsewhere)."""
        self.check_decode(token)
        out = self._forward([int(token)], want_logits=True, argmax_only=argmax_only)
        assert out is not None
        return Argmax.of_logits(out) if argmax_only and isinstance(out, np.ndarray) else out

    def check_decode(self, token: int, slot: int | None = None) -> None:
        """Why one more token cannot be decoded (ContextOverflow, InvalidToken naming `slot`), else nothing."""
        if len(self._tokens) + 1 > self.n_ctx:
            raise ContextOverflow(len(self._tokens) + 1, self.n_ctx, slot=slot)
        self._check_tokens([token], slot)

    def _check_tokens(self, tokens: Sequence[int], slot: int | None = None) -> None:
        n_vocab = self.config.n_vocab
        if tokens and 0 <= min(tokens) and max(tokens) < n_vocab:  # in C, not a Python loop
            return
        for t in tokens:
            if not 0 <= t < n_vocab:
                raise InvalidToken(f"token id {t} is outside the vocabulary [0, {n_vocab})", slot=slot)

    def _forward(
        self, tokens: list[int], want_logits: bool, argmax_only: bool = False
    ) -> np.ndarray | Argmax | None:
        """Evaluate tokens after the held conversation (a graph where one holds the step); logits [V] of the
        last one if asked (with `argmax_only`, a graph step gives their `Argmax` instead)."""
        pos0 = self.begin_step(len(tokens))
        try:
            logits, ran = None, False
            graph = self._graph_for(len(tokens), pos0, want_logits)
            if graph is not None:
                try:
                    logits, ran = graph.step(tokens, pos0, want_logits, argmax_only), True
                except GraphCaptureFailed as e:  # the step is redone op by op (it is idempotent)
                    self.drop_graph(graph, e)
            if not ran:
                ids = np.asarray(tokens, dtype=np.int64)
                out = self.model.forward(ids, Rows.chunk(self.placement, pos0, len(tokens)), want_logits)
                logits = None if out is None else out[0]
        except BaseException:
            self.abort_step(pos0)
            raise
        self.commit_step(tokens)
        return logits

    # A step of several slots (`SlotSet.decode`) runs one forward pass between these, on each of its runners.
    def begin_step(self, n_tokens: int) -> int:
        """Open the pool for n_tokens after the held conversation; returns their first position."""
        pos0 = len(self._tokens)
        self.pool.begin_append(pos0, n_tokens)
        self._epoch += 1
        return pos0

    def commit_step(self, tokens: Sequence[int]) -> None:
        """The step's K/V were stored: hold its tokens."""
        self.pool.commit_append(len(tokens))
        self._tokens.extend(tokens)

    def abort_step(self, pos0: int) -> None:
        """The step failed: keep a consistent state, the deepest valid resume point at or below pos0."""
        self.pool.abort_append()
        self._resume_at(pos0)

    def _graph_for(self, n_tokens: int, pos0: int, want_logits: bool) -> StepGraph | None:
        """The decode graph for one token with logits; else the smallest prefill graph holding the step
        whose padded rows stay inside the pool."""
        if n_tokens == 1 and want_logits and self.decode_graph is not None:
            return self.decode_graph
        for graph in self.prefill_graphs:
            if graph.n_tokens >= n_tokens and pos0 + graph.n_tokens <= self.n_ctx:
                return graph
        return None

    def drop_graph(self, graph: StepGraph, error: GraphCaptureFailed) -> None:
        """A graph whose capture failed: said on stderr; its steps run op by op from now on."""
        say_op_by_op(error)
        if graph is self.decode_graph:
            self.decode_graph = None
        self.prefill_graphs = tuple(g for g in self.prefill_graphs if g is not graph)

    # ---- prompt cache and checkpoints ----------------------------------------------------------
    def _resume_at(self, target: int) -> int:
        """Cut the held conversation back to the deepest valid resume point <= target and return it.

        Valid resume points: any r the pool can continue from (always, without sliding-window layers;
        with rings, r whose preceding window-1 positions the rings still hold), and the position of any
        kept checkpoint (restored into the rings). Otherwise 0: evaluate from the start."""
        if self.pool.can_resume(target):
            r = target
        else:
            usable = [c for c in self._checkpoints if c.position <= target]
            if usable:
                restore_checkpoint(self.pool, usable[-1])
                self.placement.refill()
                r = usable[-1].position
            else:
                r = 0
        self._epoch += 1
        if r < self.pool.n_tokens:
            self.pool.truncate(r)
        del self._tokens[r:]
        self._drop_checkpoints_above(r)
        self.placement.truncated(r)
        return r

    def _drop_checkpoints_above(self, r: int) -> None:
        self._checkpoints = [c for c in self._checkpoints if c.position <= r]

    def _checkpoint(self) -> None:
        """Take a ring checkpoint at the current end (a turn boundary), keeping the deepest ones."""
        if (
            not self.settings.prompt_cache
            or self.kv_geometry.max_window is None
            or self.settings.max_checkpoints == 0
        ):
            return
        if self._checkpoints and self._checkpoints[-1].position == self.pool.n_tokens:
            return
        cp = take_checkpoint(self.pool)
        if cp is None:
            return
        self._checkpoints.append(cp)
        del self._checkpoints[: -self.settings.max_checkpoints]
