"""The session store end to end (--cache-disk): real servers (gunicorn, engine, SmolLM2; gemma3 for the
shared folder), the OpenAI SDK for chats.

* A chat, SIGTERM (the shutdown save), a new server on the same folder, the same chat plus one message:
  the stored conversation is restored (cached_tokens >= 99 % of it) and the greedy reply equals the one
  of a server that never stopped; the same after kill -9 once an idle save happened.
* Two conversations alternating on one slot hit the store on every returning turn (the disk store and
  the RAM-only one, --cache-ram).
* A displaced chat's save is committed in the background (fsync, rename, index) and is restored after a
  SIGTERM restart; what a kill -9 between the engine's write and that commit leaves (a whole pending file,
  one cut short) is committed or removed at start-up, never indexed half-written.
* Three chats on two slots (--parallel 2) hit the store on every returning turn.
* 50 conversations under a small byte limit: the folder never holds more than the limit.
* A corrupt and a truncated file are moved aside, the prompts are evaluated cold with the right answer.
* A gemma3 server sharing the folder ignores SmolLM2's files and leaves them alone.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import openai
import psutil
import pytest
import requests
import strata_sessionfile as sf
from support.data import gemma3_model_path

from .servers import start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

FACTS = " ".join(f"Item {i} is stored in box {i * 7 % 31} on shelf {i % 5}." for i in range(30))
REPLY_TOKENS = 12


def chat_a() -> list[dict]:
    return [
        {"role": "system", "content": "You are a careful assistant. Facts: " + FACTS},
        {"role": "user", "content": "Where is item 12?"},
    ]


def chat_b() -> list[dict]:
    return [
        {"role": "system", "content": "Answer in one line. Known places: " + FACTS[::-1]},
        {"role": "user", "content": "Where is item 3?"},
    ]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300)


def turn(server, messages: list[dict], **extra) -> tuple[str, int]:
    """One greedy chat turn: (reply, cached_tokens)."""
    reply = chat(server, messages, **extra)
    return reply.choices[0].message.content, reply.usage.prompt_tokens_details.cached_tokens


def chat(server, messages: list[dict], **extra):
    return client(server).chat.completions.create(
        model="smollm2", messages=messages, max_tokens=REPLY_TOKENS, temperature=0, extra_body=extra or None
    )


def followed(messages: list[dict], reply: str, question: str) -> list[dict]:
    return [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": question}]


def metric(server, name: str) -> float:
    text = requests.get(server.url + "/metrics", timeout=30).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def await_metric(server, name: str, value: float, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while (got := metric(server, name)) < value:
        assert time.monotonic() < deadline, f"{name} is {got}, not {value}"
        time.sleep(0.1)
    assert got == value, name


def stored_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.ssf"))


def stored_tokens(path: Path) -> int:
    return sf.inspect(path, verify=False).metadata.state.n_tokens


def kill_everything(server) -> None:
    """kill -9 of the server, its worker and the engine at once: no shutdown hook runs."""
    parent = psutil.Process(server.proc.pid)
    for proc in [*parent.children(recursive=True), parent]:
        proc.send_signal(signal.SIGKILL)
    server.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def never_stopped(module_tmp):
    """A server without a store: the reference replies (its prompt cache keeps each chat held)."""
    server = start_server(module_tmp, name="reference")
    yield server
    assert server.stop() == 0


def reference_turns(server, messages: list[dict], question: str) -> tuple[str, str]:
    """A chat's first turn evaluated cold (as on a new server) and its second turn on the same server."""
    first = chat(server, messages, cache_prompt=False)
    reply = first.choices[0].message.content
    second, cached = turn(server, followed(messages, reply, question))
    assert cached >= first.usage.prompt_tokens  # it held the chat
    return reply, second


def returning_turn(server, messages: list[dict], held: int | None, hits: int):
    """A chat's turn on a server whose store may hold it: a returning chat (`held`: the tokens it held when it
    left its slot) gets all of them from the store, counted as the next hit; a new one shares only the
    template's first tokens. Returns (the reply, the hits so far)."""
    reply = chat(server, messages)
    cached = reply.usage.prompt_tokens_details.cached_tokens
    if held is None:
        assert cached < 10
        return reply, hits
    assert cached >= 0.99 * held, (messages[-1], cached, held)
    assert metric(server, 'strata:store_lookups_total{result="hit"}') == hits + 1
    return reply, hits + 1


