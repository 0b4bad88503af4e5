"""transfer(): a session handed from a ``SessionSource`` straight to a ``SessionTarget``, with no file in
between (e.g. a llama.cpp slot file's ``SlotSource`` into an engine).

The target sees exactly what a restore of the format v1 file ``save(source)`` would write shows it: the
plan's metadata is that file's, encoded and decoded again, and the same checks run in the same order
(binding B1/B2 against the target's identity, the limits B3-B6, ``check_plan``). Then one pass:

- staged where the target can stage it (the live session is kept until ``commit_staged``; any failure
  calls ``discard_staged``);
- else streaming behind the gate (``begin_apply`` on the first piece; after it a failure calls
  ``fail_stop`` and raises ``FailStop``).

Pieces land straight in the target's memory where it offers landing views (the source fills them), else
go through one block buffer. ``changed`` (optional) is asked before the commit whether the source's bytes
changed under it (``FileChanged`` if so).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from . import errors as E
from .adapter import LandingTarget, SessionSource, SessionTarget, StagingTarget, adapter_call
from .apply import block_handed_over, copy_waiter, fail_stop
from .codec import (
    compute_layout,
    decode_header,
    decode_metadata,
    encode_header,
    encode_metadata,
    payload_length_of,
)
from .format import DEFAULT_BLOCK_SIZE, TRAILER_SIZE
from .memory import MIN_BLOCK_SIZE, block_buffers
from .records import PartExtent, Phase, Progress, RestoreMode, RestorePlan, RestoreReport
from .validate import binding_check, check_limits

# What a piece goes to: copy_in (streaming) or stage_in (staged), as (layer, part, offset, bytes).
Deliver = Callable[..., object]


def _plan(source: SessionSource, target: SessionTarget, path: str, mode: RestoreMode) -> RestorePlan:
    """The plan a restore of ``save(source)``'s file would make, checked against the target's engine."""
    identity = adapter_call(source.identity)
    snapshot = adapter_call(source.snapshot)
    try:
        metadata = encode_metadata(identity.model, identity.config, snapshot.state, snapshot.layers)
    except E.SessionFileError as exc:
        exc.path = path
        raise
    layout = compute_layout(len(metadata) - 4, snapshot.layers, TRAILER_SIZE)
    raw = encode_header(identity.model.fingerprint, identity.config.fingerprint, payload_length_of(layout))
    header = decode_header(raw, path=path)
    body = memoryview(metadata)[4:]
    binding_check(header, body, adapter_call(target.identity), path)
    decoded = decode_metadata(body, header=header, path=path)
    check_limits(decoded, adapter_call(target.limits), path)
    return RestorePlan(path, header, decoded, layout, None, mode)


def _pieces(extent: PartExtent, block_size: int):
    """(offset, length) of the part's pieces of at most one block."""
    for offset in range(0, extent.size, block_size):
        yield offset, min(block_size, extent.size - offset)


def transfer(
    source: SessionSource,
    target: SessionTarget,
    *,
    path: str = "",
    mode: RestoreMode | str = RestoreMode.AUTO,
    block_size: int = DEFAULT_BLOCK_SIZE,
    progress: Callable[[Progress], None] | None = None,
    changed: Callable[[], bool] | None = None,
) -> RestoreReport:
    """Restore ``source``'s session into ``target`` (see the module docstring). ``path`` names the source in
    errors and in the report."""
    if block_size < MIN_BLOCK_SIZE:
        raise ValueError(f"block_size must be at least {MIN_BLOCK_SIZE}")
    mode = RestoreMode(mode)
    t0 = time.perf_counter()
    plan = _plan(source, target, path, RestoreMode.STREAMING)
    stager: StagingTarget | None = None
    if mode is not RestoreMode.STREAMING and isinstance(target, StagingTarget):
        staged_plan = RestorePlan(path, plan.header, plan.metadata, plan.layout, None, RestoreMode.STAGED)
        if adapter_call(target.can_stage, staged_plan):
            stager, plan = target, staged_plan
    if mode is RestoreMode.STAGED and stager is None:
        raise E.StagingUnavailable(
            "staged restore requested but the adapter cannot stage this session", path=path
        )
    lander = target if isinstance(target, LandingTarget) and adapter_call(target.can_land, plan) else None
    adapter_call(target.check_plan, plan)
    t_checked = time.perf_counter()
    total = plan.layout.data_length
    buffer = None if lander is not None else block_buffers(target, block_size, None, 2)[0]
    waiter, handed_over = copy_waiter(target), block_handed_over(target)

    def run(deliver: Deliver) -> None:
        done = 0
        for extent in plan.layout.extents:
            if lander is not None:
                offset = 0
                for view in adapter_call(lander.landing_views, extent.layer, extent.part, 0, extent.size):
                    adapter_call(source.copy_out, extent.layer, extent.part, offset, view)
                    offset += len(view)
            else:
                assert buffer is not None
                for offset, length in _pieces(extent, block_size):
                    piece = buffer[:length]
                    adapter_call(source.copy_out, extent.layer, extent.part, offset, piece)
                    deliver(extent.layer, extent.part, offset, piece.toreadonly())
                    handed_over()
                    if waiter is not None:  # the one buffer is refilled next
                        waiter()
            done += extent.size
            if progress is not None:
                progress(Progress(Phase.APPLY, done, total))
        if changed is not None and changed():
            raise E.FileChanged("the source changed while it was restored", path=path)

    if stager is not None:
        try:
            adapter_call(stager.begin_staging, plan)
            run(lambda *piece: adapter_call(stager.stage_in, *piece))
            adapter_call(stager.commit_staged, plan.state)
        except BaseException:
            try:
                stager.discard_staged()
            except Exception:  # the original failure is what the caller must see
                pass
            raise
    else:
        adapter_call(target.begin_apply, plan)  # the gate: from here on a failure is a fail-stop
        try:
            run(lambda *piece: adapter_call(target.copy_in, *piece))
            adapter_call(target.commit, plan.state)
        except BaseException as exc:
            raise fail_stop(target, exc, path) from exc
    t_end = time.perf_counter()
    return RestoreReport(
        path, plan.mode, plan.state.n_tokens, total, total, t_end - t0, t_checked - t0, t_end - t_checked
    )
