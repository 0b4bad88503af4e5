"""The serve loop: a scheduler of steps over the engine's slots (spec/engine-protocol.md, "Scheduling").

Command lines are read and parsed (UTF-8, JSON, verb, id, slot) on a reader thread (`ParsedLines`), so a
huge line (a 50 MB prompt) is read beside the steps. Between two steps the loop takes every line parsed so
far (never waiting for input while it has work): a `NOW` verb runs there, a `WORKER` verb (and the
preparation of a COMPLETE: checks, template, tokenizer, constraint) runs on the one worker thread and is
answered at a later boundary, a `JOB` verb starts a job that the steps advance. A step is one batched decode forward for every slot that is
generating (`SlotSet.decode`, a row per slot) and at most one prefill chunk of one job being evaluated
(prompts and embeddings take turns, round-robin), so a long prompt delays the others' next token by at
most one chunk, cut to a quarter while slots generate (`chunk_tokens`). Only this thread touches the
runners and writes lines. A step of greedy rows launches the next one before its tokens are accepted
(`Scheduler._launch_ahead`): on the GPU the device computes while this thread writes the lines.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import threading
from collections import deque
from collections.abc import Callable, Generator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import attrs

from .completion import CompletionResult, Generation, Phase, PromptProgress, TokenEvent, parse_request
from .errors import ContextOverflow, EngineError, InvalidToken
from .protocol import (
    PROMPT_PROGRESS_PHASE,
    CommandRegistry,
    Dispatch,
    ErrorKind,
    ExitStatus,
    FailStop,
    LineReader,
    LineWriter,
    ParsedLine,
    ProtocolError,
    Reason,
    Request,
    ServeContext,
    parse_line,
)

if TYPE_CHECKING:
    from .slots import LaunchedStep

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


def token_line(event: TokenEvent, unstructure: Callable[[Any], Any]) -> dict[str, Any]:
    line: dict[str, Any] = {"event": "token", "token": event.id, "piece": event.piece, "content": event.content}
    if event.chosen is not None:
        line |= {"logprob": event.chosen.logprob, "prob": event.chosen.prob, "bytes": list(event.chosen.bytes)}
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
    generation: Generation | None = None
    cancel: bool = False  # a CANCEL arrived: the next sampled token is the last
    # the steps taken while it was processing (admitted), and its share of them: the sum over those steps of
    # 1 / the slots processing in each (summed over requests: the steps, llama-server's n_decode_total)
    n_steps: int = 0
    step_share: float = 0.0


@attrs.define(eq=False)
class Ahead:
    """A decode step launched before the previous step's tokens were accepted: its jobs, a row each."""

    jobs: list[CompleteJob]
    step: LaunchedStep


class Gate:
    """The pool between two steps, for a session verb running on the session thread: `enter` asks for it and
    waits until the loop hands it over at a step boundary; the loop then takes no step until `release` (the
    verb's end). Validation before `enter` runs beside the steps."""

    def __init__(self, wake: Callable[[], None]):
        self._wake = wake
        self.asked = threading.Event()
        self.granted = threading.Event()
        self.released = threading.Event()

    def enter(self) -> None:
        if self.asked.is_set():
            return
        self.asked.set()
        self._wake()
        self.granted.wait()

    def release(self) -> None:
        self.released.set()


class QueuedLines(LineWriter):
    """A session verb's lines (progress), kept for the loop to write: one thread writes stdout."""

    def __init__(self) -> None:
        self.lines: queue.SimpleQueue[Mapping[str, Any]] = queue.SimpleQueue()

    def write(self, obj: Mapping[str, Any]) -> None:
        self.lines.put(obj)


@attrs.define(eq=False)
class SessionJob:
    """SAVE / RESTORE / RESTORE_PREFIX of a slot on the session thread."""

    request: Request  # the loop's (its lines go to stdout)
    slot: int
    gate: Gate
    lines: QueuedLines
    future: Future | None = None


