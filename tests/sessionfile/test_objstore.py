"""Sessions on an S3-compatible object store (objstore.S3Source / S3Sink) against a real one, SeaweedFS: the
round trip (streaming and staged, plain, compressed, authenticated) gives the local file's bytes; the object
appears only when its upload completes; an object replaced between or during the passes is refused; a store
that stops mid-restore is a named error (a clean refusal before the gate, a fail-stop after it); a save
that fails or is killed leaves no object and, once aborted, no upload; a reader with a key refuses what the
key did not authenticate before the adapter sees a byte; a 1 GiB streaming restore from the store grows
peak RSS by at most 64 MiB."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from strata_sessionfile import errors as E
from strata_sessionfile import inspect, restore, save
from strata_sessionfile.auth import SessionKey
from strata_sessionfile.cli import EXIT_UNAUTHENTICATED, EXIT_UNREADABLE, EXIT_VALID, main
from strata_sessionfile.testing import (
    PATTERN_SIZE,
    PatternSource,
    fake_identity,
    recorder,
    synthetic_specs,
    tokens_for_bytes,
)
from strata_sessionfile.writer import SessionWriter

from .helpers import COPYING, COPYING_STAGING, LIVE_TOUCH, TOUCH, helpers_alive

objstore = pytest.importorskip("strata_sessionfile.objstore", reason="boto3 is not installed")
botocore_exceptions = pytest.importorskip("botocore.exceptions")
S3Sink, S3Source = objstore.S3Sink, objstore.S3Source

KEY = SessionKey(bytes(range(32)))
OTHER_KEY = SessionKey(bytes([7]) * 32)
PART = 5 << 20  # S3's smallest part: several parts from a few MiB


@pytest.fixture
def s3(s3_store):
    return s3_store.client()


def _needs_codec(compression) -> None:
    if compression is not None:
        pytest.importorskip("zstandard")


def object_bytes(s3, bucket: str, key: str) -> bytes:
    return s3.get_object(Bucket=bucket, Key=key)["Body"].read()


def object_exists(s3, bucket: str, key: str) -> bool:
    try:
        s3.head_object(Bucket=bucket, Key=key)
    except botocore_exceptions.ClientError as exc:
        assert exc.response["ResponseMetadata"]["HTTPStatusCode"] == 404
        return False
    return True


def uploads_under(s3, bucket: str, prefix: str) -> list[dict]:
    return s3.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])


def record_requests(s3, operation: str = "GetObject") -> list[dict]:
    """Every request of ``operation`` the client sends from now on: its parameters (botocore's own event)."""
    seen: list[dict] = []
    s3.meta.events.register(
        f"provide-client-params.s3.{operation}", lambda params, **kw: seen.append(dict(params))
    )
    return seen


class BigSource(PatternSource):
    """A synthetic session of about ``n_bytes`` of K/V (8 layers of 4 heads x 64); ``noise``: its pattern is
    random bytes, which no codec compresses (a compressed file as large as a plain one)."""

    def __init__(self, n_bytes: int, seed: int = 1, noise: bool = False) -> None:
        specs = synthetic_specs(8, 4, 64)
        super().__init__(fake_identity(), specs, tokens_for_bytes(specs, n_bytes), seed=seed)
        if noise:
            self._pattern = memoryview(random.Random(seed).randbytes(PATTERN_SIZE))


# --- round trips ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("key", [None, KEY], ids=["plain", "authenticated"])
def test_round_trip_through_the_store_gives_the_local_files_bytes(
    s3_store, s3, s3_prefix, tmp_path, compression, key
):
    _needs_codec(compression)
    bucket, name = s3_store.bucket, s3_prefix + "s.ssf"
    local = tmp_path / "s.ssf"
    save(local, COPYING(1), block_size=4096, compression=compression, key=key)
    report = save(S3Sink(s3, bucket, name), COPYING(1), block_size=4096, compression=compression, key=key)
    assert report.path == f"s3://{bucket}/{name}" and report.bytes_written == local.stat().st_size
    assert object_bytes(s3, bucket, name) == local.read_bytes()
    etag = s3.head_object(Bucket=bucket, Key=name)["ETag"]
    gets, heads = record_requests(s3), record_requests(s3, "HeadObject")
    for mode, factory in (("streaming", COPYING), ("staged", COPYING_STAGING)):
        target = factory(2)
        with S3Source(s3, bucket, name) as source:
            got = restore(source, target, mode=mode, block_size=4096, key=key)
        assert got.mode == mode and target.live_digest() == COPYING(1).live_digest()
        size = local.stat().st_size  # staged reads the object once, streaming twice
        assert got.bytes_read == size if mode == "staged" else size < got.bytes_read <= 2 * size
    # Each source's first GET pins the version it returns (and holds this whole small object); every later
    # request (the stamps between and after the passes) asks for that version.
    opening = [g for g in gets if "IfMatch" not in g]
    assert len(opening) == 2 and all(g["Range"] == f"bytes=0-{objstore.HEAD_BYTES - 1}" for g in opening)
    pinned = [r for r in gets + heads if r not in opening]
    assert len(pinned) >= 3 and all(r["IfMatch"] == etag for r in pinned)
    assert uploads_under(s3, bucket, s3_prefix) == [] and helpers_alive() == []


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_session_of_several_parts_and_ranges(s3_store, s3, s3_prefix, tmp_path, compression):
    """12 MiB in 5 MiB parts (a compressed save patches its header in part 1 last); read back in 1 MiB ranges
    fetched at once, each GET at most one range."""
    _needs_codec(compression)
    bucket, name = s3_store.bucket, s3_prefix + "big.ssf"
    local = tmp_path / "big.ssf"
    save(local, BigSource(12 << 20, noise=True), block_size=1 << 20, compression=compression)
    save(
        S3Sink(s3, bucket, name, part_size=PART),
        BigSource(12 << 20, noise=True),
        block_size=1 << 20,
        compression=compression,
    )
    assert (
        object_bytes(s3, bucket, name) == local.read_bytes() and local.stat().st_size > PART
    )  # parts: 2 or more
    gets = record_requests(s3)
    with S3Source(s3, bucket, name, range_size=1 << 20) as source:
        info = inspect(source, block_size=4 << 20)
    assert info.payload_verified and info.payload_hash == inspect(local).payload_hash
    sizes = [int(hi) - int(lo) + 1 for lo, hi in (g["Range"].removeprefix("bytes=").split("-") for g in gets)]
    assert max(sizes) <= 1 << 20 and sum(sizes) >= info.layout.file_size - (8 << 10)
    etag = s3.head_object(Bucket=bucket, Key=name)["ETag"]
    assert all(g["IfMatch"] == etag for g in gets[1:]) and len(gets) > 12


def test_the_object_appears_only_when_the_upload_completes(s3_store, s3, s3_prefix):
    bucket, name = s3_store.bucket, s3_prefix + "s.ssf"
    save(S3Sink(s3, bucket, name), COPYING(1), block_size=4096)
    old = object_bytes(s3, bucket, name)
    writer = SessionWriter(S3Sink(s3, bucket, name), COPYING(2), block_size=4096)
    for stage in (writer.plan, writer.create, writer.write, writer.flush):
        stage()
        assert object_bytes(s3, bucket, name) == old  # every part stored, none visible
    assert len(uploads_under(s3, bucket, s3_prefix)) == 1
    writer.rename()
    writer.sync_folder()
    new = object_bytes(s3, bucket, name)
    assert new != old and inspect(S3Source(s3, bucket, name)).payload_verified
    assert uploads_under(s3, bucket, s3_prefix) == []


# --- the pinned version ---------------------------------------------------------------------------------
@pytest.fixture
def two_versions(s3_store, s3, s3_prefix, tmp_path):
    """An object holding COPYING(1)'s session, and the bytes of another session to replace it with."""
    name = s3_prefix + "s.ssf"
    save(S3Sink(s3, s3_store.bucket, name), COPYING(1), block_size=4096)
    other = tmp_path / "other.ssf"
    save(other, COPYING(3), block_size=4096)
    return name, other.read_bytes()


@pytest.mark.parametrize("change", ["replaced", "deleted"])
def test_an_object_replaced_between_the_passes_is_refused_before_the_gate(s3_store, s3, two_versions, change):
    name, other = two_versions

    def between_passes(plan):
        if change == "replaced":
            s3.put_object(Bucket=s3_store.bucket, Key=name, Body=other)
        else:
            s3.delete_object(Bucket=s3_store.bucket, Key=name)

    target = COPYING(2)
    before = target.live_digest()
    with pytest.raises(E.ObjectReplaced) as info:
        restore(
            S3Source(s3, s3_store.bucket, name),
            recorder(target, {"check_plan": between_passes}),
            mode="streaming",
            block_size=4096,
        )
    assert info.value.reason == "object_replaced" and isinstance(info.value, E.FileChanged)
    assert not TOUCH & set(target.events) and target.live_digest() == before


def test_an_object_replaced_during_the_staged_pass_is_refused(s3_store, s3, two_versions):
    name, other = two_versions
    replaced = []

    def during(*args):
        if not replaced:
            replaced.append(s3.put_object(Bucket=s3_store.bucket, Key=name, Body=other))

    target = COPYING_STAGING(2)
    before = target.live_digest()
    with pytest.raises(E.ObjectReplaced):
        restore(
            S3Source(s3, s3_store.bucket, name),
            recorder(target, {"stage_in": during}),
            mode="staged",
            block_size=4096,
        )
    assert "discard_staged" in target.events and not LIVE_TOUCH & set(target.events)
    assert target.live_digest() == before


def test_an_object_replaced_during_the_apply_pass_fail_stops(s3_store, s3, two_versions):
    name, other = two_versions
    replaced = []

    def during(*args):
        if not replaced:
            replaced.append(s3.put_object(Bucket=s3_store.bucket, Key=name, Body=other))

    rec = recorder(COPYING(2), {"copy_in": during})
    with pytest.raises(E.FailStop) as info:
        restore(S3Source(s3, s3_store.bucket, name), rec, mode="streaming", block_size=4096, read_threads=1)
    assert info.value.cause_reason == "object_replaced"
    assert rec.calls.count("fail_stop") == 1 and "commit" not in rec.calls


# --- the store going away ---------------------------------------------------------------------------------
@pytest.mark.parametrize("when", ["before_gate", "after_gate"])
def test_the_store_stopped_mid_restore_is_a_named_error(own_s3_store, when):
    s3 = own_s3_store.client()
    bucket = own_s3_store.bucket
    save(S3Sink(s3, bucket, "s.ssf"), COPYING(1), block_size=4096)
    stopped = []

    def stop(*args):
        if not stopped:
            stopped.append(own_s3_store.kill())

    target = COPYING(2)
    before = target.live_digest()
    hooks = {"check_plan": stop} if when == "before_gate" else {"copy_in": stop}
    t0 = time.monotonic()
    with pytest.raises(E.SessionFileError) as info:
        restore(
            S3Source(s3, bucket, "s.ssf"),
            recorder(target, hooks),
            mode="streaming",
            block_size=4096,
            read_threads=1,
        )
    elapsed = time.monotonic() - t0
    if when == "before_gate":
        assert type(info.value) is E.StoreUnavailable and isinstance(info.value, E.ReadFailed)
        assert not TOUCH & set(target.events) and target.live_digest() == before
    else:
        assert type(info.value) is E.FailStop and info.value.cause_reason == "store_unavailable"
        assert target.events.count("fail_stop") == 1 and "commit" not in target.events
    assert elapsed < 60, f"the refusal took {elapsed:.0f} s"
    assert helpers_alive() == []


# --- saves that do not complete ---------------------------------------------------------------------------
class InterruptedSource(BigSource):
    """Raises KeyboardInterrupt (as Ctrl-C would) once ``after`` bytes were copied out."""

    def __init__(self, n_bytes: int, after: int) -> None:
        super().__init__(n_bytes)
        self.after, self.copied = after, 0

    def copy_out(self, layer, part, offset, dest) -> None:
        if self.copied >= self.after:
            raise KeyboardInterrupt
        super().copy_out(layer, part, offset, dest)
        self.copied += len(dest)


def test_an_interrupted_save_leaves_no_object_and_no_upload(s3_store, s3, s3_prefix):
    bucket, name = s3_store.bucket, s3_prefix + "s.ssf"
    with pytest.raises(KeyboardInterrupt):
        save(
            S3Sink(s3, bucket, name, part_size=PART),
            InterruptedSource(24 << 20, after=12 << 20),
            block_size=1 << 20,
        )
    assert not object_exists(s3, bucket, name) and uploads_under(s3, bucket, s3_prefix) == []
    assert helpers_alive() == []


def test_a_failing_part_upload_keeps_the_old_object_and_leaves_no_upload(s3_store, s3, s3_prefix):
    """Every part upload after the first fails (a ConnectionClosedError raised from botocore's own event hook):
    the save is refused, the upload aborted."""
    bucket, name = s3_store.bucket, s3_prefix + "s.ssf"
    save(S3Sink(s3, bucket, name), COPYING(1), block_size=4096)
    old = object_bytes(s3, bucket, name)
    failing = s3_store.client()

    def drop(params, **kw):
        if params["PartNumber"] > 1:
            raise botocore_exceptions.ConnectionClosedError(endpoint_url=s3_store.endpoint_url)

    failing.meta.events.register("provide-client-params.s3.UploadPart", drop)
    with pytest.raises(E.WriteFailed) as info:
        save(S3Sink(failing, bucket, name, part_size=PART), BigSource(16 << 20), block_size=1 << 20)
    assert "uploading part" in str(info.value) and info.value.path == f"s3://{bucket}/{name}"
    assert object_bytes(s3, bucket, name) == old and uploads_under(s3, bucket, s3_prefix) == []


KILLED_SAVE = r"""
import sys
from strata_sessionfile import save
from strata_sessionfile.objstore import S3Sink, s3_client
from strata_sessionfile.testing import PatternSource, fake_identity, synthetic_specs, tokens_for_bytes
endpoint, bucket, key = sys.argv[1:4]
specs = synthetic_specs(8, 4, 64)
slow = PatternSource(fake_identity(), specs, tokens_for_bytes(specs, 256 << 20), seed=1)
save(S3Sink(s3_client(endpoint), bucket, key, part_size=5 << 20), slow, block_size=1 << 20)
"""


def test_a_save_killed_mid_upload_never_shows_an_object_and_its_parts_are_aborted(s3_store, s3, s3_prefix):
    bucket, name = s3_store.bucket, s3_prefix + "s.ssf"
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_SAVE, s3_store.endpoint_url, bucket, name],
        env={**os.environ, **s3_store.env()},
    )
    try:
        deadline = time.monotonic() + 120
        parts = []
        while not parts and time.monotonic() < deadline and child.poll() is None:
            uploads = uploads_under(s3, bucket, s3_prefix)
            if uploads:
                parts = s3.list_parts(Bucket=bucket, Key=name, UploadId=uploads[0]["UploadId"]).get(
                    "Parts", []
                )
            time.sleep(0.05)
        assert parts, "the child stored no part before it ended"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    assert child.returncode == -signal.SIGKILL, "the save completed before the kill"
    assert not object_exists(s3, bucket, name)
    assert len(uploads_under(s3, bucket, s3_prefix)) == 1  # a killed process cannot abort its own upload
    assert objstore.abort_stale_uploads(s3, bucket, s3_prefix, older_than_s=0) == 1
    assert uploads_under(s3, bucket, s3_prefix) == [] and not object_exists(s3, bucket, name)


