"""Bounded load run of strata-server on loopback: a few hundred mixed requests from several concurrent
clients (chat, completion, streaming, tokenize, save, restore), then p50/p99 latency per kind, errors
(anything but a documented 503 counts), and the server's RSS (gunicorn master + worker + engine)
sampled over the run.

It starts its own server on a free 127.0.0.1 port with the default model, stops by itself after
--requests requests or --max-seconds, and stops the server. Run it as `make bench` does:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/server/bench_server.py
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import psutil
import requests

LOOPBACK = "127.0.0.1"
PROMPTS = [
    "Write one sentence about the sea.",
    "List three fruits.",
    "What is the capital of France?",
    "Explain what a cache is, briefly.",
    "Say something kind.",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def chatml(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


class Load:
    def __init__(self, url: str, n_predict: int, slots_enabled: bool) -> None:
        self.url = url
        self.n_predict = n_predict
        self.kinds = {
            "chat": self.chat,
            "completion": self.completion,
            "stream_chat": self.stream_chat,
            "stream_completion": self.stream_completion,
            "tokenize": self.tokenize,
        }
        self.weights = {"chat": 3, "completion": 3, "stream_chat": 2, "stream_completion": 2, "tokenize": 3}
        if slots_enabled:
            self.kinds.update(save=self.save, restore=self.restore)
            self.weights.update(save=1, restore=1)

    def post(self, path: str, body: dict, **kwargs) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=600, **kwargs)

    def chat(self, rng: random.Random) -> requests.Response:
        return self.post(
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
                "max_tokens": self.n_predict,
                "temperature": 0,
            },
        )

    def completion(self, rng: random.Random) -> requests.Response:
        return self.post(
            "/completion",
            {
                "prompt": chatml(rng.choice(PROMPTS)),
                "n_predict": self.n_predict,
                "temperature": 0.7,
                "seed": rng.randrange(1000),
            },
        )

    def _stream(self, path: str, body: dict) -> requests.Response:
        response = self.post(path, {**body, "stream": True}, stream=True)
        if response.status_code == 200:
            content = response.content.decode()
            if '"error"' in content:  # an error after the stream started
                response.status_code = 599
        return response

    def stream_chat(self, rng: random.Random) -> requests.Response:
        return self._stream(
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "max_tokens": self.n_predict},
        )

    def stream_completion(self, rng: random.Random) -> requests.Response:
        return self._stream(
            "/completion", {"prompt": chatml(rng.choice(PROMPTS)), "n_predict": self.n_predict}
        )

    def tokenize(self, rng: random.Random) -> requests.Response:
        return self.post("/tokenize", {"content": rng.choice(PROMPTS) * rng.randint(1, 20)})

    def save(self, rng: random.Random) -> requests.Response:
        return self.post("/slots/0?action=save", {"filename": f"bench-{rng.randrange(3)}.bin"})

    def restore(self, rng: random.Random) -> requests.Response:
        return self.post("/slots/0?action=restore", {"filename": f"bench-{rng.randrange(3)}.bin"})


def process_tree_rss(pid: int) -> int:
    root = psutil.Process(pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=300, help="total requests (default 300)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    parser.add_argument("--n-predict", type=int, default=4, help="tokens per generation (default 4)")
    parser.add_argument(
        "--max-seconds", type=float, default=420, help="stop issuing requests after this long"
    )
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="strata-bench-"))
    slots = workdir / "slots"
    slots.mkdir()
    port = free_port()
    url = f"http://{LOOPBACK}:{port}"
    log = open(workdir / "server.log", "wb")  # noqa: SIM115
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "strata_server.cli",
            "--host",
            LOOPBACK,
            "--port",
            str(port),
            "--slot-save-path",
            str(slots),
            "--metrics",
            "-c",
            "2048",
            "--log-level",
            "warning",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        started = time.monotonic()
        while True:
            if server.poll() is not None:
                print((workdir / "server.log").read_text()[-3000:])
                raise SystemExit(f"server exited with {server.returncode}")
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.1)
        ready_s = time.monotonic() - started
        # Warm up and create the files restore will read.
        requests.post(url + "/completion", json={"prompt": chatml(PROMPTS[0]), "n_predict": 4}, timeout=600)
        probe = requests.post(url + "/slots/0?action=save", json={"filename": "bench-0.bin"}, timeout=600)
        slots_enabled = probe.status_code == 200
        if slots_enabled:
            for name in ("bench-1.bin", "bench-2.bin"):
                requests.post(url + "/slots/0?action=save", json={"filename": name}, timeout=600)
        else:
            print(f"save/restore left out of the mix: {probe.json()['error']['message']}")
        load = Load(url, args.n_predict, slots_enabled)
        rss_samples: list[tuple[float, int]] = []
        stop = threading.Event()

        def sample_rss() -> None:
            while not stop.is_set():
                rss_samples.append((time.monotonic(), process_tree_rss(server.pid)))
                stop.wait(0.5)

        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        latencies: dict[str, list[float]] = defaultdict(list)
        outcomes: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        errors: list[str] = []
        counter = iter(range(args.requests))
        counter_lock = threading.Lock()
        deadline = time.monotonic() + args.max_seconds
        kinds = list(load.weights)
        weights = [load.weights[k] for k in kinds]

        def client(index: int) -> None:
            rng = random.Random(args.seed + index)
            while time.monotonic() < deadline:
                with counter_lock:
                    if next(counter, None) is None:
                        return
                kind = rng.choices(kinds, weights)[0]
                t0 = time.perf_counter()
                try:
                    response = load.kinds[kind](rng)
                    status = response.status_code
                    detail = response.text[:200] if status != 200 else ""
                except requests.RequestException as exc:
                    status, detail = 0, repr(exc)
                elapsed = time.perf_counter() - t0
                latencies[kind].append(elapsed)
                outcomes[kind][status] += 1
                documented_503 = status == 503 and "unavailable_error" in detail
                if status != 200 and not documented_503:
                    errors.append(f"{kind}: {status} {detail}")

        run_start = time.monotonic()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        run_s = time.monotonic() - run_start
        # Unloaded round trips: what the HTTP layer and the engine protocol add, without queueing.
        idle: dict[str, list[float]] = defaultdict(list)
        for _ in range(30):
            for kind, call in (
                ("health (idle)", lambda: requests.get(url + "/health", timeout=30)),
                (
                    "tokenize (idle)",
                    lambda: requests.post(url + "/tokenize", json={"content": "hi"}, timeout=30),
                ),
            ):
                t0 = time.perf_counter()
                if call().status_code != 200:
                    errors.append(f"{kind}: not 200")
                idle[kind].append(time.perf_counter() - t0)
        stop.set()
        sampler.join()
        metrics = requests.get(url + "/metrics", timeout=30).text
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            exit_code = server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            exit_code = server.wait()
        log.close()

    total = sum(len(v) for v in latencies.values())
    cpu = os.cpu_count()
    print(
        f"strata-server bounded load: {total} requests, {args.clients} clients, n_predict {args.n_predict}, "
        f"{run_s:.1f} s ({total / run_s:.2f} req/s); loopback {url}; {cpu} CPUs; server ready in {ready_s:.1f} s"
    )
    print("(one slot: latency includes the wait for slot 0 behind the other clients' requests)")
    print(f"{'kind':<18}{'n':>5}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}  statuses")
    for kind in sorted(latencies):
        values = [v * 1000 for v in latencies[kind]]
        print(
            f"{kind:<18}{len(values):>5}{statistics.median(values):>10.1f}{percentile(values, 0.99):>10.1f}"
            f"{max(values):>10.1f}  {dict(outcomes[kind])}"
        )
    for kind, values in idle.items():
        ms = [v * 1000 for v in values]
        print(
            f"{kind:<18}{len(ms):>5}{statistics.median(ms):>10.2f}{percentile(ms, 0.99):>10.2f}{max(ms):>10.2f}  "
            "(one client, nothing queued)"
        )
    gauges = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in metrics.splitlines()
        if line.startswith(("llamacpp:prompt_tokens_seconds", "llamacpp:predicted_tokens_seconds"))
    }
    print(
        f"engine throughput over the run: prompt {gauges.get('llamacpp:prompt_tokens_seconds', 0):.1f} tok/s, "
        f"generation {gauges.get('llamacpp:predicted_tokens_seconds', 0):.2f} tok/s"
    )
    n_503 = sum(o.get(503, 0) for o in outcomes.values())
    print(f"errors other than documented 503s: {len(errors)}; documented 503s: {n_503}")
    for line in errors[:10]:
        print("  ", line)
    if rss_samples:
        values = [r for _, r in rss_samples]
        quarter = max(1, len(values) // 4)
        first_q, last_q = statistics.mean(values[:quarter]), statistics.mean(values[-quarter:])
        print(
            f"RSS (master+worker+engine): first quarter mean {first_q / 2**20:.1f} MiB, last quarter mean "
            f"{last_q / 2**20:.1f} MiB, ratio {last_q / first_q:.3f}, max {max(values) / 2**20:.1f} MiB, "
            f"{len(values)} samples"
        )
    restarts = [line for line in metrics.splitlines() if line.startswith("strata:engine_restarts_total")]
    print(f"{restarts[0] if restarts else 'no restart metric'}; server exit status {exit_code}")
    print(
        json.dumps(
            {"requests": total, "errors": len(errors), "rss_ratio": last_q / first_q if rss_samples else None}
        )
    )
    return 1 if errors or exit_code != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
