"""Chat templates: `tokenizer.chat_template` rendered in a sandboxed jinja2 environment (as Hugging Face
transformers renders it), or, for a file without one, the built-in turn format of its family."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping, Sequence
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

# llama.cpp's capability probes (common/jinja/caps.cpp): a system turn whose content the template must read
SYSTEM_PROBE = ({"role": "system", "content": "System message"}, {"role": "user", "content": "User message"})
PROBE_TOOLS = (
    {
        "name": "tool",
        "type": "function",
        "function": {
            "name": "tool1",
            "description": "Tool description",
            "parameters": {
                "type": "object",
                "properties": {"arg": {"type": "string", "description": "Arg description"}},
                "required": ["arg"],
            },
        },
    },
)

# what llama-server's preserve_reasoning (on by default) sets beside it: name -> its value when preserving
PRESERVE_REASONING_VARIABLES: Mapping[str, bool] = {
    "preserve_thinking": True,
    "clear_thinking": False,
    "truncate_history_thinking": False,
    "drop_thinking": False,
}
# the names a template may read llama-server's reasoning_effort by
REASONING_EFFORT_VARIABLES = ("reasoning_effort", "reasoning_strength")
# llama.cpp maps the developer role to system except for templates with channels (GPT-OSS's harmony)
KEEPS_DEVELOPER_ROLE = "<|channel|>"


def _object_arguments_probe() -> list[dict[str, Any]]:
    """caps.cpp's conversation with one tool call whose arguments are an object (fresh: the probe watches
    these very dicts)."""
    call = {
        "id": "call00001",
        "type": "function",
        "function": {"name": "tool1", "arguments": {"arg": "value"}},
    }
    return [
        {"role": "user", "content": "User message"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"},
        {"role": "assistant", "content": "The tool response was 'tool response'"},
        {"role": "user", "content": "User message"},
    ]


def _with_object_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """`message` with its tool calls' JSON-text arguments parsed (common/chat.cpp's func_args_not_string)."""
    calls = []
    for i, call in enumerate(message["tool_calls"]):
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping) and isinstance(arguments := function.get("arguments"), str):
            try:
                parsed = json.loads(arguments)
            except json.JSONDecodeError as exc:
                raise ChatTemplateError(f"tool_calls[{i}].function.arguments is not JSON: {exc}") from exc
            call = {**call, "function": {**function, "arguments": parsed}}
        calls.append(call)
    return {**message, "tool_calls": calls}


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _plain(value: Any) -> Any:
    """`value` with jinja's lazy sequences (a `map` filter's generator) as the lists llama.cpp's jinja has."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)) or isinstance(value, Iterator):
        return [_plain(item) for item in value]
    return value


