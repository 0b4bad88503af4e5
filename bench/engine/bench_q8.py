"""The packed products with int8 activations (`--cpu-kernels numba-q8`: `numba_q8.py`, AVX512-VNNI) against
the float32 kernels, on both models' real weights: a decode step's products (every layer's weights and the
output head) per number of token rows (above PACKED_MAX_ROWS the float32 side is dequantize + BLAS, as the
engine runs it), on one thread (the thread's CPU time, best of --reps, the kernels
taking turns in one process, so a shared machine's load falls on all alike), with each kernel's error
relative to |x| @ |W|^T over the sweep (x standard normal; the float32 kernels': ~1e-7). With --decode,
the engine's prefill (--prefill tokens) and greedy decode instead (-t threads): a `--cpu-kernels numba` runner and
a `numba-q8` one (tiled weights) taking turns in one process: tok/s and CPU time, decode at both held depths with
the largest logit difference between the two at the same tokens.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/engine/bench_q8.py [--rows 1 8]
    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/engine/bench_q8.py --decode [-t 2]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from bench_cpu_kernels import best_of_each, packed_weights


def decode_ab(name: str, threads: int | None, depths: list[int], gen: int, rounds: int, prefill: int) -> None:
    """A prefill of `prefill` tokens, then greedy decode at each depth, the float32 and the q8 runner in turns
    (False: `numba`, True: `numba-q8`)."""
    from bench_engine import model_path
    from strata_engine.settings import EngineSettings
    from strata_engine.slots import SlotSet

    runners = {
        q8: SlotSet.load(
            EngineSettings(model_path=model_path(name), kv_type="f16", n_ctx=max(*depths, prefill) + gen + 8,
                           cpu_kernels="numba-q8" if q8 else "numba", threads=threads)
        ).runners[0]
        for q8 in (False, True)
    }  # fmt: skip
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(100, 20000, prefill)]
    rate, cpu = {}, {}
    for _ in range(rounds):
        for q8, runner in runners.items():
            runner.erase()
            t, c = time.perf_counter(), time.process_time()
            runner.prefill(prompt)
            rate[q8] = max(rate.get(q8, 0.0), prefill / (time.perf_counter() - t))
            cpu[q8] = min(cpu.get(q8, float("inf")), time.process_time() - c)
    n_threads = runners[True].settings.threads
    print(
        f"{name} prefill of {prefill} ({n_threads} threads, best of {rounds}): f32 {rate[False]:.1f} tok/s "
        f"({cpu[False]:.2f} s of CPU), q8 {rate[True]:.1f} tok/s ({cpu[True]:.2f} s), x{rate[True] / rate[False]:.2f} "
        f"(CPU x{cpu[False] / cpu[True]:.2f}); load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    for depth in depths:
        held = [int(t) for t in rng.integers(100, 20000, max(depth, 1))]
        first = {}
        for q8, runner in runners.items():
            runner.erase()
            first[q8] = int(np.argmax(runner.prefill(held).logits))
        rate, cpu, logits = {}, {}, {}
        for _ in range(rounds):
            for q8, runner in runners.items():
                runner.cut_back(len(held))
                token, steps = first[False], []
                t, c = time.perf_counter(), time.process_time()
                for _ in range(gen):
                    steps.append(runner.decode(token))
                    token = (
                        int(np.argmax(steps[-1]))
                        if q8 is False
                        else int(np.argmax(logits[False][len(steps) - 1]))
                    )
                rate[q8] = max(rate.get(q8, 0.0), gen / (time.perf_counter() - t))
                cpu[q8] = min(cpu.get(q8, float("inf")), 1e3 * (time.process_time() - c) / gen)
                logits[q8] = np.stack(steps)
        diff = float(np.abs(logits[True] - logits[False]).max())
        agree = int(np.sum(logits[True].argmax(-1) == logits[False].argmax(-1)))
        print(
            f"{name} at {depth} held ({n_threads} threads, best of {rounds}): f32 {rate[False]:.1f} tok/s "
            f"({cpu[False]:.2f} ms of CPU a token), q8 {rate[True]:.1f} tok/s ({cpu[True]:.2f} ms), x{rate[True] / rate[False]:.2f} "
            f"(CPU x{cpu[False] / cpu[True]:.2f}); on f32's tokens max |logit difference| {diff:.2f}, same greedy "
            f"token {agree}/{gen}; load {os.getloadavg()[0]:.2f}",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--decode", action="store_true", help="the engine's decode, q8 on and off in turns")
    ap.add_argument("-t", "--threads", type=int, default=None, help="--decode's threads (default: the cores)")
    ap.add_argument("--depths", nargs="+", type=int, default=[0, 4096], help="--decode's held tokens")
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=512, help="--decode's prompt timed first (0 held)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.decode:
        for name in args.models:
            decode_ab(name, args.threads, args.depths, args.gen, args.rounds, args.prefill)
        return
    from strata_engine.ops import numba_q8
    from strata_engine.ops.numba_ops import PACKED_MAX_ROWS, NumbaOps

    if not numba_q8.HAS_VNNI:
        raise SystemExit("this CPU has no AVX512-VNNI: the q8 kernels do not run here")
    ops = NumbaOps("f32", threads=1)
    layout = NumbaOps("f32", threads=1, q8=True).packed_layout

    def f32_product(x, w):
        """The float32 kernels' product as the engine runs it: packed up to PACKED_MAX_ROWS rows, else BLAS."""
        return ops.packed_matmul(x, w, q8=False) if x.shape[0] <= PACKED_MAX_ROWS else ops.blas_matmul(x, w)

    rng = np.random.default_rng(0)
    for name in args.models:
        ws = packed_weights(name)
        tiled = {
            id(w): layout(w) for w in ws if numba_q8.takes(w)
        }  # the q8 kernels' layout, as loaded (5 bits: Q5_0)
        kinds = sorted({(str(w.values.dtype), w.block, str(w.scale.dtype), w.min is not None) for w in ws})
        print(f"{name}: {len(ws)} weights, {sum(w.nbytes for w in ws) / 1e6:.1f} MB packed, layouts {kinds}")
        dense = {id(w): w.dequantize().astype(np.float64) for w in ws[:4]}
        for m in args.rows:
            xs = [rng.standard_normal((m, w.shape[1])).astype(np.float32) for w in ws]
            errs = {"f32": 0.0, "q8": 0.0}
            for x, w in list(zip(xs, ws, strict=True))[:4]:
                want, bound = x @ dense[id(w)].T, np.abs(x) @ np.abs(dense[id(w)]).T
                for key, q8 in (("f32", False), ("q8", True)):
                    got = ops.packed_matmul(x, tiled[id(w)], q8=True) if q8 else f32_product(x, w)
                    errs[key] = max(errs[key], float(np.max(np.abs(got - want) / bound)))
            fns = {
                "f32": lambda xs=xs, ws=ws: [f32_product(x, w) for x, w in zip(xs, ws, strict=True)],
                "q8": lambda xs=xs, ws=ws, tiled=tiled: [
                    ops.packed_matmul(x, tiled.get(id(w), w), q8=True) for x, w in zip(xs, ws, strict=True)
                ],
            }
            best = best_of_each(fns, args.reps, clock=time.thread_time)
            print(
                f"  M={m:3d}: f32 {best['f32'] * 1e3:7.2f} ms, q8 {best['q8'] * 1e3:7.2f} ms (x{best['f32'] / best['q8']:.2f}); "
                f"error / (|x| @ |W|^T): f32 {errs['f32']:.1e}, q8 {errs['q8']:.1e}; load {os.getloadavg()[0]:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
