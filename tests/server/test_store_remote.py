"""The object store's tier at start-up, against a real SeaweedFS: the unfinished multipart uploads under the
store's prefix older than the age limit (a killed server's parts) are aborted; younger ones (a live server's
save) and those outside the prefix are left alone."""

from __future__ import annotations

import time

import pytest
from strata_server.store.remote import STALE_UPLOAD_AGE_S, RemoteSettings, RemoteTier
from support.s3 import start_seaweed

pytestmark = [pytest.mark.slow]


def unfinished(client, bucket: str) -> set[str]:
    return {u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])}


def wait_for(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One SeaweedFS for the module's tests (its start is most of their time)."""
    seaweed = start_seaweed(tmp_path_factory.mktemp("s3"))
    yield seaweed
    seaweed.stop()


def test_stale_multipart_uploads_under_the_prefix_are_aborted_at_start(store, monkeypatch):
    for name, value in store.env().items():
        monkeypatch.setenv(name, value)
    client = store.client()
    for key in ("fleet/m/c/b/killed.ssf", "other/m/c/b/elsewhere.ssf"):
        client.create_multipart_upload(Bucket=store.bucket, Key=key)
    assert unfinished(client, store.bucket) == {"fleet/m/c/b/killed.ssf", "other/m/c/b/elsewhere.ssf"}

    # The default age: a fresh upload may be a live server's save; nothing is aborted.
    young = RemoteTier(RemoteSettings.parse(f"s3://{store.bucket}/fleet", store.endpoint_url), None, False)
    assert young.settings.stale_upload_age_s == STALE_UPLOAD_AGE_S >= 600
    time.sleep(2.0)
    young.close(1.0)
    assert unfinished(client, store.bucket) == {"fleet/m/c/b/killed.ssf", "other/m/c/b/elsewhere.ssf"}

    time.sleep(1.1)  # every upload is now older than one second
    settings = RemoteSettings(store.bucket, "fleet", store.endpoint_url, stale_upload_age_s=1.0)
    tier = RemoteTier(settings, None, False)
    assert wait_for(lambda: unfinished(client, store.bucket) == {"other/m/c/b/elsewhere.ssf"})
    tier.close(1.0)


def test_an_object_refused_for_its_mac_is_counted_refused_not_missed(store, tmp_path, monkeypatch):
    """An object under the prompt's first block whose MAC is of another key: never a candidate, and the
    lookup says it refused one (the store counts the lookup `refused`, not `miss`); its bad file counted once."""
    import numpy as np
    import strata_sessionfile as sf
    from strata_server.store.names import Fingerprints, conversation_name
    from strata_sessionfile.testing import fake_identity, memory_adapter_factory

    for name, value in store.env().items():
        monkeypatch.setenv(name, value)
    identity = fake_identity("ours")
    fingerprints = Fingerprints(identity.model.fingerprint.hex(), identity.config.fingerprint.hex())
    path = tmp_path / "other-key.ssf"
    adapter = memory_adapter_factory(n_tokens=300, identity=identity)(1)
    sf.save(path, adapter, key=sf.SessionKey(bytes(range(32))))
    tokens = np.frombuffer(sf.inspect(path).metadata.state.tokens, dtype="<i4")
    settings = RemoteSettings.parse(f"s3://{store.bucket}/fleet", store.endpoint_url)
    tier = RemoteTier(settings, sf.SessionKey(bytes(range(1, 33))), True)
    key = tier.block_prefix(fingerprints, tokens) + conversation_name(fingerprints, tokens)
    store.client().upload_file(str(path), store.bucket, key)
    for _ in range(2):  # the second lookup remembers the refusal
        search = tier.best(tokens, fingerprints, 1)
        assert search.candidate is None and search.refused == 1
    assert dict(tier.metrics.bad_files) == {"mac_wrong_key": 1}
    tier.close(1.0)


def test_the_catalog_lists_this_engines_objects_and_reads_each_version_once(store, tmp_path, monkeypatch):
    """The page's list of the bucket: every object of this engine (model and config) newest first from one
    cached listing, another engine's left out; each object's tokens and notes read from its header once per
    version (a rename, a new ETag, is read again); one whose MAC is of another key is refused."""
    import numpy as np
    import strata_sessionfile as sf
    from strata_server.store import remote as remote_module
    from strata_server.store.names import Fingerprints, conversation_name
    from strata_server.store.retitle import retitled
    from strata_sessionfile.testing import fake_identity, memory_adapter_factory

    for name, value in store.env().items():
        monkeypatch.setenv(name, value)
    ours, other_key = sf.SessionKey(bytes(range(32))), sf.SessionKey(bytes(range(1, 33)))
    identity = fake_identity("catalog")
    fingerprints = Fingerprints(identity.model.fingerprint.hex(), identity.config.fingerprint.hex())
    tier = RemoteTier(RemoteSettings.parse(f"s3://{store.bucket}/catalog", store.endpoint_url), ours, True)
    client = store.client()

    def put(seed: int, key: sf.SessionKey, ident=identity, title: str | None = None) -> str:
        path = tmp_path / f"{seed}.ssf"
        sf.save(path, memory_adapter_factory(n_tokens=300, identity=ident)(seed), key=key)
        if title is not None:
            titled = tmp_path / f"{seed}-titled.ssf"
            retitled(path, titled, title, key, True)
            path = titled
        tokens = np.frombuffer(sf.inspect(path, verify=False).metadata.state.tokens, dtype="<i4")
        fp = Fingerprints(ident.model.fingerprint.hex(), ident.config.fingerprint.hex())
        object_key = tier.block_prefix(fp, tokens) + conversation_name(fp, tokens)
        client.upload_file(str(path), store.bucket, object_key)
        time.sleep(1.05)  # LastModified has whole seconds: each object newer than the last
        return object_key

    plain = put(1, ours)
    titled = put(2, ours, title="Boxes & shelves")
    put(3, ours, ident=fake_identity("another model"))
    forged = put(4, other_key)
    listed = tier.listed(fingerprints)
    assert [o.key for o in listed] == [forged, titled, plain]
    assert all(
        o.nbytes == client.head_object(Bucket=store.bucket, Key=o.key)["ContentLength"] for o in listed
    )

    gets = []
    real_get = tier.client.get_object
    monkeypatch.setattr(tier.client, "get_object", lambda **kw: gets.append(kw["Key"]) or real_get(**kw))
    summaries = [tier.summary(o, fingerprints) for o in listed]
    assert summaries[0] is None  # another key's MAC
    assert summaries[1].notes.title == "Boxes & shelves" and summaries[2].notes is None
    assert len(summaries[2].tokens) == sf.inspect(tmp_path / "1.ssf", verify=False).metadata.state.n_tokens
    assert sorted(gets) == sorted([forged, titled, plain])  # one ranged GET each (the header is small)
    again = [tier.summary(o, fingerprints) for o in listed]
    assert all(a is b for a, b in zip(again, summaries, strict=True)) and len(gets) == 3  # kept, not read

    # A new object is not listed until the listing's time is up (one listing serves every request meanwhile).
    newer = put(5, ours)
    assert newer not in [o.key for o in tier.listed(fingerprints)]
    monkeypatch.setattr(remote_module, "CATALOG_TTL_S", 0.0)
    assert tier.listed(fingerprints)[0].key == newer

    # A rename of another server's (the same key written again): a new version, read again.
    renamed = put(2, ours, title="Renamed")
    assert renamed == titled
    (again,) = [o for o in tier.listed(fingerprints) if o.key == titled]
    assert again.etag != listed[1].etag
    assert tier.summary(again, fingerprints).notes.title == "Renamed"
    assert tier.summary(listed[1], fingerprints).notes.title == "Boxes & shelves"  # that version's, kept
    tier.close(1.0)
