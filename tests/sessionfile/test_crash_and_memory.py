"""A save killed with SIGKILL at random points leaves the old file or the complete new one, never a torn file
that validates; a restore of a 2 GiB session grows peak RSS by at most 64 MiB (measured in a child)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import xxhash
from strata_sessionfile import inspect, save
from strata_sessionfile.testing import PatternSource, fake_identity, synthetic_specs, tokens_for_bytes

CRASH_CHILD = r"""
import sys
from strata_sessionfile import save
from strata_sessionfile.testing import PatternSource, fake_identity, synthetic_specs
path, n_tokens = sys.argv[1], int(sys.argv[2])
specs = synthetic_specs(8, 4, 64)
sources = [PatternSource(fake_identity(), specs, n_tokens, seed=s) for s in (1, 2)]
print("ready", flush=True)
i = 1
while True:
    save(path, sources[i % 2], block_size=256 << 10)
    i += 1
"""


@pytest.mark.slow
def test_sigkill_during_saves_never_leaves_a_torn_file(tmp_path):
    specs = synthetic_specs(8, 4, 64)
    n_tokens = tokens_for_bytes(specs, 6 << 20)
    versions = {}
    for seed in (1, 2):
        p = tmp_path / f"v{seed}.ssf"
        save(p, PatternSource(fake_identity(), specs, n_tokens, seed=seed))
        versions[xxhash.xxh3_128_hexdigest(p.read_bytes())] = seed
    work = tmp_path / "work"
    work.mkdir()
    target = work / "session.ssf"
    shutil.copyfile(tmp_path / "v1.ssf", target)
    rng = random.Random(1234)
    seen = {1: 0, 2: 0}
    mid_save = 0
    kills = 20
    for _ in range(kills):
        child = subprocess.Popen(
            [sys.executable, "-c", CRASH_CHILD, str(target), str(n_tokens)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert child.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.0, 0.3))
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=30)
            child.stdout.close()
        assert child.returncode == -signal.SIGKILL
        digest = xxhash.xxh3_128_hexdigest(target.read_bytes())
        assert digest in versions, "the target is neither the old nor a complete new file"
        assert inspect(target).payload_verified
        seen[versions[digest]] += 1
        for (
            leftover
        ) in work.iterdir():  # a killed save may leave its temporary; never under the target's name
            if leftover.name != "session.ssf":
                assert leftover.name.startswith(".session.ssf.") and leftover.name.endswith(".strata-tmp")
                leftover.unlink()
                mid_save += 1
    print(f"SIGKILL x{kills}: old/new version found {seen}, killed mid-save {mid_save} times")
    assert seen[2] > 0, f"no save completed in {kills} runs: the test did not exercise anything ({seen})"
    assert mid_save > 0, "no kill landed inside a save"


RSS_CHILD = r"""
import gc, json, sys
from strata_sessionfile import restore
from strata_sessionfile.testing import SinkTarget, fake_identity, synthetic_specs

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

target = SinkTarget(fake_identity(), synthetic_specs())
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current RSS
base = status("VmRSS")
report = restore(sys.argv[1], target, mode=sys.argv[2])
print(json.dumps({"base": base, "peak": status("VmHWM"), "received": target.received,
                  "n_tokens": report.n_tokens, "bytes_read": report.bytes_read}))
"""


@pytest.mark.slow
def test_restore_of_a_2_gib_session_grows_peak_rss_by_at_most_64_mib(tmp_path):
    specs = synthetic_specs()
    n_tokens = tokens_for_bytes(specs, 2 << 30)
    path = tmp_path / "big.ssf"
    try:
        save(path, PatternSource(fake_identity(), specs, n_tokens, seed=3))
        info = inspect(path, verify=False)
        assert info.layout.data_length >= (2 << 30) - (1 << 20)
        proc = subprocess.run(
            [sys.executable, "-c", RSS_CHILD, str(path), "streaming"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        growth = out["peak"] - out["base"]
        print(f"2 GiB restore: peak RSS growth {growth / 2**20:.1f} MiB")
        assert out["received"] == info.layout.data_length and out["n_tokens"] == n_tokens
        assert out["bytes_read"] >= 2 * info.layout.data_length
        assert growth <= 64 << 20, f"peak RSS grew by {growth / 2**20:.1f} MiB"
    finally:
        if path.exists():
            path.unlink()


@pytest.mark.slow
def test_restore_of_a_compressed_512_mib_session_grows_peak_rss_by_at_most_64_mib(tmp_path):
    """Frames are decoded one block at a time: the decoded block, two frame buffers and the decoder's state."""
    specs = synthetic_specs()
    n_tokens = tokens_for_bytes(specs, 512 << 20)
    path = tmp_path / "big-zstd.ssf"
    try:
        save(path, PatternSource(fake_identity(), specs, n_tokens, seed=3), compression="zstd")
        info = inspect(path, verify=False)
        assert info.layout.compressed is not None and info.layout.data_length >= (512 << 20) - (1 << 20)
        proc = subprocess.run(
            [sys.executable, "-c", RSS_CHILD, str(path), "streaming"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        growth = out["peak"] - out["base"]
        print(
            f"512 MiB compressed restore ({info.layout.file_size / 2**20:.0f} MiB file): peak RSS growth "
            f"{growth / 2**20:.1f} MiB"
        )
        assert out["received"] == info.layout.data_length and out["n_tokens"] == n_tokens
        assert growth <= 64 << 20, f"peak RSS grew by {growth / 2**20:.1f} MiB"
    finally:
        if path.exists():
            path.unlink()
