"""spec/golden and spec/bad: every golden file decodes to its JSON and re-encodes byte for byte; every bad
file raises exactly its named error; both sets are reproducible from tests/sessionfile/golden.py."""

from __future__ import annotations

import hashlib
import hmac
import json

import pytest
from strata_sessionfile import errors as E
from strata_sessionfile import inspect, restore, save
from strata_sessionfile.format import Part
from strata_sessionfile.testing import MemoryAdapter

from . import golden

GOLDEN = sorted(golden.golden_sessions())
BAD = json.loads((golden.BAD_DIR / "expected.json").read_text())


def _skip_if_another_libzstd(name: str) -> None:
    """A compressed golden file's bytes are libzstd's output: byte equality holds for the libzstd that wrote it.
    (Decoding does not depend on it and is checked whatever the version.)"""
    if name in golden.GOLDEN_COMPRESSION:
        wrote = json.loads((golden.GOLDEN_DIR / f"{name}.json").read_text())["compression"]["libzstd"]
        if wrote != golden.zstd_version():
            pytest.skip(f"{name} was written by libzstd {wrote}; this is {golden.zstd_version()}")


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_file_is_reproducible(name):
    _skip_if_another_libzstd(name)
    data, expected = golden.golden_bytes(name)
    assert (golden.GOLDEN_DIR / f"{name}.ssf").read_bytes() == data
    assert json.loads((golden.GOLDEN_DIR / f"{name}.json").read_text()) == expected


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_file_decodes_to_its_json(name):
    path = golden.GOLDEN_DIR / f"{name}.ssf"
    expected = json.loads((golden.GOLDEN_DIR / f"{name}.json").read_text())
    key = golden.GOLDEN_KEYS.get(name)
    info = inspect(path, key=key)
    assert info.payload_verified and info.mac_verified == (key is not None) == info.authenticated
    if key is not None:  # the extension is what section 4.1 computes from the file's own bytes and the key
        data = path.read_bytes()
        tail = golden.trailer_start(data)
        auth = expected["authentication"]
        assert auth["key_id"] == key.key_id.hex() == data[tail + 16 : tail + 32].hex()
        assert (
            auth["payload_digest"]
            == hashlib.sha256(data[64:tail]).hexdigest()
            == data[tail + 32 : tail + 64].hex()
        )
        assert (
            auth["mac"]
            == hmac.new(
                bytes(range(32)), b"strata-session-mac-v1\0" + data[:64] + data[tail : tail + 64], "sha256"
            ).hexdigest()
            == data[tail + 64 : tail + 96].hex()
        )
    else:
        assert "authentication" not in expected
    assert info.layout.file_size == expected["file_size"] == path.stat().st_size
    h = expected["header"]
    assert info.header.flags == h["flags"]
    comp = info.layout.compressed
    if "compression" in expected:
        c = expected["compression"]
        assert comp is not None and comp.codec.name.lower() == c["codec"] and comp.level == c["level"]
        assert (comp.block_size, comp.n_blocks, list(comp.frame_sizes)) == (
            c["block_size"],
            c["n_blocks"],
            c["frame_sizes"],
        )
    else:
        assert comp is None
    assert info.header.model_fingerprint.hex() == h["model_fingerprint"]
    assert info.header.config_fingerprint.hex() == h["config_fingerprint"]
    assert info.header.payload_length == h["payload_length"]
    assert f"{info.header.header_hash:016x}" == h["header_hash"]
    assert info.payload_hash.hex() == expected["payload_hash"]
    md = info.metadata
    assert md.config.mapping == expected["config"]
    assert [(f.role, f.size, f.digest.hex()) for f in md.model.files] == [
        (f["role"], f["size"], f["digest"]) for f in expected["model_files"]
    ]
    st = expected["state"]
    assert list(md.state.tokens) == st["tokens"]
    assert md.state.position == st["position"]
    assert md.state.sampler_state.hex() == st["sampler_state"]
    assert md.state.checkpoint.token_index == st["checkpoint"]["token_index"]
    assert md.state.checkpoint.data.hex() == st["checkpoint"]["data"]
    assert md.state.engine_fields.hex() == st["engine_fields"]
    assert len(md.layers) == len(expected["layers"])
    data = path.read_bytes() if comp is None else _decompressed_data(path, info.layout)
    extents = {(e.layer, e.part): e for e in info.layout.extents}
    for li, (g, want) in enumerate(zip(md.layers, expected["layers"], strict=True)):
        assert g.spec.index == want["index"] and g.spec.role.name.lower() == want["role"]
        assert (g.spec.n_kv_heads, g.spec.head_dim_k, g.spec.head_dim_v) == (
            want["n_kv_heads"],
            want["head_dim_k"],
            want["head_dim_v"],
        )
        assert (g.spec.k_dtype.name.lower(), g.spec.v_dtype.name.lower()) == (
            want["k_dtype"],
            want["v_dtype"],
        )
        assert (g.spec.window, g.tokens_held, g.spec.extra_bytes) == (
            want["window"],
            want["tokens_held"],
            want["extra_bytes"],
        )
        for part in Part:
            hexed = want["parts"][part.name.lower()]
            ext = extents.get((li, part))
            start = ext.data_offset + (info.layout.data_offset if comp is None else 0) if ext else 0
            got = b"" if ext is None else data[start : start + ext.size]
            assert got.hex() == hexed, (li, part)


