"""The completion loop against a scripted runner (a test double whose logits pick the next scripted
token), with the real SmolLM2 tokenizer: stop conditions, stop strings across tokens, UTF-8 hold-back,
cancellation, n_probs, timings, request validation, prompt forms, sampler state across requests."""

from __future__ import annotations

import numpy as np
import pytest
from strata_engine.completion import (
    Completer,
    CompletionRequest,
    Generation,
    Phase,
    StopStringFilter,
    StopType,
    Timings,
    parse_request,
)
from strata_engine.errors import ContextOverflow, InvalidRequest
from strata_engine.sampling import Argmax, SamplerState
from strata_engine.tokenizer.unicode import bytes_to_unicode
from support.data import gemma3_model_path, load_reference


class ScriptedRunner:
    """Holds tokens like ModelRunner; the logits after each evaluated token make `script[i]` the
    greedy choice at generation step i (random logits once the script is exhausted)."""

    def __init__(self, script, n_vocab=49152, n_ctx=4096, seed=0):
        self.script = list(script)
        self.n_vocab = n_vocab
        self.n_ctx = n_ctx
        self.held: list[int] = []
        self.step = 0
        self.erased = 0
        self.rows: list[str] = []  # per decode_row: what the generation asked for
        self._rng = np.random.default_rng(seed)

    @property
    def n_held(self):
        return len(self.held)

    def _logits(self):
        logits = self._rng.normal(size=self.n_vocab).astype(np.float32)
        if self.step < len(self.script):
            logits[self.script[self.step]] = 50.0
        self.step += 1
        return logits

    def prefill(self, tokens, should_stop=None):
        common = 0
        while common < min(len(tokens), len(self.held)) - 0 and tokens[common] == self.held[common]:
            common += 1
        common = min(common, len(tokens) - 1)
        self.held = list(tokens)
        self.step = 0

        class Result:
            pass

        result = Result()
        result.logits, result.cache_n, result.prompt_n = self._logits(), common, len(tokens) - common
        return result

    def prefill_steps(self, tokens, on_chunk=None, chunk_size=None):
        result = self.prefill(tokens)  # one chunk, whatever its size
        if on_chunk is not None:
            on_chunk(result.cache_n, len(tokens))
        yield
        return result

    def decode(self, token):
        assert len(self.held) < self.n_ctx
        self.held.append(token)
        return self._logits()

    def decode_row(self, token, argmax_only):
        logits = self.decode(token)
        self.rows.append("argmax" if argmax_only else "logits")
        return Argmax.of_logits(logits) if argmax_only else logits

    def erase(self):
        n, self.held = len(self.held), []
        self.erased += 1
        return n


@pytest.fixture
def tokenizer(tokenizers):
    return tokenizers["smollm2"]


@pytest.fixture
def template(templates):
    return templates["smollm2"]


def ids_of(tokenizer, *pieces):
    """Token ids whose texts are exactly `pieces` (each must be one token)."""
    out = []
    for piece in pieces:
        ids = tokenizer.encode(piece)
        assert len(ids) == 1, (piece, ids)
        out.append(ids[0])
    return out


def run(tokenizer, template, script, n_ctx=4096, **fields):
    runner = ScriptedRunner(script, n_ctx=n_ctx)
    completer = Completer(runner, tokenizer, template)
    events = []
    request = parse_request({"prompt": "Hi", "temperature": 0, **fields})
    result = completer.complete(
        request, on_token=events.append, cancelled=fields.pop("_cancel", lambda: False)
    )
    return result, events, runner


def test_eos_stops_and_is_not_shown(tokenizer, template):
    script = ids_of(tokenizer, " Paris", ".") + [2]
    result, events, runner = run(tokenizer, template, script)
    assert result.stop_type is StopType.EOS and result.tokens == tuple(script)
    assert result.content == " Paris." and [e.content for e in events] == [" Paris", ".", ""]
    assert events[-1].piece == "<|im_end|>"
    # prompt (1 token) + 3 generated - 1: the EOS is never evaluated
    assert result.n_tokens_held == runner.n_held == 3 == result.tokens_cached
    assert result.timings.predicted_n == 3 and result.tokens_evaluated == 1


