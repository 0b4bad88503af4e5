"""Request bodies -> engine ``COMPLETE`` arguments, by a table of the peer's fields.

Each ``SamplingField`` names the engine field, the request keys that set it (the peer's aliases)
and its parser; a wrong type is a 400 naming the field. Unknown keys are ignored as the peer ignores
them; features that would change the output and that Strata does not have are refused by name.
``logit_bias`` (the OpenAI object or the peer's list of pairs) and structured output (``json_schema``,
``grammar``, ``response_format``) are normalized into the engine's one shape of each.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import falcon
from strata_engine.sampling import SamplingParams
from strata_engine.settings import MESSAGE_EXTRAS

from .errors import ApiError, ErrorType, invalid_request
from .slot_manager import invalid_slot_message


def _int(key: str, value: Any) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (isinstance(value, float) and not value.is_integer())
    ):
        raise invalid_request(f"'{key}' must be an integer, got {json.dumps(value)}")
    return int(value)


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid_request(f"'{key}' must be a number, got {json.dumps(value)}")
    return float(value)


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise invalid_request(f"'{key}' must be true or false, got {json.dumps(value)}")
    return value


def _stop(key: str, value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return [s for s in value if s]
    raise invalid_request(f"'{key}' must be a string or a list of strings")


@attrs.frozen
class SamplingField:
    engine_name: str
    parse: Callable[[str, Any], Any]
    keys: tuple[str, ...]  # request keys, first wins (the peer reads n_predict before its aliases)


SAMPLING_FIELDS: tuple[SamplingField, ...] = (
    SamplingField("n_predict", _int, ("n_predict", "max_tokens", "max_completion_tokens")),
    SamplingField("temperature", _number, ("temperature",)),
    SamplingField("top_k", _int, ("top_k",)),
    SamplingField("top_p", _number, ("top_p",)),
    SamplingField("min_p", _number, ("min_p",)),
    SamplingField("repeat_penalty", _number, ("repeat_penalty",)),
    SamplingField("repeat_last_n", _int, ("repeat_last_n",)),
    SamplingField("frequency_penalty", _number, ("frequency_penalty",)),
    SamplingField("presence_penalty", _number, ("presence_penalty",)),
    SamplingField("seed", _int, ("seed",)),
    SamplingField("stop", _stop, ("stop",)),
    SamplingField("ignore_eos", _bool, ("ignore_eos",)),
    SamplingField("cache_prompt", _bool, ("cache_prompt",)),
    SamplingField("n_probs", _int, ("n_probs",)),
    SamplingField("post_sampling_probs", _bool, ("post_sampling_probs",)),
)

# The engine's defaults (spec/engine-protocol.md), reported in generation_settings and /props: the sampler's
# are its SamplingParams'.
ENGINE_DEFAULTS: dict[str, Any] = {
    "n_predict": -1,
    **attrs.asdict(SamplingParams(), filter=lambda field, _: field.name != "logit_bias"),
    "seed": -1,
    "stop": [],
    "ignore_eos": False,
    "cache_prompt": True,
    "n_probs": 0,
    "post_sampling_probs": False,
    "logit_bias": [],
}

# Peer features Strata does not implement: refused when set to anything but their neutral value.
UNSUPPORTED_FIELDS: dict[str, Callable[[Any], bool]] = {
    "tools": lambda v: v in (None, []),
    "lora": lambda v: v in (None, []),
    # Samplers beyond Strata's chain (logit bias, penalties, top-k, top-p, min-p, temperature).
    "typical_p": lambda v: v in (None, 1, 1.0),
    "mirostat": lambda v: v in (None, 0),
    "dynatemp_range": lambda v: v in (None, 0, 0.0),
    "xtc_probability": lambda v: v in (None, 0, 0.0),
    "dry_multiplier": lambda v: v in (None, 0, 0.0),
    "top_n_sigma": lambda v: (
        v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0)
    ),
    "t_max_predict_ms": lambda v: v in (None, 0),
}


@attrs.frozen
class CompletionOptions:
    """What a completion request asks for, besides the prompt."""

    sampling: dict[str, Any]  # engine COMPLETE fields given by the request
    stream: bool = False
    include_usage: bool = False
    return_tokens: bool = False
    model: str | None = None
    top_logprobs: int | None = None  # chat: OpenAI logprobs asked for, with this many alternatives
    logit_bias: tuple[tuple[int | str, float | bool], ...] = ()  # the engine's [token, bias or false] pairs
    constraint: dict[str, Any] = attrs.Factory(dict)  # the engine's json_schema or grammar field, if any
    id_slot: int | None = None  # the slot the request names; None (or the peer's -1): the server chooses

    @property
    def post_sampling_probs(self) -> bool:
        return bool(self.sampling.get("post_sampling_probs", False))

    def engine_fields(self) -> dict[str, Any]:
        """The COMPLETE fields besides the prompt."""
        fields = {**self.sampling, **self.constraint}
        if self.logit_bias:
            fields["logit_bias"] = [list(pair) for pair in self.logit_bias]
        return fields

    def settings(self) -> dict[str, Any]:
        """generation_settings as reported back: the engine defaults overlaid with the request's (logit_bias
        in the peer's shape, a ban's bias null as the peer's -inf; texts as given, not tokenized)."""
        bias = [{"bias": None if b is False else b, "token": t} for t, b in self.logit_bias]
        return {**ENGINE_DEFAULTS, **self.sampling, "logit_bias": bias}


