"""The engine protocol's wire layer (spec/engine-protocol.md, "Lines"): every verb's object as an attrs class,
structured by one private cattrs converter, and `VERBS`, the table of the verbs (their argument, its class,
where they run, whether they name a slot).

A field's type names its JSON check (`Wire`, in `Annotated`); a field that may be null means its default.
Unknown fields are ignored, as llama-server does. Every bad field is named in one `InvalidRequest`
(`arguments`), and a class's `rules` check what no one field can. The same converter turns the engine's
attrs results into JSON objects (`unstructure`). Of the engine this module loads only the exceptions, the
protocol's vocabulary and the settings' enums, so the server's fake engine speaks through it too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar, get_args

import attrs
import cattrs

from .errors import InvalidRequest
from .protocol import ArgumentKind, CommandRegistry, Dispatch, Handler, Request, SaveFormat
from .settings import Pooling, values

MAX_N_PROBS = 100
MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 65536  # pairs in one request
EUCLIDEAN = 2  # llama-server's default embd_normalize
SHOWN_CHARS = 80  # of a bad value, in its problem


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "…"


@attrs.frozen
class Wire:
    """A JSON value's check: `good` says what passes `test`; `convert` makes the field's value of it."""

    good: str
    test: Callable[[Any], bool]
    convert: Callable[[Any], Any] = lambda value: value

    def structure(self, value: Any) -> Any:
        if not self.test(value):
            raise ValueError(f"must be {self.good}, got {_shown(value)}")
        return self.convert(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(t) for t in value)


Boolean = Annotated[bool, Wire("a boolean", lambda v: isinstance(v, bool))]
Text = Annotated[str, Wire("a string", lambda v: isinstance(v, str))]
Integer = Annotated[int, Wire("an integer", _is_int)]
Count = Annotated[int, Wire("an integer >= 0", lambda v: _is_int(v) and v >= 0)]
Number = Annotated[float, Wire("a finite number", _is_number, float)]
TokenIds = Annotated[list[int], Wire("a list of token ids", _is_token_ids)]
Path = Annotated[
    str,
    Wire(
        "a non-empty string without line breaks or NUL",
        lambda v: isinstance(v, str) and bool(v) and not any(c in v for c in "\r\n\0"),
    ),
]


def _problem(name: str, exc: BaseException, type_: Any) -> list[str]:
    if isinstance(exc, InvalidRequest):  # a check that names its own problems (`LogitBias`)
        return exc.problems
    if isinstance(exc, KeyError):
        wire = _wire_of(type_)
        return [f"{name} must be {wire.good}" if wire is not None else f"{name} is required"]
    return [f"{name} {exc}"]


def _wire_of(type_: Any) -> Wire | None:
    """The check of a field's type (`Annotated[T, Wire]`, or that or None)."""
    for candidate in (type_, *get_args(type_)):
        wire = next((a for a in getattr(candidate, "__metadata__", ()) if isinstance(a, Wire)), None)
        if wire is not None:
            return wire
    return None


# ---- COMPLETE and PROMPT_TOKENS ------------------------------------------------------------------------


def _bias_pairs(raw: Any) -> tuple[tuple[int | str, float], ...]:
    """[[token id or text, bias or false], ...]; false bans (-inf). Each bad pair is named."""
    good = f"logit_bias must be a list of at most {MAX_LOGIT_BIAS} [token id or text, number or false] pairs"
    if not isinstance(raw, list) or len(raw) > MAX_LOGIT_BIAS:
        raise InvalidRequest([good])
    pairs: list[tuple[int | str, float]] = []
    problems: list[str] = []
    for index, pair in enumerate(raw):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise InvalidRequest([f"{good}; item {index} is {_shown(pair)}"])
        token, bias = pair
        if not ((_is_int(token) and token >= 0) or (isinstance(token, str) and token)):
            problems.append(
                f"logit_bias[{index}][0] must be a token id >= 0 or a non-empty text, got {token!r}"
            )
        elif bias is False:
            pairs.append((token, -math.inf))
        elif _is_number(bias):
            pairs.append((token, float(bias)))
        else:
            problems.append(f"logit_bias[{index}][1] must be a finite number or false, got {bias!r}")
    if problems:
        raise InvalidRequest(problems)
    return tuple(pairs)


