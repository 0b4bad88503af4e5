"""A fleet: three strata-servers (each its own --cache-disk, one bucket of a real SeaweedFS reached through a
TCP relay) behind a real HAProxy (round robin, health checks on /health; support/fleet.py). One fleet for the
module, short greedy replies. A conversation hops across all three servers and every turn after the first
restores >= 99% of its history; a server SIGKILLed mid-stream gives its client an error, never a corrupted
reply, and the next turn continues on another server from the last completed turn; SeaweedFS stopped and
started: the servers keep answering (cold), then catch up; a slow store (the relay's latency) slows no
completion; a full disk under --cache-disk (a small tmpfs, where this runs as root) fails saves cleanly,
counted, and leaves nothing half-written."""

from __future__ import annotations

import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import attrs
import pytest
import requests
import strata_sessionfile as sf
from strata_server.store.folder import BAD_FOLDER
from strata_server.store.names import NAME
from strata_server.store.remote import LISTING_TTL_S
from support.fleet import HAProxy, haproxy_binary, served_by
from support.s3 import StoreProxy
from support.server_process import ServerProcess, metrics

from .servers import start_server
from .store_s3 import FACTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

N_SERVERS = 3
REPLY_TOKENS = 12
FULL_DISK_MIB = 128  # the tmpfs under the last server's --cache-disk (a conversation here: ~10-15 MiB)
DISK_MAX_MIB = 64  # --cache-disk-max: room left on that tmpfs for a save and a download beyond it
UPLOADED = 'strata:store_uploads_total{result="uploaded"}'
UPLOAD_FAILED = 'strata:store_uploads_total{result="failed"}'
SAVE_FAILURES = "strata:store_save_failures_total"
WRITE_BEHIND_FAILED = 'strata:store_write_behind_total{result="failed"}'
WRITE_BEHIND_SAVED = 'strata:store_write_behind_total{result="saved"}'
SLOW_STORE_S = 60.0  # the relay holds each write request (an upload's) this long at most, or until let go


