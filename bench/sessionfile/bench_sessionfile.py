"""Session file save/restore against the physical limit: a plain sequential write+fsync of the same bytes,
and the plain sequential reads a restore needs (streaming: the file twice; staged: once), on the same disk,
in one run. Prints ratios and the peak RSS growth of each operation.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/sessionfile/bench_sessionfile.py [--sizes 1,4] [--dir D]

Cold runs evict the file from the page cache first (posix_fadvise DONTNEED after fsync); warm runs read
from the page cache. "copy" rows: the restore target copies every byte into a 64 MiB ring "pool" (a real
memcpy per byte, as an engine's adapter does), which the plain-read baseline does not; "no copy" rows: the
target takes each block and copies nothing, i.e. the library's own cost (read, hash, dispatch).

Compression (``--compression-levels 1,3``, on by default; ``--no-plain`` skips the rows above): the same
session shape filled with K/V-like data -- f16 values from a normal distribution (a 16 MiB pool of
them, cycled: longer than any zstd window used here) -- saved uncompressed and with zstd at each level
(one thread; and ``threads=-1`` at the first level), then restored from the page cache (streaming and
staged, the target copying every byte). Printed: the file size ratio and each time as a ratio to the
uncompressed save/restore of the same session in this run. Dense f16 normal values compress poorly
(sign and exponent bits carry little entropy, the 10 mantissa bits are noise), so expect ~0.9.
``--recompress FILE`` measures the same on the K/V of an existing session file (e.g. one a real engine
saved): it is restored into memory and saved again, uncompressed and compressed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from strata_sessionfile import (
    BlockBuffers,
    Compression,
    EngineIdentity,
    EngineLimits,
    default_read_threads,
    inspect,
    restore,
    save,
)
from strata_sessionfile.format import DEFAULT_BLOCK_SIZE
from strata_sessionfile.testing import (
    MemoryAdapter,
    PatternSource,
    SinkTarget,
    fake_identity,
    synthetic_specs,
    tokens_for_bytes,
)

BLOCK = DEFAULT_BLOCK_SIZE


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


class _Peak:
    """Peak RSS growth of a block of code (VmHWM reset through /proc/self/clear_refs)."""

    def __enter__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        self.base = _status("VmRSS")
        return self

    def __exit__(self, *exc):
        self.growth = _status("VmHWM") - self.base


def evict(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def plain_write(path: str, n: int, buf: memoryview, fallocate: bool = False) -> float:
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if fallocate:  # the same reservation save() makes, to separate its effect from the library's
            os.posix_fallocate(fd, 0, n)
        done = 0
        while done < n:
            take = min(len(buf), n - done)
            view = buf[:take]
            while view:
                view = view[os.write(fd, view) :]
            done += take
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t


def plain_read(path: str, times: int, buf: memoryview) -> float:
    t = time.perf_counter()
    for _ in range(times):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t


class NoCopyTarget(SinkTarget):
    """Receives every block and copies nothing: the library's own cost (read, hash, dispatch)."""

    def copy_in(self, layer, part, offset, src):
        self.received += len(src)


class StagingMixin:
    def can_stage(self, plan):
        return True

    def begin_staging(self, plan):
        self.begin_apply(plan)

    def stage_in(self, layer, part, offset, src):
        self.copy_in(layer, part, offset, src)

    def commit_staged(self, state):
        self.commit(state)

    def discard_staged(self):
        pass


