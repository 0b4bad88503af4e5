"""``--parallel N`` in the HTTP layer, over the in-process fake engine (one FakeEngine per slot): the slot
manager's choice and queue, GET /slots, /props, /metrics, id_slot, slot actions on every slot."""

from __future__ import annotations

import threading
import time

import pytest
from strata_server.errors import SlotBusy
from strata_server.ledger import Origin, SlotLedger
from strata_server.slot_manager import SlotManager
from strata_server.tokens import as_tokens

from .checks import assert_error

GREEDY = {"temperature": 0, "n_predict": 6}


def slot_post(client, slot: int, action: str, body: dict | None = None):
    return client.simulate_post(f"/slots/{slot}", params={"action": action}, json=body or {})


# --- the slot manager alone ---------------------------------------------------------------------------


def test_least_recently_used_idle_slot_first():
    slots = SlotManager(SlotLedger(3))
    # Never used: a tie, which the peer's scan gives to the highest id.
    assert slots.acquire(0) == 2
    assert slots.acquire(0) == 1
    slots.release(2)
    slots.release(1)  # now slot 0 (never used) is the least recently used, then 2, then 1
    assert [slots.acquire(0) for _ in range(3)] == [0, 2, 1]


def test_prefix_similarity_rule():
    slots = SlotManager(SlotLedger(3), similarity=0.5)
    for slot_id, tokens in ((0, [1, 2, 3, 4]), (1, [1, 2, 9, 9]), (2, [])):
        slots.ledger.restored(slot_id, as_tokens(tokens), Origin.SLOT_FILE, "held.bin")
    # 4 of 5 prompt tokens shared with slot 0 (0.8 > 0.5); slot 1 shares 2 of 5 (0.4).
    assert slots.choose(prompt=[1, 2, 3, 4, 5]).id == 0
    # 2 of 6 (0.33) is not more than 0.5: the least recently used slot (the highest id on a tie).
    assert slots.choose(prompt=[1, 2, 7, 7, 7, 7]).id == 2
    slots.similarity = 0.0  # the rule off
    assert slots.choose(prompt=[1, 2, 3, 4, 5]).id == 2
    assert slots.choose(id_slot=1).id == 1


def test_waiters_take_turns_in_arrival_order():
    slots = SlotManager(SlotLedger(1))
    assert slots.acquire(0) == 0
    order: list[str] = []

    def wait(name: str) -> None:
        slot = slots.acquire(5.0)
        order.append(name)
        time.sleep(0.05)
        slots.release(slot)

    threads = []
    for name in ("a", "b", "c"):
        threads.append(threading.Thread(target=wait, args=(name,)))
        threads[-1].start()
        while slots.waiting < len(threads):
            time.sleep(0.005)
    slots.release(0)
    for thread in threads:
        thread.join(5)
    assert order == ["a", "b", "c"] and slots.waiting == 0


def test_named_slot_waits_alone_and_times_out():
    slots = SlotManager(SlotLedger(2))
    assert slots.acquire(0, id_slot=1) == 1
    start = time.monotonic()
    with pytest.raises(SlotBusy, match="slot 1 stayed busy"):
        slots.acquire(0.2, id_slot=1)
    assert time.monotonic() - start >= 0.2 and slots.waiting == 0
    assert slots.acquire(0) == 0  # another slot is free for a request naming none
    with pytest.raises(SlotBusy, match="every slot"):
        slots.acquire(0.05)


# --- the HTTP layer -----------------------------------------------------------------------------------


@pytest.fixture
def api4(make_api, slot_dir):
    return make_api(n_ctx=1024, parallel=4, slot_save_path=str(slot_dir), metrics=True)