def test_ignore_eos_continues(tokenizer, template):
    script = [2] + ids_of(tokenizer, " a", " b")
    result, _, _ = run(tokenizer, template, script, ignore_eos=True, n_predict=3)
    assert result.stop_type is StopType.LIMIT and result.tokens == tuple(script) and result.content == " a b"


def test_n_predict_limit_and_zero(tokenizer, template):
    result, events, runner = run(tokenizer, template, ids_of(tokenizer, " a", " b", " c"), n_predict=2)
    assert result.stop_type is StopType.LIMIT and len(result.tokens) == 2 and len(events) == 2
    assert runner.n_held == 1 + 2 - 1
    result, events, runner = run(tokenizer, template, [], n_predict=0)
    assert result.tokens == () and events == [] and result.stop_type is StopType.LIMIT and runner.n_held == 1


def test_context_full_is_a_limit(tokenizer, template):
    result, _, runner = run(tokenizer, template, [], n_ctx=5)
    assert result.stop_type is StopType.LIMIT and runner.n_held == 5 and len(result.tokens) == 5


def test_stop_string_split_across_tokens(tokenizer, template):
    script = ids_of(tokenizer, " Hello", " wor", "ld", "!", " more")
    result, events, runner = run(tokenizer, template, script, stop=["world!"])
    assert result.stop_type is StopType.WORD and result.stopping_word == "world!"
    assert result.content == " Hello " and "".join(e.content for e in events) == result.content
    assert result.tokens == tuple(script[:4]) and runner.n_held == 1 + 4 - 1


def test_stop_prefix_held_back_then_released(tokenizer, template):
    script = ids_of(tokenizer, " The", " end", " endless", ".") + [2]
    result, events, _ = run(tokenizer, template, script, stop=[" end."])
    # " end" could start " end." so it is held; " endless" shows it is not a stop
    assert [e.content for e in events] == [" The", "", " end endless", ".", ""]
    assert result.stop_type is StopType.EOS and result.content == " The end endless."


def test_held_tail_released_at_the_end(tokenizer, template):
    script = ids_of(tokenizer, " a", " b")
    result, events, _ = run(tokenizer, template, script, stop=[" b c"], n_predict=2)
    assert [e.content for e in events] == [" a", " b"]  # the limit flushes the held " b"
    assert result.content == " a b"


def test_utf8_hold_back(tokenizer, template):
    table = bytes_to_unicode()
    rocket = [tokenizer.vocab.token_to_id[table[b]] for b in "🚀".encode()]
    script = ids_of(tokenizer, " go") + rocket + [2]
    result, events, _ = run(tokenizer, template, script)
    assert [e.content for e in events] == [" go", "", "", "", "🚀", ""]
    assert events[1].piece == "\ufffd"  # a piece alone may be an incomplete character
    assert result.content == " go🚀"


def test_cancel_flushes_and_stops(tokenizer, template):
    script = ids_of(tokenizer, " a", " b", " c", " d")
    calls = []

    def cancelled():
        calls.append(1)
        return len(calls) >= 2

    result, events, runner = run(tokenizer, template, script, stop=[" b!"], _cancel=cancelled)
    assert result.stop_type is StopType.CANCELLED and result.tokens == tuple(script[:2])
    assert [e.content for e in events] == [" a", " b"] and result.content == " a b"
    assert runner.n_held == 1 + 2 - 1