def bench_size(folder: str, gib: float, repeat: int) -> list[tuple]:
    specs = synthetic_specs()
    n_tokens = tokens_for_bytes(specs, int(gib * (1 << 30)))
    ident = fake_identity()
    source = PatternSource(ident, specs, n_tokens)
    path = os.path.join(folder, f"bench-{gib}g.ssf")
    base_path = os.path.join(folder, f"bench-{gib}g.plain")
    buf = memoryview(bytearray(os.urandom(1 << 20)) * (BLOCK >> 20))
    # kept across calls, as an engine would (the baselines reuse `buf`); one per reader thread + 1
    buffers = BlockBuffers(BLOCK, default_read_threads() + 1)
    rows = []
    best: dict[str, float] = {}
    peaks: dict[str, int] = {}

    def keep(name, secs, peak=None):
        best[name] = min(best.get(name, float("inf")), secs)
        if peak is not None:
            peaks[name] = max(peaks.get(name, 0), peak)

    try:
        for _ in range(repeat):
            for p in (path, base_path):
                if os.path.exists(p):
                    os.unlink(p)
            with _Peak() as pk:
                t = time.perf_counter()
                report = save(path, source, buffers=buffers)
                secs = time.perf_counter() - t
            keep("save", secs, pk.growth)
            size = report.bytes_written
            keep("write+fsync", plain_write(base_path, size, buf))
            os.unlink(base_path)
            keep("fallocate+write+fsync", plain_write(base_path, size, buf, fallocate=True))
            for cache in ("cold", "warm"):
                for mode, passes in (("streaming", 2), ("staged", 1)):
                    if cache == "cold":
                        evict(base_path)
                    keep(f"read x{passes} {cache}", plain_read(base_path, passes, buf))
                    for copy, cls in (("copy", SinkTarget), ("no copy", NoCopyTarget)):
                        if mode == "staged":
                            cls = type("Staging" + cls.__name__, (StagingMixin, cls), {})
                        target = cls(ident, specs)
                        if cache == "cold":
                            evict(path)
                        with _Peak() as pk:
                            t = time.perf_counter()
                            rr = restore(path, target, mode=mode, buffers=buffers)
                            secs = time.perf_counter() - t
                        keep(f"restore {mode} {cache} {copy}", secs, pk.growth)
                        assert rr.mode == mode and target.state is not None
        gb = size / 1e9
        rows.append(
            (f"{gib:g} GiB", "save", best["save"], best["write+fsync"], "write+fsync", gb, peaks["save"])
        )
        rows.append(
            (
                f"{gib:g} GiB",
                "save",
                best["save"],
                best["fallocate+write+fsync"],
                "falloc+write+fsync",
                gb,
                peaks["save"],
            )
        )
        for cache in ("cold", "warm"):
            for mode, passes in (("streaming", 2), ("staged", 1)):
                for copy in ("copy", "no copy"):
                    name = f"restore {mode} {cache} {copy}"
                    rows.append(
                        (
                            f"{gib:g} GiB",
                            name,
                            best[name],
                            best[f"read x{passes} {cache}"],
                            f"read x{passes} {cache}",
                            gb * passes,
                            peaks[name],
                        )
                    )
    finally:
        for p in (path, base_path):
            if os.path.exists(p):
                os.unlink(p)
    return rows


# --- compression ---------------------------------------------------------------------------------------
KV_POOL_BYTES = 16 << 20


