"""The write-behind's queue policies as pure logic: the upload queue (a burst of one conversation's turns
uploads once, the oldest pending upload of a conversation superseded by its newer one, the byte limit
dropping the oldest) and the dirty slots (a slot marked twice is saved once)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
from strata_server.store.uploads import Upload, UploadQueue
from strata_server.store.writebehind import DirtySlots


def conversation(seed: int, n_turns: int, turn_tokens: int = 300) -> list[np.ndarray]:
    """The tokens after each turn of one conversation (each turn extends the one before)."""
    tokens = np.random.default_rng(seed).integers(0, 50_000, size=n_turns * turn_tokens, dtype=np.int32)
    return [tokens[: (turn + 1) * turn_tokens] for turn in range(n_turns)]


def upload(tokens: np.ndarray, nbytes: int = 100, name: str = "") -> Upload:
    name = name or f"{len(tokens)}-{int(tokens[0])}.ssf"
    return Upload(Path("/nowhere") / name, f"fleet/m/c/b/{name}", tokens, nbytes)


def drain(queue: UploadQueue) -> list[Upload]:
    taken = []
    while (u := queue.take()) is not None:
        taken.append(u)
    return taken


def test_a_burst_of_turns_uploads_once_the_last_turn():
    queue = UploadQueue(max_bytes=10_000)
    turns = [upload(t) for t in conversation(1, 4)]
    superseded = []
    for turn in turns:
        offered = queue.offer(turn)
        assert offered.queued and not offered.dropped
        superseded += offered.superseded
    assert superseded == turns[:3]  # each pending turn replaced by the next, oldest first
    assert drain(queue) == [turns[3]]
    assert queue.bytes == 0 and len(queue) == 0


def test_an_upload_taken_is_not_superseded_and_the_next_turn_queues_after_it():
    queue = UploadQueue(max_bytes=10_000)
    first, second = (upload(t) for t in conversation(2, 2))
    queue.offer(first)
    assert queue.take() is first  # uploading now
    assert queue.offer(second).superseded == ()
    assert drain(queue) == [second]


def test_other_conversations_are_not_superseded_and_keep_their_order():
    queue = UploadQueue(max_bytes=10_000)
    a1, a2 = (upload(t) for t in conversation(3, 2))
    b1, b2 = (upload(t) for t in conversation(4, 2))
    for u in (a1, b1, a2):
        queue.offer(u)
    assert queue.offer(b2).superseded == (b1,)
    assert drain(queue) == [a2, b2]


def test_an_offer_a_pending_upload_holds_in_full_is_not_queued():
    queue = UploadQueue(max_bytes=10_000)
    shorter, longer = (upload(t) for t in conversation(5, 2))
    queue.offer(longer)
    offered = queue.offer(shorter)
    assert not offered.queued and offered.superseded == (shorter,)
    assert drain(queue) == [longer]


def test_a_branch_of_a_conversation_supersedes_nothing():
    """Two conversations sharing a system prompt, then different: neither holds the other."""
    (shared,) = conversation(6, 1)
    rng = np.random.default_rng(7)
    left = np.concatenate([shared, rng.integers(0, 50_000, 50, dtype=np.int32)])
    right = np.concatenate([shared, rng.integers(0, 50_000, 50, dtype=np.int32)])
    queue = UploadQueue(max_bytes=10_000)
    queue.offer(upload(left, name="left.ssf"))
    assert queue.offer(upload(right, name="right.ssf")).superseded == ()
    assert [u.key.rpartition("/")[2] for u in drain(queue)] == ["left.ssf", "right.ssf"]


def test_the_byte_limit_drops_the_oldest_pending_uploads():
    queue = UploadQueue(max_bytes=1_000)
    old, middle, new = (upload(conversation(10 + i, 1)[0], nbytes=400) for i in range(3))
    assert queue.offer(old).dropped == ()
    assert queue.offer(middle).dropped == ()
    assert queue.bytes == 800
    offered = queue.offer(new)
    assert offered.queued and offered.dropped == (old,)
    assert queue.bytes == 800 <= queue.max_bytes
    assert drain(queue) == [middle, new]


def test_superseding_frees_its_bytes_before_anything_is_dropped():
    queue = UploadQueue(max_bytes=1_000)
    other = upload(conversation(20, 1)[0], nbytes=400)
    turn1, turn2 = (upload(t, nbytes=500) for t in conversation(21, 2))
    queue.offer(other)
    queue.offer(turn1)
    offered = queue.offer(turn2)  # 400 + 500 pending; turn1's 500 go, turn2's 500 fit beside `other`
    assert offered.superseded == (turn1,) and offered.dropped == ()
    assert drain(queue) == [other, turn2]


def test_an_upload_larger_than_the_limit_alone_is_dropped_and_the_queue_kept():
    queue = UploadQueue(max_bytes=1_000)
    kept = upload(conversation(30, 1)[0], nbytes=600)
    queue.offer(kept)
    huge = upload(conversation(31, 1)[0], nbytes=1_001)
    offered = queue.offer(huge)
    assert not offered.queued and offered.dropped == (huge,)
    assert drain(queue) == [kept]


def test_a_slot_marked_twice_is_taken_once_in_marking_order():
    dirty = DirtySlots()
    for slot in (2, 0, 2, 0, 1):
        dirty.mark(slot)
    assert [dirty.take(), dirty.take(), dirty.take()] == [2, 0, 1]
    dirty.mark(2)  # a turn after its write-behind began: marked again
    assert dirty.take() == 2


def test_closing_wakes_a_waiting_taker():
    dirty = DirtySlots()
    taken: list[int | None] = []
    taker = threading.Thread(target=lambda: taken.append(dirty.take()))
    taker.start()
    dirty.close()
    taker.join(timeout=5)
    assert not taker.is_alive() and taken == [None]


def test_an_object_deleted_since_listed_is_told_apart_from_a_store_failure():
    """A newer turn's upload deletes the older object a peer may have listed: that peer lists again."""
    from botocore.exceptions import ClientError, EndpointConnectionError
    from strata_server.store.remote import missing

    assert missing(ClientError({"Error": {"Code": "404", "Message": "Not Found"}}, "HeadObject"))
    assert missing(ClientError({"Error": {"Code": "NoSuchKey"}}, "GetObject"))
    assert not missing(ClientError({"Error": {"Code": "AccessDenied"}}, "GetObject"))
    assert not missing(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
