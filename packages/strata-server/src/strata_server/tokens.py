"""Token ids as the server keeps them (read-only little-endian int32 arrays, the form every hash is taken
of) and the one common-prefix rule that the slot choice, the ledger and the store share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def as_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a read-only little-endian int32 array."""
    array = np.array(tokens, dtype="<i4")
    array.flags.writeable = False
    return array


EMPTY = as_tokens([])


def known_tokens(prompt: Any) -> np.ndarray | None:
    """A prompt sent as token ids, as tokens; None for anything else (text the engine tokenizes: unknown here)."""
    if not isinstance(prompt, (list, np.ndarray)) or not all(
        isinstance(t, (int, np.integer)) for t in prompt
    ):
        return None
    return as_tokens(prompt)


def common_prefix(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n
