"""A kept conversation's text (strata_server.transcript): a chat turn's notes made and read back, a title
given to them, the limits, and the text of a file without notes read from its detokenized tokens only where it
is wholly ChatML."""

from __future__ import annotations

import json

from strata_engine.session.fields import MAX_NOTES_BYTES
from strata_server.transcript import (
    TITLE_CHARS,
    Notes,
    inherits,
    read_notes,
    read_transcript,
    turn_notes,
    with_notes,
)

FIELDS = json.dumps({"layout": 1, "ring_start": 0, "checkpoint": None}).encode()


def test_notes_round_trip_through_the_engine_fields():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<script>x</script>"}]
    notes = turn_notes(messages, "Hi <img onerror=1>")
    assert notes is not None and notes.encode() is not None
    fields = with_notes(FIELDS, notes.encode())
    assert json.loads(fields)["layout"] == 1  # the engine's own fields are kept
    read = read_notes(fields)
    assert read == Notes((*messages, {"role": "assistant", "content": "Hi <img onerror=1>"}), None)
    t = read_transcript("<|im_start|>whatever", read)
    assert t.from_notes and t.title == "<script>x</script>" and t.messages == read.messages
    titled = read_transcript("x", Notes(read.messages, "My chat"))
    assert titled.title == "My chat" and titled.messages == read.messages


def test_notes_only_for_text_messages_and_within_the_engine_bound():
    assert turn_notes([{"role": "user", "content": [{"type": "text", "text": "a"}]}], "b") is None
    assert turn_notes("a prompt", "b") is None
    assert Notes(({"role": "user", "content": "x" * MAX_NOTES_BYTES},)).encode() is None


def test_files_without_our_notes_give_none():
    bad = (b"", b"not json", FIELDS, with_notes(FIELDS, '{"v":2,"messages":[]}'), with_notes(FIELDS, "[1]"))
    for raw in (*bad, with_notes(FIELDS, '{"v":1,"messages":[{"role":1}],"title":null}')):
        assert read_notes(raw) is None


def test_text_without_notes_split_only_where_it_is_wholly_chatml():
    text = (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n  Where is\n item 12?<|im_end|>\n"
        "<|im_start|>assistant\nBox"
    )
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
    assert read_transcript("plain", Notes(None, "Given")).title == "Given"


def test_a_save_inherits_the_title_of_the_conversation_it_extends():
    older = Notes(({"role": "user", "content": "A"}, {"role": "assistant", "content": "cut rep"}), "Mine")
    newer = turn_notes(
        [{"role": "user", "content": "A"}, {"role": "assistant", "content": "cut reply"}], "ok"
    )
    assert inherits(newer, older) == "Mine"
    other = turn_notes([{"role": "user", "content": "B"}], "ok")
    assert inherits(other, older) is None
    assert inherits(None, older) == "Mine"  # no messages of its own: the tokens extend the titled ones
    assert inherits(newer, Notes(older.messages)) is None and inherits(newer, None) is None
