"""Structured output and the sampling request fields through the real engine (the completion loop on the
real SmolLM2 runner): hypothesis-generated JSON schemas whose every completion parses and validates, a
GBNF grammar, refusals before anything is evaluated, logit_bias bans, the reported probabilities
(n_probs, post_sampling_probs), and unconstrained requests unchanged."""

from __future__ import annotations

import json
import math
import re
import string

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strata_engine.completion import Completer, StopType, parse_request
from strata_engine.errors import InvalidGrammar, InvalidJsonSchema, InvalidRequest
from strata_engine.protocol import Reason, error_payload

from .runners import base_runner, reference, sibling

pytestmark = pytest.mark.slow

ASK_JSON = [{"role": "user", "content": "Give an example JSON value."}]
N_PREDICT = 256  # far more than any generated schema's longest output needs (~100 tokens)


@pytest.fixture(scope="module")
def completer(tokenizers, templates):
    runner = sibling(base_runner("smollm2"), kv_type="f32", n_ctx=1024)
    return Completer(runner, tokenizers["smollm2"], templates["smollm2"])


def complete(completer, events=None, **fields):
    request = parse_request({"messages": ASK_JSON, "n_predict": N_PREDICT, "temperature": 0, **fields})
    return completer.complete(request, on_token=(events.append if events is not None else lambda e: None))


# -- schemas ----------------------------------------------------------------------------------------------

NAMES = st.text(alphabet=string.ascii_lowercase, min_size=1, max_size=6)
LEAVES = st.one_of(
    st.builds(
        lambda lo, n: {"type": "string", "minLength": lo, "maxLength": lo + n},
        st.integers(0, 2),
        st.integers(1, 6),
    ),
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-100, 100),
        st.integers(0, 1000),
    ),
    st.builds(
        lambda lo, span: {"type": "number", "minimum": lo, "maximum": lo + span},
        st.integers(-10, 10),
        st.integers(1, 100),
    ),
    st.lists(NAMES, min_size=1, max_size=4, unique=True).map(lambda values: {"enum": values}),
    st.just({"type": "boolean"}),
)


def _object(properties: dict) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": sorted(properties),
        "additionalProperties": False,
    }


SCHEMAS = st.recursive(
    LEAVES,
    lambda inner: st.one_of(
        st.builds(
            lambda items, n: {"type": "array", "items": items, "maxItems": n}, inner, st.integers(1, 3)
        ),
        st.dictionaries(NAMES, inner, min_size=1, max_size=3).map(_object),
    ),
    max_leaves=4,
).map(lambda schema: schema if schema.get("type") == "object" else _object({"value": schema}))


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(schema=SCHEMAS, sampled=st.booleans())
def test_generated_schemas_always_validate(completer, schema, sampled):
    fields = {"temperature": 0.8, "seed": 7} if sampled else {}
    result = complete(completer, json_schema=schema, **fields)
    assert result.stop_type is StopType.EOS, (schema, result.content)  # the grammar completed the output
    jsonschema.validate(json.loads(result.content), schema)


def test_nested_schema_and_json_object(completer):
    schema = _object(
        {
            "name": {"type": "string", "maxLength": 12},
            "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2},
            "size": _object(
                {
                    "w": {"type": "integer", "minimum": 0, "maximum": 99},
                    "h": {"type": "number", "minimum": 0, "maximum": 1},
                }
            ),
        }
    )
    result = complete(completer, json_schema=schema)
    assert result.stop_type is StopType.EOS
    jsonschema.validate(json.loads(result.content), schema)
    any_object = complete(
        completer,
        json_schema={"type": "object", "maxProperties": 2, "additionalProperties": {"type": "integer"}},
    )
    assert isinstance(json.loads(any_object.content), dict)


def test_gbnf_grammar(completer):
    grammar = 'root ::= answer ", " digit digit?\nanswer ::= "yes" | "no"\ndigit ::= [0-9]'
    result = complete(completer, grammar=grammar)
    assert result.stop_type is StopType.EOS and re.fullmatch(r"(yes|no), [0-9]{1,2}", result.content), (
        result.content
    )
    sampled = complete(completer, grammar=grammar, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=3)
    assert re.fullmatch(r"(yes|no), [0-9]{1,2}", sampled.content), sampled.content