# --- authentication ---------------------------------------------------------------------------------------
@pytest.fixture
def authenticated_objects(s3_store, s3, s3_prefix, tmp_path):
    """name -> object key: the session written with KEY, without a key, with OTHER_KEY, and with KEY and a
    flipped MAC byte."""
    bucket = s3_store.bucket
    names = {}
    for label, key in (("mac", KEY), ("plain", None), ("other", OTHER_KEY)):
        names[label] = s3_prefix + f"{label}.ssf"
        save(S3Sink(s3, bucket, names[label]), COPYING(1), block_size=4096, key=key)
    flipped = bytearray(object_bytes(s3, bucket, names["mac"]))
    flipped[-9] ^= 1  # the MAC's last byte
    names["flipped"] = s3_prefix + "flipped.ssf"
    s3.put_object(Bucket=bucket, Key=names["flipped"], Body=bytes(flipped))
    return names


@pytest.mark.parametrize("mode,factory", [("streaming", COPYING), ("staged", COPYING_STAGING)])
def test_a_reader_with_a_key_refuses_what_the_key_did_not_authenticate_before_the_adapter(
    s3_store, s3, authenticated_objects, mode, factory
):
    bucket = s3_store.bucket
    target = factory(2)
    restore(S3Source(s3, bucket, authenticated_objects["mac"]), target, mode=mode, block_size=4096, key=KEY)
    assert target.live_digest() == COPYING(1).live_digest()
    for label, cls in (("plain", E.MacMissing), ("other", E.MacWrongKey), ("flipped", E.MacMismatch)):
        target = factory(2)
        before = target.live_digest()
        with pytest.raises(cls):
            restore(
                S3Source(s3, bucket, authenticated_objects[label]),
                target,
                mode=mode,
                block_size=4096,
                key=KEY,
            )
        assert not TOUCH & set(target.events), (label, target.events)  # K1-K3: nothing reached the adapter
        assert target.live_digest() == before
    # Without a key, every one of them restores (the MAC is not checked); told not to require one, a reader
    # with a key takes the file without a MAC and still checks the others.
    restore(S3Source(s3, bucket, authenticated_objects["flipped"]), factory(2), mode=mode, block_size=4096)
    restore(
        S3Source(s3, bucket, authenticated_objects["plain"]),
        factory(2),
        mode=mode,
        block_size=4096,
        key=KEY,
        require_mac=False,
    )
    with pytest.raises(E.MacWrongKey):
        restore(
            S3Source(s3, bucket, authenticated_objects["other"]),
            factory(2),
            mode=mode,
            block_size=4096,
            key=KEY,
            require_mac=False,
        )


