"""The conformance kit: an in-memory reference adapter, synthetic sessions, and ``run_conformance``.

Another engine's test suite calls ``run_conformance(adapter_factory, workdir)`` with a factory
``adapter_factory(seed) -> adapter`` that returns a fresh adapter holding a live session (sessions
from different seeds differ; the same seed gives the same session). The kit runs the library's
round-trip, truncation, corruption, binding, gate and file-type cases against it and raises
``ConformanceFailure`` listing every case that failed. ``compression="zstd"`` runs every case on
compressed files (the adapter protocol does not change: the library decodes the frames).
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable, Sequence

import attrs
import xxhash

from . import errors as E
from .adapter import LandingTarget, StagingTarget
from .format import Part
from .identity import config_fingerprint, model_identity_from_files
from .reader import restore
from .records import (
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
from .writer import save


def fake_identity(name: str = "test-model", config: dict | None = None) -> EngineIdentity:
    """An engine identity for tests: a model fingerprint from a made-up file list, a config mapping."""
    digest = xxhash.xxh3_128_digest(name.encode())
    model = model_identity_from_files([ModelFile("model", 1000, digest)])
    return EngineIdentity(model, config_fingerprint(config if config is not None else
                                                    {"engine": "memory", "engine_version": "1", "kv_type": "f16"}))


def pattern_bytes(n: int, seed: int) -> bytes:
    """Deterministic pseudo-random bytes (XXH3-128 in counter mode)."""
    out = bytearray()
    i = 0
    while len(out) < n:
        out += xxhash.xxh3_128_digest(i.to_bytes(8, "little"), seed=seed) * 64
        i += 1
    return bytes(out[:n])


def make_snapshot(specs: Sequence[LayerSpec], n_tokens: int, seed: int = 0, *, vocab: int = 1000,
                  draft_lag: int = 1) -> Snapshot:
    rng = random.Random(seed)
    tokens = [rng.randrange(vocab) for _ in range(n_tokens)]
    layers = []
    for s in specs:
        cap = s.capacity(n_tokens)
        held = cap if s.role == 0 else max(0, cap - draft_lag)
        layers.append(LayerGeometry(s, held))
    state = RunningState(tokens, n_tokens, pattern_bytes(rng.randrange(0, 64), seed),
                         Checkpoint(max(0, n_tokens - rng.randrange(0, 3)), pattern_bytes(rng.randrange(0, 16), seed + 1)),
                         b'{"note":"engine field"}')
    return Snapshot(state, tuple(layers))


class MemoryAdapter:
    """The reference adapter: K/V parts held as bytearrays; records every call in ``events``.

    Implements SessionSource, SessionTarget, (with ``staging=True``) StagingTarget, and (with
    ``zero_copy=True``) LandingTarget: every piece then lands in two views (split in the middle), so the
    library's handling of several views per piece is exercised too.
    """

    def __init__(self, identity: EngineIdentity, specs: Sequence[LayerSpec], *, max_tokens: int = 4096,
                 vocab_size: int | None = 1000, staging: bool = False, zero_copy: bool = False) -> None:
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
        self.parts = [[bytearray(pattern_bytes(g.part_size(p), seed * 7919 + li * 5 + p)) for p in Part]
                      for li, g in enumerate(snap.layers)]
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
        dest[:] = self.parts[layer][part][offset:offset + len(dest)]

    @staticmethod
    def _halves(data: bytearray, offset: int, length: int) -> list[memoryview]:
        view = memoryview(data)[offset:offset + length]
        return [view[:length // 2], view[length // 2:]]

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
        return EngineLimits(max_tokens=self.max_tokens, layers=self.specs, vocab_size=self.vocab_size,
                            max_sampler_state_bytes=4096, max_checkpoint_data_bytes=4096,
                            max_engine_fields_bytes=4096)

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
        self.parts[layer][part][offset:offset + len(src)] = src

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
        self._staged[1][layer][part][offset:offset + len(src)] = src

    def commit_staged(self, state: RunningState) -> None:
        self.events.append("commit_staged")
        assert self._staged is not None
        self.layers, self.parts = self._staged
        self.state = state
        self._staged = None

    def discard_staged(self) -> None:
        self.events.append("discard_staged")
        self._staged = None


def memory_adapter_factory(specs: Sequence[LayerSpec] | None = None, *, n_tokens: int = 40,
                           staging: bool = False, identity: EngineIdentity | None = None,
                           zero_copy: bool = False) -> Callable[[int], MemoryAdapter]:
    """A factory for run_conformance: seed -> MemoryAdapter holding a session derived from the seed."""
    from .format import DType, LayerRole

    if specs is None:
        specs = [LayerSpec(i, LayerRole.MAIN, 2, 16, 16, DType.F16, DType.F16, 8 if i % 3 == 2 else 0)
                 for i in range(4)] + [LayerSpec(4, LayerRole.MAIN, 2, 16, 16, DType.I8, DType.I8, 0, 24),
                                       LayerSpec(0, LayerRole.DRAFT, 1, 8, 8, DType.F32, DType.F32, 0)]
    ident = identity or fake_identity()

    def factory(seed: int) -> MemoryAdapter:
        adapter = MemoryAdapter(ident, specs, staging=staging, zero_copy=zero_copy)
        return adapter.load_snapshot(make_snapshot(specs, n_tokens + seed % 7, seed), seed)

    return factory


# --- the conformance run ----------------------------------------------------------------------------
TRAILER_BACK = 24 + 1  # the last data byte lies just before the 24-byte trailer

class ConformanceFailure(AssertionError):
    def __init__(self, failures: list[str]) -> None:
        super().__init__("conformance failed:\n  " + "\n  ".join(failures))
        self.failures = failures


class _Recorder:
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


class _StagingRecorder(_Recorder):
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


class _LandingMixin:
    """Forwards the LandingTarget calls of an adapter that has them."""

    def can_land(self, plan):
        return self._inner.can_land(plan)

    def landing_views(self, *a):
        return self._call("landing_views", *a)


class _LandingRecorder(_LandingMixin, _Recorder):
    pass


class _LandingStagingRecorder(_LandingMixin, _StagingRecorder):
    pass


def recorder(adapter, hooks: dict[str, Callable] | None = None) -> _Recorder:
    staging, landing = isinstance(adapter, StagingTarget), isinstance(adapter, LandingTarget)
    cls = {(False, False): _Recorder, (True, False): _StagingRecorder, (False, True): _LandingRecorder,
           (True, True): _LandingStagingRecorder}[staging, landing]
    return cls(adapter, hooks)


@attrs.define
class _IdentityOverride:
    """A SessionSource that writes the inner adapter's session under another identity."""

    inner: object
    ident: EngineIdentity

    def identity(self):
        return self.ident

    def snapshot(self):
        return self.inner.snapshot()

    def copy_out(self, *a):
        return self.inner.copy_out(*a)


