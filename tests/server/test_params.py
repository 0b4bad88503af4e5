"""Request fields -> the engine's COMPLETE fields: logit_bias in both of the peer's shapes, structured output
from response_format / json_schema / grammar, OpenAI's logprobs; and the peer's probability shapes in the
responses (through falcon.testing with the in-process fake engine)."""

from __future__ import annotations

import pytest
from strata_server.errors import ApiError
from strata_server.params import parse_constraint, parse_logit_bias, parse_options

from .checks import assert_error

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def test_logit_bias_shapes_as_the_peer():
    openai = parse_logit_bias(
        {"15": -100, "hello": False, " 7": 2, "-3": 1, "9": True, "99999": 5, "x": "y"}, n_vocab=1000
    )
    assert openai == ((15, -100.0), ("hello", False), (7, 2.0))  # -3, 99999 out of range; true, "y" skipped
    pairs = parse_logit_bias(
        [[15, -1.5], ["hi", False], [2000, 1], [1, 2, 3], "x", [True, 1], [4, None]], n_vocab=1000
    )
    assert pairs == ((15, -1.5), ("hi", False))
    assert parse_logit_bias(None, 10) == () and parse_logit_bias({}, 10) == ()
    with pytest.raises(ApiError, match="logit_bias"):
        parse_logit_bias("15", 10)
    options = parse_options({"logit_bias": {"5": False}}, n_vocab=10)
    assert options.engine_fields()["logit_bias"] == [[5, False]]
    assert options.settings()["logit_bias"] == [{"bias": None, "token": 5}]  # the peer reports -inf as null


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"response_format": {"type": "json_object"}}, {"json_schema": {"type": "object"}}),
        (
            {"response_format": {"type": "json_object", "schema": SCHEMA}},
            {"json_schema": SCHEMA},
        ),  # the peer's shape
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            {"json_schema": SCHEMA},
        ),  # OpenAI's shape
        ({"response_format": {"type": "json_schema", "schema": SCHEMA}}, {"json_schema": SCHEMA}),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, {"json_schema": {}}),
        ({"response_format": {"type": "text"}, "json_schema": SCHEMA}, {"json_schema": SCHEMA}),
        (
            {"response_format": {"type": "json_object"}, "json_schema": SCHEMA},
            {"json_schema": {"type": "object"}},
        ),
        ({"json_schema": {}}, {"json_schema": {}}),
        ({"grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
        ({"grammar": ""}, {}),
        ({}, {}),
    ],
)
def test_structured_output_fields(body, expected):
    assert parse_constraint(body, chat=True) == expected
    assert parse_options(body, chat=True).engine_fields() == expected


def test_structured_output_refusals():
    with pytest.raises(ApiError, match='must be one of "text" or "json_object", but got: yaml'):
        parse_constraint({"response_format": {"type": "yaml"}}, chat=False)
    with pytest.raises(ApiError, match="Cannot use both json_schema and grammar"):
        parse_constraint({"json_schema": SCHEMA, "grammar": 'root ::= "a"'}, chat=True)
    # the completion endpoints take the grammar, as the peer does
    assert parse_constraint({"json_schema": SCHEMA, "grammar": 'root ::= "a"'}, chat=False) == {
        "grammar": 'root ::= "a"'
    }
    for body in ({"grammar": 5}, {"json_schema": "{}"}, {"response_format": "json"}):
        with pytest.raises(ApiError):
            parse_constraint(body, chat=False)


def test_openai_logprobs_on_completions_and_sampling_fields():
    options = parse_options(
        {
            "logprobs": 3,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.25,
            "repeat_penalty": 1.1,
            "post_sampling_probs": True,
        }
    )
    assert options.sampling == {
        "n_probs": 3,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "repeat_penalty": 1.1,
        "post_sampling_probs": True,
    }
    assert parse_options({"logprobs": 3, "n_probs": 5}).sampling["n_probs"] == 5  # n_probs wins, as the peer
    with pytest.raises(ApiError, match="'presence_penalty' must be a number"):
        parse_options({"presence_penalty": "high"})


def test_post_sampling_probs_shape(make_api):
    client, _, _ = make_api()
    body = client.simulate_post(
        "/completion",
        json={"prompt": "abc", "temperature": 0, "n_predict": 3, "n_probs": 2, "post_sampling_probs": True},
    ).json
    entry = body["completion_probabilities"][0]
    assert set(entry) == {"id", "token", "bytes", "prob", "top_probs"}
    assert set(entry["top_probs"][0]) == {"id", "token", "bytes", "prob"} and len(entry["top_probs"]) == 2
    plain = client.simulate_post(
        "/completion", json={"prompt": "abc", "temperature": 0, "n_predict": 3, "n_probs": 2}
    ).json["completion_probabilities"][0]
    assert set(plain) == {"id", "token", "bytes", "logprob", "top_logprobs"}
    assert plain["token"].encode() == bytes(plain["bytes"])
    chat = client.simulate_post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n_probs": 3},
    ).json
    assert len(chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3  # n_probs on chat too
    assert_error(
        client.simulate_post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}},
        ),
        400,
        "invalid_request_error",
    )
