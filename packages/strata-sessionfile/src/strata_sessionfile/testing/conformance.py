"""``run_conformance``: the library's round-trip, truncation, corruption, binding, gate and file-type cases
run against another engine's adapter.

The caller gives a factory ``adapter_factory(seed) -> adapter`` that returns a fresh adapter holding a live
session (sessions from different seeds differ; the same seed gives the same session). Each case is one
function of a ``ConformanceRun`` (the factory, the options, a known-good file, the failures found so
far); ``CASES`` lists them in the order they run. ``compression="zstd"`` runs every case on compressed
files (the adapter protocol does not change: the library decodes the frames).
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable

import attrs
import xxhash

from .. import errors as E
from ..adapter import SessionAdapter, StagingTarget
from ..auth import SessionKey
from ..compression import Compression
from ..format import AUTH_TRAILER_SIZE, HEADER_SIZE, MAC_COVERED_TRAILER
from ..identity import config_fingerprint, model_identity_from_files
from ..reader import inspect, restore
from ..records import EngineIdentity, ModelFile
from ..writer import save
from .recorder import IdentityOverride, recorder

TRAILER_BACK = 24 + 1  # the last data byte lies just before the 24-byte trailer


class ConformanceFailure(AssertionError):
    def __init__(self, failures: list[str]) -> None:
        super().__init__("conformance failed:\n  " + "\n  ".join(failures))
        self.failures = failures


@attrs.define
class ConformanceRun:
    """What every case works with. ``good`` is a file saved from ``factory(1)``; refusals are tried on
    adapters from ``factory(2)``; ``bad`` is the path a case writes a damaged file to."""

    factory: Callable[[int], SessionAdapter]
    workdir: str
    block_size: int
    compression: Compression | str | None
    random_truncations: int
    random_flips: int
    rng: random.Random
    failures: list[str] = attrs.Factory(list)
    source: SessionAdapter = attrs.field(init=False)  # factory(1), made by start()
    good: str = ""
    good_bytes: bytes = b""

    def start(self) -> ConformanceRun:
        os.makedirs(self.workdir, exist_ok=True)
        self.source = self.factory(1)
        self.good = os.path.join(self.workdir, "good.ssf")
        self.save(self.source, self.good)
        self.good_bytes = _file_bytes(self.good)
        return self

    @property
    def bad(self) -> str:
        return os.path.join(self.workdir, "bad.ssf")

    def fail(self, message: str) -> None:
        self.failures.append(message)

    def save(self, adapter, path: str, key: SessionKey | None = None) -> None:
        save(path, adapter, block_size=self.block_size, compression=self.compression, key=key)

    def saved(self, adapter, name: str) -> bytes:
        """The bytes of ``adapter``'s session saved now (how a case sees what an adapter holds)."""
        path = os.path.join(self.workdir, name)
        self.save(adapter, path)
        return _file_bytes(path)

    def write_bad(self, data: bytes) -> str:
        if os.path.lexists(self.bad):
            os.unlink(self.bad)
        with open(self.bad, "wb") as f:
            f.write(data)
        return self.bad

    def expect_refusal(
        self,
        case: str,
        path: str,
        expected: type[E.SessionFileError] | tuple = E.SessionFileError,
        hooks=None,
        mode="auto",
        key: SessionKey | None = None,
    ) -> E.SessionFileError | None:
        """Restore ``path`` into a fresh adapter: it must be refused with ``expected``, before the gate, and the
        adapter's live session must be what it was."""
        target = self.factory(2)
        before = self.saved(target, "before.ssf")
        rec = recorder(target, hooks)
        try:
            restore(path, rec, block_size=self.block_size, mode=mode, key=key)
        except E.SessionFileError as exc:
            if not isinstance(exc, expected):
                self.fail(f"{case}: raised {type(exc).__name__} ({exc.reason}), expected {expected}")
            if isinstance(exc, E.FailStop) or rec.touched:
                self.fail(f"{case}: the adapter was touched before the gate: {rec.calls}")
            elif self.saved(target, "after.ssf") != before:
                self.fail(f"{case}: a refused restore changed the live session")
            return exc
        except Exception as exc:  # anything else escaping is itself a failure
            self.fail(f"{case}: {type(exc).__name__} escaped: {exc}")
            return None
        self.fail(f"{case}: the restore was accepted")
        return None


