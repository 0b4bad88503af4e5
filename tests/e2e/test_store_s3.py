"""The session store's object-store tier (--cache-store s3://BUCKET/PREFIX behind --cache-disk) against a real
SeaweedFS: a conversation started on server A continues on server B (its own folder, the same bucket) with
cached_tokens >= 99 % of what A stored and the greedy reply A gives; the objects carry the fingerprints and the
first block's hash in their keys; with a session key, B refuses A's unauthenticated objects."""

from __future__ import annotations

import re

import pytest
import requests
import strata_sessionfile as sf
from strata_sessionfile.format import Flags
from strata_sessionfile.objstore import S3Source

from .servers import start_server
from .store_s3 import FACTS, REPLY_TOKENS, cached_tokens, chat, metric, objects, reference_chat, reply_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_a_conversation_started_on_a_continues_on_b(module_tmp, s3_store):
    store_url = f"s3://{s3_store.bucket}/fleet"
    flags = ("--cache-store", store_url, "--cache-store-endpoint", s3_store.endpoint_url, "--metrics")
    ref = reference_chat(module_tmp, 12, 7, "s3-reference")  # B must give its replies
    messages, first, following, reference = ref.messages, ref.first, ref.following, ref.reference

    a = start_server(
        module_tmp, "--cache-disk", str(module_tmp / "disk-a"), *flags, name="s3-a", env=s3_store.env()
    )
    try:
        assert reply_of(chat(a, messages)) == reply_of(first)
    finally:
        assert a.stop() == 0  # the shutdown save, uploaded before the server exits
    (key,) = objects(s3_store, "fleet/")
    with S3Source(s3_store.client(), s3_store.bucket, key) as source:
        header = sf.inspect(source, verify=False).header
        n_stored = sf.inspect(source, verify=False).metadata.state.n_tokens
    model, config, block, name = key.split("/")[1:]
    assert (model, config) == (header.model_fingerprint.hex(), header.config_fingerprint.hex())
    assert re.fullmatch(r"[0-9a-f]{16}", block) and re.fullmatch(r"[0-9a-f]{32}\.ssf", name)
    assert n_stored >= first["usage"]["prompt_tokens"] + REPLY_TOKENS - 2

    b = start_server(
        module_tmp, "--cache-disk", str(module_tmp / "disk-b"), *flags, name="s3-b", env=s3_store.env()
    )
    try:
        again = chat(b, following)
        assert cached_tokens(again) >= 0.99 * n_stored  # A's whole conversation, restored from the bucket
        assert reply_of(again) == reply_of(reference)
        assert metric(b, "strata:store_fetches_total") == 1
        assert metric(b, 'strata:store_lookups_total{result="hit"}') == 1
        assert (module_tmp / "disk-b" / name).is_file()  # downloaded into B's folder
    finally:
        assert b.stop() == 0

    # A server with a session key refuses A's objects (no MAC): evaluated cold, the same reply.
    key_path = module_tmp / "fleet.key"
    key_path.write_bytes(bytes(range(32)))
    c = start_server(
        module_tmp,
        "--cache-disk",
        str(module_tmp / "disk-c"),
        *flags,
        "--session-key-file",
        str(key_path),
        name="s3-c",
        env=s3_store.env(),
    )
    try:
        cold = chat(c, following)
        assert cached_tokens(cold) == 0 and reply_of(cold) == reply_of(reference)
        assert metric(c, "strata:store_fetches_total") == 0
    finally:
        assert c.stop() == 0


def test_without_a_disk_a_conversation_moves_through_the_objects_alone(module_tmp, s3_store):
    """--cache-store without --cache-disk on A and on B, both with one session key: A's shutdown save is the
    object (a multipart upload by its engine, authenticated), B's restore reads it in place (ranged GETs, nothing
    downloaded, the MAC checked), and B's longer save supersedes it (A's object deleted)."""
    key_path = module_tmp / "nodisk.key"
    key_path.write_bytes(bytes(range(100, 132)))
    flags = (
        "--cache-store",
        f"s3://{s3_store.bucket}/nodisk",
        "--cache-store-endpoint",
        s3_store.endpoint_url,
        "--metrics",
        "--cache-idle-seconds",
        "0",
        "--session-key-file",
        str(key_path),
    )
    ref = reference_chat(module_tmp, 21, 3, "nodisk-reference")
    messages, first, following, reference = ref.messages, ref.first, ref.following, ref.reference

    a = start_server(module_tmp, *flags, name="nodisk-a", env=s3_store.env())
    try:
        assert reply_of(chat(a, messages)) == reply_of(first)
    finally:
        assert a.stop() == 0  # the shutdown save: written by the engine straight into the bucket
    (key,) = objects(s3_store, "nodisk/")
    with S3Source(s3_store.client(), s3_store.bucket, key) as source:
        inspection = sf.inspect(source, verify=True, key=sf.SessionKey.from_file(key_path))
    assert inspection.header.flags & Flags.AUTHENTICATED
    n_stored = inspection.metadata.state.n_tokens
    assert n_stored >= first["usage"]["prompt_tokens"] + REPLY_TOKENS - 2

    b = start_server(module_tmp, *flags, name="nodisk-b", env=s3_store.env())
    try:
        again = chat(b, following)
        assert cached_tokens(again) >= 0.99 * n_stored
        assert reply_of(again) == reply_of(reference)
        assert metric(b, "strata:store_fetches_total") == 1
        assert metric(b, "strata:store_fetch_bytes_total") == 0  # read in place, not downloaded
        assert metric(b, 'strata:store_lookups_total{result="hit"}') == 1
    finally:
        assert b.stop() == 0
    (longer,) = objects(s3_store, "nodisk/")  # B's save of the longer conversation replaced A's object
    assert longer != key
    with S3Source(s3_store.client(), s3_store.bucket, longer) as source:
        assert sf.inspect(source, verify=True).metadata.state.n_tokens > n_stored


def test_an_unreachable_object_store_leaves_the_server_serving(module_tmp):
    from strata_sessionfile.testing.s3server import free_ports

    (port,) = free_ports(1)  # nothing listens there
    env = {
        "AWS_ACCESS_KEY_ID": "unused",
        "AWS_SECRET_ACCESS_KEY": "unused",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    server = start_server(
        module_tmp,
        "--cache-disk",
        str(module_tmp / "disk-down"),
        "--metrics",
        "--cache-store",
        "s3://gone/fleet",
        "--cache-store-endpoint",
        f"http://127.0.0.1:{port}",
        name="s3-down",
        env=env,
    )
    try:
        prompt = "Inventory notes, read carefully. " + FACTS
        body = requests.post(
            server.url + "/completion", json={"prompt": prompt, "n_predict": 4, "temperature": 0}, timeout=300
        ).json()
        assert body["timings"]["cache_n"] == 0 and body["tokens_evaluated"] > 256
        assert metric(server, "strata:store_remote_failures_total") >= 1
        assert requests.get(server.url + "/health", timeout=30).status_code == 200
    finally:
        assert server.stop() == 0  # the shutdown save is kept locally; its upload fails and is logged
    assert list((module_tmp / "disk-down").glob("*.ssf"))
