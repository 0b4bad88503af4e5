"""The serve loop's jobs: the COMPLETEs and EMBEDs in flight, from their start to their terminal line.

A JOB verb's handler returns its job (`CompleteJob`, `ChunkJob`); `Jobs.start` takes it in. A COMPLETE's
slot is busy from then on: it is prepared on the preparer thread (`submit`), then admitted to the steps
with a `Generation`; an EMBED's chunks take turns with the prompts being evaluated (`chunks`). The step
policy (scheduler.py) advances them through `chunk`, `accept` and `end`; every terminal line is written
here (`end`), with the forward passes run so far (`Flight.forward_passes`, llama-server's n_decode_total).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Generator, Mapping
from concurrent.futures import Future
from typing import Any

import attrs

from .completion import CompletionResult, Generation, Phase, PromptProgress, TokenEvent
from .errors import EngineError
from .protocol import PROMPT_PROGRESS_PHASE, ErrorKind, Flight, ProtocolError, Reason, Request

log = logging.getLogger(__name__)


def token_line(event: TokenEvent, unstructure: Callable[[Any], Any]) -> dict[str, Any]:
    line: dict[str, Any] = {
        "event": "token",
        "token": event.id,
        "piece": event.piece,
        "content": event.content,
    }
    if event.chosen is not None:
        line |= {
            "logprob": event.chosen.logprob,
            "prob": event.chosen.prob,
            "bytes": list(event.chosen.bytes),
        }
    if event.probs is not None:
        line["probs"] = [unstructure(p) for p in event.probs]
    return line


def result_payload(result: CompletionResult, unstructure: Callable[[Any], Any]) -> dict[str, Any]:
    payload = unstructure(result)
    payload["tokens"] = list(result.tokens)
    return payload


@attrs.define(eq=False)
class CompleteJob:
    """A COMPLETE in its slot: being prepared (generation None), then its generation's phases."""

    request: Request
    slot: int
    completer: Any  # completion.Completer of the slot
    prepare: Callable[[], Any]  # -> completion.Prepared, on the preparer thread (it touches no slot)
    generation: Generation | None = None
    cancel: bool = False  # a CANCEL arrived: the next sampled token is the last
    # the steps taken while it was processing (admitted), and its share of them: the sum over those steps of
    # 1 / the slots processing in each (summed over requests: the steps, llama-server's n_decode_total)
    n_steps: int = 0
    step_share: float = 0.0


# (chunk_size, on_chunk(tokens)) -> the generator whose each next() evaluates one chunk; its return value
# goes to the job's `finish`
ChunkSteps = Callable[[Callable[[], int], Callable[[int], None]], Generator[None, None, Any]]


@attrs.define(eq=False)
class ChunkJob:
    """Slot-less chunked work (EMBED) of `n_tokens`: `make_steps` gives its chunks' generator, `finish` turns
    the generator's return value into the result payload."""

    request: Request
    make_steps: ChunkSteps
    finish: Callable[[Any], Mapping[str, Any]]
    n_tokens: int  # in all
    steps: Generator[None, None, Any] | None = None
    done_tokens: int = 0


Submit = Callable[[Callable[[], Any], Callable[[Future], None]], None]


