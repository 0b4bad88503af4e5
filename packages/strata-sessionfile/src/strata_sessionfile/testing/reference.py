"""The reference adapter: ``MemoryAdapter`` (K/V parts held as bytearrays), the sessions it holds
(``make_snapshot`` from a seed), and ``memory_adapter_factory`` (seed -> adapter) for ``run_conformance``."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import xxhash

from ..format import DType, LayerRole, Part
from ..identity import config_fingerprint, model_identity_from_files
from ..records import (
    Checkpoint,
    EngineIdentity,
    EngineLimits,
    LayerGeometry,
    LayerSpec,
    ModelFile,
    RestorePlan,
    RunningState,
    Snapshot,
)


def fake_identity(name: str = "test-model", config: dict | None = None) -> EngineIdentity:
    """An engine identity for tests: a model fingerprint from a made-up file list, a config mapping."""
    digest = xxhash.xxh3_128_digest(name.encode())
    model = model_identity_from_files([ModelFile("model", 1000, digest)])
    return EngineIdentity(
        model,
        config_fingerprint(
            config if config is not None else {"engine": "memory", "engine_version": "1", "kv_type": "f16"}
        ),
    )


def pattern_bytes(n: int, seed: int) -> bytes:
    """Deterministic pseudo-random bytes (XXH3-128 in counter mode)."""
    out = bytearray()
    i = 0
    while len(out) < n:
        out += xxhash.xxh3_128_digest(i.to_bytes(8, "little"), seed=seed) * 64
        i += 1
    return bytes(out[:n])


def make_snapshot(
    specs: Sequence[LayerSpec], n_tokens: int, seed: int = 0, *, vocab: int = 1000, draft_lag: int = 1
) -> Snapshot:
    rng = random.Random(seed)
    tokens = [rng.randrange(vocab) for _ in range(n_tokens)]
    layers = []
    for s in specs:
        cap = s.capacity(n_tokens)
        held = cap if s.role == 0 else max(0, cap - draft_lag)
        layers.append(LayerGeometry(s, held))
    state = RunningState(
        tokens,
        n_tokens,
        pattern_bytes(rng.randrange(0, 64), seed),
        Checkpoint(max(0, n_tokens - rng.randrange(0, 3)), pattern_bytes(rng.randrange(0, 16), seed + 1)),
        b'{"note":"engine field"}',
    )
    return Snapshot(state, tuple(layers))


class MemoryAdapter:
    """The reference adapter: K/V parts held as bytearrays; records every call in ``events``.

    Implements SessionSource, SessionTarget, (with ``staging=True``) StagingTarget, and (with
    ``zero_copy=True``) LandingTarget: every piece then lands in two views (split in the middle), so the
    library's handling of several views per piece is exercised too.
    """

    def __init__(
        self,
        identity: EngineIdentity,
        specs: Sequence[LayerSpec],
        *,
        max_tokens: int = 4096,
        vocab_size: int | None = 1000,
        staging: bool = False,
        zero_copy: bool = False,
    ) -> None:
        self._identity = identity
        self.specs = tuple(specs)
        self.max_tokens = max_tokens
        self.vocab_size = vocab_size
        self.staging = staging
        self.zero_copy = zero_copy
        self._applying = False
        self.state = RunningState([])
        self.layers = tuple(LayerGeometry(s, 0) for s in self.specs)
        self.parts: list[list[bytearray]] = [[bytearray(0) for _ in Part] for _ in self.specs]
        self.events: list[str] = []
        self.fail_stopped: Exception | None = None
        self._pending: tuple | None = None
        self._staged: tuple | None = None

    # -- a live session ----------------------------------------------------------------------------
    def load_snapshot(self, snap: Snapshot, seed: int = 0) -> MemoryAdapter:
        self.state = snap.state
        self.layers = snap.layers
        self.parts = [
            [bytearray(pattern_bytes(g.part_size(p), seed * 7919 + li * 5 + p)) for p in Part]
            for li, g in enumerate(snap.layers)
        ]
        return self

    def live_digest(self) -> bytes:
        h = xxhash.xxh3_128()
        h.update(repr((self.state, self.layers)).encode())
        for parts in self.parts:
            for p in parts:
                h.update(len(p).to_bytes(8, "little"))
                h.update(p)
        return h.digest()

    # -- SessionSource -----------------------------------------------------------------------------
    def identity(self) -> EngineIdentity:
        return self._identity

    def snapshot(self) -> Snapshot:
        return Snapshot(self.state, self.layers)

    def copy_out(self, layer: int, part: Part, offset: int, dest: memoryview) -> None:
        dest[:] = self.parts[layer][part][offset : offset + len(dest)]

    @staticmethod
    def _halves(data: bytearray, offset: int, length: int) -> list[memoryview]:
        view = memoryview(data)[offset : offset + length]
        return [view[: length // 2], view[length // 2 :]]

    # -- LandingTarget (only with zero_copy=True) ----------------------------------------------------
    def can_land(self, plan: RestorePlan) -> bool:
        return self.zero_copy

    def landing_views(self, layer: int, part: Part, offset: int, length: int) -> list[memoryview]:
        self.events.append("landing_views")
        if self._staged is not None:
            return self._halves(self._staged[1][layer][part], offset, length)
        # The live K/V: only after the gate.
        assert self._applying, "landing_views for the live session before begin_apply"
        return self._halves(self.parts[layer][part], offset, length)

    # -- SessionTarget -----------------------------------------------------------------------------
    def limits(self) -> EngineLimits:
        return EngineLimits(
            max_tokens=self.max_tokens,
            layers=self.specs,
            vocab_size=self.vocab_size,
            max_sampler_state_bytes=4096,
            max_checkpoint_data_bytes=4096,
            max_engine_fields_bytes=4096,
        )

    def check_plan(self, plan: RestorePlan) -> None:
        self.events.append("check_plan")

    def begin_apply(self, plan: RestorePlan) -> None:
        self.events.append("begin_apply")
        self._applying = True
        # The live pools are overwritten in place from here on (as a real engine does).
        self.layers = plan.layers
        self.parts = [[bytearray(g.part_size(p)) for p in Part] for g in plan.layers]

    def copy_in(self, layer: int, part: Part, offset: int, src: memoryview) -> None:
        self.events.append("copy_in")
        assert src.readonly
        self.parts[layer][part][offset : offset + len(src)] = src

    def commit(self, state: RunningState) -> None:
        self.events.append("commit")
        self.state = state
        self._applying = False

    def fail_stop(self, error: Exception) -> None:
        self.events.append("fail_stop")
        self.fail_stopped = error

    # -- StagingTarget (only meaningful with staging=True) ------------------------------------------
    def can_stage(self, plan: RestorePlan) -> bool:
        return self.staging

    def begin_staging(self, plan: RestorePlan) -> None:
        self.events.append("begin_staging")
        self._staged = (plan.layers, [[bytearray(g.part_size(p)) for p in Part] for g in plan.layers])

    def stage_in(self, layer: int, part: Part, offset: int, src: memoryview) -> None:
        self.events.append("stage_in")
        assert self._staged is not None
        self._staged[1][layer][part][offset : offset + len(src)] = src

    def commit_staged(self, state: RunningState) -> None:
        self.events.append("commit_staged")
        assert self._staged is not None
        self.layers, self.parts = self._staged
        self.state = state
        self._staged = None

    def discard_staged(self) -> None:
        self.events.append("discard_staged")
        self._staged = None


def memory_adapter_factory(
    specs: Sequence[LayerSpec] | None = None,
    *,
    n_tokens: int = 40,
    staging: bool = False,
    identity: EngineIdentity | None = None,
    zero_copy: bool = False,
) -> Callable[[int], MemoryAdapter]:
    """A factory for run_conformance: seed -> MemoryAdapter holding a session derived from the seed."""
    if specs is None:
        specs = [
            LayerSpec(i, LayerRole.MAIN, 2, 16, 16, DType.F16, DType.F16, 8 if i % 3 == 2 else 0)
            for i in range(4)
        ] + [
            LayerSpec(4, LayerRole.MAIN, 2, 16, 16, DType.I8, DType.I8, 0, 24),
            LayerSpec(0, LayerRole.DRAFT, 1, 8, 8, DType.F32, DType.F32, 0),
        ]
    ident = identity or fake_identity()

    def factory(seed: int) -> MemoryAdapter:
        adapter = MemoryAdapter(ident, specs, staging=staging, zero_copy=zero_copy)
        return adapter.load_snapshot(make_snapshot(specs, n_tokens + seed % 7, seed), seed)

    return factory
