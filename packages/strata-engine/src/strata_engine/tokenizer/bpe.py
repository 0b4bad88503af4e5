"""GPT-2 byte-level BPE (`tokenizer.ggml.model == "gpt2"`), as llama.cpp's `llm_tokenizer_bpe_session`.

A raw-text fragment is split into words by the pre-tokenizer named in `tokenizer.ggml.pre`; each word's
UTF-8 bytes are mapped to GPT-2's printable characters; then, per word, the adjacent pair with the
lowest merge rank is merged (ties: leftmost first) until no ranked pair is left (under Llama 3's
pre-tokenizers a word that is a token as a whole is that token, unmerged).

The loops run compiled (kernels.bpe_encode) on integer symbols: every vocabulary token keeps its id,
and a string that the merges use or produce but that is not a token gets an id from n_vocab up (left
alone at the end, it is emitted as those of its characters that are tokens, as llama.cpp does).
reference.py has the same algorithm on Python strings.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from ..errors import TokenizerError, UnsupportedTokenizer
from . import kernels
from .unicode import (
    bytes_to_unicode,
    codepoint_classes,
    gpt2_pattern,
    llama3_pattern,
    qwen2_pattern,
    single_number_pattern,
    unicode_to_bytes,
)
from .vocab import Vocabulary

# A pre-tokenizer is a sequence of regex splits applied in turn: each one splits every piece of the
# previous one into matches and gaps (llama.cpp's `unicode_regex_split`).
PreTokenizer = Sequence[Callable[[], re.Pattern[str]]]


@attrs.frozen
class PreTokenizerSpec:
    """One llama.cpp pre-tokenizer type (LLAMA_VOCAB_PRE_TYPE_*) with the flags its names set."""

    splits: PreTokenizer  # the regexes (reference.py applies them)
    # the same split compiled (kernels.bpe_encode): which word splitter, every \p{N} alone first or not,
    # and the longest run of digits one word holds (the llama3-style splitters)
    word_split: kernels.WordSplit
    digits_apart: bool = False
    max_digits: int = 0
    # a word that is a token as a whole is that token, merged or not (llama.cpp's `ignore_merges`)
    ignore_merges: bool = False
    # llama.cpp's `clean_spaces` detokenization pass (clean_up_tokenization_spaces)
    clean_spaces: bool = True
    # BOS added where the file has no tokenizer.ggml.add_bos_token
    add_bos: bool = False


_SMOLLM = PreTokenizerSpec(
    splits=(single_number_pattern, gpt2_pattern), word_split=kernels.WordSplit.GPT2, digits_apart=True,
    clean_spaces=False,
)  # fmt: skip
_LLAMA3 = PreTokenizerSpec(
    splits=(llama3_pattern,), word_split=kernels.WordSplit.LLAMA3, max_digits=3, ignore_merges=True,
    add_bos=True,
)  # fmt: skip
_QWEN2 = PreTokenizerSpec(splits=(qwen2_pattern,), word_split=kernels.WordSplit.LLAMA3, max_digits=1)

# `tokenizer.ggml.pre` -> the splits and flags llama.cpp b11549 gives it (llama-vocab.cpp: the names of
# LLAMA_VOCAB_PRE_TYPE_SMOLLM, _LLAMA3 and _QWEN2).
PRE_TOKENIZERS: Mapping[str, PreTokenizerSpec] = {
    "smollm": _SMOLLM,
    **dict.fromkeys(
        (
            "llama-bpe",
            "llama3",
            "llama-v3",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ),
        _LLAMA3,
    ),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"), attrs.evolve(_QWEN2, clean_spaces=False)
    ),
    "megrez": _QWEN2,  # the one QWEN2 name that leaves clean_spaces on
}

# What llama.cpp reads a missing `tokenizer.ggml.pre` as (a pre-tokenizer not implemented here).
DEFAULT_PRE = "default"

# Runs every compiled path once when an encoder is built, so that no request pays for compilation.
WARM_UP_TEXT = "Hello, world! It's 42 o'clock\n\n  naïve 東京 🚀\t x**2 <b>\u2581"


def pre_tokenizer_spec(pre: str) -> PreTokenizerSpec:
    spec = PRE_TOKENIZERS.get(pre)
    if spec is None:
        raise UnsupportedTokenizer(
            f"tokenizer.ggml.pre = {pre!r} is not supported for gpt2 BPE (supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    return spec


def pre_tokenizer_of(metadata: Mapping[str, Any]) -> PreTokenizerSpec:
    """The pre-tokenizer a file's `tokenizer.ggml.pre` names (llama.cpp's "default" where it names none)."""
    return pre_tokenizer_spec(str(metadata.get("tokenizer.ggml.pre", DEFAULT_PRE)))


def default_add_bos(metadata: Mapping[str, Any]) -> bool:
    """Whether BOS is added where the file has no tokenizer.ggml.add_bos_token (an unknown pre-tokenizer is
    refused when the encoder is built, after the vocabulary's checks)."""
    spec = PRE_TOKENIZERS.get(str(metadata.get("tokenizer.ggml.pre", DEFAULT_PRE)))
    return spec is not None and spec.add_bos


def clean_up_spaces(text: bytes) -> bytes:
    """llama.cpp's `clean_spaces` passes over detokenized text (llama_vocab::impl::detokenize), in its order:
    no space before ? ! . , ; " ' " becomes "'"; no space before 's 'm 're 've."""
    text = re.sub(rb" ([?!.,])", rb"\1", text)
    text = text.replace(b" ' ", b"'")
    return re.sub(rb" '(?=[sm]|re|ve)", b"'", text)


def rank_merges(merges: Sequence[str]) -> dict[tuple[str, str], int]:
    """(left, right) -> rank, the line's index in `tokenizer.ggml.merges` (the first line of a pair wins)."""
    ranks: dict[tuple[str, str], int] = {}
    for rank, merge in enumerate(merges):
        cut = merge.find(" ", 1)
        if cut < 0:
            raise TokenizerError(f"tokenizer.ggml.merges[{rank}] = {merge!r} has no space")
        ranks.setdefault((merge[:cut], merge[cut + 1 :]), rank)
    return ranks


def normal_token_bytes(text: str) -> bytes:
    """The bytes a NORMAL token stands for (GPT-2 characters back to bytes)."""
    table = unicode_to_bytes()
    try:
        return bytes(table[ch] for ch in text)
    except KeyError:
        # a character outside GPT-2's table (not produced by byte-level BPE): keep it as UTF-8
        return b"".join(bytes([table[ch]]) if ch in table else ch.encode("utf-8") for ch in text)


WholeWords = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]
# bpe_encode's `whole_words` where merges are never skipped (no byte characters: the lookup is off)
_NO_WHOLE_WORDS: WholeWords = (
    np.zeros(0, np.uint32), np.zeros(1, np.uint64), np.full(1, -1, np.int32), np.zeros(0, np.uint32),
    np.zeros(1, np.int64),
)  # fmt: skip


