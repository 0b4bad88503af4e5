"""Tokenizers built from GGUF metadata alone: GPT-2 byte-level BPE and SentencePiece-style BPE,
identical to llama.cpp's tokenization for the supported kinds (errors: `strata_engine.errors`)."""

from .core import TOKENIZER_KINDS, Tokenizer
from .stream import Utf8Stream
from .vocab import TokenType, Vocabulary

__all__ = [
    "TOKENIZER_KINDS",
    "TokenType",
    "Tokenizer",
    "Utf8Stream",
    "Vocabulary",
]
