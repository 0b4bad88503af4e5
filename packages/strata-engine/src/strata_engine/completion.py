"""Completions: a validated request, the prompt (text, token ids, or chat messages), prefill a chunk at a time
through the runner (prompt cache inside), then sample / stream / decode until a stop condition.

Each step: the logits, masked by the request's constraint (constraints.py) if it has one, go through
the sampler chain (sampling.py); the sampled token is committed to the constraint.

Stop conditions, checked on every sampled token, in this order: a stop string completed by the token's
text (`word`), an end-of-generation token (`eos`, unless `ignore_eos`), the constraint complete with
nothing but end-of-generation left to allow (`eos`), `n_predict` reached or the context full
(`limit`), a cancellation (`cancelled`). The token that ends the generation is reported like the others
but is never evaluated, so the runner holds prompt + generated - 1 tokens.

Streamed text is safe to show: bytes of an incomplete UTF-8 character and any tail that could still
become a stop string are held back, and released with a later token or dropped when a stop string
matches (`StopStringFilter`).
"""

from __future__ import annotations

import enum
import functools
import json
import math
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any, Protocol

import attrs
import numpy as np

from .chat import ChatTemplate
from .constraints import ConstraintCompiler, ConstraintKind, OutputConstraint
from .errors import ContextOverflow, InvalidRequest
from .sampling import (
    Argmax,
    Candidates,
    Sampler,
    SamplerState,
    SamplingParams,
    best_indices,
    final_probs,
    random_seed,
    token_logprob,
    top_n_logprobs,
)
from .tokenizer import Tokenizer, Utf8Stream
from .wire import CompleteArgs, arguments

# The log-probability reported for probability 0 (llama-server's: the lowest float, JSON has no -inf).
LOGPROB_OF_ZERO = -3.4028234663852886e38


class StopType(enum.Enum):
    EOS = "eos"
    LIMIT = "limit"
    WORD = "word"
    CANCELLED = "cancelled"


# -- the request --------------------------------------------------------------------------------------


@attrs.frozen
class CompletionRequest:
    """Exactly one of `prompt` (a string, or a tuple of strings and token ids) and `messages`."""

    prompt: str | tuple[str | int, ...] | None = None
    messages: tuple[Mapping[str, Any], ...] | None = None
    add_generation_prompt: bool = True  # messages: end with the assistant's turn header
    continue_final_message: bool = False  # messages: continue the last (assistant) message instead
    tools: tuple[Any, ...] | None = None  # messages: the chat template's `tools`
    chat_template_kwargs: Mapping[str, Any] | None = None  # messages: more chat template variables
    return_progress: bool = False  # report the prefill's progress after each chunk
    add_special: bool | None = None  # None: the model's add_bos
    n_predict: int = -1
    sampling: SamplingParams = SamplingParams()
    seed: int = -1
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    cache_prompt: bool = True
    n_probs: int = 0
    post_sampling_probs: bool = False
    logit_bias: tuple[tuple[int | str, float], ...] = ()  # strings are tokenized; -inf bans
    constraint: OutputConstraint | None = None


# COMPLETE's fields that set the sampler chain (`SamplingParams`'s, but the logit bias: resolved in `prepare`)
SAMPLING_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repeat_penalty",
    "repeat_last_n",
    "frequency_penalty",
    "presence_penalty",
)


