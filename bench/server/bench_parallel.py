"""Concurrent clients on one strata-server started with --parallel N: aggregate decode tok/s and each
request's time to first token and inter-token latency (p50/p99), at 1, 2, 4 and 8 clients, with ratios
against one client and against llama.cpp's batched bench (tests/reference/peer-engine-cpu.json:
SmolLM2, 512-token prompts, 32 tokens each; 254 tok/s aggregate decode at 8 sequences).

Each client streams one /completion of its own 512-token prompt (token ids, distinct per client and
round, cache_prompt false) with n_predict tokens (default 384), greedy, ignore_eos; all clients of a
round start together. The figures of a round:

- "agg decode", basis "window": the batched bench's S_TG in server terms: the tokens that arrived while
  every client of the round was decoding (the window from the last first token to the first last token),
  per second of that window.
- "agg decode", basis "summed": when that window is empty (the first client finished before the last one's
  first token: the server evaluates the prompts one chunk after another, so with few tokens each, as the
  peer's 32, the first clients are done before the last prompt is in), each client's own decode rate
  after its first token ((its tokens - 1) / (its last arrival - its first)), summed over the clients. It
  counts time in which fewer clients decoded at once, so it is below what a window would show: the table
  says which basis each row has, and a level's rounds with a window are kept over those without.
- "x 1 client": the aggregate over the same round's one-client aggregate. A run is --rounds rounds, each
  running every level once (1, 2, 4, 8, then again): the machine's speed swings +-20 % between minutes, so a
  ratio of figures taken minutes apart says more about the minutes than the server. A level's row shows its
  median round's figures and the median of its rounds' ratios; each round's are printed below the table,
  with their quartiles from 4 rounds. At the peer's shape a round's windows last 0.2-0.5 s and one round's
  ratio ranges x1.8-5.2 on the 2-core machine: take 21 rounds for a ratio (~2 minutes at --levels 1,8).
- "end to end": every generated token over the round's wall time (prefills included).
- "TTFT" (time to first token) and "ITL" (inter-token latency, between consecutive tokens of one client):
  p50 and p99 over the round's clients.
- "others": the CPU the machine's other processes took in the window (its busy time in /proc/stat less the
  server's processes' and this one's), in % of one core: on a shared 2-core machine a burst of another job
  in a window of 1-3 s halves its aggregate although the load average looks quiet (bench/server/DECISIONS.md).
  The sampler reads /proc every 0.1 s, about 2 % of a core; "-" without a server of its own (--url).
  Below the table, each level's window split by process (engine, worker, arbiter, client: this process's
  streaming threads): on 2 cores what the server and clients take per token is taken from the engine's.

The default n_predict (384) gives every level a window on the 2-core CPU (the window's contexts are then
512 to 896 tokens deep, deeper than the peer's 544). `--peer-shape` runs exactly the peer's shape
(its prompt and generated tokens, read from the reference: 512 and 32), whose 8-client rounds have no
window here (basis "summed"); with `--prompts-cached` each client's prompt is evaluated into a slot of its
own before the round, so the round's clients decode together from their first tokens, as the peer's bench
decodes its sequences after their prompts (its TG phase): every level has a window, 512 to 544 tokens deep at
the peer's shape (TTFT then times one prompt token, not a prompt). A figure that cannot be measured is printed
as "-" (null in the JSON line), never as NaN.

It starts its own server (default model, -np = the largest level, -c = slots x 1024) on a free
loopback port unless --url is given. Run it on a quiet machine (load average < 1.5), as:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/server/bench_parallel.py
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

LOOPBACK = "127.0.0.1"
REFERENCE = Path(__file__).resolve().parents[2] / "tests" / "reference" / "peer-engine-cpu.json"
WORDS = (
    "river mountain quiet lantern orange music garden winter silver market paper window story "
    "engine forest candle harbor pencil thunder velvet meadow copper island rocket"
).split()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


DEFAULT_N_PREDICT = 384  # gives every level up to 8 clients a window on the 2-core CPU (module docstring)
WINDOW, SUMMED = "window", "summed"  # the basis of a row's aggregate decode figure


def peer_rows() -> list[dict]:
    return json.loads(REFERENCE.read_text())["batched_bench_smollm2"]


PEER_MODEL = (
    "SmolLM2-135M-Instruct.Q4_1.gguf"  # the file llama.cpp's batched bench ran (batched_bench_smollm2)
)


def peer_aggregate(model_path: str | None) -> dict[int, float]:
    """The peer's aggregate decode per sequence count, for the model it ran only (none for another model)."""
    if model_path is None or Path(model_path).name != PEER_MODEL:
        return {}
    return {row["parallel_sequences"]: row["aggregate_decode_tok_per_s"] for row in peer_rows()}


