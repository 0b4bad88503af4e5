"""The scheduler (spec/engine-protocol.md, "Scheduling") in process on the real SmolLM2: concurrent
completions interleave and each gets the greedy tokens it gets alone, a long prompt delays another slot's
tokens by at most one chunk (counted in steps), CANCEL by id, commands answered between steps, slot_busy,
SAVE of one slot while another streams, a refused RESTORE keeps the slot's conversation."""

from __future__ import annotations

import re

import numpy as np
import pytest
import xxhash
from strata_engine.scheduler import CUT_CHUNK_SHARE
from strata_engine.slots import LaunchedStep, SlotSet

from .inprocess import InProcessEngine, alone_then_together
from .runners import base_runner, sharing

CHUNK = 16
N_CTX_SLOT = 512


def make_slots(n_slots: int):
    return sharing(
        base_runner("smollm2"),
        n_slots=n_slots,
        n_ctx=N_CTX_SLOT * n_slots,
        prefill_chunk=CHUNK,
        kv_type="f16",
    )


@pytest.fixture
def engine(tokenizers, templates):
    started: list[InProcessEngine] = []

    def start(n_slots: int) -> InProcessEngine:
        started.append(InProcessEngine(make_slots(n_slots), tokenizers["smollm2"], templates["smollm2"]))
        return started[-1]

    yield start
    for e in started:
        e.close()


def prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(300, 40000, n)]


def greedy(**fields) -> dict:
    return {"temperature": 0, "ignore_eos": True, **fields}


def digest(tokens) -> str:
    return xxhash.xxh3_64_hexdigest(np.asarray(tokens, dtype="<i4").tobytes())


def test_concurrent_completes_interleave_and_each_gets_its_greedy_tokens_alone(engine):
    prompts = {"a": prompt(20, 1), "b": prompt(45, 2), "c": prompt(7, 3)}
    alone = engine(1)
    expected = {
        rid: alone.command("COMPLETE", greedy(id=rid, prompt=p, n_predict=10, cache_prompt=False))["tokens"]
        for rid, p in prompts.items()
    }
    e = engine(3)
    for slot, (rid, p) in enumerate(prompts.items()):
        e.send("COMPLETE", greedy(id=rid, slot=slot, prompt=p, n_predict=10))
    results = {rid: e.terminal(rid) for rid in prompts}
    for rid, result in results.items():
        assert result["event"] == "result" and result["slot"] == list(prompts).index(rid)
        assert result["tokens"] == expected[rid]
        assert [line["token"] for _, line in e.of(rid, "token")] == expected[rid]
    order = [line["id"] for _, line in e.log if line["event"] == "token"]
    assert (
        sum(x != y for x, y in zip(order, order[1:], strict=False)) > 2
    )  # interleaved, not one after another
    # every step decoded every slot that was generating: 3 requests of 10 tokens in well under 30 steps
    assert e.scheduler.steps < 20
    # the steps each request was processing in, and its share of them: summed, the steps and their busy slots
    shares = sum(r["step_share"] for r in results.values())
    assert shares == pytest.approx(e.scheduler.steps)  # every step had a COMPLETE processing
    assert 2.0 < sum(r["n_steps"] for r in results.values()) / shares <= 3.0  # mostly all three at once
    solo = alone.command("COMPLETE", greedy(id="x", prompt=prompts["a"], n_predict=3))
    assert solo["n_steps"] == solo["step_share"] >= 3  # alone: every step its own


@pytest.fixture
def collected(monkeypatch):
    """The slot set and keep flags of every step launched ahead (`LaunchedStep.collect`), in order."""
    keeps: list[tuple[SlotSet, list[bool]]] = []
    collect = LaunchedStep.collect

    def spy(self, keep):
        keeps.append((self.slot_set, list(keep)))
        return collect(self, keep)

    monkeypatch.setattr(LaunchedStep, "collect", spy)
    return keeps


