"""Every endpoint and documented error through falcon.testing, with the in-process fake engine."""

from __future__ import annotations

import json

import pytest
from strata_server.engine.client import EngineState

from .checks import assert_error, sse_events
from .fake_engine import EOS, greedy_ends_at_eos, tokenize

GREEDY = {"temperature": 0, "n_predict": 8}


# --- health, props, models -------------------------------------------------------------------------


def test_health_ok_and_loading(make_api):
    client, engine, _ = make_api()
    assert client.simulate_get("/health").json == {"status": "ok"}
    assert client.simulate_get("/v1/health").json == {"status": "ok"}
    engine.state = EngineState.STARTING
    assert_error(client.simulate_get("/health"), 503, "unavailable_error", "Loading model")
    for path in ("/props", "/v1/models", "/slots"):
        assert_error(client.simulate_get(path), 503, "unavailable_error", "Loading model")
    assert_error(
        client.simulate_post("/completion", json={"prompt": "x"}), 503, "unavailable_error", "Loading model"
    )


def test_props_and_models(make_api, fake_model):
    client, _, _ = make_api(alias="tiny")
    props = client.simulate_get("/props").json
    assert props["total_slots"] == 1
    assert props["default_generation_settings"]["n_ctx"] == 512
    assert props["model_path"] == str(fake_model)
    assert props["model_alias"] == "tiny"
    assert props["endpoint_metrics"] is False and props["endpoint_slots"] is True
    assert props["bos_token"] == "<|im_start|>" and props["eos_token"] == "<|im_end|>"
    for path in ("/v1/models", "/models"):
        models = client.simulate_get(path).json
        assert models["object"] == "list"
        entry = models["data"][0]
        assert entry["id"] == "tiny" and entry["object"] == "model" and entry["aliases"] == ["tiny"]
        assert entry["meta"]["n_vocab"] == 300 and entry["meta"]["n_ctx"] == 512


def test_unknown_path_is_peer_404(make_api):
    client, _, _ = make_api()
    assert_error(client.simulate_get("/nope"), 404, "not_found_error", "File Not Found")
    assert_error(client.simulate_delete("/completion"), 404, "not_found_error", "File Not Found")


# --- /completion -----------------------------------------------------------------------------------


def test_completion_fields_and_prompt_cache(make_api):
    client, _, _ = make_api()
    first = client.simulate_post("/completion", json={"prompt": "hello world", **GREEDY}).json
    for key in (
        "index",
        "content",
        "tokens",
        "id_slot",
        "stop",
        "model",
        "tokens_predicted",
        "tokens_evaluated",
        "generation_settings",
        "prompt",
        "has_new_line",
        "truncated",
        "stop_type",
        "stopping_word",
        "tokens_cached",
        "timings",
    ):
        assert key in first, key
    assert first["stop"] is True and first["id_slot"] == 0 and first["tokens"] == []
    assert first["prompt"] == "hello world" and first["stop_type"] == "limit"
    assert first["tokens_predicted"] == 8 and first["tokens_evaluated"] == 11
    assert first["timings"]["cache_n"] == 0 and first["timings"]["prompt_n"] == 11
    assert first["generation_settings"]["temperature"] == 0 and first["generation_settings"]["top_k"] == 40
    again = client.simulate_post("/completion", json={"prompt": "hello world", **GREEDY}).json
    # As the peer: an identical prompt re-evaluates exactly one token.
    assert again["timings"]["cache_n"] == 10 and again["timings"]["prompt_n"] == 1
    assert again["content"] == first["content"]


def test_completion_token_prompts_and_return_tokens(make_api):
    client, _, _ = make_api()
    ids = [107, 108]  # "hi"
    body = client.simulate_post("/completion", json={"prompt": ids, "return_tokens": True, **GREEDY}).json
    assert body["prompt"] == "hi" and len(body["tokens"]) == 8
    mixed = client.simulate_post("/completion", json={"prompt": ["say ", 107, 108], "n_predict": 2}).json
    assert mixed["prompt"] == "say hi"
    nested = client.simulate_post("/completion", json={"prompt": [[107, 108]], "n_predict": 1}).json
    assert nested["tokens_evaluated"] == 2
    by_alias = client.simulate_post("/completions", json={"prompt": "x", "max_tokens": 3}).json
    assert by_alias["tokens_predicted"] == 3


