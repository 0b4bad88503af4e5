"""Chat templates rendered as llama-server b11549 renders them: every built-in name and llama.cpp's own
.jinja files (DeepSeek-R1, QwQ, Qwen3, command-r7b, Llama-3.3, firefunction-v2) against llama-server's
/apply-template on the same model (tests/reference/llamacpp-chat-templates.json, its README says how)."""

from __future__ import annotations

import datetime
import json

import pytest
from strata_engine.chat import ChatTemplate
from strata_engine.errors import ChatTemplateError
from strata_engine.settings import ChatTemplateName, values
from support.chat_reference import (
    REFERENCE,
    TEMPLATES_DIR,
    TEST_TOOL,
    jinja_cases,
    matches_today,
    template_path,
)

# what llama-server puts in the template kwargs for --reasoning on|off (common/arg.cpp), and always
REASONING_KWARGS = {"on": {"enable_thinking": True}, "off": {"enable_thinking": False}, "auto": {}}
ALWAYS_KWARGS = {"preserve_reasoning": True}


def test_every_llamacpp_name_is_built_in():
    assert set(REFERENCE["named"]) == set(values(ChatTemplateName))


@pytest.mark.parametrize("name", sorted(REFERENCE["named"]))
def test_named_format_is_llama_servers(name):
    template = ChatTemplate.configured(name, bos_token="<|im_start|>", eos_token="<|im_end|>")
    reference = REFERENCE["named"][name]
    conversation = REFERENCE["conversation"]
    assert template.render(conversation) == reference["generation_prompt"]
    assert template.render(conversation, add_generation_prompt=False) == reference["no_generation_prompt"]


def test_named_format_refuses_tools():
    template = ChatTemplate.configured("llama3")
    with pytest.raises(ChatTemplateError, match="tools need a jinja chat template"):
        template.render([{"role": "user", "content": "x"}], tools=[TEST_TOOL])


@pytest.fixture(scope="module")
def file_templates(metadata, tokenizers) -> dict[str, ChatTemplate]:
    """Each .jinja given as --chat-template to SmolLM2 (the model the reference was rendered on)."""
    return {
        path.name: ChatTemplate.for_model(metadata["smollm2"], tokenizers["smollm2"], path.read_text())
        for path in sorted(TEMPLATES_DIR.glob("*.jinja"))
    }


@pytest.mark.parametrize("template", sorted(path.name for path in TEMPLATES_DIR.glob("*.jinja")))
def test_jinja_template_is_llama_servers(template, file_templates):
    """Every case of the reference grid: --reasoning, messages, tools absent/empty/one, the request's
    chat_template_kwargs, with and without the generation prompt."""
    cases = jinja_cases(template)
    assert len(cases) == 3 * 2 * 3 * 3 * 2
    for case in cases:
        kwargs = {**ALWAYS_KWARGS, **REASONING_KWARGS[case["reasoning"]]}
        kwargs.update(REFERENCE["chat_template_kwargs"][case["chat_template_kwargs"]] or {})
        before = datetime.date.today()
        prompt = file_templates[template].render(
            REFERENCE[case["messages"]],
            add_generation_prompt=case["add_generation_prompt"],
            tools=REFERENCE["tools"][case["tools"]],
            chat_template_kwargs=kwargs,
        )
        assert matches_today(prompt, REFERENCE["prompts"][case["prompt"]], before), case


@pytest.mark.parametrize(
    ("template", "thinks"),
    [
        ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", True),
        ("Qwen-Qwen3-0.6B.jinja", True),
        ("Qwen-QwQ-32B.jinja", True),
        ("CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja", True),
        ("meta-llama-Llama-3.3-70B-Instruct.jinja", False),
        ("fireworks-ai-llama-3-firefunction-v2.jinja", False),
    ],
)
def test_thinking_support_is_the_templates_reaction(template, thinks, file_templates):
    assert file_templates[template].supports_thinking is thinks


def test_enable_thinking_must_be_a_boolean(file_templates):
    template = file_templates["Qwen-Qwen3-0.6B.jinja"]
    with pytest.raises(ChatTemplateError, match='invalid type for "enable_thinking"'):
        template.render([{"role": "user", "content": "x"}], chat_template_kwargs={"enable_thinking": "no"})


def test_undefined_renders_empty():
    template = ChatTemplate.from_source(
        "[{{ nothing }}|{{ nothing.deeper.still }}|{{ 'a' + nothing }}|{{ custom }}]", origin="test"
    )
    messages = [{"role": "user", "content": "x"}]
    assert template.render(messages) == "[||a|]"
    assert template.render(messages, chat_template_kwargs={"custom": 7}) == "[||a|7]"


