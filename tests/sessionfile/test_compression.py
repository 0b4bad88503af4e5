"""Compressed data sections (spec 3.3): round trips in both restore modes and any block size, the options,
refusals without zstandard (simulated by hiding the import), every compressed bad file refused before the
gate, a zip bomb refused without allocating, the RAM preflight, truncation/flip/hypothesis robustness and
the conformance kit on compressed files, and the CLI."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strata_sessionfile import BlockBuffers, Compression, inspect, restore, save
from strata_sessionfile import errors as E
from strata_sessionfile.cli import EXIT_INVALID, EXIT_UNSUPPORTED, EXIT_VALID, main
from strata_sessionfile.format import Flags
from strata_sessionfile.testing import memory_adapter_factory, run_conformance

from . import golden
from .helpers import LIVE_TOUCH, SMALL, check_refused_cleanly, files_in, mutate, restore_invariant

ZSTD = Compression("zstd", level=3)
COMPRESSED_BAD = sorted(
    n for n in json.loads((golden.BAD_DIR / "expected.json").read_text()) if n.startswith("zstd_")
)


@pytest.fixture
def no_zstd(monkeypatch):
    """zstandard not installed: `import zstandard` raises ImportError."""
    monkeypatch.setitem(sys.modules, "zstandard", None)


@pytest.fixture(scope="module")
def zfile(tmp_path_factory):
    """A compressed copy of the robustness tests' session (several frames) and its bytes."""
    path = tmp_path_factory.mktemp("z") / "z.ssf"
    save(path, SMALL(1), block_size=4096, compression=ZSTD)
    return path, path.read_bytes()


# --- round trips --------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["streaming", "staged"])
@pytest.mark.parametrize("save_block,restore_block", [(4096, 4096), (4096, 1 << 20), (12288, 4096)])
def test_round_trip_any_block_sizes(tmp_path, factory, staging_factory, mode, save_block, restore_block):
    plain, packed, again = tmp_path / "plain.ssf", tmp_path / "packed.ssf", tmp_path / "again.ssf"
    save(plain, factory(1), block_size=save_block)
    report = save(packed, factory(1), block_size=save_block, compression=ZSTD)
    assert report.compression == "zstd" and report.bytes_written == packed.stat().st_size
    assert report.kv_bytes == inspect(plain).layout.data_length
    info = inspect(packed)
    assert info.header.flags == Flags.DATA_COMPRESSED and info.layout.compressed.block_size == save_block
    assert info.metadata == inspect(plain).metadata
    target = (staging_factory if mode == "staged" else factory)(2)
    rr = restore(packed, target, mode=mode, block_size=restore_block)
    assert rr.mode == mode and rr.file_size == packed.stat().st_size
    size = packed.stat().st_size
    assert rr.bytes_read == (size if mode == "staged" else 2 * size - 64)  # the apply pass skips the header
    save(again, target, block_size=save_block)
    assert again.read_bytes() == plain.read_bytes()  # the same session as the uncompressed save holds
    assert files_in(tmp_path) == ["again.ssf", "packed.ssf", "plain.ssf"]


