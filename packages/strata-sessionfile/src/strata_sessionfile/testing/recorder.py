"""Wrappers the conformance cases restore and save through: a ``Recorder`` forwards to an adapter, records
the restore-side calls it receives and runs a case's hooks before them; ``IdentityOverride`` saves an
adapter's session under another identity."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from ..adapter import LandingTarget, StagingTarget
from ..records import EngineIdentity


class Recorder:
    """Forwards to an adapter and records which restore-side calls it received."""

    def __init__(self, inner, hooks: dict[str, Callable] | None = None) -> None:
        self._inner = inner
        self.calls: list[str] = []
        self.hooks = hooks or {}

    def _call(self, name: str, *args):
        self.calls.append(name)
        hook = self.hooks.get(name)
        if hook is not None:
            hook(*args)
        return getattr(self._inner, name)(*args)

    def identity(self):
        return self._inner.identity()

    def limits(self):
        return self._inner.limits()

    def snapshot(self):
        return self._inner.snapshot()

    def copy_out(self, *a):
        return self._inner.copy_out(*a)

    def check_plan(self, plan):
        return self._call("check_plan", plan)

    def begin_apply(self, plan):
        return self._call("begin_apply", plan)

    def copy_in(self, *a):
        return self._call("copy_in", *a)

    def commit(self, state):
        return self._call("commit", state)

    def fail_stop(self, error):
        return self._call("fail_stop", error)

    @property
    def touched(self) -> bool:
        return any(c in ("begin_apply", "copy_in", "commit", "fail_stop", "commit_staged") for c in self.calls)


class StagingRecorder(Recorder):
    def can_stage(self, plan):
        return self._inner.can_stage(plan)

    def begin_staging(self, plan):
        return self._call("begin_staging", plan)

    def stage_in(self, *a):
        return self._call("stage_in", *a)

    def commit_staged(self, state):
        return self._call("commit_staged", state)

    def discard_staged(self):
        return self._call("discard_staged")


class LandingCalls:
    """Forwards the LandingTarget calls of an adapter that has them."""

    def can_land(self, plan):
        return self._inner.can_land(plan)

    def landing_views(self, *a):
        return self._call("landing_views", *a)


class LandingRecorder(LandingCalls, Recorder):
    pass


class LandingStagingRecorder(LandingCalls, StagingRecorder):
    pass


def recorder(adapter, hooks: dict[str, Callable] | None = None) -> Recorder:
    staging, landing = isinstance(adapter, StagingTarget), isinstance(adapter, LandingTarget)
    cls = {(False, False): Recorder, (True, False): StagingRecorder, (False, True): LandingRecorder,
           (True, True): LandingStagingRecorder}[staging, landing]
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
