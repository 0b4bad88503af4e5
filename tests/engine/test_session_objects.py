"""`SAVE` / `RESTORE` / `RESTORE_PREFIX` of an object (`s3://BUCKET/KEY`, spec/engine-protocol.md, Sessions,
objects) against a real SeaweedFS: a save is a multipart upload that leaves no parts behind, a restore from the
object continues the conversation as a file's does (staged and streaming), a missing object and a malformed URL
are refused and the held conversation kept."""

from __future__ import annotations

import numpy as np
import pytest
import strata_sessionfile as sf
from strata_engine.client import EngineProcess
from strata_sessionfile.objstore import S3Source
from support.data import smollm2_model_path
from support.s3 import start_seaweed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def random_tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1000, 20000, n)]


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory):
    store = start_seaweed(tmp_path_factory.mktemp("s3"))
    yield store
    store.stop()


def test_save_and_restore_of_an_object(seaweed, tmp_path):
    engines = [
        EngineProcess(
            smollm2_model_path(),
            "--ctx-size",
            "1024",
            "--object-store-endpoint",
            seaweed.endpoint_url,
            *mode,
            env=seaweed.env(),
        )
        for mode in ((), ("--restore-mode", "streaming"))
    ]
    try:
        writer, reader = engines
        prompt, more = random_tokens(400, 21), random_tokens(30, 22)
        writer.complete(prompt, 4)
        url = f"s3://{seaweed.bucket}/engine/chat.ssf"
        saved = writer.result("SAVE", {"path": url})
        assert saved["n_saved"] == 403
        client = seaweed.client()
        assert (
            client.head_object(Bucket=seaweed.bucket, Key="engine/chat.ssf")["ContentLength"]
            == saved["n_written"]
        )
        assert not client.list_multipart_uploads(Bucket=seaweed.bucket).get("Uploads")
        unsynced = writer.result(
            "SAVE", {"path": url + ".copy", "sync": False}
        )  # an object: sync does not apply
        assert unsynced["n_written"] == saved["n_written"]
        with S3Source(client, seaweed.bucket, "engine/chat.ssf") as source:
            assert sf.inspect(source, verify=True).metadata.state.n_tokens == 403

        reference = writer.complete(prompt + more, 8)  # the writer still holds the conversation
        for engine, verb, argument in (
            (writer, "RESTORE", {"path": url}),
            (reader, "RESTORE_PREFIX", {"path": url, "cut_to": 400, "discard_held": True}),
        ):
            engine.result("ERASE")
            restored = engine.result(verb, argument)
            assert restored["n_read"] >= saved["n_written"]
            turn = engine.complete(prompt + more, 8)
            assert turn["timings"]["cache_n"] == 400 and turn["tokens"] == reference["tokens"]

        held = reader.result("STATUS")["slots"][0]["tokens_held_digest"]
        refusals = [
            ("RESTORE", {"path": f"s3://{seaweed.bucket}/engine/absent.ssf"}, "session_refused", "not_found"),
            ("RESTORE", {"path": "s3://only-a-bucket"}, "invalid_request", "bad_argument"),
            ("SAVE", {"path": "s3://only-a-bucket"}, "invalid_request", "bad_argument"),
        ]
        for verb, argument, kind, reason in refusals:
            answer = reader.command(verb, argument)
            assert answer["event"] == "error", (verb, argument, answer)
            error = answer["error"]
            assert (error["type"], error["reason"]) == (kind, reason), (verb, argument, error)
        assert reader.result("STATUS")["slots"][0]["tokens_held_digest"] == held
    finally:
        for engine in engines:
            engine.quit()
