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
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .chat_formats import FORMATS, Format
from .errors import ChatTemplateError
from .settings import MESSAGE_EXTRAS, ChatTemplateName, chat_template_problem, values
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)


# ChatML: what llama.cpp falls back to for a file without a template (common/chat.cpp's CHATML_TEMPLATE_SRC),
# and what it renders for `--chat-template chatml`.
CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# general.architecture -> the built-in format for files that carry no template
BUILTIN_TEMPLATES: Mapping[str, ChatTemplateName] = {
    "gemma3": ChatTemplateName.GEMMA,
    "gemma2": ChatTemplateName.GEMMA,
    "gemma": ChatTemplateName.GEMMA,
}

# llama-server's date variables (common_chat_extra_context): name -> strftime format
DATE_VARIABLES: Mapping[str, str] = {"date_string": "%d %b %Y", "datetime": "%b %d %Y"}

# the one user message llama.cpp renders to learn whether a template reacts to enable_thinking
THINKING_PROBE = ({"role": "user", "content": "test"},)


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


class _Empty(jinja2.ChainableUndefined):
    """An undefined variable, a member of one, or one added to a string, is empty (llama.cpp's jinja)."""

    def _refused(self) -> bool:  # what the sandbox refused stays an error, not an empty value
        return issubclass(self._undefined_exception, SecurityError)

    def __getattr__(self, name: str) -> Any:
        if self._refused():
            self._fail_with_undefined_error()
        return super().__getattr__(name)

    def __str__(self) -> str:
        if self._refused():
            self._fail_with_undefined_error()
        return ""

    def __add__(self, other: Any) -> Any:
        return other

    def __radd__(self, other: Any) -> Any:
        return other


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols"],
        autoescape=False,
        undefined=_Empty,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check `messages` (a list of ``{"role": str, "content": str | [{"type": "text", "text": str}]}``)
    and return them with string contents, each with its `MESSAGE_EXTRAS` as given; every problem is
    reported together."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {role, content} objects")
    problems: list[str] = []
    normalized: list[dict[str, Any]] = []
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
            extras = {key: message[key] for key in MESSAGE_EXTRAS if message.get(key) is not None}
            normalized.append({"role": role, "content": content, **extras})
    if problems:
        raise ChatTemplateError("invalid messages: " + "; ".join(problems))
    return normalized


def _enable_thinking(kwargs: Mapping[str, Any], default: bool) -> bool:
    """llama-server's enable_thinking: the template kwarg when it is a boolean, else `default`."""
    value = kwargs.get("enable_thinking")
    if isinstance(value, str):
        raise ChatTemplateError('invalid type for "enable_thinking" (expected boolean, got string)')
    return value if isinstance(value, bool) else default


