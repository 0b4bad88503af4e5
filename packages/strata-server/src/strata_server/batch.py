"""The tasks of one completion request -- several prompts, ``n`` choices each -- run one after another on
one slot, and answered as llama-server answers them.

llama-server makes one task per prompt and ``n_cmpl - 1`` child tasks per prompt (``n`` is its alias),
numbered in that order (prompt ``i``'s choice ``j`` is task ``i * n + j``); each child's sampler seed is
the request's plus ``j`` (a random seed stays random). Strata runs a request's tasks in turn on one slot,
under one lease (llama-server spreads them over its slots); a later choice reuses the prompt the one
before left in the slot (prompt cache).

The answer (``tools/server/server-context.cpp``, ``handle_completions_impl``): one task answers as
before. Several answer, on ``/completion``, a JSON list of the native objects, each with its ``index``;
on the OpenAI endpoints, the first task's object with every task's choice in ``choices`` (each with its
``index``; ``usage`` and ``timings`` are the first task's). Streamed, each task's chunks carry its index,
and the OpenAI endpoints end with one ``data: [DONE]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import falcon

from .connection import ClientConnection
from .context import ServerContext
from .engine.client import EngineLease, engine_call
from .errors import ApiError, ErrorType, invalid_request
from .generation import CompletionRun, NativeCompletionFormat, ResponseFormat, RunInfo, sse_frame

# Tasks (prompts x choices) one request may queue: they run one after another on the slot. llama-server
# refuses n above its slot count (-np, 4 by default) and does not bound the prompts.
MAX_TASKS = 128
SEED_RANDOM = -1


def choice_count(body: dict) -> int:
    """The request's ``n_cmpl`` (or its alias ``n``); as llama-server, anything below 1 is one."""
    for key in ("n_cmpl", "n"):
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid_request(f"'{key}' must be an integer")
        return max(value, 1)
    return 1


def check_task_count(n_prompts: int, n_choices: int) -> None:
    if n_prompts * n_choices > MAX_TASKS:
        raise invalid_request(
            f"{n_prompts} prompt(s) x n={n_choices} is {n_prompts * n_choices} completions; "
            f"this server runs at most {MAX_TASKS} per request"
        )


def choice_seed(seed: int, choice: int) -> int:
    """Choice ``choice``'s sampler seed: the request's plus ``choice`` (llama-server's child tasks); a random
    seed (-1) stays random, each choice then drawing on from where the previous one left the generator."""
    return seed if seed == SEED_RANDOM else (seed + choice) % 2**64


def with_index(chunk: dict, index: int) -> dict:
    """A chunk or answer of task ``index``: the native shape's ``index``, every OpenAI choice's ``index``."""
    if "index" in chunk:
        chunk["index"] = index
    for choice in chunk.get("choices") or ():
        choice["index"] = index
    return chunk


class IndexedFormat(ResponseFormat):
    """A ``ResponseFormat`` whose chunks and answers are those of task ``index``."""

    def __init__(self, inner: ResponseFormat, index: int) -> None:
        self.inner = inner  # first: the base class sets n_predicted, which is the inner format's
        super().__init__(inner.info)
        self.index = index
        self.sends_done = inner.sends_done

    @property
    def n_predicted(self) -> int:
        return self.inner.n_predicted

    @n_predicted.setter
    def n_predicted(self, value: int) -> None:
        self.inner.n_predicted = value

    def start_chunks(self) -> list[dict]:
        return [with_index(chunk, self.index) for chunk in self.inner.start_chunks()]

    def carries_ids(self) -> bool:
        return self.inner.carries_ids()

    def progress_chunk(self, progress: dict) -> dict:
        return with_index(self.inner.progress_chunk(progress), self.index)

    def token_chunk(self, content: str, ids: list[int], probs: list[dict]) -> dict:
        return with_index(self.inner.token_chunk(content, ids, probs), self.index)

    def final_chunks(self, result: dict, lease: EngineLease) -> list[dict]:
        return [with_index(chunk, self.index) for chunk in self.inner.final_chunks(result, lease)]

    def response(self, result: dict, probs: list[dict], lease: EngineLease) -> dict:
        return with_index(self.inner.response(result, probs, lease), self.index)


def merge_answers(answers: list[dict], native: bool) -> Any:
    """The request's answer from its tasks' (in task order), as llama-server merges them."""
    if len(answers) == 1:
        return answers[0]
    if native:
        return answers
    merged = answers[0]
    merged["choices"] = [choice for answer in answers for choice in answer["choices"]]
    return merged


@attrs.frozen
class TaskSpec:
    """One prompt of a request: its engine command, and makers of its response formats (each choice gets
    its own: a format counts its task's tokens and shows its settings)."""

    command: dict
    make_format: Callable[[RunInfo], ResponseFormat]
    make_verbose: Callable[[RunInfo], NativeCompletionFormat] | None = (
        None  # the peer's __verbose, when asked
    )