def test_leading_bos_dropped_when_the_tokenizer_adds_it():
    source = "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}"
    messages = [{"role": "user", "content": "x"}]
    kept = ChatTemplate.from_source(source, origin="test", bos_token="<s>", eos_token="</s>")
    dropped = ChatTemplate.from_source(
        source, origin="test", bos_token="<s>", eos_token="</s>", add_bos=True, add_eos=True
    )
    assert kept.render(messages) == "<s>x</s>" and dropped.render(messages) == "x"


def test_tool_calls_reach_the_template(file_templates):
    template = file_templates["Qwen-Qwen3-0.6B.jinja"]
    call = {"type": "function", "function": {"name": "test", "arguments": {"success": True}}}
    messages = [
        {"role": "user", "content": "call it"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "done", "tool_call_id": "0"},
    ]
    prompt = template.render(messages, tools=[TEST_TOOL])
    assert '<tool_call>\n{"name": "test", "arguments": {"success": true}}\n</tool_call>' in prompt
    assert "<tool_response>\ndone\n</tool_response>" in prompt


# --- the messages as llama-server hands them to a template (common/chat.cpp's workarounds, caps.cpp's probes) --


def family_template(name: str) -> ChatTemplate:
    return ChatTemplate.from_source(template_path(f"families/{name}.jinja").read_text(), origin="test")


def tool_call_turns(arguments) -> list[dict]:
    call = {"id": "0", "type": "function", "function": {"name": "test", "arguments": arguments}}
    return [
        {"role": "user", "content": "call it"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "done", "tool_call_id": "0"},
    ]


def test_json_text_arguments_reach_an_object_reading_template_parsed(file_templates):
    """OpenAI clients send a tool call's arguments as JSON text; llama-server parses them for a template that
    reads them as an object (Qwen3's `arguments | tojson`), and leaves them text for one that does not."""
    qwen3 = file_templates["Qwen-Qwen3-0.6B.jinja"]
    assert qwen3.supports_object_arguments
    as_text = qwen3.render(tool_call_turns('{"success": true}'), tools=[TEST_TOOL])
    assert as_text == qwen3.render(tool_call_turns({"success": True}), tools=[TEST_TOOL])
    printing = ChatTemplate.from_source(
        "{% for m in messages %}{% for c in m.tool_calls %}{{ c.function.arguments }}{% endfor %}{% endfor %}",
        origin="test",
    )
    assert not printing.supports_object_arguments
    assert printing.render(tool_call_turns('{"success": true}')) == '{"success": true}'
    with pytest.raises(ChatTemplateError, match=r"tool_calls\[0\].function.arguments is not JSON"):
        qwen3.render(tool_call_turns("{success"), tools=[TEST_TOOL])


def test_a_system_turn_the_template_does_not_read_is_merged_into_the_next():
    """Gemma 2's template raises on a system turn: llama-server gives it the system text atop the first user
    turn instead."""
    gemma2 = family_template("google-gemma-2-2b-it")
    assert not gemma2.supports_system_role
    merged = [{"role": "user", "content": "Be brief.\nHello"}]
    assert gemma2.render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    ) == (gemma2.render(merged))
    assert family_template("Qwen-Qwen2.5-7B-Instruct").supports_system_role
    # a continued assistant turn is set apart first, as the peer: the merge applies to the turns before it
    system = {"role": "system", "content": "Be brief."}
    continued = [system, {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}]
    assert gemma2.render(continued, continue_final_message=True) == gemma2.render(merged) + "Hi"
    alone = gemma2.render([system, {"role": "assistant", "content": "Hi"}], continue_final_message=True)
    assert alone == "<start_of_turn>model\nHi"  # the system turn, with no turn to join, is dropped


def test_developer_is_system_but_for_channel_templates():
    source = "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"
    messages = [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}]
    assert ChatTemplate.from_source(source, origin="test").render(messages) == "system:d;user:u;"
    harmony = ChatTemplate.from_source(source + "{# <|channel|> #}", origin="test")
    assert harmony.render(messages) == "developer:d;user:u;"


def test_reasoning_kwargs_set_the_names_templates_read_them_by():
    template = ChatTemplate.from_source(
        "{{ preserve_thinking }} {{ clear_thinking }} {{ drop_thinking }} {{ reasoning_strength }}",
        origin="test",
    )
    messages = [{"role": "user", "content": "x"}]
    assert template.render(messages) == "   "
    kept = {"preserve_reasoning": True, "reasoning_effort": "low"}
    assert template.render(messages, chat_template_kwargs=kept) == "True False False low"
    dropped = {"preserve_reasoning": False}
    assert template.render(messages, chat_template_kwargs=dropped) == "False True True "


def test_tojson_takes_a_mapped_sequence():
    """llama.cpp's own DeepSeek-R1 template writes `tools | map(attribute='function') | tojson(indent=2)`."""
    prompt = family_template("llama-cpp-deepseek-r1").render(
        [{"role": "user", "content": "x"}], tools=[TEST_TOOL]
    )
    assert json.dumps([TEST_TOOL["function"]], indent=2) in prompt
