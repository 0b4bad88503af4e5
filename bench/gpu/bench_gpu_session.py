"""Session save/restore on the GPU against the disk's own limits, measured in one run on that machine.

    python3 bench/gpu/bench_gpu_session.py --model smollm2=PATH --model gemma3=PATH \
        [--gemma3-tokens 32700] [--smollm2-tokens 7900] [--synthetic-tokens 131072] [--dir D]

1. Real conversations through `strata-engine serve --backend cupy` processes (bench_session.py's
   procedure: cold turn, SAVE, next turn never restarted; new process RESTORE auto (staged in VRAM for a
   device pool) and streaming, next turn), for the device pool and for the host-mapped pool behind a
   VRAM ring (`--kv-resident 1024`): save vs a plain write+fsync of the same bytes, restore vs the plain
   page-cache reads it needs, RSS during the restore, next turn after restore vs never restarted vs cold.
2. A synthetic multi-GiB session (smollm2 geometry at --synthetic-tokens: 23,040 B/token, ~2.8 GiB at
   131,072), random f16 K/V written straight into the device pool in-process and saved with the
   engine's adapter (pinned block buffers); restored by a new engine process, cold (file evicted from
   the page cache with posix_fadvise) and warm, against plain cold and warm reads of the same file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from strata_engine.client import EngineProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
import bench_session as BS  # noqa: E402 - the CPU benchmark's procedure, reused with GPU settings

MODELS: dict[str, Path] = {}
EXTRA_ARGS: list[str] = []


def gpu_engine(model: str, *args: str) -> EngineProcess:
    """bench_session's engine, on the models given here with the GPU arguments added."""
    return EngineProcess(MODELS[model], *args, *EXTRA_ARGS, timeout_s=3600)


BS.engine = gpu_engine
BS.model_path = lambda name: MODELS[name]


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


PLACEMENTS = {"device-pool": [], "host-pool+ring1024": ["--kv-resident", "1024"]}


def real_conversations(models: dict[str, int], folder: Path, placements: list[str]) -> list[dict]:
    out = []
    for placement in placements:
        extra = PLACEMENTS[placement]
        EXTRA_ARGS[:] = ["--backend", "cupy", "--prefill-chunk", "2048", *extra]
        for model, n_prompt in models.items():
            n_ctx = n_prompt + 68
            r = BS.bench_model(model, n_prompt, n_ctx, folder, depth_sweep=False)
            r["placement"] = placement
            print(f"\n#### {placement}")
            BS.report(r, None)
            sys.stdout.flush()
            out.append(r)
    return out


def synthetic_session(n_tokens: int, folder: Path) -> dict:
    import cupy as cp
    import strata_sessionfile as sf
    from strata_engine.runner import RunnerState
    from strata_engine.session import EngineSession
    from strata_engine.settings import EngineSettings
    from strata_engine.slots import SlotSet

    settings = EngineSettings(model_path=MODELS["smollm2"], n_ctx=n_tokens, backend="cupy")
    runner = SlotSet.load(settings).runners[0]
    pool = runner.pool
    rng = cp.random.default_rng(1)
    for i in range(pool.geometry.n_layers):
        layer = pool.layer(i)
        for arr in (layer.k, layer.v):
            arr[...] = rng.standard_normal(arr.shape, dtype=cp.float32).astype(cp.float16)
    cp.cuda.Device().synchronize()
    tokens = tuple(int(t) for t in np.random.default_rng(2).integers(100, 5000, n_tokens))
    runner.restore_state(RunnerState(tokens, 0))
    path = folder / "synthetic.ssf"
    t0 = time.perf_counter()
    report = sf.save(path, EngineSession(runner))
    save_s = time.perf_counter() - t0
    size = path.stat().st_size
    del runner, pool
    cp.get_default_memory_pool().free_all_blocks()
    r: dict = {"n_tokens": n_tokens, "file_bytes": size, "save_s": save_s, "save_report_ms": report.save_ms
               if hasattr(report, "save_ms") else None}  # fmt: skip
    r["plain_write_fsync_s"] = BS.plain_write_fsync(folder, size)
    evict(path)
    r["plain_read_cold_s"] = BS.plain_read(path)
    r["plain_read_warm_s"] = min(BS.plain_read(path) for _ in range(2))
    # In-process restores of the warm file, twice: a first-restore-only cost shows as their difference.
    runner = SlotSet.load(settings).runners[0]
    for k in (1, 2):
        t0 = time.perf_counter()
        sf.restore(path, EngineSession(runner))
        r[f"in_process_restore_{k}_s"] = time.perf_counter() - t0
    del runner
    cp.get_default_memory_pool().free_all_blocks()
    EXTRA_ARGS[:] = ["--backend", "cupy"]
    for mode in ("auto", "streaming"):
        for temp in ("cold", "warm"):
            e = gpu_engine("smollm2", "--ctx-size", str(n_tokens), "--restore-mode", mode)
            if temp == "cold":
                evict(path)
            else:
                BS.plain_read(path)
            r[f"restore_{mode}_{temp}"] = BS.restore_measured(e, path)
            e.quit()
    return r


