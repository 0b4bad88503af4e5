"""Wrappers the conformance cases restore and save through: a ``Recorder`` forwards to an adapter, records
the restore-side calls it receives and runs a case's hooks before them; ``IdentityOverride`` saves an
adapter's session under another identity."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from ..adapter import LandingTarget, StagingTarget
from ..records import EngineIdentity


def _recorded(name: str):
    """A method that records the call, runs the case's hook for it, then forwards it."""

    def method(self, *args):
        self.calls.append(name)
        hook = self.hooks.get(name)
        if hook is not None:
            hook(*args)
        return getattr(self._inner, name)(*args)

    method.__name__ = name
    return method


def _forwarded(name: str):
    """A method that only forwards the call."""

    def method(self, *args):
        return getattr(self._inner, name)(*args)

    method.__name__ = name
    return method


class Recorder:
    """Forwards to an adapter and records which restore-side calls it received."""

    LIVE_CALLS = (
        "begin_apply",
        "copy_in",
        "commit",
        "fail_stop",
        "commit_staged",
    )  # what changes a live session

    def __init__(self, inner, hooks: dict[str, Callable] | None = None) -> None:
        self._inner = inner
        self.calls: list[str] = []
        self.hooks = hooks or {}

    identity, limits, snapshot, copy_out = (
        _forwarded(n) for n in ("identity", "limits", "snapshot", "copy_out")
    )
    check_plan, begin_apply, copy_in, commit, fail_stop = (
        _recorded(n) for n in ("check_plan", "begin_apply", "copy_in", "commit", "fail_stop")
    )

    @property
    def touched(self) -> bool:
        return any(c in self.LIVE_CALLS for c in self.calls)


class StagingRecorder(Recorder):
    can_stage = _forwarded("can_stage")
    begin_staging, stage_in, commit_staged, discard_staged = (
        _recorded(n) for n in ("begin_staging", "stage_in", "commit_staged", "discard_staged")
    )


class LandingCalls:
    """Forwards the LandingTarget calls of an adapter that has them."""

    can_land, landing_views = _forwarded("can_land"), _recorded("landing_views")


class LandingRecorder(LandingCalls, Recorder):
    pass


class LandingStagingRecorder(LandingCalls, StagingRecorder):
    pass


def recorder(adapter, hooks: dict[str, Callable] | None = None) -> Recorder:
    staging, landing = isinstance(adapter, StagingTarget), isinstance(adapter, LandingTarget)
    cls = {
        (False, False): Recorder,
        (True, False): StagingRecorder,
        (False, True): LandingRecorder,
        (True, True): LandingStagingRecorder,
    }[staging, landing]
    return cls(adapter, hooks)


@attrs.define
class IdentityOverride:
    """A SessionSource that writes the inner adapter's session under another identity."""

    inner: object
    ident: EngineIdentity

    def identity(self):
        return self.ident

    def snapshot(self):
        return self.inner.snapshot()

    def copy_out(self, *a):
        return self.inner.copy_out(*a)