@pytest.mark.parametrize("stop", ["sigterm", "kill-after-idle-save"])
def test_a_chat_continues_after_a_restart(module_tmp, never_stopped, stop):
    folder = module_tmp / f"store-{stop}"
    flags = (
        "--cache-disk",
        str(folder),
        "--metrics",
        "--cache-idle-seconds",
        "1" if stop != "sigterm" else "600",
    )
    first_reply, reference = reference_turns(never_stopped, chat_a(), "And item 7?")
    server = start_server(module_tmp, *flags, name=f"{stop}-1")
    reply, _ = turn(server, chat_a())
    assert reply == first_reply
    if stop == "sigterm":
        assert server.stop() == 0  # the shutdown save
    else:
        deadline = time.monotonic() + 60
        while metric(server, 'strata:store_saves_total{trigger="idle"}') < 1:
            assert time.monotonic() < deadline, "no idle save"
            time.sleep(0.2)
        kill_everything(server)
    files = stored_files(folder)
    assert len(files) == 1
    n_stored = stored_tokens(files[0])
    assert n_stored > 400

    server = start_server(module_tmp, *flags, name=f"{stop}-2")
    try:
        reply, cached = turn(server, followed(chat_a(), first_reply, "And item 7?"))
        assert cached >= 0.99 * n_stored
        assert reply == reference
        assert metric(server, 'strata:store_lookups_total{result="hit"}') == 1
        slot = requests.get(server.url + "/slots", timeout=30).json()[0]["conversation"]
        assert slot["origin"] == "store" and slot["file"] == files[0].name and slot["n_restored"] == cached
    finally:
        assert server.stop() == 0