def test_n_probs(tokenizer, template):
    script = ids_of(tokenizer, " a", " b")
    result, events, _ = run(tokenizer, template, script, n_predict=2, n_probs=3)
    for event, token in zip(events, script, strict=True):
        assert len(event.probs) == 3 and event.probs[0].id == token
        assert event.probs[0].token == tokenizer.piece(token)
        assert event.probs[0].prob == pytest.approx(np.exp(event.probs[0].logprob))
        assert event.probs[0].logprob >= event.probs[1].logprob >= event.probs[2].logprob
    plain, events, _ = run(tokenizer, template, script, n_predict=2)
    assert all(e.probs is None for e in events)


class LogitsRunner(ScriptedRunner):
    """A ScriptedRunner that hands every step's logits, whatever the generation asks (the path before Argmax)."""

    def decode_row(self, token, argmax_only):
        return super().decode_row(token, False)


@pytest.mark.parametrize(("fields", "argmax"), [
    ({}, True),  # greedy, nothing reads the logits
    ({"repeat_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}, True),  # penalties neutral
    ({"repeat_penalty": 1.3, "repeat_last_n": 0}, True),  # a penalty over no tokens
    ({"repeat_penalty": 1.3}, False),
    ({"presence_penalty": 0.5}, False),
    ({"logit_bias": [[" b", -100.0]]}, False),
    ({"n_probs": 2}, False),
    ({"grammar": 'root ::= " a" " b" " a"'}, False),
    ({"temperature": 0.9, "seed": 7}, False),
], ids=["greedy", "neutral-penalties", "no-penalty-window", "repeat", "presence", "logit-bias", "n-probs",
        "grammar", "sampled"])  # fmt: skip
def test_a_step_hands_only_the_argmax_where_the_sampler_reads_nothing_else(
    tokenizer, template, fields, argmax
):
    """`Generation.argmax_only` asks the runner for the raw logits' argmax only for a greedy row that nothing
    else reads (no penalty, bias, n_probs, constraint); the tokens are those of the logits path either way."""
    script = ids_of(tokenizer, " a", " b", " a", " b", " c")
    result, events, runner = run(tokenizer, template, script, n_predict=5, **fields)
    assert runner.rows and set(runner.rows) == {"argmax" if argmax else "logits"}
    completer = Completer(LogitsRunner(script), tokenizer, template)
    request = parse_request({"prompt": "Hi", "temperature": 0, "n_predict": 5, **fields})
    expected = completer.complete(request)
    assert set(completer.runner.rows) == {"logits"}
    assert result.tokens == expected.tokens and result.content == expected.content
    assert result.stop_type is expected.stop_type
    if fields.get("n_probs"):
        assert all(event.probs for event in events)


def test_an_argmax_of_a_non_finite_logit_ends_the_generation(tokenizer, template):
    """A step whose best raw logit is -inf (everything banned) ends the output as EOS, as its logits do."""
    completer = Completer(ScriptedRunner(ids_of(tokenizer, " a")), tokenizer, template)
    gen = Generation(
        completer, completer.prepare(parse_request({"prompt": "Hi", "temperature": 0, "n_predict": 4}))
    )
    while gen.phase is Phase.PREFILL:
        gen.prefill_chunk()
    assert gen.argmax_only and gen.pending is not None
    assert gen.accept(Argmax(5, float("-inf")))
    assert gen.result.stop_type is StopType.EOS and gen.result.tokens == tuple(ids_of(tokenizer, " a"))


def test_timings_shape(tokenizer, template):
    ticks = iter([0.0, 0.5, 2.5])
    runner = ScriptedRunner(ids_of(tokenizer, " a", " b"))
    completer = Completer(runner, tokenizer, template, clock=lambda: next(ticks))
    result = completer.complete(parse_request({"prompt": "Hi there", "n_predict": 2, "temperature": 0}))
    t = result.timings
    assert (t.cache_n, t.prompt_n, t.prompt_ms, t.predicted_n, t.predicted_ms) == (0, 2, 500.0, 2, 2000.0)
    # the second token took the 2 s after the first (sampled from the prompt's logits), as llama-server counts
    assert t.prompt_per_second == pytest.approx(4.0) and t.predicted_per_token_ms == pytest.approx(2000.0)


def test_prompt_cache_and_cache_prompt_false(tokenizer, template):
    runner = ScriptedRunner([])
    completer = Completer(runner, tokenizer, template)
    completer.complete(parse_request({"prompt": "one two three", "n_predict": 1, "temperature": 0}))
    again = completer.complete(
        parse_request({"prompt": "one two three four", "n_predict": 1, "temperature": 0})
    )
    assert again.timings.cache_n == 3 and again.timings.prompt_n == 1
    cold = completer.complete(
        parse_request(
            {"prompt": "one two three four", "n_predict": 1, "temperature": 0, "cache_prompt": False}
        )
    )
    assert runner.erased == 1 and cold.timings.cache_n == 0


def test_prompt_forms(tokenizer, template):
    completer = Completer(ScriptedRunner([]), tokenizer, template)
    assert completer.prompt_tokens(parse_request({"prompt": "Hello"})) == tokenizer.encode("Hello")
    # SmolLM2 does not ask for a BOS: add_special adds nothing; control tokens in strings are parsed
    mixed = parse_request({"prompt": ["<|im_start|>Hello", 2, " there"], "add_special": True})
    assert completer.prompt_tokens(mixed) == [1, *tokenizer.encode("Hello"), 2, *tokenizer.encode(" there")]
    assert completer.prompt_tokens(parse_request({"prompt": [5, 6]})) == [5, 6]
    chat = completer.prompt_tokens(parse_request({"messages": [{"role": "user", "content": "hi"}]}))
    assert chat == tokenizer.encode(template.render([{"role": "user", "content": "hi"}]))
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        completer.prompt_tokens(parse_request({"prompt": [1, 49152]}))
    with pytest.raises(InvalidRequest, match="empty"):
        completer.prompt_tokens(parse_request({"prompt": ""}))


def test_prompt_longer_than_context(tokenizer, template):
    completer = Completer(ScriptedRunner([], n_ctx=3), tokenizer, template)
    with pytest.raises(ContextOverflow) as info:
        completer.complete(parse_request({"prompt": [1, 2, 3, 4]}))
    assert (info.value.n_prompt_tokens, info.value.n_ctx) == (4, 3)


def test_request_validation_reports_every_problem():
    with pytest.raises(InvalidRequest) as info:
        parse_request(
            {"prompt": "x", "messages": [], "n_predict": -3, "temperature": "hot", "top_p": "high", "top_k": True,
             "seed": -5, "stop": ["", 3], "n_probs": 101, "ignore_eos": 1}
        )  # fmt: skip
    problems = " ".join(info.value.problems)
    for field in ("exactly one of prompt and messages", "n_predict", "temperature", "top_p", "top_k", "seed",
                  "stop", "n_probs", "ignore_eos"):  # fmt: skip
        assert field in problems, field
    with pytest.raises(InvalidRequest, match="JSON object"):
        parse_request([1, 2])
    with pytest.raises(InvalidRequest, match="prompt must be"):
        parse_request({"prompt": [1.5]})
    request = parse_request({"prompt": "x", "unknown_field": 1})  # unknown fields are ignored
    assert request == CompletionRequest(prompt="x")


def test_seeded_requests_reproduce_and_state_continues(tokenizer, template):
    def sample_run(completer, seed):
        completer.runner.__init__([], seed=11)  # same logits every run
        request = parse_request({"prompt": "Hi", "n_predict": 6, "temperature": 1.5, "top_k": 0, "top_p": 1.0,
                                 "min_p": 0.0, "seed": seed})  # fmt: skip
        return completer.complete(request).tokens

    completer = Completer(ScriptedRunner([]), tokenizer, template)
    assert sample_run(completer, 123) == sample_run(completer, 123)
    assert sample_run(completer, 123) != sample_run(completer, 124)
    # seed -1 continues the held generator; restoring its captured state replays the same tokens
    captured = completer.sampler_state.to_bytes()
    first = sample_run(completer, -1)
    completer.sampler_state = SamplerState.from_bytes(captured)
    assert sample_run(completer, -1) == first


def test_stop_filter_prefers_earliest_match():
    f = StopStringFilter(["cd", "bcd"])
    assert f.push(b"ab") == ("a", None)
    assert f.push(b"cd") == ("", "bcd")  # "bcd" starts before "cd"


@pytest.fixture
def gemma3(tokenizers, templates):
    return tokenizers["gemma3"], templates["gemma3"]


def test_gemma3_end_of_turn_stops(gemma3):
    tokenizer, template = gemma3
    runner = ScriptedRunner([*tokenizer.encode(" Paris"), 106], n_vocab=tokenizer.n_vocab)
    completer = Completer(runner, tokenizer, template)
    result = completer.complete(
        parse_request({"messages": [{"role": "user", "content": "Capital of France?"}], "temperature": 0})
    )
    assert result.stop_type is StopType.EOS and result.tokens[-1] == 106 and result.content == " Paris"
    assert runner.held[0] == 2  # gemma3 asks for a BOS


@pytest.mark.slow
def test_gemma3_real_runner_greedy_matches_transformers(gemma3):
    from strata_engine.settings import EngineSettings

    from .runners import load_runner

    tokenizer, template = gemma3
    case = load_reference("transformers-gemma3-270m.json")["complete"][0]
    runner = load_runner(EngineSettings(model_path=gemma3_model_path(), n_ctx=64))
    completer = Completer(runner, tokenizer, template)
    result = completer.complete(parse_request({"prompt": case["prompt"], "n_predict": 4, "temperature": 0}))
    assert completer.prompt_tokens(parse_request({"prompt": case["prompt"]})) == case["prompt_tokens"]
    assert list(result.tokens) == case["tokens"][:4]
    assert result.content == tokenizer.decode(case["tokens"][:4])


def test_prompt_of_exactly_the_context_gets_one_token(tokenizer, template):
    runner = ScriptedRunner(ids_of(tokenizer, " a", " b"), n_ctx=3)
    result = Completer(runner, tokenizer, template).complete(
        parse_request({"prompt": [5, 6, 7], "temperature": 0})
    )
    assert result.stop_type is StopType.LIMIT and len(result.tokens) == 1 and runner.n_held == 3


def test_llama_server_values_are_accepted_with_its_meaning(tokenizer, template):
    request = parse_request({"prompt": "x", "top_k": -1, "top_p": 1.5, "min_p": -0.1, "n_predict": -2})
    assert request.n_predict == -1 and request.sampling.top_k == -1
    script = ids_of(tokenizer, " a", " b")
    result, _, _ = run(
        tokenizer, template, script, top_k=-1, top_p=0.0, min_p=2.0, n_predict=2, temperature=1.0
    )
    assert result.tokens == tuple(script)  # top_p <= 0 / min_p > 1 keep the best token only


def test_one_generated_token_has_no_generation_rate():
    one = Timings.measure(0, 5, 0.1, 1, 0.02)
    assert one.predicted_per_second == one.predicted_per_token_ms == 0.0  # llama-server's edge
    # the rates count the tokens after the first, as llama-server's (its slot file: 16 tokens in 252.781 ms,
    # 16.852 ms a token, 59.34 a second; tests/reference/peer-slots-gemma3-270m.json)
    peer = Timings.measure(0, 16000, 25.0, 16, 0.252781)
    assert peer.predicted_per_token_ms == pytest.approx(16.852066666666666)
    assert peer.predicted_per_second == pytest.approx(59.33990291991882)
    assert Timings.measure(0, 5, 0.1, 2, 0.02).predicted_per_second == pytest.approx(50.0)
    assert Timings.measure(0, 5, 0.1, 0, 0.0).predicted_per_second == 0.0