Prompt = Annotated[
    str | tuple[str | int, ...],
    Wire(
        "a string or a non-empty list of strings and token ids",
        lambda v: (
            isinstance(v, str)
            or (isinstance(v, list) and bool(v) and all(isinstance(p, str) or _is_int(p) for p in v))
        ),
        lambda v: v if isinstance(v, str) else tuple(v),
    ),
]
Messages = Annotated[
    tuple[Mapping[str, Any], ...],
    Wire(
        "a non-empty list of {role, content} objects",
        lambda v: isinstance(v, list) and bool(v) and all(isinstance(m, Mapping) for m in v),
        tuple,
    ),
]
Tools = Annotated[tuple[Any, ...], Wire("a list (OpenAI's tools)", lambda v: isinstance(v, list), tuple)]
TemplateKwargs = Annotated[
    Mapping[str, Any], Wire("an object (chat template variables)", lambda v: isinstance(v, Mapping), dict)
]
Stop = Annotated[
    tuple[str, ...],
    Wire(
        f"a list of at most {MAX_STOP_STRINGS} non-empty strings",
        lambda v: (
            isinstance(v, list) and len(v) <= MAX_STOP_STRINGS and all(isinstance(s, str) and s for s in v)
        ),
        tuple,
    ),
]
LogitBias = Annotated[
    tuple[tuple[int | str, float], ...], Wire("a list of [token, bias] pairs", lambda v: True, _bias_pairs)
]
JsonSchema = Annotated[
    Any, Wire("a JSON schema (an object or a boolean)", lambda v: isinstance(v, (Mapping, bool)))
]
Grammar = Annotated[str, Wire("a string (GBNF)", lambda v: isinstance(v, str))]
NPredict = Annotated[int, Wire("an integer >= -2", lambda v: _is_int(v) and v >= -2)]
AtLeastMinusOne = Annotated[int, Wire("an integer >= -1", lambda v: _is_int(v) and v >= -1)]
Positive = Annotated[float, Wire("a number > 0", lambda v: _is_number(v) and v > 0.0, float)]
Seed = Annotated[int, Wire("an integer in [-1, 2^64)", lambda v: _is_int(v) and -1 <= v < 2**64)]
NProbs = Annotated[
    int, Wire(f"an integer in [0, {MAX_N_PROBS}]", lambda v: _is_int(v) and 0 <= v <= MAX_N_PROBS)
]
SaveFormatName = Annotated[
    SaveFormat, Wire(f"one of {', '.join(values(SaveFormat))}", lambda v: v in values(SaveFormat), SaveFormat)
]
PoolingName = Annotated[
    Pooling, Wire(f"one of {', '.join(values(Pooling))}", lambda v: v in values(Pooling), Pooling)
]


@attrs.frozen
class Rule:
    """A check across fields, of the object as sent."""

    holds: Callable[[Mapping[str, Any]], bool]
    problem: str


@attrs.frozen
class CompleteArgs:
    """COMPLETE's (and PROMPT_TOKENS') object (spec "COMPLETE"); None: the engine's default
    (completion.completion_request applies them)."""

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            lambda obj: (obj.get("prompt") is None) != (obj.get("messages") is None),
            "exactly one of prompt and messages must be given",
        ),
        Rule(
            lambda obj: obj.get("json_schema") is None or obj.get("grammar") in (None, ""),
            "give json_schema or grammar, not both",
        ),
    )

    prompt: Prompt | None = None
    messages: Messages | None = None
    add_special: Boolean | None = None  # None: the model's add_bos
    add_generation_prompt: Boolean | None = None
    continue_final_message: Boolean | None = None
    tools: Tools | None = None  # messages: the template's `tools`
    chat_template_kwargs: TemplateKwargs | None = None  # messages: more template variables
    return_progress: Boolean | None = None
    n_predict: NPredict | None = None
    temperature: Number | None = None
    top_k: Integer | None = None
    top_p: Number | None = None
    min_p: Number | None = None
    repeat_penalty: Positive | None = None
    repeat_last_n: AtLeastMinusOne | None = None
    frequency_penalty: Number | None = None
    presence_penalty: Number | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    ignore_eos: Boolean | None = None
    cache_prompt: Boolean | None = None
    n_probs: NProbs | None = None
    post_sampling_probs: Boolean | None = None
    logit_bias: LogitBias | None = None
    json_schema: JsonSchema | None = None
    grammar: Grammar | None = None  # "" is none


# ---- the other verbs -------------------------------------------------------------------------------------


@attrs.frozen
class NoArgs:
    """A verb whose object has no fields of its own (`id` and `slot` are every verb's: protocol.parse_line)."""


@attrs.frozen
class TokenizeArgs:
    content: Text
    add_special: Boolean = False
    parse_special: Boolean = True
    with_pieces: Boolean = False


@attrs.frozen
class DetokenizeArgs:
    tokens: TokenIds


@attrs.frozen
class EmbedArgs:
    tokens: TokenIds
    pooling: PoolingName | None = None  # None: the model's
    normalize: AtLeastMinusOne = EUCLIDEAN