def completion_request(args: CompleteArgs) -> CompletionRequest:
    """The request of COMPLETE's object, the engine's defaults in place of the fields not given."""

    def given(value: Any, default: Any) -> Any:
        return default if value is None else value

    defaults, request = SamplingParams(), CompletionRequest()
    constraint = None
    if args.json_schema is not None:
        constraint = OutputConstraint(ConstraintKind.JSON_SCHEMA, json.dumps(args.json_schema))
    elif args.grammar:
        constraint = OutputConstraint(ConstraintKind.GRAMMAR, args.grammar)
    return CompletionRequest(
        prompt=args.prompt,
        messages=args.messages,
        add_generation_prompt=given(args.add_generation_prompt, request.add_generation_prompt),
        continue_final_message=given(args.continue_final_message, request.continue_final_message),
        tools=args.tools,
        chat_template_kwargs=args.chat_template_kwargs,
        return_progress=given(args.return_progress, request.return_progress),
        add_special=args.add_special,
        n_predict=max(given(args.n_predict, request.n_predict), -1),
        sampling=SamplingParams(
            **{field: given(getattr(args, field), getattr(defaults, field)) for field in SAMPLING_FIELDS}
        ),
        seed=given(args.seed, request.seed),
        stop=given(args.stop, request.stop),
        ignore_eos=given(args.ignore_eos, request.ignore_eos),
        cache_prompt=given(args.cache_prompt, request.cache_prompt),
        n_probs=given(args.n_probs, request.n_probs),
        post_sampling_probs=given(args.post_sampling_probs, request.post_sampling_probs),
        logit_bias=given(args.logit_bias, request.logit_bias),
        constraint=constraint,
    )


def parse_request(obj: Any) -> CompletionRequest:
    """A `CompletionRequest` from the protocol's JSON object; every bad field is reported together."""
    return completion_request(arguments(CompleteArgs, obj))


# -- streamed text ------------------------------------------------------------------------------------


class StopStringFilter:
    """Turns token bytes into text that is safe to show: holds incomplete UTF-8 characters and any
    tail that is a prefix of a stop string; reports the stop string a push completed."""

    def __init__(self, stops: Sequence[str]):
        self._stops = tuple(stops)
        self._utf8 = Utf8Stream()
        self._pending = ""

    def push(self, data: bytes) -> tuple[str, str | None]:
        """(text released now, the stop string that matched or None). After a match, the matched
        string and everything after it are dropped."""
        self._pending += self._utf8.push(data)
        text = self._pending
        first: tuple[int, str] | None = None
        for stop in self._stops:
            at = text.find(stop)
            if at >= 0 and (first is None or at < first[0]):
                first = (at, stop)
        if first is not None:
            self._pending = ""
            return text[: first[0]], first[1]
        hold = self._partial_stop_len(text)
        self._pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], None

    def finish(self) -> str:
        """Everything still held (an incomplete character shows as U+FFFD)."""
        text = self._pending + self._utf8.finish()
        self._pending = ""
        return text

    def _partial_stop_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest


# -- events and results --------------------------------------------------------------------------------


@attrs.frozen
class TokenProb:
    id: int
    token: str
    bytes: tuple[int, ...]  # the token's own bytes (`token` shows an incomplete character as U+FFFD)
    logprob: float
    prob: float


@attrs.frozen
class TokenEvent:
    id: int
    piece: str
    content: str
    probs: tuple[TokenProb, ...] | None = None  # with n_probs: the top candidates, best first
    chosen: TokenProb | None = None  # with n_probs: the sampled token's own probability


@attrs.frozen
class PromptProgress:
    """The prefill so far, as llama-server's `prompt_progress`: prompt tokens in all, reused from the held
    conversation, held now (reused + evaluated), and milliseconds since the prefill began."""

    total: int
    cache: int
    processed: int
    time_ms: float


@attrs.frozen
class Timings:
    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float

    @classmethod
    def measure(
        cls, cache_n: int, prompt_n: int, prompt_s: float, predicted_n: int, predicted_s: float
    ) -> Timings:
        def per_token_ms(n: int, s: float) -> float:
            return 1000.0 * s / n if n else 0.0

        def per_second(n: int, s: float) -> float:
            return n / s if s > 0 else 0.0

        return cls(
            cache_n=cache_n,
            prompt_n=prompt_n,
            prompt_ms=1000.0 * prompt_s,
            prompt_per_token_ms=per_token_ms(prompt_n, prompt_s),
            prompt_per_second=per_second(prompt_n, prompt_s),
            predicted_n=predicted_n,
            predicted_ms=1000.0 * predicted_s,
            # llama-server's generation clock starts at the first token (sampled from the prompt's logits):
            # its rates count the n - 1 tokens after it (b11549: 3 tokens in 1833 ms -> 916.7 ms a token)
            predicted_per_token_ms=per_token_ms(predicted_n - 1, predicted_s) if predicted_n > 1 else 0.0,
            predicted_per_second=per_second(predicted_n - 1, predicted_s) if predicted_n > 1 else 0.0,
        )


