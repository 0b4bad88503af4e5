"""A stored conversation's text as a person reads it.

A chat turn's messages (as the client sent them, plus the reply) are the slot's *notes*: the store's save
hands them to the engine, which keeps them in the session file's engine fields, under its hashes and MAC
(`notes_of`, `messages_of_notes`). A file without notes (saved by a slot action, or by a text completion)
shows its tokens detokenized by the engine, split into messages only where that text is wholly ChatML
(the packaged model's template). The title is the first user message. A leaf: no server imports (the engine's bound on notes only).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from strata_engine.session.fields import MAX_NOTES_BYTES

NOTES_VERSION = 1

CHATML_MESSAGE = re.compile(r"<\|im_start\|>([A-Za-z_]+)\n(.*?)(?:<\|im_end\|>\n?|\Z)", re.S)
CHATML_START = "<|im_start|>"
TITLE_CHARS = 80


@attrs.frozen
class Transcript:
    text: str
    messages: tuple[dict[str, str], ...] | None  # None: not ChatML, shown as its text
    title: str
    from_notes: bool = False  # the messages are the file's notes, not read from its detokenized text


def notes_of(messages: Any, reply: str) -> str | None:
    """A chat turn's notes: its messages and the reply, as JSON; None unless every message is a role and a
    string content (a multimodal or tool message is not kept as text)."""
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        return None
    kept = []
    for m in messages:
        if (
            not isinstance(m, Mapping)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            return None
        kept.append({"role": m["role"], "content": m["content"]})
    kept.append({"role": "assistant", "content": reply})
    notes = json.dumps({"v": NOTES_VERSION, "messages": kept}, ensure_ascii=False, separators=(",", ":"))
    # Over the engine's bound the conversation is saved without them (its text then read from its tokens).
    return notes if len(notes.encode("utf-8", "surrogatepass")) <= MAX_NOTES_BYTES else None


def messages_of_notes(engine_fields: bytes) -> tuple[dict[str, str], ...] | None:
    """The messages a session file's engine fields keep, or None (no notes, or not ours)."""
    try:
        fields = json.loads(engine_fields.decode("utf-8"))
        notes = json.loads(fields["notes"]) if isinstance(fields, dict) and "notes" in fields else None
    except (UnicodeDecodeError, ValueError, TypeError):
        return None
    if (
        not isinstance(notes, dict)
        or notes.get("v") != NOTES_VERSION
        or not isinstance(notes.get("messages"), list)
    ):
        return None
    found = []
    for m in notes["messages"]:
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            return None
        found.append({"role": m["role"], "content": m["content"]})
    return tuple(found)


def transcript_of_notes(text: str, messages: tuple[dict[str, str], ...]) -> Transcript:
    return Transcript(text, messages, title_of(text, messages), from_notes=True)


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
