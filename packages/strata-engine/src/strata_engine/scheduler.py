"""The step policy of the serve loop (spec/engine-protocol.md, "Scheduling").

A step is one batched decode forward for every slot that is generating (`decode_rows`, a row per slot) and
at most one prefill chunk of one job being evaluated (prompts and embeddings take turns, round-robin), so a
long prompt delays the others' next token by at most one chunk, cut to a quarter while slots generate
(`chunk_tokens`). A step of greedy rows launches the next one before its tokens are accepted
(`Scheduler._launch_ahead`): on the GPU the device computes while the loop writes the lines. The loop
(loop.py) takes a step between two looks at its lines; the jobs (jobs.py) are what the steps advance.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import attrs

from .completion import Generation
from .errors import ContextOverflow, InvalidToken
from .jobs import CompleteJob, Jobs

log = logging.getLogger(__name__)

# While slots generate, a prefill chunk (a prompt's or an EMBED's) is cut to this share of the full chunk
# (`--prefill-chunk`), and never below MIN_CUT_CHUNK tokens. A chunk costs a fixed part (on the 2-core CPU
# with SmolLM2, about 7 decode steps: bench/engine/DECISIONS.md) plus its tokens', so cutting it to a few decode
# steps' worth would cost the prompt most of its speed: a quarter keeps about 3/4 of the full chunk's rate
# per token and bounds the others' inter-token latency by about a quarter of a full chunk's time.
CUT_CHUNK_SHARE = 4  # the full chunk // 4
MIN_CUT_CHUNK = 16


def chunk_tokens(full: int, generating: bool) -> int:
    """The tokens of the next prefill chunk: the full chunk, or while slots generate the cut one."""
    return max(full // CUT_CHUNK_SHARE, min(MIN_CUT_CHUNK, full)) if generating else full


def _generating(job: CompleteJob) -> Generation:
    """A decoding job's generation (`Jobs.decoding` gives only jobs that have one)."""
    assert job.generation is not None
    return job.generation


def _row(job: CompleteJob) -> tuple[int, int]:
    """A decoding job's row of a step: its slot and the token it evaluates."""
    pending = _generating(job).pending
    assert pending is not None  # set whenever a generation is in its decode phase
    return job.slot, pending


@attrs.define
class ChunkBudget:
    """The next prefill chunk's tokens, asked by a runner just before it evaluates the chunk."""

    full: int
    generating: bool = False  # slots generate in this step: its chunk is cut

    def __call__(self) -> int:
        return chunk_tokens(self.full, self.generating)


class Launched(Protocol):
    def collect(self, keep: Sequence[bool]) -> list[Any]: ...


class Slots(Protocol):
    """What the steps need of the slot set (`slots.SlotSet`)."""

    def decode_rows(self, steps: Sequence[tuple[int, int]], argmax_only: Sequence[bool]) -> list[Any]: ...

    def launch(self, steps: Sequence[tuple[int, int]]) -> Launched: ...


@attrs.define(eq=False)
class Ahead:
    """A decode step launched before the previous step's tokens were accepted: its jobs, a row each."""

    jobs: list[CompleteJob]
    step: Launched