def test_completion_stream_framing(make_api):
    client, _, _ = make_api()
    plain = client.simulate_post("/completion", json={"prompt": "stream me", **GREEDY}).json
    client.simulate_post("/completion", json={"prompt": "reset", "n_predict": 1, "cache_prompt": False})
    result = client.simulate_post(
        "/completion", json={"prompt": "stream me", "stream": True, "return_tokens": True, **GREEDY}
    )
    assert result.status_code == 200
    assert result.headers["content-type"].startswith("text/event-stream")
    events = sse_events(result.text)
    assert "[DONE]" not in events  # /completion never sends [DONE]
    partial, final = events[:-1], events[-1]
    assert all(e["stop"] is False and e["id_slot"] == -1 for e in partial)
    assert "".join(e["content"] for e in partial) == plain["content"]
    assert sum(len(e["tokens"]) for e in partial) == 8
    assert (
        final["stop"] is True and final["id_slot"] == 0 and final["content"] == "" and final["tokens"] == []
    )
    assert final["timings"]["predicted_n"] == 8 and final["stop_type"] == "limit"


def test_a_stream_ending_at_a_token_without_text_still_sends_its_id(make_api):
    """The end-of-generation token renders as no text: its id went out with nothing after it (a stream lost
    its last token id whenever a generation ended at EOS, or at the limit on an empty piece)."""
    client, _, _ = make_api()
    prompt = next(p for p in (f"eos {i}" for i in range(1000)) if greedy_ends_at_eos(tokenize(p), 64))
    body = {"prompt": prompt, "temperature": 0, "n_predict": 64, "return_tokens": True, "cache_prompt": False}
    plain = client.simulate_post("/completion", json=body).json
    assert plain["stop_type"] == "eos" and plain["tokens"][-1] == EOS
    events = sse_events(client.simulate_post("/completion", json=body | {"stream": True}).text)
    streamed = [t for e in events[:-1] for t in e["tokens"]]
    assert streamed == plain["tokens"] and events[-1]["tokens_predicted"] == len(streamed)
    forced = body | {"ignore_eos": True, "n_predict": len(plain["tokens"])}  # the limit on the empty piece
    events = sse_events(client.simulate_post("/completion", json=forced | {"stream": True}).text)
    assert [t for e in events[:-1] for t in e["tokens"]] == plain["tokens"]
    assert events[-1]["stop_type"] == "limit"


def test_completion_stop_words_and_probs(make_api):
    client, _, _ = make_api()
    plain = client.simulate_post("/completion", json={"prompt": "abc", **GREEDY, "n_predict": 12}).json
    text = plain["content"]
    word = text[3:5]
    stopped = client.simulate_post(
        "/completion", json={"prompt": "abc", **GREEDY, "n_predict": 12, "stop": [word]}
    ).json
    assert stopped["stop_type"] == "word" and stopped["stopping_word"] == word
    assert stopped["content"] == text[: text.index(word)]
    probs = client.simulate_post("/completion", json={"prompt": "abc", **GREEDY, "n_probs": 3}).json
    entries = probs["completion_probabilities"]
    assert len(entries) == 8 and len(entries[0]["top_logprobs"]) == 3
    assert entries[0]["logprob"] == entries[0]["top_logprobs"][0]["logprob"]


@pytest.mark.parametrize(
    ("body", "message_part"),
    [
        ({}, '"prompt" must be provided'),
        ({"prompt": 5}, '"prompt" must be'),
        ({"prompt": "x", "temperature": "hot"}, "'temperature' must be a number"),
        ({"prompt": "x", "n_predict": 1.5}, "'n_predict' must be an integer"),
        ({"prompt": "x", "stream": "yes"}, "'stream' must be true or false"),
        ({"prompt": "x", "stop": [1]}, "'stop' must be a string or a list of strings"),
        ({"prompt": "x", "id_slot": 2}, "Invalid slot ID"),
        ({"prompt": [1, 999]}, "token id 999 is out of range"),
    ],
)
def test_completion_bad_requests(make_api, body, message_part):
    client, _, _ = make_api()
    error = assert_error(client.simulate_post("/completion", json=body), 400, "invalid_request_error")
    assert message_part in error["message"]


def test_completion_malformed_bodies(make_api):
    client, _, _ = make_api(max_body_bytes=2048)
    for raw in (b"", b"{not json", b"[1, 2]", b"[" * 1000 + b"]" * 1000, b"\xff\xfe", b'{"prompt": NaN}'):
        assert_error(
            client.simulate_post("/completion", body=raw, content_type="application/json"),
            400,
            "invalid_request_error",
        )
    big = json.dumps({"prompt": "x" * 4000})
    assert_error(
        client.simulate_post("/completion", body=big, content_type="application/json"),
        413,
        "invalid_request_error",
    )


