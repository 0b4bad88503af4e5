"""llama-server b11549's renderings of chat templates (tests/reference/llamacpp-chat-templates.json; its
README in tests/reference/chat_templates says how they were made) and the templates themselves."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

from support.data import REFERENCE_DIR, load_reference

REFERENCE = load_reference("llamacpp-chat-templates.json")
TEMPLATES_DIR = REFERENCE_DIR / "chat_templates"
TEST_TOOL = REFERENCE["tools"]["test_tool"][0]  # llama.cpp's server suite's TEST_TOOL


def template_path(name: str) -> Path:
    return TEMPLATES_DIR / name


def dated(text: str, today: datetime.date) -> str:
    """A reference prompt with its date placeholders filled in for `today`."""
    return text.replace("{date_string}", today.strftime("%d %b %Y")).replace(
        "{datetime}", today.strftime("%b %d %Y")
    )


def jinja_cases(template: str) -> list[dict[str, Any]]:
    return [case for case in REFERENCE["jinja"] if case["template"] == template]


def jinja_prompt(
    template: str,
    *,
    reasoning: str,
    messages: str = "question",
    tools: str = "absent",
    chat_template_kwargs: str = "none",
    add_generation_prompt: bool = True,
) -> str:
    """llama-server's prompt (date placeholders unfilled) for one case of the reference grid."""
    (case,) = [
        case
        for case in jinja_cases(template)
        if (case["reasoning"], case["messages"], case["tools"], case["chat_template_kwargs"])
        == (reasoning, messages, tools, chat_template_kwargs)
        and case["add_generation_prompt"] == add_generation_prompt
    ]
    return REFERENCE["prompts"][case["prompt"]]


def matches_today(prompt: str, reference: str, before: datetime.date) -> bool:
    """`prompt` is `reference` dated the day a render began or the day it ended (a render across midnight)."""
    return prompt in {dated(reference, before), dated(reference, datetime.date.today())}
