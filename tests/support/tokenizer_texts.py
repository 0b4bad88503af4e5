"""Texts the tokenizer tests share: the pieces that pre-tokenizers and merges treat specially, and mixed
texts drawn from them (deterministic, for tests that ask llama.cpp)."""

from __future__ import annotations

import random

# Pieces the pre-tokenizers and merges treat specially: scripts, emoji sequences, whitespace runs, digits
# of several kinds, contractions (any case), special-token texts and near misses.
PIECES = [
    "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL", "'x", "''", " '", "n't",
    " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\u00a0", "\u3000", "\u2028", "\u200b", "\x0b", "\x1c",
    "\r", " \n ", "\r\n\r\n", " \t\n", ";\n", "'RE", "'Ve", "'lL", "'D",
    "0", "7", "42", "٣", "１", "Ⅻ", "½", "²", "3.14", "-1e9", "1234567", "٣٤٥٦",
    "Hello", " world", "Привет", "мир", "東京", "日本語", "مرحبا", "नमस्ते", "ಕನ್ನಡ", "สวัสดี", "한국어", "Ελλάδα",
    "🚀", "👍🏽", "👩‍💻", "🇫🇷", "❤️", "\U0001f9d1\u200d\U0001f33e",
    "\u2581", "▁▁", "> </", ">\u2581<", "Ġ", "Ċ", ".", ",", "!?", "...", "—", "«»", "()", "{}", "#", "**", "`", "</", "/>",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<start_of_turn>", "<end_of_turn>", "<bos>", "<unused7>",
    "<0x0A>", "<", ">", "|",
]  # fmt: skip


def mixed_texts(seed: int, count: int, max_pieces: int = 24) -> list[str]:
    """`count` texts of up to `max_pieces` pieces each, a piece repeated now and then (runs, repeated words)."""
    rng = random.Random(seed)
    return [
        "".join(rng.choice(PIECES) * rng.choice((1, 1, 1, 2, 5)) for _ in range(rng.randint(1, max_pieces)))
        for _ in range(count)
    ]