def parse_logit_bias(value: Any, n_vocab: int | None) -> tuple[tuple[int | str, float | bool], ...]:
    """The OpenAI object (``{"15043": -100, "hello": false}``) or the peer's list of pairs (``[[15043,
    -100], ["hello", false]]``) as the engine's pairs. As the peer: a key that is a whole integer is a
    token id, any other a text; a bias that is neither a number nor false, an id outside the vocabulary,
    and a malformed pair are skipped."""
    if value is None:
        return ()
    if isinstance(value, dict):
        items = [[int(k) if re.fullmatch(r"\s*[+-]?\d+", k) else k, v] for k, v in value.items()]
    elif isinstance(value, list):
        items = value
    else:
        raise invalid_request("'logit_bias' must be an object {token: bias} or a list of [token, bias] pairs")
    pairs: list[tuple[int | str, float | bool]] = []
    for item in items:
        if not (isinstance(item, list) and len(item) == 2):
            continue
        token, bias = item
        if bias is not False and (
            isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias)
        ):
            continue
        if isinstance(token, int) and not isinstance(token, bool):
            if 0 <= token and (n_vocab is None or token < n_vocab):
                pairs.append((token, bias if bias is False else float(bias)))
        elif isinstance(token, str) and token:
            pairs.append((token, bias if bias is False else float(bias)))
    return tuple(pairs)


# response_format type -> the JSON schema it asks for, from (the response_format object, the request's
# json_schema); None: no constraint.
RESPONSE_FORMATS: dict[str, Callable[[dict, Any], Any]] = {
    "text": lambda rf, schema: schema,
    # OpenAI's json_object is any JSON object; the peer's own shape may carry a schema beside the type.
    "json_object": lambda rf, schema: rf["schema"] if rf.get("schema") is not None else {"type": "object"},
    # OpenAI's {"json_schema": {"name", "schema", "strict"}}; the peer's bare "schema" beside the type too.
    "json_schema": lambda rf, schema: (
        (rf["json_schema"].get("schema") if isinstance(rf.get("json_schema"), dict) else rf.get("schema"))
        or {}
    ),
}


def parse_constraint(body: Mapping[str, Any], *, chat: bool) -> dict[str, Any]:
    """The engine's ``json_schema`` or ``grammar`` field from ``response_format``, ``json_schema`` and
    ``grammar``. ``response_format`` overrides ``json_schema``. With both a schema and a grammar, chat
    answers the peer's 400 and the completion endpoints take the grammar, as the peer does."""
    schema = body.get("json_schema")
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict):
            raise invalid_request("'response_format' must be an object")
        kind = response_format.get("type") or "text"
        if kind not in RESPONSE_FORMATS:
            raise invalid_request(
                f'response_format type must be one of "text" or "json_object", but got: {kind}'
            )
        schema = RESPONSE_FORMATS[kind](response_format, schema)
    grammar = body.get("grammar")
    if grammar is not None and not isinstance(grammar, str):
        raise invalid_request("'grammar' must be a string (a GBNF grammar)")
    if schema is not None and not isinstance(schema, (dict, bool)):
        raise invalid_request("'json_schema' must be a JSON schema (an object)")
    if schema is not None and grammar:
        if chat:
            raise invalid_request("Cannot use both json_schema and grammar")
        schema = None
    if grammar:
        return {"grammar": grammar}
    return {"json_schema": schema} if schema is not None else {}


