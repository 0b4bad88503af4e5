"""The step policy (scheduler.py) on a fake slot set and fake generations, no model: each step decodes every
generating slot in one batch and evaluates at most one prefill chunk (cut while slots generate, prompts
taking turns), greedy rows launch the next step ahead, and a failed step ends only what it must."""

from __future__ import annotations

import io
import json
from collections import deque

import attrs
import cattrs
import pytest
from strata_engine.completion import Phase
from strata_engine.errors import ContextOverflow
from strata_engine.jobs import CompleteJob, Jobs
from strata_engine.protocol import Flight, LineWriter, Request
from strata_engine.scheduler import MIN_CUT_CHUNK, ChunkBudget, Scheduler, chunk_tokens

FULL_CHUNK = 64


@attrs.frozen
class Best:
    """An argmax row's result (`sampling.Argmax`'s shape)."""

    token: int
    logit: float = 1.0


@attrs.frozen
class Result:
    tokens: tuple[int, ...]


class FakeGeneration:
    """A prompt of `prompt` tokens read a chunk at a time, then `n_predict` tokens, each the last one + 1."""

    def __init__(self, prompt: int, n_predict: int, chunk_size, argmax_only: bool = True):
        self.left, self.n_predict, self.chunk_size = prompt, n_predict, chunk_size
        self.argmax_only = argmax_only
        self.phase, self.pending, self.result = Phase.PREFILL, None, None
        self.chunks: list[int] = []
        self.tokens: list[int] = []

    def prefill_chunk(self) -> bool:
        n = min(self.left, self.chunk_size())
        self.chunks.append(n)
        self.left -= n
        return False if self.left else self.accept(Best(100))

    def ends_at(self, best: Best) -> bool:
        return len(self.tokens) + 1 >= self.n_predict

    def accept(self, best: Best) -> bool:
        self.tokens.append(best.token)
        if len(self.tokens) >= self.n_predict:
            self.phase, self.pending, self.result = Phase.DONE, None, Result(tuple(self.tokens))
            return True
        self.phase, self.pending = Phase.DECODE, best.token
        return False


class FakeRunner:
    def __init__(self):
        self.erased = 0

    def erase(self) -> int:
        self.erased += 1
        return 0


class FakeCompleter:
    def __init__(self):
        self.runner = FakeRunner()


class Launched:
    def __init__(self, slots: FakeSlots, steps):
        self.slots, self.steps = slots, steps

    def collect(self, keep):
        self.slots.collected.append(list(keep))
        kept = [step for step, k in zip(self.steps, keep, strict=True) if k]
        rows = iter(self.slots.decode_rows(kept, [True] * len(kept)) if kept else [])
        return [next(rows) if k else None for k in keep]


class FakeSlots:
    """Each row's next token is its token + 1; `fail` raises instead (once)."""

    def __init__(self):
        self.decoded: list[list[tuple[int, int]]] = []
        self.launched: list[list[tuple[int, int]]] = []
        self.collected: list[list[bool]] = []
        self.fail: Exception | None = None

    def decode_rows(self, steps, argmax_only):
        if self.fail is not None:
            exc, self.fail = self.fail, None
            raise exc
        self.decoded.append(list(steps))
        return [Best(token + 1) for _, token in steps]

    def launch(self, steps):
        self.launched.append(list(steps))
        return Launched(self, steps)


class Harness:
    def __init__(self):
        self.out = io.BytesIO()
        self.writer = LineWriter(self.out)
        self.budget = ChunkBudget(FULL_CHUNK)
        self.jobs = Jobs(Flight(), cattrs.Converter().unstructure, submit=None, chunk_size=self.budget)
        self.slots = FakeSlots()
        self.policy = Scheduler(self.slots, self.jobs, self.budget, self.writer.held)

    def admit(
        self, rid: str, slot: int, prompt: int, n_predict: int, argmax_only: bool = True
    ) -> CompleteJob:
        """A COMPLETE past its preparation: its slot busy, its prompt waiting for its chunks."""
        job = CompleteJob(
            Request("COMPLETE", {}, rid, slot, self.writer),
            slot,
            FakeCompleter(),
            prepare=None,
            generation=FakeGeneration(prompt, n_predict, self.budget, argmax_only),
        )
        self.jobs.flight.busy[slot] = job
        self.jobs.chunks.append(job)
        return job

    def run(self, max_steps: int = 200) -> None:
        while self.policy.stepping() and self.policy.steps < max_steps:
            self.policy.step()

    def lines(self) -> list[dict]:
        return [json.loads(line) for line in self.out.getvalue().splitlines()]

    def terminal(self, rid: str) -> dict:
        return next(
            line for line in self.lines() if line.get("id") == rid and line["event"] in ("result", "error")
        )


def test_the_cut_chunk():
    assert chunk_tokens(FULL_CHUNK, generating=False) == FULL_CHUNK
    assert chunk_tokens(FULL_CHUNK, generating=True) == FULL_CHUNK // 4
    assert chunk_tokens(32, generating=True) == MIN_CUT_CHUNK  # never below MIN_CUT_CHUNK ...
    assert chunk_tokens(8, generating=True) == 8  # ... nor above the full chunk


