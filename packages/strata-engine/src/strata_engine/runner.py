"""ModelRunner: one conversation (a slot; `slots.SlotSet` holds several on one model, each a runner over its
region of one K/V pool) on one model: prefill with prompt-cache reuse, decode, erase.

The runner holds the loaded model (`loaded.LoadedModel`: weights, settings, graphs; shared by the slots),
its K/V pool (its slot's region), the placement and the ring checkpoints; `slots.SlotSet` builds it. Its
running state is the tokens whose K/V is held (`tokens_held`; position = their count), the pool's extent and
the checkpoints; `snapshot_state` / `restore_state` move that state in and out for the session adapter.

Prompt cache (`prefill`): the request reuses the longest common prefix of its tokens and the held ones
that is a valid resume point (see `_resume_point`), drops the rest of the held conversation, and
evaluates what remains in chunks of `prefill_chunk` tokens, computing logits for the last token only
(`prefill_steps`: one chunk per step, so a scheduler can run other slots' steps between them).
When the whole prompt is already held the last token is evaluated again for its logits
(cache_n = n - 1, prompt_n = 1, as llama-server reports).
"""

from __future__ import annotations

import array
from collections.abc import Callable, Generator, Sequence

import attrs
import numpy as np

from .config import ModelConfig
from .errors import ContextOverflow, EngineError, GraphCaptureFailed, InvalidToken, KVStateError
from .gguf import GGUFFile
from .kv import PoolPlacement, RingCheckpoint, restore_checkpoint, take_checkpoint
from .loaded import LoadedModel
from .models import Model
from .models.common import Rows
from .sampling import Argmax


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
    """See the module docstring. Built by `slots.SlotSet` (its one constructor of slots) over a placement of its
    arena. Not thread-safe: the serve loop calls it from one thread."""

    def __init__(self, loaded: LoadedModel, placement: PoolPlacement):
        self.loaded = loaded
        self.placement = placement
        self.pool = placement.pool
        self.kv_geometry = self.pool.geometry
        self.n_ctx = self.kv_geometry.n_ctx
        # the model's settings, with this slot's share of the context
        self.settings = attrs.evolve(loaded.settings, n_ctx=self.n_ctx, n_slots=1)
        # the CUDA graphs of this slot's steps (the loaded model captured them); a step none holds runs op by op
        self.graphs = loaded.graphs_of(placement)
        self._tokens: list[int] = []
        self._checkpoints: list[RingCheckpoint] = []
        self._epoch = 0  # bumped by every change of the held conversation (see `_prefill_chunks`)

    @property
    def model(self) -> Model:
        return self.loaded.model

    @property
    def gguf(self) -> GGUFFile:
        return self.loaded.gguf

    @property
    def config(self) -> ModelConfig:
        return self.loaded.config

    @property
    def prefill_chunk(self) -> int:
        """Tokens a prefill step takes (the settings' default resolved when the model loaded)."""
        assert self.settings.prefill_chunk is not None
        return self.settings.prefill_chunk

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
        while other slots generate), tells on_chunk(cache_n, n_held), and yields None (the first next() also
        tells on_chunk(cache_n, cache_n) before its chunk: llama-server's progress before evaluation); the one that
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
        if on_chunk is not None:
            on_chunk(resume, pos)  # before evaluation: what the held conversation gives
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
            graph = self.graphs.for_step(len(tokens), pos0, want_logits, self.n_ctx)
            if graph is not None:
                try:
                    logits, ran = graph.step(tokens, pos0, want_logits, argmax_only), True
                except GraphCaptureFailed as e:  # the step is redone op by op (it is idempotent)
                    self.graphs.drop(graph, e)
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