def _file_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _section_boundaries(path: str) -> list[int]:
    """Offsets where a truncation is most likely to be mishandled: each section's edges, each part's (or
    each frame's) first and middle byte."""
    lay = inspect(path, verify=False).layout
    points = {
        0,
        1,
        8,
        16,
        32,
        48,
        56,
        63,
        64,
        68,
        lay.data_offset - 1,
        lay.data_offset,
        lay.trailer_offset,
        lay.trailer_offset + 16,
        lay.file_size - 1,
    }
    if lay.compressed is None:
        for ext in lay.extents:
            points.add(lay.data_offset + ext.data_offset)
            points.add(lay.data_offset + ext.data_offset + ext.size // 2)
    else:  # the compression header, every frame's first and middle byte, the block table
        points |= {lay.data_offset + 16, lay.compressed.table_offset, lay.trailer_offset - 1}
        for offset, size in lay.compressed.frames():
            points |= {offset, offset + size // 2}
    return sorted(p for p in points if 0 <= p < lay.file_size)


def _flip_byte_once(path: str, from_end: int) -> Callable:
    """A hook that flips the byte ``from_end`` bytes before the end of ``path`` the first time it runs."""
    flipped: list[bool] = []

    def hook(*args) -> None:
        if not flipped:
            flipped.append(True)
            with open(path, "r+b") as f:
                f.seek(-from_end, os.SEEK_END)
                byte = f.read(1)
                f.seek(-from_end, os.SEEK_END)
                f.write(bytes([byte[0] ^ 1]))

    return hook


# --- the cases ----------------------------------------------------------------------------------------
def round_trip(run: ConformanceRun) -> None:
    """Restore into an adapter holding another session (streaming, then auto), save again: the same bytes.
    The session must span at least 3 blocks, or the gate cases prove little."""
    target = run.factory(2)
    for mode in ("streaming", "auto"):
        try:
            restore(run.good, target, block_size=run.block_size, mode=mode)
            if run.saved(target, "again.ssf") != run.good_bytes:
                run.fail(f"round_trip ({mode}): re-encoding the restored session differs from the file")
        except Exception as exc:
            run.fail(f"round_trip ({mode}): {type(exc).__name__}: {exc}")
    try:
        layout = inspect(run.good).layout
    except Exception as exc:
        run.fail(f"inspect: {type(exc).__name__}: {exc}")
        return
    if layout.data_length < 3 * run.block_size:
        run.fail(
            f"the factory's session has {layout.data_length} K/V bytes; the gate cases need at least 3 "
            f"blocks ({3 * run.block_size})"
        )


def truncation(run: ConformanceRun) -> None:
    """The file cut at every section boundary and at random offsets: refused as truncated."""
    cuts = _section_boundaries(run.good) + [
        run.rng.randrange(len(run.good_bytes)) for _ in range(run.random_truncations)
    ]
    for cut in cuts:
        run.expect_refusal(f"truncation at {cut}", run.write_bad(run.good_bytes[:cut]), E.Truncated)


def header_flips(run: ConformanceRun) -> None:
    """Every header byte flipped: refused."""
    for off in range(64):
        data = bytearray(run.good_bytes)
        data[off] ^= 0xFF
        run.expect_refusal(f"header flip at {off}", run.write_bad(bytes(data)))


def payload_flips(run: ConformanceRun) -> None:
    """Random payload bytes flipped: refused."""
    for _ in range(run.random_flips):
        off = run.rng.randrange(64, len(run.good_bytes))
        data = bytearray(run.good_bytes)
        data[off] ^= run.rng.randrange(1, 256)
        run.expect_refusal(f"payload flip at {off}", run.write_bad(bytes(data)))


def binding(run: ConformanceRun) -> None:
    """A file of another model, and of another config: refused, the config refusal naming the key."""
    ident = run.source.identity()
    other_model = model_identity_from_files([ModelFile("model", 1, b"\x00" * 16)])
    run.save(IdentityOverride(run.source, EngineIdentity(other_model, ident.config)), run.bad)
    run.expect_refusal("model mismatch", run.bad, E.ModelMismatch)
    other_config = config_fingerprint({**ident.config.mapping, "conformance_probe": 1})
    run.save(IdentityOverride(run.source, EngineIdentity(ident.model, other_config)), run.bad)
    exc = run.expect_refusal("config mismatch", run.bad, E.ConfigMismatch)
    if exc is not None and not any("conformance_probe" in d for d in getattr(exc, "differences", ())):
        run.fail(f"config mismatch: the refusal does not name the differing key: {exc}")


def gate_before(run: ConformanceRun) -> None:
    """Before the gate: the adapter's own refusal in check_plan, and a file modified, grown or shrunk
    between the passes, are clean refusals."""

    def refuse(plan):
        raise E.GeometryMismatch("conformance: refused by check_plan")

    run.expect_refusal("check_plan refusal", run.good, E.GeometryMismatch, hooks={"check_plan": refuse})
    bad = run.bad
    shutil.copyfile(run.good, bad)

    def modify_in_place(plan):
        with open(bad, "r+b") as f:
            f.seek(plan.layout.data_offset)
            byte = f.read(1)
            f.seek(plan.layout.data_offset)
            f.write(bytes([byte[0] ^ 1]))

    run.expect_refusal(
        "modified between passes", bad, E.FileChanged, hooks={"check_plan": modify_in_place}, mode="streaming"
    )
    for what, change in (
        ("grew", lambda f, n: f.truncate(n + 1)),
        ("shrank", lambda f, n: f.truncate(n - 1)),
    ):
        shutil.copyfile(run.good, bad)

        def hook(plan, change=change):
            with open(bad, "r+b") as f:
                change(f, plan.layout.file_size)

        run.expect_refusal(
            f"file {what} between passes", bad, E.FileChanged, hooks={"check_plan": hook}, mode="streaming"
        )


def gate_after(run: ConformanceRun) -> None:
    """The file changes under the apply pass, after the first block: exactly one fail_stop, FailStop, no
    commit."""
    shutil.copyfile(run.good, run.bad)
    flip_last = _flip_byte_once(run.bad, TRAILER_BACK)
    rec = recorder(run.factory(2), {"copy_in": flip_last, "landing_views": flip_last})
    try:
        restore(run.bad, rec, block_size=run.block_size, mode="streaming")
        run.fail("gate_after: a file changed during the apply pass was accepted")
    except E.FailStop as exc:
        if rec.calls.count("fail_stop") != 1 or "commit" in rec.calls:
            run.fail(f"gate_after: expected one fail_stop and no commit, calls {sorted(set(rec.calls))}")
        if exc.cause_reason not in ("payload_corrupt", "file_changed"):
            run.fail(f"gate_after: cause {exc.cause_reason}")
    except Exception as exc:
        run.fail(f"gate_after: {type(exc).__name__} instead of FailStop: {exc}")


def can_stage(run: ConformanceRun) -> bool:
    """Whether the adapter stages (a StagingTarget whose staged round trip is not StagingUnavailable)."""
    if not isinstance(run.source, StagingTarget):
        return False
    try:
        restore(run.good, run.factory(2), block_size=run.block_size, mode="staged")
    except E.StagingUnavailable:
        return False
    except Exception as exc:
        run.fail(f"staged round trip: {type(exc).__name__}: {exc}")
    return True


def staged(run: ConformanceRun) -> None:
    """A file changed during the staged pass: refused, the live session untouched (no fail-stop)."""
    shutil.copyfile(run.good, run.bad)
    flip_last = _flip_byte_once(run.bad, TRAILER_BACK)
    run.expect_refusal(
        "staged, changed during the pass",
        run.bad,
        (E.PayloadCorrupt, E.FileChanged),
        hooks={"stage_in": flip_last, "landing_views": flip_last},
        mode="staged",
    )


def file_types(run: ConformanceRun) -> None:
    """What is not a plain regular file with one name: refused."""
    link = os.path.join(run.workdir, "link.ssf")
    if os.path.lexists(link):
        os.unlink(link)
    os.symlink(run.good, link)
    run.expect_refusal("symlink", link, E.SymlinkRefused)
    os.unlink(link)
    os.link(run.good, link)
    run.expect_refusal("second hard link", run.good, E.MultipleLinks)
    os.unlink(link)
    os.mkfifo(link)
    run.expect_refusal("FIFO", link, E.NotRegularFile)
    os.unlink(link)
    os.mkdir(link)
    run.expect_refusal("directory", link, E.NotRegularFile)
    os.rmdir(link)
    run.expect_refusal("missing", link, E.NotFound)


def authentication(run: ConformanceRun) -> None:
    """A file written with a key restores with it (streaming and auto: the same bytes saved again); a reader
    holding the key refuses, before the gate and with the live session untouched, a file without a MAC, one
    made with another key, a flipped MAC byte, and a payload changed under a matching payload hash and MAC."""
    key, other = SessionKey.generate(), SessionKey.generate()
    path = os.path.join(run.workdir, "authenticated.ssf")
    run.save(run.source, path, key)
    again = os.path.join(run.workdir, "authenticated-again.ssf")
    expected = _file_bytes(path)
    for mode in ("streaming", "auto"):
        target = run.factory(2)
        try:
            restore(path, target, block_size=run.block_size, mode=mode, key=key)
            run.save(target, again, key)
            if _file_bytes(again) != expected:
                run.fail(f"authentication ({mode}): re-encoding the restored session differs from the file")
        except Exception as exc:
            run.fail(f"authentication ({mode}): {type(exc).__name__}: {exc}")
    run.expect_refusal("no MAC", run.good, E.MacMissing, key=key)
    run.expect_refusal("another key", path, E.MacWrongKey, key=other)
    tail = len(expected) - AUTH_TRAILER_SIZE
    data = bytearray(expected)
    data[tail + 64] ^= 1
    run.expect_refusal("flipped MAC byte", run.write_bad(bytes(data)), E.MacMismatch, key=key)
    # A data byte changed, the payload hash and the MAC made to match it (as a forger who could find an XXH3
    # collision, or a writer holding the key, could): the payload digest still refuses it, before the gate (a
    # compressed file's changed frame may be refused by its decoder first).
    layout = inspect(path, verify=False).layout
    comp = layout.compressed
    at, refused = (
        (tail - 1, E.PayloadNotAuthentic)
        if comp is None
        else (
            _middle_of_last_frame(comp),
            (E.PayloadNotAuthentic, E.FrameCorrupt, E.DecompressedSizeMismatch),
        )
    )
    data = bytearray(expected)
    data[at] ^= 1
    data[tail : tail + 16] = xxhash.xxh3_128_digest(bytes(data[HEADER_SIZE:tail]))
    data[tail + 64 : tail + 96] = key.mac(
        bytes(data[:HEADER_SIZE]), bytes(data[tail : tail + MAC_COVERED_TRAILER])
    )
    run.expect_refusal(
        "payload changed under its hash", run.write_bad(bytes(data)), refused, key=key, mode="streaming"
    )


def _middle_of_last_frame(comp) -> int:
    offset, size = list(comp.frames())[-1]
    return offset + size // 2


def _always(run: ConformanceRun) -> bool:
    return True


@attrs.frozen
class Case:
    name: str
    check: Callable[[ConformanceRun], None]
    applies: Callable[[ConformanceRun], bool] = _always  # asked just before the case would run


CASES: tuple[Case, ...] = (
    Case("round_trip", round_trip),
    Case("truncation", truncation),
    Case("header_flips", header_flips),
    Case("payload_flips", payload_flips),
    Case("binding", binding),
    Case("gate_before", gate_before),
    Case("gate_after", gate_after),
    Case("staged", staged, applies=can_stage),
    Case("authentication", authentication),
    Case("file_types", file_types),
)


def run_conformance(
    adapter_factory: Callable[[int], SessionAdapter],
    workdir: str | os.PathLike,
    *,
    block_size: int = 4096,
    random_truncations: int = 16,
    random_flips: int = 64,
    seed: int = 0,
    compression: Compression | str | None = None,
) -> list[str]:
    """Run every case that applies, in ``CASES`` order; return the names of those that ran; raise
    ConformanceFailure listing every failure."""
    run = ConformanceRun(
        adapter_factory,
        os.fspath(workdir),
        block_size,
        compression,
        random_truncations,
        random_flips,
        random.Random(seed),
    ).start()
    ran = []
    for case in CASES:
        if case.applies(run):
            ran.append(case.name)
            case.check(run)
    if run.failures:
        raise ConformanceFailure(run.failures)
    return ran