def peer_shape() -> tuple[int, int]:
    """The peer's (prompt tokens, generated tokens) per sequence, the same in every row of its bench."""
    shapes = {(row["prompt_tokens_each"], row["generated_each"]) for row in peer_rows()}
    assert len(shapes) == 1, f"the peer's rows differ in shape: {shapes}"
    return shapes.pop()


def prompt_tokens(url: str, seed: int, n_tokens: int) -> list[int]:
    rng = random.Random(seed)
    text = " ".join(rng.choice(WORDS) for _ in range(n_tokens * 2))
    tokens = requests.post(url + "/tokenize", json={"content": text, "add_special": True}, timeout=60).json()[
        "tokens"
    ]
    assert len(tokens) >= n_tokens, "the text is too short"
    return tokens[:n_tokens]


def request_body(prompt: list[int], n_predict: int, slot: int | None) -> dict:
    """A greedy streamed /completion; with a slot, into that slot reusing what it holds (cache_prompt)."""
    body = {
        "prompt": prompt,
        "n_predict": n_predict,
        "temperature": 0,
        "ignore_eos": True,
        "cache_prompt": False,
        "stream": True,
        "return_tokens": True,
    }
    if slot is not None:
        body |= {"id_slot": slot, "cache_prompt": True}
    return body