class Jobs:
    """The jobs in flight and their lines. `submit(work, then)` runs work on the preparer thread and then(future)
    in the loop; `chunk_size()` sizes the next prefill chunk (the step policy's `ChunkBudget`)."""

    def __init__(
        self, flight: Flight, unstructure: Callable[[Any], Any], submit: Submit, chunk_size: Callable[[], int]
    ):
        self.flight = flight
        self.unstructure = unstructure
        self.submit = submit
        self.chunk_size = chunk_size
        self.ids: dict[str, CompleteJob | ChunkJob] = {}  # the ids of jobs in flight
        self.chunks: deque[CompleteJob | ChunkJob] = deque()  # jobs with chunks to evaluate, in turn
        self._starts: dict[type, Callable[[Any], None]] = {
            CompleteJob: self._start_complete,
            ChunkJob: self._start_chunks,
        }

    def start(self, job: CompleteJob | ChunkJob) -> None:
        if job.request.id is not None:
            self.ids[job.request.id] = job
        self._starts[type(job)](job)

    def _start_complete(self, job: CompleteJob) -> None:
        """The slot is busy from now; prepared on the preparer thread, then admitted to the steps."""
        self.flight.busy[job.slot] = job
        self.submit(job.prepare, lambda done: self._admit(job, done))

    def _start_chunks(self, job: ChunkJob) -> None:
        def on_chunk(n: int) -> None:
            job.done_tokens += n

        job.steps = job.make_steps(self.chunk_size, on_chunk)
        self.chunks.append(job)

    def _admit(self, job: CompleteJob, done: Future) -> None:
        exc = done.exception()
        if exc is not None:
            if not isinstance(exc, EngineError):
                log.error("unexpected failure preparing a COMPLETE", exc_info=exc)
            self.end(job, exc)
            return
        request = job.request

        def on_progress(progress: PromptProgress) -> None:
            request.emit({"event": "progress", "phase": PROMPT_PROGRESS_PHASE, **self.unstructure(progress)})

        try:
            job.generation = Generation(
                job.completer,
                done.result(),
                on_token=lambda event: request.emit(token_line(event, self.unstructure)),
                on_progress=on_progress,
                cancelled=lambda: job.cancel,
                chunk_size=self.chunk_size,
            )
        except EngineError as exc:  # the runner refused the prompt before touching the slot
            self.end(job, exc)
            return
        if job.cancel:
            job.generation.cancel_prefill()
            self.end(job)
            return
        self.chunks.append(job)

    def cancel(self, target: str) -> None:
        """CANCEL: end the COMPLETE or EMBED with that id (an EMBED or a prompt being read ends now, between
        two chunks; a generation's next token is its last). Anything else is ignored."""
        job = self.ids.get(target)
        if isinstance(job, ChunkJob):
            assert job.steps is not None
            job.steps.close()
            self.chunks.remove(job)
            self.end(
                job,
                ProtocolError(
                    ErrorKind.CANCELLED,
                    f"{job.request.verb} cancelled after {job.done_tokens} of {job.n_tokens} tokens",
                    reason=Reason.CANCELLED.value,
                ),
            )
            return
        if not isinstance(job, CompleteJob) or job.cancel:
            return
        job.cancel = True
        gen = job.generation
        if gen is not None and gen.phase is Phase.PREFILL:
            gen.cancel_prefill()
            self.chunks.remove(job)
            self.end(job)

    def end(
        self,
        job: CompleteJob | ChunkJob,
        error: BaseException | None = None,
        payload: Mapping[str, Any] | None = None,
    ) -> None:
        """Write the job's terminal line and free its slot and id."""
        if isinstance(job, CompleteJob):
            del self.flight.busy[job.slot]
            if error is None:
                assert job.generation is not None and job.generation.result is not None
                payload = {
                    **result_payload(job.generation.result, self.unstructure),
                    "n_steps": job.n_steps,
                    "step_share": job.step_share,
                }
        if job.request.id is not None:
            self.ids.pop(job.request.id, None)
        if error is not None:
            job.request.fail(error, n_forward=self.flight.forward_passes)
        else:
            assert payload is not None
            job.request.answer({**payload, "n_forward": self.flight.forward_passes})

    # ---- what a step does to them ---------------------------------------------------------------------
    def decoding(self) -> list[CompleteJob]:
        return [
            job
            for job in self.flight.busy.values()
            if isinstance(job, CompleteJob)
            and job.generation is not None
            and job.generation.phase is Phase.DECODE
        ]

    def count_step(self) -> None:
        """A step in the counts of the COMPLETEs processing (prompt or generation) in it."""
        processing = [
            job
            for job in self.flight.busy.values()
            if isinstance(job, CompleteJob) and job.generation is not None
        ]
        for job in processing:
            job.n_steps += 1
            job.step_share += 1.0 / len(processing)

    def accept(self, job: CompleteJob, output: Any) -> None:
        """A decode row's logits (or Argmax) for the job's generation; its terminal line once it ends."""
        gen = job.generation
        assert gen is not None
        try:
            finished = gen.accept(output)
        except Exception as exc:
            log.exception("sampling failed in slot %d", job.slot)
            self.end(job, exc)
            return
        if finished:
            self.end(job)

    def chunk(self, job: CompleteJob | ChunkJob) -> None:
        """Evaluate the job's next chunk; it takes its turn again while it has more."""
        if isinstance(job, ChunkJob):
            assert job.steps is not None
            self.flight.forward_passes += (
                1  # each next() evaluates one chunk (its checks ran before its start)
            )
            try:
                next(job.steps)
                self.chunks.append(job)
            except StopIteration as end:
                self.end(job, payload=job.finish(end.value))
            except Exception as exc:
                if not isinstance(exc, EngineError):
                    log.exception("unexpected failure in %s", job.request.verb)
                self.end(job, exc)
            return
        gen = job.generation
        assert gen is not None
        try:
            finished = gen.prefill_chunk()
        except EngineError as exc:  # raised before anything was evaluated: the slot is intact
            self.end(job, exc)
            return
        except Exception as exc:
            self.flight.forward_passes += 1
            log.exception("a prefill chunk failed in slot %d", job.slot)
            self.fail_erased(job, exc)
            return
        self.flight.forward_passes += 1  # before end: its terminal line counts this chunk
        if finished:
            self.end(job)
        elif gen.phase is Phase.PREFILL:
            self.chunks.append(job)

    def fail_erased(self, job: CompleteJob, exc: Exception) -> None:
        """An unexpected failure while the slot was being evaluated: its K/V may be half-written, so the
        slot is erased and the error says so."""
        dropped = job.completer.runner.erase()
        log.error("slot %d erased after an unexpected failure (%d tokens dropped)", job.slot, dropped)
        self.end(
            job,
            ProtocolError(
                ErrorKind.INTERNAL,
                f"{type(exc).__name__}: {exc} (slot {job.slot} was erased: its K/V may be half-written)",
                reason=Reason.UNEXPECTED.value,
            ),
        )