def test_compressed_file_is_smaller_for_compressible_data_and_save_options(tmp_path, factory):
    a = save(tmp_path / "a.ssf", factory(1), block_size=4096)
    b = save(tmp_path / "b.ssf", factory(1), block_size=4096, compression="zstd")
    c = save(tmp_path / "c.ssf", factory(1), block_size=4096, compression=Compression(level=19, threads=2))
    assert b.bytes_written < a.bytes_written / 4  # MemoryAdapter parts are a 16-byte pattern repeated
    assert c.bytes_written < a.bytes_written / 4 and inspect(tmp_path / "c.ssf").layout.compressed.level == 19
    target = factory(2)
    restore(tmp_path / "c.ssf", target, block_size=4096)  # zstd worker threads write ordinary frames
    save(tmp_path / "again.ssf", target, block_size=4096)
    assert (tmp_path / "again.ssf").read_bytes() == (tmp_path / "a.ssf").read_bytes()
    assert save(tmp_path / "d.ssf", factory(1), block_size=4096, compression="none").compression is None
    for bad in (dict(level=23), dict(level=-(1 << 18)), dict(codec="lz4"), dict(threads=-2)):
        with pytest.raises(ValueError):
            Compression(**bad)
    with pytest.raises(TypeError):
        save(tmp_path / "e.ssf", factory(1), compression=3)
    with pytest.raises(ValueError):
        save(tmp_path / "e.ssf", factory(1), compression="zstd", block_size=128 << 20)
    assert not (tmp_path / "e.ssf").exists()
    (tmp_path / "again.ssf").unlink()


def test_caller_buffers_smaller_than_a_frame_are_not_used(tmp_path, factory):
    p = tmp_path / "z.ssf"
    save(p, factory(1), block_size=65536, compression=ZSTD)
    small = BlockBuffers(4096)  # cannot hold one frame: the reader maps its own
    target = factory(2)
    restore(p, target, mode="streaming", buffers=small, block_size=4096)
    save(tmp_path / "again.ssf", target, block_size=65536, compression=ZSTD)
    assert (tmp_path / "again.ssf").read_bytes() == p.read_bytes()


def test_empty_session_compressed(tmp_path):
    path = golden.GOLDEN_DIR / "empty_zstd.ssf"
    info = inspect(path)
    assert info.layout.compressed.n_blocks == 0 and info.layout.data_length == 0 and info.payload_verified


# --- without zstandard ----------------------------------------------------------------------------------
def test_without_zstandard_a_compressed_file_is_refused_by_name(no_zstd, tmp_path, capsys):
    path = golden.GOLDEN_DIR / "kv_f16_zstd.ssf"
    for mode in ("streaming", "staged"):
        target = golden.golden_adapter("kv_f16_zstd", staging=mode == "staged")
        before = target.live_digest()
        with pytest.raises(E.CompressionUnavailable, match=r"strata-sessionfile\[zstd\]"):
            restore(path, target, mode=mode, block_size=4096)
        assert target.events == [] and target.live_digest() == before
    with pytest.raises(E.CompressionUnavailable):
        inspect(path)
    info = inspect(path, verify=False)  # everything but the frames can still be read and validated
    assert info.layout.compressed.n_blocks == 4
    assert main(["inspect", str(path), "--verify", "--json"]) == EXIT_UNSUPPORTED
    assert json.loads(capsys.readouterr().out)["reason"] == "compression_unavailable"
    assert main(["inspect", str(path)]) == EXIT_VALID
    small = golden.golden_adapter("small_f16")
    before = small.live_digest()
    small.load_snapshot(small.snapshot(), seed=9)  # other K/V bytes: the restore must bring the file's back
    restore(
        golden.GOLDEN_DIR / "small_f16.ssf", small, block_size=4096
    )  # uncompressed files need no zstandard
    assert small.live_digest() == before


def test_without_zstandard_a_compressed_save_keeps_the_old_file(no_zstd, tmp_path, factory):
    target = tmp_path / "s.ssf"
    target.write_bytes(b"old")
    with pytest.raises(E.CompressionUnavailable):
        save(target, factory(1), compression="zstd")
    assert target.read_bytes() == b"old" and files_in(tmp_path) == ["s.ssf"]


# --- bad compressed files: refused before the gate ------------------------------------------------------
@pytest.mark.parametrize("name", COMPRESSED_BAD)
@pytest.mark.parametrize("mode", ["streaming", "staged"])
def test_compressed_bad_files_are_refused_before_the_gate(name, mode):
    target = golden.golden_adapter("kv_f16_zstd", staging=mode == "staged")
    before = target.live_digest()
    reason = json.loads((golden.BAD_DIR / "expected.json").read_text())[name]
    with pytest.raises(E.SessionFileError) as info:
        restore(golden.BAD_DIR / name, target, mode=mode, block_size=4096)
    assert info.value.reason == reason, info.value
    assert not LIVE_TOUCH & set(target.events) and target.live_digest() == before


