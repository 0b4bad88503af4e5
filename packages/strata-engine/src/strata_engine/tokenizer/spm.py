"""SentencePiece-style BPE (`tokenizer.ggml.model == "llama"`), as llama.cpp's `llm_tokenizer_spm_session`.

Spaces become U+2581; the text starts as one symbol per character; repeatedly the adjacent pair whose
concatenation is the vocabulary token with the highest score is merged (ties: leftmost first). A final
symbol that is not a token is emitted as its UTF-8 bytes through the `<0xNN>` byte tokens.

The loop runs compiled (kernels.spm_encode) over the text's code points, word by word where no token
can span two words, finding a pair's token in a hash table of every token's text; reference.py has the
same algorithm on Python strings, on the whole text.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import TokenizerError
from . import kernels
from .vocab import Vocabulary

SPACE_MARK = "\u2581"

# Runs every compiled path once when an encoder is built (byte fallback included: U+E0000 has no token).
WARM_UP_TEXT = "Hello, world! It's 42 o'clock\n\n  naïve 東京 🚀\t x**2 <b>\U000e0000"


def byte_fallback_ids(vocab: Vocabulary) -> list[int | None]:
    """The token standing for each byte value: `<0xNN>`, else (ASCII) the character itself, else None."""
    token_to_id = vocab.token_to_id
    ids: list[int | None] = []
    for b in range(256):
        token_id = token_to_id.get(f"<0x{b:02X}>")
        if token_id is None and b < 0x80:
            token_id = token_to_id.get(chr(b))
        ids.append(token_id)
    return ids


def _space_marks(text: str) -> list[int]:
    """Positions of U+2581 in `text`."""
    if SPACE_MARK not in text:
        return []
    return [at for at, ch in enumerate(text) if ch == SPACE_MARK]


class SentencePieceEncoder:
    def __init__(self, vocab: Vocabulary):
        if vocab.scores is None:
            raise TokenizerError("tokenizer.ggml.scores is required by the llama (SentencePiece) tokenizer")
        self.vocab = vocab
        tokens = vocab.tokens
        lengths = np.fromiter(map(len, tokens), np.int64, len(tokens))
        self._tok_off = np.zeros(len(tokens) + 1, np.int64)
        np.cumsum(lengths, out=self._tok_off[1:])
        self._tok_cps = np.frombuffer("".join(tokens).encode("utf-32-le", "surrogatepass"), np.uint32)
        self._text_hashes, self._text_ids = kernels.build_text_table(
            self._tok_cps, self._tok_off, kernels.table_slots(len(tokens))
        )
        self._max_token_len = int(lengths.max())
        # the best score first: rank 0; equal scores share a rank (the leftmost pair then wins)
        self._score_rank = np.unique(-np.asarray(vocab.scores, np.float64), return_inverse=True)[1].astype(
            np.int32
        )
        # the characters that precede a U+2581 inside some token: a word boundary is a U+2581 after any other
        joiners = {ord(text[at - 1]) for text in tokens for at in _space_marks(text) if at}
        self._space_joiners = np.array(sorted(joiners), np.uint32)
        self._byte_ids = np.array([-1 if i is None else i for i in byte_fallback_ids(vocab)], np.int32)
        self._unk_id = -1 if vocab.unk_id is None else vocab.unk_id
        self._run([WARM_UP_TEXT, 0, WARM_UP_TEXT])  # a missing byte token is an error only where needed

    def _run(self, pieces: Sequence[str | int]) -> tuple[np.ndarray, int]:
        cps, item_start, item_stop, item_token = kernels.pack_items(pieces, replace_space=SPACE_MARK)
        return kernels.spm_encode(
            cps, item_start, item_stop, item_token, self._text_hashes, self._text_ids, self._tok_cps,
            self._tok_off, self._max_token_len, self._score_rank, self._space_joiners, self._byte_ids, self._unk_id,
        )  # fmt: skip

    def encode(self, pieces: Sequence[str | int]) -> list[int]:
        """Token ids of raw-text pieces (str) and special token ids (int, kept as they are)."""
        ids, missing_byte = self._run(pieces)
        if missing_byte >= 0:
            raise TokenizerError(f"no byte token <0x{missing_byte:02X}> and no unknown token to stand for it")
        return ids.tolist()
