"""``/infill``: llama-server's checks, errors and fill-in-the-middle prompt layout (infill.py), through
falcon.testing with the in-process fake engine (whose model has FIM tokens with ``fim=True``)."""

from __future__ import annotations

from strata_engine.protocol import FimToken
from strata_server.infill import N_BATCH, SNIPPET_SEPARATOR, extra_context, infill_tokens

from .checks import assert_error, sse_events

BODY = {
    "input_prefix": "def add(a, b):\n    ",
    "input_suffix": "\n\nprint(add(1, 2))\n",
    "n_predict": 5,
    "temperature": 0,
}
NO_FIM = (
    "Infill is not supported by this model: prefix token is missing. suffix token is missing. middle token "
    "is missing. "
)
FIM = {FimToken.PRE: 1001, FimToken.SUF: 1002, FimToken.MID: 1003}


def test_a_model_without_fim_tokens_gets_the_peer_error(make_api):
    client, engine, _ = make_api()
    assert_error(client.simulate_post("/infill", json=BODY), 501, "not_supported_error", NO_FIM)
    assert engine.commands == []  # refused before anything reaches the engine


def test_infill_checks_its_fields_as_the_peer(make_api):
    client, _, _ = make_api(fim=True)
    cases = [
        ({"input_suffix": "x"}, '"input_prefix" is required'),
        ({"input_prefix": "x"}, '"input_suffix" is required'),
        ({**BODY, "prompt": 5}, '"prompt" must be a string'),
        (
            {**BODY, "input_extra": {"text": "x"}},
            '"input_extra" must be an array of {"filename": string, "text": string}',
        ),
        (
            {**BODY, "input_extra": [{"filename": "a.py"}]},
            'extra_context chunk must contain a "text" field with a string value',
        ),
        (
            {**BODY, "input_extra": [{"text": "x", "filename": 3}]},
            'extra_context chunk\'s "filename" field must be a string',
        ),
    ]
    for body, message in cases:
        assert_error(client.simulate_post("/infill", json=body), 400, "invalid_request_error", message)


def test_infill_lays_out_the_prompt_and_generates(make_api):
    client, _, _ = make_api(n_ctx=4096, fim=True)
    extra = [{"filename": "util.py", "text": "def sub(a, b): return a - b"}]
    answer = client.simulate_post("/infill", json={**BODY, "prompt": "return", "input_extra": extra}).json
    # no FIM_SEP/FIM_REP in this model: the snippet separator, then prefix + prompt, suffix, middle
    assert answer["prompt"] == (
        SNIPPET_SEPARATOR
        + extra[0]["text"]
        + "<fim_prefix>"
        + BODY["input_prefix"]
        + "return"
        + "<fim_suffix>"
        + BODY["input_suffix"]
        + "<fim_middle>"
    )
    assert answer["tokens_predicted"] == 5 and answer["stop"] is True and "generation_settings" in answer
    streamed = sse_events(client.simulate_post("/infill", json={**BODY, "stream": True}).text)
    assert streamed[-1]["stop"] is True and "[DONE]" not in streamed
    plain = client.simulate_post("/infill", json=BODY).json
    assert "".join(c["content"] for c in streamed[:-1]) == plain["content"]
    two = client.simulate_post("/infill", json={**BODY, "n": 2}).json
    assert [a["index"] for a in two] == [0, 1] and two[0]["content"] == two[1]["content"] == plain["content"]


def test_the_extra_context_fits_what_the_server_n_predict_leaves(make_api):
    extra = [{"text": "x" * 100}]
    client, _, _ = make_api(n_ctx=4096, fim=True, n_predict=1000)  # 4096 - 2048 - 2 * 1000 = 48 tokens of it
    answer = client.simulate_post("/infill", json={**BODY, "input_extra": extra}).json
    assert answer["prompt"].startswith("x" * 48 + "<fim_prefix>")
    client, _, _ = make_api(n_ctx=2048, fim=True)  # the peer's rule at -c 2048: 2 tokens of it
    assert (
        client.simulate_post("/infill", json={**BODY, "input_extra": extra})
        .json["prompt"]
        .startswith("xx<fim_prefix>")
    )


def test_infill_tokens_cut_as_the_peer():
    prefix, suffix, prompt = list(range(2000)), list(range(3000, 3600)), [7, 8]
    extra = extra_context(
        {**FIM, FimToken.REP: 1004, FimToken.SEP: 1005},
        [{"text": "ab", "filename": "f"}],
        lambda text: [ord(c) for c in text],
    )
    assert extra == [
        1004,
        *map(ord, "myproject\n"),
        1005,
        *map(ord, "f\n"),
        *map(ord, "ab"),
        1005,
        *map(ord, "filename\n"),
    ]
    out = infill_tokens(
        FIM, prefix=prefix, suffix=suffix, prompt=prompt, extra=extra, bos=1, n_predict=-1, n_ctx=N_BATCH + 10
    )
    n_extra, n_prefix, n_suffix = 12, 3 * N_BATCH // 4, N_BATCH // 4 - 2 - len(prompt)
    assert out[:n_extra] == extra[-n_extra:]
    assert out[n_extra : n_extra + 2] == [1, 1001]  # BOS after the extra context, then FIM_PRE
    assert out[n_extra + 2 : n_extra + 2 + n_prefix] == prefix[-n_prefix:]
    rest = out[n_extra + 2 + n_prefix :]
    assert rest == [*prompt, 1002, *suffix[:n_suffix], 1003]
    assert infill_tokens(
        FIM, prefix=[5], suffix=[6], prompt=[], extra=[], bos=None, n_predict=-1, n_ctx=64
    ) == [1001, 5, 1002, 6, 1003]
