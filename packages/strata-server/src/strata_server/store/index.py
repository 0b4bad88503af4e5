"""The store's in-memory index: for each stored conversation, its tokens and the chained hashes of its
token blocks; the longest stored prefix of a prompt; least-recently-used order by bytes.

Block hashes are chained (h_i = XXH3-64(h_{i-1} || block i's tokens as little-endian int32), h_0 = 0),
so one hash names a whole prefix: a prompt's block hashes are looked up deepest first, and the first hit
names every conversation that shares at least that many whole blocks with it. The match is then
checked and extended token by token against the conversation's own tokens, so a hash collision can
never restore a wrong prefix. Nothing here touches files (store.py does); thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

import attrs
import numpy as np
import xxhash

from ..tokens import as_tokens, common_prefix

BLOCK_TOKENS = 256  # tokens per hashed block: a prefix shorter than one block is never found


def chain_hashes(tokens: np.ndarray, block: int = BLOCK_TOKENS) -> list[int]:
    """The chained hash of each whole block of `tokens` (see the module docstring)."""
    hashes, h = [], 0
    data = tokens.astype("<i4", copy=False)
    for start in range(0, len(data) - block + 1, block):
        h = xxhash.xxh3_64_intdigest(h.to_bytes(8, "little") + data[start : start + block].tobytes())
        hashes.append(h)
    return hashes


@attrs.frozen(eq=False)
class StoredConversation:
    """One file of the store: its name in the folder, its size, and the conversation's tokens."""

    name: str
    nbytes: int
    tokens: np.ndarray = attrs.field(converter=as_tokens, repr=lambda t: f"<{len(t)} tokens>")
    hashes: tuple[int, ...] = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "hashes", tuple(chain_hashes(self.tokens)))

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


@attrs.frozen
class Match:
    conversation: StoredConversation
    n_tokens: int  # prompt tokens the conversation holds, checked token by token


class StoreIndex:
    """Stored conversations by name, by block-hash prefix, and in least-recently-used order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: OrderedDict[str, StoredConversation] = OrderedDict()  # least recently used first
        self._by_hash: dict[int, set[str]] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_name)

    def add(self, conversation: StoredConversation) -> None:
        """Index it as the most recently used (replacing an entry of the same name)."""
        with self._lock:
            self._remove(conversation.name)
            self._by_name[conversation.name] = conversation
            for h in conversation.hashes:
                self._by_hash.setdefault(h, set()).add(conversation.name)

    def remove(self, name: str) -> StoredConversation | None:
        with self._lock:
            return self._remove(name)

    def _remove(self, name: str) -> StoredConversation | None:
        conversation = self._by_name.pop(name, None)
        if conversation is not None:
            for h in conversation.hashes:
                names = self._by_hash.get(h)
                if names is not None:
                    names.discard(name)
                    if not names:
                        del self._by_hash[h]
        return conversation

    def get(self, name: str) -> StoredConversation | None:
        with self._lock:
            return self._by_name.get(name)

    def snapshot(self) -> list[StoredConversation]:
        """Every stored conversation, least recently used first."""
        with self._lock:
            return list(self._by_name.values())

    def touch(self, name: str) -> None:
        """Mark it used now (a restore)."""
        with self._lock:
            if name in self._by_name:
                self._by_name.move_to_end(name)

    def longest_prefix(self, prompt: np.ndarray) -> Match | None:
        """The conversation sharing the longest prefix with `prompt` (at least one whole block); among
        equal matches the one with the fewest tokens (the least to read). None when nothing shares a block."""
        hashes = chain_hashes(prompt)
        with self._lock:
            for depth in range(len(hashes), 0, -1):
                names = self._by_hash.get(hashes[depth - 1])
                if not names:
                    continue
                best: Match | None = None
                for name in names:
                    conversation = self._by_name[name]
                    n = common_prefix(prompt, conversation.tokens)
                    if n < depth * BLOCK_TOKENS:
                        continue  # a hash collision: the tokens disagree inside the hashed blocks
                    if best is None or (n, -conversation.n_tokens) > (
                        best.n_tokens,
                        -best.conversation.n_tokens,
                    ):
                        best = Match(conversation, n)
                if best is not None:
                    return best
        return None

    def covers(self, tokens: np.ndarray) -> bool:
        """Whether some stored conversation holds all of `tokens` as its prefix (saving them adds nothing)."""
        match = self.longest_prefix(tokens)
        return match is not None and match.n_tokens == len(tokens)

    def strict_prefixes_of(self, tokens: np.ndarray) -> list[StoredConversation]:
        """The stored conversations that `tokens` extends (a save of `tokens` replaces them)."""
        hashes = set(chain_hashes(tokens))
        with self._lock:
            candidates = {name for h in hashes for name in self._by_hash.get(h, ())}
            found = [self._by_name[name] for name in candidates]
        return [
            c for c in found if c.n_tokens < len(tokens) and common_prefix(tokens, c.tokens) == c.n_tokens
        ]

    def bytes_held(self) -> int:
        with self._lock:
            return sum(c.nbytes for c in self._by_name.values())

    def over_limit(self, limit_bytes: int, keep: Iterable[str] = ()) -> list[StoredConversation]:
        """The least recently used conversations to evict, oldest first, so that the rest fit
        `limit_bytes`; those named in `keep` go last (only when the others do not make room)."""
        kept = set(keep)
        with self._lock:
            order = [c for c in self._by_name.values() if c.name not in kept]
            order += [c for c in self._by_name.values() if c.name in kept]
            total = sum(c.nbytes for c in order)
        victims = []
        for conversation in order:
            if total <= limit_bytes:
                break
            victims.append(conversation)
            total -= conversation.nbytes
        return victims
