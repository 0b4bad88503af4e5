"""`Tokenizer`: text <-> token ids for a GGUF model, built from its metadata alone."""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from ..errors import TokenizerError, UnsupportedTokenizer
from .bpe import (
    DEFAULT_PRE,
    BytePairEncoder,
    clean_up_spaces,
    default_add_bos,
    normal_token_bytes,
    pre_tokenizer_of,
)
from .reference import ReferenceBytePairEncoder, ReferenceSentencePieceEncoder
from .spm import SPACE_MARK, SentencePieceEncoder
from .stream import Utf8Stream
from .unicode import bytes_to_unicode, replace_surrogates
from .vocab import TokenType, Vocabulary


class Implementation(enum.Enum):
    """Which encoders a `Tokenizer` runs: the compiled ones, or the pure-Python oracle they must match."""

    COMPILED = "compiled"
    REFERENCE = "reference"


EncoderFactory = Callable[[Vocabulary, Mapping[str, Any]], Any]


@attrs.frozen
class TokenizerKind:
    """How to build one `tokenizer.ggml.model` kind, with llama.cpp's defaults for keys a file omits."""

    encoders: Mapping[Implementation, EncoderFactory]
    # llama.cpp's default where the file has no tokenizer.ggml.add_bos_token (byte-level BPE: per pre-tokenizer)
    default_add_bos: Callable[[Mapping[str, Any]], bool]
    default_add_space_prefix: bool
    # False: spaces are escaped as U+2581 in the vocabulary (SentencePiece), else byte-level (GPT-2).
    byte_level: bool
    # whether decoding ends with llama.cpp's `clean_spaces` pass (bpe.clean_up_spaces)
    clean_spaces: Callable[[Mapping[str, Any]], bool]


def _bpe(encoder: type) -> EncoderFactory:
    def build(vocab: Vocabulary, metadata: Mapping[str, Any]) -> Any:
        merges = metadata.get("tokenizer.ggml.merges")
        if not isinstance(merges, (list, tuple)):
            raise TokenizerError("tokenizer.ggml.merges is required by the gpt2 (byte-level BPE) tokenizer")
        return encoder(vocab, merges, str(metadata.get("tokenizer.ggml.pre", DEFAULT_PRE)))

    return build


def _spm(encoder: type) -> EncoderFactory:
    return lambda vocab, metadata: encoder(vocab)


TOKENIZER_KINDS: Mapping[str, TokenizerKind] = {
    "gpt2": TokenizerKind(
        {Implementation.COMPILED: _bpe(BytePairEncoder), Implementation.REFERENCE: _bpe(ReferenceBytePairEncoder)},
        default_add_bos=default_add_bos, default_add_space_prefix=False,
        byte_level=True, clean_spaces=lambda metadata: pre_tokenizer_of(metadata).clean_spaces,
    ),
    "llama": TokenizerKind(
        {Implementation.COMPILED: _spm(SentencePieceEncoder), Implementation.REFERENCE: _spm(ReferenceSentencePieceEncoder)},
        default_add_bos=lambda metadata: True, default_add_space_prefix=True, byte_level=False,
        clean_spaces=lambda metadata: False,
    ),
}  # fmt: skip


