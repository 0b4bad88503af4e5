"""Session file save/restore against the physical limit: a plain sequential write+fsync of the same bytes,
and the plain sequential reads a restore needs (streaming: the file twice; staged: once), on the same disk,
in one run. Prints ratios and the peak RSS growth of each operation.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/bench_sessionfile.py [--sizes 1,4] [--dir D]

Cold runs evict the file from the page cache first (posix_fadvise DONTNEED after fsync); warm runs read
from the page cache. "copy" rows: the restore target copies every byte into a 64 MiB ring "pool" (a real
memcpy per byte, as an engine's adapter does), which the plain-read baseline does not; "no copy" rows: the
target takes each block and copies nothing, i.e. the library's own cost (read, hash, dispatch).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from strata_sessionfile import BlockBuffers, restore, save
from strata_sessionfile.format import DEFAULT_BLOCK_SIZE
from strata_sessionfile.testing import (
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
                view = view[os.write(fd, view):]
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
    buffers = BlockBuffers(BLOCK)  # kept across calls, as an engine would (the baselines reuse `buf`)
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
        rows.append((f"{gib:g} GiB", "save", best["save"], best["write+fsync"], "write+fsync", gb, peaks["save"]))
        rows.append((f"{gib:g} GiB", "save", best["save"], best["fallocate+write+fsync"], "falloc+write+fsync",
                     gb, peaks["save"]))
        for cache in ("cold", "warm"):
            for mode, passes in (("streaming", 2), ("staged", 1)):
                for copy in ("copy", "no copy"):
                    name = f"restore {mode} {cache} {copy}"
                    rows.append((f"{gib:g} GiB", name, best[name], best[f"read x{passes} {cache}"],
                                 f"read x{passes} {cache}", gb * passes, peaks[name]))
    finally:
        for p in (path, base_path):
            if os.path.exists(p):
                os.unlink(p)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,4", help="session sizes in GiB, comma-separated")
    ap.add_argument("--dir", default=None, help="folder on the disk to measure (default: the repository's)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per size; the best time of each is kept")
    args = ap.parse_args()
    folder = args.dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    folder = tempfile.mkdtemp(prefix=".bench-sessionfile-", dir=folder)
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    sizes = [float(s) for s in args.sizes.split(",")]
    print(f"strata-sessionfile bench: block {BLOCK >> 20} MiB, {os.cpu_count()} CPUs, folder {folder}, "
          f"{free / 2**30:.0f} GiB free, Python {sys.version.split()[0]}")
    print(f"{'size':>7} {'operation':<34} {'time s':>8} {'limit s':>8} {'ratio':>6} {'GB/s':>6}  "
          f"{'limit':<18} {'peak RSS +MiB':>13}")
    try:
        for gib in sizes:
            if free < 2.2 * gib * (1 << 30):
                print(f"{gib:g} GiB: skipped, only {free / 2**30:.1f} GiB free")
                continue
            for size, op, secs, limit, limit_name, gb, peak in bench_size(folder, gib, args.repeat):
                print(f"{size:>7} {op:<34} {secs:8.3f} {limit:8.3f} {secs / limit:6.3f} {gb / secs:6.2f}  "
                      f"{limit_name:<18} {peak / 2**20:13.1f}", flush=True)
    finally:
        os.rmdir(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