def report_synthetic(r: dict) -> None:
    gb = r["file_bytes"] / 1e9
    print(
        f"\n== synthetic session: {r['n_tokens']} tokens of smollm2 K/V (f16), file {r['file_bytes']:,d} B "
        f"({r['file_bytes'] / (1 << 30):.2f} GiB) =="
    )
    print(
        f"save      {r['save_s']:.2f} s ({gb / r['save_s']:.2f} GB/s)   plain write+fsync {r['plain_write_fsync_s']:.2f} s "
        f"({gb / r['plain_write_fsync_s']:.2f} GB/s)   x{r['save_s'] / r['plain_write_fsync_s']:.2f}"
    )
    print(
        f"plain reads: cold {r['plain_read_cold_s']:.2f} s ({gb / r['plain_read_cold_s']:.2f} GB/s), "
        f"warm {r['plain_read_warm_s']:.2f} s ({gb / r['plain_read_warm_s']:.2f} GB/s)"
    )
    print(
        f"in-process restores (auto, warm file): first {r['in_process_restore_1_s']:.2f} s, "
        f"second {r['in_process_restore_2_s']:.2f} s"
    )
    for mode in ("auto", "streaming"):
        for temp in ("cold", "warm"):
            rs = r[f"restore_{mode}_{temp}"]
            reads = 1 if rs["mode"] == "staged" else 2
            if temp == "cold":  # streaming: the first pass is cold, the second finds the file cached
                base = r["plain_read_cold_s"] + (reads - 1) * r["plain_read_warm_s"]
            else:
                base = reads * r["plain_read_warm_s"]
            print(
                f"restore {mode:9s} {temp}: {rs['restore_ms'] / 1000:.2f} s ({rs['mode']}), plain reads {base:.2f} s "
                f"x{rs['restore_ms'] / 1000 / base:.2f}; RSS peak above before {BS.mib(rs['peak_above_before'])}, "
                f"transient {BS.mib(rs['transient'])}"
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, help="NAME=PATH (repeatable)")
    ap.add_argument("--smollm2-tokens", type=int, default=7900)
    ap.add_argument("--gemma3-tokens", type=int, default=32700)
    ap.add_argument("--synthetic-tokens", type=int, default=131072, help="0: skip")
    ap.add_argument("--placements", default=",".join(PLACEMENTS))
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    for spec in args.model:
        name, path = spec.split("=", 1)
        MODELS[name] = Path(path)
    sizes = {"smollm2": args.smollm2_tokens, "gemma3": args.gemma3_tokens}
    folder = Path(tempfile.mkdtemp(prefix=".bench-gpu-session-", dir=args.dir or BS.REPO))
    results: dict = {}
    try:
        results["real"] = real_conversations(
            {m: sizes[m] for m in MODELS}, folder, args.placements.split(",")
        )
        if args.synthetic_tokens and "smollm2" in MODELS:
            results["synthetic"] = synthetic_session(args.synthetic_tokens, folder)
            report_synthetic(results["synthetic"])
    finally:
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
