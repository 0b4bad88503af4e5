"""Running one ``COMPLETE`` of an HTTP request, and the three ways the peer frames the answer.

``CompletionRun`` sends the command on a lease (``batch.BatchRun`` holds it for the request's tasks) and
either collects the whole answer or streams it as SSE. A ``ResponseFormat`` turns engine lines into the
peer's JSON for one endpoint:
``/completion`` (native, no ``[DONE]``), ``/v1/completions`` and ``/v1/chat/completions`` (OpenAI,
``data: [DONE]`` at the end).
"""

from __future__ import annotations

import abc
import itertools
import json
import secrets
import string
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import attrs

from .connection import POLL_INTERVAL_S, ClientConnection, watch_client
from .context import ServerContext
from .engine.client import IDLE_EVENT, EngineLease
from .errors import EngineCallError, sse_error_frame
from .params import CompletionOptions
from .tokens import known_tokens

FINISH_REASONS = {"eos": "stop", "word": "stop", "limit": "length", "cancelled": "stop"}
SSE_PING = b":\n\n"


def sse_frame(payload: dict | str) -> bytes:
    text = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return b"data: " + text.encode("utf-8") + b"\n\n"


def completion_id() -> str:
    alphabet = string.ascii_letters + string.digits
    return "chatcmpl-" + "".join(secrets.choice(alphabet) for _ in range(32))


@attrs.define
class TokenBatch:
    """Tokens generated since the last chunk sent (content can lag behind tokens)."""

    ids: list[int] = attrs.Factory(list)
    probs: list[dict] = attrs.Factory(list)

    def take(self) -> tuple[list[int], list[dict]]:
        ids, probs = self.ids, self.probs
        self.ids, self.probs = [], []
        return ids, probs