def test_each_step_is_launched_before_the_last_ones_tokens_are_accepted_and_an_ended_row_is_dropped(
        engine, collected):  # fmt: skip
    """Greedy rows: the scheduler launches the next step before accepting a step's tokens (`_launch_ahead`; on
    this backend the launch defers the step to its collection). A row whose token ends its request for a known
    reason (n_predict here) is left out of the next step; one a stop word ended is dropped when the step is
    collected, its slot holding what the same request leaves alone. Every stream gets its tokens alone."""
    alone = engine(1)
    plain = alone.command("COMPLETE", greedy(id="p", prompt=prompt(9, 40), n_predict=24, cache_prompt=False))
    stop = plain["content"][len(plain["content"]) // 2 :][:3]
    requests = {
        "w": greedy(id="w", prompt=prompt(9, 40), n_predict=24, stop=[stop], cache_prompt=False),
        "n": greedy(id="n", prompt=prompt(14, 41), n_predict=7, cache_prompt=False),
        "l": greedy(id="l", prompt=prompt(5, 42), n_predict=30, cache_prompt=False),
    }
    e = engine(3)
    expected = alone_then_together(alone, e, requests)
    assert expected["w"]["stop_type"] == "word" and len(expected["w"]["tokens"]) < 24
    keeps = [keep for slots, keep in collected if slots is e.ctx.slots]
    # every decode step after the first of each stretch was launched ahead: "l" alone decodes 29 tokens
    assert len(keeps) >= 29 - 3
    # only "w" (a stop word: not known before its token is accepted) was ever dropped, once; "n"'s end was known
    assert sum(not k for keep in keeps for k in keep) == 1


def test_a_long_prompt_delays_another_slots_tokens_by_at_most_one_chunk(engine):
    e = engine(2)
    e.send("COMPLETE", greedy(id="short", slot=0, prompt=prompt(5, 4), n_predict=24))
    e.send(
        "COMPLETE", greedy(id="long", slot=1, prompt=prompt(20 * CHUNK, 5), n_predict=2, return_progress=True)
    )
    assert e.terminal("short")["event"] == "result" and e.terminal("long")["event"] == "result"
    token_steps = [step for step, _ in e.of("short", "token")]
    assert len(token_steps) == 24
    assert np.all(np.diff(token_steps) == 1)  # one token every step, from its first to its last
    before, *chunks = e.of("long", "progress")  # one line before the evaluation, then one per chunk
    assert before[1]["processed"] == before[1]["cache"] == 0
    chunk_steps = [step for step, _ in chunks]
    processed = [line["processed"] for _, line in chunks]
    assert len(chunk_steps) == 20 and len(set(chunk_steps)) == 20  # one chunk per step
    assert np.all(np.diff([0, *processed]) <= CHUNK)
    assert (
        sum(token_steps[0] < s < token_steps[-1] for s in chunk_steps) >= 15
    )  # evaluated while "short" decoded


def test_cancel_one_id_and_the_others_finish(engine):
    e = engine(3)
    for slot, rid in enumerate("xyz"):
        e.send("COMPLETE", greedy(id=rid, slot=slot, prompt=prompt(8, 10 + slot), n_predict=30))
    e.until(lambda line: line.get("id") == "y" and line["event"] == "token")
    e.send("CANCEL", {"id": "y"})
    results = {rid: e.terminal(rid) for rid in "xyz"}
    assert results["y"]["stop_type"] == "cancelled" and 1 <= len(results["y"]["tokens"]) < 30
    assert results["x"]["stop_type"] == results["z"]["stop_type"] == "limit"
    assert len(results["x"]["tokens"]) == len(results["z"]["tokens"]) == 30
    e.send("CANCEL", {"id": "y"})  # no longer in flight: ignored, no line
    status = e.command("STATUS", {"id": "s"})
    assert [s["is_processing"] for s in status["slots"]] == [False] * 3
    assert status["slots"][1]["n_tokens_held"] == 8 + len(results["y"]["tokens"]) - 1


def test_cancel_during_the_prompt_keeps_what_was_read(engine):
    e = engine(1)
    e.send("COMPLETE", greedy(id="p", prompt=prompt(30 * CHUNK, 6), n_predict=4, return_progress=True))
    e.until(lambda line: line.get("id") == "p" and line["event"] == "progress")
    e.send("CANCEL", {"id": "p"})
    result = e.terminal("p")
    assert result["stop_type"] == "cancelled" and result["tokens"] == []
    assert 0 < result["timings"]["prompt_n"] < 30 * CHUNK and result["timings"]["prompt_n"] % CHUNK == 0
    assert result["n_tokens_held"] == result["timings"]["prompt_n"]


def test_commands_are_answered_between_steps_and_a_huge_tokenize_stalls_no_decoding(engine, tokenizers):
    e = engine(1)
    e.send("COMPLETE", greedy(id="g", prompt=prompt(8, 7), n_predict=200))
    e.until(lambda line: line.get("id") == "g" and line["event"] == "token")
    text = "the quick brown fox jumps over the lazy dog. " * 20000  # 900 KB: seconds of tokenizing
    e.send("TOKENIZE", {"id": "t", "content": text})
    e.send("DETOKENIZE", {"id": "d", "tokens": [1, 2, 3]})
    e.send("STATUS", {"id": "s"})
    status = e.terminal("s")
    assert status["is_processing"] and status["slots"][0]["request_id"] == "g"
    tokenized = e.terminal("t")
    assert tokenized["tokens"] == tokenizers["smollm2"].encode(text)
    assert e.terminal("d")["content"] == tokenizers["smollm2"].decode([1, 2, 3])
    sent_at = e.of("s", "result")[0][0]
    answered_at = e.of("t", "result")[0][0]
    # the generation went on, a token every step, while the text was tokenized on the worker thread
    assert answered_at > sent_at
    assert sum(sent_at < step <= answered_at for step, _ in e.of("g", "token")) == answered_at - sent_at
    assert not e.of("g", "result")  # ... and the answer did not wait for the generation's end
    e.send("CANCEL", {"id": "g"})
    assert e.terminal("g")["stop_type"] == "cancelled"


def test_slot_busy_duplicate_id_and_bad_slot(engine):
    e = engine(2)
    e.send("COMPLETE", greedy(id="a", slot=1, prompt=prompt(8, 8), n_predict=50))
    e.until(lambda line: line.get("id") == "a" and line["event"] == "token")
    for verb, arg in (
        ("COMPLETE", greedy(id="b", slot=1, prompt=[5], n_predict=1)),
        ("ERASE", {"id": "b", "slot": 1}),
        ("SAVE", {"id": "b", "slot": 1, "path": "/nonexistent/x"}),
    ):
        busy = e.command(verb, arg)
        assert busy["event"] == "error" and busy["slot"] == 1, busy
        assert (busy["error"]["type"], busy["error"]["reason"]) == ("slot_busy", "slot_busy")
    duplicate = e.command("COMPLETE", greedy(id="a", slot=0, prompt=[5], n_predict=1))
    assert duplicate["error"]["reason"] == "duplicate_id"
    bad = e.command("COMPLETE", greedy(id="c", slot=2, prompt=[5], n_predict=1))
    assert bad["error"]["reason"] == "bad_field" and "slot" in bad["error"]["message"]
    assert e.command("COMPLETE", greedy(id="c", slot=0, prompt=[5], n_predict=1))["event"] == "result"
    e.send("CANCEL", {"id": "a"})
    assert e.terminal("a")["stop_type"] == "cancelled"


def test_save_one_slot_while_another_streams_and_a_refused_restore_keeps_the_slot(engine, tmp_path):
    generated = 300
    alone = engine(1)
    # long enough to outlast the first SAVE (which fingerprints the model file) on faster kernels
    expected = alone.command("COMPLETE", greedy(id="g", prompt=prompt(12, 9), n_predict=generated))["tokens"]
    e = engine(2)
    held = e.command("COMPLETE", greedy(id="h", slot=1, prompt=prompt(60, 11), n_predict=5))
    e.send("COMPLETE", greedy(id="g", slot=0, prompt=prompt(12, 9), n_predict=generated))
    e.until(lambda line: line.get("id") == "g" and line["event"] == "token")
    path = tmp_path / "slot1.session"
    saved = e.command("SAVE", {"id": "save", "slot": 1, "path": str(path)})
    assert (
        saved["event"] == "result" and saved["slot"] == 1 and saved["n_saved"] == held["n_tokens_held"] == 64
    )
    assert not e.of("g", "result")  # saved while "g" streamed
    digest1 = e.command("STATUS")["slots"][1]["tokens_held_digest"]
    corrupt = tmp_path / "corrupt.session"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    refused = e.command("RESTORE", {"id": "r", "slot": 1, "path": str(corrupt)})
    assert (
        refused["event"] == "error" and refused["error"]["type"] == "session_refused" and refused["slot"] == 1
    )
    assert e.command("STATUS")["slots"][1]["tokens_held_digest"] == digest1
    assert e.terminal("g")["tokens"] == expected  # the stream went on, unchanged
    # a file of slot 1 restores into slot 0
    restored = e.command("RESTORE", {"id": "r0", "slot": 0, "path": str(path)})
    assert restored["n_restored"] == 64
    assert e.command("STATUS")["slots"][0]["tokens_held_digest"] == digest1


class DeviceLost(SlotSet):
    """A slot set whose decode step fails as a lost device would (after the prefill worked)."""

    def decode_rows(self, steps, argmax_only):  # what the scheduler's decode step calls
        raise RuntimeError("device lost")


def test_an_unexpected_failure_in_a_step_erases_that_slot_and_the_engine_serves_on(tokenizers, templates):
    slots = sharing(
        base_runner("smollm2"), slot_set=DeviceLost, n_slots=2, n_ctx=2 * N_CTX_SLOT, prefill_chunk=CHUNK
    )
    slots.runners[1].prefill(prompt(10, 12))
    kept = digest(slots.runners[1].tokens_held)
    e = InProcessEngine(slots, tokenizers["smollm2"], templates["smollm2"])
    try:
        e.send("COMPLETE", greedy(id="a", slot=0, prompt=prompt(6, 13), n_predict=4))
        failed = e.terminal("a")
        assert [line["event"] for _, line in e.of("a")] == [
            "token",
            "error",
        ]  # the prefill's token, then the step
        assert failed["slot"] == 0 and failed["error"]["type"] == "internal"
        assert (
            "device lost" in failed["error"]["message"] and "slot 0 was erased" in failed["error"]["message"]
        )
        status = e.command("STATUS", {"id": "s"})
        assert status["slots"][0]["n_tokens_held"] == 0 and status["slots"][1]["tokens_held_digest"] == kept
    finally:
        e.close()


def test_while_a_slot_generates_a_prompt_is_cut_into_smaller_chunks_and_alone_into_full_ones(
    tokenizers, templates
):
    full = 128
    slots = sharing(
        base_runner("smollm2"), n_slots=2, n_ctx=2 * N_CTX_SLOT, prefill_chunk=full, kv_type="f16"
    )
    e = InProcessEngine(slots, tokenizers["smollm2"], templates["smollm2"])
    try:
        e.command(
            "COMPLETE",
            greedy(id="alone", slot=1, prompt=prompt(3 * full, 20), n_predict=1, return_progress=True),
        )
        processed = [line["processed"] for _, line in e.of("alone", "progress")]  # before, then per chunk
        assert np.diff(processed).tolist() == [full] * 3 and processed[0] == 0
        e.send("COMPLETE", greedy(id="gen", slot=0, prompt=prompt(5, 21), n_predict=400))
        e.until(lambda line: line.get("id") == "gen" and line["event"] == "token")
        e.send(
            "COMPLETE",
            greedy(id="long", slot=1, prompt=prompt(3 * full, 22), n_predict=1, return_progress=True),
        )
        assert e.terminal("long")["timings"]["prompt_n"] == 3 * full
        e.send("CANCEL", {"id": "gen"})
        assert e.terminal("gen")["stop_type"] == "cancelled"
        lines = e.of("long", "progress")  # one before the evaluation, then one per chunk
        chunks = np.diff([line["processed"] for _, line in lines]).tolist()
        assert chunks == [full // CUT_CHUNK_SHARE] * 3 * CUT_CHUNK_SHARE  # cut while "gen" generated
        token_steps = [step for step, _ in e.of("gen", "token")]
        chunk_steps = [step for step, _ in lines[1:]]
        assert token_steps[0] < chunk_steps[0] and chunk_steps[-1] < token_steps[-1]
        assert np.all(np.diff(token_steps) == 1)  # a token every step meanwhile
    finally:
        e.close()


def test_a_huge_complete_line_is_read_and_parsed_beside_the_steps(engine):
    e = engine(2)
    e.send("COMPLETE", greedy(id="g", slot=0, prompt=prompt(8, 30), n_predict=400))
    e.until(lambda line: line.get("id") == "g" and line["event"] == "token")
    text = "the quick brown fox " * 800_000  # 16 MB: 256 blocks of 64 KiB
    sent_at = e.scheduler.steps
    e.send("COMPLETE", {"id": "huge", "slot": 1, "prompt": text})  # returns once the reader took every byte
    written_at = e.scheduler.steps
    refused = e.terminal("huge")
    assert refused["error"]["type"] == "exceed_context_size" and refused["slot"] == 1
    answered_at = e.of("huge", "error")[0][0]
    # the loop went on stepping while the line was read and parsed (not one 64 KiB block per step boundary)
    assert answered_at - sent_at < 64, (sent_at, written_at, answered_at)
    tokens = [step for step, _ in e.of("g", "token")]
    assert (
        sum(sent_at < step <= answered_at for step in tokens) == answered_at - sent_at
    )  # a token every step
    e.send("CANCEL", {"id": "g"})
    assert e.terminal("g")["stop_type"] == "cancelled"


def test_cancel_ends_an_embed_between_chunks_and_the_engine_serves_on(engine):
    e = engine(2)
    e.send("COMPLETE", greedy(id="g", slot=0, prompt=prompt(8, 40), n_predict=400))
    e.until(lambda line: line.get("id") == "g" and line["event"] == "token")
    e.send("EMBED", {"id": "emb", "tokens": prompt(30 * CHUNK, 41)})
    e.send("CANCEL", {"id": "emb"})
    cancelled = e.terminal("emb")
    assert (cancelled["event"], cancelled["error"]["type"], cancelled["error"]["reason"]) == (
        "error",
        "cancelled",
        "cancelled",
    )
    done, total = map(int, re.search(r"after (\d+) of (\d+) tokens", cancelled["error"]["message"]).groups())
    assert total == 30 * CHUNK and done < total and done % CHUNK == 0  # ended between two chunks
    e.send("CANCEL", {"id": "emb"})  # no longer in flight: ignored, no line
    whole = e.command("EMBED", {"id": "emb", "tokens": prompt(3 * CHUNK, 41), "pooling": "mean"})
    assert whole["event"] == "result" and whole["n_tokens"] == 3 * CHUNK
    e.send("CANCEL", {"id": "g"})
    assert e.terminal("g")["stop_type"] == "cancelled"
    assert not [line for _, line in e.log if line.get("id") is None]  # the CANCELs were never answered


class FailsAfterItsThirdDecode(SlotSet):
    """A slot set whose third decode step runs its forward pass and then fails (as a device lost while the
    logits come back)."""

    decodes = 0

    def decode_rows(self, steps, argmax_only):
        out = super().decode_rows(steps, argmax_only)
        self.decodes += 1
        if self.decodes == 3:
            raise RuntimeError("device lost after the pass")
        return out


def passes(n_tokens: int, chunk: int = CHUNK) -> int:
    """The forward passes of a prompt or EMBED evaluated alone: one per chunk."""
    return -(-n_tokens // chunk)


def test_every_forward_pass_is_counted_once_embeds_cancels_and_concurrent_steps_included(engine):
    e = engine(2)
    done = e.command("COMPLETE", greedy(id="a", prompt=prompt(40, 50), n_predict=5))
    expected = passes(40) + 4  # the prompt's chunks, then a decode per token but the last (never evaluated)
    assert done["n_forward"] == e.command("STATUS", {"id": "s"})["n_forward"] == expected
    embedded = e.command("EMBED", {"id": "emb", "tokens": prompt(50, 51), "pooling": "mean"})
    expected += passes(50)
    assert embedded["n_forward"] == expected
    e.send("EMBED", {"id": "cut", "tokens": prompt(30 * CHUNK, 52)})
    e.send("CANCEL", {"id": "cut"})
    cancelled = e.terminal("cut")
    evaluated = int(re.search(r"after (\d+) of", cancelled["error"]["message"]).group(1))
    expected += passes(evaluated)
    assert cancelled["event"] == "error" and cancelled["n_forward"] == expected
    # a generation and an EMBED at once: steps run a decode pass and a chunk each, both counted
    steps_before = e.scheduler.steps
    e.send("COMPLETE", greedy(id="g", slot=1, prompt=prompt(8, 53), n_predict=30))
    e.send("EMBED", {"id": "beside", "tokens": prompt(100, 54), "pooling": "mean"})
    assert e.terminal("g")["event"] == e.terminal("beside")["event"] == "result"
    expected += passes(8) + 29 + passes(100)
    assert e.command("STATUS", {"id": "s2"})["n_forward"] == expected
    assert e.scheduler.steps - steps_before < passes(8) + 29 + passes(100)  # some steps ran two passes


def test_the_passes_of_a_request_that_failed_are_counted(tokenizers, templates):
    slots = sharing(
        base_runner("smollm2"),
        slot_set=FailsAfterItsThirdDecode,
        n_slots=1,
        n_ctx=N_CTX_SLOT,
        prefill_chunk=CHUNK,
    )
    e = InProcessEngine(slots, tokenizers["smollm2"], templates["smollm2"])
    try:
        failed = e.command("COMPLETE", greedy(id="f", prompt=prompt(20, 55), n_predict=10))
        assert failed["event"] == "error" and failed["error"]["type"] == "internal"
        assert failed["n_forward"] == e.command("STATUS", {"id": "s"})["n_forward"] == passes(20) + 3
    finally:
        e.close()


class CountedRunners(tuple):
    """A slot set's runners that record the slots looked up and every walk over all of them."""

    touched: set[int]
    walks: int

    def __new__(cls, runners):
        counted = super().__new__(cls, runners)
        counted.touched, counted.walks = set(), 0
        return counted

    def __getitem__(self, index):
        self.touched.add(index)
        return super().__getitem__(index)

    def __iter__(self):
        self.walks += 1
        return super().__iter__()


def test_256_slots_steps_touch_only_the_slots_generating(tokenizers, templates):
    """Issue 41's scale: with -np 256 a step's work is O(active slots): two slots generate and no step looks up
    another slot or walks them all (counted on the slot set's runners, which every slot access goes through)."""
    n_slots = 256
    slots = sharing(base_runner("smollm2"), n_slots=n_slots, n_ctx=64 * n_slots, kv_type="f16")
    e = InProcessEngine(slots, tokenizers["smollm2"], templates["smollm2"])
    try:
        slots.runners = counted = CountedRunners(slots.runners)
        for rid, slot in (("a", 7), ("b", 200)):
            e.send("COMPLETE", greedy(id=rid, slot=slot, prompt=prompt(5, slot), n_predict=24))
        assert [e.terminal(rid)["event"] for rid in "ab"] == ["result", "result"]
        assert e.scheduler.steps >= 24 and counted.touched <= {7, 200} and counted.walks == 0
    finally:
        e.close()