def _section_boundaries(path: str) -> list[int]:
    from .reader import inspect

    info = inspect(path, verify=False)
    lay = info.layout
    points = {0, 1, 8, 16, 32, 48, 56, 63, 64, 68, lay.data_offset - 1, lay.data_offset, lay.trailer_offset,
              lay.trailer_offset + 16, lay.file_size - 1}
    if lay.compressed is None:
        for ext in lay.extents:
            points.add(lay.data_offset + ext.data_offset)
            points.add(lay.data_offset + ext.data_offset + ext.size // 2)
    else:  # the compression header, every frame's first and middle byte, the block table
        points |= {lay.data_offset + 16, lay.compressed.table_offset, lay.trailer_offset - 1}
        for offset, size in lay.compressed.frames():
            points |= {offset, offset + size // 2}
    return sorted(p for p in points if 0 <= p < lay.file_size)


def run_conformance(adapter_factory: Callable[[int], object], workdir: str | os.PathLike, *,
                    block_size: int = 4096, random_truncations: int = 16, random_flips: int = 64,
                    seed: int = 0, compression=None) -> list[str]:
    """Run every conformance case; return the case names that ran; raise ConformanceFailure on any failure."""
    workdir = os.fspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    rng = random.Random(seed)
    failures: list[str] = []
    ran: list[str] = []

    def file_bytes(p: str) -> bytes:
        with open(p, "rb") as f:
            return f.read()

    def saved(adapter, name: str) -> bytes:
        p = os.path.join(workdir, name)
        save(p, adapter, block_size=block_size, compression=compression)
        return file_bytes(p)

    source = adapter_factory(1)
    good = os.path.join(workdir, "good.ssf")
    save(good, source, block_size=block_size, compression=compression)
    good_bytes = file_bytes(good)

    def expect_refusal(case: str, path: str, expected: type[E.SessionFileError] | tuple = E.SessionFileError,
                       hooks=None, mode="auto") -> E.SessionFileError | None:
        target = adapter_factory(2)
        before = saved(target, "before.ssf")
        rec = recorder(target, hooks)
        try:
            restore(path, rec, block_size=block_size, mode=mode)
        except E.SessionFileError as exc:
            if not isinstance(exc, expected):
                failures.append(f"{case}: raised {type(exc).__name__} ({exc.reason}), expected {expected}")
            if isinstance(exc, E.FailStop) or rec.touched:
                failures.append(f"{case}: the adapter was touched before the gate: {rec.calls}")
            elif saved(target, "after.ssf") != before:
                failures.append(f"{case}: a refused restore changed the live session")
            return exc
        except Exception as exc:  # anything else escaping is itself a failure
            failures.append(f"{case}: {type(exc).__name__} escaped: {exc}")
            return None
        failures.append(f"{case}: the restore was accepted")
        return None

    # 1. round trip: restore into an adapter holding another session, save again, same bytes.
    ran.append("round_trip")
    target = adapter_factory(2)
    for mode in ("streaming", "auto"):
        try:
            restore(good, target, block_size=block_size, mode=mode)
            if saved(target, "again.ssf") != good_bytes:
                failures.append(f"round_trip ({mode}): re-encoding the restored session differs from the file")
        except Exception as exc:
            failures.append(f"round_trip ({mode}): {type(exc).__name__}: {exc}")
    info_layout = None
    try:
        from .reader import inspect

        info_layout = inspect(good).layout
    except Exception as exc:
        failures.append(f"inspect: {type(exc).__name__}: {exc}")
    if info_layout is not None and info_layout.data_length < 3 * block_size:
        failures.append(f"the factory's session has {info_layout.data_length} K/V bytes; the gate cases need at "
                        f"least 3 blocks ({3 * block_size})")

    bad = os.path.join(workdir, "bad.ssf")

    def write_bad(data: bytes) -> str:
        if os.path.lexists(bad):
            os.unlink(bad)
        with open(bad, "wb") as f:
            f.write(data)
        return bad

    # 2. truncation at every section boundary and at random offsets.
    ran.append("truncation")
    cuts = _section_boundaries(good) + [rng.randrange(len(good_bytes)) for _ in range(random_truncations)]
    for cut in cuts:
        expect_refusal(f"truncation at {cut}", write_bad(good_bytes[:cut]), E.Truncated)

    # 3. every header byte flipped; random payload bytes flipped.
    ran.append("header_flips")
    for off in range(64):
        data = bytearray(good_bytes)
        data[off] ^= 0xFF
        expect_refusal(f"header flip at {off}", write_bad(bytes(data)))
    ran.append("payload_flips")
    for _ in range(random_flips):
        off = rng.randrange(64, len(good_bytes))
        data = bytearray(good_bytes)
        data[off] ^= rng.randrange(1, 256)
        expect_refusal(f"payload flip at {off}", write_bad(bytes(data)))

    # 4. binding: another model, another config (the refusal names the key that differs).
    ran.append("binding")
    ident = source.identity()
    other_model = model_identity_from_files([ModelFile("model", 1, b"\x00" * 16)])
    save(bad, _IdentityOverride(source, EngineIdentity(other_model, ident.config)), block_size=block_size,
         compression=compression)
    expect_refusal("model mismatch", bad, E.ModelMismatch)
    other_config = config_fingerprint({**ident.config.mapping, "conformance_probe": 1})
    save(bad, _IdentityOverride(source, EngineIdentity(ident.model, other_config)), block_size=block_size,
         compression=compression)
    exc = expect_refusal("config mismatch", bad, E.ConfigMismatch)
    if exc is not None and not any("conformance_probe" in d for d in getattr(exc, "differences", ())):
        failures.append(f"config mismatch: the refusal does not name the differing key: {exc}")

    # 5. gate, before: the adapter's own refusal, and a file modified between the passes.
    ran.append("gate_before")

    def refuse(plan):
        raise E.GeometryMismatch("conformance: refused by check_plan")

    expect_refusal("check_plan refusal", good, E.GeometryMismatch, hooks={"check_plan": refuse})
    shutil.copyfile(good, bad)

    def modify_in_place(plan):
        with open(bad, "r+b") as f:
            f.seek(plan.layout.data_offset)
            byte = f.read(1)
            f.seek(plan.layout.data_offset)
            f.write(bytes([byte[0] ^ 1]))

    expect_refusal("modified between passes", bad, E.FileChanged, hooks={"check_plan": modify_in_place},
                   mode="streaming")
    for what, change in (("grew", lambda f, n: f.truncate(n + 1)), ("shrank", lambda f, n: f.truncate(n - 1))):
        shutil.copyfile(good, bad)

        def hook(plan, change=change):
            with open(bad, "r+b") as f:
                change(f, plan.layout.file_size)

        expect_refusal(f"file {what} between passes", bad, E.FileChanged, hooks={"check_plan": hook},
                       mode="streaming")

    # 6. gate, after: the file changes under the apply pass -> fail_stop, FailStop, no commit.
    ran.append("gate_after")
    shutil.copyfile(good, bad)
    victim = adapter_factory(2)
    flipped = []

    def flip_last(*args):
        if not flipped:
            flipped.append(True)
            with open(bad, "r+b") as f:
                f.seek(-TRAILER_BACK, os.SEEK_END)
                byte = f.read(1)
                f.seek(-TRAILER_BACK, os.SEEK_END)
                f.write(bytes([byte[0] ^ 1]))

    rec = recorder(victim, {"copy_in": flip_last, "landing_views": flip_last})
    try:
        restore(bad, rec, block_size=block_size, mode="streaming")
        failures.append("gate_after: a file changed during the apply pass was accepted")
    except E.FailStop as exc:
        if rec.calls.count("fail_stop") != 1 or "commit" in rec.calls:
            failures.append(f"gate_after: expected one fail_stop and no commit, calls {sorted(set(rec.calls))}")
        if exc.cause_reason not in ("payload_corrupt", "file_changed"):
            failures.append(f"gate_after: cause {exc.cause_reason}")
    except Exception as exc:
        failures.append(f"gate_after: {type(exc).__name__} instead of FailStop: {exc}")
    can_stage = isinstance(source, StagingTarget)
    if can_stage:
        try:
            restore(good, adapter_factory(2), block_size=block_size, mode="staged")
        except E.StagingUnavailable:
            can_stage = False
        except Exception as exc:
            failures.append(f"staged round trip: {type(exc).__name__}: {exc}")
    if can_stage:
        ran.append("staged")
        shutil.copyfile(good, bad)
        flipped.clear()
        expect_refusal("staged, changed during the pass", bad, (E.PayloadCorrupt, E.FileChanged),
                       hooks={"stage_in": flip_last, "landing_views": flip_last}, mode="staged")

    # 7. what is not a plain regular file with one name.
    ran.append("file_types")
    link = os.path.join(workdir, "link.ssf")
    for p in (link,):
        if os.path.lexists(p):
            os.unlink(p)
    os.symlink(good, link)
    expect_refusal("symlink", link, E.SymlinkRefused)
    os.unlink(link)
    os.link(good, link)
    expect_refusal("second hard link", good, E.MultipleLinks)
    os.unlink(link)
    os.mkfifo(link)
    expect_refusal("FIFO", link, E.NotRegularFile)
    os.unlink(link)
    os.mkdir(link)
    expect_refusal("directory", link, E.NotRegularFile)
    os.rmdir(link)
    expect_refusal("missing", link, E.NotFound)

    if failures:
        raise ConformanceFailure(failures)
    return ran



# --- synthetic sessions of any size (RSS test, benchmark) -------------------------------------------
PATTERN_SIZE = 1 << 20


def synthetic_specs(n_layers: int = 24, n_kv_heads: int = 8, head_dim: int = 128) -> list[LayerSpec]:
    from .format import DType, LayerRole

    return [LayerSpec(i, LayerRole.MAIN, n_kv_heads, head_dim, head_dim, DType.F16, DType.F16)
            for i in range(n_layers)]


def tokens_for_bytes(specs: Sequence[LayerSpec], n_bytes: int) -> int:
    """Tokens a full-attention session of these specs holds in about n_bytes of K/V."""
    per_token = sum(LayerGeometry(s, 1).n_bytes for s in specs)
    return max(1, n_bytes // per_token)


class PatternSource:
    """A SessionSource of any size that holds none of it: parts are filled from a 1 MiB pattern."""

    def __init__(self, identity: EngineIdentity, specs: Sequence[LayerSpec], n_tokens: int, seed: int = 0) -> None:
        self._identity = identity
        self.specs = tuple(specs)
        self._snapshot = make_snapshot(specs, n_tokens, seed, vocab=32000)
        self._pattern = memoryview(pattern_bytes(PATTERN_SIZE, seed))

    def identity(self) -> EngineIdentity:
        return self._identity

    def snapshot(self) -> Snapshot:
        return self._snapshot

    def copy_out(self, layer: int, part: Part, offset: int, dest: memoryview) -> None:
        start = (offset + layer * 4099 + int(part) * 613) % PATTERN_SIZE
        pos, n = 0, len(dest)
        while pos < n:
            take = min(n - pos, PATTERN_SIZE - start)
            dest[pos:pos + take] = self._pattern[start:start + take]
            pos += take
            start = 0


class SinkTarget:
    """A SessionTarget that copies every received byte into a fixed ring "pool" (allocated and touched up
    front, like an engine's pool) and keeps the running state; for RSS measurements and benchmarks."""

    def __init__(self, identity: EngineIdentity, specs: Sequence[LayerSpec], *, max_tokens: int = 1 << 24,
                 pool_bytes: int = 64 << 20) -> None:
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
            self.pool[self._pos:self._pos + take] = src[done:done + take]
            self._pos = (self._pos + take) % len(self.pool)
            done += take
        self.received += n

    def commit(self, state: RunningState) -> None:
        self.state = state

    def fail_stop(self, error: Exception) -> None:
        self.fail_stopped = error