def test_unsupported_features_are_501(make_api):
    client, _, _ = make_api()
    neutral = {
        "prompt": "x",
        "n_predict": 1,
        "typical_p": 1.0,
        "mirostat": 0,
        "top_n_sigma": -1,
        "grammar": "",
        "response_format": {"type": "text"},
        "n": 1,
        "samplers": ["top_k"],
        "n_keep": 4,
    }
    assert client.simulate_post("/completion", json=neutral).status_code == 200
    for extra in ({"mirostat": 2}, {"typical_p": 0.5}, {"dry_multiplier": 0.8}, {"t_max_predict_ms": 100}):
        body = {"prompt": "x", **extra}
        assert_error(client.simulate_post("/completion", json=body), 501, "not_supported_error")


def test_exceed_context_is_peer_error(make_api):
    client, _, _ = make_api(n_ctx=64)
    error = assert_error(
        client.simulate_post("/completion", json={"prompt": "y" * 100}), 400, "exceed_context_size_error"
    )
    assert error["n_prompt_tokens"] == 100 and error["n_ctx"] == 64
    assert error["message"] == (
        "request (100 tokens) exceeds the available context size (64 tokens), try increasing it"
    )
    stream = client.simulate_post("/completion", json={"prompt": "y" * 100, "stream": True})
    assert stream.status_code == 400  # before the first token: a plain JSON error, not SSE


# --- OpenAI endpoints ------------------------------------------------------------------------------


def test_v1_completions(make_api):
    client, _, _ = make_api()
    body = client.simulate_post(
        "/v1/completions", json={"prompt": "hello", "max_tokens": 5, "temperature": 0}
    ).json
    assert body["object"] == "text_completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["index"] == 0 and choice["logprobs"] is None
    assert body["usage"] == {
        "completion_tokens": 5,
        "prompt_tokens": 5,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert "timings" in body and "system_fingerprint" in body
    stream = client.simulate_post(
        "/v1/completions", json={"prompt": "hello", "max_tokens": 5, "temperature": 0, "stream": True}
    )
    events = sse_events(stream.text)
    assert events[-1] == "[DONE]"
    last = events[-2]
    assert last["choices"][0]["finish_reason"] == "length" and last["usage"]["completion_tokens"] == 5
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == choice["text"]


def test_chat_completions(make_api):
    client, engine, _ = make_api()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    body = client.simulate_post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0}
    ).json
    assert body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    rendered = engine.engine.render(messages)
    assert body["usage"]["prompt_tokens"] == len(rendered.encode()) - 2 * (len("<|im_start|>") - 1) - 2 * (
        len("<|im_end|>") - 1
    ) - (len("<|im_start|>") - 1)
    alias = client.simulate_post(
        "/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0}
    ).json
    assert alias["choices"][0]["message"]["content"] == message["content"]
    assert alias["usage"]["prompt_tokens_details"]["cached_tokens"] == alias["usage"]["prompt_tokens"] - 1


def test_chat_stream_with_usage(make_api):
    client, _, _ = make_api()
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}
    ]
    plain = client.simulate_post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0}
    ).json
    result = client.simulate_post(
        "/v1/chat/completions",
        json={
            "messages": messages,
            "max_tokens": 6,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    events = sse_events(result.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert events[-1] == "[DONE]"
    usage_chunk, finish_chunk = events[-2], events[-3]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6
    assert (
        finish_chunk["choices"][0]["delta"] == {} and finish_chunk["choices"][0]["finish_reason"] == "length"
    )
    assert "timings" in finish_chunk
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[1:-3])
    assert text == plain["choices"][0]["message"]["content"]
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    no_usage = sse_events(
        client.simulate_post(
            "/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "stream": True}
        ).text
    )
    assert no_usage[-2]["choices"][0]["finish_reason"] is not None  # no usage chunk unless asked


def test_chat_bad_messages(make_api):
    client, _, _ = make_api()
    assert_error(
        client.simulate_post("/v1/chat/completions", json={"messages": []}), 400, "invalid_request_error"
    )
    assert_error(
        client.simulate_post("/v1/chat/completions", json={"messages": [{"content": "x"}]}),
        400,
        "invalid_request_error",
    )
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]}]
    assert_error(
        client.simulate_post("/v1/chat/completions", json={"messages": image}), 501, "not_supported_error"
    )


# --- tokenize / detokenize -------------------------------------------------------------------------


