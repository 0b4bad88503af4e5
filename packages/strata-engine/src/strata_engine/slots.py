"""`SlotSet`: several conversations (slots) on one loaded model, in one preallocated K/V pool, decoded together.

Slot i is `runners[i]`, a `ModelRunner` over slot i's region of every layer of the one pool (`kv.PoolArena`:
each layer's parts are [n_slots, capacity, ...], sliding-window rings included), with today's API for one
conversation (prefill, prefill_steps, decode, erase, snapshot_state / restore_state, cut_back; the session
adapter saves and restores a slot through it) and n_ctx = the slot's share of the total: n_ctx // n_slots,
llama-server's rule. A slot's geometry, and so a session file's identity, depends on that share only, so a
file saved from any slot restores into any slot of an engine with the same per-slot context, whatever N.

`decode` advances several slots by one token each in ONE forward pass: the rows (one per slot) share every
product with the weights, and each row attends over its own slot's K/V (`models.common.Rows`). Its logits
equal each slot's decoded alone up to float round-off (the products' summation order varies with the row
count; tests/engine/test_slots.py measures it). On the cupy backend a step of B > 1 slots replays a CUDA
graph of the smallest batch-size bucket holding it (`graph.BatchDecodeGraph`: 2, 4, 8, ... n_slots,
captured at start-up), padded with rows that store nothing; a step of one slot replays its runner's graph.
The loaded model (`loaded.LoadedModel`) captures and holds every graph: the slots' and the batches'.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from .config import ModelConfig
from .errors import GraphCaptureFailed, InvalidRequest, SettingsError
from .gguf import GGUFFile
from .graph import BatchDecodeGraph, StepGraph
from .kv import KVGeometry, make_arena, make_placements
from .loaded import LoadedModel
from .models import Model
from .models.common import Rows, Span
from .runner import ModelRunner
from .sampling import Argmax
from .settings import EngineSettings, KVType


class SlotSet:
    """See the module docstring: `SlotSet(loaded, n_slots)` is the one constructor of slots. Not thread-safe: the
    scheduler calls it from one thread."""

    def __init__(self, loaded: LoadedModel, n_slots: int):
        """n_slots slots of the model's context // n_slots tokens each, carved out of one pool, on `loaded`'s
        weights (its settings: the context of all slots together and the K/V settings); their graphs captured
        and the kernels warmed (`LoadedModel.prepare`)."""
        settings = attrs.evolve(loaded.settings, n_slots=n_slots)  # validated: SettingsError
        total = settings.n_ctx_total(loaded.config.n_ctx_train)
        if (problem := settings.slot_problem(total)) is not None:
            raise SettingsError([problem])
        self.loaded = loaded
        self.settings = attrs.evolve(settings, n_ctx=total)  # n_ctx: the total; each runner's: its own share
        geometry = KVGeometry.from_config(loaded.config, total // n_slots, KVType(settings.kv_type))
        ops = loaded.model.ops
        arena = make_arena(geometry, ops, settings.kv_resident, n_slots)
        placements = make_placements(arena.pools(ops), settings.kv_resident)
        loaded.prepare(placements)
        self.runners = tuple(ModelRunner(loaded, placement) for placement in placements)
        # Batched decode graphs, ascending sizes; a step none holds runs op by op.
        self.batch_graphs = loaded.batch_graphs_of(arena)

    @classmethod
    def load(cls, settings: EngineSettings) -> SlotSet:
        """Load the model once and carve settings.n_slots slots of n_ctx // n_slots tokens each out of one pool."""
        return cls(LoadedModel.load(settings), settings.n_slots)

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
    def n_slots(self) -> int:
        return len(self.runners)

    @property
    def n_ctx_slot(self) -> int:
        return self.runners[0].n_ctx

    def decode(self, steps: Sequence[tuple[int, int]]) -> np.ndarray:
        """Evaluate one token in each of several slots: steps = [(slot, token), ...], distinct slots.
        Returns float32 logits [B, n_vocab], row b for steps[b]; each slot holds one more token.

        One forward pass over the B rows. A ContextOverflow or InvalidToken names its slot and nothing is
        evaluated; on any other exception every slot of the batch is cut back to what it held before (its
        deepest resume point at or below it: `ModelRunner.abort_step`), the other slots untouched."""
        return np.stack(self.decode_rows(steps, [False] * len(steps)))  # type: ignore[arg-type]

    def launch(self, steps: Sequence[tuple[int, int]]) -> LaunchedStep:
        """The decode step of greedy rows `steps` (as in `decode_rows`, every row argmax_only), started where it
        runs asynchronously (a captured graph: one slot's or a batch's) so the caller can do its own work
        (accepting the previous step's tokens) while the device computes; `LaunchedStep.collect` ends it. Where
        steps run synchronously the step is deferred to `collect`, which then evaluates only the rows kept.
        The checks run now: a ContextOverflow or InvalidToken names its slot and nothing is launched."""
        steps = self._checked(steps, [True] * len(steps))
        launched = LaunchedStep(self, steps)
        graph = (
            self.batch_graphs.for_rows(len(steps))
            if len(steps) > 1
            else self.runners[steps[0][0]].graphs.decode
        )
        if graph is None:
            return launched  # deferred
        opened: list[tuple[ModelRunner, int]] = []
        try:
            for slot, _ in steps:
                opened.append((self.runners[slot], self.runners[slot].begin_step(1)))
            if isinstance(graph, BatchDecodeGraph):
                graph.launch([(r.pool.slot, pos, t) for (r, pos), (_, t) in zip(opened, steps, strict=True)])
            else:
                graph.launch([steps[0][1]], opened[0][1])
        except BaseException as exc:
            for runner, pos in opened:
                runner.abort_step(pos)
            if not isinstance(exc, GraphCaptureFailed):
                raise
            if isinstance(graph, BatchDecodeGraph):  # dropped now: collect (and later steps) run op by op
                self.batch_graphs.drop(graph, exc)
            else:
                self.runners[steps[0][0]].graphs.drop(graph, exc)
            return launched
        launched.graph, launched.opened = graph, opened
        return launched

    def _checked(
        self, steps: Sequence[tuple[int, int]], argmax_only: Sequence[bool]
    ) -> list[tuple[int, int]]:
        """steps as ints, after the checks of a decode step (InvalidRequest, ContextOverflow, InvalidToken)."""
        if len(argmax_only) != len(steps):
            raise InvalidRequest([f"{len(argmax_only)} argmax_only flags for {len(steps)} decode rows"])
        steps = [(int(slot), int(token)) for slot, token in steps]
        slots = [slot for slot, _ in steps]
        problems = [f"slot {s} outside [0, {self.n_slots})" for s in slots if not 0 <= s < self.n_slots]
        if len(set(slots)) != len(slots):
            problems.append(f"a slot appears more than once in one decode step: {slots}")
        if not steps:
            problems.append("a decode step needs at least one slot")
        if problems:
            raise InvalidRequest(problems)
        for slot, token in steps:
            self.runners[slot].check_decode(token, slot)
        return steps

    def decode_rows(
        self, steps: Sequence[tuple[int, int]], argmax_only: Sequence[bool]
    ) -> list[Argmax | np.ndarray]:
        """`decode`, where row b's result is the `Argmax` of its logits if argmax_only[b] (a greedy row whose
        sampler reads nothing else: `completion.Generation.argmax_only`), else its logits [n_vocab]. A
        captured step computes the argmax on the device and downloads only the rows of logits asked for,
        into pinned memory: those arrays are valid until the next step of this SlotSet."""
        steps = self._checked(steps, argmax_only)
        slots = [slot for slot, _ in steps]
        if len(steps) == 1:  # one slot: its own step (a captured graph where it has one)
            slot, token = steps[0]
            return [self.runners[slot].decode_row(token, argmax_only[0])]
        runners = [self.runners[slot] for slot in slots]
        opened: list[tuple[ModelRunner, int]] = []
        try:
            for runner in runners:
                opened.append((runner, runner.begin_step(1)))
            out: list[Argmax | np.ndarray] | None = None
            graph = self.batch_graphs.for_rows(len(steps))
            if graph is not None:
                try:
                    rows = [(r.pool.slot, pos, t) for (r, pos), (_, t) in zip(opened, steps, strict=True)]
                    out = graph.decode_rows(rows, argmax_only)
                except GraphCaptureFailed as e:  # the step is redone op by op (it is idempotent)
                    self.batch_graphs.drop(graph, e)
            if out is None:
                spans = Rows(tuple(Span(runner.placement, pos, 1) for runner, pos in opened))
                logits = self.model.forward(
                    np.asarray([t for _, t in steps], dtype=np.int64), spans, want_logits=True
                )
                assert logits is not None
                out = [
                    Argmax.of_logits(row) if only else row
                    for row, only in zip(logits, argmax_only, strict=True)
                ]
        except BaseException:
            for runner, pos in opened:
                runner.abort_step(pos)
            raise
        for runner, (_, token) in zip(runners, steps, strict=True):
            runner.commit_step([token])
        return out


