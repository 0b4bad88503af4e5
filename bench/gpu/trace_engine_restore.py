"""A timeline of each RESTORE in fresh `strata-engine serve` processes: where the first restore of a
process spends what later ones do not.

    python3 bench/gpu/trace_engine_restore.py --model PATH --tokens 32715 [--backend cupy] [--engines 2]
        [--restores 3] [--folder /tmp] [--args "--kv-resident 1024"]

One untraced engine prefills --tokens random ids and SAVEs; then each of --engines fresh engines runs
under a tracer (this script with --serve) and RESTOREs the file --restores times. The tracer records,
relative to the verb's start: every read job of the reader threads (thread, start, end, bytes), the
calling thread's waits for them (take), each hash update, each adapter call, the library's steps. The
report per restore: totals per kind, the effective rates, and the first and last blocks' timelines.

--variant changes the traced engines only (for comparisons; none of these is a setting of the engine):
``vram-staging`` (a fresh engine stages in a VRAM area, as before it staged into its own pool),
``threads=N`` (N reader threads), ``block=MiB`` (the block size), ``spin=MS`` (the engine's thread
busy-waits MS milliseconds before each RESTORE, outside the timeline: whether a core that was idle, not
the code, makes a process's first restore slower).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ADAPTER_CALLS = (
    "check_plan",
    "can_stage",
    "begin_staging",
    "stage_in",
    "commit_staged",
    "begin_apply",
    "copy_in",
    "commit",
    "wait_copies",
    "block_buffers",
    "discard_staged",
)
# (module, name): each library step is wrapped where its caller looks it up.
LIBRARY_STEPS = (
    ("reader", "open_metadata"),
    ("validate", "check_limits"),
    ("reader", "preflight"),
    ("datapass", "stream_data"),
    ("apply", "stream_data"),
    ("apply", "land_data"),
    ("reader", "hash_pass"),
    ("reader", "apply_staged"),
    ("reader", "apply_streaming"),
    ("validate", "decode_metadata"),
    ("validate", "compute_layout"),
    ("validate", "binding_check"),
    ("validate", "decode_header"),
    ("validate", "decode_trailer"),
    ("validate", "read_exact_parallel"),
    ("apply", "read_exact_parallel"),
    ("validate", "fresh_buffer"),
)


# ---- the traced engine (runs inside the engine process) -------------------------------------------
def serve_traced(argv: list[str], out: str, variant: str) -> int:
    import importlib

    from strata_engine import cli
    from strata_engine.session import adapter as adapter_mod
    from strata_engine.session import verbs
    from strata_sessionfile import auth, pipelines

    if variant in ("", "none"):
        pass
    elif variant == "vram-staging":
        adapter_mod.EngineSession._stages_in_pool = lambda self: False
    elif variant.startswith("threads="):
        verbs.SessionVerbs.read_threads = lambda self, n=int(variant[8:]): n
    elif variant.startswith("block="):
        verbs.SESSION_BLOCK_SIZE = int(variant[6:]) << 20
    elif variant.startswith("spin="):
        spin_s = int(variant[5:]) / 1000
    else:
        raise SystemExit(f"unknown variant {variant!r}")

    events: list[tuple] = []
    clock = time.perf_counter
    origin = [clock()]

    def note(kind: str, t0: float, t1: float, extra=None) -> None:
        events.append((kind, (t0 - origin[0]) * 1e3, (t1 - origin[0]) * 1e3, extra))

    def wrap(owner, name, extra=None):
        fn = getattr(owner, name)

        def call(*a, **k):
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                note(name, t0, clock(), extra(*a, **k) if extra else None)

        setattr(owner, name, call)

    for name in ADAPTER_CALLS:
        if hasattr(adapter_mod.EngineSession, name):
            wrap(adapter_mod.EngineSession, name)
    for module, name in LIBRARY_STEPS:
        wrap(importlib.import_module(f"strata_sessionfile.{module}"), name)
    wrap(pipelines.OrderedReads, "take")
    real_read = pipelines.OrderedReads._read

    def traced_read(self, offset, views):
        t0 = clock()
        try:
            return real_read(self, offset, views)
        finally:
            note("read", t0, clock(), (threading.current_thread().name, offset, sum(len(v) for v in views)))

    pipelines.OrderedReads._read = traced_read
    real_xxhash = (
        auth.xxhash
    )  # every pass's hasher (auth.payload_hasher) is a copy of the one started on the prefix

    class TracedHash:
        def __init__(self, *args):
            self.h = real_xxhash.xxh3_128(*args)

        def update(self, data):
            t0 = clock()
            self.h.update(data)
            note(
                "hash",
                t0,
                clock(),
                len(memoryview(data).cast("B")) if not isinstance(data, bytes) else len(data),
            )

        def digest(self):
            return self.h.digest()

        def copy(self):
            c = TracedHash.__new__(TracedHash)
            c.h = self.h.copy()
            return c

    class XX:
        xxh3_128 = TracedHash

    auth.xxhash = XX
    real_restore = verbs.SessionVerbs.restore
    count = [0]

    def restore(self, ctx, path):
        events.clear()
        if variant.startswith("spin="):
            until = clock() + spin_s
            while clock() < until:
                pass
        origin[0] = clock()
        try:
            return real_restore(self, ctx, path)
        finally:
            note("RESTORE", origin[0], clock())
            with open(f"{out}.{count[0]}.json", "w") as f:
                json.dump(events, f)
            count[0] += 1

    verbs.SessionVerbs.restore = restore
    return cli.main(argv)


# ---- the driver -------------------------------------------------------------------------------------
class Engine:
    def __init__(self, cmd: list[str], env: dict | None = None):
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, **(env or {})},
        )
        ready = self.read()
        assert ready["event"] == "ready", ready

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine exited with {self.proc.wait()}")
        return json.loads(line)

    def command(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        while True:
            event = self.read()
            if event["event"] in ("result", "error"):
                if event["event"] == "error":
                    raise RuntimeError(f"{line[:40]}: {event['error']}")
                return event

    def quit(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def summarize(events: list, label: str) -> None:
    by: dict[str, list] = {}
    for kind, t0, t1, extra in events:
        by.setdefault(kind, []).append((t0, t1, extra))

    def total(kind: str) -> float:
        return sum(t1 - t0 for t0, t1, _ in by.get(kind, []))

    def span(kind: str) -> str:
        got = by.get(kind)
        return f"{got[0][0]:.2f}-{got[-1][1]:.2f}" if got else "-"

    whole = by["RESTORE"][0][1]
    reads = by.get("read", [])
    read_bytes = sum(e[2] for _, _, e in reads)
    read_ms = sum(t1 - t0 for t0, t1, _ in reads)
    first_read = reads[0][0] if reads else 0.0
    hashes = [h for h in by.get("hash", []) if h[0] >= first_read]  # the data section's (not the prefix's)
    hash_bytes = sum(h[2] for h in hashes)
    hash_ms = sum(t1 - t0 for t0, t1, _ in hashes)
    print(
        f"  {label}: {whole:.2f} ms | open_metadata {total('open_metadata'):.2f} check_plan {total('check_plan'):.2f} "
        f"begin_staging {total('begin_staging'):.2f} stream/land {total('stream_data') + total('land_data'):.2f} "
        f"[{span('read')}] commit_staged {total('commit_staged'):.2f} commit {total('commit'):.2f}"
    )
    print(
        f"     reads: {len(reads)} jobs {read_bytes / 1e6:.1f} MB, {read_ms:.2f} ms thread-time "
        f"({read_bytes / max(read_ms, 1e-9) / 1e6:.1f} GB/s per thread), threads "
        f"{len({e[0] for _, _, e in reads})}; take waits {total('take'):.2f} ms over {len(by.get('take', []))}; "
        f"hash {hash_ms:.2f} ms ({hash_bytes / max(hash_ms, 1e-9) / 1e6:.1f} GB/s); stage_in {total('stage_in'):.2f}; "
        f"copy_in {total('copy_in'):.2f}; wait_copies {total('wait_copies'):.2f} over {len(by.get('wait_copies', []))}"
    )
    per_block = {"read", "take", "hash", "stage_in", "copy_in", "wait_copies", "RESTORE"}
    steps = sorted((t0, kind, t1 - t0) for kind, t0, t1, _ in events if kind not in per_block)
    print("     steps: " + " ".join(f"{kind}@{t0:.2f}+{d:.2f}" for t0, kind, d in steps))
    takes = by.get("take", [])
    if reads and takes:
        rows = []
        ordered = sorted(reads, key=lambda e: e[2][1])
        for i, (r, t) in enumerate(zip(ordered, takes, strict=False)):
            until = takes[i + 1][0] if i + 1 < len(takes) else whole
            mine = [h for h in hashes if t[1] <= h[0] < until]  # what this thread hashed after the take
            h_ms = sum(h[1] - h[0] for h in mine)
            rows.append(
                f"#{i} read {r[0]:.2f}-{r[1]:.2f} ({r[2][2] / max(r[1] - r[0], 1e-9) / 1e6:.1f} GB/s, "
                f"{r[2][0][-1]}) take {t[0]:.2f}-{t[1]:.2f} hash {h_ms:.2f} ms until {until:.2f}"
            )
        show = rows[:5] + (["..."] if len(rows) > 8 else []) + rows[max(5, len(rows) - 3) :]
        for row in show:
            print("       " + row)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        return serve_traced(sys.argv[4:], sys.argv[2], sys.argv[3])
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=7915)
    ap.add_argument("--backend", default="cupy")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--restores", type=int, default=3)
    ap.add_argument("--folder", default="/tmp")
    ap.add_argument("--args", default="", help="more `serve` arguments, e.g. '--kv-resident 1024'")
    ap.add_argument("--mode", default="auto")
    ap.add_argument(
        "--variant",
        default="none",
        help="none | vram-staging | threads=N | block=MiB | spin=MS (see the docstring)",
    )
    a = ap.parse_args()
    serve = [
        "serve",
        "--model",
        a.model,
        "--ctx-size",
        str(a.tokens + 64),
        "--backend",
        a.backend,
        "--restore-mode",
        a.mode,
        *shlex.split(a.args),
    ]
    folder = Path(a.folder)
    tag = "".join(c if c.isalnum() else "_" for c in a.args)
    path = folder / f"trace-{Path(a.model).stem}-{a.tokens}-{a.backend}{tag}.ssf"
    if not path.exists():
        e = Engine([sys.executable, "-m", "strata_engine.cli", *serve])
        prompt = np.random.default_rng(5).integers(100, 5000, a.tokens).tolist()
        e.command("COMPLETE " + json.dumps({"prompt": prompt, "n_predict": 1, "temperature": 0}))
        e.command("SAVE " + json.dumps({"path": str(path)}))
        e.quit()
    size = path.stat().st_size
    print(
        f"{path.name}: {size / 1e6:.1f} MB, {a.tokens} tokens, backend {a.backend} {a.args} "
        f"variant {a.variant}"
    )
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    from bench_session import plain_read  # the CPU benchmark's plain read

    for k in range(a.engines):
        out = str(folder / f"trace-{os.getpid()}-{k}")
        e = Engine([sys.executable, __file__, "--serve", out, a.variant, *serve])
        base = min(plain_read(path) for _ in range(3)) * 1e3
        print(f"engine {k}: plain read {base:.2f} ms")
        for r in range(a.restores):
            res = e.command("RESTORE " + json.dumps({"path": str(path)}))
            with open(f"{out}.{r}.json") as f:
                events = json.load(f)
            summarize(
                events,
                f"RESTORE #{r} restore_ms {res['restore_ms']:.2f} (x{res['restore_ms'] / base:.2f}) "
                f"mode {res['mode']}, verb",
            )
        e.quit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
