"""Structured output and the sampling request fields through the real server, engine and model: the OpenAI
SDK's response_format with a JSON schema, a GBNF grammar on /completion (plain and streamed), the peer's
400 for an invalid schema or grammar, logit_bias bans in both of the peer's shapes, and the probabilities
in the peer's shapes."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import requests

from .servers import start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PERSON = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "pets"],
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "maxItems": 2, "items": {"enum": ["cat", "dog", "fish"]}},
    },
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
YES_NO = 'root ::= answer ", " [0-9] [0-9]?\nanswer ::= "yes" | "no"'


@pytest.fixture(scope="module")
def server(module_tmp):
    proc = start_server(module_tmp, "--alias", "smollm2")
    yield proc
    assert proc.stop() == 0


def post(server, path: str, body: dict, **kwargs) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=300, **kwargs)


def test_openai_sdk_response_format_json_schema(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    reply = client.chat.completions.create(
        model="smollm2",
        messages=ASK,
        max_tokens=80,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    any_object = client.chat.completions.create(
        model="smollm2",
        messages=ASK,
        max_tokens=80,
        temperature=0.7,
        seed=5,
        response_format={"type": "json_object"},
    )
    if any_object.choices[0].finish_reason == "stop":  # an open object may run past max_tokens
        assert isinstance(json.loads(any_object.choices[0].message.content), dict)


def test_grammar_on_completion_plain_and_streamed(server):
    prompt = "<|im_start|>user\nIs the sky blue? Answer and rate 0-99.<|im_end|>\n<|im_start|>assistant\n"
    body = post(
        server, "/completion", {"prompt": prompt, "grammar": YES_NO, "n_predict": 16, "temperature": 0}
    ).json()
    assert body["stop_type"] == "eos" and re.fullmatch(r"(yes|no), [0-9]{1,2}", body["content"]), body[
        "content"
    ]
    with post(
        server,
        "/completion",
        {"prompt": prompt, "grammar": YES_NO, "n_predict": 16, "temperature": 0, "stream": True},
        stream=True,
    ) as response:
        events = [json.loads(f[6:]) for f in response.content.decode().split("\n\n") if f]
    assert "".join(e["content"] for e in events[:-1]) == body["content"]
    schema = post(
        server,
        "/v1/completions",
        {"prompt": prompt, "json_schema": PERSON, "max_tokens": 80, "temperature": 0},
    ).json()
    jsonschema.validate(json.loads(schema["choices"][0]["text"]), PERSON)


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        (
            "/completion",
            {"prompt": "x", "json_schema": {"type": "frobnicate"}},
            '"json_schema": JSON schema conversion failed:',
        ),
        (
            "/v1/chat/completions",
            {
                "messages": ASK,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}},
                    },
                },
            },
            '"json_schema": JSON schema conversion failed:',
        ),
        (
            "/completion",
            {"prompt": "x", "grammar": 'root ::= "a" ('},
            "Failed to initialize samplers: failed to parse grammar",
        ),
        (
            "/v1/chat/completions",
            {"messages": ASK, "grammar": "answer ::= [0-9]", "stream": True},
            "Failed to initialize samplers: failed to parse grammar",
        ),
        (
            "/v1/chat/completions",
            {"messages": ASK, "json_schema": PERSON, "grammar": YES_NO},
            "Cannot use both json_schema and grammar",
        ),
    ],
)
def test_invalid_schema_or_grammar_is_the_peers_400(server, path, body, message):
    response = post(server, path, body)
    assert response.status_code == 400 and response.headers["Content-Type"].startswith("application/json")
    error = response.json()["error"]
    assert (
        error["code"] == 400
        and error["type"] == "invalid_request_error"
        and error["message"].startswith(message)
    )
    assert (
        post(server, "/completion", {"prompt": "Hello", "n_predict": 1}).status_code == 200
    )  # still serving


def test_logit_bias_ban_in_both_shapes(server):
    chat = {
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 1,
        "temperature": 0,
        "n_probs": 1,
    }
    first = post(server, "/v1/chat/completions", chat).json()["choices"][0]["logprobs"]["content"][0]["id"]
    for bias in ({str(first): -100}, {str(first): False}, [[first, False]]):
        again = post(server, "/v1/chat/completions", {**chat, "logit_bias": bias}).json()
        assert again["choices"][0]["logprobs"]["content"][0]["id"] != first, bias
        assert {"bias": None if bias != {str(first): -100} else -100.0, "token": first} in post(
            server, "/completion", {"prompt": "Hi", "n_predict": 1, "logit_bias": bias}
        ).json()["generation_settings"]["logit_bias"]


def test_probabilities_in_the_peers_shapes(server):
    body = post(
        server,
        "/completion",
        {"prompt": "The capital of France is", "n_predict": 3, "temperature": 0, "n_probs": 4},
    ).json()
    for entry in body["completion_probabilities"]:
        logprobs = [t["logprob"] for t in entry["top_logprobs"]]
        assert len(logprobs) == 4 and logprobs == sorted(logprobs, reverse=True)
        assert sum(2.718281828459045**lp for lp in logprobs) <= 1.0 + 1e-9
        assert entry["id"] == entry["top_logprobs"][0]["id"] and entry["logprob"] == logprobs[0]
        assert bytes(entry["bytes"]).decode() == entry["token"]
    post_sampling = post(
        server,
        "/completion",
        {
            "prompt": "The capital of France is",
            "n_predict": 2,
            "temperature": 1.0,
            "top_k": 3,
            "top_p": 1.0,
            "min_p": 0.0,
            "seed": 1,
            "n_probs": 4,
            "post_sampling_probs": True,
        },
    ).json()
    for entry in post_sampling["completion_probabilities"]:
        probs = [t["prob"] for t in entry["top_probs"]]
        assert len(probs) == 3 and abs(sum(probs) - 1.0) < 1e-6 and probs == sorted(probs, reverse=True)
    text = post(
        server,
        "/v1/completions",
        {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0, "logprobs": 2},
    ).json()
    assert [len(e["top_logprobs"]) for e in text["choices"][0]["logprobs"]["content"]] == [2, 2]
