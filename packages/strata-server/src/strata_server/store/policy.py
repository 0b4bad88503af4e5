"""When the store saves and restores: pure decisions over what a slot holds, the prompt and the
longest stored match (store.py acts on them).

* A conversation is worth saving when it has at least one whole hashed block and --cache-min-reuse
  tokens (anything shorter could never be restored) and no stored conversation already holds it all.
* A request is about to replace the slot's conversation when it drops a whole block of it or more,
  whether a restore or the prompt cache cuts it (a next turn that re-renders the last reply differently
  drops a few tokens: no save), or asks for no prompt cache (the engine erases all of it).
* A stored match is restored when it holds at least --cache-min-reuse prompt tokens more than the slot
  already shares with the prompt; the engine is told to keep no less than that.
"""

from __future__ import annotations

import attrs
import numpy as np

from ..tokens import common_prefix
from .index import BLOCK_TOKENS, Match


@attrs.frozen
class Plan:
    held_common: int  # prompt tokens the slot already holds
    save_first: bool  # save the slot's conversation before the request replaces it
    restore: Match | None  # the stored conversation to restore (cut to restore.n_tokens)
    min_keep: int = 0  # refuse the restore when it would keep fewer tokens than this

    @property
    def looked_up(self) -> bool:
        return self.restore is not None


def worth_saving(tokens: np.ndarray | None, min_reuse: int) -> bool:
    return tokens is not None and len(tokens) >= max(BLOCK_TOKENS, min_reuse)


def plan(
    prompt: np.ndarray,
    held: np.ndarray | None,
    match: Match | None,
    *,
    min_reuse: int,
    cache_prompt: bool = True,
) -> Plan:
    """What to do for one request (`held`: the slot's tokens, None when unknown)."""
    held_common = common_prefix(prompt, held) if held is not None and cache_prompt else 0
    restore = None
    if cache_prompt and match is not None and match.n_tokens - held_common >= min_reuse:
        restore = match
    dropped = len(held) - held_common if held is not None else 0
    return Plan(
        held_common, dropped >= BLOCK_TOKENS, restore, held_common + min_reuse if restore is not None else 0
    )
