"""Write-behind on a real SeaweedFS: two servers (each its own --cache-disk) on one bucket, idle saves off.
Four turns on server A; within two seconds of A's fourth reply the conversation is in the bucket (one object:
A's earlier turns superseded or deleted), and the fifth turn on server B restores the whole history from it
(cached_tokens, B's fetch and hit) and answers as A, which held the chat, does. The write-behind is counted in
A's /metrics (saves by trigger, write-behinds, uploads, the queue)."""

from __future__ import annotations

import time

import pytest
import strata_sessionfile as sf
from strata_sessionfile.objstore import S3Source

from .servers import start_server
from .store_s3 import FACTS, cached_tokens, chat, metric, reply_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PREFIX = "writebehind"
VISIBLE_WITHIN_S = 2.0  # from A's reply to its object in the bucket


def stored_tokens(client, bucket: str, key: str, verify: bool = False) -> int:
    with S3Source(client, bucket, key) as source:
        return sf.inspect(source, verify=verify).metadata.state.n_tokens


def wait_for_object(s3_store, at_least: int, timeout_s: float, alone: bool = False) -> tuple[str, int] | None:
    """An object under the prefix holding at least `at_least` tokens (header and metadata read: ranged
    GETs); with `alone`, once it is the only one."""
    client = s3_store.client()  # one client: the poll's own cost stays out of the figure
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        listing = client.list_objects_v2(Bucket=s3_store.bucket, Prefix=PREFIX + "/")
        keys = [o["Key"] for o in listing.get("Contents", [])]
        for key in keys if len(keys) == 1 or not alone else ():
            try:
                if (n := stored_tokens(client, s3_store.bucket, key)) >= at_least:
                    return key, n
            except sf.SessionFileError:
                pass  # deleted since listed: an older turn, replaced by A's newer one
        time.sleep(0.02)
    return None


def test_four_turns_on_a_continue_on_b_within_seconds(module_tmp, s3_store):
    flags = (
        "--cache-store",
        f"s3://{s3_store.bucket}/{PREFIX}",
        "--cache-store-endpoint",
        s3_store.endpoint_url,
        "--metrics",
        "--cache-idle-seconds",
        "0",  # no idle saves: only the write-behind can put a turn in the bucket
    )
    a = start_server(
        module_tmp, "--cache-disk", str(module_tmp / "wb-a"), *flags, name="wb-a", env=s3_store.env()
    )
    b = None
    try:
        b = start_server(
            module_tmp, "--cache-disk", str(module_tmp / "wb-b"), *flags, name="wb-b", env=s3_store.env()
        )
        messages = [{"role": "system", "content": "You are a careful assistant. Facts: " + FACTS}]
        for item in (3, 11, 19, 27):
            messages.append({"role": "user", "content": f"Where is item {item}?"})
            turn = chat(a, messages)
            messages.append({"role": "assistant", "content": reply_of(turn)})
        replied = time.monotonic()
        held = turn["usage"]["prompt_tokens"] + turn["usage"]["completion_tokens"]
        found = wait_for_object(s3_store, held - 2, timeout_s=30.0)
        visible_s = time.monotonic() - replied
        assert found is not None, "A's fourth turn never reached the bucket"
        assert visible_s <= VISIBLE_WITHIN_S, f"A's fourth turn reached the bucket after {visible_s:.2f} s"
        # A's earlier turns: superseded in the queue or deleted once the newer upload landed.
        assert wait_for_object(s3_store, held - 2, timeout_s=10.0, alone=True) == found
        key, n_stored = found
        assert stored_tokens(s3_store.client(), s3_store.bucket, key, verify=True) == n_stored

        messages.append({"role": "user", "content": "And item 5?"})
        on_b = chat(b, messages)
        assert cached_tokens(on_b) >= 0.99 * n_stored  # the whole history, from A's object
        assert metric(b, "strata:store_fetches_total") == 1
        assert metric(b, 'strata:store_lookups_total{result="hit"}') == 1
        assert reply_of(chat(a, messages)) == reply_of(on_b)  # A held the chat: the same greedy reply

        # A's last turn started another write-behind: read its counters once they agree (none in flight)
        deadline = time.monotonic() + 30.0
        while True:
            saved = metric(a, 'strata:store_write_behind_total{result="saved"}')
            counted = metric(a, 'strata:store_saves_total{trigger="write_behind"}')
            leases = metric(a, "strata:store_write_behind_lease_seconds_count")
            if counted == saved == leases or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert saved >= 1
        assert counted == saved
        assert metric(a, 'strata:store_saves_total{trigger="idle"}') == 0
        assert metric(a, 'strata:store_saves_total{trigger="replace"}') == 0
        assert leases == saved
        assert metric(a, 'strata:store_uploads_total{result="uploaded"}') >= 1
        assert metric(a, "strata:store_upload_bytes_total") > 0
        assert metric(a, 'strata:store_uploads_total{result="failed"}') == 0
        assert metric(a, "strata:store_upload_queue_limit_bytes") == 1024 << 20
        assert (
            metric(b, 'strata:store_uploads_total{result="uploaded"}') >= 1
        )  # B's fifth turn, for the next server
        print(
            f"A's fourth turn in the bucket {visible_s:.2f} s after its reply"
        )  # the decision record's figure
    finally:
        if b is not None:
            assert b.stop() == 0
        assert a.stop() == 0