ZIP_BOMB_CHILD = r"""
import json, sys
from strata_sessionfile import EngineIdentity, errors as E, inspect, restore
from strata_sessionfile.testing import MemoryAdapter
meta = inspect(sys.argv[1], verify=False).metadata  # the frames are not decoded without --verify
target = MemoryAdapter(EngineIdentity(meta.model, meta.config), [g.spec for g in meta.layers], max_tokens=64)
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")
base = status("VmRSS")
try:
    restore(sys.argv[1], target, block_size=4096)
    reason = None
except E.SessionFileError as exc:
    reason = exc.reason
print(json.dumps({"reason": reason, "growth": status("VmHWM") - base}))
"""


def test_zip_bomb_frame_is_refused_without_allocating(tmp_path):
    """A 2 KB frame that declares (and would decode to) 64 MiB of zeros where the block holds 4 KiB."""
    import zstandard

    data, _ = golden.golden_bytes("kv_f16_zstd")
    head, frames, _table = golden.zstd_split(data)
    bomb = zstandard.ZstdCompressor(level=3).compress(bytes(64 << 20))
    assert len(bomb) < 4096
    path = tmp_path / "bomb.ssf"
    path.write_bytes(golden.zstd_rebuild(head, [frames[0], bomb, *frames[2:]]))
    proc = subprocess.run(
        [sys.executable, "-c", ZIP_BOMB_CHILD, str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["reason"] == "decompressed_size_mismatch"
    assert out["growth"] < 16 << 20, f"peak RSS grew by {out['growth'] / 2**20:.1f} MiB"


def test_preflight_counts_the_decompression_buffers(tmp_path, factory):
    plain, packed = tmp_path / "plain.ssf", tmp_path / "packed.ssf"
    save(plain, factory(1), block_size=1 << 20)
    save(packed, factory(1), block_size=1 << 20, compression=ZSTD)  # one 1 MiB block (the session is ~100 KB)
    have = 1 << 20  # enough for two 64 KiB read buffers, not for a 1 MiB block decoded
    restore(plain, factory(2), block_size=65536, memory_available=lambda: have)
    data_length = inspect(packed).layout.data_length
    assert data_length < have
    target = factory(2)
    with pytest.raises(E.InsufficientMemory):
        restore(packed, target, block_size=65536, memory_available=lambda: have)
    assert target.events == []


# --- robustness on compressed files ---------------------------------------------------------------------
def test_truncation_and_header_flips_compressed(zfile, tmp_path):
    path, data = zfile
    comp = inspect(path).layout.compressed
    assert comp.n_blocks >= 3
    cuts = {
        0,
        63,
        64,
        comp.header_offset,
        comp.frames_offset - 1,
        comp.frames_offset,
        comp.table_offset,
        len(data) - 25,
        len(data) - 1,
    }
    cuts |= {o for o, _n in comp.frames()} | {o + n // 2 for o, n in comp.frames()}
    rng = random.Random(11)
    cuts |= {rng.randrange(len(data)) for _ in range(40)}
    bad = tmp_path / "t.ssf"
    for cut in sorted(cuts):
        bad.write_bytes(data[:cut])
        check_refused_cleanly(bad, expected=E.Truncated)
    for off in range(64):
        b = bytearray(data)
        b[off] ^= 0xFF
        bad.write_bytes(bytes(b))
        check_refused_cleanly(bad)


def test_every_compression_header_and_table_byte_flipped_with_hashes_refreshed(zfile, tmp_path):
    """Hashes refreshed, so only the Z rules can catch it: each flip is refused, never applied."""
    path, data = zfile
    comp = inspect(path).layout.compressed
    bad = tmp_path / "f.ssf"
    offsets = list(range(comp.header_offset, comp.header_offset + 16)) + list(
        range(comp.table_offset, comp.table_offset + 4 * comp.n_blocks)
    )
    for off in offsets:
        if comp.header_offset + 4 <= off < comp.header_offset + 8:
            continue  # the level is informative (checked below)
        b = bytearray(data)
        b[off] ^= 0x01
        bad.write_bytes(golden.refresh(b))
        check_refused_cleanly(bad)
        check_refused_cleanly(bad, staging=True)
    b = bytearray(data)
    b[comp.header_offset + 4] ^= 0x01  # another level: still valid, the same session
    bad.write_bytes(golden.refresh(b))
    restore(bad, SMALL(2), block_size=4096)


@settings(
    max_examples=400,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["flip", "flip", "u32", "u64", "insert", "delete"]),
            st.integers(min_value=4096, max_value=1 << 16),
            st.integers(min_value=0, max_value=(1 << 64) - 1),
        ),
        min_size=1,
        max_size=3,
    ),
    rehash=st.booleans(),
    staging=st.booleans(),
)
def test_random_mutations_of_compressed_files(zfile, tmp_path, ops, rehash, staging):
    """Mutations in the compressed data section (frames, table): only SessionFileErrors, nothing applied early."""
    _path, data = zfile
    bad = tmp_path / "m.ssf"
    mutated = mutate(data, ops, rehash)
    if bad.exists():
        bad.unlink()
    bad.write_bytes(mutated)
    accepted = restore_invariant(bad, staging)
    if mutated != data and not rehash:
        assert not accepted


