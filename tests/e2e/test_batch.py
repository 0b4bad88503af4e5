"""Several prompts and `n` choices in one request through the real server, engine and SmolLM2: answered
as llama-server answers them, the tasks run one after another on the slot."""

from __future__ import annotations

import json

import openai
import pytest
import requests

from .servers import start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

GREEDY = {"temperature": 0, "n_predict": 6}
MESSAGES = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def server(module_tmp):
    proc = start_server(module_tmp, name="batch")
    yield proc
    assert proc.stop() == 0


def post(server, path: str, body: dict):
    response = requests.post(server.url + path, json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_list_of_two_prompts_gives_two_results_in_order(server):
    prompts = ["The capital of France is", "One, two, three,"]
    singles = [post(server, "/completion", {"prompt": p, **GREEDY})["content"] for p in prompts]
    assert singles[0] != singles[1]
    both = post(server, "/completion", {"prompt": prompts, **GREEDY})
    assert [r["index"] for r in both] == [0, 1] and [r["prompt"] for r in both] == prompts
    assert [r["content"] for r in both] == singles
    text = post(server, "/v1/completions", {"prompt": prompts, "max_tokens": 6, "temperature": 0})
    assert [(c["index"], c["text"]) for c in text["choices"]] == list(enumerate(singles))


def test_n_two_greedy_choices_are_identical(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="smollm2", messages=MESSAGES, n=2, max_tokens=6, temperature=0
    )
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].message.content == reply.choices[1].message.content
    assert reply.choices[0].message.content


def test_n_two_sampled_choices_follow_the_seed(server):
    body = {
        "messages": MESSAGES,
        "n": 2,
        "max_tokens": 12,
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "seed": 7,
    }
    first = post(server, "/v1/chat/completions", body)
    again = post(server, "/v1/chat/completions", body)
    texts = [c["message"]["content"] for c in first["choices"]]
    assert texts == [c["message"]["content"] for c in again["choices"]]  # reproducible with a seed
    # choice j samples with seed + j, as llama-server's child tasks
    second_alone = post(server, "/v1/chat/completions", {**body, "n": 1, "seed": 8})
    assert second_alone["choices"][0]["message"]["content"] == texts[1]


def test_streamed_choices_carry_their_index(server):
    body = {"messages": MESSAGES, "n": 2, "max_tokens": 6, "temperature": 0}
    plain = post(server, "/v1/chat/completions", body)
    response = requests.post(
        server.url + "/v1/chat/completions", json={**body, "stream": True}, stream=True, timeout=300
    )
    assert response.status_code == 200
    chunks = [
        line[len("data: ") :]
        for line in response.iter_lines(decode_unicode=True)
        if line.startswith("data: ")
    ]
    assert chunks[-1] == "[DONE]" and chunks.count("[DONE]") == 1
    texts = {0: "", 1: ""}
    for chunk in map(json.loads, chunks[:-1]):
        choice = chunk["choices"][0]
        texts[choice["index"]] += choice["delta"].get("content") or ""
    assert texts == {c["index"]: c["message"]["content"] for c in plain["choices"]}
