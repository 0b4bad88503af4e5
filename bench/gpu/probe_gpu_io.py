"""What the save / restore path can reach on this machine: the primitives a session file's I/O is made of.

    python3 bench/gpu/probe_gpu_io.py [--folder DIR] [--mib 116]

Measures, on a file of --mib MiB in --folder (page cache warm for the reads, as a restore of a file just
written): one sequential read into a reused 16 MiB buffer (the benchmarks' "plain read"); the same file
read by 2, 4 and 8 threads at once (disjoint 4 MiB blocks, each thread its own buffer); XXH3-128 on one
core, over the whole buffer (from memory) and over each 4 MiB block right after one thread read it
(cache-warm); the session library's restore pipeline on this file (strata_sessionfile's ReadAhead: N
reader threads, blocks hashed in file order on the calling thread) for N = 1, 2, 4; pinned host ->
device copies; a plain write + fsync against the same writes with the kernel's writeback started after
each 4 MiB block (sync_file_range, SYNC_FILE_RANGE_WRITE) and one fsync at the end. Runs without CuPy
too (the device copy is then left out), and without strata_sessionfile (its pipeline is then left out).
Best of 3 per figure.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import threading
import time

import xxhash

BLOCK = 4 << 20
SYNC_FILE_RANGE_WRITE = 2


def best(f, n: int = 3) -> float:
    return min(f() for _ in range(n))


def plain_read(path: str) -> float:
    buf = memoryview(bytearray(16 << 20))
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    while os.readv(fd, [buf]):
        pass
    os.close(fd)
    return time.perf_counter() - t0


def threaded_read(path: str, size: int, threads: int) -> float:
    bufs = [memoryview(bytearray(BLOCK)) for _ in range(threads)]
    fd = os.open(path, os.O_RDONLY)
    blocks = list(range(0, size, BLOCK))

    def work(k: int) -> None:
        for off in blocks[k::threads]:
            os.preadv(fd, [bufs[k]], off)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    elapsed = time.perf_counter() - t0
    os.close(fd)
    return elapsed


def write_fsync(folder: str, size: int, data: bytes, early: bool) -> float:
    libc = ctypes.CDLL(None, use_errno=True)
    sfr = libc.sync_file_range
    sfr.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    path = os.path.join(folder, "probe-write.bin")
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    off = 0
    while off < size:
        n = os.write(fd, memoryview(data)[: min(BLOCK, size - off)])
        if early:
            sfr(fd, off, n, SYNC_FILE_RANGE_WRITE)
        off += n
    os.fsync(fd)
    os.close(fd)
    elapsed = time.perf_counter() - t0
    os.unlink(path)
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--folder", default="/tmp")
    ap.add_argument("--mib", type=int, default=116)
    args = ap.parse_args()
    size = args.mib << 20
    gb = size / 1e9
    data = os.urandom(BLOCK)
    path = os.path.join(args.folder, "probe-read.bin")
    with open(path, "wb") as f:
        for _ in range(0, size, BLOCK):
            f.write(data)
    plain_read(path)
    t = best(lambda: plain_read(path))
    print(f"plain read (1 thread, 16 MiB buffer)  {t * 1e3:7.1f} ms  {gb / t:5.1f} GB/s", flush=True)
    for threads in (2, 4, 8):
        t = best(lambda threads=threads: threaded_read(path, size, threads))
        print(
            f"read by {threads} threads (4 MiB blocks)     {t * 1e3:7.1f} ms  {gb / t:5.1f} GB/s", flush=True
        )
    payload = memoryview(bytearray(size))

    def hash_all() -> float:
        t0 = time.perf_counter()
        h = xxhash.xxh3_128()
        for lo in range(0, size, BLOCK):
            h.update(payload[lo : lo + BLOCK])
        return time.perf_counter() - t0

    t = best(hash_all)
    print(f"xxh3_128, one core                   {t * 1e3:7.1f} ms  {gb / t:5.1f} GB/s", flush=True)
    block = memoryview(bytearray(BLOCK))

    def hash_after_read() -> float:  # the hash's time only, each block just read into a reused buffer
        fd = os.open(path, os.O_RDONLY)
        h, spent = xxhash.xxh3_128(), 0.0
        for off in range(0, size, BLOCK):
            os.preadv(fd, [block], off)
            t0 = time.perf_counter()
            h.update(block)
            spent += time.perf_counter() - t0
        os.close(fd)
        return spent

    t = best(hash_after_read)
    print(f"xxh3_128 of each block after its read {t * 1e3:6.1f} ms  {gb / t:5.1f} GB/s", flush=True)
    try:
        from strata_sessionfile import _fileio, pipelines
    except ImportError:
        pipelines = None
        print("no strata_sessionfile: its restore pipeline not measured")
    if pipelines is not None:
        for threads in (1, 2, 4, 8):
            bufs = [memoryview(bytearray(BLOCK)) for _ in range(threads + 1)]

            def pipeline(threads: int = threads, bufs: list = bufs) -> tuple[float, float]:
                t0 = time.perf_counter()
                source = _fileio.FileSource(path)
                readers = pipelines.ReadThreads(threads)
                h, hashing = xxhash.xxh3_128(), 0.0
                reader = pipelines.ReadAhead(source, bufs, pipelines.block_chunks(0, size, BLOCK), readers)
                try:
                    for _offset, view in reader:
                        t1 = time.perf_counter()
                        h.update(view)  # on the calling thread, another core than the reader's
                        hashing += time.perf_counter() - t1
                finally:
                    reader.close()
                    readers.close()
                    source.close()
                return time.perf_counter() - t0, hashing

            t, hashing = min(pipeline() for _ in range(3))
            print(
                f"library read + in-order hash, {threads} reader(s) {t * 1e3:5.1f} ms  {gb / t:5.1f} GB/s"
                f"  (hashing {hashing * 1e3:.1f} ms of it)",
                flush=True,
            )
    try:
        import cupy as cp
        import cupyx

        host = cupyx.empty_pinned((size,), dtype="u1")
        dev = cp.empty(size, dtype=cp.uint8)

        def h2d() -> float:
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            for lo in range(0, size, BLOCK):
                dev[lo : lo + BLOCK].set(host[lo : lo + BLOCK])
            cp.cuda.Device().synchronize()
            return time.perf_counter() - t0

        h2d()
        t = best(h2d)
        print(f"pinned host -> device, 4 MiB copies  {t * 1e3:7.1f} ms  {gb / t:5.1f} GB/s", flush=True)
    except ImportError:
        print("no cupy: device copies not measured")
    for _ in range(2):
        for early in (False, True):
            t = write_fsync(args.folder, size, data, early)
            label = "write + writeback per block + fsync" if early else "plain write + fsync           "
            print(f"{label}   {t * 1e3:7.1f} ms  {gb / t:5.2f} GB/s", flush=True)
    os.unlink(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