def test_inspect_reads_an_object_and_verifies_its_mac(
    s3_store, authenticated_objects, tmp_path, monkeypatch, capsys
):
    for var, value in s3_store.env().items():
        monkeypatch.setenv(var, value)
    key_file = tmp_path / "session.key"
    key_file.write_bytes(bytes(range(32)))
    url = f"s3://{s3_store.bucket}/{authenticated_objects['mac']}"
    args = ["--endpoint-url", s3_store.endpoint_url, "--key-file", str(key_file)]
    assert main(["inspect", url, "--verify", *args]) == EXIT_VALID
    out = capsys.readouterr().out
    assert out.startswith(f"{url}: strata session file v1") and "MAC verified, payload digest verified" in out
    for label, reason in (("plain", "mac_missing"), ("other", "mac_wrong_key"), ("flipped", "mac_mismatch")):
        url = f"s3://{s3_store.bucket}/{authenticated_objects[label]}"
        assert main(["inspect", url, "--json", *args]) == EXIT_UNAUTHENTICATED
        assert json.loads(capsys.readouterr().out)["reason"] == reason
    missing = f"s3://{s3_store.bucket}/{authenticated_objects['mac']}.missing"
    assert main(["inspect", missing, "--json", "--endpoint-url", s3_store.endpoint_url]) == EXIT_UNREADABLE
    assert json.loads(capsys.readouterr().out)["reason"] == "not_found"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    assert main(["inspect", url, "--json", "--endpoint-url", s3_store.endpoint_url]) == EXIT_UNREADABLE
    assert json.loads(capsys.readouterr().out)["reason"] == "permission_denied"


