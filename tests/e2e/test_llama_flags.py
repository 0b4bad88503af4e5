"""llama-server's flags through a real strata-server (gunicorn, the real engine and model): default sampling
and output, chat templates by name and as a jinja file, model aliases and tags, header names as the peer's."""

from __future__ import annotations

import pytest
import requests

from .servers import start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TEMPLATE = (
    "{%- for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{%- if add_generation_prompt %}[assistant] {% endif %}"
)
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server(module_tmp):
    template = module_tmp / "template.jinja"
    template.write_text(TEMPLATE, encoding="utf-8")
    proc = start_server(
        module_tmp,
        "--chat-template-file",
        str(template),
        "--temp",
        "0",
        "-n",
        "3",
        "--alias",
        "strata,smollm2",
        "--tags",
        "small,test",
        "--metrics",
        name="flags",
    )
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def gemma_template_server(module_tmp):
    proc = start_server(module_tmp, "--chat-template", "gemma", name="gemma-template")
    yield proc
    assert proc.stop() == 0


def post(server, path: str, body: dict) -> dict:
    response = requests.post(server.url + path, json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_request_without_fields_uses_the_server_defaults(server):
    first = post(server, "/completion", {"prompt": "The capital of France is"})
    assert first["tokens_predicted"] == 3 and first["generation_settings"]["temperature"] == 0
    again = post(server, "/completion", {"prompt": "The capital of France is"})
    assert again["content"] == first["content"]  # greedy by the server's --temp 0
    own = post(server, "/completion", {"prompt": "The capital of France is", "n_predict": 1})
    assert own["tokens_predicted"] == 1
    # ignore_eos bans SmolLM2's end-of-generation tokens, listed as llama-server b11549 lists them
    ignoring = post(server, "/completion", {"prompt": "Hi", "n_predict": 1, "ignore_eos": True})
    assert ignoring["generation_settings"]["logit_bias"] == [{"bias": None, "token": t} for t in (0, 2, 4)]
    props = requests.get(server.url + "/props", timeout=10).json()
    params = props["default_generation_settings"]["params"]
    assert params["temperature"] == 0 and params["n_predict"] == 3


def test_jinja_template_file_renders_apply_template_and_chat(server):
    assert post(server, "/apply-template", {"messages": HELLO})["prompt"] == "[user] Say hello.\n[assistant] "
    props = requests.get(server.url + "/props", timeout=10).json()
    assert props["chat_template"] == TEMPLATE
    chat = post(server, "/v1/chat/completions", {"messages": HELLO})
    # The prompt is the template's: its tokens are those of the rendered text.
    rendered = post(server, "/tokenize", {"content": "[user] Say hello.\n[assistant] "})["tokens"]
    assert chat["usage"]["prompt_tokens"] == len(rendered) and chat["usage"]["completion_tokens"] == 3


def test_builtin_template_by_name(gemma_template_server):
    prompt = post(gemma_template_server, "/apply-template", {"messages": HELLO})["prompt"]
    assert prompt == "<start_of_turn>user\nSay hello.<end_of_turn>\n<start_of_turn>model\n"
    chat = post(gemma_template_server, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 2})
    assert chat["usage"]["completion_tokens"] == 2


def test_aliases_tags_and_peer_header_names(server):
    response = requests.get(server.url + "/v1/models", timeout=10)
    entry = response.json()["data"][0]
    assert (
        entry["id"] == "smollm2"  # llama-server's choice: the first in sort order
        and entry["aliases"] == ["smollm2", "strata"]
        and entry["tags"] == ["small", "test"]
    )
    assert "Content-Type" in list(response.raw.headers.keys())  # as sent on the wire
    metrics = requests.get(server.url + "/metrics", timeout=10, headers={"Origin": "http://localhost:3000"})
    names = list(metrics.raw.headers.keys())
    assert "Process-Start-Time-Unix" in names and "Access-Control-Allow-Origin" in names


def test_assistant_prefill_and_input_tokens(server):
    messages = [*HELLO, {"role": "assistant", "content": "Hello"}]
    rendered = post(server, "/apply-template", {"messages": messages})["prompt"]
    assert rendered == "[user] Say hello.\n[assistant] Hello"  # continued, not closed: the peer's prefill
    counted = post(server, "/v1/chat/completions/input_tokens", {"messages": messages})["input_tokens"]
    assert counted == len(post(server, "/tokenize", {"content": rendered})["tokens"])
    chat = post(server, "/v1/chat/completions", {"messages": messages})
    assert chat["usage"]["prompt_tokens"] == counted
    refused = requests.post(
        server.url + "/v1/chat/completions",
        timeout=60,
        json={"messages": messages, "continue_final_message": True},
    )
    assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error"


def test_return_progress_reports_the_prefill_in_the_stream(server):
    import json

    body = {
        "prompt": "Once upon a time, in a land far away, there lived",
        "n_predict": 2,
        "stream": True,
        "return_progress": True,
    }
    for expected_cache in (None, "total - 1"):
        with requests.post(server.url + "/completion", json=body, stream=True, timeout=120) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith(b"data: ")]
        progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
        # as llama-server b11549: one event before the evaluation (processed = cache), then one per batch
        # (-b 2048: this prompt is one), the last with every token processed
        before, last = progress
        assert before["processed"] == before["cache"] == last["cache"] and before["total"] == last["total"]
        assert last["processed"] == last["total"] == events[-1]["tokens_evaluated"]
        if expected_cache:  # the same prompt again: all but its last token reused
            assert last["cache"] == last["total"] - 1
        else:
            assert before["processed"] == 0
        assert events[-1]["stop"] is True and events[-1]["tokens_predicted"] == 2
        assert events.index(next(e for e in events if "prompt_progress" in e)) == 0  # before any token
