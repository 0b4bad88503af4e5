"""A stored conversation's text as a person reads it: its tokens detokenized by the engine (exact: the text the
model held, control tokens as their text), split into messages where it is ChatML (the packaged model's
template), the title its first user message. A leaf: no server imports."""

from __future__ import annotations

import re

import attrs

CHATML_MESSAGE = re.compile(r"<\|im_start\|>([A-Za-z_]+)\n(.*?)(?:<\|im_end\|>\n?|\Z)", re.S)
CHATML_START = "<|im_start|>"
TITLE_CHARS = 80


@attrs.frozen
class Transcript:
    text: str
    messages: tuple[dict[str, str], ...] | None  # None: not ChatML, shown as its text
    title: str


def read_transcript(text: str) -> Transcript:
    messages = None
    if text.startswith(CHATML_START):
        found = [{"role": m.group(1), "content": m.group(2)} for m in CHATML_MESSAGE.finditer(text)]
        # Only a text that is wholly ChatML messages is split: anything else would be a guess.
        if "".join(m.group(0) for m in CHATML_MESSAGE.finditer(text)) == text:
            messages = tuple(found)
    return Transcript(text, messages, title_of(text, messages))


def title_of(text: str, messages: tuple[dict[str, str], ...] | None) -> str:
    first = next((m["content"] for m in messages or () if m["role"] == "user"), None)
    source = (first if first is not None else text).strip()
    line = " ".join(source.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1] + "…"