@attrs.frozen
class ApplyTemplateArgs:
    messages: Any = None  # the chat template checks them (a refusal is a chat_template error)
    add_generation_prompt: Boolean = True
    continue_final_message: Boolean = False
    tools: Tools | None = None
    chat_template_kwargs: TemplateKwargs | None = None


@attrs.frozen
class SaveArgs:
    path: Path
    sync: Boolean = True  # False: neither the file nor its folder fsynced (the client makes it durable later)
    format: SaveFormatName = SaveFormat.STRATA  # llama.cpp: a slot file llama-server restores
    v_trans: Boolean = False  # llama.cpp only: V transposed, for a llama-server without flash attention
    notes: Text | None = None  # the client's text, kept in the file's engine fields (format v1 only)


@attrs.frozen
class RestoreArgs:
    path: Path


@attrs.frozen
class RestorePrefixArgs:
    path: Path
    cut_to: Count | None = None  # None: keep every token of the file
    min_keep: Count = 0
    discard_held: Boolean = False


# ---- the converter ---------------------------------------------------------------------------------------


def _wire_hook(type_: Any) -> Callable[[Any, Any], Any]:
    wire = _wire_of(type_)
    assert wire is not None  # the factory's predicate asked
    return lambda value, _: wire.structure(value)


def _make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(detailed_validation=True)
    converter.register_structure_hook_factory(
        lambda type_: _wire_of(type_) is not None and getattr(type_, "__metadata__", None) is not None,
        _wire_hook,
    )
    return converter


_converter = _make_converter()
unstructure = _converter.unstructure


def arguments(cls: type, obj: Any) -> Any:
    """The verb's object as `cls`; every bad field (and broken rule) named in one InvalidRequest."""
    if not isinstance(obj, Mapping):
        raise InvalidRequest(["the request must be a JSON object"])
    problems: list[str] = []
    parsed: Any = None
    try:
        parsed = _converter.structure(obj, cls)
    except cattrs.ClassValidationError as exc:
        named, others = exc.group_exceptions()
        for error, note in named:
            problems += _problem(note.name, error, note.type)
        problems += [str(error) for error in others]
    problems += [rule.problem for rule in getattr(cls, "rules", ()) if not rule.holds(obj)]
    if problems:
        raise InvalidRequest(problems)
    return parsed


def arguments_of(request: Request) -> Any:
    """A request's object as its verb's argument class (`VERBS`)."""
    return arguments(VERBS[request.verb].arguments, request.args)


# ---- the verbs -------------------------------------------------------------------------------------------


@attrs.frozen
class Verb:
    """A verb of the protocol (spec "Lines" and "Scheduling")."""

    argument: ArgumentKind
    arguments: type  # its object's class
    dispatch: Dispatch
    slotted: bool = (
        False  # it acts on one slot: its object may name `slot`, it is refused while the slot is busy
    )


JSON, OPTIONAL = ArgumentKind.JSON, ArgumentKind.OPTIONAL
VERBS: dict[str, Verb] = {
    "COMPLETE": Verb(JSON, CompleteArgs, Dispatch.JOB, slotted=True),
    "PROMPT_TOKENS": Verb(JSON, CompleteArgs, Dispatch.WORKER),
    "TOKENIZE": Verb(JSON, TokenizeArgs, Dispatch.WORKER),
    "DETOKENIZE": Verb(JSON, DetokenizeArgs, Dispatch.WORKER),
    "APPLY_TEMPLATE": Verb(JSON, ApplyTemplateArgs, Dispatch.WORKER),
    "EMBED": Verb(JSON, EmbedArgs, Dispatch.JOB),
    "STATUS": Verb(OPTIONAL, NoArgs, Dispatch.NOW),
    "ERASE": Verb(OPTIONAL, NoArgs, Dispatch.NOW, slotted=True),
    "CANCEL": Verb(JSON, NoArgs, Dispatch.NOW),
    "QUIT": Verb(OPTIONAL, NoArgs, Dispatch.NOW),
    "SAVE": Verb(JSON, SaveArgs, Dispatch.SESSION, slotted=True),
    "RESTORE": Verb(JSON, RestoreArgs, Dispatch.SESSION, slotted=True),
    "RESTORE_PREFIX": Verb(JSON, RestorePrefixArgs, Dispatch.SESSION, slotted=True),
}


def register(registry: CommandRegistry, handlers: Mapping[str, Handler]) -> None:
    """Install each verb's handler, as `VERBS` says the verb is."""
    for verb, handler in handlers.items():
        spec = VERBS[verb]
        registry.register(verb, spec.argument, handler, spec.dispatch, slotted=spec.slotted)