MAX_TOP_LOGPROBS = 20


def parse_chat_logprobs(body: Mapping[str, Any]) -> tuple[dict[str, Any], int | None]:
    """OpenAI chat's ``logprobs: true`` + ``top_logprobs: N``: the body without them, and N (None: off)."""
    rest = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")}
    wanted = body.get("logprobs")
    top = body.get("top_logprobs")
    if wanted is None or wanted is False:
        if top not in (None, 0):
            raise invalid_request("'top_logprobs' needs 'logprobs': true")
        return rest, None
    _bool("logprobs", wanted)
    n = 0 if top is None else _int("top_logprobs", top)
    if not 0 <= n <= MAX_TOP_LOGPROBS:
        raise invalid_request(f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, got {n}")
    return rest, n


def parse_options(
    body: Mapping[str, Any],
    *,
    top_logprobs: int | None = None,
    n_vocab: int | None = None,
    chat: bool = False,
    n_slots: int = 1,
) -> CompletionOptions:
    sampling: dict[str, Any] = {}
    for field in SAMPLING_FIELDS:
        for key in field.keys:
            if key in body and body[key] is not None:
                sampling[field.engine_name] = field.parse(key, body[key])
                break
    logprobs = body.get("logprobs")
    if logprobs not in (None, False) and "n_probs" not in sampling:
        # The peer's completion endpoints: OpenAI's integer logprobs when n_probs is not given.
        sampling["n_probs"] = _int("logprobs", logprobs)
    for key, neutral in UNSUPPORTED_FIELDS.items():
        if key in body and not neutral(body[key]):
            raise ApiError(ErrorType.NOT_SUPPORTED, f"'{key}' is not supported by this server")
    id_slot = None if body.get("id_slot") is None else _int("id_slot", body["id_slot"])
    if id_slot == -1:
        id_slot = None
    if id_slot is not None and not 0 <= id_slot < n_slots:
        raise invalid_request(invalid_slot_message(id_slot, n_slots))
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise invalid_request("'stream_options' must be an object")
    model = body.get("model")
    if top_logprobs is not None:
        # The engine reports the top-N of each step; the chosen token is among them when greedy.
        sampling["n_probs"] = max(top_logprobs, 1, int(sampling.get("n_probs", 0)))
    return CompletionOptions(
        sampling=sampling,
        stream=_bool("stream", body["stream"]) if body.get("stream") is not None else False,
        include_usage=_bool("stream_options.include_usage", stream_options.get("include_usage", False)),
        return_tokens=_bool("return_tokens", body.get("return_tokens", False)),
        model=model if isinstance(model, str) and model else None,
        top_logprobs=top_logprobs,
        logit_bias=parse_logit_bias(body.get("logit_bias"), n_vocab),
        constraint=parse_constraint(body, chat=chat),
        id_slot=id_slot,
    )


def _is_token(item: Any) -> bool:
    return isinstance(item, int) and not isinstance(item, bool)


def _one_prompt(prompt: Any) -> bool:
    """llama-server's single prompt: a string, a list of token ids, or a list mixing strings and ids."""
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list):
        return False
    return all(_is_token(p) for p in prompt) or (
        any(_is_token(p) for p in prompt) and any(isinstance(p, str) for p in prompt)
    )


def _checked_prompt(prompt: str | list, where: str, n_vocab: int | None) -> str | list:
    if isinstance(prompt, str):
        return prompt
    for index, item in enumerate(prompt):
        if isinstance(item, dict):
            raise ApiError(ErrorType.NOT_SUPPORTED, "multimodal prompts are not supported by this server")
        if not (_is_token(item) or isinstance(item, str)):
            raise invalid_request(f"{where}[{index}] must be a string or a token id")
        if _is_token(item) and (item < 0 or (n_vocab is not None and item >= n_vocab)):
            raise invalid_request(f"{where}[{index}]: token id {item} is out of range [0, {n_vocab})")
    return prompt