def test_tokenize_detokenize(make_api):
    client, _, _ = make_api()
    assert client.simulate_post("/tokenize", json={"content": "hi"}).json == {"tokens": [107, 108]}
    assert client.simulate_post("/tokenize", json={"content": "hi", "add_special": True}).json == {
        "tokens": [1, 107, 108]
    }
    pieces = client.simulate_post("/tokenize", json={"content": "hé", "with_pieces": True}).json["tokens"]
    assert pieces[0] == {"id": 107, "piece": "h"} and pieces[1]["piece"] == [0xC3]
    assert client.simulate_post("/detokenize", json={"tokens": [107, 108]}).json == {"content": "hi"}
    assert_error(client.simulate_post("/detokenize", json={"tokens": [5000]}), 400, "invalid_request_error")
    assert_error(client.simulate_post("/tokenize", json={"content": 3}), 400, "invalid_request_error")


# --- metrics ---------------------------------------------------------------------------------------


def test_metrics_disabled_is_peer_501(make_api):
    client, _, _ = make_api()
    assert_error(
        client.simulate_get("/metrics"),
        501,
        "not_supported_error",
        "This server does not support metrics endpoint. Start it with `--metrics`",
    )


def test_metrics_counts(make_api, slot_dir):
    client, _, _ = make_api(metrics=True, slot_save_path=str(slot_dir))
    client.simulate_post("/completion", json={"prompt": "count me", "n_predict": 4})
    saved = client.simulate_post("/slots/0", params={"action": "save"}, json={"filename": "m.bin"}).json
    client.simulate_post("/slots/0", params={"action": "restore"}, json={"filename": "missing.bin"})
    result = client.simulate_get("/metrics")
    assert result.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "Process-Start-Time-Unix" in result.headers
    values = {}
    for line in result.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values["llamacpp:prompt_tokens_total"] == 8
    assert values["llamacpp:tokens_predicted_total"] == 4
    # the engine's forward passes (the fake's: one for the prompt, one per token but the last), each one slot's
    assert values["llamacpp:n_decode_total"] == 4 and values["llamacpp:n_busy_slots_per_decode"] == 1
    assert values["strata:slot_saves_total"] == 1
    assert values["strata:slot_save_bytes_total"] == saved["n_written"]
    assert values['strata:slot_restore_refusals_total{reason="not_found"}'] == 1
    assert values["strata:engine_restarts_total"] == 0
    for name in (
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        "llamacpp:n_decode_total",
        "strata:slot_restores_total",
        "strata:slot_restore_milliseconds_total",
    ):
        assert name in values


# --- GET /slots and the single slot ----------------------------------------------------------------


def test_get_slots(make_api):
    client, engine, _ = make_api()
    fresh = client.simulate_get("/slots").json
    assert fresh == [{"id": 0, "n_ctx": 512, "speculative": False, "is_processing": False}]
    client.simulate_post("/completion", json={"prompt": "abc", "n_predict": 3})
    slot = client.simulate_get("/slots").json[0]
    assert slot["n_prompt_tokens"] == 3 and slot["params"]["n_predict"] == 3
    # idle: n_decoded 0, as the peer's
    assert isinstance(slot["next_token"], list) and slot["next_token"][0]["n_decoded"] == 0
    lease = engine.acquire()
    try:
        assert client.simulate_get("/slots").json[0]["is_processing"] is True
        assert_error(
            client.simulate_get("/slots", params={"fail_on_no_slot": "1"}),
            503,
            "unavailable_error",
            "no slot available",
        )
    finally:
        lease.release()


def test_no_slots_flag(make_api):
    client, _, _ = make_api(slots=False)
    assert_error(
        client.simulate_get("/slots"),
        501,
        "not_supported_error",
        "This server does not support slots endpoint. Start it with `--slots`",
    )


def test_busy_slot_waits_bounded_then_503(make_api):
    client, engine, _ = make_api(slot_wait=0.2)
    lease = engine.acquire()
    try:
        error = assert_error(
            client.simulate_post("/completion", json={"prompt": "x"}), 503, "unavailable_error"
        )
        assert "slot 0" in error["message"]
        # What needs no slot does not wait for one.
        for path, body in (
            ("/tokenize", {"content": "x"}),
            ("/detokenize", {"tokens": [100]}),
            ("/apply-template", {"messages": [{"role": "user", "content": "x"}]}),
        ):
            assert client.simulate_post(path, json=body).status_code == 200, path
        for path in ("/props", "/slots", "/health"):
            assert client.simulate_get(path).status_code == 200, path
    finally:
        lease.release()
    assert client.simulate_post("/completion", json={"prompt": "x", "n_predict": 1}).status_code == 200


