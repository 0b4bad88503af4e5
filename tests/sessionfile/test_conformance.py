"""The conformance kit passes the reference adapter (streaming and staging) and catches broken adapters."""

from __future__ import annotations

import pytest
from strata_sessionfile.testing import (
    CASES,
    ConformanceFailure,
    MemoryAdapter,
    memory_adapter_factory,
    run_conformance,
)


@pytest.mark.parametrize("staging", [False, True])
def test_reference_adapter_passes(tmp_path, staging):
    ran = run_conformance(memory_adapter_factory(n_tokens=200, staging=staging), tmp_path, random_flips=48)
    assert ran == [case.name for case in CASES if staging or case.name != "staged"]  # in the table's order
    assert (
        ran[:7]
        == [
            "round_trip",
            "truncation",
            "header_flips",
            "payload_flips",
            "binding",
            "gate_before",
            "gate_after",
        ]
        and ran[-1] == "file_types"
    )


class _OffsetBlindCopyIn(MemoryAdapter):
    def copy_in(self, layer, part, offset, src):
        super().copy_in(layer, part, 0, src)


class _ForgetfulCommit(MemoryAdapter):
    def commit(self, state):
        self.events.append("commit")


class _EagerCheckPlan(MemoryAdapter):
    """Starts overwriting live K/V in check_plan: before the gate."""

    def check_plan(self, plan):
        super().check_plan(plan)
        for parts in self.parts:
            for p in parts:
                p[:] = bytes(len(p))


@pytest.mark.parametrize(
    "cls,expect",
    [
        (_OffsetBlindCopyIn, "round_trip"),
        (_ForgetfulCommit, "round_trip"),
        (_EagerCheckPlan, "a refused restore changed the live session"),
    ],
)
def test_broken_adapters_fail(tmp_path, cls, expect):
    base = memory_adapter_factory(n_tokens=200)

    def factory(seed):
        good = base(seed)
        bad = cls(good.identity(), good.specs)
        return bad.load_snapshot(good.snapshot(), seed)

    with pytest.raises(ConformanceFailure) as info:
        run_conformance(factory, tmp_path, random_truncations=2, random_flips=2)
    assert any(expect in f for f in info.value.failures), info.value.failures