def utf8_prefix(data: bytes) -> str:
    """The text of `data` without an incomplete character at its end (the peer's ``validate_utf8``)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.reason == "unexpected end of data":
            return data[: exc.start].decode("utf-8", errors="replace")
        return data.decode("utf-8", errors="replace")


def token_probabilities(event: dict, post_sampling: bool) -> dict:
    """The peer's probabilities entry for one token line with ``probs``: ``{id, token, bytes, logprob,
    top_logprobs: [{id, token, bytes, logprob}]}``, or with post-sampling probabilities ``prob`` and
    ``top_probs`` (llama-server's ``probs_vector_to_json``)."""
    key, top_key = ("prob", "top_probs") if post_sampling else ("logprob", "top_logprobs")

    def entry(p: dict, piece: str) -> dict:
        data = bytes(p["bytes"]) if "bytes" in p else piece.encode("utf-8")
        return {"id": p.get("id"), "token": utf8_prefix(data), "bytes": list(data), key: p.get(key)}

    chosen = {**event, "id": event.get("token")}  # a token line's "id" is its request's (protocol v2)
    return {
        **entry(chosen, str(event.get("piece", ""))),
        top_key: [entry(p, str(p.get("token", ""))) for p in event.get("probs") or []],
    }


def probs_object(probs: list[dict], top: int | None = None) -> dict:
    """The OpenAI endpoints' ``logprobs``: ``{"content": [entry, ...]}``, each entry's alternatives cut to
    ``top`` (chat's ``top_logprobs``) when given."""
    if top is None:
        return {"content": probs}
    return {
        "content": [
            {k: (v[:top] if k in ("top_logprobs", "top_probs") else v) for k, v in p.items()} for p in probs
        ]
    }


def prompt_progress(event: dict) -> dict:
    """llama-server's ``prompt_progress`` object from an engine ``progress`` line."""
    return {
        "total": event.get("total"),
        "cache": event.get("cache"),
        "processed": event.get("processed"),
        "time_ms": event.get("time_ms"),
    }


class ProgressCadence:
    """llama-server's return_progress cadence: the event before the evaluation (processed = cache), then one
    each time a --batch-size batch of the prompt is evaluated, and the last; the engine tells every prefill
    chunk, which may be smaller (a chunk cut while other slots generate)."""

    def __init__(self, n_batch: int) -> None:
        self.n_batch = n_batch
        self.sent: int | None = None  # the processed count of the last event sent

    def due(self, progress: dict) -> bool:
        processed, cache, total = (int(progress.get(k) or 0) for k in ("processed", "cache", "total"))
        batches = (processed - cache) // self.n_batch
        if self.sent is None or processed >= total or batches > (self.sent - cache) // self.n_batch:
            self.sent = processed
            return True
        return False


@attrs.frozen
class RunInfo:
    model: str
    options: CompletionOptions
    created: int = attrs.Factory(lambda: int(time.time()))
    id: str = attrs.Factory(completion_id)
    system_fingerprint: str = ""


class ResponseFormat(abc.ABC):
    """One endpoint's framing of a completion."""

    sends_done = True  # OpenAI endpoints end the stream with ``data: [DONE]``

    def __init__(self, info: RunInfo) -> None:
        self.info = info
        self.n_predicted = 0

    def start_chunks(self) -> list[dict]:
        return []

    def carries_ids(self) -> bool:
        """Whether a token chunk shows token ids (a chunk with ids but no text says something only then)."""
        return False

    def progress_chunk(self, progress: dict) -> dict:
        """A chunk carrying llama-server's ``prompt_progress`` (``return_progress`` in a stream)."""
        return {**self.token_chunk("", [], []), "prompt_progress": progress}

    @abc.abstractmethod
    def token_chunk(self, content: str, ids: list[int], probs: list[dict]) -> dict: ...

    @abc.abstractmethod
    def final_chunks(self, result: dict, lease: EngineLease) -> list[dict]: ...

    @abc.abstractmethod
    def response(self, result: dict, probs: list[dict], lease: EngineLease) -> dict: ...

    def usage(self, result: dict) -> dict:
        timings = result.get("timings") or {}
        prompt_tokens = int(result.get("tokens_evaluated", 0))
        completion_tokens = len(result.get("tokens") or [])
        return {
            "completion_tokens": completion_tokens,
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": int(timings.get("cache_n", 0))},
        }

    def openai_envelope(self, obj: str, **fields: Any) -> dict:
        return {
            **fields,
            "created": self.info.created,
            "model": self.info.options.model or self.info.model,
            "system_fingerprint": self.info.system_fingerprint,
            "object": obj,
            "id": self.info.id,
        }


class NativeCompletionFormat(ResponseFormat):
    """``POST /completion``: llama-server's own fields; stream frames without ``[DONE]``."""

    sends_done = False

    def __init__(self, info: RunInfo, prompt_text: Callable[[EngineLease], str]) -> None:
        super().__init__(info)
        self.prompt_text = prompt_text

    def carries_ids(self) -> bool:
        return self.info.options.return_tokens

    def token_chunk(self, content: str, ids: list[int], probs: list[dict]) -> dict:
        chunk = {
            "index": 0,
            "content": content,
            "tokens": ids if self.carries_ids() else [],
            "stop": False,
            "id_slot": -1,
            "tokens_predicted": self.n_predicted,
        }
        if probs:
            chunk["completion_probabilities"] = probs
        return chunk

    def _final(self, result: dict, probs: list[dict] | None, lease: EngineLease, *, streamed: bool) -> dict:
        tokens = result.get("tokens") or []
        final = {
            # As the peer: in a stream the text and tokens went out in the partial chunks.
            "index": 0,
            "content": "" if streamed else str(result.get("content", "")),
            "tokens": tokens if self.info.options.return_tokens and not streamed else [],
            "id_slot": lease.slot,
            "stop": True,
            "model": self.info.options.model or self.info.model,
            "tokens_predicted": len(tokens),
            "tokens_evaluated": result.get("tokens_evaluated", 0),
            "generation_settings": self.info.options.settings(),
            "prompt": self.prompt_text(lease),
            "has_new_line": "\n" in str(result.get("content", "")),
            "truncated": bool(result.get("truncated")),
            "stop_type": "none"
            if result.get("stop_type") == "cancelled"
            else result.get("stop_type", "none"),
            "stopping_word": result.get("stopping_word", ""),
            "tokens_cached": result.get("tokens_cached", 0),
            "timings": result.get("timings", {}),
        }
        if probs:
            final["completion_probabilities"] = probs
        return final

    def final_chunks(self, result: dict, lease: EngineLease) -> list[dict]:
        return [self._final(result, None, lease, streamed=True)]

    def response(self, result: dict, probs: list[dict], lease: EngineLease) -> dict:
        return self._final(result, probs, lease, streamed=False)


class TextCompletionFormat(ResponseFormat):
    """``POST /v1/completions`` (OpenAI text completion); ``logprobs`` as the peer: ``{"content": [...]}``
    with ``n_probs`` (or OpenAI's integer ``logprobs``), else null."""

    def token_chunk(self, content: str, ids: list[int], probs: list[dict]) -> dict:
        return self.openai_envelope(
            "text_completion",
            choices=[
                {
                    "text": content,
                    "index": 0,
                    "logprobs": probs_object(probs) if probs else None,
                    "finish_reason": None,
                }
            ],
        )

    def final_chunks(self, result: dict, lease: EngineLease) -> list[dict]:
        finish = FINISH_REASONS.get(result.get("stop_type", ""), "stop")
        return [
            self.openai_envelope(
                "text_completion",
                choices=[{"text": "", "index": 0, "logprobs": None, "finish_reason": finish}],
                usage=self.usage(result),
                timings=result.get("timings", {}),
            )
        ]

    def response(self, result: dict, probs: list[dict], lease: EngineLease) -> dict:
        finish = FINISH_REASONS.get(result.get("stop_type", ""), "stop")
        return self.openai_envelope(
            "text_completion",
            choices=[
                {
                    "text": result.get("content", ""),
                    "index": 0,
                    "logprobs": probs_object(probs) if probs else None,
                    "finish_reason": finish,
                }
            ],
            usage=self.usage(result),
            timings=result.get("timings", {}),
        )


class ChatCompletionFormat(ResponseFormat):
    """``POST /v1/chat/completions`` (OpenAI chat): role chunk, content deltas, finish, usage;
    ``choices[0].logprobs`` with OpenAI's ``logprobs`` (alternatives cut to ``top_logprobs``) or ``n_probs``."""

    def _with_logprobs(self, chunk: dict, probs: list[dict]) -> dict:
        if probs and chunk["choices"]:
            chunk["choices"][0]["logprobs"] = probs_object(probs, self.info.options.top_logprobs)
        return chunk

    def start_chunks(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": None}, None)]

    def progress_chunk(self, progress: dict) -> dict:
        return {**self._chunk({"role": "assistant", "content": None}, None), "prompt_progress": progress}

    def _chunk(self, delta: dict, finish: str | None, **extra: Any) -> dict:
        return self.openai_envelope(
            "chat.completion.chunk", choices=[{"finish_reason": finish, "index": 0, "delta": delta}], **extra
        )

    def token_chunk(self, content: str, ids: list[int], probs: list[dict]) -> dict:
        return self._with_logprobs(self._chunk({"content": content}, None), probs)

    def final_chunks(self, result: dict, lease: EngineLease) -> list[dict]:
        finish = FINISH_REASONS.get(result.get("stop_type", ""), "stop")
        chunks = [self._chunk({}, finish, timings=result.get("timings", {}))]
        if self.info.options.include_usage:
            chunks.append(
                self.openai_envelope(
                    "chat.completion.chunk",
                    choices=[],
                    usage=self.usage(result),
                    timings=result.get("timings", {}),
                )
            )
        return chunks

    def response(self, result: dict, probs: list[dict], lease: EngineLease) -> dict:
        finish = FINISH_REASONS.get(result.get("stop_type", ""), "stop")
        return self._with_logprobs(
            self.openai_envelope(
                "chat.completion",
                choices=[
                    {
                        "finish_reason": finish,
                        "index": 0,
                        "message": {"role": "assistant", "content": result.get("content", "")},
                    }
                ],
                usage=self.usage(result),
                timings=result.get("timings", {}),
            ),
            probs,
        )


class CompletionRun:
    """One COMPLETE of a request (one task: a prompt, or one of ``n`` choices), run on a lease that
    ``batch.BatchRun`` holds: ``start`` sends it, then ``collect`` gathers the JSON answer or
    ``task_frames`` streams it as SSE."""

    def __init__(
        self,
        ctx: ServerContext,
        command: dict,
        options: CompletionOptions,
        fmt: ResponseFormat,
        client: ClientConnection | None = None,
        verbose: ResponseFormat | None = None,
    ) -> None:
        self.ctx = ctx
        self.command = command
        self.options = options
        self.fmt = fmt
        self.client = client or ClientConnection(None)
        self.verbose = (
            verbose  # the peer's ``verbose``: the native answer beside the OpenAI one, as __verbose
        )
        self.want_probs = int(options.sampling.get("n_probs", 0)) > 0
        self.prompt: Any = command.get("prompt")  # the prompt sent (token ids when the server tokenized it)
        # A chat turn's messages, kept as the conversation's notes even once the prompt is sent as tokens.
        self.messages: Any = command.get("messages")

    def start(self, lease: EngineLease) -> Iterator[dict]:
        """Send the COMPLETE; its events, watched for the client's departure (which cancels it)."""
        assert lease.slot is not None, "a completion runs on a slot's lease"
        ping = self.ctx.config.sse_ping_interval if self.options.stream else 0
        # The engine's silence is broken every POLL_INTERVAL_S to see whether the client left.
        command = (
            self.command
            if self.ctx.store is None
            else self.ctx.store.prepare(lease, self.command, lease.slot)
        )
        self.prompt = command.get("prompt")
        self.ctx.ledger.started(
            lease.slot, known_tokens(self.prompt), cache_prompt=command.get("cache_prompt", True) is not False
        )
        return watch_client(
            lease.request("COMPLETE", command, idle_s=POLL_INTERVAL_S), self.client, lease.cancel, ping_s=ping
        )

    def _record(self, result: dict, lease: EngineLease) -> None:
        self.ctx.metrics.record_completion(result)
        assert lease.slot is not None
        self.ctx.ledger.completed(lease.slot, result, self.options.settings(), self.messages)

    def collect(self, events: Iterator[dict], lease: EngineLease) -> dict:
        probs = []
        for event in events:
            kind = event["event"]
            if kind == "token" and self.want_probs:
                probs.append(token_probabilities(event, self.options.post_sampling_probs))
            elif kind == "result":
                self._record(event, lease)
                return self._with_verbose(self.fmt.response(event, probs, lease), event, probs, lease)
        raise AssertionError("request() ends with a result or raises")

    def task_frames(
        self, lease: EngineLease, events: Iterator[dict], first: dict | None = None
    ) -> Generator[bytes, None, bool]:
        """This task's SSE frames (``first``: its first event, already read); returns whether it ended with
        its result (False: an error frame ended it). A client gone cancels it and reads it to its end."""
        batch = TokenBatch()
        cadence = ProgressCadence(self.ctx.config.progress_batch())
        ended = False
        try:
            for chunk in self.fmt.start_chunks():
                yield sse_frame(chunk)
            # itertools.chain, not a generator: closing this stream must leave `events` open for _abandon.
            for event in itertools.chain([] if first is None else [first], events):
                if event is IDLE_EVENT:
                    yield SSE_PING
                    continue
                kind = event["event"]
                if kind == "token":
                    self.fmt.n_predicted += 1
                    batch.ids.append(int(event.get("token", -1)))
                    if self.want_probs:
                        batch.probs.append(token_probabilities(event, self.options.post_sampling_probs))
                    content = str(event.get("content", ""))
                    if content or batch.probs:
                        ids, probs = batch.take()
                        yield sse_frame(self.fmt.token_chunk(content, ids, probs))
                elif kind == "progress":
                    progress = prompt_progress(event)
                    if cadence.due(progress):
                        yield sse_frame(self.fmt.progress_chunk(progress))
                elif kind == "result":
                    ended = True
                    if (
                        batch.ids and self.fmt.carries_ids()
                    ):  # the last tokens had no text (EOS): their ids go out
                        ids, probs = batch.take()
                        yield sse_frame(self.fmt.token_chunk("", ids, probs))
                    self._record(event, lease)
                    final = self.fmt.final_chunks(event, lease)
                    final[0] = self._with_verbose(final[0], event, [], lease)
                    for chunk in final:
                        yield sse_frame(chunk)
                    return True
        except EngineCallError as exc:
            ended = True
            yield sse_error_frame(exc)
        finally:
            # A client that went away closes this generator early: the COMPLETE is cancelled and read
            # to its end (and counted) before the next request may use the engine.
            if not ended:
                self._abandon(lease, events)
        return False

    def _with_verbose(self, answer: dict, result: dict, probs: list[dict], lease: EngineLease) -> dict:
        if self.verbose is not None:
            answer["__verbose"] = self.verbose.response(result, probs, lease)
        return answer

    def _abandon(self, lease: EngineLease, events: Iterator[dict]) -> None:
        lease.cancel()
        try:
            for event in events:
                if event["event"] == "result":
                    self._record(event, lease)
        except EngineCallError:
            pass  # the engine died meanwhile: release() leaves the restart to the supervisor
