"""Tokenizers built from GGUF metadata alone: GPT-2 byte-level BPE and SentencePiece-style BPE,
identical to llama.cpp's tokenization for the supported kinds."""

from .core import TOKENIZER_KINDS, Tokenizer
from .stream import Utf8Stream
from .vocab import (
    InvalidTokenId,
    TokenizerError,
    TokenType,
    UnsupportedTokenizer,
    Vocabulary,
)

__all__ = [
    "TOKENIZER_KINDS",
    "InvalidTokenId",
    "TokenType",
    "Tokenizer",
    "TokenizerError",
    "UnsupportedTokenizer",
    "Utf8Stream",
    "Vocabulary",
]
