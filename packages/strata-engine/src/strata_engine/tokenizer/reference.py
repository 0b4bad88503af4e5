"""The pure-Python encoders, kept as the oracle of the compiled ones (bpe.py, spm.py): the tests check
that both give identical ids, and bench/engine/bench_tokenizer.py measures one against the other.

GPT-2 BPE ranks a pair by its merge rank; SentencePiece BPE by the score of the merged token. Either way
the pair with the smallest key merges first, the leftmost among equals (llama.cpp's order).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import TokenizerError
from .bpe import pre_tokenizer_spec, rank_merges
from .spm import SPACE_MARK, byte_fallback_ids
from .unicode import bytes_to_unicode, split_matches_and_gaps
from .vocab import Vocabulary

_WORD_CACHE_SIZE = 1 << 16


def merge_symbols(symbols: list[str], priority: Callable[[str, str], Any | None]) -> list[str]:
    """Merge `symbols` in place and return it; merged-away slots become "".

    priority(left, right) is the pair's sort key (smaller merges first), or None when it cannot merge.
    """
    n = len(symbols)
    prev = list(range(-1, n - 1))
    next_ = list(range(1, n + 1))
    if n:
        next_[-1] = -1
    heap: list[tuple[Any, int, int, str]] = []
    for i in range(n - 1):
        key = priority(symbols[i], symbols[i + 1])
        if key is not None:
            heap.append((key, i, i + 1, symbols[i] + symbols[i + 1]))
    heapq.heapify(heap)
    while heap:
        _, left, right, merged = heapq.heappop(heap)
        left_text, right_text = symbols[left], symbols[right]
        if not left_text or not right_text or left_text + right_text != merged:
            continue  # outdated: one side was merged into something else meanwhile
        symbols[left] = merged
        symbols[right] = ""
        after = next_[right]
        next_[left] = after
        if after >= 0:
            prev[after] = left
        before = prev[left]
        if before >= 0:
            key = priority(symbols[before], merged)
            if key is not None:
                heapq.heappush(heap, (key, before, left, symbols[before] + merged))
        if after >= 0:
            key = priority(merged, symbols[after])
            if key is not None:
                heapq.heappush(heap, (key, left, after, merged + symbols[after]))
    return symbols


class ReferenceBytePairEncoder:
    """GPT-2 byte-level BPE on Python strings, as llama.cpp's `llm_tokenizer_bpe_session`: the fragment
    is split by the pre-tokenizer's regexes, each word's UTF-8 bytes become GPT-2's printable
    characters, then the word's pairs are merged by rank."""

    def __init__(self, vocab: Vocabulary, merges: Sequence[str], pre: str):
        spec = pre_tokenizer_spec(pre)
        self.vocab = vocab
        self._splits = [make() for make in spec.splits]
        self._ignore_merges = spec.ignore_merges
        self._ranks = rank_merges(merges)
        self._byte_chars = bytes_to_unicode()
        self._word_cache: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def pre_tokenize(self, text: str) -> list[str]:
        pieces = [text]
        for pattern in self._splits:
            pieces = [sub for piece in pieces for sub in split_matches_and_gaps(pattern, piece)]
        return pieces

    def encode(self, pieces: Sequence[str | int]) -> list[int]:
        out: list[int] = []
        for piece in pieces:
            if isinstance(piece, int):
                out.append(piece)
            else:
                self._encode_text(piece, out)
        return out

    def _encode_text(self, text: str, out: list[int]) -> None:
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
        if whole is not None and (len(word) == 1 or self._ignore_merges):
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


class ReferenceSentencePieceEncoder:
    """SentencePiece-style BPE on Python strings, as llama.cpp's `llm_tokenizer_spm_session`: spaces
    become U+2581, the pair whose concatenation is the best-scored token merges first, and a final
    symbol that is not a token is emitted as its UTF-8 bytes through the `<0xNN>` byte tokens."""

    def __init__(self, vocab: Vocabulary):
        if vocab.scores is None:
            raise TokenizerError("tokenizer.ggml.scores is required by the llama (SentencePiece) tokenizer")
        self.vocab = vocab
        self._scores = vocab.scores
        self._byte_ids = byte_fallback_ids(vocab)

    def encode(self, pieces: Sequence[str | int]) -> list[int]:
        out: list[int] = []
        for piece in pieces:
            if isinstance(piece, int):
                out.append(piece)
            else:
                self._encode_text(piece, out)
        return out

    def _encode_text(self, text: str, out: list[int]) -> None:
        text = text.replace(" ", SPACE_MARK)
        if not text:
            return
        token_to_id = self.vocab.token_to_id
        scores = self._scores

        def priority(left: str, right: str) -> float | None:
            token_id = token_to_id.get(left + right)
            return None if token_id is None else -scores[token_id]  # the best score first

        symbols = merge_symbols(list(text), priority)
        for symbol in symbols:
            if not symbol:
                continue
            token_id = token_to_id.get(symbol)
            if token_id is not None:
                out.append(token_id)
                continue
            # only an unmerged single character can miss the vocabulary: byte fallback
            for b in symbol.encode("utf-8"):
                byte_id = self._byte_ids[b]
                if byte_id is None:
                    byte_id = self.vocab.unk_id
                if byte_id is None:
                    raise TokenizerError(f"no byte token <0x{b:02X}> and no unknown token to stand for it")
                out.append(byte_id)
