"""The adapter protocol: what an engine implements so this library can save and restore its session.

The library drives, the engine answers. ``identity()`` is called on every save and restore: compute the
fingerprints once (at model load) and return the cached value. Every adapter method is called on the thread that called
``save``/``restore``; the library's own helper threads only read, write and hash file bytes.

Save (``SessionSource``): ``identity()``, ``snapshot()`` (frozen for the duration of the save), then
``copy_out(layer, part, offset, dest)`` for every piece of every non-empty part, in file order. ``dest``
is a writable memoryview of exactly the bytes to fill; it must be filled when the call returns.

Restore (``SessionTarget``), streaming mode: ``identity()``, ``limits()``, the read pass (no adapter
call), ``check_plan(plan)`` (raise a ``SessionFileError`` such as ``GeometryMismatch`` to refuse),
then the gate: ``begin_apply(plan)``, ``copy_in(layer, part, offset, src)`` for every piece (``src`` is
read-only and valid only during the call), and ``commit(state)`` (which includes any residency refill).
If anything fails after ``begin_apply`` was called, ``fail_stop(error)`` is called and ``FailStop`` is
raised: the engine must not decode from its K/V any more. Before the gate, a failure calls nothing.

Restore, staged mode (``StagingTarget``, optional): ``can_stage(plan)`` says whether a staging area
fits; then ``begin_staging(plan)``, ``stage_in(...)`` while the payload hash runs, and only after every
check ``commit_staged(state)`` -- or ``discard_staged()`` on any failure, leaving the live session as it
was. One read of the file.

Buffers (``BufferProvider``, optional): ``block_buffers(count, nbytes)`` returns ``count`` writable
memoryviews of ``nbytes`` each (e.g. pinned host memory) that the library uses as its block buffers: 2 on
a save, one per reader thread + 1 on a restore. Keep what was made and add to it (a save and a restore
alternate); the views are used until the call returns, never after.

Landing (``LandingTarget``, optional, for a restore into host memory; not used for a compressed data
section): ``can_land(plan)`` (before the gate; touches nothing) says whether every piece of this restore
can be read straight into the engine's memory; if so, ``landing_views(layer, part, offset, length)``
replaces ``copy_in`` (streaming: called only after ``begin_apply``; the views are the live K/V) or
``stage_in`` (staged: after ``begin_staging``; the views are the staging area, never K/V the engine serves
from -- an engine that holds nothing may stage into its own pool), and
returns writable views in order (e.g. two for a ring that wraps) whose lengths add up to ``length``. The
library reads the file into them and hashes them there; every check, the gate and fail-stop apply
exactly as with the copying calls.

Asynchronous copies (``AsyncCopyTarget``, optional): ``copy_in`` / ``stage_in`` may return before their
copy has read ``src`` (e.g. a host-to-device DMA queued from the adapter's pinned block buffers) when the
adapter implements ``wait_copies()``, which returns once every copy it started has read its source. The
library calls it before it refills or frees any memory it handed to ``copy_in`` / ``stage_in``, and once
after the last piece of a pass (also when the pass fails), so no copy outlives the pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from . import errors as E
from .format import Part
from .records import EngineIdentity, EngineLimits, RestorePlan, RunningState, Snapshot


def adapter_call(fn, *args):
    """Call an adapter method: a SessionFileError passes through, anything else becomes AdapterFailed."""
    try:
        return fn(*args)
    except E.SessionFileError:
        raise
    except Exception as exc:
        raise E.AdapterFailed(
            f"adapter {getattr(fn, '__name__', fn)} raised {type(exc).__name__}: {exc}"
        ) from exc


@runtime_checkable
class SessionSource(Protocol):
    def identity(self) -> EngineIdentity: ...

    def snapshot(self) -> Snapshot: ...

    def copy_out(self, layer: int, part: Part, offset: int, dest: memoryview) -> None:
        """Fill ``dest`` with bytes [offset, offset + len(dest)) of part ``part`` of layer ``layer``
        (a position in ``snapshot().layers``)."""


@runtime_checkable
class SessionTarget(Protocol):
    def identity(self) -> EngineIdentity: ...

    def limits(self) -> EngineLimits: ...

    def check_plan(self, plan: RestorePlan) -> None:
        """Refuse (raise a SessionFileError) a plan this engine cannot take. Must not touch live state."""

    def begin_apply(self, plan: RestorePlan) -> None:
        """The gate: from this call on the live K/V may be overwritten."""

    def copy_in(self, layer: int, part: Part, offset: int, src: memoryview) -> None:
        """Copy ``src`` to bytes [offset, offset + len(src)) of part ``part`` of layer ``layer``."""

    def commit(self, state: RunningState) -> None:
        """Adopt the running state after every block was applied and every check passed."""

    def fail_stop(self, error: Exception) -> None:
        """A failure after the gate: the K/V can no longer be vouched for."""


@runtime_checkable
class StagingTarget(SessionTarget, Protocol):
    def can_stage(self, plan: RestorePlan) -> bool: ...

    def begin_staging(self, plan: RestorePlan) -> None: ...

    def stage_in(self, layer: int, part: Part, offset: int, src: memoryview) -> None: ...

    def commit_staged(self, state: RunningState) -> None:
        """Switch the session to the staged K/V and this state, atomically for the engine."""

    def discard_staged(self) -> None: ...


class _Applies(Protocol):
    def begin_apply(self, plan: RestorePlan) -> None: ...

    def copy_in(self, layer: int, part: Part, offset: int, src: memoryview) -> None: ...

    def commit(self, state: RunningState) -> None: ...

    def discard(self) -> None: ...


class StagesByApplying:
    """The StagingTarget of a target whose applying already builds the restore aside (nothing live is touched
    before its commit): staging is the same path, so the file is read once; `discard` drops what was built."""

    def can_stage(self, plan: RestorePlan) -> bool:
        return True

    def begin_staging(self: _Applies, plan: RestorePlan) -> None:
        self.begin_apply(plan)

    def stage_in(self: _Applies, layer: int, part: Part, offset: int, src: memoryview) -> None:
        self.copy_in(layer, part, offset, src)

    def commit_staged(self: _Applies, state: RunningState) -> None:
        self.commit(state)

    def discard_staged(self: _Applies) -> None:
        self.discard()


@runtime_checkable
class BufferProvider(Protocol):
    def block_buffers(self, count: int, nbytes: int) -> Sequence[memoryview]: ...


@runtime_checkable
class AsyncCopyTarget(Protocol):
    def wait_copies(self) -> None:
        """Return once every copy that copy_in / stage_in started has read its source."""


@runtime_checkable
class MergingCopyTarget(Protocol):
    def flush_copies(self) -> None:
        """Start every copy that copy_in / stage_in held back to merge it with a next piece (called after the
        last piece of each block, so that block's copy runs while the library hashes it)."""


@runtime_checkable
class LandingTarget(Protocol):
    def can_land(self, plan: RestorePlan) -> bool:
        """Whether every piece of this plan (in its mode) can be read straight into the engine's memory."""

    def landing_views(self, layer: int, part: Part, offset: int, length: int) -> Sequence[memoryview]:
        """Writable views where bytes [offset, offset + length) of the part go (live K/V after the gate in
        streaming mode, the staging area in staged mode), in order."""


class SessionAdapter(SessionSource, SessionTarget, Protocol):
    """An adapter that both saves and restores (what an engine usually implements)."""