class Scheduler:
    """The steps over `slots` of the `jobs` in flight; `held_lines()` keeps the lines written meanwhile for one
    write (`protocol.LineWriter.held`)."""

    def __init__(
        self,
        slots: Slots,
        jobs: Jobs,
        budget: ChunkBudget,
        held_lines: Callable[[], AbstractContextManager[None]],
    ):
        self.slots = slots
        self.jobs = jobs
        self.budget = budget
        self.held_lines = held_lines
        self.steps = 0  # steps taken (tests count them)
        # the next decode step, launched on the device before this step's tokens were accepted (`_launch_ahead`)
        self.ahead: Ahead | None = None

    def stepping(self) -> bool:
        return bool(self.jobs.chunks) or self.ahead is not None or any(self.jobs.decoding())

    def step(self, ahead: bool = True) -> None:
        """One step: the decode of every generating slot (collecting the one launched ahead, if any; launching
        the next where `ahead` allows: `_launch_ahead`), then at most one prefill chunk."""
        decoding = self.jobs.decoding()
        if not decoding and not self.jobs.chunks:
            if self.ahead is not None:  # every row's conversation ended meanwhile: the step is dropped
                self._decode([], ahead=False)
            return
        self.steps += 1
        self.jobs.count_step()
        self.budget.generating = bool(decoding)
        if decoding:
            self._decode(decoding, ahead)
        if self.jobs.chunks:
            self.jobs.chunk(self.jobs.chunks.popleft())

    def _decode(self, jobs: list[CompleteJob], ahead: bool = True) -> None:
        if self.ahead is not None:
            launched, self.ahead = self.ahead, None
            # a generating job left out of it (none should be) gets the next step, unlaunched
            ahead = ahead and all(job in launched.jobs for job in jobs)
            jobs = [job for job in launched.jobs if job in jobs]
            outputs = self._collect_ahead(launched, jobs)
            if outputs is None or not jobs:
                return
        else:
            steps = [_row(job) for job in jobs]
            try:  # a greedy row that reads nothing but the argmax gets it from the device, not its logits
                outputs = self.slots.decode_rows(steps, [_generating(job).argmax_only for job in jobs])
            except (ContextOverflow, InvalidToken) as exc:  # nothing was evaluated; that slot's request ends
                bad = next((job for job in jobs if job.slot == exc.slot), None)
                if bad is None:
                    raise
                self.jobs.end(bad, exc)
                return
            except Exception as exc:
                self._failed_step(jobs, exc)
                return
        self.jobs.flight.forward_passes += 1
        if ahead:
            self._launch_ahead(jobs, outputs)
        with self.held_lines():  # the step's token (and terminal) lines in one write
            for row, job in enumerate(jobs):
                self.jobs.accept(job, outputs[row])

    def _failed_step(self, jobs: list[CompleteJob], exc: Exception) -> None:
        self.jobs.flight.forward_passes += 1  # past the checks: the forward pass ran, or failed while running
        # the batch's slots were cut back, but this failure is not understood: drop their conversations
        log.error("a decode step failed; erasing slots %s", [job.slot for job in jobs], exc_info=exc)
        for job in jobs:
            self.jobs.fail_erased(job, exc)

    def _launch_ahead(self, jobs: list[CompleteJob], outputs: list[Any]) -> None:
        """Launch the next decode step before this one's tokens are accepted (the device computes while the
        loop writes the lines): only for greedy rows decided on the device, no chunk waiting, and only rows
        whose token does not end their generation for a reason known now (`Generation.ends_at`); a row
        whose conversation ends anyway (a stop word) is dropped when the step is collected. Where steps run
        synchronously (the numpy backend) the launch defers the step to its collection."""
        if self.jobs.chunks or not jobs or not all(_generating(job).argmax_only for job in jobs):
            return
        going = [
            (job, best) for job, best in zip(jobs, outputs, strict=True) if not _generating(job).ends_at(best)
        ]
        if not going:
            return
        try:
            step = self.slots.launch([(job.slot, best.token) for job, best in going])
        except Exception as exc:  # noqa: BLE001 - the next step runs as before and meets it there
            log.warning("launching a decode step ahead failed (%s: %s); the next step runs unlaunched",
                        type(exc).__name__, exc)  # fmt: skip
            return
        self.ahead = Ahead([job for job, _ in going], step)

    def _collect_ahead(self, launched: Ahead, jobs: list[CompleteJob]) -> list[Any] | None:
        """The launched step's results for the rows of `jobs` (those of its jobs still decoding, in its row
        order); the other rows are dropped. None if the step failed (`jobs` ended, as a failed step's are)."""
        try:
            results = launched.step.collect([job in jobs for job in launched.jobs])
        except Exception as exc:
            self._failed_step(jobs, exc)
            return None
        return [r for r in results if r is not None]