def _whole_word_table(vocab: Vocabulary) -> WholeWords:
    """bpe_encode's `whole_words`: each byte's GPT-2 character and a table of every token's text."""
    tokens = vocab.tokens
    tok_off = np.zeros(len(tokens) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, tokens), np.int64, len(tokens)), out=tok_off[1:])
    tok_cps = np.frombuffer("".join(tokens).encode("utf-32-le", "surrogatepass"), np.uint32).copy()
    hashes, ids = kernels.build_text_table(tok_cps, tok_off, kernels.table_slots(len(tokens)))
    byte_chars = np.array([ord(ch) for ch in bytes_to_unicode()], np.uint32)
    return byte_chars, hashes, ids, tok_cps, tok_off


class BytePairEncoder:
    def __init__(self, vocab: Vocabulary, merges: Sequence[str], pre: str):
        spec = pre_tokenizer_spec(pre)
        self.vocab = vocab
        self.pre = pre
        self._spec = spec
        ranks = rank_merges(merges)
        token_to_id = vocab.token_to_id
        symbols = dict(token_to_id)
        extra: list[str] = []

        def symbol(text: str) -> int:
            found = symbols.get(text)
            if found is None:
                found = symbols[text] = vocab.n_vocab + len(extra)
                extra.append(text)
            return found

        lefts = np.empty(len(ranks), np.int32)
        rights = np.empty(len(ranks), np.int32)
        pair_ranks = np.empty(len(ranks), np.int32)
        self._merge_result = np.zeros(max(len(merges), 1), np.int32)
        for k, ((left, right), rank) in enumerate(ranks.items()):
            lefts[k], rights[k], pair_ranks[k] = symbol(left), symbol(right), rank
            self._merge_result[rank] = symbol(left + right)
        self._byte_symbol = np.array([symbol(ch) for ch in bytes_to_unicode()], np.int32)
        fallbacks = [[token_to_id[ch] for ch in text if ch in token_to_id] for text in extra]
        self._fallback_off = np.zeros(len(extra) + 1, np.int64)
        np.cumsum([len(f) for f in fallbacks], out=self._fallback_off[1:])
        self._fallback_ids = np.array([i for f in fallbacks for i in f], np.int32)
        self._pair_keys, self._pair_values = kernels.build_pair_table(
            lefts, rights, pair_ranks, kernels.table_slots(len(ranks))
        )
        self._classes = codepoint_classes()
        self._whole_words = _whole_word_table(vocab) if spec.ignore_merges else _NO_WHOLE_WORDS
        self.encode([WARM_UP_TEXT, 0, WARM_UP_TEXT])

    def encode(self, pieces: Sequence[str | int]) -> list[int]:
        """Token ids of raw-text pieces (str) and special token ids (int, kept as they are)."""
        cps, item_start, item_stop, item_token = kernels.pack_items(pieces)
        ids = kernels.bpe_encode(
            cps, item_start, item_stop, item_token, self._classes, int(self._spec.word_split),
            self._spec.digits_apart, self._spec.max_digits, self._byte_symbol, self._pair_keys, self._pair_values,
            self._merge_result, self.vocab.n_vocab, self._fallback_off, self._fallback_ids, self._whole_words,
        )  # fmt: skip
        return ids.tolist()
