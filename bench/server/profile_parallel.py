"""Where the CPU goes while N clients decode through strata-server (bench_parallel's load): the CPU time of
every thread of the server's processes (gunicorn arbiter, worker, engine) and of this client process,
read from /proc (schedstat) every --sample-ms, attributed to the tokens that arrived in bench_parallel's aggregate
window (from the last first token to the first last token of a round), per round and summed.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/server/profile_parallel.py --clients 8

It prints, per process and per thread group (the engine's loop thread, its numba workers, its reader; the
worker's request threads, its engine-stdout reader, its event loop; the client threads), the CPU ms per
token in the window and the share of the window's wall time (100 % = one core busy). With --py-spy PATH
it also samples the engine's and the worker's Python stacks with py-spy (nonblocking, idle included) during
the rounds, keeps them under PATH and prints where the engine's loop thread spends its wall time (the forward
pass, sampling and detokenizing, building and writing the lines, waiting) and the worker's threads' samples
by what they run. (py-spy is installed beside this Python, not a dependency: `pip install py-spy`.)
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import requests
from bench_parallel import MACHINE, Sampler, children, one_request, prompt_tokens, request_body, start_server

PY_SPY = str(Path(sys.executable).parent / "py-spy")  # installed beside this Python (not a dependency)


def python_thread_names(pid: int) -> dict[int, str]:
    """Native thread id -> Python thread name of `pid`'s Python threads (py-spy dump; Python 3.11 leaves the
    OS names alone). Threads not listed are native (numba's workers)."""
    out = subprocess.run(
        [PY_SPY, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60
    ).stdout
    return {int(tid, 0): name for tid, name in re.findall(r'^Thread (\S+) \(\w+\): "([^"]*)"', out, re.M)}


def group_of(proc: str, name: str) -> str:
    """A thread's group: its process and what it does (by Python thread name)."""
    if proc == "engine":
        if name == "MainThread":
            return "engine: loop thread (forward + the rest)"
        if name.startswith("strata-reader"):
            return "engine: command reader"
        if name.startswith(("strata-worker", "strata-prepare", "strata-session")):
            return "engine: worker threads"
        return "engine: native threads (numba workers)" if name == "?" else f"engine: {name}"
    if proc == "worker":
        if name.startswith("engine-stdout"):
            return "worker: engine-stdout reader"
        if name == "MainThread":
            return "worker: event loop (main thread)"
        return "worker: request threads" if name != "?" else "worker: native threads"
    if proc == "client":
        return "client: " + ("sampler" if name == "sampler" else "request threads")
    return proc


# The engine loop thread's samples by the innermost frame that matches (function name, file): what it does.
ENGINE_LOOP_PARTS = (
    ("write", "protocol.py", "lines: json.dumps + write + flush"),
    ("token_line", "jobs.py", "lines: build the token line"),
    ("emit", "protocol.py", "lines: tag"),
    ("accept", "completion.py", "sampling + detokenize (Generation.accept)"),
    ("decode_rows", "slots.py", "forward pass (SlotSet.decode_rows)"),
    ("chunk", "jobs.py", "prefill chunk"),
    ("step", "scheduler.py", "step, other"),
    ("select", "loop.py", "waiting for a line"),
)
WORKER_PARTS = (
    ("loads", "json", "json.loads (engine lines)"),
    ("dumps", "json", "json.dumps (SSE frames)"),
    ("sendall", "", "socket writes"),
    ("write", "gunicorn", "gunicorn write"),
    ("_read_lines", "process.py", "reading engine lines"),
    ("wait", "threading.py", "waiting (queue, condition)"),
    ("get", "queue.py", "waiting (queue, condition)"),
    ("select", "", "waiting (select)"),
    ("task_frames", "generation.py", "SSE frames, other"),
)


def frame_parts(stack: str, parts: tuple) -> str:
    frames = stack.split(";")
    for frame in reversed(frames):
        func, _, where = frame.partition(" (")
        for name, file, part in parts:
            if func.rsplit(".", 1)[-1] == name and file in where:
                return part
    return "other"


def spy_table(path: Path, parts: tuple, thread: str | None) -> dict[str, dict[str, int]]:
    """py-spy raw samples of `path`: thread name -> part -> samples (only `thread` where given)."""
    table: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        head, _, rest = stack.partition(";")
        name = head.split(": ", 1)[-1]
        if thread is not None and name != thread:
            continue
        group = name if not name.startswith("ThreadPoolExecutor") else "request threads"
        table[group][frame_parts(rest, parts)] += int(count)
    return table


def print_spy(title: str, table: dict[str, dict[str, int]]) -> None:
    print(f"\n{title} (py-spy samples, idle included: shares of the thread's wall time)")
    for thread, parts in sorted(table.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(parts.values())
        print(f"  {thread} ({total} samples)")
        for part, n in sorted(parts.items(), key=lambda kv: -kv[1]):
            print(f"    {part:50} {100 * n / total:5.1f}%")


def run_round(url: str, clients: int, seed: int, prompt_len: int, n_predict: int) -> list[dict]:
    prompts = [prompt_tokens(url, seed * 100 + i, prompt_len) for i in range(clients)]
    results: list[dict] = [{} for _ in range(clients)]
    barrier = threading.Barrier(clients)
    bodies = [request_body(prompt, n_predict, None) for prompt in prompts]
    threads = [
        threading.Thread(target=one_request, args=(url, bodies[i], barrier, results[i]), name=f"client-{i}")
        for i in range(clients)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def set_thread_names() -> None:
    """Name this process's threads in /proc as Python names them (the sampler tells them apart)."""
    import ctypes

    libc = ctypes.CDLL(None)
    original = threading.Thread.run

    def run(self) -> None:
        libc.prctl(15, self.name[:15].encode(), 0, 0, 0)  # PR_SET_NAME
        original(self)

    threading.Thread.run = run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--n-predict", type=int, default=32)
    parser.add_argument("--sample-ms", type=float, default=20.0)
    parser.add_argument("--server-args", default="")
    parser.add_argument(
        "--py-spy", type=Path, help="sample the engine and the worker with py-spy, into this folder"
    )
    args = parser.parse_args()
    set_thread_names()
    load = os.getloadavg()[0]
    log = Path(tempfile.mkdtemp(prefix="profile-parallel-")) / "server.log"
    proc, url = start_server(args.clients, 1024, args.server_args.split(), log)
    spies: list[subprocess.Popen] = []
    try:
        worker = children(proc.pid)[0]
        engine = children(worker)[0]
        pids = {"arbiter": proc.pid, "worker": worker, "engine": engine, "client": os.getpid()}
        names = {"engine": python_thread_names(engine), "worker": python_thread_names(worker)}
        warm = prompt_tokens(url, 0, args.prompt_tokens)
        requests.post(
            url + "/completion", json={"prompt": warm, "n_predict": 4, "cache_prompt": False}, timeout=600
        ).raise_for_status()
        if args.py_spy:
            args.py_spy.mkdir(parents=True, exist_ok=True)
            for name in ("engine", "worker"):
                spies.append(
                    subprocess.Popen(
                        [
                            PY_SPY,
                            "record",
                            "--pid",
                            str(pids[name]),
                            "--threads",
                            "--nonblocking",
                            "--idle",
                            "--format",
                            "raw",
                            "--rate",
                            "100",
                            "--output",
                            str(args.py_spy / f"{name}.txt"),
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
                pids[f"py-spy {name}"] = spies[-1].pid
            time.sleep(1.0)
        sampler = Sampler(pids, args.sample_ms / 1000)
        sampler.start()
        per_thread: dict = defaultdict(float)
        waiting: dict = defaultdict(float)
        machine = 0.0
        wall = tokens = 0.0
        for r in range(args.rounds):
            results = run_round(url, args.clients, 7000 + r, args.prompt_tokens, args.n_predict)
            time.sleep(2 * args.sample_ms / 1000)
            start = max(res["arrivals"][0] for res in results)
            end = min(res["arrivals"][-1] for res in results)
            t0, t1, deltas = sampler.between(start, end)
            n = sum(1 for res in results for t in res["arrivals"] if t0 < t <= t1)
            wall += t1 - t0
            tokens += n
            machine += deltas.pop(MACHINE)[0]
            for key, (cpu, wait) in deltas.items():
                per_thread[key] += cpu
                waiting[key] += wait
            print(
                f"round {r}: window {t1 - t0:.2f} s, {n} tokens, {n / (t1 - t0):.1f} tok/s "
                f"(load {os.getloadavg()[0]:.2f})",
                flush=True,
            )
        sampler.stop()
    finally:
        for spy in spies:
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
        proc.terminate()
        proc.wait(60)
    groups: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    processes: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for (proc_name, tid, name), cpu in per_thread.items():
        python_name = names[proc_name].get(tid, "?") if proc_name in names else name
        for table, key in ((groups, group_of(proc_name, python_name)), (processes, proc_name)):
            table[key][0] += cpu
            table[key][1] += waiting[(proc_name, tid, name)]
    processes["other processes (the machine's busy time less these)"] = [
        machine - sum(v[0] for v in processes.values()),
        0.0,
    ]
    print(
        f"\n{args.clients} clients, {args.prompt_tokens}-token prompts, {args.n_predict} tokens each, "
        f"{args.rounds} rounds: {tokens:.0f} tokens in {wall:.2f} s of aggregate window = "
        f"{tokens / wall:.1f} tok/s; load {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end"
    )
    header = f"{'':40} {'CPU ms/token':>12} {'% of a core':>11} {'runnable, waiting: ms/token':>28}"
    total = [sum(v[0] for v in processes.values()), sum(v[1] for v in processes.values())]
    for table in (processes | {"the machine (busy, both cores)": total}, groups):
        print(header)
        for name, (cpu, wait) in sorted(table.items(), key=lambda kv: -kv[1][0]):
            print(
                f"{name:40} {1000 * cpu / tokens:12.2f} {100 * cpu / wall:10.0f}% {1000 * wait / tokens:28.2f}"
            )
        print()
    print("threads of the engine and the worker:")
    for (proc_name, tid, name), cpu in sorted(per_thread.items(), key=lambda kv: -kv[1]):
        if proc_name in names and cpu > 0:
            print(
                f"  {proc_name:7} {tid:>8} {names[proc_name].get(tid, '?'):24} {1000 * cpu / tokens:8.2f} ms/token, "
                f"runnable waiting {1000 * waiting[(proc_name, tid, name)] / tokens:.2f}, asleep "
                f"{1000 * (wall - cpu - waiting[(proc_name, tid, name)]) / tokens:.2f}"
            )

    if args.py_spy:
        print_spy(
            "engine loop thread", spy_table(args.py_spy / "engine.txt", ENGINE_LOOP_PARTS, "MainThread")
        )
        print_spy("worker threads", spy_table(args.py_spy / "worker.txt", WORKER_PARTS, None))


if __name__ == "__main__":
    main()