@attrs.frozen
class CompletionResult:
    content: str
    tokens: tuple[int, ...]
    stop_type: StopType
    stopping_word: str
    truncated: bool  # prompts are never truncated here; kept for llama-server's shape
    tokens_evaluated: int  # prompt tokens
    tokens_cached: int  # tokens held after the request
    n_tokens_held: int
    seed: int
    timings: Timings


# -- the loop -------------------------------------------------------------------------------------------


class Runner(Protocol):
    """What a generation needs of its slot's `ModelRunner`."""

    n_ctx: int

    @property
    def n_held(self) -> int: ...

    # each next() evaluates one chunk (chunk_size()'s tokens where given); the return value
    # (StopIteration.value) is the PrefillResult (.logits, .cache_n, .prompt_n); closing it early keeps the
    # chunks evaluated
    def prefill_steps(
        self,
        tokens: Sequence[int],
        on_chunk: Callable[[int, int], None] | None = None,
        chunk_size: Callable[[], int] | None = None,
    ) -> Generator[None, None, Any]: ...

    def decode(self, token: int) -> np.ndarray: ...

    # `decode`, or with argmax_only the logits' Argmax (computed where they are)
    def decode_row(self, token: int, argmax_only: bool) -> np.ndarray | Argmax: ...

    def erase(self) -> int: ...


@attrs.frozen
class Prepared:
    """A request checked and made ready, touching no slot: what can refuse it has (the constraint compiled,
    the logit bias resolved, the prompt tokenized and measured)."""

    request: CompletionRequest
    prompt: tuple[int, ...]
    params: SamplingParams
    constraint: Any  # constraints.Constraint (it holds the parser's state) or None


class Phase(enum.Enum):
    PREFILL = "prefill"  # the prompt is being evaluated, a chunk at a time
    DECODE = "decode"  # `pending` is the next token to evaluate
    DONE = "done"  # `result` is set


