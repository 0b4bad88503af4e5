"""Synthetic sessions of any size that hold none of their bytes (RSS tests, benchmarks): ``PatternSource``
saves one, ``SinkTarget`` restores one into a fixed ring "pool"."""

from __future__ import annotations

from collections.abc import Sequence

from ..format import DType, LayerRole, Part
from ..records import (
    EngineIdentity,
    EngineLimits,
    LayerGeometry,
    LayerSpec,
    RestorePlan,
    RunningState,
    Snapshot,
)
from .reference import make_snapshot, pattern_bytes

PATTERN_SIZE = 1 << 20


def synthetic_specs(n_layers: int = 24, n_kv_heads: int = 8, head_dim: int = 128) -> list[LayerSpec]:
    return [
        LayerSpec(i, LayerRole.MAIN, n_kv_heads, head_dim, head_dim, DType.F16, DType.F16)
        for i in range(n_layers)
    ]


def tokens_for_bytes(specs: Sequence[LayerSpec], n_bytes: int) -> int:
    """Tokens a full-attention session of these specs holds in about n_bytes of K/V."""
    per_token = sum(LayerGeometry(s, 1).n_bytes for s in specs)
    return max(1, n_bytes // per_token)


class PatternSource:
    """A SessionSource of any size that holds none of it: parts are filled from a 1 MiB pattern, cycled
    (a subclass may put another pattern in ``_pattern``; each layer and part starts at its own offset)."""

    LAYER_STRIDE, PART_STRIDE = 4099, 613  # where each layer's and part's bytes start in the pattern

    def __init__(
        self, identity: EngineIdentity, specs: Sequence[LayerSpec], n_tokens: int, seed: int = 0
    ) -> None:
        self._identity = identity
        self.specs = tuple(specs)
        self._snapshot = make_snapshot(specs, n_tokens, seed, vocab=32000)
        self._pattern = memoryview(pattern_bytes(PATTERN_SIZE, seed))

    def identity(self) -> EngineIdentity:
        return self._identity

    def snapshot(self) -> Snapshot:
        return self._snapshot

    def copy_out(self, layer: int, part: Part, offset: int, dest: memoryview) -> None:
        size = len(self._pattern)
        start = (offset + layer * self.LAYER_STRIDE + int(part) * self.PART_STRIDE) % size
        pos, n = 0, len(dest)
        while pos < n:
            take = min(n - pos, size - start)
            dest[pos : pos + take] = self._pattern[start : start + take]
            pos += take
            start = 0


class SinkTarget:
    """A SessionTarget that copies every received byte into a fixed ring "pool" (allocated and touched up
    front, like an engine's pool) and keeps the running state; for RSS measurements and benchmarks."""

    def __init__(
        self,
        identity: EngineIdentity,
        specs: Sequence[LayerSpec],
        *,
        max_tokens: int = 1 << 24,
        pool_bytes: int = 64 << 20,
    ) -> None:
        self._identity = identity
        self.specs = tuple(specs)
        self.max_tokens = max_tokens
        self.pool = memoryview(bytearray(b"\x01") * pool_bytes)  # touched now, not during the restore
        self._pos = 0
        self.received = 0
        self.state: RunningState | None = None
        self.fail_stopped: Exception | None = None

    def identity(self) -> EngineIdentity:
        return self._identity

    def limits(self) -> EngineLimits:
        return EngineLimits(max_tokens=self.max_tokens, layers=self.specs)

    def check_plan(self, plan: RestorePlan) -> None:
        pass

    def begin_apply(self, plan: RestorePlan) -> None:
        self._pos = 0

    def copy_in(self, layer: int, part: Part, offset: int, src: memoryview) -> None:
        n = len(src)
        done = 0
        while done < n:
            take = min(n - done, len(self.pool) - self._pos)
            self.pool[self._pos : self._pos + take] = src[done : done + take]
            self._pos = (self._pos + take) % len(self.pool)
            done += take
        self.received += n

    def commit(self, state: RunningState) -> None:
        self.state = state

    def fail_stop(self, error: Exception) -> None:
        self.fail_stopped = error