def one_request(url: str, body: dict, start: threading.Barrier, out: dict) -> None:
    start.wait()
    sent = time.perf_counter()
    arrivals: list[float] = []
    with requests.post(url + "/completion", json=body, stream=True, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data: "):
                continue
            chunk = json.loads(line[len(b"data: ") :])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("stop"):
                break
            now = time.perf_counter()
            arrivals += [now] * len(chunk.get("tokens") or [])
    out.update(sent=sent, arrivals=arrivals)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def thread_times(pid: int) -> dict[tuple[int, str], tuple[float, float]]:
    """(tid, thread name) -> (seconds on a CPU, seconds runnable but waiting for one) of every thread of
    `pid` (schedstat's nanoseconds; /proc's stat counts 10 ms ticks)."""
    times = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return times
    for tid in tids:
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            on_cpu_ns, waiting_ns = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[:2]
        except OSError:
            continue
        times[(int(tid), name)] = (int(on_cpu_ns) / 1e9, int(waiting_ns) / 1e9)
    return times


MACHINE = ("machine", 0, "busy")


def machine_busy() -> float:
    """Seconds the machine's CPUs were busy (/proc/stat: everything but idle and iowait), all CPUs summed."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


class Sampler:
    """/proc CPU times of the named processes' threads every `period` seconds, with their time stamps."""

    def __init__(self, pids: dict[str, int], period: float):
        self.pids = pids
        self.period = period
        self.samples: list[tuple[float, dict[tuple[str, int, str], tuple[float, float]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def snapshot(self) -> tuple[float, dict]:
        now = time.perf_counter()
        times = {
            (proc, tid, name): t
            for proc, pid in self.pids.items()
            for (tid, name), t in thread_times(pid).items()
        }
        times[MACHINE] = (machine_busy(), 0.0)
        return now, times

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.snapshot())
            self._stop.wait(self.period)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> tuple[float, float, dict]:
        """The first sample at or after `start` and the last at or before `end`: (t0, t1, CPU deltas)."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            raise ValueError(f"fewer than two samples in a window of {end - start:.3f} s")
        return self._delta(inside[0], inside[-1])

    def around(self, start: float, end: float) -> tuple[float, float, dict]:
        """`between` over the last sample at or before `start` and the first at or after `end` (a window
        shorter than the period still has two)."""
        before = [s for s in self.samples if s[0] <= start]
        after = [s for s in self.samples if s[0] >= end]
        if not before or not after:
            raise ValueError("the window is not inside the samples")
        return self._delta(before[-1], after[0])

    @staticmethod
    def _delta(first: tuple[float, dict], last: tuple[float, dict]) -> tuple[float, float, dict]:
        (t0, a), (t1, b) = first, last
        return (
            t0,
            t1,
            {key: tuple(y - x for x, y in zip(a.get(key, (0.0, 0.0)), b[key], strict=True)) for key in b},
        )


def cpu_shares(sampler: Sampler | None, window: tuple[float, float]) -> dict[str, float] | None:
    """CPU in the window, in % of one core: each process of the server and this one (the clients), and
    "others" (the machine's busy time less theirs); None without a sampler or a window long enough."""
    if sampler is None:
        return None
    time.sleep(1.5 * sampler.period)  # a sample after the window's end
    try:
        t0, t1, deltas = sampler.around(*window)
    except ValueError:
        return None
    machine = deltas.pop(MACHINE)[0]
    shares: dict[str, float] = {}
    for (proc, _tid, _name), (cpu, _waiting) in deltas.items():
        role = proc.split()[0]
        shares[role] = shares.get(role, 0.0) + 100 * cpu / (t1 - t0)
    shares["others"] = 100 * machine / (t1 - t0) - sum(shares.values())
    return shares


def server_sampler(server_pid: int, period: float = 0.1) -> Sampler:
    """CPU times of the server's processes (arbiter, its worker, the worker's engine) and this one."""
    pids = {"arbiter": server_pid, "client": os.getpid()}
    for worker in children(server_pid):
        pids[f"worker {worker}"] = worker
        pids |= {f"engine {engine}": engine for engine in children(worker)}
    return Sampler(pids, period)


def run_level(
    url: str,
    clients: int,
    round_seed: int,
    prompt_len: int,
    n_predict: int,
    sampler: Sampler | None = None,
    cached: bool = False,
) -> dict:
    prompts = [prompt_tokens(url, round_seed * 100 + i, prompt_len) for i in range(clients)]
    slots: list[int | None] = list(range(clients)) if cached else [None] * clients
    if cached:  # each prompt evaluated into its own slot first, one after another (--prompts-cached)
        for prompt, slot in zip(prompts, slots, strict=True):
            body = request_body(prompt, 1, slot) | {"stream": False}
            requests.post(url + "/completion", json=body, timeout=600).raise_for_status()
    results: list[dict] = [{} for _ in range(clients)]
    barrier = threading.Barrier(clients)
    threads = [threading.Thread(target=one_request,
                                args=(url, request_body(prompts[i], n_predict, slots[i]), barrier, results[i]))
               for i in range(clients)]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(len(r["arrivals"]) == n_predict for r in results), "a request did not get all its tokens"
    start = min(r["sent"] for r in results)
    end = max(r["arrivals"][-1] for r in results)
    window = (max(r["arrivals"][0] for r in results), min(r["arrivals"][-1] for r in results))
    if window[1] > window[0]:
        in_window = sum(1 for r in results for t in r["arrivals"] if window[0] < t <= window[1])
        basis, aggregate = WINDOW, in_window / (window[1] - window[0])
        shares = cpu_shares(sampler, window)
    else:  # no moment when every client decoded: each one's rate after its first token, summed
        basis, aggregate = SUMMED, sum(decode_rate(r["arrivals"]) or 0.0 for r in results)
        shares = cpu_shares(sampler, (min(r["arrivals"][0] for r in results), end))
    ttft = [(r["arrivals"][0] - r["sent"]) * 1000 for r in results]
    itl = [(b - a) * 1000 for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:], strict=False)]
    return {
        "clients": clients,
        "basis": basis,
        "aggregate_decode": aggregate,
        "end_to_end": clients * n_predict / (end - start),
        "ttft_p50": percentile(ttft, 0.5),
        "ttft_p99": percentile(ttft, 0.99),
        "itl_p50": percentile(itl, 0.5),
        "itl_p99": percentile(itl, 0.99),
        "others_pct": None if shares is None else shares["others"],
        "cpu_pct": shares,
    }


def level_row(rounds: list[dict], firsts: list[dict]) -> dict:
    """A level's figures over the rounds: the median round's (of those with a window, if any has one: a window
    is the truer basis), and "x_first", the median over those rounds of the aggregate over the same round's
    first level's (one client): a ratio paired in time."""
    kept = [i for i, row in enumerate(rounds) if row["basis"] == WINDOW] or list(range(len(rounds)))
    by_aggregate = sorted(kept, key=lambda i: rounds[i]["aggregate_decode"])
    row = dict(rounds[by_aggregate[(len(by_aggregate) - 1) // 2]])  # the lower median: a round's own figures
    paired = [ratio(rounds[i]["aggregate_decode"], firsts[i]["aggregate_decode"]) for i in kept]
    known = [x for x in paired if x is not None]
    row["x_first"] = statistics.median(known) if known else None
    # the spread of the paired ratios: the machine's minutes, which a few rounds do not average out
    row["x_first_quartiles"] = statistics.quantiles(known, n=4)[::2] if len(known) >= 4 else None
    row["x_first_rounds"] = paired
    row["aggregate_rounds"] = [rounds[i]["aggregate_decode"] for i in kept]
    return row


def decode_rate(arrivals: list[float]) -> float | None:
    """One client's tokens after its first, per second from its first to its last; None for one token."""
    span = arrivals[-1] - arrivals[0]
    return (len(arrivals) - 1) / span if len(arrivals) > 1 and span > 0 else None


def shown(value: float | None, width: int, fmt: str = ".1f", unit: str = "") -> str:
    """A table cell: the value, or "-" where it could not be measured (never nan)."""
    return f"{'-' if value is None else format(value, fmt) + unit:>{width}}"


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def start_server(slots: int, ctx_per_slot: int, extra: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "strata_server.cli",
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "-np",
        str(slots),
        "-c",
        str(slots * ctx_per_slot),
        *extra,
    ]
    proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://{LOOPBACK}:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited ({proc.returncode}); see {log}")
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except requests.ConnectionError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the server was not healthy within 300 s; see {log}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="an already running server (started with -np >= the largest level)")
    parser.add_argument("--levels", default="1,2,4,8", help="concurrent clients per round (default: 1,2,4,8)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument(
        "--n-predict",
        type=int,
        default=DEFAULT_N_PREDICT,
        help=f"tokens each client generates (default {DEFAULT_N_PREDICT}: a window at 8 clients)",
    )
    parser.add_argument(
        "--peer-shape",
        action="store_true",
        help="the peer's exact shape (tests/reference/peer-engine-cpu.json: 512-token prompts, "
        "32 tokens each), in place of --prompt-tokens and --n-predict",
    )
    parser.add_argument(
        "--prompts-cached",
        action="store_true",
        help="evaluate each client's prompt into its own slot before the round (id_slot, "
        "cache_prompt), so the clients decode together from their first token on: the peer's "
        "batched bench's decode phase (with --peer-shape: 512 to 544 tokens deep)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds, each running every level once; a level's row is its median round's "
        "figures, its 'x 1 client' the median of the rounds' own ratios (default 3)",
    )
    parser.add_argument("--server-args", default="", help="extra strata-server flags (e.g. '--backend cupy')")
    args = parser.parse_args(argv)
    if args.peer_shape:
        args.prompt_tokens, args.n_predict = peer_shape()
    levels = [int(x) for x in args.levels.split(",")]
    load = os.getloadavg()[0]
    print(f"load average {load:.2f} at the start{' (above 1.5: figures unreliable)' if load >= 1.5 else ''}")
    proc = sampler = None
    if args.url:
        url = args.url
    else:
        log = Path(tempfile.mkdtemp(prefix="bench-parallel-")) / "server.log"
        proc, url = start_server(max(levels), 1024, args.server_args.split(), log)
        print(f"server: -np {max(levels)} -c {max(levels) * 1024} {args.server_args} (log {log})")
    try:
        props = requests.get(url + "/props", timeout=30).json()
        n_slots, model_path = props["total_slots"], props.get("model_path")
        assert n_slots >= max(levels), f"the server has {n_slots} slots, fewer than {max(levels)} clients"
        warm = prompt_tokens(url, 0, args.prompt_tokens)  # the first forward passes do one-time work
        requests.post(
            url + "/completion", json={"prompt": warm, "n_predict": 4, "cache_prompt": False}, timeout=600
        ).raise_for_status()
        # with a server of its own, the other processes' share of each window (their load lands on the decode)
        sampler = server_sampler(proc.pid) if proc is not None else None
        if sampler is not None:
            sampler.start()
        # round after round, every level once a round: a level's figure and the one-client figure it is divided
        # by come from the same minute or two (the machine's speed swings more between minutes than a round lasts)
        rounds = [{clients: run_level(url, clients, 1000 * clients + r, args.prompt_tokens, args.n_predict, sampler,
                                      args.prompts_cached)
                   for clients in levels} for r in range(args.rounds)]  # fmt: skip
        rows = [
            level_row([rnd[clients] for rnd in rounds], [rnd[levels[0]] for rnd in rounds])
            for clients in levels
        ]
    finally:
        if sampler is not None:
            sampler.stop()
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    peer = peer_aggregate(model_path)
    same_shape = (args.prompt_tokens, args.n_predict) == peer_shape()
    print(
        f"\n{args.prompt_tokens}-token prompts, {args.n_predict} tokens each; load average {os.getloadavg()[0]:.2f} "
        "at the end"
    )
    print(
        f"{'clients':>7} {'agg decode':>10} {'basis':>6} {'x 1 client':>10} {'peer':>6} {'x peer':>7} "
        f"{'end to end':>10} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'others':>7}"
    )
    for row in rows:
        p = peer.get(row["clients"])
        print(
            f"{row['clients']:>7} {row['aggregate_decode']:>10.1f} {row['basis']:>6} "
            f"{shown(row['x_first'], 10, '.2f')} {shown(p, 6)} "
            f"{shown(ratio(row['aggregate_decode'], p), 7, '.2f')} {row['end_to_end']:>10.1f} "
            f"{shown(row['ttft_p50'], 9, '.0f', 'ms')} {shown(row['ttft_p99'], 9, '.0f', 'ms')} "
            f"{shown(row['itl_p50'], 8, '.1f', 'ms')} {shown(row['itl_p99'], 8, '.1f', 'ms')} "
            f"{shown(row['others_pct'], 7, '.0f', '%')}"
        )
    if args.rounds > 1:
        for row in rows:
            each = " ".join(shown(x, 0, ".2f") for x in row["x_first_rounds"])
            spread = row["x_first_quartiles"]
            spread = (
                f" (quartiles {spread[0]:.2f}-{spread[1]:.2f})"
                if spread and row["clients"] != levels[0]
                else ""
            )
            print(
                f"{row['clients']} clients: x {levels[0]} client{'s' * (levels[0] > 1)} round by round {each}{spread}; "
                f"aggregate {' '.join(f'{a:.1f}' for a in row['aggregate_rounds'])}"
            )
    for row in rows:
        if row["cpu_pct"]:
            parts = ", ".join(f"{role} {pct:.0f}%" for role, pct in sorted(row["cpu_pct"].items()))
            print(f"{row['clients']} clients, CPU in the window (% of one core): {parts}")
    for row in rows:
        if row["basis"] == SUMMED:
            print(
                f"{row['clients']} clients: no window in which every client decoded (the first finished before the "
                "last one's first token); 'agg decode' is each client's decode rate after its first token, summed"
            )
    if not peer:
        print(f"peer: none for {model_path} (llama.cpp's batched bench in the references ran {PEER_MODEL})")
    elif not same_shape:
        print(
            f"peer: llama.cpp's batched bench at its own shape ({' / '.join(map(str, peer_shape()))} tokens), "
            "not this run's; --peer-shape runs that shape"
        )
    print(
        json.dumps(
            {
                "rows": [
                    {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()} for row in rows
                ],
                "prompt_tokens": args.prompt_tokens,
                "n_predict": args.n_predict,
                "load_start": load,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