class Tokenizer:
    """Tokenization identical to llama.cpp's for the supported kinds (`TOKENIZER_KINDS`)."""

    def __init__(self, model: str, kind: TokenizerKind, vocab: Vocabulary, encoder: Any, clean_spaces: bool):
        self.model = model
        self._kind = kind
        self.clean_spaces = clean_spaces
        self.vocab = vocab
        self._encoder = encoder
        self.max_token_bytes = self._longest_token_bytes()
        # Byte-level BPE drops a byte whose character is not in the vocabulary (as llama.cpp does):
        # the bytes that always yield a token, or None where all do (SentencePiece falls back to bytes).
        kept = bytes(b for b, ch in enumerate(bytes_to_unicode()) if ch in vocab.token_to_id)
        self._kept_bytes = kept if kind.byte_level and len(kept) < 256 else None

    @classmethod
    def from_gguf_metadata(
        cls, metadata: Mapping[str, Any], implementation: Implementation = Implementation.COMPILED
    ) -> Tokenizer:
        """The model's tokenizer; building the compiled one compiles its loops (or loads them from numba's
        on-disk cache), so that no request pays for it."""
        model = metadata.get("tokenizer.ggml.model")
        if not isinstance(model, str):
            raise TokenizerError("tokenizer.ggml.model is missing or not a string")
        kind = TOKENIZER_KINDS.get(model)
        if kind is None:
            raise UnsupportedTokenizer(
                f"tokenizer.ggml.model = {model!r} is not supported (supported: {', '.join(TOKENIZER_KINDS)})"
            )
        vocab = Vocabulary.from_gguf_metadata(
            metadata,
            default_add_bos=kind.default_add_bos(metadata),
            default_add_space_prefix=kind.default_add_space_prefix,
        )
        encoder = kind.encoders[implementation](vocab, metadata)
        return cls(model, kind, vocab, encoder, kind.clean_spaces(metadata))

    # -- facts --------------------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return self.vocab.n_vocab

    @property
    def bos_id(self) -> int | None:
        return self.vocab.bos_id

    @property
    def eos_id(self) -> int | None:
        return self.vocab.eos_id

    @property
    def add_bos(self) -> bool:
        return self.vocab.add_bos

    @property
    def end_of_generation(self) -> frozenset[int]:
        """EOS, end-of-turn and the other tokens that end a generation."""
        return self.vocab.end_of_generation

    def is_end_of_generation(self, token_id: int) -> bool:
        return token_id in self.vocab.end_of_generation

    def token_text(self, token_id: int) -> str:
        """The token's text as stored in the vocabulary (e.g. ``"<|im_end|>"``, ``"Ġthe"``)."""
        self.vocab.check_id(token_id)
        return self.vocab.tokens[token_id]

    def _longest_token_bytes(self) -> int:
        """The most bytes of input text one token can stand for: a merged token the bytes it decodes to
        (SentencePiece: its text as written, since a literal U+2581 in the input matches its 3 bytes),
        a special token the text the partition matched."""
        tokens = self.vocab.tokens
        if self._kind.byte_level:
            merged = max(len(normal_token_bytes(text)) for text in tokens)
        else:
            merged = max(len(text.encode("utf-8")) for text in tokens)
        return max(merged, *(len(s.text.encode("utf-8")) for s in self.vocab.special_tokens))

    # -- text -> tokens -----------------------------------------------------------------------------

    def min_tokens(self, text: str, *, add_special: bool = False) -> int:
        """A lower bound on ``len(self.encode(text, add_special=add_special))``, found without tokenizing:
        each token stands for at most `max_token_bytes` bytes of the text's UTF-8, and only bytes that
        may be dropped (those not in `_kept_bytes`) yield none. About 0.1 s for 50 MB."""
        if self._kept_bytes is None:
            # isascii is O(1) (CPython keeps the flag); a lone surrogate is 3 bytes, as the U+FFFD it becomes
            n_bytes = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        else:
            try:
                data = text.encode("utf-8")
            except UnicodeEncodeError:
                data = replace_surrogates(text).encode("utf-8")
            n_bytes = len(data) - len(data.translate(None, self._kept_bytes))
        bound = -(-n_bytes // self.max_token_bytes)
        if add_special:
            bound += int(self.vocab.add_bos) + int(self.vocab.add_eos and self.vocab.eos_id is not None)
        return bound

    def encode(self, text: str, *, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of `text`. `add_special` adds BOS (and EOS) where the model asks for them;
        `parse_special` recognises control tokens written in the text (user-defined ones always are)."""
        vocab = self.vocab
        out: list[int] = []
        if add_special and vocab.add_bos:
            assert vocab.bos_id is not None  # checked when the vocabulary was built
            out.append(vocab.bos_id)
        prefix_space = vocab.add_space_prefix and not self._kind.byte_level
        pieces: list[str | int] = []
        previous_was_special = True
        for fragment in vocab.partition(replace_surrogates(text), parse_special):
            if isinstance(fragment, str) and prefix_space and previous_was_special:
                fragment = " " + fragment
            pieces.append(fragment)
            previous_was_special = isinstance(fragment, int)
        out.extend(self._encoder.encode(pieces))
        if add_special and vocab.add_eos and vocab.eos_id is not None:
            out.append(vocab.eos_id)
        return out

    # -- tokens -> text -----------------------------------------------------------------------------

    def token_bytes(self, token_id: int, *, special: bool = True) -> bytes:
        """The bytes token `token_id` stands for. Control and unknown tokens render as their text with
        `special`, as nothing without; unused and undefined tokens render as nothing."""
        vocab = self.vocab
        vocab.check_id(token_id)
        token_type = int(vocab.types[token_id])
        text = vocab.tokens[token_id]
        if token_type in (TokenType.CONTROL, TokenType.UNKNOWN):
            return text.encode("utf-8") if special else b""
        if token_type == TokenType.USER_DEFINED:
            return text.encode("utf-8")
        if token_type == TokenType.NORMAL:
            if self._kind.byte_level:
                return normal_token_bytes(text)
            return text.replace(SPACE_MARK, " ").encode("utf-8")
        if token_type == TokenType.BYTE and not self._kind.byte_level:
            return bytes([int(text[3:5], 16)])
        return b""

    def piece(self, token_id: int, *, special: bool = True) -> str:
        """The token's own text; an incomplete UTF-8 sequence shows as U+FFFD."""
        return self.token_bytes(token_id, special=special).decode("utf-8", errors="replace")

    def decode_bytes(self, token_ids: Iterable[int], *, special: bool = True, clean: bool = False) -> bytes:
        """The tokens' bytes one after the other (llama-server's /detokenize); with `clean`, then llama.cpp's
        `clean_spaces` pass where the model's pre-tokenizer has it on (llama_detokenize, as llama-server's
        echoed "prompt")."""
        parts = []
        for i, token_id in enumerate(token_ids):
            data = self.token_bytes(token_id, special=special)
            if i == 0 and self.vocab.add_space_prefix and not self._kind.byte_level and data[:1] == b" ":
                data = data[1:]  # the space the encoder prefixed
            parts.append(data)
        text = b"".join(parts)
        return clean_up_spaces(text) if clean and self.clean_spaces else text

    def decode(self, token_ids: Iterable[int], *, special: bool = True, clean: bool = False) -> str:
        """Text of `token_ids` (invalid UTF-8 shows as U+FFFD); `clean` as in `decode_bytes`."""
        return self.decode_bytes(token_ids, special=special, clean=clean).decode("utf-8", errors="replace")

    @staticmethod
    def stream() -> Utf8Stream:
        """A streaming decoder for generated token bytes."""
        return Utf8Stream()