@attrs.define(eq=False)
class ChunkJob:
    """Slot-less chunked work (EMBED): each next() of `steps` evaluates one chunk (its on_chunk counts
    `done_tokens`); its return value goes to `finish`, which gives the result payload."""

    request: Request
    steps: Generator[None, None, Any] | None
    finish: Callable[[Any], Mapping[str, Any]]
    n_tokens: int  # in all
    done_tokens: int = 0


class ParsedLines:
    """The command lines of `reader`, read and parsed by `parse` on a thread of their own, in arrival order;
    `wake()` after each one and at the end of input. The JSON parser holds the GIL while it parses (about
    0.2 s for a 50 MB string prompt, 1 s for 5M token ids), but reading the line and everything before and
    after go on beside the steps."""

    def __init__(self, reader: LineReader, parse: Callable[[bytes], ParsedLine], wake: Callable[[], None]):
        self._reader = reader
        self._parse = parse
        self._wake = wake
        self._lines: deque[ParsedLine] = deque()
        self.eof = False  # set after the last line was queued
        self._thread = threading.Thread(target=self._run, name="strata-reader", daemon=True)

    def start(self) -> None:
        self._reader.widen_pipe()
        self._thread.start()

    def _run(self) -> None:
        try:
            while (line := self._reader.read_line()) is not None:
                self._lines.append(self._parse(line))
                self._wake()
        except Exception:  # stdin unreadable: the same as its end (requests in flight finish)
            log.exception("reading the command lines failed")
        self.eof = True
        self._wake()

    def has_line(self) -> bool:
        return bool(self._lines)

    def poll(self) -> ParsedLine | None:
        return self._lines.popleft() if self._lines else None


