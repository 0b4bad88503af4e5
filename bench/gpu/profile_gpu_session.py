"""Where an in-process SAVE / RESTORE of a device-pool session spends its time (cupy backend).

    python3 bench/gpu/profile_gpu_session.py --model PATH [--tokens 7915] [--folder /tmp] [--backend cupy]

A runner's device pool is filled with random f16 K/V for --tokens positions (no prefill), saved, then
restored in-process (staged, streaming) three times each; printed per operation: the times of the
library's report (read pass / apply), the milliseconds in each adapter call and library step, a plain
read of the same file; staged restores by 1-8 readers; and the
functions with the most own time in one profiled staged and one profiled streaming restore and one save.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from bench_session import plain_read  # noqa: E402 - the CPU benchmark's plain read

ADAPTER_CALLS = (
    "identity",
    "limits",
    "check_plan",
    "can_stage",
    "begin_staging",
    "stage_in",
    "commit_staged",
    "begin_apply",
    "copy_in",
    "landing_views",
    "commit",
    "block_buffers",
    "wait_copies",
)


# (module, name): each library step is wrapped where its caller looks it up.
LIBRARY_STEPS = (
    ("reader", "open_metadata"),
    ("validate", "check_limits"),
    ("reader", "preflight"),
    ("datapass", "stream_data"),
    ("apply", "stream_data"),
    ("apply", "land_data"),
    ("datapass", "check_unchanged"),
    ("apply", "check_unchanged"),
)


def timed_calls(adapter, runner) -> dict[str, float]:
    """Wrap the adapter's calls, the runner's restore_state and the library's steps (reader module) to sum
    the milliseconds spent in each."""
    import importlib

    from strata_sessionfile import pipelines, validate

    spent: dict[str, float] = {}

    def wrap(owner, name):
        fn = getattr(owner, name)

        def call(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + (time.perf_counter() - t0) * 1e3

        setattr(owner, name, call)

    for name in ADAPTER_CALLS:
        if hasattr(adapter, name):
            wrap(adapter, name)
    wrap(runner, "restore_state")
    for module, name in LIBRARY_STEPS:
        wrap(importlib.import_module(f"strata_sessionfile.{module}"), name)
    wrap(pipelines.OrderedReads, "take")  # the calling thread waiting for a block's read
    real_xxhash = validate.xxhash  # every pass's hasher is a copy of the one validate starts on the prefix

    class TimedHash:  # the payload hash's update calls, timed (the library hashes on the calling thread)
        def __init__(self, *args):
            self.inner = real_xxhash.xxh3_128(*args)

        def update(self, data):
            t0 = time.perf_counter()
            self.inner.update(data)
            spent["hash"] = spent.get("hash", 0.0) + (time.perf_counter() - t0) * 1e3

        def copy(self):
            twin = TimedHash()
            twin.inner = self.inner.copy()
            return twin

        def digest(self):
            return self.inner.digest()

    validate.xxhash = type("TimedXXHash", (), {"xxh3_128": TimedHash})
    return spent


def main() -> int:
    import strata_sessionfile as sf
    from strata_engine.runner import RunnerState
    from strata_engine.session import EngineSession
    from strata_engine.session.buffers import BlockBufferCache
    from strata_engine.session.verbs import SessionOptions, SessionVerbs
    from strata_engine.settings import EngineSettings
    from strata_engine.slots import SlotSet

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=7915)
    ap.add_argument("--folder", default="/tmp")
    ap.add_argument("--backend", default="cupy", help="numpy runs the same on the CPU (a host pool)")
    ap.add_argument(
        "--prefill",
        action="store_true",
        help="a real prefill of the tokens (ring checkpoint included) instead of random K/V",
    )
    args = ap.parse_args()
    n = args.tokens
    settings = EngineSettings(model_path=Path(args.model), n_ctx=n + 64, backend=args.backend)
    runner = SlotSet.load(settings).runners[0]
    pool, xp = runner.pool, runner.model.ops.xp
    tokens = tuple(int(t) for t in np.random.default_rng(2).integers(100, 5000, n))
    if args.prefill:
        runner.prefill(list(tokens))
    else:
        rng = xp.random.default_rng(1)
        for i in range(pool.geometry.n_layers):
            layer = pool.layer(i)
            for arr in (layer.k, layer.v):
                arr[...] = rng.standard_normal(arr.shape, dtype=xp.float32).astype(xp.float16)
        getattr(runner.model.ops, "synchronize", lambda: None)()
        runner.restore_state(RunnerState(tokens, 0))
    verbs = SessionVerbs(SessionOptions())
    block = verbs.block_size(runner)
    adapter = EngineSession(runner, buffers=BlockBufferCache())
    path = Path(args.folder) / "profile-session.ssf"
    for _ in range(2):
        sf.save(path, adapter, block_size=block)
    size = path.stat().st_size
    plain_read(path)
    read_s = min(plain_read(path) for _ in range(3))
    print(
        f"{n} tokens, file {size:,} B, block {block >> 20} MiB, plain read {read_s * 1e3:.1f} ms", flush=True
    )
    spent = timed_calls(adapter, runner)
    for mode in ("staged", "streaming"):
        for k in range(3):
            spent.clear()
            t0 = time.perf_counter()
            r = sf.restore(path, adapter, mode=mode, block_size=block)
            wall = time.perf_counter() - t0
            calls = ", ".join(f"{name} {ms:.1f}" for name, ms in spent.items())
            print(
                f"restore {mode:9s} #{k}: {wall * 1e3:6.1f} ms (read pass {r.read_pass_s * 1e3:5.1f}, apply "
                f"{r.apply_s * 1e3:5.1f}) x{wall / read_s:.2f} of the plain read; ms in: {calls}",
                flush=True,
            )
    # The engine process also holds the tokenizer (tens of thousands of Python objects the collector scans):
    # staged restores with it alive, then after gc.freeze() (start-up objects out of the collector's reach).
    import gc

    from strata_engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf_metadata(runner.gguf.metadata)
    for label in ("tokenizer held", "tokenizer held, gc.freeze()"):
        if "freeze" in label:
            gc.freeze()
        walls, collections = [], sum(st["collections"] for st in gc.get_stats())
        for _ in range(5):
            t0 = time.perf_counter()
            sf.restore(path, adapter, mode="staged", block_size=block)
            walls.append(time.perf_counter() - t0)
        collections = sum(st["collections"] for st in gc.get_stats()) - collections
        print(
            f"staged, {label}: best {min(walls) * 1e3:6.1f} ms, median {sorted(walls)[2] * 1e3:6.1f} ms, "
            f"{collections} collections in 5 restores; {len(gc.get_objects())} tracked objects",
            flush=True,
        )
    gc.unfreeze()
    del tokenizer
    for readers, size in ((1, block), (2, block), (4, block), (8, block), (4, 2 * block), (4, 4 * block)):
        sf.restore(
            path, adapter, mode="staged", block_size=size, read_threads=readers
        )  # buffers of that size
        walls = []
        for _ in range(5):
            t0 = time.perf_counter()
            sf.restore(path, adapter, mode="staged", block_size=size, read_threads=readers)
            walls.append(time.perf_counter() - t0)
        print(
            f"staged, {readers} reader(s), {size >> 20} MiB blocks: best {min(walls) * 1e3:6.1f} ms, "
            f"median {sorted(walls)[2] * 1e3:6.1f} ms",
            flush=True,
        )
    for k in range(3):
        t0 = time.perf_counter()
        sf.save(path, adapter, block_size=block)
        print(f"save #{k}: {(time.perf_counter() - t0) * 1e3:6.1f} ms", flush=True)
    # Idle gaps: the benchmark's RESTORE reaches an engine whose threads and cores sat idle.
    for k in range(3):
        time.sleep(2.0)
        t0 = time.perf_counter()
        r = sf.restore(path, adapter, mode="staged", block_size=block)
        print(
            f"staged after 2 s idle #{k}: {(time.perf_counter() - t0) * 1e3:6.1f} ms (read pass "
            f"{r.read_pass_s * 1e3:5.1f}, apply {r.apply_s * 1e3:5.1f})",
            flush=True,
        )
    # The same file restored by an engine process, as the benchmark does.
    import bench_session as BS

    BS.model_path = lambda name: Path(args.model)
    engine = BS.Engine("model", "--ctx-size", str(n + 64), "--backend", args.backend)
    try:
        for k in range(6):
            if k >= 3:
                time.sleep(2.0)
            got = engine.restore_measured(path)
            print(
                f"engine process RESTORE #{k}{' after 2 s idle' if k >= 3 else ''}: {got['restore_ms']:6.1f} ms "
                f"(read pass {got['read_pass_ms']:5.1f}, apply {got['apply_ms']:5.1f}, {got['mode']}), "
                f"round trip {got['wall_s'] * 1e3:6.1f} ms",
                flush=True,
            )
    except Exception as exc:  # e.g. a refusal: the engine's settings differ from this runner's
        print(f"engine process RESTORE failed: {exc}")
    finally:
        engine.quit()
    for title, run in (
        ("staged restore", lambda: sf.restore(path, adapter, mode="staged", block_size=block)),
        ("streaming restore", lambda: sf.restore(path, adapter, mode="streaming", block_size=block)),
        ("save", lambda: sf.save(path, adapter, block_size=block)),
    ):
        prof = cProfile.Profile()
        prof.enable()
        run()
        prof.disable()
        print(f"---- {title} (profiled) ----")
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
