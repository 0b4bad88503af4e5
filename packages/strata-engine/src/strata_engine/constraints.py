"""Constrained decoding (structured output) with llguidance.

A request may carry one `OutputConstraint`: a JSON schema (`json_schema`) or a GBNF grammar
(`grammar`). `ConstraintCompiler` builds llguidance's tokenizer once per engine from the GGUF
vocabulary (each token's bytes; control tokens marked special; the end-of-generation tokens as its EOS),
on the first constrained request, and compiles each request's constraint into a `Constraint` -- or
refuses it before anything is evaluated (`InvalidJsonSchema`, `InvalidGrammar`, with llama-server's
messages). Per generated token a `Constraint` computes the allowed-token bitmask (into one reused
buffer), masks the logits (-inf outside it) and commits the sampled token; it is `finished` once the
output is complete and only an end-of-generation token could follow.

A request without a constraint has no `Constraint` object at all: its steps pay nothing.
"""

from __future__ import annotations

import enum
import functools
import json
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from .errors import ConstraintError, InvalidGrammar, InvalidJsonSchema
from .tokenizer import Tokenizer, TokenType

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # declared in the stub only


class ConstraintKind(enum.StrEnum):
    """The request field that carries a constraint (its wire name)."""

    JSON_SCHEMA = "json_schema"
    GRAMMAR = "grammar"


@attrs.frozen
class OutputConstraint:
    kind: ConstraintKind
    source: str  # the JSON schema as JSON text, or the GBNF grammar


# JSON as json.dumps writes it (", " and ": ", no other whitespace): a small model cannot wander into
# endless whitespace. Keywords llguidance cannot enforce are refused (strict), never silently ignored.
JSON_COMPILE_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "lenient": False,
}


def _json_schema_grammar(source: str) -> str:
    schema = json.loads(source)
    if schema is True:
        schema = {}  # the schema `true` accepts any JSON value, as `{}` does
    if not isinstance(schema, dict):
        raise ValueError("the schema must be an object or true (false accepts nothing)")
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_COMPILE_OPTIONS)


def _gbnf_grammar(source: str) -> str:
    return llguidance.grammar_from("gbnf", source)


@attrs.frozen
class _Compilation:
    to_grammar: Callable[[str], str]  # the source -> llguidance's grammar (ValueError when malformed)
    error: type[ConstraintError]
    headline: str  # llama-server's message for the same refusal; the cause follows it on a new line


_COMPILATIONS: dict[ConstraintKind, _Compilation] = {
    ConstraintKind.JSON_SCHEMA: _Compilation(
        _json_schema_grammar, InvalidJsonSchema, '"json_schema": JSON schema conversion failed:'
    ),
    ConstraintKind.GRAMMAR: _Compilation(
        _gbnf_grammar, InvalidGrammar, "Failed to initialize samplers: failed to parse grammar"
    ),
}

# llguidance's mark of a special token: its bytes start with 0xFF (no UTF-8 text does).
_SPECIAL_MARK = b"\xff"


class _LLVocabulary:
    """What llguidance's `TokenizerWrapper` reads of a tokenizer: the bytes of every token, the EOS and
    BOS ids, and a call that tokenizes text (llguidance uses it to tokenize forced text)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [self._token(i) for i in range(tokenizer.n_vocab)]
        self.special_token_ids = [i for i, t in enumerate(self.tokens) if t.startswith(_SPECIAL_MARK)]

    def _token(self, token_id: int) -> bytes:
        tok = self._tokenizer
        token_type = tok.vocab.token_type(token_id)
        text = tok.token_text(token_id)
        # As llguidance's llama.cpp adapter: control tokens, and user-defined ones written like them,
        # are special (a grammar never produces them by their text); unused tokens have no bytes.
        if token_type in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.UNUSED, TokenType.UNDEFINED) or (
            token_type == TokenType.USER_DEFINED and text.startswith("<") and text.endswith(">")
        ):
            return _SPECIAL_MARK + text.encode("utf-8")
        return tok.token_bytes(token_id)

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special=False, parse_special=False)


class Constraint:
    """One request's compiled constraint: the mask of each step, and the tokens committed so far."""

    def __init__(self, matcher: llguidance.LLMatcher, n_vocab: int):
        self._matcher = matcher
        self._n_vocab = n_vocab
        self._bitmask = allocate_token_bitmask(1, n_vocab)

    def allowed(self) -> np.ndarray:
        """The tokens the constraint allows next, as a boolean array over the vocabulary."""
        fill_next_token_bitmask(self._matcher, self._bitmask)
        return np.unpackbits(self._bitmask.view(np.uint8), count=self._n_vocab, bitorder="little").view(
            np.bool_
        )

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """`logits` with every token the constraint forbids at -inf (a new array)."""
        allowed = self.allowed()
        if logits.shape[-1] != allowed.shape[0]:  # logits past the tokenizer's vocabulary: never allowed
            allowed = np.pad(allowed, (0, logits.shape[-1] - allowed.shape[0]))
        return np.where(allowed, logits, np.float32(-np.inf))

    def commit(self, token: int) -> bool:
        """Advance past the sampled `token`; False if the constraint does not allow it."""
        return bool(self._matcher.consume_token(token))

    @property
    def finished(self) -> bool:
        """The output is complete and nothing but an end-of-generation token may follow."""
        return self._matcher.is_stopped() and self._matcher.is_accepting()


class ConstraintCompiler:
    """Compiles requests' constraints against one engine's vocabulary."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer

    @functools.cached_property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer of this vocabulary, built on first use (about a second: bench/engine/DECISIONS.md "Constrained decoding")
        and kept for the engine's life."""
        tok = self._tokenizer
        return llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_LLVocabulary(tok)),
            n_vocab=tok.n_vocab,
            eos_token=sorted(tok.end_of_generation),
        )

    def compile(self, constraint: OutputConstraint) -> Constraint:
        """The request's `Constraint`; `InvalidJsonSchema` / `InvalidGrammar` when it cannot be enforced."""
        compilation = _COMPILATIONS[constraint.kind]
        try:
            grammar = compilation.to_grammar(constraint.source)
        except ValueError as exc:  # json.JSONDecodeError included
            raise compilation.error(f"{compilation.headline}\n{exc}") from None
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise compilation.error(f"{compilation.headline}\n{matcher.get_error()}")
        return Constraint(matcher, self._tokenizer.n_vocab)