def mount_tmpfs(path: Path, mib: int) -> bool:
    """A tmpfs of `mib` MiB at `path` (root only); whether it was mounted."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0700", "tmpfs", str(path)])
    return done.returncode == 0


@attrs.define
class Fleet:
    servers: dict[str, ServerProcess]
    flags: dict[str, tuple[str, ...]]  # each server's flags (a restart uses them again)
    haproxy: HAProxy
    relay: StoreProxy
    seaweed: object
    folder: Path
    full_disk: Path | None  # the last server's --cache-disk when it is a tmpfs
    reference: ServerProcess  # no store, never stopped: holds a chat between its turns (the replies to match)

    @property
    def url(self) -> str:
        return self.haproxy.url

    def restart(self, name: str) -> None:
        """The server `name` started again on its port (HAProxy sees it up again)."""
        old = self.servers[name]
        self.servers[name] = start_server(
            self.folder,
            *self.flags[name],
            name=name,
            env=self.seaweed.env(),
            port=old.port,
            own_group=True,
        )
        self.haproxy.wait_up(set(self.servers))


@pytest.fixture(scope="module")
def fleet(module_tmp, s3_store):
    if haproxy_binary() is None:
        pytest.skip("haproxy is not installed (apt-get install -y haproxy; .ci/run does)")
    relay = StoreProxy(s3_store.endpoint_url)
    names = [f"fleet-{i}" for i in range(N_SERVERS)]
    full_disk = module_tmp / "fleet-full-disk"
    mounted = mount_tmpfs(full_disk, FULL_DISK_MIB)
    disks = [module_tmp / n for n in names[:-1]] + [full_disk]
    flags = {
        name: (
            "--cache-disk",
            str(disk),
            "--cache-store",
            f"s3://{s3_store.bucket}/fleet",
            "--cache-store-endpoint",
            relay.endpoint_url,
            # A turn adds tens of tokens: restore the fleet's newer turn rather than evaluate them again.
            "--cache-min-reuse",
            "16",
            "--cache-idle-seconds",
            "0",  # only the write-behind shares a turn
            "--cache-disk-max",
            str(DISK_MAX_MIB),
            "--metrics",
        )
        for name, disk in zip(names, disks, strict=True)
    }
    servers: dict[str, ServerProcess] = {}
    reference = None
    haproxy = None
    try:
        # The first alone (a fresh clone compiles the engine's kernels once), then the others together.
        for group in (names[:1], names[1:]):
            for name in group:
                servers[name] = start_server(
                    module_tmp, *flags[name], name=name, env=s3_store.env(), own_group=True, wait=False
                )
            if len(group) > 1:
                reference = start_server(module_tmp, name="fleet-reference", wait=False)
            for name in group:
                servers[name].wait_healthy(600)
        assert reference is not None
        reference.wait_healthy(600)
        haproxy = HAProxy(module_tmp, {n: s.port for n, s in servers.items()}).start()
        yield Fleet(
            servers, flags, haproxy, relay, s3_store, module_tmp, full_disk if mounted else None, reference
        )
    finally:
        if haproxy is not None:
            haproxy.stop()
        running = [
            s
            for s in [*servers.values(), *([reference] if reference is not None else [])]
            if s.proc is not None and s.proc.poll() is None
        ]
        with ThreadPoolExecutor(len(running) or 1) as pool:  # their shutdown saves at once
            list(pool.map(ServerProcess.stop, running))
        relay.close()
        if mounted:
            subprocess.run(["umount", "-l", str(full_disk)], check=False)


# --- a conversation's turns ------------------------------------------------------------------------


@attrs.frozen
class Turn:
    server: str  # the fleet's server that answered
    reply: str
    prompt_tokens: int
    completion_tokens: int
    cache_n: int
    seconds: float

    @property
    def history(self) -> int:
        """The tokens this turn leaves in the conversation (what the next turn's prompt begins with)."""
        return self.prompt_tokens + self.completion_tokens


def ask(url: str, messages: list[dict], **extra) -> requests.Response:
    return requests.post(
        url + "/v1/chat/completions",
        json={"messages": messages, "max_tokens": REPLY_TOKENS, "temperature": 0, **extra},
        timeout=300,
    )


@attrs.define
class Conversation:
    """A chat whose history grows by each completed turn's reply."""

    topic: str
    messages: list[dict] = attrs.field(init=False)
    turns: list[Turn] = attrs.Factory(list)

    def __attrs_post_init__(self) -> None:
        self.messages = [
            {"role": "system", "content": f"You are a careful assistant ({self.topic}). {FACTS}"}
        ]

    def turn(self, url: str, question: str) -> Turn:
        t0 = time.perf_counter()
        response = ask(url, [*self.messages, {"role": "user", "content": question}])
        seconds = time.perf_counter() - t0
        assert response.status_code == 200, response.text
        body = response.json()
        reply = body["choices"][0]["message"]["content"]
        self.messages += [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
        turn = Turn(
            response.headers.get("X-Strata-Server", url),
            reply,
            body["usage"]["prompt_tokens"],
            body["usage"]["completion_tokens"],
            body["timings"]["cache_n"],
            seconds,
        )
        self.turns.append(turn)
        return turn


def replayed(conversation: Conversation, url: str) -> list[str]:
    """The conversation's questions asked again, turn by turn, of the server at `url`: its replies."""
    again = Conversation(conversation.topic)
    for question in conversation.messages[1::2]:
        again.turn(url, question["content"])
    return [t.reply for t in again.turns]


def wait_metric(server: ServerProcess, name: str, above: float, timeout: float = 30.0) -> float:
    """Until the server's metric `name` exceeds `above`; its value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := metrics(server.url).get(name, 0.0)) > above:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{name} of {server.url} still <= {above} after {timeout} s:\n{server.log()}")


def settled(server: ServerProcess, timeout: float = 60.0) -> None:
    """Until every save the server committed has its upload's outcome (uploaded, superseded, failed, ...)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = metrics(server.url)
        offered = sum(v for k, v in m.items() if k.startswith("strata:store_saves_total{"))
        if sum(v for k, v in m.items() if k.startswith("strata:store_uploads_total{")) >= offered:
            return
        time.sleep(0.05)
    raise AssertionError(f"uploads of {server.url} not settled after {timeout} s:\n{server.log()}")


def shared_turn(fleet: Fleet, conversation: Conversation, question: str) -> Turn:
    """A turn through HAProxy, returned once its server's write-behind upload landed in the bucket and the
    client thought for a moment: no sooner than half a listing's lifetime after the turn began, so the
    listing a server made at its last turn (N_SERVERS turns ago, round robin) has expired."""
    t0 = time.monotonic()
    before = {n: metrics(s.url).get(UPLOADED, 0.0) for n, s in fleet.servers.items()}
    turn = conversation.turn(fleet.url, question)
    wait_metric(fleet.servers[turn.server], UPLOADED, before[turn.server])
    time.sleep(max(0.0, t0 + LISTING_TTL_S / 2 - time.monotonic()))
    return turn


# --- the tests -------------------------------------------------------------------------------------


def test_a_conversation_hops_across_the_fleet(fleet):
    conversation = Conversation("hops")
    for item in (3, 11, 19, 27, 5):
        shared_turn(fleet, conversation, f"Where is item {item}?")
    turns = conversation.turns
    assert {t.server for t in turns} == set(fleet.servers)
    assert all(a.server != b.server for a, b in zip(turns, turns[1:], strict=False))  # round robin
    for before, after in zip(turns, turns[1:], strict=False):
        # Every turn after the first restores (nearly) all the history from the turn before, on another server.
        assert after.cache_n >= 0.99 * before.history, (before, after)
    # Restored turn after turn, the conversation reads exactly as on a server that held it throughout.
    assert replayed(conversation, fleet.reference.url) == [t.reply for t in turns]


def test_a_server_killed_mid_stream(fleet):
    conversation = Conversation("killed")
    first = shared_turn(fleet, conversation, "Where is item 7?")
    question = "List every item with its box and shelf, one per line."
    response = requests.post(
        fleet.url + "/v1/chat/completions",
        json={
            "messages": [*conversation.messages, {"role": "user", "content": question}],
            "max_tokens": 400,
            "temperature": 0,
            "stream": True,
        },
        stream=True,
        timeout=300,
    )
    assert response.status_code == 200
    victim = served_by(response)
    assert victim != first.server
    events, done, error = [], False, None
    try:
        for line in response.iter_lines():
            if not line:
                continue
            assert line.startswith(b"data: "), line  # every frame the client sees is whole
            payload = line[len(b"data: ") :]
            if payload == b"[DONE]":
                done = True
                break
            events.append(json.loads(payload))
            if len(events) == 2:  # the reply is streaming: the server dies now
                assert fleet.servers[victim].kill() == -9
    except requests.RequestException as exc:  # the connection cut short by HAProxy
        error = exc
    assert error is not None or done, "the stream ended neither in an error nor complete"
    if done:  # complete: then it is the whole greedy reply, finished
        assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert fleet.servers[victim].proc.poll() is not None
    # The client asks again: another server continues from the last completed turn (the killed one's turn
    # never completed, so nothing of it is kept).
    again = conversation.turn(fleet.url, question)
    assert again.server not in (victim,)
    assert again.cache_n >= 0.99 * first.history
    assert replayed(conversation, fleet.reference.url) == [first.reply, again.reply]
    fleet.restart(victim)


def test_the_store_stopped_and_started(fleet):
    conversation = Conversation("store restart")
    first = shared_turn(fleet, conversation, "Where is item 2?")
    failures = {
        n: metrics(s.url).get("strata:store_remote_failures_total", 0.0) for n, s in fleet.servers.items()
    }
    uploads_failed = {n: metrics(s.url).get(UPLOAD_FAILED, 0.0) for n, s in fleet.servers.items()}
    fleet.seaweed.stop()
    try:
        # Down: each turn on a server that never held the chat evaluates it cold, and answers.
        down = [conversation.turn(fleet.url, f"And item {item}?") for item in (4, 6)]
        for turn in down:
            assert turn.server != first.server
            assert turn.cache_n < first.history  # nothing restored: the store is gone
            assert (
                metrics(fleet.servers[turn.server].url)["strata:store_remote_failures_total"]
                > failures[turn.server]
            )
            wait_metric(fleet.servers[turn.server], UPLOAD_FAILED, uploads_failed[turn.server])
        for server in fleet.servers.values():
            assert requests.get(server.url + "/health", timeout=10).status_code == 200
    finally:
        fleet.seaweed.start()
    # Back: the next turns' uploads land again and the fleet restores the whole history once more.
    back = [shared_turn(fleet, conversation, f"And item {item}?") for item in (8, 10, 12)]
    assert back[0].cache_n >= 0.99 * first.history  # its server held the first turn
    for before, after in zip(back, back[1:], strict=False):
        assert after.cache_n >= 0.99 * before.history, (before, after)


def test_a_slow_store_slows_no_completion(fleet):
    name, server = next(iter(fleet.servers.items()))
    conversation = Conversation("slow store")
    uploaded = metrics(server.url).get(UPLOADED, 0.0)
    conversation.turn(server.url, "Where is item 9?")
    wait_metric(server, UPLOADED, uploaded)
    before = metrics(server.url)
    # A store slow to take writes: each PUT and POST (an upload's requests) waits SLOW_STORE_S or until the
    # test lets it go; lookups (GET, HEAD) do not wait, since a turn's lookup is in its path by design.
    fleet.relay.slow(SLOW_STORE_S, (b"PUT ", b"POST "))
    try:
        # The chat held by its server: each turn's write-behind upload waits on the store, the turns don't.
        turns = [conversation.turn(server.url, f"And item {item}?") for item in (13, 14, 15)]
        during = metrics(server.url)
        held = fleet.relay.held
    finally:
        fleet.relay.fast()
    assert held >= 1  # an upload's request waits on the store now, the turns answered meanwhile
    assert during[UPLOADED] == before[UPLOADED]  # none of their uploads landed yet
    assert during[UPLOAD_FAILED] == before[UPLOAD_FAILED]
    assert during[WRITE_BEHIND_SAVED] >= before[WRITE_BEHIND_SAVED] + 1  # saved locally, the upload pending
    settled(server)
    # Nothing lost: the last turn reached the bucket and another server continues from it.
    other = [s for n, s in fleet.servers.items() if n != name][0]
    assert conversation.turn(other.url, "And item 16?").cache_n >= 0.99 * turns[-1].history


def bad_files(m: dict[str, float]) -> float:
    """strata:store_bad_files_total over its reasons (unlabelled while none was counted)."""
    return sum(v for k, v in m.items() if k.startswith("strata:store_bad_files_total"))


def test_a_full_disk_fails_saves_cleanly(fleet):
    if fleet.full_disk is None:
        pytest.skip("no tmpfs for the full disk: mounting one needs root")
    name = list(fleet.servers)[-1]
    server = fleet.servers[name]
    stat = os.statvfs(fleet.full_disk)
    free = stat.f_bavail * stat.f_frsize
    ballast = fleet.full_disk / "ballast"
    with open(ballast, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, free - (256 << 10))  # 256 KiB left: no conversation fits
    try:
        before = metrics(server.url)
        conversation = Conversation("full disk")
        turns = [conversation.turn(server.url, f"Where is item {item}?") for item in (21, 22)]
        wait_metric(server, WRITE_BEHIND_FAILED, before.get(WRITE_BEHIND_FAILED, 0.0) + 1)
        after = metrics(server.url)
        assert after[SAVE_FAILURES] >= before.get(SAVE_FAILURES, 0.0) + 2
        assert after[UPLOADED] == before.get(UPLOADED, 0.0)  # nothing to share
        assert turns[1].cache_n >= 0.99 * turns[0].history  # the slot still holds the chat
        assert requests.get(server.url + "/health", timeout=10).status_code == 200
        # The replies are the ones a server that never saved gives.
        assert replayed(conversation, fleet.reference.url) == [t.reply for t in turns]
    finally:
        ballast.unlink()
    # Nothing half-written stays: every file left is a whole conversation (its hashes checked) under a
    # store name, no pending or temporary file, nothing moved aside as bad.
    left = [p for p in fleet.full_disk.iterdir() if p.is_file()]
    assert all(NAME.match(p.name) for p in left), left
    for path in left:
        sf.inspect(path, verify=True)
    assert not list((fleet.full_disk / BAD_FOLDER).glob("*"))
    # Room again: the next turn is saved and shared.
    saved = metrics(server.url).get(WRITE_BEHIND_SAVED, 0.0)
    conversation.turn(server.url, "And item 23?")
    wait_metric(server, WRITE_BEHIND_SAVED, saved)
    # none of this test's files was refused as bad (other tests' faults may have counted some on this server)
    assert bad_files(metrics(server.url)) == bad_files(before)
