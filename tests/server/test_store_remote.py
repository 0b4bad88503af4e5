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


def test_stale_multipart_uploads_under_the_prefix_are_aborted_at_start(tmp_path, monkeypatch):
    store = start_seaweed(tmp_path)
    try:
        for name, value in store.env().items():
            monkeypatch.setenv(name, value)
        client = store.client()
        for key in ("fleet/m/c/b/killed.ssf", "other/m/c/b/elsewhere.ssf"):
            client.create_multipart_upload(Bucket=store.bucket, Key=key)
        assert unfinished(client, store.bucket) == {"fleet/m/c/b/killed.ssf", "other/m/c/b/elsewhere.ssf"}

        # The default age: a fresh upload may be a live server's save; nothing is aborted.
        young = RemoteTier(
            RemoteSettings.parse(f"s3://{store.bucket}/fleet", store.endpoint_url), None, False
        )
        assert young.settings.stale_upload_age_s == STALE_UPLOAD_AGE_S >= 600
        time.sleep(2.0)
        young.close(1.0)
        assert unfinished(client, store.bucket) == {"fleet/m/c/b/killed.ssf", "other/m/c/b/elsewhere.ssf"}

        time.sleep(1.1)  # every upload is now older than one second
        settings = RemoteSettings(store.bucket, "fleet", store.endpoint_url, stale_upload_age_s=1.0)
        tier = RemoteTier(settings, None, False)
        assert wait_for(lambda: unfinished(client, store.bucket) == {"other/m/c/b/elsewhere.ssf"})
        tier.close(1.0)
    finally:
        store.stop()