def test_chat_logprobs(make_api):
    client, _, _ = make_api()
    messages = [{"role": "user", "content": "hi"}]
    body = client.simulate_post(
        "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2},
    ).json
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(len(entry["top_logprobs"]) == 2 for entry in content)
    assert content[0]["logprob"] == content[0]["top_logprobs"][0]["logprob"]
    assert "".join(entry["token"] for entry in content) == body["choices"][0]["message"]["content"]
    stream = sse_events(
        client.simulate_post(
            "/v1/chat/completions",
            json={"messages": messages, "max_tokens": 4, "temperature": 0, "logprobs": True, "stream": True},
        ).text
    )
    streamed = [e["choices"][0]["logprobs"]["content"] for e in stream[1:-2]]
    assert sum(len(c) for c in streamed) == 4 and all(c[0]["top_logprobs"] == [] for c in streamed)
    assert_error(
        client.simulate_post("/v1/chat/completions", json={"messages": messages, "top_logprobs": 3}),
        400,
        "invalid_request_error",
    )
    assert_error(
        client.simulate_post(
            "/v1/chat/completions", json={"messages": messages, "logprobs": True, "top_logprobs": 50}
        ),
        400,
        "invalid_request_error",
    )
    text = client.simulate_post("/v1/completions", json={"prompt": "x", "logprobs": 2, "max_tokens": 3}).json
    entries = text["choices"][0]["logprobs"][
        "content"
    ]  # the peer's shape: OpenAI's integer logprobs = n_probs
    assert len(entries) == 3 and all(len(entry["top_logprobs"]) == 2 for entry in entries)


def test_apply_template(make_api):
    client, engine, _ = make_api()
    messages = [{"role": "user", "content": "hi"}]
    assert client.simulate_post("/apply-template", json={"messages": messages}).json == {
        "prompt": engine.engine.render(messages)
    }
    assert_error(
        client.simulate_post("/apply-template", json={"messages": "x"}), 400, "invalid_request_error"
    )


def test_deeply_nested_json_is_400(make_api):
    client, _, _ = make_api()
    raw = b'{"prompt": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    assert_error(
        client.simulate_post("/completion", body=raw, content_type="application/json"),
        400,
        "invalid_request_error",
    )


# How each engine error kind reaches the client (spec/http-api.md); a kind added to the protocol must be
# added here.
HTTP_OF_ERROR_KIND = {
    "invalid_request": (400, "invalid_request_error"),
    "exceed_context_size": (400, "exceed_context_size_error"),
    "session_refused": (400, "invalid_request_error"),
    "session_write_failed": (500, "server_error"),
    "slot_busy": (503, "unavailable_error"),
    "slot_failed": (500, "server_error"),
    "fail_stop": (500, "server_error"),
    "cancelled": (500, "server_error"),
    "internal": (500, "server_error"),
}


def test_every_engine_error_kind_has_its_http_error():
    from strata_engine.protocol import ErrorKind
    from strata_server.errors import EngineReplyError, to_api_error

    assert set(HTTP_OF_ERROR_KIND) == {k.value for k in ErrorKind}
    for kind, (status, type_name) in HTTP_OF_ERROR_KIND.items():
        body = to_api_error(EngineReplyError({"type": kind, "message": "m", "reason": "r"})).body()["error"]
        assert (body["code"], body["type"]) == (status, type_name), kind
    unknown = to_api_error(EngineReplyError({"type": "from_a_newer_engine", "message": "m"}))
    assert unknown.status == 500


def test_json_object_prompts_are_llama_server_s(make_api):
    """{"prompt_string": TEXT} is a prompt (alone or in a list), as llama-server b11549 takes it; with media
    it is 501 (text models only); an object without a prompt string (an OpenAI content part) is llama-server's
    400."""
    client, _, _ = make_api()
    plain = client.simulate_post("/completion", json={"prompt": "hello", **GREEDY}).json
    one = client.simulate_post("/completion", json={"prompt": {"prompt_string": "hello"}, **GREEDY}).json
    assert one["content"] == plain["content"] and one["tokens_evaluated"] == plain["tokens_evaluated"]
    listed = client.simulate_post(
        "/completion", json={"prompt": [{"prompt_string": "hello"}, "hi"], **GREEDY}
    )
    assert [a["content"] for a in listed.json][0] == plain["content"]
    media = {"prompt_string": "<__media__>", "multimodal_data": ["aGk="]}
    assert_error(client.simulate_post("/completion", json={"prompt": media}), 501, "not_supported_error")
    part = {"type": "text", "text": "hello"}
    for prompt in (part, [part]):
        error = assert_error(
            client.simulate_post("/completion", json={"prompt": prompt}), 400, "invalid_request_error"
        )
        assert "a JSON object containing a prompt string" in error["message"]
