"""transfer(): a session from one adapter straight into another gives the target exactly what a restore of
the source's saved file gives it, with the same refusals before anything is touched, and the gate's rules
after (staged: the live session kept; streaming: fail-stop)."""

from __future__ import annotations

import pytest
from strata_sessionfile import errors as E
from strata_sessionfile import restore, save, transfer
from strata_sessionfile.testing import fake_identity, memory_adapter_factory

from .helpers import COPYING, COPYING_STAGING, LANDING, LANDING_STAGING, LIVE_TOUCH, TOUCH

TARGETS = {
    "copying": COPYING,
    "staged": COPYING_STAGING,
    "landing": LANDING,
    "landing-staged": LANDING_STAGING,
}


@pytest.mark.parametrize("block_size", [4096, 1 << 20])
@pytest.mark.parametrize("kind", TARGETS)
def test_transfer_equals_restoring_the_saved_file(tmp_path, kind, block_size):
    source = COPYING(1)
    path = tmp_path / "s.ssf"
    save(path, source, block_size=4096)
    restored, moved = TARGETS[kind](2), TARGETS[kind](2)
    restore(path, restored, block_size=block_size)
    report = transfer(source, moved, path="memory", block_size=block_size)
    assert moved.live_digest() == restored.live_digest() == source.live_digest()
    assert report.n_tokens == source.state.n_tokens and report.mode.value == (
        "staged" if "staged" in kind else "streaming"
    )
    landed = "landing_views" in moved.events
    assert landed is kind.startswith("landing")


@pytest.mark.parametrize("kind", ["copying", "staged"])
def test_another_models_session_is_refused_before_the_target_is_touched(kind):
    other = memory_adapter_factory(n_tokens=200, identity=fake_identity("another-model"))(1)
    target = TARGETS[kind](2)
    before = target.live_digest()
    with pytest.raises(E.ModelMismatch):
        transfer(other, target)
    assert not TOUCH & set(target.events) and target.live_digest() == before


def test_a_session_past_the_targets_limits_is_refused_before_the_target_is_touched():
    target = COPYING_STAGING(2)
    target.max_tokens = 100  # the source holds 201 tokens
    with pytest.raises(E.LimitExceeded):
        transfer(COPYING(1), target)
    assert not TOUCH & set(target.events)


def test_a_source_changed_under_a_staged_transfer_keeps_the_live_session():
    target = LANDING_STAGING(2)
    before = target.live_digest()
    with pytest.raises(E.FileChanged):
        transfer(COPYING(1), target, changed=lambda: True)
    assert target.events[-1] == "discard_staged"
    assert not LIVE_TOUCH & set(target.events) and target.live_digest() == before


def test_a_source_failing_after_the_gate_fail_stops_the_streaming_target():
    source, target = COPYING(1), COPYING(2)
    calls = []

    def failing(layer, part, offset, dest):
        calls.append(layer)
        if len(calls) == 3:
            raise OSError(5, "Input/output error")
        return type(source).copy_out(source, layer, part, offset, dest)

    source.copy_out = failing  # type: ignore[method-assign]
    with pytest.raises(E.FailStop):
        transfer(source, target, block_size=4096)
    assert "begin_apply" in target.events and target.fail_stopped is not None