def test_a_displaced_chat_is_committed_in_the_background_and_a_killed_commit_is_recovered(
    module_tmp, never_stopped
):
    folder = module_tmp / "store-background"
    flags = ("--cache-disk", str(folder), "--metrics", "--cache-idle-seconds", "600")
    a_first, a_reference = reference_turns(never_stopped, chat_a(), "And item 7?")
    b_first, b_reference = reference_turns(never_stopped, chat_b(), "And item 9?")
    server = start_server(module_tmp, *flags, name="background-1")
    try:
        assert turn(server, chat_a())[0] == a_first
        assert (
            turn(server, chat_b())[0] == b_first
        )  # a leaves the slot: written by the engine, committed after
        await_metric(server, 'strata:store_saves_total{trigger="replace"}', 1)
        (a_file,) = stored_files(folder)
        assert not list(folder.glob("*.pending"))
        assert metric(server, "strata:store_bytes") == a_file.stat().st_size  # indexed once committed
    finally:
        assert server.stop() == 0  # b is saved at shutdown
    (b_file,) = [p for p in stored_files(folder) if p != a_file]
    n_a = stored_tokens(a_file)
    # What a kill -9 between the engine's write and the commit leaves: a's file whole under its pending name
    # (the engine renames its temporary only when complete); b's cut short (what only a power loss could leave).
    a_file.rename(a_file.with_name(a_file.name + ".pending"))
    data = b_file.read_bytes()
    b_file.unlink()
    b_file.with_name(b_file.name + ".pending").write_bytes(data[: len(data) // 2])
    server = start_server(module_tmp, *flags, name="background-2")
    try:
        reply, cached = turn(server, followed(chat_a(), a_first, "And item 7?"))
        assert [p.name for p in stored_files(folder)] == [a_file.name] and not list(folder.glob("*.pending"))
        assert cached >= 0.99 * n_a and reply == a_reference
        reply, cached = turn(server, followed(chat_b(), b_first, "And item 9?"))
        assert cached < 10 and reply == b_reference  # evaluated cold: the half file was never indexed
        assert metric(server, 'strata:store_lookups_total{result="hit"}') == 1
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("store", ["disk", "ram"])
def test_two_conversations_alternating_on_one_slot_hit_the_store_every_turn(module_tmp, store):
    folder = module_tmp / "store-alternating"
    flags = ("--cache-disk", str(folder)) if store == "disk" else ("--cache-ram", "512")
    server = start_server(module_tmp, *flags, "--metrics", name=f"alternating-{store}")
    try:
        chats = {"a": chat_a(), "b": chat_b()}
        held: dict[str, int] = {}  # tokens a chat's conversation held when it left the slot
        before: dict[str, int] = {}  # ... the time before
        last: dict[str, list[dict]] = {}  # the messages of its last turn
        hits = 0
        for round_ in range(3):
            for name, messages in chats.items():
                reply, hits = returning_turn(server, messages, held.get(name), hits)
                before[name], held[name] = (
                    held.get(name, 0),
                    reply.usage.prompt_tokens + reply.usage.completion_tokens - 1,
                )
                last[name], chats[name] = (
                    messages,
                    followed(messages, reply.choices[0].message.content, f"And item {round_ + 4}?"),
                )
        # a's last question edited (b holds the slot): a's stored conversation is restored, cut back to the edit
        edited = chat(server, [*last["a"][:-1], {"role": "user", "content": "Where is item 29?"}])
        cached = edited.usage.prompt_tokens_details.cached_tokens
        assert before["a"] <= cached < edited.usage.prompt_tokens
        assert metric(server, 'strata:store_lookups_total{result="hit"}') == hits + 1
        assert metric(server, "strata:store_bytes") > 0
        assert metric(server, 'strata:store_saves_total{trigger="replace"}') >= 5
    finally:
        assert server.stop() == 0
        log = server.log_path.read_text(errors="replace")
    # every restore logged at INFO with its time, as saves are
    restores = re.findall(
        r"session store: restored slot 0 from (\S+) \(\d+ tokens kept, .*\) in (\d+) ms", log
    )
    assert len(restores) == hits + 1 and all(int(ms) > 0 for _, ms in restores)
    if store == "disk":
        assert stored_files(folder)
    else:  # the RAM store's folder: a name of its own, under /dev/shm, gone with the server
        ram = Path(restores[0][0]).parent
        assert ram.name.startswith(f"strata-cache-ram-{os.geteuid()}-") and not ram.exists()


def test_three_chats_on_two_slots_hit_the_store_on_every_returning_turn(module_tmp):
    """--parallel 2: each returning chat takes the least recently used slot, whose conversation is written by
    the engine (SAVE, sync false) and committed off the path; the returning one is restored from the store."""
    folder = module_tmp / "store-two-slots"
    server = start_server(
        module_tmp,
        "-np",
        "2",
        "-c",
        "4096",
        "--cache-disk",
        str(folder),
        "--metrics",
        "--cache-idle-seconds",
        "600",
        name="two-slots",
    )
    try:
        chats = {
            "a": chat_a(),
            "b": chat_b(),
            "c": [
                {"role": "system", "content": "Be brief. Inventory: " + FACTS[len(FACTS) // 2 :] + FACTS},
                {"role": "user", "content": "Where is item 20?"},
            ],
        }
        held: dict[str, int] = {}
        hits = 0
        for round_ in range(3):
            for name, messages in chats.items():
                reply, hits = returning_turn(server, messages, held.get(name), hits)
                held[name] = reply.usage.prompt_tokens + reply.usage.completion_tokens - 1
                chats[name] = followed(messages, reply.choices[0].message.content, f"And item {round_ + 4}?")
        await_metric(
            server, 'strata:store_saves_total{trigger="replace"}', 7
        )  # one per turn but the first two
        assert not list(folder.glob("*.pending"))
        assert metric(server, "strata:store_bytes") == sum(p.stat().st_size for p in stored_files(folder))
    finally:
        assert server.stop() == 0


def test_fifty_conversations_never_exceed_the_byte_limit(module_tmp):
    folder = module_tmp / "store-bounded"
    limit_mib = 40  # about five 300-token SmolLM2 conversations (22.5 KiB of f16 K/V per token)
    server = start_server(
        module_tmp,
        "--cache-disk",
        str(folder),
        "--cache-disk-max",
        str(limit_mib),
        "--metrics",
        "--cache-idle-seconds",
        "0",
        name="bounded",
    )
    try:
        for i in range(50):
            prompt = (
                f"Conversation {i}. " + FACTS[(i * 37) % 200 :] + f" Question {i}: where is item {i % 30}?"
            )
            body = requests.post(
                server.url + "/completion",
                json={"prompt": prompt, "n_predict": 1, "temperature": 0},
                timeout=300,
            ).json()
            assert body["tokens_evaluated"] >= 300
            held = sum(p.stat().st_size for p in stored_files(folder))
            assert held <= limit_mib << 20, (i, held)
        assert metric(server, "strata:store_bytes") <= limit_mib << 20
        assert metric(server, "strata:store_evictions_total") >= 40
        await_metric(
            server, 'strata:store_saves_total{trigger="replace"}', 49
        )  # the last commit is off the path
    finally:
        assert server.stop() == 0
    assert sum(p.stat().st_size for p in stored_files(folder)) <= limit_mib << 20


def test_a_corrupt_and_a_truncated_file_are_skipped_with_the_right_answer(module_tmp, never_stopped):
    folder = module_tmp / "store-bad"
    prompts = {
        "x": "Once upon a time, in a quiet village by the sea, " + FACTS,
        "y": "Recipe notes: mix the flour and the water slowly. " + FACTS[::-1],
    }
    server = start_server(module_tmp, "--cache-disk", str(folder), "--metrics", name="bad-1")
    try:
        for prompt in prompts.values():
            requests.post(
                server.url + "/completion",
                json={"prompt": prompt, "n_predict": 2, "temperature": 0},
                timeout=300,
            ).raise_for_status()
    finally:
        assert server.stop() == 0  # x saved when y replaced it, y at shutdown
    files = {stored_tokens(p): p for p in stored_files(folder)}
    assert len(files) == 2
    corrupt, truncated = (files[n] for n in sorted(files))
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 2] ^= 0x55
    corrupt.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-4096])

    server = start_server(module_tmp, "--cache-disk", str(folder), "--metrics", name="bad-2")
    try:
        for prompt in prompts.values():
            longer = prompt + " And then?"
            body = requests.post(
                server.url + "/completion",
                json={"prompt": longer, "n_predict": 8, "temperature": 0},
                timeout=300,
            ).json()
            cold = requests.post(
                never_stopped.url + "/completion",
                json={"prompt": longer, "n_predict": 8, "temperature": 0, "cache_prompt": False},
                timeout=300,
            ).json()
            assert body["timings"]["cache_n"] == 0 and body["content"] == cold["content"]
        assert metric(server, 'strata:store_bad_files_total{reason="truncated"}') == 1  # at the scan
        assert metric(server, 'strata:store_bad_files_total{reason="payload_corrupt"}') == 1  # at the restore
        assert metric(server, 'strata:store_lookups_total{result="hit"}') == 0
        assert requests.get(server.url + "/health", timeout=30).status_code == 200
    finally:
        assert server.stop() == 0
    assert len(list((folder / ".bad").iterdir())) == 2
    assert corrupt.name not in {p.name for p in stored_files(folder)}


def test_a_server_of_another_model_sharing_the_folder_ignores_its_files(module_tmp):
    folder = module_tmp / "store-shared"
    smollm2 = start_server(module_tmp, "--cache-disk", str(folder), name="shared-smollm2")
    try:
        turn(smollm2, chat_a())
    finally:
        assert smollm2.stop() == 0
    theirs = {p.name: p.stat().st_mtime for p in stored_files(folder)}
    assert len(theirs) == 1

    gemma = start_server(
        module_tmp,
        "--cache-disk",
        str(folder),
        "--metrics",
        "-m",
        str(gemma3_model_path()),
        "--cache-idle-seconds",
        "600",
        name="shared-gemma3",
    )
    try:
        deadline = time.monotonic() + 60
        while "session store" not in gemma.log():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert "0 conversations (0.0 MiB) indexed, 1 of other engines ignored, 0 bad" in gemma.log()
        body = requests.post(
            gemma.url + "/completion",
            json={"prompt": chat_a()[0]["content"], "n_predict": 2, "temperature": 0},
            timeout=300,
        ).json()
        assert body["timings"]["cache_n"] == 0 and body["tokens_predicted"] == 2
        assert metric(gemma, "strata:store_files") == 0
        assert metric(gemma, 'strata:store_lookups_total{result="miss"}') == 1
    finally:
        assert gemma.stop() == 0  # saves gemma3's own conversation beside SmolLM2's
    after = {p.name: p.stat().st_mtime for p in stored_files(folder)}
    assert len(after) == 2 and all(after[name] == mtime for name, mtime in theirs.items())
    assert not (folder / ".bad").exists()