class Generation:
    """One request's state in its slot, advanced a step at a time by whoever owns the runner: a prefill
    chunk (`prefill_chunk`), then per token the logits of the last evaluated token (`accept`), which are
    sampled, checked against the stop conditions and streamed (`on_token`). Single-slot use is
    `Completer.complete`; the serve loop's scheduler interleaves many (scheduler.py)."""

    def __init__(
        self,
        completer: Completer,
        prepared: Prepared,
        *,
        on_token: Callable[[TokenEvent], None] = lambda event: None,
        on_progress: Callable[[PromptProgress], None] | None = None,
        cancelled: Callable[[], bool] = lambda: False,
        chunk_size: Callable[[], int] | None = None,
    ):
        self.completer = completer
        self.runner = completer.runner
        self.prepared = prepared
        self._on_token = on_token
        self._cancelled = cancelled
        self._clock = completer._clock
        request = prepared.request
        state = SamplerState.seeded(request.seed) if request.seed >= 0 else completer.sampler_state
        self.sampler = Sampler(prepared.params, state)
        self.history = list(prepared.prompt)  # the repetition penalty's window reads it
        self.generated: list[int] = []
        self.text = StopStringFilter(request.stop)
        self.content: list[str] = []
        self.stop_type, self.stopping_word = StopType.LIMIT, ""
        self.pending: int | None = None
        self.result: CompletionResult | None = None
        self.start = self._clock()
        self.prompt_done = self.start
        # the prefill so far (from on_chunk): a cancelled prefill's timings, and whether the last chunk is in
        self._cache_n, self._prompt_n, self._n_held_read = 0, 0, None
        prompt = prepared.prompt

        def on_chunk(cache_n: int, n_held: int) -> None:
            self._cache_n, self._n_held_read = cache_n, n_held
            if on_progress is not None and request.return_progress:
                on_progress(
                    PromptProgress(len(prompt), cache_n, n_held, 1000.0 * (self._clock() - self.start))
                )

        self.phase = Phase.PREFILL
        # checks the prompt first
        self._prefill = self.runner.prefill_steps(list(prompt), on_chunk=on_chunk, chunk_size=chunk_size)
        if not request.cache_prompt:
            self.runner.erase()  # the prompt cache's cut-back happens at the first chunk: nothing is reused

    @property
    def done(self) -> bool:
        return self.phase is Phase.DONE

    @functools.cached_property  # the request's, fixed: read for every row of every step
    def argmax_only(self) -> bool:
        """Whether the next token is the argmax of the raw logits and nothing else reads them (greedy; no
        constraint, logit bias, active penalty or n_probs): the step may hand `accept` their `Argmax`,
        computed where the logits are, instead of the logits."""
        params = self.prepared.params
        return (params.is_greedy and not params.adjusts and self.prepared.constraint is None
                and not self.prepared.request.n_probs)  # fmt: skip

    def ends_at(self, best: Argmax) -> bool:
        """Whether accepting `best` ends the generation for a reason known before it is accepted: every stop of
        `accept` but a stop word (an argmax_only row, so no constraint). A step launched ahead of `accept`
        (scheduler) leaves such a row out."""
        return (
            not math.isfinite(best.logit)
            or self._stop_without_text(best.token, len(self.generated) + 1) is not None
        )

    def _stop_without_text(self, token: int, n_generated: int) -> StopType | None:
        """The stop that `token`, the n_generated-th token, brings without looking at the text (a stop word
        does): EOS (end of generation, a finished constraint), LIMIT (n_predict, a full context), CANCELLED."""
        request, runner, constraint = self.prepared.request, self.runner, self.prepared.constraint
        if (not request.ignore_eos and self.completer.tokenizer.is_end_of_generation(token)) or (
                constraint is not None and constraint.finished):  # fmt: skip
            return StopType.EOS
        if 0 < request.n_predict <= n_generated or runner.n_held >= runner.n_ctx:
            return StopType.LIMIT
        return StopType.CANCELLED if self._cancelled() else None

    def prefill_chunk(self) -> bool:
        """Evaluate the prompt's next chunk; at its end, sample the first token. True once done."""
        assert self.phase is Phase.PREFILL
        try:
            next(self._prefill)
            if self._n_held_read != len(self.prepared.prompt):
                return False
            next(self._prefill)  # every chunk is in: this only returns the result
            raise AssertionError("prefill_steps yielded after its last chunk")
        except StopIteration as end:
            prefill = end.value
        self.prompt_done = self._clock()
        self._cache_n, self._prompt_n = prefill.cache_n, prefill.prompt_n
        if self.prepared.request.n_predict == 0:
            return self._finish()
        return self.accept(prefill.logits)

    def cancel_prefill(self) -> bool:
        """End a generation whose prompt is being evaluated (CANCEL): what was read stays held. False when
        it is past its prefill (the next sampled token then ends it, as `cancelled` says)."""
        if self.phase is not Phase.PREFILL:
            return False
        self._prefill.close()
        self.prompt_done = self._clock()
        self._prompt_n = 0 if self._n_held_read is None else self._n_held_read - self._cache_n
        self.stop_type = StopType.CANCELLED
        return self._finish()

    def accept(self, logits: np.ndarray | Argmax) -> bool:
        """Sample from the logits of the last evaluated token (or take their `Argmax`, given only where
        `argmax_only` said so), stream the token; True once done (else `pending` is the token to evaluate next)."""
        request, tok, sampler, constraint = (
            self.prepared.request,
            self.completer.tokenizer,
            self.sampler,
            self.prepared.constraint,
        )
        if isinstance(logits, Argmax):
            assert self.argmax_only, "an Argmax handed to a generation whose sampler reads its logits"
            token, chosen_logit = logits.token, logits.logit
        else:
            masked = logits if constraint is None else constraint.mask(logits)
            adjusted = sampler.adjusted(masked, self.history)
            token = sampler.sample(adjusted)
            chosen_logit = float(adjusted[token])
        if not math.isfinite(chosen_logit):
            # the constraint allows nothing the logit bias did not ban: the output cannot go on
            self.stop_type = StopType.EOS
            return self._finish()
        if constraint is not None:
            committed = constraint.commit(token)
            assert committed, f"token {token} was sampled although the constraint masked it"
        self.generated.append(token)
        self.history.append(token)
        released, matched = self.text.push(tok.token_bytes(token, special=False))
        stop: StopType | None = None
        if matched is not None:
            stop, self.stopping_word = StopType.WORD, matched
        else:
            stop = self._stop_without_text(token, len(self.generated))
        if stop is not None and stop is not StopType.WORD:
            released += self.text.finish()
        self.content.append(released)
        chosen, probs = None, None
        if request.n_probs:
            assert isinstance(logits, np.ndarray)
            chosen, probs = self.completer.probabilities(request, sampler, logits, adjusted, token)
        self._on_token(TokenEvent(token, tok.piece(token), released, probs, chosen))
        if stop is not None:
            self.stop_type = stop
            return self._finish()
        self.phase, self.pending = Phase.DECODE, token
        return False

    def _finish(self) -> bool:
        end = self._clock()
        self.completer.sampler_state = self.sampler.state
        held = self.runner.n_held
        self.phase, self.pending = Phase.DONE, None
        self.result = CompletionResult(
            content="".join(self.content),
            tokens=tuple(self.generated),
            stop_type=self.stop_type,
            stopping_word=self.stopping_word,
            truncated=False,
            tokens_evaluated=len(self.prepared.prompt),
            tokens_cached=held,
            n_tokens_held=held,
            seed=self.sampler.state.seed,
            timings=Timings.measure(
                self._cache_n,
                self._prompt_n,
                self.prompt_done - self.start,
                len(self.generated),
                end - self.prompt_done,
            ),
        )
        return True


