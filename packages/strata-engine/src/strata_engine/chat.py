"""Chat templates: `tokenizer.chat_template` rendered in a sandboxed jinja2 environment (as Hugging Face
transformers renders it), or, for a file without one, the built-in turn format of its family."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import attrs
import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import ChatTemplateError
from .settings import ChatTemplateName, chat_template_problem, values
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)


# Gemma's turn format (llama.cpp's LLM_CHAT_TEMPLATE_GEMMA): the assistant is "model", system text is
# folded into the next user turn, contents are trimmed. No BOS here: tokenization adds it (add_bos).
GEMMA_TURNS = (
    "{%- set system = namespace(text='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set system.text = system.text + (message['content'] | trim) -%}"
    "{%- else -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{- '<start_of_turn>' + role + '\\n' -}}"
    "{%- if system.text and role != 'model' -%}"
    "{{- system.text + '\\n\\n' -}}{%- set system.text = '' -%}"
    "{%- endif -%}"
    "{{- (message['content'] | trim) + '<end_of_turn>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)

# ChatML: what llama.cpp falls back to for a file without a template.
CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# general.architecture -> the template for files that carry none
BUILTIN_TEMPLATES: Mapping[str, str] = {"gemma3": GEMMA_TURNS, "gemma2": GEMMA_TURNS, "gemma": GEMMA_TURNS}

# --chat-template NAME -> its template
NAMED_TEMPLATES: Mapping[ChatTemplateName, str] = {
    ChatTemplateName.CHATML: CHATML,
    ChatTemplateName.GEMMA: GEMMA_TURNS,
}


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _tojson(
    value: Any,
    indent: int | None = None,
    separators=None,
    sort_keys: bool = False,
    ensure_ascii: bool = False,
) -> str:
    return json.dumps(
        value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], autoescape=False
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def normalize_messages(messages: Any) -> list[dict[str, str]]:
    """Check `messages` (a list of ``{"role": str, "content": str | [{"type": "text", "text": str}]}``)
    and return them with string contents; every problem is reported together."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {role, content} objects")
    problems: list[str] = []
    normalized: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            problems.append(f"messages[{i}] is not an object")
            continue
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            problems.append(f"messages[{i}].role must be a non-empty string")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if (
                    isinstance(part, Mapping)
                    and part.get("type") == "text"
                    and isinstance(part.get("text"), str)
                ):
                    texts.append(part["text"])
                else:
                    problems.append(
                        f"messages[{i}].content[{j}] is not a text part {{type: text, text: str}}"
                    )
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            problems.append(f"messages[{i}].content must be a string or a list of text parts")
        if isinstance(role, str) and isinstance(content, str):
            normalized.append({"role": role, "content": content})
    if problems:
        raise ChatTemplateError("invalid messages: " + "; ".join(problems))
    return normalized


@attrs.frozen
class ChatTemplate:
    source: str = attrs.field(repr=False)
    origin: str  # "file" (tokenizer.chat_template) or "builtin:<name>"
    bos_token: str
    eos_token: str
    _template: jinja2.Template = attrs.field(repr=False, alias="_template")

    @classmethod
    def from_source(
        cls, source: str, *, origin: str, bos_token: str = "", eos_token: str = ""
    ) -> ChatTemplate:
        try:
            template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"the chat template ({origin}) does not parse: line {exc.lineno}: {exc.message}"
            ) from exc
        return cls(source=source, origin=origin, bos_token=bos_token, eos_token=eos_token, _template=template)

    @classmethod
    def configured(cls, value: str, *, bos_token: str = "", eos_token: str = "") -> ChatTemplate:
        """`--chat-template`'s value: a built-in name (`ChatTemplateName`) or a jinja template."""
        if value in values(ChatTemplateName):
            return cls.from_source(
                NAMED_TEMPLATES[ChatTemplateName(value)],
                origin=f"builtin:{value}",
                bos_token=bos_token,
                eos_token=eos_token,
            )
        problem = chat_template_problem(value)
        if problem:
            raise ChatTemplateError(f"chat template {problem}")
        return cls.from_source(value, origin="custom", bos_token=bos_token, eos_token=eos_token)

    @classmethod
    def for_model(
        cls, metadata: Mapping[str, Any], tokenizer: Tokenizer, override: str | None = None
    ) -> ChatTemplate:
        """`override` (`configured`) if given, else the file's template, else the built-in one of its
        architecture, else ChatML."""
        bos = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
        eos = tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
        if override is not None:
            return cls.configured(override, bos_token=bos, eos_token=eos)
        source = metadata.get("tokenizer.chat_template")
        if isinstance(source, str) and source.strip():
            try:
                return cls.from_source(source, origin="file", bos_token=bos, eos_token=eos)
            except ChatTemplateError as exc:
                # a template this renderer cannot parse must not make the model unusable
                log.warning("%s; using the built-in template instead", exc)
        arch = str(metadata.get("general.architecture", ""))
        if arch in BUILTIN_TEMPLATES:
            return cls.from_source(
                BUILTIN_TEMPLATES[arch], origin=f"builtin:{arch}", bos_token=bos, eos_token=eos
            )
        return cls.from_source(CHATML, origin="builtin:chatml", bos_token=bos, eos_token=eos)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> str:
        """The prompt for `messages`. With `continue_final_message` the last message, the assistant's, is left
        open for the model to continue (llama-server's assistant prefill): the others are rendered with the
        generation prompt and the last one's text is appended."""
        normalized = normalize_messages(list(messages))
        if not continue_final_message:
            return self._render(normalized, add_generation_prompt, extra)
        if normalized[-1]["role"] != "assistant":
            raise ChatTemplateError(
                "continue_final_message needs the last message to be the assistant's, "
                f"got {normalized[-1]['role']!r}"
            )
        return self._render(normalized[:-1], True, extra) + normalized[-1]["content"]

    def _render(
        self, normalized: list[dict[str, str]], add_generation_prompt: bool, extra: Mapping[str, Any]
    ) -> str:
        try:
            return self._template.render(
                messages=normalized,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:  # includes sandbox SecurityError
            raise ChatTemplateError(f"the chat template ({self.origin}) failed: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(
                f"the chat template ({self.origin}) failed: {type(exc).__name__}: {exc}"
            ) from exc
