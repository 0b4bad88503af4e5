"""The merge loop both BPE flavours share: repeatedly merge the adjacent pair with the best priority.

GPT-2 BPE ranks a pair by its merge rank; SentencePiece BPE by the score of the merged token. Either way
the pair with the smallest key merges first, the leftmost among equals (llama.cpp's order).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


def merge_symbols(symbols: list[str], priority: Callable[[str, str], Any | None]) -> list[str]:
    """Merge `symbols` in place and return it; merged-away slots become "".

    priority(left, right) is the pair's sort key (smaller merges first), or None when it cannot merge.
    """
    n = len(symbols)
    prev = list(range(-1, n - 1))
    next_ = list(range(1, n + 1))
    if n:
        next_[-1] = -1
    heap: list[tuple[Any, int, int, str]] = []
    for i in range(n - 1):
        key = priority(symbols[i], symbols[i + 1])
        if key is not None:
            heap.append((key, i, i + 1, symbols[i] + symbols[i + 1]))
    heapq.heapify(heap)
    while heap:
        _, left, right, merged = heapq.heappop(heap)
        left_text, right_text = symbols[left], symbols[right]
        if not left_text or not right_text or left_text + right_text != merged:
            continue  # outdated: one side was merged into something else meanwhile
        symbols[left] = merged
        symbols[right] = ""
        after = next_[right]
        next_[left] = after
        if after >= 0:
            prev[after] = left
        before = prev[left]
        if before >= 0:
            key = priority(symbols[before], merged)
            if key is not None:
                heapq.heappush(heap, (key, before, left, symbols[before] + merged))
        if after >= 0:
            key = priority(merged, symbols[after])
            if key is not None:
                heapq.heappush(heap, (key, left, after, merged + symbols[after]))
    return symbols
