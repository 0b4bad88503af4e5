"""/infill through the real server and engine: llama-server's refusal on the packaged SmolLM2 (it has no
prefix/suffix/middle tokens), and its fill-in-the-middle layout and generation on a copy of SmolLM2 whose
vocabulary names three control tokens <fim_prefix>, <fim_suffix>, <fim_middle> (weights unchanged)."""

from __future__ import annotations

import json

import pytest
import requests
from support.gguf_variants import SMOLLM2_FIM_NAMES, with_renamed_tokens

from .servers import start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BODY = {
    "input_prefix": "def add(a, b):\n    ",
    "input_suffix": "\n\nprint(add(1, 2))\n",
    "n_predict": 8,
    "temperature": 0,
}
NO_FIM = (
    "Infill is not supported by this model: prefix token is missing. suffix token is missing. middle token "
    "is missing. "
)


@pytest.fixture(scope="module")
def plain_server(module_tmp):
    proc = start_server(module_tmp, name="plain")
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def fim_server(module_tmp, smollm2_path):
    model = with_renamed_tokens(smollm2_path, module_tmp / "smollm2-fim.gguf", SMOLLM2_FIM_NAMES)
    # -c 4096: the peer keeps n_ctx - 2048 - 2 n_predict tokens of extra context, all of it here
    proc = start_server(module_tmp, "-m", str(model), "-c", "4096", name="fim")
    yield proc
    assert proc.stop() == 0


def test_a_model_without_fim_tokens_is_refused_as_the_peer(plain_server):
    response = requests.post(plain_server.url + "/infill", json=BODY, timeout=60)
    assert response.status_code == 501
    assert response.json() == {"error": {"code": 501, "message": NO_FIM, "type": "not_supported_error"}}
    after = requests.post(
        plain_server.url + "/completion", json={"prompt": "def", "n_predict": 2}, timeout=120
    )
    assert after.status_code == 200  # it keeps serving


def test_infill_lays_out_the_prompt_and_generates(fim_server):
    extra = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}]
    response = requests.post(fim_server.url + "/infill", json={**BODY, "input_extra": extra}, timeout=300)
    assert response.status_code == 200, response.text
    answer = response.json()
    # SmolLM2 has FIM_REP (<reponame>) but no FIM_SEP: the project name, the snippet separator, then the FIM part
    assert answer["prompt"] == (
        "<reponame>myproject\n"
        + "\n\n--- snippet ---\n\n"
        + extra[0]["text"]
        + "<fim_prefix>"
        + BODY["input_prefix"]
        + "<fim_suffix>"
        + BODY["input_suffix"]
        + "<fim_middle>"
    )
    assert 0 < answer["tokens_predicted"] <= 8 and answer["stop"] is True
    assert answer["stop_type"] in ("limit", "eos") and isinstance(answer["content"], str)
    plain = requests.post(fim_server.url + "/infill", json=BODY, timeout=300).json()
    assert plain["prompt"].endswith("<fim_middle>") and plain["tokens_predicted"] > 0
    streamed = requests.post(
        fim_server.url + "/infill", json={**BODY, "stream": True}, stream=True, timeout=300
    )
    chunks = [
        json.loads(line[len("data: ") :])
        for line in streamed.iter_lines(decode_unicode=True)
        if line.startswith("data: ")
    ]
    assert chunks[-1]["stop"] is True
    assert "".join(c["content"] for c in chunks[:-1]) == plain["content"]
