"""Whole engine steps of this tree against another tree's, in one process, taking turns (the machine's speed swings
more than most changes do between minutes: bench/CPU-NOTES.md): the decode step of 8 and of 1 slots at --held
tokens each, and a 512-token prefill at 0 held, per model (default kernels, 2 threads, --kv-type K/V).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/ab_engine.py --other /tmp/base [--rounds 12]

The other tree's `strata_engine` is copied as `strata_engine_b` (`ab_attention.load_other`). Printed: each tree's
median ms, and the paired ratio (the other tree's time over this one's: > 1 is faster here) with its quartiles.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import strata_engine  # noqa: F401  (first: its OPENBLAS_THREAD_TIMEOUT must precede numpy's BLAS)

# isort: split
import numpy as np
from ab_attention import load_other

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from strata_engine.settings import EngineSettings  # noqa: E402
from strata_engine.slots import SlotSet  # noqa: E402
from support.data import gemma3_model_path, smollm2_model_path  # noqa: E402

SLOTS = 8
PROMPT = 512


def decode_case(slot_set, rows: int, held: int, steps: int = 12):
    """A run of `steps` decode steps of `rows` slots, each cut back to `held` tokens after every step."""

    def run() -> float:
        t = time.perf_counter()
        for _ in range(steps):
            slot_set.decode([(i, 7) for i in range(rows)])
            for i in range(rows):
                slot_set.runners[i].cut_back(held)
        return (time.perf_counter() - t) / steps

    return run


def prefill_case(slot_set, prompt: list[int]):
    def run() -> float:
        runner = slot_set.runners[0]
        runner.cut_back(0)
        t = time.perf_counter()
        runner.prefill(prompt)
        return time.perf_counter() - t

    return run


def paired(runs: dict, rounds: int) -> str:
    for run in runs.values():
        run()  # warm
    times: dict[str, list[float]] = {side: [] for side in runs}
    for i in range(rounds):
        for side in ("here", "other") if i % 2 == 0 else ("other", "here"):
            times[side].append(runs[side]())
    med = {side: sorted(v)[len(v) // 2] * 1e3 for side, v in times.items()}
    ratio = sorted(o / h for h, o in zip(times["here"], times["other"], strict=True))
    n = len(ratio)
    return (f"here {med['here']:8.2f} ms  other {med['other']:8.2f} ms  "
            f"x{ratio[n // 2]:.3f} [{ratio[n // 4]:.3f}-{ratio[3 * n // 4]:.3f}]")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", type=Path, required=True, help="the other checkout's root")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--held", type=int, default=700, help="tokens each slot holds in the decode cases")
    ap.add_argument("--models", default="smollm2,gemma3")
    ap.add_argument("--kv-type", default="f16", help="both trees' K/V type (f16, int8, f32)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        load_other(a.other.resolve(), Path(tmp))
        from strata_engine_b.settings import EngineSettings as OtherSettings
        from strata_engine_b.slots import SlotSet as OtherSlotSet

        rng = np.random.default_rng(0)
        prompts = [[2] + rng.integers(300, 40000, a.held - 1).tolist() for _ in range(SLOTS)]
        chunk = [2] + rng.integers(300, 40000, PROMPT - 1).tolist()
        paths = {"smollm2": smollm2_model_path, "gemma3": gemma3_model_path}
        for model in a.models.split(","):
            path = paths[model]()
            kw = dict(model_path=path, n_ctx=SLOTS * 1024, n_slots=SLOTS, kv_type=a.kv_type)
            sets = {"here": SlotSet.load(EngineSettings(**kw)), "other": OtherSlotSet.load(OtherSettings(**kw))}
            for slot_set in sets.values():
                for runner, prompt in zip(slot_set.runners, prompts, strict=True):
                    runner.prefill(prompt)
            for rows in (SLOTS, 1):
                runs = {side: decode_case(s, rows, a.held) for side, s in sets.items()}
                print(f"{model} decode, {rows} slots at {a.held} held: {paired(runs, a.rounds)}", flush=True)
            runs = {side: prefill_case(s, chunk) for side, s in sets.items()}
            print(f"{model} prefill {PROMPT} at 0 held:  {paired(runs, a.rounds)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
