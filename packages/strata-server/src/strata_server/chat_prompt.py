"""A chat request's prompt options, checked as llama-server checks them (its oaicompat_chat_params_parse):
the generation prompt, the continuation of a final assistant message (assistant prefill), the tools and
the chat template kwargs the template sees."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from .config import ServerConfig
from .errors import invalid_request
from .params import parse_messages

BOTH_SET = "Cannot set both add_generation_prompt and continue_final_message to true."
TWO_TRAILING_ASSISTANTS = "Cannot have 2 or more assistant messages at the end of the list."


@attrs.frozen
class ChatPrompt:
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message, the assistant's, is continued
    tools: list[Any] | None = None  # the template's `tools` (none when empty, as the peer)
    chat_template_kwargs: dict[str, Any] = attrs.Factory(
        dict
    )  # the server's defaults, the request's over them

    def engine_fields(self) -> dict[str, Any]:
        """The fields of COMPLETE and APPLY_TEMPLATE that say how the messages are rendered."""
        fields = {
            "messages": self.messages,
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "chat_template_kwargs": self.chat_template_kwargs,
        }
        return fields | ({"tools": self.tools} if self.tools else {})


def _flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid_request(f"'{key}' must be true or false")
    return value


def _tools(body: Mapping[str, Any]) -> list[Any] | None:
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise invalid_request("'tools' must be an array")
    return tools or None


def _template_kwargs(body: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    given = body.get("chat_template_kwargs")
    if given is not None and not isinstance(given, dict):
        raise invalid_request("'chat_template_kwargs' must be an object")
    return {**defaults, **(given or {})}


def parse_chat_prompt(body: Mapping[str, Any], config: ServerConfig) -> ChatPrompt:
    """As the peer: a final assistant message is continued when asked (``continue_final_message``, which
    needs ``add_generation_prompt: false``) or by default (--no-prefill-assistant turns that off); then the
    message before it must not be the assistant's too. The template kwargs are the server's (--reasoning,
    --chat-template-kwargs) with the request's ``chat_template_kwargs`` over them."""
    messages = parse_messages(body)
    add_generation_prompt = _flag(body, "add_generation_prompt", True)
    continue_final = _flag(body, "continue_final_message", False)
    if continue_final and add_generation_prompt:
        raise invalid_request(BOTH_SET)
    prefill = messages[-1]["role"] == "assistant" and (continue_final or config.prefill_assistant)
    if prefill and len(messages) >= 2 and messages[-2]["role"] == "assistant":
        raise invalid_request(TWO_TRAILING_ASSISTANTS)
    return ChatPrompt(
        messages,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=prefill,
        tools=_tools(body),
        chat_template_kwargs=_template_kwargs(body, config.template_kwargs()),
    )