def test_slots_props_and_metrics_list_every_slot(api4):
    client, engine, _ = api4
    done = client.simulate_post("/completion", json={"prompt": "hello there", **GREEDY, "id_slot": 2}).json
    assert done["id_slot"] == 2
    lease = engine.acquire(id_slot=1)
    try:
        slots = client.simulate_get("/slots").json
        assert [s["id"] for s in slots] == [0, 1, 2, 3]
        assert all(s["n_ctx"] == 256 and s["speculative"] is False for s in slots)
        assert [s["is_processing"] for s in slots] == [False, True, False, False]
        assert "params" not in slots[0] and slots[2]["n_prompt_tokens"] == done["tokens_evaluated"]
        assert slots[2]["next_token"][0]["n_decoded"] == 0 < done["tokens_predicted"]  # idle, as the peer's
        props = client.simulate_get("/props").json
        assert props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] == 256
        text = client.simulate_get("/metrics").text
        assert "llamacpp:requests_processing 1" in text
        assert 'strata:slot_is_processing{id_slot="1"} 1' in text
        assert 'strata:slot_is_processing{id_slot="0"} 0' in text
        assert f'strata:slot_tokens_held{{id_slot="2"}} {done["tokens_cached"]}' in text
    finally:
        lease.release()
    # Every slot busy: fail_on_no_slot answers 503, as the peer.
    leases = [engine.acquire(id_slot=i) for i in range(4)]
    try:
        assert_error(client.simulate_get("/slots", params={"fail_on_no_slot": "1"}), 503, "unavailable_error")
    finally:
        for lease in leases:
            lease.release()


def test_id_slot_is_honoured_and_checked(api4):
    client, _, _ = api4
    for slot in (3, 0, 1):
        body = client.simulate_post("/completion", json={"prompt": "abc", **GREEDY, "id_slot": slot}).json
        assert body["id_slot"] == slot and body["timings"]["cache_n"] == 0  # each slot its own conversation
    again = client.simulate_post("/completion", json={"prompt": "abc", **GREEDY, "id_slot": 3}).json
    assert again["timings"]["cache_n"] > 0
    for bad in (4, -2):
        assert_error(
            client.simulate_post("/completion", json={"prompt": "abc", "id_slot": bad}),
            400,
            "invalid_request_error",
            f"Invalid slot ID: {bad}; this server has slots 0..3",
        )
    assert (
        client.simulate_post("/completion", json={"prompt": "abc", **GREEDY, "id_slot": -1}).status_code
        == 200
    )


def test_a_conversation_returns_to_the_slot_holding_it(api4):
    client, _, _ = api4
    chats = {slot: f"{'xyz'[slot]}: conversation number {slot}" for slot in range(3)}  # nothing shared
    first = {
        slot: client.simulate_post("/completion", json={"prompt": p, **GREEDY}).json
        for slot, p in chats.items()
    }
    # Fresh slots are taken least recently used first: 3, 2, 1 (never used, highest id first).
    assert [first[s]["id_slot"] for s in range(3)] == [3, 2, 1]
    for slot in (1, 0, 2):  # each continues where it was, whatever the order
        prompt = chats[slot] + first[slot]["content"] + " and more"
        body = client.simulate_post("/completion", json={"prompt": prompt, **GREEDY}).json
        assert body["id_slot"] == first[slot]["id_slot"]
        assert body["timings"]["cache_n"] >= first[slot]["tokens_evaluated"]
    # The chat endpoint too (messages are tokenized by PROMPT_TOKENS before the choice): the slot least
    # recently used is slot 0, but the next turn goes back to the chat's slot.
    messages = [{"role": "user", "content": "a chat about the weather"}]
    chat = client.simulate_post("/v1/chat/completions", json={"messages": messages, **GREEDY}).json
    client.simulate_post("/completion", json={"prompt": "q: something else", **GREEDY})
    messages += [
        {"role": "assistant", "content": chat["choices"][0]["message"]["content"]},
        {"role": "user", "content": "and tomorrow?"},
    ]
    turn = client.simulate_post("/v1/chat/completions", json={"messages": messages, **GREEDY}).json
    assert turn["timings"]["cache_n"] >= chat["usage"]["prompt_tokens"]