def _deep_keys(value: Any) -> Iterator[tuple[int, Any]]:
    """Every (container, key) inside `value`: what llama.cpp's tojson marks as read."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield id(value), key
            yield from _deep_keys(item)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield id(value), index
            yield from _deep_keys(item)


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


class _Environment(ImmutableSandboxedEnvironment):
    """The sandbox, noting which (container, key) a render reads while a capability probe watches (what
    llama.cpp's jinja counts as a value "used")."""

    watched: set[tuple[int, Any]] | None = None

    def getitem(self, obj: Any, argument: Any) -> Any:
        if self.watched is not None:
            self.watched.add((id(obj), argument))
        return super().getitem(obj, argument)

    def getattr(self, obj: Any, attribute: str) -> Any:
        if self.watched is not None:
            self.watched.add((id(obj), attribute))
        return super().getattr(obj, attribute)


def _environment() -> _Environment:
    env = _Environment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols"],
        autoescape=False,
        undefined=_Empty,
    )

    def tojson(
        value: Any,
        indent: int | None = None,
        separators=None,
        sort_keys: bool = False,
        ensure_ascii: bool = False,
    ) -> str:
        if env.watched is not None:
            env.watched.update(_deep_keys(value))
        value = _plain(value)
        return json.dumps(
            value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii
        )

    env.filters["tojson"] = tojson
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
    # llama.cpp's template capabilities (caps.cpp) that change the messages it is given: a system turn it
    # does not read is merged into the next turn; tool call arguments given as JSON text reach a template that
    # reads them as an object parsed
    supports_system_role: bool = True
    supports_object_arguments: bool = False

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
        return attrs.evolve(
            made,
            supports_thinking=made._reacts_to_thinking(),
            supports_system_role=made._reads(SYSTEM_PROBE, 0, "content"),
            supports_object_arguments=made._reads_object_arguments(),
        )

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
            return self._render(self._as_given_by_llama_server(normalized), add_generation_prompt, context)
        if normalized[-1]["role"] != "assistant":
            raise ChatTemplateError(
                "continue_final_message needs the last message to be the assistant's, "
                f"got {normalized[-1]['role']!r}"
            )
        # as the peer: the continued message is set apart before the others are handed over
        rest = self._as_given_by_llama_server(normalized[:-1])
        return self._render(rest, True, context) + normalized[-1]["content"]

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
        # common_chat_template_direct_apply_impl: these two kwargs also set the names templates read them by
        if isinstance(kwargs.get("preserve_reasoning"), bool):
            preserve = kwargs["preserve_reasoning"]
            context.update({name: value == preserve for name, value in PRESERVE_REASONING_VARIABLES.items()})
        if isinstance(kwargs.get("reasoning_effort"), str) and kwargs["reasoning_effort"]:
            context.update(dict.fromkeys(REASONING_EFFORT_VARIABLES, kwargs["reasoning_effort"]))
        return context

    def _as_given_by_llama_server(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages as common_chat_templates_apply_jinja hands them to this template: developer is system
        (but for channel templates), a system turn the template does not read is merged into the next one,
        and JSON-text tool call arguments are parsed for a template that reads them as an object."""
        if self._template is None:
            return messages
        if KEEPS_DEVELOPER_ROLE not in self.source:
            messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        if not self.supports_system_role and messages and messages[0]["role"] == "system":
            first, rest = messages[0], messages[1:]
            if rest:
                rest = [{**rest[0], "content": first["content"] + "\n" + rest[0]["content"]}, *rest[1:]]
            messages = rest
        if self.supports_object_arguments:
            messages = [_with_object_arguments(m) if m.get("tool_calls") else m for m in messages]
        return messages

    def _render_watched(
        self, messages: list[dict[str, Any]], tools: Sequence[Any]
    ) -> tuple[set[tuple[int, Any]], bool]:
        """What one render of a probe reads, and whether it succeeded, as caps.cpp's caps_try_execute renders
        it: empty BOS and EOS, the generation prompt."""
        assert self._template is not None
        env = self._template.environment
        assert isinstance(env, _Environment)
        env.watched = set()
        try:
            self._template.render(
                messages=messages, tools=list(tools), bos_token="", eos_token="", add_generation_prompt=True
            )
            succeeded = True
        except Exception:  # noqa: BLE001 - a probe learns from the failure; real renders report it
            succeeded = False
        reads, env.watched = env.watched, None
        return reads, succeeded

    def _reads(self, probe: Sequence[Mapping[str, Any]], index: int, key: str) -> bool:
        """Whether a render of `probe` reads messages[index][key] (a failed render's reads count too)."""
        messages = [dict(m) for m in probe]
        reads, _ = self._render_watched(messages, [])
        return (id(messages[index]), key) in reads

    def _reads_object_arguments(self) -> bool:
        """caps.cpp's supports_object_arguments: a render of a tool call with object arguments succeeds and
        reads the argument (retried once with an empty reasoning_content on the assistant turns, as caps.cpp)."""
        messages = _object_arguments_probe()
        arguments = messages[1]["tool_calls"][0]["function"]["arguments"]
        reads, succeeded = self._render_watched(messages, PROBE_TOOLS)
        if not succeeded:
            for message in messages:
                if message["role"] == "assistant":
                    message.setdefault("reasoning_content", "")
            reads, succeeded = self._render_watched(messages, PROBE_TOOLS)
        return succeeded and (id(arguments), "arg") in reads

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
