"""A chat request's prompt options, checked as llama-server checks them (its oaicompat_chat_params_parse):
the generation prompt, and the continuation of a final assistant message (assistant prefill)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from .errors import invalid_request
from .params import parse_messages

BOTH_SET = "Cannot set both add_generation_prompt and continue_final_message to true."
TWO_TRAILING_ASSISTANTS = "Cannot have 2 or more assistant messages at the end of the list."


@attrs.frozen
class ChatPrompt:
    messages: list[dict[str, str]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message, the assistant's, is continued

    def engine_fields(self) -> dict[str, Any]:
        """The fields of COMPLETE and APPLY_TEMPLATE that say how the messages are rendered."""
        return {
            "messages": self.messages,
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }


def _flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid_request(f"'{key}' must be true or false")
    return value


def parse_chat_prompt(body: Mapping[str, Any], *, prefill_assistant: bool) -> ChatPrompt:
    """As the peer: a final assistant message is continued when asked (``continue_final_message``, which
    needs ``add_generation_prompt: false``) or by default (``prefill_assistant``, off with
    --no-prefill-assistant); then the message before it must not be the assistant's too."""
    messages = parse_messages(body)
    add_generation_prompt = _flag(body, "add_generation_prompt", True)
    continue_final = _flag(body, "continue_final_message", False)
    if continue_final and add_generation_prompt:
        raise invalid_request(BOTH_SET)
    prefill = messages[-1]["role"] == "assistant" and (continue_final or prefill_assistant)
    if prefill and len(messages) >= 2 and messages[-2]["role"] == "assistant":
        raise invalid_request(TWO_TRAILING_ASSISTANTS)
    return ChatPrompt(messages, add_generation_prompt=add_generation_prompt, continue_final_message=prefill)
