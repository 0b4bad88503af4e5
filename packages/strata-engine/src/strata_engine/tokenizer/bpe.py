"""GPT-2 byte-level BPE (`tokenizer.ggml.model == "gpt2"`), as llama.cpp's `llm_tokenizer_bpe_session`.

A raw-text fragment is split into words by the pre-tokenizer named in `tokenizer.ggml.pre`; each word's
UTF-8 bytes are mapped to GPT-2's printable characters; then, per word, the adjacent pair with the
lowest merge rank is merged (ties: leftmost first) until no ranked pair is left.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

import attrs

from ..errors import TokenizerError, UnsupportedTokenizer
from .merge import merge_symbols
from .unicode import (
    bytes_to_unicode,
    gpt2_pattern,
    single_number_pattern,
    split_matches_and_gaps,
    unicode_to_bytes,
)
from .vocab import Vocabulary

# A pre-tokenizer is a sequence of regex splits applied in turn: each one splits every piece of the
# previous one into matches and gaps (llama.cpp's `unicode_regex_split`).
PreTokenizer = Sequence[Callable[[], re.Pattern[str]]]


@attrs.frozen
class PreTokenizerSpec:
    splits: PreTokenizer
    # llama.cpp's `clean_spaces` detokenization pass: only the pre-tokenizers listed here, which
    # leave it off, are supported.
    clean_spaces: bool = False


# `tokenizer.ggml.pre` -> the splits llama.cpp applies for it (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_*).
PRE_TOKENIZERS: Mapping[str, PreTokenizerSpec] = {
    # SMOLLM: "\p{N}" then GPT-2's regex
    "smollm": PreTokenizerSpec(splits=(single_number_pattern, gpt2_pattern)),
}

_WORD_CACHE_SIZE = 1 << 16


class BytePairEncoder:
    def __init__(self, vocab: Vocabulary, merges: Sequence[str], pre: str):
        spec = PRE_TOKENIZERS.get(pre)
        if spec is None:
            raise UnsupportedTokenizer(
                f"tokenizer.ggml.pre = {pre!r} is not supported for gpt2 BPE "
                f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
            )
        self.vocab = vocab
        self.pre = pre
        self._splits = [make() for make in spec.splits]
        self._ranks: dict[tuple[str, str], int] = {}
        for rank, merge in enumerate(merges):
            cut = merge.find(" ", 1)
            if cut < 0:
                raise TokenizerError(f"tokenizer.ggml.merges[{rank}] = {merge!r} has no space")
            self._ranks.setdefault((merge[:cut], merge[cut + 1 :]), rank)
        self._byte_chars = bytes_to_unicode()
        self._word_cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def pre_tokenize(self, text: str) -> list[str]:
        pieces = [text]
        for pattern in self._splits:
            pieces = [sub for piece in pieces for sub in split_matches_and_gaps(pattern, piece)]
        return pieces

    def encode(self, text: str, out: list[int]) -> None:
        byte_chars = self._byte_chars
        cache = self._word_cache
        for word in self.pre_tokenize(text):
            ids = cache.get(word)
            if ids is None:
                encoded = "".join(byte_chars[b] for b in word.encode("utf-8"))
                ids = self._merge_word(encoded)
                cache[word] = ids
                if len(cache) > _WORD_CACHE_SIZE:
                    cache.popitem(last=False)
            out.extend(ids)

    def _merge_word(self, word: str) -> tuple[int, ...]:
        token_to_id = self.vocab.token_to_id
        whole = token_to_id.get(word)
        if len(word) == 1 and whole is not None:
            return (whole,)
        ranks = self._ranks
        symbols = merge_symbols(list(word), lambda left, right: ranks.get((left, right)))
        ids: list[int] = []
        for symbol in symbols:
            if not symbol:
                continue
            token_id = token_to_id.get(symbol)
            if token_id is not None:
                ids.append(token_id)
            else:
                # a symbol that is not a token: its characters one by one, skipping any not in the vocabulary
                ids.extend(token_to_id[ch] for ch in symbol if ch in token_to_id)
        return tuple(ids)

    def normal_token_bytes(self, text: str) -> bytes:
        """The bytes a NORMAL token stands for (GPT-2 characters back to bytes)."""
        table = unicode_to_bytes()
        try:
            return bytes(table[ch] for ch in text)
        except KeyError:
            # a character outside GPT-2's table (not produced by byte-level BPE): keep it as UTF-8
            return b"".join(bytes([table[ch]]) if ch in table else ch.encode("utf-8") for ch in text)
