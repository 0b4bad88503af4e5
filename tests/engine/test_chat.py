"""Chat templates of both real models: SmolLM2's ChatML from the file, gemma3's built-in turn format."""

from __future__ import annotations

import pytest
from strata_engine.chat import ChatTemplate
from strata_engine.errors import ChatTemplateError

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": " hi "},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
]


def test_smollm2_chatml_from_file(templates, tokenizers):
    template, tokenizer = templates["smollm2"], tokenizers["smollm2"]
    assert (
        template.origin == "file"
        and template.bos_token == "<|im_start|>"
        and template.eos_token == "<|im_end|>"
    )
    assert template.render(CONVERSATION) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n hi <|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    # the file's template adds its default system prompt when none is given
    assert template.render([{"role": "user", "content": "hi"}], add_generation_prompt=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
    )
    ids = tokenizer.encode(template.render(CONVERSATION), add_special=True)
    assert ids[0] == 1 and ids.count(1) == 5 and ids.count(2) == 4  # control tokens parsed


def test_gemma3_builtin_turns(templates, tokenizers):
    template, tokenizer = templates["gemma3"], tokenizers["gemma3"]
    assert template.origin == "builtin:gemma3"
    prompt = template.render(CONVERSATION)
    assert prompt == (
        "<start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n"
    )
    ids = tokenizer.encode(prompt, add_special=True)
    assert ids[:3] == [2, 105, 2364] and ids[-3:] == [105, 4368, 107]  # <bos><start_of_turn>user ... model\n
    assert template.render([{"role": "user", "content": "x"}], add_generation_prompt=False).endswith(
        "<end_of_turn>\n"
    )


def test_text_parts_are_joined(templates):
    template = templates["gemma3"]
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert template.render(parts) == "<start_of_turn>user\nab<end_of_turn>\n<start_of_turn>model\n"


def test_bad_messages_reported_together(templates):
    template = templates["smollm2"]
    with pytest.raises(ChatTemplateError) as info:
        template.render([{"role": 3, "content": "x"}, "nope", {"role": "user", "content": 5}])
    message = str(info.value)
    assert "messages[0].role" in message and "messages[1]" in message and "messages[2].content" in message
    with pytest.raises(ChatTemplateError, match="non-empty list"):
        template.render([])


def test_raise_exception_and_sandbox():
    strict = ChatTemplate.from_source(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok",
        origin="test",
    )
    assert strict.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="first must be user"):
        strict.render([{"role": "assistant", "content": "x"}])
    escape = ChatTemplate.from_source("{{ messages.__class__.__mro__ }}", origin="test")
    with pytest.raises(ChatTemplateError):
        escape.render([{"role": "user", "content": "x"}])
    mutate = ChatTemplate.from_source("{{ messages.append(1) }}", origin="test")
    with pytest.raises(ChatTemplateError):
        mutate.render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate.from_source("{% for %}", origin="test")


def test_unparsable_file_template_falls_back(tokenizers):
    tokenizer = tokenizers["smollm2"]
    metadata = {"tokenizer.chat_template": "{% for %}", "general.architecture": "llama"}
    template = ChatTemplate.for_model(metadata, tokenizer)
    assert template.origin == "builtin:chatml"
    assert template.render([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_continue_final_message_leaves_the_assistant_turn_open(templates):
    template = templates["gemma3"]
    prefill = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "It is"}]
    assert template.render(prefill, continue_final_message=True) == (
        "<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\nIt is"
    )
    alone = template.render([{"role": "assistant", "content": "Once"}], continue_final_message=True)
    assert alone == "<start_of_turn>model\nOnce"
    with pytest.raises(ChatTemplateError, match="the last message to be the assistant's"):
        template.render([{"role": "user", "content": "x"}], continue_final_message=True)


@pytest.mark.parametrize(
    ("name", "start"), [("chatml", "<|im_start|>user\nhi"), ("gemma", "<start_of_turn>user\nhi")]
)
def test_configured_templates_by_name_and_jinja(name, start):
    messages = [{"role": "user", "content": "hi"}]
    named = ChatTemplate.configured(name)
    assert named.origin == f"builtin:{name}" and named.render(messages).startswith(start)
    custom = ChatTemplate.configured("{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    assert custom.origin == "custom" and custom.render(messages) == "<hi>"
    with pytest.raises(ChatTemplateError, match="neither a built-in name"):
        ChatTemplate.configured("llama9")
