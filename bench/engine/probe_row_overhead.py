"""What the serve loop's decode step costs a row outside the forward pass: the real scheduler, completers and
line writer (to a file) over SmolLM2's slots, with `SlotSet.decode_rows` replaced by one that hands back greedy
`Argmax` rows at once, so a step is only the loop's own work (sampling's bookkeeping, detokenizing, stop
checks, the token lines). On the GPU a batched step of 8 rows takes ~1.1-1.3 ms; this is the share of it the
engine's Python adds per row (bench/engine/DECISIONS.md "Scheduler"). With --real the forward pass is kept: the engine
process's own step at B rows (loop included) without the HTTP server in front, to set against
bench_parallel's figures through the server.

    python3 bench/engine/probe_row_overhead.py [--slots 8] [--tokens 400] [--real [--backend cupy] [--prompt 512]]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from strata_engine.chat import ChatTemplate  # noqa: E402
from strata_engine.gguf.reader import read_gguf  # noqa: E402
from strata_engine.protocol import LineReader, LineWriter  # noqa: E402
from strata_engine.sampling import Argmax  # noqa: E402
from strata_engine.serve import build_registry, serve_context, serve_loop  # noqa: E402
from strata_engine.settings import EngineSettings  # noqa: E402
from strata_engine.slots import LaunchedStep, SlotSet  # noqa: E402
from strata_engine.tokenizer import Tokenizer  # noqa: E402
from support.data import smollm2_model_path  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--real", action="store_true", help="keep the real forward pass (decode_rows)")
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--model", type=Path, default=None, help="a GGUF file (default: SmolLM2's package)")
    ap.add_argument("--prompt", type=int, default=8, help="prompt tokens a slot (the depth decoded at)")
    args = ap.parse_args()
    n = args.slots
    path = args.model or smollm2_model_path()
    meta = read_gguf(path).metadata
    tok = Tokenizer.from_gguf_metadata(meta)
    n_ctx = 1024 if args.prompt + args.tokens <= 1024 else 2 * (args.prompt + args.tokens)
    slots = SlotSet.load(
        EngineSettings(
            model_path=path,
            n_ctx=n_ctx * n,
            n_slots=n,
            backend=args.backend,
            prefill_chunk=256,
            kv_type="f16",
        )
    )
    rng = np.random.default_rng(0)
    if not args.real:
        slots.decode_rows = lambda steps, argmax_only: [
            Argmax(int(rng.integers(300, 40000)), 1.0) for _ in steps
        ]
        slots.launch = lambda steps: LaunchedStep(slots, list(steps))  # deferred: collected by the above
    ctx = serve_context(slots, tok, ChatTemplate.for_model(meta, tok))
    read_end, write_end = os.pipe()
    with tempfile.TemporaryFile() as out:
        loop = serve_loop(ctx, build_registry(), LineReader(read_end), LineWriter(out))
        times: list[tuple[int, float, float]] = []
        decode = loop.scheduler._decode  # the policy's decode step: forward pass, sampling, token lines

        def timed(jobs, *more):
            t0 = time.perf_counter()
            decode(jobs, *more)
            times.append((len(jobs), t0, time.perf_counter() - t0))

        loop.scheduler._decode = timed  # type: ignore[method-assign]

        def feed() -> None:  # the loop keeps the main thread, as in `strata-engine serve`
            for i in range(n):
                request = {"id": f"r{i}", "slot": i, "prompt": rng.integers(300, 40000, args.prompt).tolist(),
                           "n_predict": args.tokens, "temperature": 0, "ignore_eos": True}  # fmt: skip
                os.write(write_end, b"COMPLETE " + json.dumps(request).encode() + b"\n")
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and (
                ctx.flight.forward_passes == 0 or loop.busy
            ):  # every request ends
                time.sleep(0.05)
            os.write(write_end, b"QUIT\n")

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        loop.run()
        feeder.join(timeout=30)
    full = np.array([t for rows, _, t in times if rows == n])
    # start to start of consecutive full steps: the loop's whole cycle (reading lines, chunks, writing)
    cycle = np.array([b[1] - a[1] for a, b in zip(times, times[1:], strict=False) if a[0] == b[0] == n])
    print(f"{len(times)} steps, {len(full)} of all {n} rows: median {np.median(full) * 1e6:.0f} us a step, "
          f"{np.median(full) / n * 1e6:.1f} us a row (p90 {np.percentile(full, 90) * 1e6:.0f} us a step); "
          f"start to start {np.median(cycle) * 1e6:.0f} us ({n / np.median(cycle):.1f} tok/s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