@attrs.define(eq=False)
class LaunchedStep:
    """A decode step of greedy rows from `SlotSet.launch`: on the device (`graph` set, each row's pool opened at
    its position: `opened`), or deferred (`graph` None). `collect` ends it once."""

    slot_set: SlotSet
    steps: list[tuple[int, int]]  # (slot, token) per row
    graph: BatchDecodeGraph | StepGraph | None = None
    opened: list[tuple[ModelRunner, int]] = attrs.field(factory=list)

    def collect(self, keep: Sequence[bool]) -> list[Argmax | None]:
        """Row b's `Argmax` where keep[b] (its slot then holds the token), None where not (a row whose
        conversation ended meanwhile: its slot holds what it held before; a launched row's K/V, stored
        past the conversation's end, is never attended). Waits for the device. On an exception every
        launched row's slot is cut back as `decode_rows` does."""
        if self.graph is None:
            kept = [step for step, k in zip(self.steps, keep, strict=True) if k]
            rows = iter(self.slot_set.decode_rows(kept, [True] * len(kept)) if kept else [])
            return [next(rows) if k else None for k in keep]  # type: ignore[misc]
        try:
            if isinstance(self.graph, BatchDecodeGraph):
                best = self.graph.argmax(len(self.steps))
            else:
                best = [self.graph.argmax()]
        except BaseException:
            for runner, pos in self.opened:
                runner.abort_step(pos)
            raise
        for (runner, pos), (_, token), k in zip(self.opened, self.steps, keep, strict=True):
            if k:
                runner.commit_step([token])
            else:
                runner.abort_step(pos)
        return [b if k else None for b, k in zip(best, keep, strict=True)]
