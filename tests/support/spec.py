"""Reading the markdown tables of spec/*.md, for the tests that bind a spec's tables to the code."""

from __future__ import annotations

import re
from pathlib import Path

SPEC_DIR = Path(__file__).resolve().parents[2] / "spec"


def read_spec(name: str) -> str:
    return (SPEC_DIR / name).read_text(encoding="utf-8")


def section(text: str, title: str) -> str:
    """The section of `text` that starts at the heading `title` ("## Errors"), up to the next heading of
    the same or a higher level."""
    start = text.index(title)
    level = len(title) - len(title.lstrip("#"))
    nxt = re.search(rf"^#{{1,{level}}} ", text[start + len(title) :], re.M)
    return text[start : start + len(title) + (nxt.start() if nxt else len(text))]


def table_rows(text: str) -> list[list[str]]:
    """The cells of the first table's rows in `text` (header and separator dropped)."""
    rows, started = [], False
    for line in text.splitlines():
        if line.startswith("|"):
            started = True
            if not set(line) <= set("|- "):
                rows.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif started:
            break
    return rows[1:]


def code(cell: str) -> str:
    """The first `code` span of a cell."""
    return re.search(r"`([^`]+)`", cell).group(1)