def _decompressed_data(path, layout) -> bytes:
    """The data section of a compressed golden file, decoded frame by frame with zstandard directly."""
    import zstandard

    data = path.read_bytes()
    dctx = zstandard.ZstdDecompressor()
    return b"".join(dctx.decompress(data[o : o + n]) for o, n in layout.compressed.frames())


@pytest.mark.parametrize("name", GOLDEN)
@pytest.mark.parametrize("mode", ["streaming", "staged"])
def test_golden_file_restores_and_reencodes_byte_for_byte(name, mode, tmp_path):
    ident, snap, _parts = golden.golden_sessions()[name]
    target = MemoryAdapter(
        ident, [g.spec for g in snap.layers], max_tokens=64, vocab_size=300000, staging=(mode == "staged")
    )
    key = golden.GOLDEN_KEYS.get(name)
    report = restore(golden.GOLDEN_DIR / f"{name}.ssf", target, mode=mode, block_size=4096, key=key)
    assert report.mode == mode and report.n_tokens == snap.state.n_tokens
    _skip_if_another_libzstd(name)
    out = tmp_path / "again.ssf"
    save(
        out,
        target,
        block_size=golden.GOLDEN_BLOCK_SIZE,
        compression=golden.GOLDEN_COMPRESSION.get(name),
        key=key,
    )
    assert out.read_bytes() == (golden.GOLDEN_DIR / f"{name}.ssf").read_bytes()


def test_bad_files_are_reproducible():
    produced = golden.bad_files()
    assert sorted(f"{n}.ssf" for n in produced) == sorted(BAD)
    for name, (data, cls) in produced.items():
        assert (golden.BAD_DIR / f"{name}.ssf").read_bytes() == data, name
        assert BAD[f"{name}.ssf"] == cls.reason


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_file_raises_its_named_error(name):
    reason = BAD[name]
    cls = E.all_reasons()[reason]
    key = golden.GOLDEN_KEY if name.startswith("mac_") else None
    with pytest.raises(E.SessionFileError) as info:
        inspect(golden.BAD_DIR / name, key=key)
    assert type(info.value) is cls, f"{name}: {type(info.value).__name__}: {info.value}"
    assert info.value.reason == reason


@pytest.mark.parametrize("name", sorted(n for n in BAD if n.startswith("mac_")))
def test_bad_authenticated_file_is_refused_before_the_adapter_sees_it(name):
    """Read with the golden key, every mac_* file is refused in either mode with the adapter's session
    untouched: K1-K3 before the metadata is read, K4 at the end of the read pass (streaming) or before
    commit_staged (staged)."""
    ident, snap, _parts = golden.golden_sessions()["small_f16"]
    for staging in (False, True):
        target = MemoryAdapter(
            ident, [g.spec for g in snap.layers], max_tokens=64, vocab_size=300000, staging=staging
        )
        before = target.live_digest()
        with pytest.raises(E.AuthenticationFailed) as info:
            restore(golden.BAD_DIR / name, target, block_size=4096, key=golden.GOLDEN_KEY)
        assert info.value.reason == BAD[name]
        assert not {"begin_apply", "copy_in", "commit", "fail_stop", "commit_staged"} & set(target.events)
        if info.value.reason != "payload_not_authentic":  # K1-K3: nothing at all reached the adapter
            assert not {"begin_staging", "stage_in"} & set(target.events), target.events
        assert target.live_digest() == before


def test_bad_authenticated_files_read_without_a_key():
    """Without a key the extension is not checked: a MAC made with another key or a flipped MAC byte reads as
    the valid file it otherwise is; the forged payload still passes XXH3 (only the key's holder can tell)."""
    for name in (
        "mac_wrong_key",
        "mac_flipped",
        "mac_key_id_flipped",
        "mac_payload_digest_flipped",
        "mac_payload_digest_mismatch",
        "mac_missing",
    ):
        assert inspect(golden.BAD_DIR / f"{name}.ssf").payload_verified, name