def build_runs(
    ctx: ServerContext, info: RunInfo, client: ClientConnection, specs: Sequence[TaskSpec], n_choices: int
) -> list[CompletionRun]:
    """Prompt ``i``'s choice ``j`` as task ``i * n_choices + j``: seeded per choice (its settings show its
    seed, as the peer's child tasks do), its chunks and answer indexed; one completion id for all."""
    runs: list[CompletionRun] = []
    for spec in specs:
        for choice in range(n_choices):
            index = len(runs)
            seed = choice_seed(int(spec.command.get("seed", SEED_RANDOM)), choice)
            options = info.options
            if "seed" in options.sampling:
                options = attrs.evolve(options, sampling={**options.sampling, "seed": seed})
            own = attrs.evolve(info, options=options)
            verbose = None if spec.make_verbose is None else IndexedFormat(spec.make_verbose(own), index)
            runs.append(
                CompletionRun(
                    ctx,
                    {**spec.command, "seed": seed},
                    options,
                    IndexedFormat(spec.make_format(own), index),
                    client=client,
                    verbose=verbose,
                )
            )
    return runs


class BatchRun:
    """A request's tasks under one lease on one slot, answered as one JSON body or one SSE stream."""

    def __init__(self, ctx: ServerContext, runs: list[CompletionRun], client: ClientConnection) -> None:
        assert runs, "a request has at least one task"
        self.ctx = ctx
        self.runs = runs
        self.client = client
        self.stream = runs[0].options.stream
        self.native = isinstance(_inner(runs[0].fmt), NativeCompletionFormat)

    def _acquire(self) -> EngineLease:
        """A slot: the one the request names, else the one whose held tokens share most of the prompt
        (SlotManager's rule). The prompt is tokenized first, once, slot-less: a prompt longer than the
        context is refused before it waits for a slot (the engine checks it as COMPLETE would)."""
        id_slot = self.runs[0].options.id_slot
        # Tokenized with a named slot too: what that slot then holds is known to later requests' choice.
        prompt = self._tokenize_first_prompt()
        return self.ctx.engine.acquire(self.ctx.config.slot_wait, id_slot=id_slot, prompt=prompt)

    def _tokenize_first_prompt(self) -> list[int]:
        """The first prompt's tokens (PROMPT_TOKENS, slot-less), sent as its runs' prompt from here on:
        the engine evaluates them exactly as the original prompt (spec/engine-protocol.md)."""
        first = self.runs[0].command
        tokens = [int(t) for t in engine_call(self.ctx.engine, "PROMPT_TOKENS", first)["tokens"]]
        text_keys = ("messages", "prompt")
        same = {k: first.get(k) for k in text_keys}
        for run in self.runs:
            if {k: run.command.get(k) for k in text_keys} == same:
                run.command = {
                    **{k: v for k, v in run.command.items() if k not in text_keys},
                    "prompt": tokens,
                }
                run.prompt = tokens
        return tokens

    def respond(self, resp: falcon.Response) -> None:
        lease = self._acquire()
        try:
            self._check_client()
            if not self.stream:
                answers = []
                for run in self.runs:
                    self._check_client()  # a client gone between tasks: the rest never run
                    answers.append(run.collect(run.start(lease), lease))
                self._release(lease)
                resp.media = merge_answers(answers, self.native)
                return
            # The first line decides between a JSON error (e.g. context exceeded) and a stream. A long
            # prompt yields an idle event first: then the stream starts and pings meanwhile.
            events = self.runs[0].start(lease)
            first = next(events)
        except BaseException:
            lease.release()
            raise
        resp.content_type = "text/event-stream"
        resp.set_header("Cache-Control", "no-cache")
        resp.set_header("X-Accel-Buffering", "no")
        resp.stream = self._stream(lease, events, first)

    def _check_client(self) -> None:
        if self.client.gone():  # it left while waiting for the slot: nothing to run for
            raise ApiError(ErrorType.INVALID_REQUEST, "the client closed the connection", status=499)

    def _stream(self, lease: EngineLease, events: Iterator[dict], first: dict) -> Iterator[bytes]:
        try:
            if not (yield from self.runs[0].task_frames(lease, events, first)):
                return  # an error frame ended the stream, as the peer's
            for run in self.runs[1:]:
                if not (yield from run.task_frames(lease, run.start(lease))):
                    return
            if self.runs[0].fmt.sends_done:
                yield sse_frame("[DONE]")
        finally:
            self._release(lease)

    def _release(self, lease: EngineLease) -> None:
        """The lease given back, then the slot handed to the store's write-behind (its part of the path)."""
        lease.release()
        if self.ctx.store is not None and lease.slot is not None:
            self.ctx.store.turn_done(lease.slot)


def _inner(fmt: ResponseFormat) -> ResponseFormat:
    return fmt.inner if isinstance(fmt, IndexedFormat) else fmt
