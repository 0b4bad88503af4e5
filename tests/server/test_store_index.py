"""The session store's index and policy without a server: chained block hashes, the longest stored prefix
checked token by token, least-recently-used eviction by bytes, the save / restore decisions, and the
start-up scan of pending files a kill left behind, the commit of a save (saving.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import strata_sessionfile as sf
from strata_server.ledger import Origin, SlotLedger
from strata_server.store.folder import StoreFolder
from strata_server.store.index import (
    BLOCK_TOKENS,
    StoredConversation,
    StoreIndex,
    as_tokens,
    chain_hashes,
)
from strata_server.store.metrics import SaveTrigger, StoreMetrics
from strata_server.store.names import PENDING_SUFFIX, Fingerprints, conversation_name
from strata_server.store.policy import plan, worth_saving
from strata_server.store.saving import PendingSave, Saves
from strata_server.store.store import SessionStore, StoreSettings
from strata_sessionfile.testing.reference import fake_identity, memory_adapter_factory

B = BLOCK_TOKENS


def tokens(n: int, seed: int) -> np.ndarray:
    return as_tokens(np.random.default_rng(seed).integers(0, 49152, n))


def conversation(name: str, toks: np.ndarray, nbytes: int = 100) -> StoredConversation:
    return StoredConversation(name, nbytes, toks)


def test_chained_hashes_name_whole_prefixes():
    t = tokens(5 * B + 17, 1)
    hashes = chain_hashes(t)
    assert len(hashes) == 5  # whole blocks only
    assert chain_hashes(t[: 3 * B + 5]) == hashes[:3]  # a prefix's hashes are a prefix of the hashes
    changed = t.copy()
    changed[2 * B + 7] += 1
    other = chain_hashes(changed)
    assert other[:2] == hashes[:2] and all(a != b for a, b in zip(other[2:], hashes[2:], strict=True))
    # the same block at another depth hashes differently: a hash names its position too
    shifted = as_tokens(np.concatenate([t[B : 2 * B], t[:B]]))
    assert chain_hashes(shifted)[1] != hashes[0] and chain_hashes(t[B : 2 * B])[0] != hashes[1]


def test_longest_prefix_is_checked_token_by_token_and_prefers_the_shortest_file():
    index = StoreIndex()
    base = tokens(4 * B, 2)
    a = as_tokens(np.concatenate([base[: 3 * B + 40], tokens(300, 3)]))  # shares 3 blocks + 40 tokens
    b = as_tokens(np.concatenate([base[:B], tokens(600, 4)]))  # shares 1 block
    index.add(conversation("a", a))
    index.add(conversation("b", b))
    match = index.longest_prefix(base)
    assert match is not None and match.conversation.name == "a" and match.n_tokens == 3 * B + 40
    assert index.longest_prefix(tokens(3 * B, 5)) is None  # nothing shares a whole block
    assert index.longest_prefix(base[: B - 1]) is None  # shorter than a block: never found
    # two files hold the whole prompt: the one with fewer tokens (the least to read) wins
    index.add(conversation("long", as_tokens(np.concatenate([base, tokens(900, 6)]))))
    index.add(conversation("short", as_tokens(np.concatenate([base, tokens(10, 7)]))))
    match = index.longest_prefix(base)
    assert (match.conversation.name, match.n_tokens) == ("short", 4 * B)
    assert index.covers(base) and not index.covers(as_tokens(np.concatenate([base, [1]])))


def test_a_prompt_that_differs_inside_the_matched_blocks_is_cut_where_it_differs():
    index = StoreIndex()
    stored = tokens(3 * B, 8)
    index.add(conversation("s", stored))
    prompt = stored.copy()
    prompt[2 * B + 3] = (prompt[2 * B + 3] + 1) % 49152
    match = index.longest_prefix(prompt)
    assert match.n_tokens == 2 * B + 3


def test_strict_prefixes_and_removal():
    index = StoreIndex()
    full = tokens(3 * B + 9, 9)
    index.add(conversation("p1", full[: B + 3]))
    index.add(conversation("p2", full[: 2 * B]))
    index.add(conversation("other", tokens(2 * B, 10)))
    index.add(conversation("self", full))
    assert sorted(c.name for c in index.strict_prefixes_of(full)) == ["p1", "p2"]
    index.remove("p2")
    assert index.longest_prefix(full[: 2 * B]).conversation.name == "self"
    assert index.remove("p2") is None and len(index) == 3


def test_least_recently_used_eviction_by_bytes():
    index = StoreIndex()
    for i, size in enumerate((40, 30, 20, 10)):
        index.add(conversation(f"c{i}", tokens(B, 20 + i), nbytes=size))
    assert index.bytes_held() == 100
    index.touch("c0")  # used now: the newest
    victims = [c.name for c in index.over_limit(60)]
    assert victims == ["c1", "c2"]  # oldest first, until the rest fits
    assert [c.name for c in index.over_limit(100)] == []
    # the one kept goes last, and only if the others do not make room
    assert [c.name for c in index.over_limit(45, keep=["c1"])] == ["c2", "c3", "c0"]
    assert [c.name for c in index.over_limit(25, keep=["c1"])] == ["c2", "c3", "c0", "c1"]


@pytest.mark.parametrize(
    "held_n, prompt_extra, match_n, expect_restore, expect_save",
    [
        (0, 0, 3 * B, True, False),  # an empty slot: restore
        (2 * B, 20, None, False, False),  # the next turn of the held conversation: nothing to do
        (2 * B, 20, 2 * B + 100, False, False),  # the store holds only 100 more than the slot: not worth it
        (2 * B, 20, 3 * B, True, False),  # the store holds a whole block more: restore
    ],
)
def test_plan_for_a_continuing_conversation(held_n, prompt_extra, match_n, expect_restore, expect_save):
    from strata_server.store.index import Match

    base = tokens(4 * B, 11)
    held = base[:held_n]
    prompt = as_tokens(np.concatenate([base[: max(held_n, match_n or 0)], tokens(prompt_extra, 12)]))
    match = Match(conversation("m", base), match_n) if match_n else None
    decision = plan(prompt, held, match, min_reuse=B)
    assert (decision.restore is not None, decision.save_first) == (expect_restore, expect_save)
    if decision.restore is not None:
        assert decision.min_keep == decision.held_common + B


def test_plan_saves_a_conversation_before_another_replaces_it():
    a, b = tokens(3 * B, 13), tokens(2 * B, 14)
    decision = plan(b, a, None, min_reuse=B)
    assert decision.save_first and decision.restore is None and decision.held_common == 0
    # a few tokens re-rendered at the end of the held conversation are not a replacement
    turn = as_tokens(np.concatenate([a[:-5], tokens(40, 15)]))
    assert not plan(turn, a, None, min_reuse=B).save_first
    # no prompt cache: the engine erases everything; nothing restored
    decision = plan(as_tokens(np.concatenate([a, tokens(9, 16)])), a, None, min_reuse=B, cache_prompt=False)
    assert decision.save_first and decision.restore is None
    assert plan(b, None, None, min_reuse=B).save_first is False  # unknown: never saved
    assert worth_saving(tokens(B, 17), B) and not worth_saving(tokens(B - 1, 17), 1)
    assert not worth_saving(tokens(300, 17), 400) and not worth_saving(None, 1)


def test_a_pending_file_left_by_a_kill_is_committed_when_whole_and_removed_when_cut(tmp_path):
    """What a server killed between the engine's write (SAVE, "sync": false) and the commit leaves: the start-up
    scan commits a whole pending file (its payload verified) and removes one cut short; another engine's
    is left alone. Only committed files are indexed."""
    ours, theirs = fake_identity("ours"), fake_identity("theirs")
    fingerprints = Fingerprints(ours.model.fingerprint.hex(), ours.config.fingerprint.hex())
    folder = StoreFolder(tmp_path)

    def pending(identity, seed: int) -> tuple[str, np.ndarray]:
        scratch = tmp_path / "scratch.tmp"
        sf.save(scratch, memory_adapter_factory(n_tokens=300, identity=identity)(seed))
        toks = as_tokens(np.frombuffer(sf.inspect(scratch, verify=False).metadata.state.tokens, dtype="<i4"))
        name = conversation_name(fingerprints, toks)
        scratch.rename(folder.pending(name))
        return name, toks

    whole, whole_tokens = pending(ours, 1)
    cut, _ = pending(ours, 2)
    data = folder.pending(cut).read_bytes()
    folder.pending(cut).write_bytes(data[: len(data) // 2])
    foreign, _ = pending(theirs, 3)
    store = SessionStore(
        StoreSettings(folder=tmp_path, max_bytes=1 << 30, min_reuse=B, idle_s=0),
        engine=None,
        ledger=SlotLedger(1),
    )
    store.fingerprints = fingerprints
    store.scan()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([whole, foreign + PENDING_SUFFIX])
    assert [c.name for c in store.index.over_limit(0)] == [whole]  # the only one indexed
    assert np.array_equal(store.index.get(whole).tokens, whole_tokens)
    assert sf.inspect(folder.file(whole)).payload_verified


def test_a_commit_makes_room_indexes_the_file_and_tells_the_ledger_what_it_holds(tmp_path):
    """The commit of a pending save, without an engine (saving.py): the file is synced and renamed, indexed,
    the least recently used file evicted to fit the byte limit, and where the file holds other tokens than
    the ledger tracked, the ledger takes the file's."""
    identity = fake_identity("ours")
    fingerprints = Fingerprints(identity.model.fingerprint.hex(), identity.config.fingerprint.hex())
    folder = StoreFolder(tmp_path)

    def written(seed: int) -> tuple[str, np.ndarray, int]:
        scratch = tmp_path / "scratch.tmp"
        sf.save(scratch, memory_adapter_factory(n_tokens=300, identity=identity)(seed))
        toks = as_tokens(np.frombuffer(sf.inspect(scratch, verify=False).metadata.state.tokens, dtype="<i4"))
        name = conversation_name(fingerprints, toks)
        size = scratch.stat().st_size
        scratch.rename(folder.pending(name))
        return name, toks, size

    first, first_tokens, size = written(1)
    second, second_tokens, _ = written(2)
    ledger = SlotLedger(1)
    index, metrics = StoreIndex(), StoreMetrics()
    settings = StoreSettings(folder=tmp_path, max_bytes=size + size // 2, min_reuse=B, idle_s=0)
    saves = Saves(settings, None, ledger, folder, index, metrics, threading.RLock())

    saves.commit(PendingSave(0, SaveTrigger.IDLE, first, first_tokens, fingerprints, size, 0.01))
    assert [p.name for p in tmp_path.glob("*.ssf")] == [first] and index.get(first) is not None
    tracked = as_tokens(second_tokens[:-3])  # the ledger lost track of the last tokens
    ledger.restored(0, tracked, Origin.STORE, first)
    saves.commit(PendingSave(0, SaveTrigger.SHUTDOWN, second, tracked, fingerprints, size, 0.01))
    assert [p.name for p in tmp_path.iterdir()] == [second]  # the first evicted: both do not fit
    assert index.get(first) is None and np.array_equal(index.get(second).tokens, second_tokens)
    assert np.array_equal(ledger.tokens(0), second_tokens)
    assert (
        metrics.evictions == 1 and metrics.saves[SaveTrigger.IDLE] == metrics.saves[SaveTrigger.SHUTDOWN] == 1
    )
    saves.drain(time.monotonic() + 1)  # nothing pending: returns at once
