"""Chat templates through a real strata-server as llama-server b11549 renders them (the cases of its own
server suite, tools/server/tests/unit/test_template.py, against its renderings: support/chat_reference.py),
--verbose's __verbose, and a model file the engine refuses stopping the server before its port is bound."""

from __future__ import annotations

import datetime
import socket
import subprocess
import sys

import pytest
import requests
from support.chat_reference import REFERENCE, TEST_TOOL, dated, jinja_prompt, matches_today, template_path
from support.gguf_variants import of_architecture, with_additions
from support.server_process import LOOPBACK, free_port

from .servers import start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the first server may compile the kernels

QWEN3 = "Qwen-Qwen3-0.6B.jinja"
DEEPSEEK_R1 = "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"
LLAMA33 = "meta-llama-Llama-3.3-70B-Instruct.jinja"
QUESTION = REFERENCE["question"]
TOOLS = {"absent": None, "empty": [], "test_tool": [TEST_TOOL]}


@pytest.fixture(scope="module")
def qwen3_off(module_tmp):
    """test_template.py's server: --jinja, a template file, --reasoning off."""
    proc = start_server(
        module_tmp,
        "--jinja",
        "--chat-template-file",
        str(template_path(QWEN3)),
        "--reasoning",
        "off",
        name="qwen3-off",
    )
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def deepseek_auto(module_tmp):
    proc = start_server(
        module_tmp, "--jinja", "--chat-template-file", str(template_path(DEEPSEEK_R1)), name="r1"
    )
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def llama33(module_tmp, deepseek_auto):
    """With --verbose: started after another server, so that it never compiles the kernels (numba's compiler
    logs at debug level)."""
    proc = start_server(
        module_tmp,
        "--chat-template-file",
        str(template_path(LLAMA33)),
        "--verbose",
        "--temp",
        "0",
        "-n",
        "2",
        name="llama33",
    )
    yield proc
    assert proc.stop() == 0


def apply_template(server, body: dict) -> str:
    response = requests.post(server.url + "/apply-template", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["prompt"]


@pytest.mark.parametrize("tools", sorted(TOOLS))
def test_reasoning_flag_and_tools_render_as_llama_server(qwen3_off, deepseek_auto, tools):
    before = datetime.date.today()
    for server, template, reasoning in ((qwen3_off, QWEN3, "off"), (deepseek_auto, DEEPSEEK_R1, "auto")):
        body = {"messages": QUESTION, "tools": TOOLS[tools]}
        expected = jinja_prompt(template, reasoning=reasoning, tools=tools)
        assert matches_today(apply_template(server, body), expected, before), (template, tools)
    assert apply_template(qwen3_off, {"messages": QUESTION}).endswith("<think>\n\n</think>\n\n")
    assert apply_template(deepseek_auto, {"messages": QUESTION}).endswith("<think>\n")


def test_request_kwargs_win_over_the_reasoning_flag(qwen3_off, deepseek_auto):
    thinking = {"messages": QUESTION, "chat_template_kwargs": {"enable_thinking": True}}
    assert apply_template(qwen3_off, thinking) == jinja_prompt(
        QWEN3, reasoning="off", chat_template_kwargs="thinking_on"
    )
    not_thinking = {"messages": QUESTION, "chat_template_kwargs": {"enable_thinking": False}}
    assert apply_template(deepseek_auto, not_thinking) == jinja_prompt(
        DEEPSEEK_R1, reasoning="auto", chat_template_kwargs="thinking_off"
    )
    bad = requests.post(
        qwen3_off.url + "/apply-template",
        json={"messages": QUESTION, "chat_template_kwargs": {"enable_thinking": "yes"}},
        timeout=60,
    )
    assert bad.status_code == 400 and "enable_thinking" in bad.text


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_date_and_generation_prompt_render_as_llama_server(llama33, add_generation_prompt):
    before = datetime.date.today()
    for tools in sorted(TOOLS):
        body = {"messages": QUESTION, "tools": TOOLS[tools], "add_generation_prompt": add_generation_prompt}
        expected = jinja_prompt(
            LLAMA33, reasoning="auto", tools=tools, add_generation_prompt=add_generation_prompt
        )
        prompt = apply_template(llama33, body)
        assert matches_today(prompt, expected, before), tools
    assert f"Today Date: {before.strftime('%d %b %Y')}" in dated(expected, before)
    header = "<|start_header_id|>assistant<|end_header_id|>"
    assert (header in prompt) is add_generation_prompt


def test_chat_completion_renders_the_same_prompt_and_verbose_shows_it(llama33):
    """The chat endpoint's prompt is llama-server's; --verbose puts __verbose in every OpenAI answer unless
    the request says verbose: false. Tools render where nothing is generated (the prompt's tokens counted);
    a generation with tools is refused (Strata does not parse tool calls out of the output)."""
    before = datetime.date.today()
    body = {"messages": QUESTION}
    answer = requests.post(llama33.url + "/v1/chat/completions", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    prompt = answer.json()["__verbose"]["prompt"]
    assert matches_today(prompt, jinja_prompt(LLAMA33, reasoning="auto"), before)
    quiet = requests.post(llama33.url + "/v1/chat/completions", json={**body, "verbose": False}, timeout=300)
    assert quiet.status_code == 200 and "__verbose" not in quiet.json()
    with_tools = {**body, "tools": [TEST_TOOL]}
    refused = requests.post(llama33.url + "/v1/chat/completions", json=with_tools, timeout=60)
    assert refused.status_code == 501 and "'tools'" in refused.text
    counted = requests.post(llama33.url + "/v1/chat/completions/input_tokens", json=with_tools, timeout=60)
    rendered = apply_template(llama33, with_tools)
    assert matches_today(rendered, jinja_prompt(LLAMA33, reasoning="auto", tools="test_tool"), before)
    tokens = requests.post(
        llama33.url + "/tokenize", json={"content": rendered, "add_special": True}, timeout=60
    )
    assert counted.json()["input_tokens"] == len(tokens.json()["tokens"])


def refused_start(model) -> subprocess.CompletedProcess:
    """strata-server -m `model` on a port this test holds: a server that tried to bind it would fail on that,
    not on the model."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "strata_server.cli",
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "-m",
        str(model),
    ]
    with socket.create_server((LOOPBACK, port)):
        return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_unsupported_or_refused_model_exits_before_the_port_is_bound(tmp_path, smollm2_path):
    unsupported = of_architecture(tmp_path / "mamba.gguf", "mamba")
    refused = with_additions(smollm2_path, tmp_path / "moe.gguf", metadata={"llama.expert_count": 8})
    for model, named in (
        (unsupported, "architecture 'mamba' is not supported"),
        (refused, "llama.expert_count"),
    ):
        done = refused_start(model)
        assert done.returncode == 3, done.stderr
        assert f"strata-server: cannot serve {model}: " in done.stderr and named in done.stderr
        assert "Listening at" not in done.stderr + done.stdout  # gunicorn never started
