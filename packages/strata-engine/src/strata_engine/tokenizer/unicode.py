"""Unicode helpers shared by the tokenizers: GPT-2's byte <-> character table and the pre-tokenizer
splitters of llama.cpp (`unicode.cpp`), rebuilt on Python's `re` with explicit character classes.

llama.cpp classifies code points with its own tables (`unicode-data.cpp`); here the classes come from
`unicodedata` (the Unicode version of this Python). They agree on every code point assigned in both
versions; a character assigned only in a newer Unicode version may be classed differently.
"""

from __future__ import annotations

import enum
import functools
import re
import unicodedata

import numpy as np

# White_Space code points, as llama.cpp's `unicode_set_whitespace` (not Python's str.isspace, which
# also counts U+001C..U+001F).
WHITESPACE_CODEPOINTS: tuple[int, ...] = (
    0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680,
    *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000,
)  # fmt: skip

# Planes 4..13 are unassigned and 15..16 are private use: no letters or numbers there.
_SCANNED_RANGES = ((0, 0x40000), (0xE0000, 0xF0000))


@functools.cache
def bytes_to_unicode() -> tuple[str, ...]:
    """GPT-2's table: byte value -> the printable character that stands for it in the vocabulary."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return tuple(table[b] for b in range(256))


@functools.cache
def unicode_to_bytes() -> dict[str, int]:
    return {ch: b for b, ch in enumerate(bytes_to_unicode())}


class CharClass(enum.IntFlag):
    """The classes the GPT-2 split tells apart, as bits of `codepoint_classes()` (0: anything else)."""

    LETTER = 1  # \p{L}
    NUMBER = 2  # \p{N}
    SPACE = 4  # llama.cpp's whitespace set


def _class_of(ranges: list[tuple[int, int]]) -> str:
    """A regex character-class body for inclusive code point ranges."""
    parts = []
    for lo, hi in ranges:
        parts.append(re.escape(chr(lo)) if lo == hi else f"{re.escape(chr(lo))}-{re.escape(chr(hi))}")
    return "".join(parts)


@functools.cache
def _class_ranges() -> dict[CharClass, tuple[tuple[int, int], ...]]:
    """Inclusive code point ranges of each class, from one scan of `unicodedata` per process."""
    letters: list[tuple[int, int]] = []
    numbers: list[tuple[int, int]] = []
    category = unicodedata.category
    for start, stop in _SCANNED_RANGES:
        letter_start = number_start = None
        for cp in range(start, stop + 1):
            major = category(chr(cp))[0] if cp < stop else ""
            if major == "L":
                if letter_start is None:
                    letter_start = cp
            elif letter_start is not None:
                letters.append((letter_start, cp - 1))
                letter_start = None
            if major == "N":
                if number_start is None:
                    number_start = cp
            elif number_start is not None:
                numbers.append((number_start, cp - 1))
                number_start = None
    whitespace = tuple((cp, cp) for cp in WHITESPACE_CODEPOINTS)
    return {CharClass.LETTER: tuple(letters), CharClass.NUMBER: tuple(numbers), CharClass.SPACE: whitespace}


@functools.cache
def character_classes() -> dict[str, str]:
    """Class bodies for \\p{L}, \\p{N} and \\s (llama.cpp's whitespace set), built once per process."""
    ranges = _class_ranges()
    return {
        "L": _class_of(list(ranges[CharClass.LETTER])),
        "N": _class_of(list(ranges[CharClass.NUMBER])),
        "S": _class_of(list(ranges[CharClass.SPACE])),
    }


@functools.cache
def codepoint_classes() -> np.ndarray:
    """uint8 [0x110000]: each code point's `CharClass` bits, the same classes as `character_classes`."""
    table = np.zeros(0x110000, dtype=np.uint8)
    for cls, ranges in _class_ranges().items():
        for lo, hi in ranges:
            table[lo : hi + 1] |= cls.value
    table.setflags(write=False)
    return table


@functools.cache
def gpt2_pattern() -> re.Pattern[str]:
    """GPT-2's split, `'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`,
    which is what llama.cpp's hand-written `unicode_regex_split_custom_gpt2` implements."""
    c = character_classes()
    L, N, S = c["L"], c["N"], c["S"]
    return re.compile(rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{L}]+| ?[{N}]+| ?[^{S}{L}{N}]+|[{S}]+(?![^{S}])|[{S}]+")


def _llama3_style_pattern(max_digits: int | None) -> re.Pattern[str]:
    """Llama 3's split as llama.cpp writes it (its `(?i:...)` contractions spelled out in ASCII):
    `(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}|
    ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+`, with `\\p{N}` taken `max_digits` at a time
    (None: one at a time, Qwen2's)."""
    c = character_classes()
    L, N, S = c["L"], c["N"], c["S"]
    digits = f"{{1,{max_digits}}}" if max_digits else ""
    return re.compile(
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
        rf"|[^\r\n{L}{N}]?[{L}]+|[{N}]{digits}| ?[^{S}{L}{N}]+[\r\n]*|[{S}]*[\r\n]+|[{S}]+(?![^{S}])|[{S}]+"
    )


@functools.cache
def llama3_pattern() -> re.Pattern[str]:
    """Llama 3's split (llama.cpp's LLAMA_VOCAB_PRE_TYPE_LLAMA3): numbers in runs of up to three digits."""
    return _llama3_style_pattern(3)


@functools.cache
def qwen2_pattern() -> re.Pattern[str]:
    """Qwen2's split (LLAMA_VOCAB_PRE_TYPE_QWEN2): Llama 3's with every \\p{N} on its own."""
    return _llama3_style_pattern(None)


@functools.cache
def single_number_pattern() -> re.Pattern[str]:
    """`\\p{N}`: every number character on its own (the digit split of starcoder-style pre-tokenizers)."""
    return re.compile(f"[{character_classes()['N']}]")


def split_matches_and_gaps(pattern: re.Pattern[str], text: str) -> list[str]:
    """Pieces of `text`: every match of `pattern` and every unmatched gap between matches, in order
    (llama.cpp's `unicode_regex_split_stl`)."""
    pieces: list[str] = []
    end = 0
    for match in pattern.finditer(text):
        if match.start() > end:
            pieces.append(text[end : match.start()])
        pieces.append(match.group())
        end = match.end()
    if end < len(text):
        pieces.append(text[end:])
    return pieces


def replace_surrogates(text: str) -> str:
    """Lone surrogates (possible in JSON strings) cannot be UTF-8 encoded: they become U+FFFD, as
    llama.cpp's UTF-8 decoder turns invalid input into U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return "".join("\ufffd" if 0xD800 <= ord(ch) <= 0xDFFF else ch for ch in text)