def test_save_one_slot_while_another_streams_and_restore_into_any(api4, make_api, slot_dir):
    client, engine, _ = api4
    one = client.simulate_post("/completion", json={"prompt": "slot one's chat", **GREEDY, "id_slot": 1}).json
    two = client.simulate_post("/completion", json={"prompt": "slot two's chat", **GREEDY, "id_slot": 2}).json
    busy = engine.acquire(id_slot=1)  # slot 1 is busy (a stream in flight)
    try:
        saved = slot_post(client, 2, "save", {"filename": "two.bin"}).json
        assert saved["id_slot"] == 2 and saved["n_saved"] == two["tokens_cached"]
        assert_error(
            slot_post(client, 7, "save", {"filename": "x.bin"}),
            400,
            "invalid_request_error",
            "Invalid slot ID: 7; this server has slots 0..3",
        )
    finally:
        busy.release()
    assert slot_post(client, 1, "save", {"filename": "one.bin"}).json["n_saved"] == one["tokens_cached"]
    restored = slot_post(client, 0, "restore", {"filename": "one.bin"}).json
    assert restored["id_slot"] == 0 and restored["n_restored"] == one["tokens_cached"]
    again = client.simulate_post(
        "/completion", json={"prompt": "slot one's chat", **GREEDY, "id_slot": 0}
    ).json
    assert again["timings"]["cache_n"] == one["tokens_evaluated"] - 1 and again["content"] == one["content"]
    assert slot_post(client, 3, "erase").json == {"id_slot": 3, "n_erased": 0}
    # Into a one-slot server with the same per-slot context.
    single, _, _ = make_api(n_ctx=256, slot_save_path=str(slot_dir))
    assert (
        single.simulate_post("/slots/0", params={"action": "restore"}, json={"filename": "one.bin"}).json[
            "n_restored"
        ]
        == one["tokens_cached"]
    )
    cont = single.simulate_post("/completion", json={"prompt": "slot one's chat", **GREEDY}).json
    assert cont["timings"]["cache_n"] == one["tokens_evaluated"] - 1 and cont["content"] == one["content"]


def test_a_restore_failing_after_its_gate_erases_that_slot_only(api4, slot_dir):
    from .fake_engine import mark_fail_after_gate

    client, _, _ = api4
    kept = client.simulate_post("/completion", json={"prompt": "kept", **GREEDY, "id_slot": 0}).json
    client.simulate_post("/completion", json={"prompt": "doomed", **GREEDY, "id_slot": 1})
    assert slot_post(client, 1, "save", {"filename": "doomed.bin"}).status_code == 200
    mark_fail_after_gate(str(slot_dir / "doomed.bin"))
    error = assert_error(slot_post(client, 1, "restore", {"filename": "doomed.bin"}), 500, "server_error")
    assert "slot 1 was erased" in error["message"] and error["reason"] == "apply_failed"
    again = client.simulate_post("/completion", json={"prompt": "kept", **GREEDY, "id_slot": 0}).json
    assert again["timings"]["cache_n"] == kept["tokens_evaluated"] - 1
    assert client.simulate_post("/slots/1", params={"action": "erase"}, json={}).json["n_erased"] == 0


def test_slot_actions_leave_the_least_recently_used_order(api4):
    client, _, _ = api4
    for slot in (0, 1, 2, 3):
        client.simulate_post("/completion", json={"prompt": f"{slot} only", **GREEDY, "id_slot": slot})
    assert slot_post(client, 0, "save", {"filename": "zero.bin"}).status_code == 200
    assert slot_post(client, 0, "erase").status_code == 200
    body = client.simulate_post("/completion", json={"prompt": "something new", **GREEDY}).json
    assert body["id_slot"] == 0  # still the least recently used: the actions were no use of it
