"""SentencePiece-style BPE (`tokenizer.ggml.model == "llama"`), as llama.cpp's `llm_tokenizer_spm_session`.

Spaces become U+2581; the text starts as one symbol per character; repeatedly the adjacent pair whose
concatenation is the vocabulary token with the highest score is merged (ties: leftmost first). A final
symbol that is not a token is emitted as its UTF-8 bytes through the `<0xNN>` byte tokens.
"""

from __future__ import annotations

from ..errors import TokenizerError
from .merge import merge_symbols
from .vocab import Vocabulary

SPACE_MARK = "\u2581"


class SentencePieceEncoder:
    def __init__(self, vocab: Vocabulary):
        if vocab.scores is None:
            raise TokenizerError("tokenizer.ggml.scores is required by the llama (SentencePiece) tokenizer")
        self.vocab = vocab
        self._scores = vocab.scores
        token_to_id = vocab.token_to_id
        self._byte_ids: list[int | None] = []
        for b in range(256):
            token_id = token_to_id.get(f"<0x{b:02X}>")
            if token_id is None and b < 0x80:
                token_id = token_to_id.get(chr(b))
            self._byte_ids.append(token_id)

    def encode(self, text: str, out: list[int]) -> None:
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
