"""Embeddings through the real server, engine and SmolLM2 with --embedding: OpenAI's shape on /v1/embeddings
(the SDK included), llama-server's on /embeddings, the model's n_embd, unit norm, determinism, the model's
default pooling (none), and the slot's conversation left as it was."""

from __future__ import annotations

import math

import openai
import pytest
import requests

from .servers import start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

N_EMBD = 576  # SmolLM2-135M's embedding length


@pytest.fixture(scope="module")
def server(module_tmp):
    proc = start_server(module_tmp, "--embedding", "--pooling", "mean", name="embeddings")
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def default_pooling_server(module_tmp):
    proc = start_server(module_tmp, "--embeddings", name="embeddings-default")
    yield proc
    assert proc.stop() == 0


def post(server, path: str, body: dict):
    response = requests.post(server.url + path, json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def norm(vector: list[float]) -> float:
    return math.sqrt(sum(x * x for x in vector))


def test_openai_embeddings_with_the_sdk(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    texts = ["The cat sat on the mat.", "The cat sat on the mat.", "Quarterly revenue grew by four percent."]
    reply = client.embeddings.create(model="smollm2", input=texts)
    vectors = [item.embedding for item in reply.data]
    assert [item.index for item in reply.data] == [0, 1, 2]
    assert all(len(v) == N_EMBD and norm(v) == pytest.approx(1.0, abs=1e-4) for v in vectors)
    assert vectors[0] == vectors[1]  # identical inputs, identical vectors
    assert max(abs(a - b) for a, b in zip(vectors[0], vectors[2], strict=True)) > 1e-3
    assert reply.usage.prompt_tokens > 0
    meta = requests.get(server.url + "/v1/models", timeout=30).json()["data"][0]["meta"]
    assert meta["n_embd"] == N_EMBD


def test_native_embeddings(server):
    answer = post(server, "/embeddings", {"content": "Hello there"})
    assert len(answer) == 1 and answer[0]["index"] == 0
    (vector,) = answer[0]["embedding"]
    openai_shape = post(server, "/v1/embeddings", {"input": "Hello there"})["data"][0]["embedding"]
    assert vector == openai_shape and len(vector) == N_EMBD


def test_embeddings_leave_the_conversation_in_the_slot(server):
    prompt = {"prompt": "The capital of France is", "n_predict": 4, "temperature": 0}
    first = post(server, "/completion", prompt)
    post(
        server,
        "/v1/embeddings",
        {"input": ["Something else entirely, and longer than the prompt above.", "x"]},
    )
    again = post(server, "/completion", prompt)
    assert again["timings"]["cache_n"] == again["tokens_evaluated"] - 1  # the held prompt was reused
    assert again["content"] == first["content"]


def test_the_models_default_pooling_is_none(default_pooling_server):
    tokens = post(default_pooling_server, "/tokenize", {"content": "Hello there", "add_special": True})[
        "tokens"
    ]
    per_token = post(default_pooling_server, "/embeddings", {"content": "Hello there"})[0]["embedding"]
    assert len(per_token) == len(tokens) and all(len(row) == N_EMBD for row in per_token)
    response = requests.post(
        default_pooling_server.url + "/v1/embeddings", json={"input": "Hello"}, timeout=60
    )
    assert response.status_code == 400
    assert (
        response.json()["error"]["message"]
        == "Pooling type 'none' is not OAI compatible. Please use a different pooling type"
    )