def parse_prompts(body: Mapping[str, Any], *, n_vocab: int | None, key: str = "prompt") -> list[str | list]:
    """The request's prompts, as llama-server reads them (``tokenize_input_prompts``): a string, a token
    list or a list mixing strings and ids is one prompt; any other list is several, each one of those."""
    if key not in body:
        raise invalid_request(f'"{key}" must be provided')
    prompt = body[key]
    if isinstance(prompt, dict):
        return [_object_prompt(prompt, f'"{key}"')]
    if _one_prompt(prompt):
        return [_checked_prompt(prompt, f'"{key}"', n_vocab)]
    if not isinstance(prompt, list):
        raise invalid_request(
            f'"{key}" must be a string, a list of tokens, a list of mixed strings & tokens, '
            "or a list of prompts"
        )
    prompts: list[str | list] = []
    for index, item in enumerate(prompt):
        if isinstance(item, dict):
            prompts.append(_object_prompt(item, f'"{key}"[{index}]'))
            continue
        if not _one_prompt(item):
            raise invalid_request(
                f'element {index} of "{key}" must be a string, a list of tokens, or a list '
                "of mixed strings & tokens"
            )
        prompts.append(_checked_prompt(item, f'"{key}"[{index}]', n_vocab))
    return prompts


def _object_prompt(item: Mapping[str, Any], where: str) -> str:
    """llama-server's JSON object prompt, ``{"prompt_string": TEXT, "multimodal_data": [...]}``: its text (media:
    501, this server runs text models); an object without a prompt string is refused as llama-server refuses it
    (an OpenAI content part ``{"type": "text", ...}`` among them)."""
    text = item.get("prompt_string")
    if not isinstance(text, str):
        raise invalid_request(
            f"{where} elements must be a string, a list of tokens, a JSON object containing a prompt string, "
            "or a list of mixed strings & tokens"
        )
    if item.get("multimodal_data"):
        raise ApiError(ErrorType.NOT_SUPPORTED, "multimodal prompts are not supported by this server")
    return text


def parse_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid_request("'messages' must be a non-empty array")
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise invalid_request(f"'messages'[{index}] must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise invalid_request(f"'messages'[{index}].role must be a non-empty string")
        extras = {key: message[key] for key in MESSAGE_EXTRAS if message.get(key) is not None}
        out.append({"role": role, "content": _message_text(message.get("content"), index), **extras})
    return out


def _message_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or "type" not in part:
                raise invalid_request(f"'messages'[{index}].content parts must be objects with a 'type'")
            if part["type"] != "text":
                raise ApiError(
                    ErrorType.NOT_SUPPORTED,
                    f"'messages'[{index}]: content of type {part['type']!r} is not supported (text only)",
                )
            if not isinstance(part.get("text"), str):
                raise invalid_request(f"'messages'[{index}].content text part needs a string 'text'")
            parts.append(part["text"])
        return "".join(parts)
    raise invalid_request(f"'messages'[{index}].content must be a string or an array of parts")


def read_json(req: falcon.Request, max_bytes: int, *, allow_empty: bool = False) -> dict[str, Any]:
    """The request body as a JSON object; 413 past ``max_bytes``, 400 for anything not an object."""
    if req.content_length is not None and req.content_length > max_bytes:
        raise falcon.HTTPContentTooLarge(
            description=f"request body is {req.content_length} bytes; the limit is {max_bytes}"
        )
    raw = req.bounded_stream.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise falcon.HTTPContentTooLarge(description=f"request body exceeds {max_bytes} bytes")
    if not raw.strip():
        if allow_empty:
            return {}
        raise invalid_request("the request body is empty; a JSON object is expected")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid_request(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise invalid_request("the request body nests too deeply") from None
    if not isinstance(body, dict):
        raise invalid_request("the request body must be a JSON object")
    return body
