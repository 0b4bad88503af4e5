"""``/embeddings`` and ``/v1/embeddings`` with ``--embedding``: llama-server's checks, errors and both answer
shapes, through falcon.testing with the in-process fake engine (which speaks EMBED)."""

from __future__ import annotations

import base64
import math
import struct

import pytest
from strata_server import build_config
from strata_server.cli import load_config
from strata_server.config import ConfigError

from .checks import assert_error
from .fake_engine import N_EMBD

DISABLED = "This server does not support embeddings. Start it with `--embeddings`"


def norm(v: list[float]) -> float:
    return math.sqrt(sum(x * x for x in v))


def n_tokens(client, text: str) -> int:
    """Tokens of an input, as embeddings count them (the model's special tokens added)."""
    return len(client.simulate_post("/tokenize", json={"content": text, "add_special": True}).json["tokens"])


def test_without_the_flag_every_route_is_the_peer_501(make_api):
    client, engine, _ = make_api()
    for path in ("/embedding", "/embeddings", "/v1/embeddings"):
        assert_error(client.simulate_post(path, json={"input": "hi"}), 501, "not_supported_error", DISABLED)
    assert engine.commands == []


def test_native_answer_pooled_and_per_token(make_api):
    client, _, _ = make_api(embedding=True, pooling="mean")
    body = client.simulate_post("/embeddings", json={"content": "hello"}).json
    assert [item["index"] for item in body] == [0]
    (vector,) = body[0]["embedding"]  # pooled: one vector
    assert len(vector) == N_EMBD and norm(vector) == pytest.approx(1.0)
    client, _, _ = make_api(embedding=True)  # the fake model's own pooling: none
    per_token = client.simulate_post("/embedding", json={"content": "hello"}).json[0]["embedding"]
    assert len(per_token) == n_tokens(client, "hello") and all(len(row) == N_EMBD for row in per_token)
    assert_error(
        client.simulate_post("/v1/embeddings", json={"input": "hello"}),
        400,
        "invalid_request_error",
        "Pooling type 'none' is not OAI compatible. Please use a different pooling type",
    )


def test_openai_answer(make_api):
    client, _, _ = make_api(embedding=True, pooling="last", alias="tiny")
    body = client.simulate_post("/v1/embeddings", json={"input": ["hello", "hello", "world!"]}).json
    assert body["object"] == "list" and body["model"] == "tiny"
    total = sum(n_tokens(client, text) for text in ("hello", "hello", "world!"))
    assert body["usage"] == {"prompt_tokens": total, "total_tokens": total}
    data = body["data"]
    assert [(d["index"], d["object"]) for d in data] == [(0, "embedding"), (1, "embedding"), (2, "embedding")]
    assert all(len(d["embedding"]) == N_EMBD and norm(d["embedding"]) == pytest.approx(1.0) for d in data)
    assert data[0]["embedding"] == data[1]["embedding"] != data[2]["embedding"]
    assert client.simulate_post("/v1/embeddings", json={"input": "x", "model": "m"}).json["model"] == "m"
    coded = client.simulate_post("/v1/embeddings", json={"input": "hello", "encoding_format": "base64"}).json
    item = coded["data"][0]
    assert item["encoding_format"] == "base64"
    decoded = struct.unpack(f"<{N_EMBD}f", base64.b64decode(item["embedding"]))
    assert decoded == pytest.approx(data[0]["embedding"], abs=1e-7)
    native = client.simulate_post("/v1/embeddings", json={"content": "hello"}).json  # the peer's own field
    assert native == [{"index": 0, "embedding": [data[0]["embedding"]]}]


def test_embd_normalize(make_api):
    client, _, _ = make_api(embedding=True, pooling="mean")

    def vector(p: int) -> list[float]:
        return client.simulate_post("/embeddings", json={"content": "abc", "embd_normalize": p}).json[0][
            "embedding"
        ][0]

    raw, taxicab = vector(-1), vector(1)
    assert norm(raw) != pytest.approx(1.0) and sum(map(abs, taxicab)) == pytest.approx(1.0)
    assert max(map(abs, vector(0))) == pytest.approx(32760.0)
    assert vector(2) == pytest.approx([x / norm(raw) for x in raw])


def test_checks_in_the_peer_order(make_api):
    client, _, _ = make_api(embedding=True, pooling="cls")
    assert_error(
        client.simulate_post("/v1/embeddings", json={"prompt": "x"}),
        400,
        "invalid_request_error",
        '"input" or "content" must be provided',
    )
    assert_error(
        client.simulate_post("/v1/embeddings", json={"input": "x", "encoding_format": "hex"}),
        400,
        "invalid_request_error",
        "The format to return the embeddings in. Can be either float or base64",
    )
    assert_error(
        client.simulate_post("/v1/embeddings", json={"input": ["x", []]}),
        400,
        "invalid_request_error",
        "Input content cannot be empty",
    )
    assert_error(
        client.simulate_post("/v1/embeddings", json={"input": [1, 999]}), 400, "invalid_request_error"
    )
    assert_error(
        client.simulate_post("/v1/embeddings", json={"input": "x", "embd_normalize": "2"}),
        400,
        "invalid_request_error",
    )


def test_embeddings_leave_the_conversation_alone(make_api):
    client, engine, _ = make_api(embedding=True, pooling="mean")
    first = client.simulate_post(
        "/completion", json={"prompt": "hello world", "n_predict": 4, "temperature": 0}
    ).json
    held = list(engine.slot_engines[0].held)
    client.simulate_post("/v1/embeddings", json={"input": ["something else entirely", "more"]})
    assert engine.slot_engines[0].held == held
    again = client.simulate_post(
        "/completion", json={"prompt": "hello world", "n_predict": 4, "temperature": 0}
    ).json
    assert again["timings"]["cache_n"] == len("hello world") - 1 and again["content"] == first["content"]


def test_the_flags_as_llama_servers(fake_model):
    for flag in ("--embedding", "--embeddings"):
        config = load_config(["--model", str(fake_model), flag, "--pooling", "cls"])
        assert config.embedding and config.pooling == "cls"
    assert not load_config(["--model", str(fake_model)]).embedding
    with pytest.raises(ConfigError, match="pooling: 'rank' is not one of none, mean, cls, last"):
        build_config({}, {"model": str(fake_model), "pooling": "rank"})


def test_embedding_inputs_as_llama_server_takes_them(make_api):
    """/embeddings' content as a {"prompt_string": ...} object is a text (b11549 answers it 200); a list of
    OpenAI content parts is llama-server's 400, not a 501."""
    client, _, _ = make_api(embedding=True, pooling="last")
    plain = client.simulate_post("/embeddings", json={"content": "hello"})
    wrapped = client.simulate_post("/embeddings", json={"content": {"prompt_string": "hello"}})
    assert wrapped.status_code == 200 and wrapped.json == plain.json
    parts = {"content": [{"type": "text", "text": "hello"}]}
    assert_error(client.simulate_post("/embeddings", json=parts), 400, "invalid_request_error")
