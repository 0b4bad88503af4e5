"""Faults of the object store during a restore straight from an object (--cache-store without --cache-disk), on
a real SeaweedFS behind a TCP relay (support/s3.StoreProxy) that lets the test act between the passes: an
object replaced between the passes is refused and the prompt evaluated cold with the right reply; the store
killed between the passes gives a refusal before the gate, killed during the apply pass the slot erased alone
(protocol v2's slot_failed: no restart) and the prompt evaluated cold;
either way the server keeps serving (/health, the next completion); a request lost on the way is retried (boto3's
standard retry mode, with back-off) and the restore completes."""

from __future__ import annotations

import attrs
import pytest
import requests
import strata_sessionfile as sf
from strata_sessionfile.objstore import S3Source
from support.s3 import StoreProxy, put_multipart, start_seaweed

from .servers import start_server
from .store_s3 import FACTS, cached_tokens, chat, metric, objects, reference_chat, reply_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PREFIX = "faults"


@attrs.frozen
class Conversation:
    following: list  # the next turn's messages
    reference: dict  # a server holding the chat answers `following` so
    key: str  # the object a server without a disk saved for its first turn
    data: bytes  # that object's bytes
    n_tokens: int  # the tokens it holds


@pytest.fixture(scope="module")
def conversation(module_tmp, s3_store) -> Conversation:
    ref = reference_chat(module_tmp, 17, 9, "faults-reference")
    messages, first = ref.messages, ref.first
    a = start_server(
        module_tmp,
        "--cache-store",
        f"s3://{s3_store.bucket}/{PREFIX}",
        "--cache-store-endpoint",
        s3_store.endpoint_url,
        "--cache-idle-seconds",
        "0",
        name="faults-a",
        env=s3_store.env(),
    )
    try:
        assert reply_of(chat(a, messages)) == reply_of(first)
    finally:
        assert a.stop() == 0
    (key,) = objects(s3_store, PREFIX + "/")
    data = s3_store.client().get_object(Bucket=s3_store.bucket, Key=key)["Body"].read()
    with S3Source(s3_store.client(), s3_store.bucket, key) as source:
        n_tokens = sf.inspect(source, verify=True).metadata.state.n_tokens
    return Conversation(ref.following, ref.reference, key, data, n_tokens)


@pytest.fixture
def store(tmp_path, conversation):
    """A fresh SeaweedFS holding the conversation's object (a test may kill it), and a relay in front of it."""
    seaweed = start_seaweed(tmp_path / "s3")
    put_multipart(seaweed.client(), seaweed.bucket, conversation.key, conversation.data)
    proxy = StoreProxy(seaweed.endpoint_url)
    yield seaweed, proxy
    proxy.close()
    seaweed.stop()


def server_b(tmp_path, seaweed, proxy, name: str):
    """A server without a disk whose engine restores in two passes (streaming), its store reached through the
    relay."""
    return start_server(
        tmp_path,
        "--cache-store",
        f"s3://{seaweed.bucket}/{PREFIX}",
        "--cache-store-endpoint",
        proxy.endpoint_url,
        "--restore-mode",
        "streaming",
        "--cache-idle-seconds",
        "0",
        "--metrics",
        name=name,
        env=seaweed.env(),
    )


def still_serving(server, conversation: Conversation) -> None:
    """/health answers, and a completion of another prompt works (its lookup fails: the store is gone)."""
    server.wait_healthy(120)
    body = requests.post(
        server.url + "/completion",
        json={"prompt": "Inventory notes, read carefully. " + FACTS, "n_predict": 4, "temperature": 0},
        timeout=300,
    )
    assert body.status_code == 200 and body.json()["tokens_evaluated"] > 256
    assert reply_of(chat(server, conversation.following)) == reply_of(conversation.reference)


def test_an_object_replaced_between_the_passes_is_refused(tmp_path, conversation, store):
    seaweed, proxy = store
    etags = []

    def replace() -> None:  # the reader's version check after its read pass: a new version arrives first
        client = seaweed.client()
        etags.append(client.head_object(Bucket=seaweed.bucket, Key=conversation.key)["ETag"])
        client.put_object(Bucket=seaweed.bucket, Key=conversation.key, Body=conversation.data)
        etags.append(client.head_object(Bucket=seaweed.bucket, Key=conversation.key)["ETag"])

    proxy.before_request(b"HEAD", replace)
    b = server_b(tmp_path, seaweed, proxy, "faults-replaced")
    try:
        body = chat(b, conversation.following)
        assert len(etags) == 2 and etags[0] != etags[1]  # the same bytes, another version
        assert cached_tokens(body) == 0 and reply_of(body) == reply_of(conversation.reference)
        assert metric(b, 'strata:store_bad_files_total{reason="object_replaced"}') == 1
        assert metric(b, 'strata:store_lookups_total{result="refused"}') == 1
        assert metric(b, "strata:store_restore_bytes_total") == 0
    finally:
        assert b.stop() == 0
    with S3Source(seaweed.client(), seaweed.bucket, conversation.key) as source:
        assert source.stamp().etag == etags[1]  # the new version stays for the next lookup


def test_the_store_killed_between_the_passes_gives_a_refusal(tmp_path, conversation, store):
    seaweed, proxy = store
    proxy.before_request(b"HEAD", seaweed.kill)
    b = server_b(tmp_path, seaweed, proxy, "faults-killed-gate")
    try:
        body = chat(b, conversation.following)
        assert seaweed.proc is None  # killed by the version check between the passes
        assert cached_tokens(body) == 0 and reply_of(body) == reply_of(conversation.reference)
        assert metric(b, 'strata:store_bad_files_total{reason="store_unavailable"}') == 1
        still_serving(b, conversation)
    finally:
        assert b.stop() == 0  # the shutdown save fails (no store) and is logged


def test_the_store_killed_during_the_apply_pass_erases_the_slot_alone(tmp_path, conversation, store):
    seaweed, proxy = store
    # Half the object into the apply pass (after the version check between the passes), the store dies.
    proxy.before_request(b"HEAD", lambda: proxy.after_bytes(len(conversation.data) // 2, seaweed.kill))
    b = server_b(tmp_path, seaweed, proxy, "faults-killed-apply")
    try:
        body = chat(b, conversation.following)
        assert seaweed.proc is None
        # protocol v2: the engine erases that slot alone (slot_failed, no restart); the prompt is evaluated cold
        assert cached_tokens(body) == 0 and reply_of(body) == reply_of(conversation.reference)
        assert metric(b, 'strata:store_lookups_total{result="refused"}') == 1
        still_serving(b, conversation)
        log = b.log_path.read_text()
        assert "erased after a restore failed past its gate" in log  # the engine's line: that slot alone
        assert "fail-stop" not in log
    finally:
        assert b.stop() == 0


def test_a_request_lost_during_the_apply_pass_is_retried(tmp_path, conversation, store):
    seaweed, proxy = store
    dropped = []

    def drop_one() -> str:
        dropped.append(True)
        return StoreProxy.DROP

    # The first ranged GET of the apply pass (after the version check between the passes) never reaches the store.
    proxy.before_request(b"HEAD", lambda: proxy.before_request(b"GET", drop_one))
    b = server_b(tmp_path, seaweed, proxy, "faults-retried")
    try:
        body = chat(b, conversation.following)
        assert dropped == [True]
        assert cached_tokens(body) >= 0.99 * conversation.n_tokens
        assert reply_of(body) == reply_of(conversation.reference)
        assert metric(b, 'strata:store_lookups_total{result="hit"}') == 1
    finally:
        assert b.stop() == 0
