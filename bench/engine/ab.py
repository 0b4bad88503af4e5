"""This tree's CPU engine against another tree's, in one process, taking turns: the machine's speed swings +-20 %
between minutes (bench/engine/DECISIONS.md), more than most kernel changes, and one process with both trees sees
the same minutes.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/engine/ab.py attention --other ../main [--rounds 21]
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/engine/ab.py engine --other /tmp/base [--rounds 12]

The other tree's `strata_engine` package is copied to a temporary folder as `strata_engine_b` (the package imports
itself relatively only).

`attention`: the attention kernels alone (numba-q8 ops, --threads, f16 K/V): a batched decode step's attention
(8 slots at ~700 held, SmolLM2's heads), one-row decode at 4,096 held (SmolLM2's and gemma3's heads), each over
30 / 18 layers' own K/V so it comes from memory as in the engine; a 512-token chunk's attention with gemma3's
heads (windowed at 0 and 4,096 held, global at 4,096). Also printed: the largest difference of the outputs.

`engine`: whole engine steps: the decode step of 8 and of 1 slots at --held tokens each, and a 512-token prefill
at 0 held, per model (default kernels, 2 threads, --kv-type K/V).

Printed per case: each tree's median ms, and the paired ratio (the other tree's time over this one's: > 1 is
faster here) with its quartiles.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import strata_engine.process_env  # noqa: F401  (first: the engine's environment precedes numpy's OpenBLAS)

# isort: split
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from strata_engine.settings import EngineSettings  # noqa: E402
from strata_engine.slots import SlotSet  # noqa: E402
from support.data import gemma3_model_path, smollm2_model_path  # noqa: E402

SLOTS = 8
PROMPT = 512
SIDES = ("here", "other")


def load_other(tree: Path, folder: Path) -> None:
    """Makes the other tree's engine package importable as strata_engine_b."""
    src = tree / "packages" / "strata-engine" / "src" / "strata_engine"
    shutil.copytree(src, folder / "strata_engine_b", ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, str(folder))


