"""GPT-2 byte-level BPE (`tokenizer.ggml.model == "gpt2"`), as llama.cpp's `llm_tokenizer_bpe_session`.

A raw-text fragment is split into words by the pre-tokenizer named in `tokenizer.ggml.pre`; each word's
UTF-8 bytes are mapped to GPT-2's printable characters; then, per word, the adjacent pair with the
lowest merge rank is merged (ties: leftmost first) until no ranked pair is left.

The loops run compiled (kernels.bpe_encode) on integer symbols: every vocabulary token keeps its id,
and a string that the merges use or produce but that is not a token gets an id from n_vocab up (left
alone at the end, it is emitted as those of its characters that are tokens, as llama.cpp does).
reference.py has the same algorithm on Python strings.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

import attrs
import numpy as np

from ..errors import TokenizerError, UnsupportedTokenizer
from . import kernels
from .unicode import (
    bytes_to_unicode,
    codepoint_classes,
    gpt2_pattern,
    single_number_pattern,
    unicode_to_bytes,
)
from .vocab import Vocabulary

# A pre-tokenizer is a sequence of regex splits applied in turn: each one splits every piece of the
# previous one into matches and gaps (llama.cpp's `unicode_regex_split`).
PreTokenizer = Sequence[Callable[[], re.Pattern[str]]]


@attrs.frozen
class PreTokenizerSpec:
    splits: PreTokenizer  # the regexes (reference.py applies them)
    # the same split compiled: every \p{N} alone first, then the GPT-2 split (kernels.gpt2_word_end)
    digits_apart: bool
    # llama.cpp's `clean_spaces` detokenization pass: only the pre-tokenizers listed here, which
    # leave it off, are supported.
    clean_spaces: bool = False


# `tokenizer.ggml.pre` -> the splits llama.cpp applies for it (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_*).
PRE_TOKENIZERS: Mapping[str, PreTokenizerSpec] = {
    # SMOLLM: "\p{N}" then GPT-2's regex
    "smollm": PreTokenizerSpec(splits=(single_number_pattern, gpt2_pattern), digits_apart=True),
}

# Runs every compiled path once when an encoder is built, so that no request pays for compilation.
WARM_UP_TEXT = "Hello, world! It's 42 o'clock\n\n  naïve 東京 🚀\t x**2 <b>\u2581"


def pre_tokenizer_spec(pre: str) -> PreTokenizerSpec:
    spec = PRE_TOKENIZERS.get(pre)
    if spec is None:
        raise UnsupportedTokenizer(
            f"tokenizer.ggml.pre = {pre!r} is not supported for gpt2 BPE (supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    return spec


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


class BytePairEncoder:
    def __init__(self, vocab: Vocabulary, merges: Sequence[str], pre: str):
        spec = pre_tokenizer_spec(pre)
        self.vocab = vocab
        self.pre = pre
        self._digits_apart = spec.digits_apart
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
        self.encode([WARM_UP_TEXT, 0, WARM_UP_TEXT])

    def encode(self, pieces: Sequence[str | int]) -> list[int]:
        """Token ids of raw-text pieces (str) and special token ids (int, kept as they are)."""
        cps, item_start, item_stop, item_token = kernels.pack_items(pieces)
        ids = kernels.bpe_encode(
            cps, item_start, item_stop, item_token, self._classes, self._digits_apart, self._byte_symbol,
            self._pair_keys, self._pair_values, self._merge_result, self.vocab.n_vocab, self._fallback_off,
            self._fallback_ids,
        )  # fmt: skip
        return ids.tolist()