class KVNormalSource(PatternSource):
    """A session of f16 values from N(0, 1) (a 16 MiB pool of them, cycled), holding none of it."""

    LAYER_STRIDE, PART_STRIDE = 40961 * 2, 6133 * 2  # even: every part starts on an f16 value

    def __init__(self, identity, specs, n_tokens: int, seed: int = 0) -> None:
        import numpy as np

        super().__init__(identity, specs, n_tokens, seed)
        values = np.random.default_rng(seed).standard_normal(KV_POOL_BYTES // 2).astype(np.float16)
        self._pattern = memoryview(values.tobytes())


class FileSessionAdapter(MemoryAdapter):
    """Holds an existing session file's session in memory (restored into it) and saves it again."""

    @classmethod
    def from_file(cls, path: str) -> FileSessionAdapter:
        md = inspect(path, verify=False).metadata
        adapter = cls(
            EngineIdentity(md.model, md.config),
            [g.spec for g in md.layers],
            max_tokens=md.state.n_tokens,
            vocab_size=None,
        )
        restore(path, adapter, mode="streaming")
        return adapter

    def limits(self) -> EngineLimits:
        return EngineLimits(max_tokens=self.max_tokens, layers=self.specs)


def _compression_variants(levels: list[int]) -> list[tuple[str, Compression | None]]:
    out: list[tuple[str, Compression | None]] = [("none", None)]
    for lv in levels:
        out.append((f"zstd {lv}", Compression("zstd", level=lv)))
    out.append((f"zstd {levels[0]} thr=-1", Compression("zstd", level=levels[0], threads=-1)))
    return out


def bench_compression(
    folder: str, label: str, source, restore_target, levels: list[int], repeat: int
) -> list[tuple]:
    """Rows (label, variant, file bytes, ratio, save s, x none, streaming s, x none, staged s, x none, peak MiB)."""
    path = os.path.join(folder, "bench-z.ssf")
    buffers = BlockBuffers(BLOCK, default_read_threads() + 1)
    results = {}
    try:
        for name, comp in _compression_variants(levels):
            best = {"save": float("inf"), "streaming": float("inf"), "staged": float("inf")}
            peak = 0
            for _ in range(repeat):
                if os.path.exists(path):
                    os.unlink(path)
                t = time.perf_counter()
                report = save(path, source, buffers=buffers, compression=comp)
                best["save"] = min(best["save"], time.perf_counter() - t)
                size = report.bytes_written
                for mode in ("streaming", "staged"):
                    target = restore_target(mode)
                    with _Peak() as pk:
                        t = time.perf_counter()
                        rr = restore(path, target, mode=mode, buffers=buffers)
                        best[mode] = min(best[mode], time.perf_counter() - t)
                    assert rr.mode == mode
                    peak = max(peak, pk.growth)
            results[name] = (size, best, peak)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    base_size, base, _ = results["none"]
    rows = []
    for name, (size, best, peak) in results.items():
        rows.append(
            (
                label,
                name,
                size,
                size / base_size,
                best["save"],
                best["save"] / base["save"],
                best["streaming"],
                best["streaming"] / base["streaming"],
                best["staged"],
                best["staged"] / base["staged"],
                peak / 2**20,
            )
        )
    return rows


def print_compression_rows(rows: list[tuple]) -> None:
    print(
        f"{'session':<22} {'compression':<15} {'file MiB':>9} {'ratio':>6} {'save s':>7} {'x none':>6} "
        f"{'stream s':>8} {'x none':>6} {'staged s':>8} {'x none':>6} {'peak RSS +MiB':>13}"
    )
    for label, name, size, ratio, save_s, save_x, st_s, st_x, sg_s, sg_x, peak in rows:
        print(
            f"{label:<22} {name:<15} {size / 2**20:9.1f} {ratio:6.3f} {save_s:7.3f} {save_x:6.2f} {st_s:8.3f} "
            f"{st_x:6.2f} {sg_s:8.3f} {sg_x:6.2f} {peak:13.1f}",
            flush=True,
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,4", help="session sizes in GiB, comma-separated")
    ap.add_argument("--dir", default=None, help="folder on the disk to measure (default: the repository's)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per size; the best time of each is kept")
    ap.add_argument(
        "--compression-levels", default="1,3", help="zstd levels to measure ('' skips compression)"
    )
    ap.add_argument(
        "--compression-sizes",
        default=None,
        help="session sizes in GiB for the compression rows (default: --sizes)",
    )
    ap.add_argument(
        "--no-plain", action="store_true", help="skip the uncompressed rows against the disk limit"
    )
    ap.add_argument("--recompress", default=None, help="also measure compression on this session file's K/V")
    args = ap.parse_args()
    folder = args.dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    folder = tempfile.mkdtemp(prefix=".bench-sessionfile-", dir=folder)
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    sizes = [float(s) for s in args.sizes.split(",")]
    print(
        f"strata-sessionfile bench: block {BLOCK >> 20} MiB, {os.cpu_count()} CPUs, folder {folder}, "
        f"{free / 2**30:.0f} GiB free, Python {sys.version.split()[0]}"
    )
    if not args.no_plain:
        print(
            f"{'size':>7} {'operation':<34} {'time s':>8} {'limit s':>8} {'ratio':>6} {'GB/s':>6}  "
            f"{'limit':<18} {'peak RSS +MiB':>13}"
        )
    try:
        for gib in [] if args.no_plain else sizes:
            if free < 2.2 * gib * (1 << 30):
                print(f"{gib:g} GiB: skipped, only {free / 2**30:.1f} GiB free")
                continue
            for size, op, secs, limit, limit_name, gb, peak in bench_size(folder, gib, args.repeat):
                print(
                    f"{size:>7} {op:<34} {secs:8.3f} {limit:8.3f} {secs / limit:6.3f} {gb / secs:6.2f}  "
                    f"{limit_name:<18} {peak / 2**20:13.1f}",
                    flush=True,
                )
        levels = [int(v) for v in args.compression_levels.split(",") if v.strip()]
        if levels:
            print(
                "\ncompression (page-cache restores; ratios against the uncompressed save/restore of the same "
                "session in this run):"
            )
            specs = synthetic_specs()
            ident = fake_identity()
            rows = []
            csizes = (
                [float(v) for v in args.compression_sizes.split(",")] if args.compression_sizes else sizes
            )
            for gib in csizes:
                if free < 1.2 * gib * (1 << 30):
                    print(f"{gib:g} GiB: skipped, only {free / 2**30:.1f} GiB free")
                    continue
                n_tokens = tokens_for_bytes(specs, int(gib * (1 << 30)))
                source = KVNormalSource(ident, specs, n_tokens)

                def target(mode):
                    cls = (
                        SinkTarget
                        if mode == "streaming"
                        else type("StagingSink", (StagingMixin, SinkTarget), {})
                    )
                    return cls(ident, specs)

                rows += bench_compression(
                    folder, f"{gib:g} GiB f16 N(0,1)", source, target, levels, args.repeat
                )
            if args.recompress:
                held = FileSessionAdapter.from_file(args.recompress)

                def file_target(mode):
                    t = FileSessionAdapter(
                        held.identity(),
                        held.specs,
                        max_tokens=held.max_tokens,
                        vocab_size=None,
                        staging=(mode == "staged"),
                    )
                    return t

                label = os.path.basename(args.recompress)[:22]
                rows += bench_compression(folder, label, held, file_target, levels, args.repeat)
            print_compression_rows(rows)
    finally:
        os.rmdir(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