# --- memory -----------------------------------------------------------------------------------------------
RSS_CHILD = r"""
import gc, json, sys
from strata_sessionfile import restore
from strata_sessionfile.objstore import S3Source, s3_client
from strata_sessionfile.testing import SinkTarget, fake_identity, synthetic_specs

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

endpoint, bucket, key = sys.argv[1:4]
client = s3_client(endpoint)
source = S3Source(client, bucket, key)  # a first request: boto3's service model is loaded before the baseline
target = SinkTarget(fake_identity(), synthetic_specs())
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current RSS
base = status("VmRSS")
report = restore(source, target, mode="streaming")
print(json.dumps({"base": base, "peak": status("VmHWM"), "received": target.received,
                  "n_tokens": report.n_tokens, "bytes_read": report.bytes_read}))
"""


@pytest.mark.slow
def test_a_1_gib_streaming_restore_from_the_store_grows_peak_rss_by_at_most_64_mib(s3_store, s3, s3_prefix):
    bucket, name = s3_store.bucket, s3_prefix + "big.ssf"
    specs = synthetic_specs()
    n_tokens = tokens_for_bytes(specs, 1 << 30)
    save(S3Sink(s3, bucket, name), PatternSource(fake_identity(), specs, n_tokens, seed=3))
    try:
        info = inspect(S3Source(s3, bucket, name), verify=False)
        assert info.layout.data_length >= (1 << 30) - (1 << 20)
        proc = subprocess.run(
            [sys.executable, "-c", RSS_CHILD, s3_store.endpoint_url, bucket, name],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, **s3_store.env()},
        )
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        growth = out["peak"] - out["base"]
        print(f"1 GiB restore from S3: peak RSS growth {growth / 2**20:.1f} MiB")
        assert out["received"] == info.layout.data_length and out["n_tokens"] == n_tokens
        assert out["bytes_read"] >= 2 * info.layout.data_length
        assert growth <= 64 << 20, f"peak RSS grew by {growth / 2**20:.1f} MiB"
    finally:
        s3.delete_object(Bucket=bucket, Key=name)
