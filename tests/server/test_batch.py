"""Several prompts and ``n`` choices in one request (batch.py), as llama-server answers them: shapes, order,
indexes, seeds, streaming, through falcon.testing with the in-process fake engine."""

from __future__ import annotations

from strata_server.batch import MAX_TASKS

from .checks import assert_error, sse_events

GREEDY = {"temperature": 0, "n_predict": 6}


def post(client, path: str, body: dict):
    result = client.simulate_post(path, json=body)
    assert result.status_code == 200, result.text
    return result.json


def test_a_list_of_prompts_answers_a_list_in_order(make_api):
    client, engine, _ = make_api()
    singles = [post(client, "/completion", {"prompt": p, **GREEDY}) for p in ("abc", "hello")]
    engine.commands.clear()
    answers = post(client, "/completion", {"prompt": ["abc", "hello"], **GREEDY})
    assert isinstance(answers, list) and [a["index"] for a in answers] == [0, 1]
    assert [a["prompt"] for a in answers] == ["abc", "hello"]
    assert [a["content"] for a in answers] == [s["content"] for s in singles]
    # the first prompt tokenized before the slot is taken (a prompt too long is refused without waiting for
    # it), then one COMPLETE after another on the slot
    assert engine.commands == ["PROMPT_TOKENS", "COMPLETE", "COMPLETE"]
    # token lists and mixed lists are prompts too; a single prompt in a list answers one object
    mixed = post(client, "/completion", {"prompt": [[100, 101, 102], [100, "bc"]], **GREEDY})
    assert [a["content"] for a in mixed] == [singles[0]["content"]] * 2
    assert post(client, "/completion", {"prompt": ["abc"], **GREEDY})["content"] == singles[0]["content"]
    assert post(client, "/completion", {"prompt": [100, "bc"], **GREEDY})["content"] == singles[0]["content"]


def test_prompt_lists_are_checked(make_api):
    client, _, _ = make_api()
    for bad in (["a", 3.5], ["a", True], [["a"]], [[1, 2], 7.0], [[1, 999]]):
        assert_error(client.simulate_post("/completion", json={"prompt": bad}), 400, "invalid_request_error")
    # llama-server's JSON object prompt is one of the list's prompts; with media it is 501 (text models only)
    listed = client.simulate_post(
        "/completion", json={"prompt": ["a", {"prompt_string": "b"}], "n_predict": 2}
    )
    assert listed.status_code == 200 and [a["prompt"] for a in listed.json] == ["a", "b"]
    media = {"prompt_string": "b", "multimodal_data": ["aGk="]}
    assert_error(
        client.simulate_post("/completion", json={"prompt": ["a", media]}), 501, "not_supported_error"
    )
    too_many = {"prompt": ["a"] * (MAX_TASKS // 2 + 1), "n": 2}
    assert_error(client.simulate_post("/completion", json=too_many), 400, "invalid_request_error")
    assert_error(
        client.simulate_post("/completion", json={"prompt": "a", "n": "2"}), 400, "invalid_request_error"
    )


def test_n_choices_on_the_openai_endpoints(make_api):
    client, engine, _ = make_api()
    messages = [{"role": "user", "content": "hi"}]
    chat = post(
        client, "/v1/chat/completions", {"messages": messages, "n": 2, "max_tokens": 5, "temperature": 0}
    )
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    # greedy: both choices are the same text
    assert chat["choices"][0]["message"] == chat["choices"][1]["message"]
    assert chat["usage"]["completion_tokens"] == 5  # usage and timings are the first task's, as the peer's
    text = post(client, "/v1/completions", {"prompt": ["ab", "cd"], "n": 2, **GREEDY})
    assert [c["index"] for c in text["choices"]] == [0, 1, 2, 3]
    assert text["choices"][0]["text"] == text["choices"][1]["text"]
    assert text["choices"][2]["text"] == text["choices"][3]["text"]
    assert (
        text["choices"][0]["text"]
        == post(client, "/v1/completions", {"prompt": "ab", **GREEDY})["choices"][0]["text"]
    )
    native = post(client, "/completion", {"prompt": "ab", "n_cmpl": 3, **GREEDY})
    assert [a["index"] for a in native] == [0, 1, 2] and len({a["content"] for a in native}) == 1
    # each later choice reuses the prompt its predecessor left in the slot
    assert all(a["timings"]["cache_n"] == a["tokens_evaluated"] - 1 for a in native[1:])
    engine.commands.clear()
    assert "choices" in post(client, "/v1/completions", {"prompt": "ab", "n": 0, **GREEDY})  # below 1: one
    assert engine.commands == ["PROMPT_TOKENS", "COMPLETE"]


def test_choices_are_seeded_as_the_peer_seeds_child_tasks(make_api):
    client, _, _ = make_api()
    body = {"prompt": "hello", "n": 3, "seed": 42, "temperature": 1.0, "n_predict": 12}
    first = post(client, "/completion", body)
    assert [a["generation_settings"]["seed"] for a in first] == [42, 43, 44]
    assert [a["content"] for a in post(client, "/completion", body)] == [
        a["content"] for a in first
    ]  # reproducible
    alone = post(client, "/completion", {**body, "n": 1, "seed": 43})
    assert alone["content"] == first[1]["content"]  # choice j samples with seed + j
    assert len({a["content"] for a in first}) > 1


def test_streamed_choices_carry_their_index(make_api):
    client, _, _ = make_api()
    messages = [{"role": "user", "content": "hi"}]
    events = sse_events(
        client.simulate_post(
            "/v1/chat/completions",
            json={
                "messages": messages,
                "n": 2,
                "max_tokens": 4,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ).text
    )
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = events[:-1]
    indexes = [c["choices"][0]["index"] for c in chunks if c["choices"]]
    assert indexes == sorted(indexes) and set(indexes) == {0, 1}  # the choices run one after another
    for index in (0, 1):
        own = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert (
            own[0]["delta"] == {"role": "assistant", "content": None} and own[-1]["finish_reason"] == "length"
        )
    assert sum(1 for c in chunks if not c["choices"]) == 2  # each task's usage chunk
    assert len({c["id"] for c in chunks}) == 1  # one completion id

    native = sse_events(
        client.simulate_post("/completion", json={"prompt": ["ab", "cd"], **GREEDY, "stream": True}).text
    )
    assert "[DONE]" not in native
    finals = [c for c in native if c["stop"]]
    assert [f["index"] for f in finals] == [0, 1] and [f["prompt"] for f in finals] == ["ab", "cd"]
    joined = {i: "".join(c["content"] for c in native if not c["stop"] and c["index"] == i) for i in (0, 1)}
    plain = post(client, "/completion", {"prompt": ["ab", "cd"], **GREEDY})
    assert joined == {0: plain[0]["content"], 1: plain[1]["content"]}


def test_a_failing_task_fails_the_request(make_api):
    client, _, _ = make_api(n_ctx=64)
    assert_error(
        client.simulate_post("/completion", json={"prompt": ["ab", "y" * 100], **GREEDY}),
        400,
        "exceed_context_size_error",
    )
    events = sse_events(
        client.simulate_post("/completion", json={"prompt": ["ab", "y" * 100], **GREEDY, "stream": True}).text
    )
    assert events[-1]["error"]["type"] == "exceed_context_size_error"  # after the first task's chunks
    assert any(e.get("stop") for e in events[:-1])
