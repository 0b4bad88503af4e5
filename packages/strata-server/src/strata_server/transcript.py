"""A stored conversation's text as a person reads it.

A chat turn's messages (as the client sent them, plus the reply) and a title a person gave are a slot's
*notes*: the store's save hands them to the engine, which keeps them in the session file's engine fields,
under its hashes and MAC (`Notes.encode`, `read_notes`). A file without notes (saved by a slot action, or
after a text completion) shows its tokens detokenized by the engine, split into messages only where that text
is wholly ChatML (the packaged model's template). The title is the given one, else the first user message.
A leaf: no server imports (the engine's bound on notes only).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from strata_engine.session.fields import MAX_NOTES_BYTES

NOTES_VERSION = 1
NOTES_KEY = "notes"  # the engine fields' key (spec/engine-protocol.md, SAVE)
CHATML_MESSAGE = re.compile(r"<\|im_start\|>([A-Za-z_]+)\n(.*?)(?:<\|im_end\|>\n?|\Z)", re.S)
CHATML_START = "<|im_start|>"
TITLE_CHARS = 80
MAX_TITLE_CHARS = 200

Messages = tuple[dict[str, str], ...]


def text_messages(messages: Any) -> Messages | None:
    """`messages` as (role, string content) pairs; None unless every one is (a multimodal or tool message is
    not kept as text)."""
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
    return tuple(kept)


@attrs.frozen
class Notes:
    messages: Messages | None = None
    title: str | None = None  # given by a person (PATCH /conversations/{id}); None: the first user message

    def encode(self) -> str | None:
        """The JSON the engine keeps; None where it would be over the engine's bound (the conversation is
        then saved without it, its text read from its tokens)."""
        notes = json.dumps(
            {"v": NOTES_VERSION, "messages": self.messages, "title": self.title},
            ensure_ascii=False,
            separators=(",", ":"),
        )
        return notes if len(notes.encode("utf-8", "surrogatepass")) <= MAX_NOTES_BYTES else None


def turn_notes(messages: Any, reply: str) -> Notes | None:
    """A chat turn's notes: its messages and the reply."""
    kept = text_messages(messages)
    return None if kept is None else Notes((*kept, {"role": "assistant", "content": reply}))


def inherits(notes: Notes | None, older: Notes | None) -> str | None:
    """The title a save inherits from the stored conversation it extends (and replaces): that one's, unless
    both keep messages and the newer ones do not begin with the older ones."""
    if older is None or older.title is None:
        return None
    if notes is not None and notes.messages is not None and older.messages is not None:
        n = len(older.messages) - 1  # the older reply may have been cut where the newer turn began
        if notes.messages[:n] != older.messages[:n]:
            return None
    return older.title


def read_notes(engine_fields: bytes) -> Notes | None:
    """The notes a session file's engine fields keep, or None (none, or not ours)."""
    try:
        fields = json.loads(bytes(engine_fields).decode("utf-8"))
        raw = fields.get(NOTES_KEY) if isinstance(fields, dict) else None
        notes = json.loads(raw) if isinstance(raw, str) else None
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(notes, dict) or notes.get("v") != NOTES_VERSION:
        return None
    messages = text_messages(notes["messages"]) if notes.get("messages") is not None else None
    title = notes.get("title")
    if (notes.get("messages") is not None and messages is None) or not isinstance(title, str | None):
        return None
    return Notes(messages, title)


def with_notes(engine_fields: bytes, notes: str) -> bytes:
    """A file's engine fields with `notes` in place of its own (everything else kept as it was)."""
    fields = json.loads(bytes(engine_fields).decode("utf-8")) if engine_fields else {}
    if not isinstance(fields, dict):
        raise ValueError("the engine fields are not a JSON object")
    fields[NOTES_KEY] = notes
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


@attrs.frozen
class Transcript:
    text: str
    messages: Messages | None  # None: not ChatML, shown as its text
    title: str
    from_notes: bool = False  # the messages are the file's notes, not read from its detokenized text


def read_transcript(text: str, notes: Notes | None = None) -> Transcript:
    """The transcript of a conversation's detokenized `text` and its file's notes, if any."""
    if notes is not None and notes.messages is not None:
        return Transcript(text, notes.messages, notes.title or title_of(text, notes.messages), True)
    messages = None
    if text.startswith(CHATML_START):
        found = list(CHATML_MESSAGE.finditer(text))
        # Only a text that is wholly ChatML messages is split: anything else would be a guess.
        if "".join(m.group(0) for m in found) == text:
            messages = tuple({"role": m.group(1), "content": m.group(2)} for m in found)
    title = notes.title if notes is not None and notes.title else title_of(text, messages)
    return Transcript(text, messages, title)


def title_of(text: str, messages: Messages | None) -> str:
    first = next((m["content"] for m in messages or () if m["role"] == "user"), None)
    source = (first if first is not None else text).strip()
    line = " ".join(source.split())
    return line if len(line) <= TITLE_CHARS else line[: TITLE_CHARS - 1] + "…"
