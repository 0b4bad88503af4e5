"""The page's list of the fleet's bucket (store/remote.py, `RemoteTier.listed` and `summary`): what listing the
objects of one engine costs, and what reading one object's listing fields costs three ways, against a local
SeaweedFS (`weed mini`, strata_sessionfile.testing.s3server):

  * header: the chosen way, `summary` (S3Source's one ranged GET of the first 256 KiB, header and metadata
    parsed, the MAC checked): tokens and notes (title, messages), authenticated;
  * head: a HEAD of the object, as user metadata written at upload would be read (the fields themselves are not
    in it here: only the request's cost is measured);
  * whole: a GET of the whole object (what a listing without either would download).

--objects synthetic session files (a fake engine's layers, --tokens tokens, a title in their notes, MAC'd), each
uploaded under the catalog's key layout. Printed: the listing's time (first, then cached), the median ms per
object of each way, and a 20-object page read cold the chosen way (`summaries`: 8 at once).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/server/bench_catalog.py [--objects 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import strata_sessionfile as sf
from strata_server.store.names import Fingerprints, conversation_name
from strata_server.store.remote import RemoteSettings, RemoteTier
from strata_server.store.retitle import retitled
from strata_sessionfile.testing import fake_identity, memory_adapter_factory
from strata_sessionfile.testing.s3server import SeaweedS3

PAGE = 20


def median_ms(fn, items) -> float:
    times = []
    for item in items:
        t0 = time.perf_counter()
        fn(item)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--objects", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=2000)
    args = parser.parse_args()
    key = sf.SessionKey(bytes(range(32)))
    identity = fake_identity("bench-catalog")
    fingerprints = Fingerprints(identity.model.fingerprint.hex(), identity.config.fingerprint.hex())
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        s3 = SeaweedS3(tmp / "s3").start()
        try:
            os.environ.update(s3.env())
            tier = RemoteTier(RemoteSettings.parse(f"s3://{s3.bucket}/bench", s3.endpoint_url), key, True)
            client = s3.client()
            factory = memory_adapter_factory(n_tokens=args.tokens, identity=identity)
            sizes = []
            for seed in range(args.objects):
                plain, titled = tmp / "plain.ssf", tmp / "titled.ssf"
                sf.save(plain, factory(seed), key=key)
                retitled(plain, titled, f"Conversation {seed}", key, True)
                tokens = np.frombuffer(sf.inspect(titled, verify=False).metadata.state.tokens, dtype="<i4")
                object_key = tier.block_prefix(fingerprints, tokens) + conversation_name(fingerprints, tokens)
                client.upload_file(str(titled), s3.bucket, object_key)
                sizes.append(titled.stat().st_size)
            t0 = time.perf_counter()
            listed = tier.listed(fingerprints)
            first_ms = (time.perf_counter() - t0) * 1000
            t0 = time.perf_counter()
            tier.listed(fingerprints)
            cached_ms = (time.perf_counter() - t0) * 1000
            assert len(listed) == args.objects, len(listed)
            t0 = time.perf_counter()
            page = tier.summaries(listed[:PAGE], fingerprints)
            page_ms = (time.perf_counter() - t0) * 1000
            assert all(s is not None and s.notes is not None for s in page)
            rest = listed[PAGE:] or listed
            fresh = RemoteTier(tier.settings, key, True)  # nothing kept: each read is a request
            header = median_ms(lambda o: fresh.summary(o, fingerprints), rest)
            head = median_ms(lambda o: client.head_object(Bucket=s3.bucket, Key=o.key), rest)
            whole = median_ms(lambda o: client.get_object(Bucket=s3.bucket, Key=o.key)["Body"].read(), rest)
            print(
                f"{args.objects} objects of {statistics.median(sizes) / (1 << 20):.2f} MiB ({args.tokens} tokens)"
            )
            print(f"listing: {first_ms:.1f} ms, cached {cached_ms:.3f} ms")
            print(f"a {PAGE}-object page read cold (header): {page_ms:.1f} ms")
            print(f"per object, median ms: header {header:.2f}, head {head:.2f}, whole {whole:.2f}")
            tier.close(1.0)
            fresh.close(1.0)
        finally:
            s3.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
