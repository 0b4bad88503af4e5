"""The serve loop (spec/engine-protocol.md, "Scheduling"): lines in, verbs dispatched, steps taken, lines out.

Command lines are read and parsed (UTF-8, JSON, verb, id, slot) on a reader thread (`ParsedLines`), so a
huge line (a 50 MB prompt) is read beside the steps. Between two steps the loop takes every line parsed so
far (never waiting for input while it has work): a `NOW` verb runs there, a `WORKER` verb (and the
preparation of a COMPLETE: checks, template, tokenizer, constraint) runs on a worker thread and is answered
at a later boundary, a `JOB` verb's handler gives a job (jobs.py) that the steps advance (scheduler.py), a
`SESSION` verb runs on the session thread and takes the pool between two steps through its `Gate`. A
handler's answer may also be an order to the loop (`Cancel`, `Quit`). Only this thread touches the
runners and writes lines; a wake pipe brings it back from `select` when a line or a task's end arrives.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import threading
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs

from .errors import EngineError
from .jobs import Jobs
from .protocol import (
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
from .scheduler import ChunkBudget, Scheduler

log = logging.getLogger(__name__)


@attrs.frozen
class Cancel:
    """CANCEL's order: end the job with that id (`Jobs.cancel`)."""

    target: str


@attrs.frozen
class Quit:
    """QUIT's order: read no more lines; answer it and exit once every request in flight has ended."""

    request: Request


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


class ServeLoop:
    def __init__(
        self,
        ctx: ServeContext,
        registry: CommandRegistry,
        reader: LineReader,
        writer: LineWriter,
        unstructure: Callable[[Any], Any],
    ):
        self.ctx = ctx
        self.registry = registry
        self.writer = writer
        self.busy = ctx.flight.busy  # slot -> its COMPLETE or session verb
        self.pending: list[tuple[Future, Callable[[Future], None]]] = []  # worker tasks
        # the WORKER verbs' thread, and one for COMPLETE's preparation (bounded by the slot's context), so a
        # huge TOKENIZE delays no completion's admission
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="strata-worker")
        self.preparer = ThreadPoolExecutor(1, thread_name_prefix="strata-prepare")
        self.sessions: list[SessionJob] = []
        self.session_worker = ThreadPoolExecutor(1, thread_name_prefix="strata-session")
        # where the pool's copies run beside the steps, a session verb takes the pool from its start
        self.gate_whole = ctx.slots.model.ops.copies_beside_steps
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._wake_lock = threading.Lock()  # a task ending after the loop closed the pipe writes nothing
        self._wake_open = True
        self.lines = ParsedLines(
            reader, lambda line: parse_line(line, registry, ctx.n_slots, writer), self._wake
        )
        self.quit: Request | None = None
        self.exit: ExitStatus | None = None
        budget = ChunkBudget(ctx.runner_of(0).settings.prefill_chunk)
        self.jobs = Jobs(
            ctx.flight, unstructure, lambda work, then: self.submit(work, then, self.preparer), budget
        )
        self.scheduler = Scheduler(ctx.slots, self.jobs, budget, writer.held)
        self._orders: dict[type, Callable[[Any], None]] = {
            Cancel: lambda order: self.jobs.cancel(order.target),
            Quit: lambda order: setattr(self, "quit", order.request),
        }

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

    def _must_land(self) -> bool:
        """Whether the loop has more to do than the next step: a step launched ahead is collected (its tokens
        accepted) first, so lines, tasks and session verbs find every slot between two steps."""
        return (self.lines.has_line() or self.lines.eof or bool(self.sessions)
                or any(future.done() for future, _ in self.pending))  # fmt: skip

    def _run(self) -> ExitStatus:
        while True:
            if not self.scheduler.stepping() and self.exit is None:
                if self._closing():
                    if not self.pending and not self.busy:
                        return self._close()
                    select.select([self._wake_r], [], [])  # a worker task ends
                elif not self.lines.has_line():
                    select.select([self._wake_r], [], [])  # a line parsed, the input's end, a task's end
            self._drain_wake()
            if self.scheduler.ahead is not None and self._must_land():
                self.scheduler.step(ahead=False)
            while self.quit is None and self.exit is None and (parsed := self.lines.poll()) is not None:
                self._take(parsed)
            self._collect()
            self._serve_sessions()
            if self.exit is not None:
                return self.exit
            self.scheduler.step()

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

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_open:
                os.write(self._wake_w, b".")

    # ---- commands -----------------------------------------------------------------------------------
    def _take(self, parsed: ParsedLine) -> None:
        request, command = parsed.request, parsed.command
        if parsed.error is not None:
            request.fail(parsed.error)
            return
        assert command is not None  # a line parsed without an error has its command (protocol.parse_line)
        if command.slotted and request.slot in self.busy:
            owner = self.busy[request.slot].request
            request.fail(
                ProtocolError(
                    ErrorKind.SLOT_BUSY,
                    f"slot {request.slot} is busy with a {owner.verb}"
                    + (f" (id {owner.id!r})" if owner.id is not None else ""),
                    reason=Reason.SLOT_BUSY.value,
                )
            )
            return
        if command.dispatch is Dispatch.JOB and request.id is not None and request.id in self.jobs.ids:
            request.fail(
                ProtocolError(
                    ErrorKind.INVALID_REQUEST,
                    f"id {request.id!r} is in flight",
                    reason=Reason.DUPLICATE_ID.value,
                )
            )
            return
        if command.dispatch is Dispatch.WORKER:
            self.submit(lambda: command.handler(self.ctx, request), lambda done: self._answer(request, done))
            return
        if command.dispatch is Dispatch.SESSION:
            self._start_session(command.handler, request)
            return
        try:
            answer = command.handler(self.ctx, request)
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
        if command.dispatch is Dispatch.JOB:
            self.jobs.start(answer)
        elif (order := self._orders.get(type(answer))) is not None:
            order(answer)
        elif answer is not None:
            request.answer(answer)

    def submit(
        self,
        work: Callable[[], Any],
        then: Callable[[Future], None],
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
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

    # ---- the session gate ---------------------------------------------------------------------------
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
            assert job.future is not None  # submitted before the job joined `sessions`
            self._flush(job)
            if job.gate.asked.is_set() and not job.gate.granted.is_set():
                job.gate.granted.set()
                job.gate.released.wait()  # no step until the verb is done with the pool
                job.future.exception()  # wait for the answer too (it follows the release at once)
                self._flush(job)
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
