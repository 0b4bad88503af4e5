"""A kept conversation's text (strata_server.transcript): a chat turn's notes made and read back, the limits,
and the text of a file without notes read from its detokenized tokens only where it is wholly ChatML."""

from __future__ import annotations

import json

from strata_engine.session.fields import MAX_NOTES_BYTES
from strata_server.transcript import TITLE_CHARS, messages_of_notes, notes_of, read_transcript


def fields(notes: str | None) -> bytes:
    return json.dumps({"layout": 1, "ring_start": 0, "checkpoint": None, "notes": notes}).encode()


def test_notes_round_trip_through_the_engine_fields():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<script>x</script>"}]
    notes = notes_of(messages, "Hi <img onerror=1>")
    assert notes is not None
    assert messages_of_notes(fields(notes)) == (
        *messages,
        {"role": "assistant", "content": "Hi <img onerror=1>"},
    )


def test_notes_only_for_text_messages_and_within_the_engine_bound():
    assert notes_of([{"role": "user", "content": [{"type": "text", "text": "a"}]}], "b") is None
    assert notes_of("a prompt", "b") is None
    assert notes_of([{"role": "user", "content": "x" * MAX_NOTES_BYTES}], "b") is None


def test_files_without_our_notes_give_none():
    for raw in (b"", b"not json", b'{"layout":1}', fields('{"v":2,"messages":[]}'), fields("[1]")):
        assert messages_of_notes(raw) is None


def test_text_without_notes_split_only_where_it_is_wholly_chatml():
    text = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n  Where is\n item 12?<|im_end|>\n<|im_start|>assistant\nBox"
    t = read_transcript(text)
    assert t.messages == (
        {"role": "system", "content": "S"},
        {"role": "user", "content": "  Where is\n item 12?"},
        {"role": "assistant", "content": "Box"},
    )
    assert t.title == "Where is item 12?" and not t.from_notes
    other = read_transcript("The capital of France is " + "Paris " * 40)
    assert other.messages is None and len(other.title) == TITLE_CHARS
    assert read_transcript("<|im_start|>user\nA<|im_end|>\ntrailing words").messages is None
