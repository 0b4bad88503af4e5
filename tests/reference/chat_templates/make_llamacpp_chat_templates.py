"""Writes ../llamacpp-chat-templates.json: llama-server b11549's /apply-template for every built-in template
name and for the .jinja files here (README.md). Run outside the repository's environment:

    python make_llamacpp_chat_templates.py LLAMA_CPP_SOURCE MODEL.gguf
"""

from __future__ import annotations

import datetime
import json
import re
import sys
import time
from pathlib import Path

import requests
import xllamacpp as xlc

HERE = Path(__file__).resolve().parent

# tests/test-chat-template.cpp's conversation
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there"},
    {"role": "user", "content": "Who are you"},
    {"role": "assistant", "content": "   I am an assistant   "},
    {"role": "user", "content": "Another question"},
]
QUESTION = [{"role": "user", "content": "What is today?"}]
# tools/server/tests/unit/test_tool_call.py's TEST_TOOL
TEST_TOOL = {
    "type": "function",
    "function": {
        "name": "test",
        "description": "",
        "parameters": {
            "type": "object",
            "properties": {"success": {"type": "boolean", "const": True}},
            "required": ["success"],
        },
    },
}
TOOLS = {"absent": None, "empty": [], "test_tool": [TEST_TOOL]}
REASONING = {"on": 1, "off": 0, "auto": -1}
KWARGS = {"none": None, "thinking_off": {"enable_thinking": False}, "thinking_on": {"enable_thinking": True}}


def serve(model: str, **settings):
    p = xlc.CommonParams()
    p.model.path = model
    p.n_parallel, p.n_ctx = 1, 2048
    p.cpuparams.n_threads = p.cpuparams_batch.n_threads = 1
    for key, value in settings.items():
        setattr(p, key, value)
    server = xlc.Server(p)
    url = server.listening_address
    for _ in range(100):
        try:
            if requests.get(url + "/health", timeout=1).status_code == 200:
                return server, url
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise RuntimeError("llama-server did not start")


def undate(text: str) -> str:
    today = datetime.date.today()
    return text.replace(today.strftime("%d %b %Y"), "{date_string}").replace(
        today.strftime("%b %d %Y"), "{datetime}"
    )


def apply(url: str, body: dict) -> str | None:
    r = requests.post(url + "/apply-template", json={k: v for k, v in body.items() if v is not None})
    return undate(r.json()["prompt"]) if r.status_code == 200 else None


def main(source: Path, model: str) -> None:
    chat = (source / "src" / "llama-chat.cpp").read_text()
    table = chat[
        chat.index("LLM_CHAT_TEMPLATES = {") : chat.index("};", chat.index("LLM_CHAT_TEMPLATES = {"))
    ]
    names = re.findall(r'\{\s*"([^"]+)",\s*LLM_CHAT_TEMPLATE_', table)
    named: dict[str, dict[str, str | None]] = {}
    for name in names:
        server, url = serve(
            model, use_jinja=False, chat_template=name, default_template_kwargs={"preserve_reasoning": "true"}
        )
        named[name] = {
            "generation_prompt": apply(url, {"messages": CONVERSATION}),
            "no_generation_prompt": apply(url, {"messages": CONVERSATION, "add_generation_prompt": False}),
        }
        del server
    jinja: list[dict] = []
    for path in sorted(HERE.glob("*.jinja")):
        for reasoning, level in REASONING.items():
            # what common_params_parse adds from --reasoning on|off, and always (common/arg.cpp)
            params = {"preserve_reasoning": "true"}
            if level >= 0:
                params["enable_thinking"] = "true" if level else "false"
            server, url = serve(
                model,
                use_jinja=True,
                chat_template=path.read_text(),
                enable_reasoning=level,
                default_template_kwargs=params,
            )
            for messages_name, messages in {"question": QUESTION, "conversation": CONVERSATION}.items():
                for tools_name, tools in TOOLS.items():
                    for kwargs_name, kwargs in KWARGS.items():
                        for generation in (True, False):
                            body = {
                                "messages": messages,
                                "tools": tools,
                                "chat_template_kwargs": kwargs,
                                "add_generation_prompt": generation,
                            }
                            jinja.append(
                                {
                                    "template": path.name,
                                    "reasoning": reasoning,
                                    "messages": messages_name,
                                    "tools": tools_name,
                                    "chat_template_kwargs": kwargs_name,
                                    "add_generation_prompt": generation,
                                    "prompt": apply(url, body),
                                }
                            )
            del server
    # the prompts repeat across the grid: each is kept once, the grid names its index
    prompts = sorted({case["prompt"] for case in jinja if case["prompt"] is not None})
    for case in jinja:
        case["prompt"] = None if case["prompt"] is None else prompts.index(case["prompt"])
    out = {
        "llama_cpp": "b11549",
        "model": Path(model).name,
        "conversation": CONVERSATION,
        "question": QUESTION,
        "tools": TOOLS,
        "chat_template_kwargs": KWARGS,
        "named": named,
        "jinja": jinja,
        "prompts": prompts,
    }
    (HERE.parent / "llamacpp-chat-templates.json").write_text(
        json.dumps(out, indent=0, ensure_ascii=False) + "\n"
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
