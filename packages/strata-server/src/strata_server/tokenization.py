"""Prompts to token ids through the engine's TOKENIZE, by llama-server's rule (``tokenize_mixed``)."""

from __future__ import annotations

from .engine.client import EngineLease


def tokenize_mixed(
    lease: EngineLease, prompt: str | list, *, add_special: bool, parse_special: bool
) -> list[int]:
    """A string, or a list mixing strings and token ids, as token ids: each string tokenized (only a leading
    one with the model's special tokens, when ``add_special``), each id kept."""
    parts = [prompt] if isinstance(prompt, str) else prompt
    tokens: list[int] = []
    for index, part in enumerate(parts):
        if isinstance(part, str):
            tokens += lease.call(
                "TOKENIZE",
                {"content": part, "add_special": add_special and index == 0, "parse_special": parse_special},
            )["tokens"]
        else:
            tokens.append(part)
    return tokens