@attrs.frozen
class ChatTemplate:
    """A jinja template (`_template`) or one of llama.cpp's built-in formats (`_format`), and what the
    model's vocabulary gives it (llama-server's common_chat_templates_init)."""

    source: str = attrs.field(repr=False)  # the jinja text, or the built-in format's name
    origin: str  # "file" (tokenizer.chat_template), "custom", or "builtin:<name>"
    bos_token: str = ""
    eos_token: str = ""
    add_bos: bool = False  # the tokenizer adds BOS: a rendered leading BOS text is dropped, as the peer does
    add_eos: bool = False  # likewise a trailing EOS text
    _template: jinja2.Template | None = attrs.field(default=None, repr=False, alias="_template")
    _format: Format | None = attrs.field(default=None, repr=False, alias="_format")
    # the template reacts to enable_thinking: llama-server's default for it under --reasoning auto
    supports_thinking: bool = False

    @classmethod
    def from_source(
        cls,
        source: str,
        *,
        origin: str,
        bos_token: str = "",
        eos_token: str = "",
        add_bos: bool = False,
        add_eos: bool = False,
    ) -> ChatTemplate:
        try:
            template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"the chat template ({origin}) does not parse: line {exc.lineno}: {exc.message}"
            ) from exc
        made = cls(
            source=source,
            origin=origin,
            bos_token=bos_token,
            eos_token=eos_token,
            add_bos=add_bos,
            add_eos=add_eos,
            _template=template,
        )
        return attrs.evolve(made, supports_thinking=made._reacts_to_thinking())

    @classmethod
    def builtin(cls, name: ChatTemplateName, *, origin: str = "", **tokens: Any) -> ChatTemplate:
        """llama.cpp's built-in format `name`; chatml is its jinja CHATML (the peer's, tools and all)."""
        origin = origin or f"builtin:{name}"
        if name == ChatTemplateName.CHATML:
            return cls.from_source(CHATML, origin=origin, **tokens)
        return cls(source=str(name), origin=origin, _format=FORMATS[name], **tokens)

    @classmethod
    def configured(cls, value: str, **tokens: Any) -> ChatTemplate:
        """`--chat-template`'s value: a built-in name (`ChatTemplateName`) or a jinja template."""
        if value in values(ChatTemplateName):
            return cls.builtin(ChatTemplateName(value), **tokens)
        problem = chat_template_problem(value)
        if problem:
            raise ChatTemplateError(f"chat template {problem}")
        return cls.from_source(value, origin="custom", **tokens)

    @classmethod
    def for_model(
        cls, metadata: Mapping[str, Any], tokenizer: Tokenizer, override: str | None = None
    ) -> ChatTemplate:
        """`override` (`configured`) if given, else the file's template, else the built-in one of its
        architecture, else ChatML."""
        tokens: dict[str, Any] = {
            "bos_token": tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else "",
            "eos_token": tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else "",
            "add_bos": tokenizer.add_bos,
            "add_eos": bool(tokenizer.vocab.add_eos and tokenizer.eos_id is not None),
        }
        if override is not None:
            return cls.configured(override, **tokens)
        source = metadata.get("tokenizer.chat_template")
        if isinstance(source, str) and source.strip():
            try:
                return cls.from_source(source, origin="file", **tokens)
            except ChatTemplateError as exc:
                # a template this renderer cannot parse must not make the model unusable
                log.warning("%s; using the built-in template instead", exc)
        arch = str(metadata.get("general.architecture", ""))
        if arch in BUILTIN_TEMPLATES:
            return cls.builtin(BUILTIN_TEMPLATES[arch], origin=f"builtin:{arch}", **tokens)
        return cls.from_source(CHATML, origin="builtin:chatml", **tokens)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt for `messages`, as llama-server renders it: `tools` (when not empty) and the
        `chat_template_kwargs` (the server's defaults and the request's, merged) reach the template beside
        `enable_thinking` and the date. With `continue_final_message` the last message, the assistant's, is
        left open for the model to continue (llama-server's assistant prefill): the others are rendered with
        the generation prompt and the last one's text is appended."""
        normalized = normalize_messages(list(messages))
        context = self._context(tools, dict(chat_template_kwargs or {}))
        if not continue_final_message:
            return self._render(normalized, add_generation_prompt, context)
        if normalized[-1]["role"] != "assistant":
            raise ChatTemplateError(
                "continue_final_message needs the last message to be the assistant's, "
                f"got {normalized[-1]['role']!r}"
            )
        return self._render(normalized[:-1], True, context) + normalized[-1]["content"]

    def _context(self, tools: Sequence[Any] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The template's variables besides messages and add_generation_prompt (common/chat.cpp's
        common_chat_template_direct_apply_impl: the kwargs last, over the rest)."""
        if self._format is not None and tools:
            raise ChatTemplateError(
                f"tools need a jinja chat template; the built-in format {self.source!r} has no place for them"
            )
        now = datetime.now()
        context: dict[str, Any] = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "enable_thinking": _enable_thinking(kwargs, self.supports_thinking),
        }
        if tools:
            context["tools"] = list(tools)
        context.update({name: now.strftime(fmt) for name, fmt in DATE_VARIABLES.items()})
        context.update(kwargs)
        return context

    def _reacts_to_thinking(self) -> bool:
        """Whether the generation prompt of one user message changes with enable_thinking (what llama.cpp's
        common_chat_templates_support_enable_thinking learns from its template analysis)."""
        try:
            on, off = (
                self._render(list(THINKING_PROBE), True, {"enable_thinking": flag}) for flag in (True, False)
            )
        except ChatTemplateError:
            return False
        return on != off

    def _render(
        self, normalized: list[dict[str, Any]], add_generation_prompt: bool, context: Mapping[str, Any]
    ) -> str:
        if self._format is not None:
            return self._format(normalized, add_generation_prompt)
        assert self._template is not None
        flags = (
            {"add_generation_prompt": True} if add_generation_prompt else {}
        )  # else undefined, as the peer's
        try:
            text = self._template.render(messages=normalized, **{**context, **flags})
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:  # includes sandbox SecurityError
            raise ChatTemplateError(f"the chat template ({self.origin}) failed: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(
                f"the chat template ({self.origin}) failed: {type(exc).__name__}: {exc}"
            ) from exc
        # the tokenizer adds them: the peer drops the template's own copies
        if self.add_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        if self.add_eos and self.eos_token and text.endswith(self.eos_token):
            text = text[: -len(self.eos_token)]
        return text
