"""The byte-level BPE pre-tokenizers under test: one name of each distinct entry of the engine's table."""

from __future__ import annotations


def one_name_per_pre_type() -> list[str]:
    """The first name of every distinct `PRE_TOKENIZERS` entry (names sharing an entry tokenize alike)."""
    from strata_engine.tokenizer.bpe import PRE_TOKENIZERS

    first: dict[object, str] = {}
    for name, spec in PRE_TOKENIZERS.items():
        first.setdefault(spec, name)
    return list(first.values())