def paired(runs: dict[str, Callable[[], float]], rounds: int) -> str:
    """Each side's run (returning its seconds) in turns, the order swapped every round; after one warm run each."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    for i in range(rounds):
        for side in SIDES if i % 2 == 0 else SIDES[::-1]:
            times[side].append(runs[side]())
    med = {side: sorted(v)[len(v) // 2] * 1e3 for side, v in times.items()}
    ratio = sorted(o / h for h, o in zip(times["here"], times["other"], strict=True))
    n = len(ratio)
    return (f"here {med['here']:8.2f} ms  other {med['other']:8.2f} ms  "
            f"x{ratio[n // 2]:.3f} [{ratio[n // 4]:.3f}-{ratio[3 * n // 4]:.3f}]")  # fmt: skip


def timed(f: Callable[[], object]) -> Callable[[], float]:
    def run() -> float:
        t = time.perf_counter()
        f()
        return time.perf_counter() - t

    return run


def attention_cases(rng: np.random.Generator):
    """(name, make(ops) -> a function running the case once and returning its output)."""
    out = []
    # a batched step: 8 rows, SmolLM2's heads (3 K/V, 9 query, 64 wide), 30 layers' K/V (from memory)
    n_kv, n_head, d, rows, held, layers = 3, 9, 64, 8, 700, 30
    ks = [rng.standard_normal((rows, held + 64, n_kv, d)).astype(np.float16) for _ in range(layers)]
    vs = [rng.standard_normal((rows, held + 64, n_kv, d)).astype(np.float16) for _ in range(layers)]
    q = rng.standard_normal((rows, n_head, d)).astype(np.float32)
    kw = dict(slots=list(range(rows)), q_pos=[held - 1 - 7 * b for b in range(rows)], k_lo=[0] * rows, capacity=0,
              window=0, scale=0.125)  # fmt: skip

    def batched(ops, ks=ks, vs=vs, q=q, kw=kw):
        return lambda: [ops.attention_rows(q, k, v, None, None, **kw) for k, v in zip(ks, vs, strict=True)][
            -1
        ]

    out.append(("batched step, 8 x ~700 held, 30 layers", batched))
    for name, (n_kv, n_head, d, layers) in (("SmolLM2", (3, 9, 64, 30)), ("gemma3", (1, 4, 256, 18))):
        held = 4096
        ks1 = [rng.standard_normal((held, n_kv, d)).astype(np.float16) for _ in range(layers)]
        vs1 = [rng.standard_normal((held, n_kv, d)).astype(np.float16) for _ in range(layers)]
        q1 = rng.standard_normal((1, n_head, d)).astype(np.float32)

        def one(ops, ks=ks1, vs=vs1, q=q1, held=held):
            return lambda: [
                ops.attention(q, k, v, q_pos0=held - 1, k_pos0=0, window=None, scale=0.125)
                for k, v in zip(ks, vs, strict=True)
            ][-1]

        out.append((f"{name} decode, 4,096 held, {layers} layers", one))
    for held, window in ((0, 512), (4096, 512), (4096, None)):
        k = (rng.standard_normal((held + 512, 1, 256)) * 2).astype(np.float16)
        v = rng.standard_normal((held + 512, 1, 256)).astype(np.float16)
        qc = rng.standard_normal((512, 4, 256)).astype(np.float32)
        lo = 0 if window is None else max(0, held - window + 1)

        def chunk(ops, k=k[lo:], v=v[lo:], q=qc, held=held, lo=lo, window=window):
            return lambda: ops.attention(q, k, v, q_pos0=held, k_pos0=lo, window=window, scale=0.0625)

        out.append((f"gemma3 512-token chunk, {held} held, {'window 512' if window else 'global'}", chunk))
    return out


def ab_attention(a: argparse.Namespace) -> None:
    from strata_engine.ops import get_ops
    from strata_engine_b.ops import get_ops as other_get_ops

    ops = {"here": get_ops("numpy", "f32", "numba-q8", a.threads),
           "other": other_get_ops("numpy", "f32", "numba-q8", a.threads)}  # fmt: skip
    for name, make in attention_cases(np.random.default_rng(0)):
        if a.only not in name:
            continue
        cases = {side: make(o) for side, o in ops.items()}
        outs = {side: f() for side, f in cases.items()}  # compiles or loads each tree's kernels
        diff = float(np.max(np.abs(outs["here"] - outs["other"])))
        runs = {side: timed(f) for side, f in cases.items()}
        print(f"{name:48s} {paired(runs, a.rounds)}  max|diff| {diff:.1e}", flush=True)


def decode_case(slot_set, rows: int, held: int, steps: int = 12) -> Callable[[], float]:
    """A run of `steps` decode steps of `rows` slots, each cut back to `held` tokens after every step."""

    def run() -> float:
        t = time.perf_counter()
        for _ in range(steps):
            slot_set.decode([(i, 7) for i in range(rows)])
            for i in range(rows):
                slot_set.runners[i].cut_back(held)
        return (time.perf_counter() - t) / steps

    return run


def prefill_case(slot_set, prompt: list[int]) -> Callable[[], float]:
    def run() -> float:
        runner = slot_set.runners[0]
        runner.cut_back(0)
        t = time.perf_counter()
        runner.prefill(prompt)
        return time.perf_counter() - t

    return run


def ab_engine(a: argparse.Namespace) -> None:
    from strata_engine_b.settings import EngineSettings as OtherSettings
    from strata_engine_b.slots import SlotSet as OtherSlotSet

    rng = np.random.default_rng(0)
    prompts = [[2] + rng.integers(300, 40000, a.held - 1).tolist() for _ in range(SLOTS)]
    chunk = [2] + rng.integers(300, 40000, PROMPT - 1).tolist()
    paths = {"smollm2": smollm2_model_path, "gemma3": gemma3_model_path}
    for model in a.models.split(","):
        kw = dict(model_path=paths[model](), n_ctx=SLOTS * 1024, n_slots=SLOTS, kv_type=a.kv_type)
        sets = {"here": SlotSet.load(EngineSettings(**kw)), "other": OtherSlotSet.load(OtherSettings(**kw))}
        for slot_set in sets.values():
            for runner, prompt in zip(slot_set.runners, prompts, strict=True):
                runner.prefill(prompt)
        for rows in (SLOTS, 1):
            runs = {side: decode_case(s, rows, a.held) for side, s in sets.items()}
            print(f"{model} decode, {rows} slots at {a.held} held: {paired(runs, a.rounds)}", flush=True)
        runs = {side: prefill_case(s, chunk) for side, s in sets.items()}
        print(f"{model} prefill {PROMPT} at 0 held:  {paired(runs, a.rounds)}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    att = sub.add_parser("attention", help="the attention kernels alone")
    att.add_argument("--rounds", type=int, default=21)
    att.add_argument("--threads", type=int, default=2)
    att.add_argument("--only", default="", help="the cases whose name holds this text")
    att.set_defaults(run=ab_attention)
    eng = sub.add_parser("engine", help="whole decode steps and a prefill")
    eng.add_argument("--rounds", type=int, default=12)
    eng.add_argument("--held", type=int, default=700, help="tokens each slot holds in the decode cases")
    eng.add_argument("--models", default="smollm2,gemma3")
    eng.add_argument("--kv-type", default="f16", help="both trees' K/V type (f16, int8, f32)")
    eng.set_defaults(run=ab_engine)
    for p in (att, eng):
        p.add_argument("--other", type=Path, required=True, help="the other checkout's root")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        load_other(a.other.resolve(), Path(tmp))
        print(f"this tree {ROOT} against {a.other.resolve()}; load {os.getloadavg()[0]:.2f}", flush=True)
        a.run(a)
        print(f"load {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