@pytest.mark.parametrize(
    ("fields", "error", "reason", "headline"),
    [
        (
            {"json_schema": {"type": "frobnicate"}},
            InvalidJsonSchema,
            Reason.BAD_JSON_SCHEMA,
            '"json_schema": JSON schema conversion failed:',
        ),
        (
            {"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}},
            InvalidJsonSchema,
            Reason.BAD_JSON_SCHEMA,
            '"json_schema": JSON schema conversion failed:',
        ),
        (
            {"json_schema": {"not": {"type": "string"}}},
            InvalidJsonSchema,
            Reason.BAD_JSON_SCHEMA,
            '"json_schema": JSON schema conversion failed:',
        ),  # a keyword it cannot enforce: refused, not ignored
        (
            {"json_schema": False},
            InvalidJsonSchema,
            Reason.BAD_JSON_SCHEMA,
            '"json_schema": JSON schema conversion',
        ),
        (
            {"grammar": 'root ::= "a" ('},
            InvalidGrammar,
            Reason.BAD_GRAMMAR,
            "Failed to initialize samplers: failed to parse grammar",
        ),
        (
            {"grammar": 'answer ::= "yes"'},
            InvalidGrammar,
            Reason.BAD_GRAMMAR,
            "Failed to initialize samplers: failed to parse grammar",
        ),  # no root rule
    ],
)
def test_invalid_constraints_are_refused_before_anything_runs(completer, fields, error, reason, headline):
    complete(completer, n_predict=2)
    held = list(completer.runner.tokens_held)
    with pytest.raises(error) as caught:
        complete(completer, messages=[{"role": "user", "content": "Something else entirely"}], **fields)
    payload = error_payload(caught.value)
    assert (payload["type"], payload["reason"]) == ("invalid_request", reason.value)
    assert payload["message"].startswith(headline)
    assert list(completer.runner.tokens_held) == held  # the held conversation is untouched


def test_bad_fields_are_named_together():
    with pytest.raises(InvalidRequest) as caught:
        parse_request(
            {
                "prompt": "x",
                "grammar": 3,
                "json_schema": "{}",
                "logit_bias": [[1, "a"], ["", 1]],
                "presence_penalty": math.inf,
                "frequency_penalty": "1",
                "post_sampling_probs": 1,
            }
        )
    text = str(caught.value)
    for name in (
        "grammar",
        "json_schema",
        "logit_bias[0][1]",
        "logit_bias[1][0]",
        "presence_penalty",
        "frequency_penalty",
        "post_sampling_probs",
    ):
        assert name in text, name
    with pytest.raises(InvalidRequest, match="not both"):
        parse_request({"prompt": "x", "grammar": 'root ::= "a"', "json_schema": {}})


def test_unconstrained_requests_unchanged(completer):
    """Greedy tokens equal the reference's, and no constraint machinery is built for them."""
    case = reference("transformers", "smollm2")["complete"][0]
    fresh = Completer(completer.runner, completer.tokenizer, completer.template)
    result = fresh.complete(
        parse_request({"prompt": case["prompt_tokens"], "n_predict": 8, "temperature": 0})
    )
    assert list(result.tokens) == case["tokens"][:8]
    assert "ll_tokenizer" not in vars(fresh.constraints)  # llguidance's tokenizer was never built


def test_logit_bias_ban_removes_the_greedy_token(completer, tokenizers):
    tok = tokenizers["smollm2"]
    first = complete(completer, n_predict=1).tokens[0]
    for bias in ([[first, False]], [[tok.piece(first), False]], [[first, -1e9]]):
        banned = complete(completer, n_predict=1, logit_bias=bias).tokens[0]
        assert banned != first, bias
    boosted = complete(completer, n_predict=3, logit_bias=[[" zebra", 100]])
    assert set(boosted.tokens) <= set(tok.encode(" zebra")), tok.decode(boosted.tokens)
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        complete(completer, n_predict=1, logit_bias=[[tok.n_vocab, 1.0]])


def test_logit_bias_ban_inside_a_grammar(completer):
    grammar = 'root ::= "yes" | "no"'
    plain = complete(completer, grammar=grammar)
    banned = complete(completer, grammar=grammar, logit_bias=[[plain.tokens[0], False]])
    assert plain.tokens[0] not in banned.tokens and banned.content in ("yes", "no")


def test_n_probs_shape_sorted_and_summing_at_most_one(completer):
    events = []
    complete(completer, events, n_predict=4, n_probs=5)
    for event in events:
        probs = [p.prob for p in event.probs]
        assert len(probs) == 5 and probs == sorted(probs, reverse=True) and sum(probs) <= 1.0 + 1e-9
        assert event.chosen.id == event.probs[0].id == event.id  # greedy: the best raw candidate
        assert event.chosen.logprob == pytest.approx(event.probs[0].logprob)
        assert bytes(event.chosen.bytes) == completer.tokenizer.token_bytes(event.id)
    # post-sampling: the chain's distribution (top-k 3 keeps three tokens; greedy keeps one)
    sampled = []
    complete(
        completer,
        sampled,
        n_predict=4,
        n_probs=5,
        post_sampling_probs=True,
        temperature=1.0,
        top_k=3,
        top_p=1.0,
        min_p=0.0,
        seed=1,
    )
    for event in sampled:
        probs = [p.prob for p in event.probs]
        assert len(probs) == 3 and probs == sorted(probs, reverse=True) and sum(probs) == pytest.approx(1.0)
        assert event.chosen.prob == next(p.prob for p in event.probs if p.id == event.id)
    greedy = []
    complete(completer, greedy, n_predict=2, n_probs=3, post_sampling_probs=True)
    for event in greedy:
        assert [p.prob for p in event.probs] == [1.0, 0.0, 0.0] and event.chosen.prob == 1.0
        assert event.probs[1].logprob == -3.4028234663852886e38  # llama-server's log(0)


def test_constrained_probabilities_are_the_raw_logits(completer):
    """Pre-sampling probabilities are of the raw logits (as llama-server's), so with a grammar they may
    name tokens the grammar forbids, while the token sampled is always allowed."""
    events = []
    result = complete(completer, events, grammar='root ::= "Z"', n_probs=2)
    assert result.content == "Z" and result.tokens == (events[0].id,)
    assert events[0].probs[0].id != events[0].id and events[0].probs[0].prob > events[0].chosen.prob
    assert np.isfinite(events[0].chosen.logprob)