class Completer:
    """Completions on one runner (a slot). Holds the slot's sampler state between requests: a request
    with `seed` >= 0 starts from that seed, one with -1 continues from where the last one ended.
    `prepare` touches no runner state (the serve loop runs it on its worker thread)."""

    def __init__(
        self,
        runner: Runner,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        clock: Callable[[], float] = time.perf_counter,
        sampler_state: SamplerState | None = None,
        constraints: ConstraintCompiler | None = None,
    ):
        self.runner = runner
        self.tokenizer = tokenizer
        self.template = template
        self._clock = clock
        self.sampler_state = sampler_state or SamplerState.seeded(random_seed())
        self.constraints = constraints or ConstraintCompiler(tokenizer)

    def _refuse_unfit(self, min_tokens: int) -> None:
        """Refuse, before tokenizing, a prompt whose length in bytes already shows it cannot fit."""
        if min_tokens > self.runner.n_ctx:
            raise ContextOverflow(min_tokens, self.runner.n_ctx, at_least=True)

    def prompt_tokens(self, request: CompletionRequest) -> list[int]:
        tok = self.tokenizer
        add_special = tok.add_bos if request.add_special is None else request.add_special
        if request.messages is not None:
            text = self.template.render(
                list(request.messages),
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                tools=request.tools,
                chat_template_kwargs=request.chat_template_kwargs,
            )
            self._refuse_unfit(tok.min_tokens(text, add_special=add_special))
            tokens = tok.encode(text, add_special=add_special, parse_special=True)
        elif isinstance(request.prompt, str):
            self._refuse_unfit(tok.min_tokens(request.prompt, add_special=add_special))
            tokens = tok.encode(request.prompt, add_special=add_special, parse_special=True)
        else:
            assert request.prompt is not None
            self._refuse_unfit(sum(
                tok.min_tokens(part, add_special=add_special and i == 0) if isinstance(part, str) else 1
                for i, part in enumerate(request.prompt)
            ))  # fmt: skip
            # llama-server's tokenize_mixed: only a leading string gets the BOS
            tokens = []
            for i, part in enumerate(request.prompt):
                if isinstance(part, str):
                    tokens.extend(tok.encode(part, add_special=add_special and i == 0, parse_special=True))
                else:
                    tokens.append(part)
            bad = [t for t in tokens if not 0 <= t < tok.n_vocab]
            if bad:
                raise InvalidRequest(
                    [f"prompt token ids outside the vocabulary [0, {tok.n_vocab}): {bad[:8]}"]
                )
        if not tokens:
            raise InvalidRequest(["the prompt is empty (no tokens)"])
        return tokens

    def logit_bias(self, pairs: Sequence[tuple[int | str, float]]) -> tuple[tuple[int, float], ...]:
        """The request's bias pairs on token ids: a text biases each of its tokens (tokenized without
        special tokens, as llama-server does); an id outside the vocabulary is refused."""
        tok = self.tokenizer
        out: list[tuple[int, float]] = []
        bad: list[int] = []
        for token, bias in pairs:
            if isinstance(token, str):
                out.extend((t, bias) for t in tok.encode(token, add_special=False, parse_special=False))
            elif token < tok.n_vocab:
                out.append((token, bias))
            else:
                bad.append(token)
        if bad:
            raise InvalidRequest(
                [f"logit_bias token ids outside the vocabulary [0, {tok.n_vocab}): {bad[:8]}"]
            )
        return tuple(out)

    def token_prob(self, token: int, *, logprob: float | None = None, prob: float | None = None) -> TokenProb:
        """A token with its probability, given as either `logprob` or `prob`."""
        if logprob is None:
            assert prob is not None
            logprob = math.log(prob) if prob > 0.0 else LOGPROB_OF_ZERO
        else:
            prob = math.exp(logprob)
        data = self.tokenizer.token_bytes(token)
        return TokenProb(token, data.decode("utf-8", errors="replace"), tuple(data), logprob, prob)

    def probabilities(
        self, request: CompletionRequest, sampler: Sampler, raw: np.ndarray, adjusted: np.ndarray, token: int
    ) -> tuple[TokenProb, tuple[TokenProb, ...]]:
        """The sampled token's probability and the `n_probs` best candidates': of softmax(raw logits), as
        llama-server by default; with `post_sampling_probs`, of the chain's last distribution."""
        n = request.n_probs
        if not request.post_sampling_probs:
            top = tuple(self.token_prob(i, logprob=lp) for i, lp in top_n_logprobs(raw, n))
            return self.token_prob(token, logprob=token_logprob(raw, token)), top
        c: Candidates = sampler.candidates(adjusted)
        probs = final_probs(c, sampler.params.is_greedy)
        at = np.flatnonzero(c.ids == token)
        chosen = self.token_prob(token, prob=float(probs[at[0]]) if at.size else 0.0)
        # the probabilities are monotone in the candidates' logits: the best logits are the best tokens
        return chosen, tuple(
            self.token_prob(int(c.ids[i]), prob=float(probs[i])) for i in best_indices(c.logits, n)
        )

    def prepare(self, request: CompletionRequest) -> Prepared:
        """Everything that can refuse the request, before any slot is touched."""
        constraint = None if request.constraint is None else self.constraints.compile(request.constraint)
        params = request.sampling
        if request.logit_bias:
            params = attrs.evolve(params, logit_bias=self.logit_bias(request.logit_bias))
        prompt = self.prompt_tokens(request)
        if len(prompt) > self.runner.n_ctx:
            raise ContextOverflow(len(prompt), self.runner.n_ctx)
        return Prepared(request, tuple(prompt), params, constraint)

    def complete(
        self,
        request: CompletionRequest,
        on_token: Callable[[TokenEvent], None] = lambda event: None,
        cancelled: Callable[[], bool] = lambda: False,
        on_progress: Callable[[PromptProgress], None] = lambda progress: None,
    ) -> CompletionResult:
        """One request start to end on this runner (`strata-engine generate`; tests). `cancelled` is asked
        between prefill chunks (after the first) and at each sampled token."""
        gen = Generation(
            self, self.prepare(request), on_token=on_token, on_progress=on_progress, cancelled=cancelled
        )
        chunks = 0
        while gen.phase is Phase.PREFILL:
            if chunks and cancelled():
                gen.cancel_prefill()
                break
            gen.prefill_chunk()
            chunks += 1
        while not gen.done:
            assert gen.pending is not None
            gen.accept(self.runner.decode_row(gen.pending, gen.argmax_only))
        assert gen.result is not None
        return gen.result