class Scheduler:
    def __init__(self, ctx: ServeContext, registry: CommandRegistry, reader: LineReader, writer: LineWriter,
                 unstructure: Callable[[Any], Any]):
        self.ctx = ctx
        self.registry = registry
        self.writer = writer
        self.unstructure = unstructure
        ctx.scheduler = self
        self.busy: dict[int, CompleteJob | SessionJob] = {}  # slot -> its COMPLETE or session verb
        self.ids: dict[str, CompleteJob | ChunkJob] = {}  # the ids of jobs in flight
        self.chunks: deque[CompleteJob | ChunkJob] = deque()  # jobs with chunks to evaluate, in turn
        self.pending: list[tuple[Future, Callable[[Future], None]]] = []  # worker tasks
        # the WORKER verbs' thread, and one for COMPLETE's preparation (bounded by the slot's context), so a
        # huge TOKENIZE delays no completion's admission
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="strata-worker")
        self.preparer = ThreadPoolExecutor(1, thread_name_prefix="strata-prepare")
        self.sessions: list[SessionJob] = []
        self.session_worker = ThreadPoolExecutor(1, thread_name_prefix="strata-session")
        # off the numpy backend a session verb takes the pool from its start (device copies beside the steps)
        self.gate_whole = ctx.runner_of(0).settings.backend != "numpy"
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._wake_lock = threading.Lock()  # a task ending after the loop closed the pipe writes nothing
        self._wake_open = True
        self.lines = ParsedLines(reader, lambda line: parse_line(line, registry, ctx.n_slots, writer), self._wake)
        self.quit: Request | None = None
        self.exit: ExitStatus | None = None
        self.steps = 0  # steps taken (tests count them)
        # forward passes run (a batched decode, a prompt's or an EMBED's chunk), failed ones included:
        # llama-server's n_decode_total, on the terminal lines of COMPLETE and EMBED and in STATUS
        self.forward_passes = 0
        self.full_chunk = ctx.runner_of(0).settings.prefill_chunk
        self._generating = False  # slots generate in this step: its chunk is cut (`chunk_tokens`)
        # the next decode step, launched on the device before this step's tokens were accepted (`_launch_ahead`)
        self.ahead: Ahead | None = None

    # ---- the loop ---------------------------------------------------------------------------------
    def run(self) -> ExitStatus:
        """Serve until QUIT or end of input (CLEAN, once every request in flight has ended) or a fail-stop."""
        self.lines.start()
        try:
            return self._run()
        except BrokenPipeError:
            log.info("stdout closed by the client: exiting")
            return ExitStatus.CLEAN
        finally:
            self.worker.shutdown(wait=False, cancel_futures=True)
            self.preparer.shutdown(wait=False, cancel_futures=True)
            self.session_worker.shutdown(wait=False, cancel_futures=True)
            with self._wake_lock:
                self._wake_open = False
                os.close(self._wake_r)
                os.close(self._wake_w)

    def _closing(self) -> bool:
        """No line will be taken any more: QUIT was read, or the input ended and every line was taken."""
        return self.quit is not None or (self.lines.eof and not self.lines.has_line())

    def _stepping(self) -> bool:
        return bool(self.chunks) or self.ahead is not None or any(self._decoding())

    def _must_land(self) -> bool:
        """Whether the loop has more to do than the next step: a step launched ahead is collected (its tokens
        accepted) first, so lines, tasks and session verbs find every slot between two steps."""
        return (self.lines.has_line() or self.lines.eof or bool(self.sessions)
                or any(future.done() for future, _ in self.pending))  # fmt: skip

    def _run(self) -> ExitStatus:
        while True:
            if not self._stepping() and self.exit is None:
                if self._closing():
                    if not self.pending and not self.busy:
                        return self._close()
                    select.select([self._wake_r], [], [])  # a worker task ends
                elif not self.lines.has_line():
                    select.select([self._wake_r], [], [])  # a line parsed, the input's end, a task's end
            self._drain_wake()
            if self.ahead is not None and self._must_land():
                self._step(ahead=False)
            while self.quit is None and self.exit is None and (parsed := self.lines.poll()) is not None:
                self._take(parsed)
            self._collect()
            self._serve_sessions()
            if self.exit is not None:
                return self.exit
            self._step()

    def _close(self) -> ExitStatus:
        if self.quit is not None:
            self.quit.answer({})
        return ExitStatus.CLEAN

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    # ---- commands -----------------------------------------------------------------------------------
    def _take(self, parsed: ParsedLine) -> None:
        request, command = parsed.request, parsed.command
        if parsed.error is not None or command is None:
            request.fail(parsed.error)
            return
        if command.slotted and request.slot in self.busy:
            owner = self.busy[request.slot].request
            request.fail(ProtocolError(ErrorKind.SLOT_BUSY, f"slot {request.slot} is busy with a {owner.verb}"
                                       + (f" (id {owner.id!r})" if owner.id is not None else ""),
                                       reason=Reason.SLOT_BUSY.value))
            return
        if command.dispatch is Dispatch.JOB and request.id is not None and request.id in self.ids:
            request.fail(ProtocolError(ErrorKind.INVALID_REQUEST, f"id {request.id!r} is in flight",
                                       reason=Reason.DUPLICATE_ID.value))
            return
        if command.dispatch is Dispatch.WORKER:
            self.submit(lambda: command.handler(self.ctx, request), lambda done: self._answer(request, done))
            return
        if command.dispatch is Dispatch.SESSION:
            self._start_session(command.handler, request)
            return
        try:
            payload = command.handler(self.ctx, request)
        except FailStop as exc:
            request.fail(exc)
            self.exit = ExitStatus.FAIL_STOP
            return
        except BrokenPipeError:
            raise
        except Exception as exc:  # every error becomes an error line; the engine keeps serving
            if not isinstance(exc, EngineError):
                log.exception("unexpected failure in %s", request.verb)
            request.fail(exc)
            return
        if payload is not None:
            request.answer(payload)

    def submit(self, work: Callable[[], Any], then: Callable[[Future], None],
               executor: ThreadPoolExecutor | None = None) -> None:
        """Run `work` on the worker thread (or `executor`); `then(future)` runs in the loop at the first
        boundary after it is done."""
        future = (executor or self.worker).submit(work)
        future.add_done_callback(lambda _: self._wake())
        self.pending.append((future, then))

    def _collect(self) -> None:
        done = [task for task in self.pending if task[0].done()]
        for task in done:
            self.pending.remove(task)
            task[1](task[0])

    def _answer(self, request: Request, done: Future) -> None:
        exc = done.exception()
        if exc is None:
            request.answer(done.result())
            return
        if not isinstance(exc, EngineError):
            log.error("unexpected failure in %s", request.verb, exc_info=exc)
        request.fail(exc)

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_open:
                os.write(self._wake_w, b".")

    def _start_session(self, handler: Callable[[ServeContext, Request], Any], request: Request) -> None:
        """A session verb: its slot busy, run on the session thread; its lines are queued for the loop."""
        assert request.slot is not None
        job = SessionJob(request, request.slot, Gate(self._wake), QueuedLines())
        self.busy[job.slot] = job
        there = attrs.evolve(request, writer=job.lines, gate=job.gate)

        def run() -> Any:
            try:
                if self.gate_whole:
                    job.gate.enter()
                return handler(self.ctx, there)
            finally:
                job.gate.release()

        job.future = self.session_worker.submit(run)
        job.future.add_done_callback(lambda _: self._wake())
        self.sessions.append(job)

    def _serve_sessions(self) -> None:
        """At a step boundary: write the session verbs' queued lines, hand the pool to one that asks (and wait
        for its end), answer those that ended."""
        for job in list(self.sessions):
            self._flush(job)
            if job.gate.asked.is_set() and not job.gate.granted.is_set():
                job.gate.granted.set()
                job.gate.released.wait()  # no step until the verb is done with the pool
                job.future.exception()  # wait for the answer too (it follows the release at once)
                self._flush(job)
            assert job.future is not None
            if not job.future.done():
                continue
            self.sessions.remove(job)
            del self.busy[job.slot]
            self._flush(job)
            exc = job.future.exception()
            if isinstance(exc, FailStop):
                job.request.fail(exc)
                self.exit = ExitStatus.FAIL_STOP
            elif exc is not None:
                if not isinstance(exc, EngineError):
                    log.error("unexpected failure in %s", job.request.verb, exc_info=exc)
                job.request.fail(exc)
            else:
                job.request.answer(job.future.result())

    def _flush(self, job: SessionJob) -> None:
        while True:
            try:
                line = job.lines.lines.get_nowait()
            except queue.Empty:
                return
            self.writer.write(line)  # tagged already

    def request_quit(self, request: Request) -> None:
        """QUIT: read no more lines; answer it and exit once every request in flight has ended."""
        self.quit = request

    # ---- jobs -----------------------------------------------------------------------------------------
    def start_complete(self, request: Request) -> None:
        """COMPLETE: the slot is busy from now; prepared on the worker thread, then admitted to the steps."""
        assert request.slot is not None
        job = CompleteJob(request, request.slot)
        self.busy[job.slot] = job
        if request.id is not None:
            self.ids[request.id] = job
        completer = self.ctx.completer_of(job.slot)
        self.submit(lambda: completer.prepare(parse_request(request.args)), lambda done: self._admit(job, done),
                    self.preparer)

    def _admit(self, job: CompleteJob, done: Future) -> None:
        exc = done.exception()
        if exc is not None:
            if not isinstance(exc, EngineError):
                log.error("unexpected failure preparing a COMPLETE", exc_info=exc)
            self._end(job, exc)
            return
        request = job.request

        def on_progress(progress: PromptProgress) -> None:
            request.emit({"event": "progress", "phase": PROMPT_PROGRESS_PHASE, **self.unstructure(progress)})

        try:
            job.generation = Generation(self.ctx.completer_of(job.slot), done.result(),
                                        on_token=lambda event: request.emit(token_line(event, self.unstructure)),
                                        on_progress=on_progress, cancelled=lambda: job.cancel,
                                        chunk_size=self._chunk_size)
        except EngineError as exc:  # the runner refused the prompt before touching the slot
            self._end(job, exc)
            return
        if job.cancel:
            job.generation.cancel_prefill()
            self._end(job)
            return
        self.chunks.append(job)

    def start_chunks(self, request: Request,
                     steps: Callable[[Callable[[], int], Callable[[int], None]], Generator[None, None, Any]],
                     finish: Callable[[Any], Mapping[str, Any]], n_tokens: int) -> None:
        """Slot-less chunked work (EMBED) of `n_tokens`, taking turns with the prompts being evaluated:
        `steps(chunk_size, on_chunk)` gives its chunks' generator (sized by chunk_size() before each, telling
        on_chunk(tokens))."""
        job = ChunkJob(request, None, finish, n_tokens)

        def on_chunk(n: int) -> None:
            job.done_tokens += n

        job.steps = steps(self._chunk_size, on_chunk)
        if request.id is not None:
            self.ids[request.id] = job
        self.chunks.append(job)

    def cancel(self, target: str) -> None:
        """CANCEL: end the COMPLETE or EMBED with that id (an EMBED or a prompt being read ends now, between
        two chunks; a generation's next token is its last). Anything else is ignored."""
        job = self.ids.get(target)
        if isinstance(job, ChunkJob):
            assert job.steps is not None
            job.steps.close()
            self.chunks.remove(job)
            self._end(job, ProtocolError(ErrorKind.CANCELLED, f"{job.request.verb} cancelled after {job.done_tokens}"
                                         f" of {job.n_tokens} tokens", reason=Reason.CANCELLED.value))
            return
        if not isinstance(job, CompleteJob) or job.cancel:
            return
        job.cancel = True
        gen = job.generation
        if gen is not None and gen.phase is Phase.PREFILL:
            gen.cancel_prefill()
            self.chunks.remove(job)
            self._end(job)

    def _end(self, job: CompleteJob | ChunkJob, error: BaseException | None = None,
             payload: Mapping[str, Any] | None = None) -> None:
        """Write the job's terminal line and free its slot and id."""
        if isinstance(job, CompleteJob):
            del self.busy[job.slot]
            if error is None:
                assert job.generation is not None and job.generation.result is not None
                payload = {**result_payload(job.generation.result, self.unstructure), "n_steps": job.n_steps,
                           "step_share": job.step_share}
        if job.request.id is not None:
            self.ids.pop(job.request.id, None)
        if error is not None:
            job.request.fail(error, n_forward=self.forward_passes)
        else:
            assert payload is not None
            job.request.answer({**payload, "n_forward": self.forward_passes})

    # ---- a step -----------------------------------------------------------------------------------
    def _decoding(self) -> list[CompleteJob]:
        return [job for job in self.busy.values() if isinstance(job, CompleteJob)
                and job.generation is not None and job.generation.phase is Phase.DECODE]

    def _step(self, ahead: bool = True) -> None:
        """One step: the decode of every generating slot (collecting the one launched ahead, if any; launching
        the next where `ahead` allows: `_launch_ahead`), then at most one prefill chunk."""
        decoding = self._decoding()
        if not decoding and not self.chunks:
            if self.ahead is not None:  # every row's conversation ended meanwhile: the step is dropped
                self._decode([], ahead=False)
            return
        self.steps += 1
        self._count_processing()
        self._generating = bool(decoding)
        if decoding:
            self._decode(decoding, ahead)
        if self.chunks:
            self._chunk(self.chunks.popleft())

    def _count_processing(self) -> None:
        """This step in the counts of the COMPLETEs processing (prompt or generation) in it."""
        processing = [job for job in self.busy.values() if isinstance(job, CompleteJob) and job.generation is not None]
        for job in processing:
            job.n_steps += 1
            job.step_share += 1.0 / len(processing)

    def _chunk_size(self) -> int:
        """The next chunk's tokens (asked by the runner just before it evaluates the chunk)."""
        return chunk_tokens(self.full_chunk, self._generating)

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
            steps = [(job.slot, job.generation.pending) for job in jobs]
            try:  # a greedy row that reads nothing but the argmax gets it from the device, not its logits
                outputs = self.ctx.slots.decode_rows(steps, [job.generation.argmax_only for job in jobs])
            except (ContextOverflow, InvalidToken) as exc:  # nothing was evaluated; that slot's request ends
                bad = next((job for job in jobs if job.slot == exc.slot), None)
                if bad is None:
                    raise
                self._end(bad, exc)
                return
            except Exception as exc:
                self._failed_step(jobs, exc)
                return
        self.forward_passes += 1
        if ahead:
            self._launch_ahead(jobs, outputs)
        with self.writer.held():  # the step's token (and terminal) lines in one write
            for row, job in enumerate(jobs):
                gen = job.generation
                assert gen is not None
                try:
                    finished = gen.accept(outputs[row])
                except Exception as exc:
                    log.exception("sampling failed in slot %d", job.slot)
                    self._end(job, exc)
                    continue
                if finished:
                    self._end(job)

    def _failed_step(self, jobs: list[CompleteJob], exc: Exception) -> None:
        self.forward_passes += 1  # past the checks: the forward pass ran, or failed while running
        # the batch's slots were cut back, but this failure is not understood: drop their conversations
        log.error("a decode step failed; erasing slots %s", [job.slot for job in jobs], exc_info=exc)
        for job in jobs:
            self._fail_erased(job, exc)

    def _launch_ahead(self, jobs: list[CompleteJob], outputs: list[Any]) -> None:
        """Launch the next decode step before this one's tokens are accepted (the device computes while this
        thread writes the lines): only for greedy rows decided on the device, no chunk waiting, and only rows
        whose token does not end their generation for a reason known now (`Generation.ends_at`); a row
        whose conversation ends anyway (a stop word) is dropped when the step is collected. Where steps run
        synchronously (the numpy backend) the launch defers the step to its collection."""
        if self.chunks or not jobs or not all(job.generation.argmax_only for job in jobs):
            return
        going = [(job, best) for job, best in zip(jobs, outputs, strict=True) if not job.generation.ends_at(best)]
        if not going:
            return
        try:
            step = self.ctx.slots.launch([(job.slot, best.token) for job, best in going])
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

    def _chunk(self, job: CompleteJob | ChunkJob) -> None:
        if isinstance(job, ChunkJob):
            assert job.steps is not None
            self.forward_passes += 1  # each next() evaluates one chunk (its checks ran before its start)
            try:
                next(job.steps)
                self.chunks.append(job)
            except StopIteration as end:
                self._end(job, payload=job.finish(end.value))
            except Exception as exc:
                if not isinstance(exc, EngineError):
                    log.exception("unexpected failure in %s", job.request.verb)
                self._end(job, exc)
            return
        gen = job.generation
        assert gen is not None
        try:
            finished = gen.prefill_chunk()
        except EngineError as exc:  # raised before anything was evaluated: the slot is intact
            self._end(job, exc)
            return
        except Exception as exc:
            self.forward_passes += 1
            log.exception("a prefill chunk failed in slot %d", job.slot)
            self._fail_erased(job, exc)
            return
        self.forward_passes += 1  # before _end: its terminal line counts this chunk
        if finished:
            self._end(job)
        elif gen.phase is Phase.PREFILL:
            self.chunks.append(job)

    def _fail_erased(self, job: CompleteJob, exc: Exception) -> None:
        """An unexpected failure while the slot was being evaluated: its K/V may be half-written, so the
        slot is erased and the error says so."""
        dropped = self.ctx.runner_of(job.slot).erase()
        log.error("slot %d erased after an unexpected failure (%d tokens dropped)", job.slot, dropped)
        self._end(job, ProtocolError(ErrorKind.INTERNAL, f"{type(exc).__name__}: {exc} (slot {job.slot} was "
                                     f"erased: its K/V may be half-written)", reason=Reason.UNEXPECTED.value))