def test_every_generating_slot_decodes_in_one_batch_and_a_prompt_takes_one_cut_chunk_per_step():
    h = Harness()
    a, b = h.admit("a", 0, prompt=10, n_predict=12), h.admit("b", 1, prompt=10, n_predict=12)
    h.policy.step(ahead=False)
    h.policy.step(ahead=False)  # each prompt took one full chunk, in turn
    assert (a.generation.chunks, b.generation.chunks) == ([10], [10])
    long = h.admit("long", 2, prompt=5 * FULL_CHUNK, n_predict=2)
    for _ in range(4):
        h.policy.step(ahead=False)
    # "a" decodes from the second step on, "b" joins it at the third: both in one batch from there
    assert h.slots.decoded == [
        [(0, 100)],
        [(0, 101), (1, 100)],
        [(0, 102), (1, 101)],
        [(0, 103), (1, 102)],
        [(0, 104), (1, 103)],
    ]
    assert long.generation.chunks == [FULL_CHUNK // 4] * 4  # one chunk per step, cut while slots generate
    h.run()
    assert long.generation.chunks[-1] <= FULL_CHUNK and sum(long.generation.chunks) == 5 * FULL_CHUNK
    for rid, n in (("a", 12), ("b", 12), ("long", 2)):
        result = h.terminal(rid)
        assert result["event"] == "result" and len(result["tokens"]) == n
    assert h.jobs.flight.busy == {} and h.jobs.flight.forward_passes == len(h.slots.decoded) + 2 + len(
        long.generation.chunks
    )


def test_prompts_take_turns_a_chunk_each():
    h = Harness()
    jobs = [h.admit(rid, slot, prompt=3 * FULL_CHUNK, n_predict=1) for slot, rid in enumerate("xyz")]
    for _ in range(6):
        h.policy.step()
    assert [len(job.generation.chunks) for job in jobs] == [2, 2, 2]
    h.run()
    assert [job.generation.chunks for job in jobs] == [[FULL_CHUNK] * 3] * 3


def test_greedy_rows_launch_the_next_step_ahead_and_a_row_known_to_end_is_left_out():
    h = Harness()
    short, longer = h.admit("s", 0, prompt=4, n_predict=3), h.admit("l", 1, prompt=4, n_predict=6)
    h.run()
    assert h.terminal("s")["tokens"] == [100, 101, 102] and h.terminal("l")["tokens"] == [
        100,
        101,
        102,
        103,
        104,
        105,
    ]
    # "s"'s 3rd token is known to end it: the first step launched (with both decoding) leaves its row out
    assert h.slots.launched[0] == [(1, 101)]
    assert all(0 not in [slot for slot, _ in rows] for rows in h.slots.launched)
    assert len(h.slots.launched) == 4  # then every step of "l" but its last, whose token ends it
    assert all(all(keep) for keep in h.slots.collected)  # no launched row had to be dropped
    assert short.generation.tokens == [100, 101, 102] and len(longer.generation.tokens) == 6


def test_no_launch_ahead_for_a_row_that_reads_its_logits_or_while_a_chunk_waits():
    h = Harness()
    h.admit("g", 0, prompt=4, n_predict=5)
    h.admit("t", 1, prompt=4, n_predict=5, argmax_only=False)  # it samples from its logits
    h.run()
    assert h.slots.launched == [] and h.terminal("t")["event"] == "result"
    h = Harness()
    h.admit("g", 0, prompt=4, n_predict=4)
    h.policy.step()
    h.admit("p", 1, prompt=4 * FULL_CHUNK, n_predict=1)
    h.policy.step()
    assert h.slots.launched == []  # a prompt's chunk is waiting: the step is not launched ahead


def test_a_step_refused_for_one_slot_ends_that_request_only():
    h = Harness()
    h.admit("a", 0, prompt=4, n_predict=5)
    h.admit("b", 1, prompt=4, n_predict=5)
    h.policy.step()
    h.policy.step()
    h.slots.fail = ContextOverflow(9, 8, slot=1)
    h.run()
    assert h.terminal("b")["error"]["type"] == "exceed_context_size"
    assert h.terminal("a")["event"] == "result" and len(h.terminal("a")["tokens"]) == 5


def test_a_failed_step_erases_the_slots_it_was_evaluating():
    h = Harness()
    a, b = h.admit("a", 0, prompt=4, n_predict=5), h.admit("b", 1, prompt=4, n_predict=5)
    h.policy.step()
    h.policy.step()
    h.slots.fail = RuntimeError("device lost")
    h.policy.step()
    for rid, job in (("a", a), ("b", b)):
        error = h.terminal(rid)["error"]
        assert error["type"] == "internal" and "was erased" in error["message"]
        assert job.completer.runner.erased == 1
    assert not h.policy.stepping() and h.jobs.flight.busy == {}


@pytest.mark.parametrize("ahead", [True, False])
def test_a_step_with_nothing_to_do_is_no_step(ahead):
    h = Harness()
    h.policy.step(ahead)
    assert h.policy.steps == 0 and h.slots.decoded == [] and deque() == h.jobs.chunks
