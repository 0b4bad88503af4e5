"""`EngineSession`: the session-file adapter over a `ModelRunner`'s K/V pool and running state.

It implements strata_sessionfile's SessionSource (save), SessionTarget (two-pass streaming restore),
StagingTarget (staged restore) and LandingTarget (reads straight into host memory); the library drives,
this class answers. What a file holds for this engine: spec/engine-protocol.md, "Sessions" (one file layer
per model layer, the pool's own bytes in logical order; engine fields and checkpoint bytes: fields.py).

The order a restore keeps: `check_plan` validates everything engine-specific without touching anything;
the gate (`begin_apply`, or the first byte `commit_staged` switches) marks the live conversation as
overwritten (`live_touched`), after which any failure ends in `fail_stop`; `commit` adopts the running
state through `ModelRunner.restore_state`, which refills every resident ring from the pool. Copies into
device memory are only queued (`wait_copies` / `flush_copies` order them against the block buffers).
Staging memory and the figures behind these choices: bench/engine/DECISIONS.md and bench/gpu/DECISIONS.md.

Fault injection for tests: a `FaultPoint` given by the serve verbs from the
``STRATA_ENGINE_SESSION_FAULT`` environment variable; never reachable from a request.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
from strata_sessionfile import (
    EngineIdentity,
    EngineLimits,
    LayerGeometry,
    LayerRole,
    LayerSpec,
    Part,
    RestoreMode,
    RestorePlan,
    RunningState,
    Snapshot,
)
from strata_sessionfile import errors as E
from strata_sessionfile import memory_available as sessionfile_memory_available
from strata_sessionfile.format import LIMIT

from ..errors import InjectedFault, PrefixUnreachable, SamplerStateError
from ..kv.pool import ring_byte_spans
from ..runner import RunnerState
from ..sampling import SamplerState
from .buffers import BlockBufferCache, block_buffers
from .fields import MAX_ENGINE_FIELDS_BYTES, EngineFieldsCodec
from .identity import runner_identity

log = logging.getLogger(__name__)

# File part -> the LayerKV attribute holding it.
PART_ATTR: dict[Part, str] = {Part.K: "k", Part.V: "v", Part.K_SCALES: "k_scale", Part.V_SCALES: "v_scale"}
# Staging is used only when this much RAM stays free beside the staged bytes.
STAGING_HEADROOM = 256 << 20


class FaultPoint(enum.Enum):
    """Where a test makes a save or restore fail (values are the environment variable's words)."""

    RESTORE_BEFORE_GATE = "restore-before-gate"  # check_plan raises: a clean refusal
    RESTORE_AFTER_GATE = "restore-after-gate"  # the second copy_in raises: the first block is applied
    RESTORE_AT_COMMIT = "restore-at-commit"  # commit / commit_staged raise after the pool was written
    SAVE_DURING_COPY = "save-during-copy"  # copy_out raises: the old file must stay


@attrs.define
class SamplerAccess:
    """How the adapter reads and replaces the sampler state (the slot's completer holds it)."""

    get: Callable[[], SamplerState]
    set: Callable[[SamplerState], None]

    @classmethod
    def holder(cls, state: SamplerState | None = None) -> SamplerAccess:
        box = [state or SamplerState.seeded(0)]
        return cls(lambda: box[0], lambda s: box.__setitem__(0, s))

    @classmethod
    def of_completer(cls, completer: Any) -> SamplerAccess:
        return cls(lambda: completer.sampler_state, lambda s: setattr(completer, "sampler_state", s))


@attrs.frozen
class PrefixCut:
    """A restore that keeps only a prefix of the file's conversation (RESTORE_PREFIX): the deepest resume
    point <= `cut_to`, refused before the gate when that is below `min_keep`."""

    cut_to: int
    min_keep: int = 0


@attrs.frozen
class _Prepared:
    """What check_plan established for the plan it was given: ready to commit."""

    plan_id: int
    runner_state: RunnerState
    sampler: SamplerState | None
    starts: tuple[int, ...]  # per layer: the first position the file's part holds
    keep: int  # tokens held after the commit (the file's, or the prefix a PrefixCut keeps)

    def same_tokens(self, tokens: Any) -> bool:
        mine = self.runner_state.tokens  # the plan's own token array: the commit normally passes it back
        return tokens is mine or tuple(tokens) == tuple(mine)


def _to_host(src: Any, dest: np.ndarray) -> None:
    if isinstance(src, np.ndarray):
        dest[...] = src
    else:  # a device array (cupy): one device -> host copy into the library's buffer
        src.get(out=dest)


class EngineSession:
    """The adapter (see the module docstring). One per runner; not thread-safe (one verb at a time
    uses it, on the scheduler's session thread, its slot busy meanwhile). `identity` may be given (tests write files under another engine version that way)."""

    def __init__(
        self,
        runner: Any,
        sampler: SamplerAccess | None = None,
        *,
        identity: EngineIdentity | None = None,
        staging: bool = True,
        memory_available: Callable[[], int | None] | None = None,
        fault: FaultPoint | None = None,
        buffers: BlockBufferCache | None = None,
        cut: PrefixCut | None = None,
        discard_held: bool = False,
        notes: str | None = None,
    ):
        self.runner = runner
        self.notes = notes  # a save's client text, kept in the engine fields (covered by the hashes and MAC)
        self.sampler = sampler or SamplerAccess.holder()
        self._identity = identity
        self.staging = staging
        self.memory_available = memory_available or sessionfile_memory_available
        self.fault = fault
        self.buffers = buffers
        self.cut = cut
        # The held conversation may be dropped (its owner saved it): a staged restore lands in the pool, as
        # into an empty engine, with no staging area (a refusal during the read leaves nothing held).
        self.discard_held = discard_held
        geometry = runner.kv_geometry
        self.kv_dtype = geometry.file_dtype
        self.specs = tuple(self._layer_spec(i) for i in range(geometry.n_layers))
        self.fields = EngineFieldsCodec(geometry)
        # Restore bookkeeping.
        self.live_touched = False  # the live pool was written by a restore that has not committed
        self.fail_stopped: BaseException | None = None
        self._prepared: _Prepared | None = None
        self._staged: list[list[np.ndarray | None]] | None = None
        self._staging_in_pool = False  # this staged restore lands in the (empty) pool itself
        self._copies_in = 0
        self._save_starts: tuple[int, ...] = ()
        self._flat: dict[tuple[int, Part], tuple[Any, int]] = {}

    # ---- identity and geometry -----------------------------------------------------------------
    def identity(self) -> EngineIdentity:
        if self._identity is None:
            self._identity = runner_identity(self.runner)
        return self._identity

    def _layer_spec(self, i: int) -> LayerSpec:
        g = self.runner.kv_geometry.layers[i]
        heads, dim = g.n_kv_heads, g.head_dim
        if g.scale_block:  # int8: one sub-head per scale, the format's rule (one scale per token and head)
            heads, dim = g.n_kv_heads * g.head_dim // g.scale_block, g.scale_block
        return LayerSpec(
            index=g.index,
            role=LayerRole.MAIN,
            n_kv_heads=heads,
            head_dim_k=dim,
            head_dim_v=dim,
            k_dtype=self.kv_dtype,
            v_dtype=self.kv_dtype,
            window=g.window or 0,
        )

    def limits(self) -> EngineLimits:
        return EngineLimits(
            max_tokens=self.runner.n_ctx,
            layers=self.specs,
            vocab_size=self.runner.config.n_vocab,
            max_sampler_state_bytes=len(SamplerState.seeded(0).to_bytes()),
            max_checkpoint_data_bytes=LIMIT["MAX_CHECKPOINT_DATA_BYTES"],
            max_engine_fields_bytes=MAX_ENGINE_FIELDS_BYTES,
        )

    def _starts(self, n: int) -> tuple[int, ...]:
        return tuple(n - spec.capacity(n) for spec in self.specs)

    # ---- the pool's bytes ----------------------------------------------------------------------
    def _slot_array(self, layer: int, part: Part) -> Any:
        """The part's slot array in the memory session bytes move through (a device-mapped pool's host side)."""
        arr = getattr(self.runner.pool.io_layer(layer), PART_ATTR[part])
        if arr is None:
            raise E.GeometryMismatch(f"layer {layer} has no {part.name} part", field=f"layers[{layer}]")
        return arr

    def _flat_slots(self, layer: int, part: Part) -> tuple[Any, int]:
        """(flat byte view of the part's slots, slot count): the pool's own view (`KVPool.part_bytes`, made
        once per pool), looked up once per adapter."""
        key = (layer, part)
        got = self._flat.get(key)
        if got is None:
            capacity = int(self._slot_array(layer, part).shape[0])
            got = self._flat[key] = (self.runner.pool.part_bytes(layer, PART_ATTR[part]), capacity)
        return got

    def _segments(self, layer: int, part: Part, start: int, offset: int, length: int):
        """(flat slot-byte view, `ring_byte_spans`) for bytes [offset, offset+length) of the part whose
        first logical position is `start`."""
        flat, capacity = self._flat_slots(layer, part)
        return flat, ring_byte_spans(start, offset, length, capacity, int(flat.shape[0]) // capacity)

    # ---- SessionSource (save) -------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        runner = self.runner
        state: RunnerState = runner.snapshot_state()
        n = state.position
        layers = tuple(LayerGeometry(spec, spec.capacity(n)) for spec in self.specs)
        starts = self._starts(n)
        for i in self.fields.ring_layers:
            if starts[i] < runner.pool.ring_start:
                raise E.InvalidSnapshot(
                    f"layer {i} must save positions [{starts[i]}, {n}) but its ring holds from "
                    f"{runner.pool.ring_start} only",
                    field=f"layers[{i}]",
                )
        checkpoint, engine_fields = self.fields.encode(
            n, state.deepest_checkpoint, runner.pool.ops.to_host, self.notes
        )
        running = RunningState(
            tokens=state.tokens,
            position=n,
            sampler_state=self.sampler.get().to_bytes(),
            checkpoint=checkpoint,
            engine_fields=engine_fields,
        )
        self._save_starts = starts
        runner.pool.ops.synchronize()  # queued device work lands before copy_out reads the pool (once per save)
        return Snapshot(running, layers)

    def copy_out(self, layer: int, part: Part, offset: int, dest: memoryview) -> None:
        if self.fault is FaultPoint.SAVE_DURING_COPY:
            raise InjectedFault("injected fault: save, during the copy")
        out = np.frombuffer(dest, dtype=np.uint8)
        flat, segs = self._segments(layer, part, self._save_starts[layer], offset, len(dest))
        for lo, hi, d in segs:
            _to_host(flat[lo:hi], out[d : d + hi - lo])

    # ---- SessionTarget (restore) ----------------------------------------------------------------
    def check_plan(self, plan: RestorePlan) -> None:
        if self.fault is FaultPoint.RESTORE_BEFORE_GATE:
            raise InjectedFault("injected fault: restore, before the gate")
        st = plan.state
        n = st.n_tokens
        where: dict[str, Any] = {"path": plan.path}
        if st.position != n:
            raise E.InconsistentState(
                f"position {st.position} differs from the {n} tokens held", field="state.position", **where
            )
        ring_start, checkpoints = self.fields.decode(st, where)
        sampler = None
        if st.sampler_state:
            try:
                sampler = SamplerState.from_bytes(st.sampler_state)
            except SamplerStateError as exc:
                raise E.InconsistentState(str(exc), field="state.sampler_state", **where) from None
        runner_state = RunnerState(st.tokens, ring_start, checkpoints)  # the file's int32 array, no copy
        problems = self.runner.state_problems(runner_state)
        if problems:
            raise E.InconsistentState("; ".join(problems), field="state", **where)
        keep = n
        if self.cut is not None:
            keep = self.runner.resume_point(runner_state, self.cut.cut_to)
            if keep < self.cut.min_keep:
                raise PrefixUnreachable(
                    f"{plan.path}: the deepest resume point at or below {self.cut.cut_to} of its {n} tokens is "
                    f"{keep}, below the {self.cut.min_keep} asked for",
                    keep,
                )
        self._prepared = _Prepared(id(plan), runner_state, sampler, self._starts(n), keep)

    def _require_prepared(self, plan: RestorePlan) -> _Prepared:
        if self._prepared is None or self._prepared.plan_id != id(plan):
            raise E.AdapterFailed("the engine was asked to apply a plan it did not check")
        return self._prepared

    def _prepared_starts(self) -> tuple[int, ...]:
        """Where each layer's slots start for the plan check_plan prepared (K/V bytes come after it)."""
        if self._prepared is None:
            raise E.AdapterFailed("K/V bytes arrived for a plan the engine did not check")
        return self._prepared.starts

    def begin_apply(self, plan: RestorePlan) -> None:
        self._require_prepared(plan)
        self.runner.pool.ops.synchronize()  # queued device work must not race the host writes that follow
        self.live_touched = True
        self._copies_in = 0

    def copy_in(self, layer: int, part: Part, offset: int, src: memoryview) -> None:
        """Into a device pool the copy is only queued (see `wait_copies`)."""
        self._count_copy_in()
        self._write_pool(layer, part, offset, np.frombuffer(src, dtype=np.uint8), self._prepared_starts())

    def wait_copies(self) -> None:
        """The library's block buffers are refilled only after this: the device copies queued from them by
        copy_in / stage_in have read them (AsyncCopyTarget)."""
        self.runner.pool.ops.synchronize()

    def flush_copies(self) -> None:
        """A block's pieces were all handed over: queue the copy that `copy_bytes` still held back to merge
        with a next piece, so it runs while the library hashes the block (MergingCopyTarget), not after it
        (bench/gpu/DECISIONS.md "Session I/O on the device")."""
        self.runner.pool.ops.flush_copies()

    def _count_copy_in(self) -> None:
        self._copies_in += 1
        if self.fault is FaultPoint.RESTORE_AFTER_GATE and self._copies_in > 1:
            raise InjectedFault("injected fault: restore, after the first applied block")

    # ---- LandingTarget (zero-copy restore) ------------------------------------------------------
    def can_land(self, plan: RestorePlan) -> bool:
        """Whether the file's bytes can be read straight into host memory: the staging area when it is
        host memory (staged), the pool's slots when they are (streaming: a host pool or the host side of
        a device-mapped pool). Touches nothing."""
        if plan.mode is RestoreMode.STAGED:
            return not self.runner.pool.capabilities.device_staging
        return isinstance(self._slot_array(0, Part.K), np.ndarray)

    def landing_views(self, layer: int, part: Part, offset: int, length: int) -> list[memoryview]:
        if self._staged is not None:  # staged: the staging area, never the live pool
            dest = self._staged[layer][part]
            assert dest is not None  # None only for an empty part, which has no bytes to land
            return [dest[offset : offset + length].data]  # a memoryview of the slice
        if (
            self._staging_in_pool
        ):  # staged into a pool that holds nothing: its slots (no conversation to keep)
            flat, segs = self._segments(layer, part, self._prepared_starts()[layer], offset, length)
            return [memoryview(flat[lo:hi]) for lo, hi, _d in segs]
        # streaming, after the gate (begin_apply): the live pool's slots
        if self._prepared is None or not self.live_touched:
            raise E.AdapterFailed("landing_views for the live pool before the gate")
        self._count_copy_in()
        flat, segs = self._segments(layer, part, self._prepared.starts[layer], offset, length)
        return [memoryview(flat[lo:hi]) for lo, hi, _d in segs]

    def _write_pool(self, layer: int, part: Part, offset: int, src: Any, starts: tuple[int, ...]) -> None:
        """Bytes [offset, offset + len(src)) of a part into the live pool's slots (see `_write_slots`)."""
        self.live_touched = True
        self._write_slots(layer, part, offset, src, starts)

    def _write_slots(self, layer: int, part: Part, offset: int, src: Any, starts: tuple[int, ...]) -> None:
        """Bytes [offset, offset + len(src)) of a part into the pool's slots; a copy into device memory is
        only queued (synchronise before `src` is reused)."""
        flat, segs = self._segments(layer, part, starts[layer], offset, len(src))
        copy = self.runner.pool.ops.copy_bytes
        for lo, hi, d in segs:
            copy(flat, lo, src[d : d + hi - lo])

    def commit(self, state: RunningState) -> None:
        prepared = self._prepared
        if prepared is None or not prepared.same_tokens(state.tokens):
            raise E.AdapterFailed("commit with a running state that check_plan did not see")
        if self.fault is FaultPoint.RESTORE_AT_COMMIT:
            raise InjectedFault("injected fault: restore, at the commit")
        # The pool was written in place (queued device copies land first); the extent, the resident rings
        # (refill), the tokens and the checkpoints follow in one call, then the sampler.
        self.runner.pool.ops.synchronize()
        self.runner.restore_state(prepared.runner_state)
        if prepared.keep < self.runner.n_held:
            self.runner.cut_back(prepared.keep)
        if prepared.sampler is not None:
            self.sampler.set(prepared.sampler)
        self.live_touched = False
        self._prepared = None

    def fail_stop(self, error: Exception) -> None:
        """The live pool holds bytes nobody vouches for: drop the conversation so nothing decodes from
        it (the serve verb then exits with the fail-stop status)."""
        self.fail_stopped = error
        self._staged = None
        self._prepared = None
        try:
            self.runner.pool.ops.synchronize()  # no queued copy may land in the pool after it was erased
            self.runner.erase()
        except Exception:  # the process is going down; the original error is what matters
            log.exception("erase after a fail-stop failed")

    # ---- StagingTarget (staged restore) --------------------------------------------------------
    def staging_bytes(self, plan: RestorePlan) -> int:
        return sum(g.n_bytes for g in plan.layers)

    def _stages_in_pool(self) -> bool:
        """A staged restore into an engine that holds nothing (a fresh process: the restart this is for)
        lands in the pool itself: there is no conversation for a staging area to keep, so none is
        allocated, faulted in or copied, and there is no switch (bench/engine/DECISIONS.md "Staging into an empty pool"). A refused file then
        leaves the pool as empty as it was (its bytes unreachable: nothing is held). So does a restore told
        it may drop the held conversation (`discard_held`): a refusal during the read leaves nothing held."""
        return self.discard_held or (self.runner.n_held == 0 and not self.runner.checkpoints)

    def can_stage(self, plan: RestorePlan) -> bool:
        if not self.staging:
            return False
        if self._stages_in_pool():
            return True
        pool = self.runner.pool
        have = pool.device_free_bytes() if pool.capabilities.device_staging else self.memory_available()
        return have is None or self.staging_bytes(plan) + STAGING_HEADROOM <= have

    def begin_staging(self, plan: RestorePlan) -> None:
        self._require_prepared(plan)
        if self._stages_in_pool():
            self._staging_in_pool = True
            return
        # A device pool stages in VRAM (the switch is then a device copy); others in host memory. Either
        # way one allocation carved into the parts: one mapping to fault in (host), one allocation from
        # the device memory pool instead of one per part (device).
        nbytes, pool = self.staging_bytes(plan), self.runner.pool
        if pool.capabilities.device_staging:
            area = pool.staging_array(nbytes)
        elif self.buffers is not None:
            area = self.buffers.staging(nbytes, reserve=pool.nbytes)
        else:
            area = np.empty(nbytes, dtype=np.uint8)
        staged, lo = [], 0
        for g in plan.layers:
            row: list[np.ndarray | None] = []
            for p in Part:
                n = g.part_size(p)
                row.append(area[lo : lo + n] if n else None)
                lo += n
            staged.append(row)
        assert lo == len(area)
        self._staged = staged

    def stage_in(self, layer: int, part: Part, offset: int, src: memoryview) -> None:
        """Into a VRAM staging area the copy is only queued (see `wait_copies`)."""
        data = np.frombuffer(src, dtype=np.uint8)
        if self._staging_in_pool:
            self._write_slots(layer, part, offset, data, self._prepared_starts())
            return
        assert self._staged is not None
        self.runner.pool.ops.copy_bytes(self._staged[layer][part], offset, data)

    def block_buffers(self, count: int, nbytes: int) -> list[memoryview]:
        return block_buffers(self.runner.pool, self.buffers, count, nbytes)

    def commit_staged(self, state: RunningState) -> None:
        staged, prepared = self._staged, self._prepared
        if self._staging_in_pool:  # the bytes are in the pool already: adopt the state (a failure: discard)
            if prepared is None or not prepared.same_tokens(state.tokens):
                raise E.AdapterFailed("commit_staged without a staged session that check_plan saw")
            self.commit(state)
            self._staging_in_pool = False
            return
        if staged is None or prepared is None or not prepared.same_tokens(state.tokens):
            raise E.AdapterFailed("commit_staged without a staged session that check_plan saw")
        # The switch: every check passed; from the first byte written the live conversation is replaced
        # (a failure from here on is a fail-stop, see live_touched).
        self.runner.pool.ops.synchronize()
        try:
            for layer, parts in enumerate(staged):
                for part, data in enumerate(parts):
                    if data is not None:  # queued device copies; one sync after every part
                        self._write_pool(layer, Part(part), 0, data, prepared.starts)
            self.runner.pool.ops.synchronize()
        finally:
            self._drop_staged()
        self.commit(state)

    def discard_staged(self) -> None:
        self.runner.pool.ops.synchronize()  # no queued copy may still write the staging area once it is freed
        if self._staging_in_pool:  # the pool held nothing before: it holds nothing again
            self._staging_in_pool = False
            self.runner.erase()
        self._drop_staged()
        if not self.live_touched:
            self._prepared = None

    def _drop_staged(self) -> None:
        self._staged = None
        if self.buffers is not None:
            self.buffers.staging_done()