@pytest.mark.parametrize("staging", [False, True])
def test_conformance_kit_on_compressed_files(tmp_path, staging):
    factory = memory_adapter_factory(n_tokens=200, staging=staging)
    ran = run_conformance(factory, tmp_path, compression=ZSTD, random_truncations=8, random_flips=24)
    assert {"round_trip", "truncation", "payload_flips", "gate_before", "gate_after"} <= set(ran)
    assert inspect(tmp_path / "good.ssf").layout.compressed is not None


def test_gate_after_a_frame_changes_during_the_apply_pass(zfile, tmp_path):
    """A frame rewritten (same size, mtime kept) after the first applied block: fail-stop, no commit."""
    _path, data = zfile
    p = tmp_path / "c.ssf"
    p.write_bytes(data)
    comp = inspect(p).layout.compressed
    last_offset, last_size = list(comp.frames())[-1]
    target = SMALL(2)
    cls = type(target)

    def copy_in(*a):
        if target.events.count("copy_in") == 0:
            st_before = os.stat(p)
            with open(p, "r+b") as f:
                f.seek(last_offset + last_size // 2)
                byte = f.read(1)
                f.seek(last_offset + last_size // 2)
                f.write(bytes([byte[0] ^ 0x10]))
            os.utime(p, ns=(st_before.st_atime_ns, st_before.st_mtime_ns))
        cls.copy_in(target, *a)

    target.copy_in = copy_in
    with pytest.raises(E.FailStop) as exc:
        restore(p, target, block_size=4096, mode="streaming")
    assert exc.value.cause_reason in (
        "payload_corrupt",
        "file_changed",
        "frame_corrupt",
        "decompressed_size_mismatch",
    )
    assert target.events.count("fail_stop") == 1 and "commit" not in target.events


# --- CLI ------------------------------------------------------------------------------------------------
def test_cli_shows_the_compression(capsys):
    path = golden.GOLDEN_DIR / "kv_f16_zstd.ssf"
    assert main(["inspect", str(path), "--verify"]) == EXIT_VALID
    out = capsys.readouterr().out
    assert (
        "compression         zstd level 3, 4 blocks of 4,096 bytes (4.10 kB); 7,423 bytes (7.42 kB) stored for "
        "12,800 bytes (12.8 kB) of K/V (ratio 0.580)\n"
    ) in out and "(verified)" in out
    assert main(["inspect", str(path), "--json"]) == EXIT_VALID
    d = json.loads(capsys.readouterr().out)
    expected = json.loads(path.with_suffix(".json").read_text())["compression"]
    assert d["compression"]["codec"] == "zstd" and d["compression"]["n_blocks"] == expected["n_blocks"]
    assert d["compression"]["frames_bytes"] == sum(expected["frame_sizes"])
    assert d["sections"]["kv_bytes"] == 12800 and d["header"]["flags"] == 1
    assert main(["inspect", str(golden.GOLDEN_DIR / "small_f16.ssf"), "--json"]) == EXIT_VALID
    assert json.loads(capsys.readouterr().out)["compression"] is None
    assert main(["inspect", str(golden.BAD_DIR / "zstd_bad_frame.ssf"), "--verify"]) == EXIT_INVALID
    assert "invalid (frame_corrupt)" in capsys.readouterr().err


# --- faults during a compressed save --------------------------------------------------------------------
@pytest.mark.parametrize("where", ["prefix", "frame", "table", "header", "encoder"])
def test_failures_during_a_compressed_save_keep_the_old_file(tmp_path, factory, monkeypatch, where):
    import errno

    from strata_sessionfile import _fileio
    from strata_sessionfile import compression as C

    path = tmp_path / "s.ssf"
    save(path, factory(1), block_size=4096, compression=ZSTD)
    old = path.read_bytes()
    real_write = _fileio.write
    writes = []

    def write(fd, data):
        writes.append(len(data))
        n_frames_done = len(writes) - 1
        if (
            (where == "prefix" and len(writes) == 1)
            or (where == "frame" and n_frames_done == 3)
            or (where == "table" and len(data) == 4 * (len(writes) - 2))
        ):  # after the prefix and every frame
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    def pwrite(fd, data, offset):
        raise OSError(errno.EIO, "Input/output error")

    def encoder(options):
        def encode(view):
            raise MemoryError("out of memory in the encoder")

        return encode

    monkeypatch.setattr(_fileio, "write", write)
    if where == "header":
        monkeypatch.setattr(_fileio, "pwrite", pwrite)
    if where == "encoder":
        monkeypatch.setattr(C.ZstdCodec, "encoder", staticmethod(encoder))
    expected = {"header": E.WriteFailed, "encoder": MemoryError}.get(where, E.NoSpace)
    with pytest.raises(expected):
        save(path, factory(2), block_size=4096, compression=ZSTD)
    assert path.read_bytes() == old and files_in(tmp_path) == ["s.ssf"]


def test_several_decode_workers_keep_file_order_and_errors(tmp_path, factory, monkeypatch):
    """With frames decoded concurrently, blocks still arrive in file order and a bad frame is raised in order."""
    from strata_sessionfile import pipelines

    monkeypatch.setattr(pipelines, "MAX_DECODE_WORKERS", 3)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert pipelines.decode_workers() == 3
    path = tmp_path / "z.ssf"
    save(path, factory(1), block_size=4096, compression=ZSTD)
    for mode, fac in (("streaming", factory), ("staged", memory_adapter_factory(n_tokens=200, staging=True))):
        target = fac(2)
        restore(path, target, mode=mode, block_size=4096)
        save(tmp_path / "again.ssf", target, block_size=4096, compression=ZSTD)
        assert (tmp_path / "again.ssf").read_bytes() == path.read_bytes()
    target = golden.golden_adapter("kv_f16_zstd")
    with pytest.raises(E.FrameCorrupt) as info:
        restore(golden.BAD_DIR / "zstd_bad_frame.ssf", target, block_size=4096)
    assert info.value.field == "frames[1]" and target.events == []
