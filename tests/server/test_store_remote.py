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
