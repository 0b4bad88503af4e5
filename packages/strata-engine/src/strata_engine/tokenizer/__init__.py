"""Tokenizers built from GGUF metadata alone: GPT-2 byte-level BPE and SentencePiece-style BPE,
identical to llama.cpp's tokenization for the supported kinds (errors: `strata_engine.errors`).

Modules: `core` (Tokenizer, the kinds), `vocab` (tokens, special-token partition), `bpe` and `spm` (the
encoders, on the compiled loops of `kernels`), `reference` (the same encoders in pure Python: the
oracle), `unicode` (character classes, GPT-2's byte table), `stream` (streaming UTF-8)."""

from .core import TOKENIZER_KINDS, Implementation, Tokenizer
from .stream import Utf8Stream
from .vocab import TokenType, Vocabulary

__all__ = [
    "TOKENIZER_KINDS",
    "Implementation",
    "TokenType",
    "Tokenizer",
    "Utf8Stream",
    "Vocabulary",
]
