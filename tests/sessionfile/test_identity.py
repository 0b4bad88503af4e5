"""Identity: the sampled model fingerprint (GGUF metadata walk, fixed samples, fast on huge files) and the
canonical config fingerprint with key-level differences."""

from __future__ import annotations

import os
import time

import pytest
from strata_sessionfile import config_fingerprint, model_fingerprint
from strata_sessionfile.identity import (
    SAMPLE_SIZE,
    canonical_config,
    config_differences,
    gguf_metadata_end,
    model_differences,
    sample_offsets,
)


def test_sample_offsets_cover_both_ends():
    size = 10_000_000
    offs = sample_offsets(size)
    assert len(offs) == 16 and offs[0] == 0 and offs[-1] == size - SAMPLE_SIZE
    assert offs == sorted(offs) and sample_offsets(1000) == [0]


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


def test_model_fingerprint_sees_size_samples_role_and_order(tmp_path):
    data = bytearray(os.urandom(3 << 20))
    a = _write(tmp_path / "a.bin", bytes(data))
    b = _write(tmp_path / "b.bin", bytes(data[:-1]))
    base = model_fingerprint([("model", a)])
    assert model_fingerprint([("model", a)]) == base
    assert model_fingerprint([("model", b)]).fingerprint != base.fingerprint  # size
    assert model_fingerprint([("draft", a)]).fingerprint != base.fingerprint  # role
    assert (
        model_fingerprint([("model", a), ("lora", b)]).fingerprint
        != model_fingerprint([("lora", b), ("model", a)]).fingerprint
    )  # order
    offs = sample_offsets(len(data))
    changed = bytearray(data)
    changed[offs[7] + 100] ^= 1  # inside a sample
    c = _write(tmp_path / "c.bin", bytes(changed))
    assert model_fingerprint([("model", c)]).fingerprint != base.fingerprint
    unsampled = bytearray(data)
    unsampled[offs[7] + SAMPLE_SIZE + 10] ^= 1  # between samples, past the 1 MiB prefix: by design not seen
    d = _write(tmp_path / "d.bin", bytes(unsampled))
    assert model_fingerprint([("model", d)]).fingerprint == base.fingerprint
    diffs = model_differences(model_fingerprint([("model", c)]), base)
    assert diffs and "sampled digest differs" in diffs[0]


def test_model_digest_is_cached_per_unchanged_file_and_recomputed_when_it_changes(tmp_path, monkeypatch):
    from strata_sessionfile import identity

    data = bytearray(os.urandom(2 << 20))
    path = _write(tmp_path / "m.bin", bytes(data))
    reads = []
    real = identity._sampled_digest
    monkeypatch.setattr(identity, "_sampled_digest", lambda f, size: reads.append(size) or real(f, size))
    first = model_fingerprint([("model", path)])
    assert model_fingerprint([("model", path)]) == first and len(reads) == 1  # the second came from the cache
    data[100] ^= 1  # same size, same name, rewritten in place: mtime/ctime move, the digest is recomputed
    with open(path, "r+b") as f:
        f.write(data)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    changed = model_fingerprint([("model", path)])
    assert len(reads) == 2 and changed.fingerprint != first.fingerprint
    os.replace(_write(tmp_path / "new.bin", bytes(data[:-7])), path)  # replaced: another inode
    assert model_fingerprint([("model", path)]).files[0].size == len(data) - 7 and len(reads) == 3


def test_fingerprint_of_a_sparse_100_gb_file_is_fast(tmp_path):
    big = tmp_path / "huge.gguf"
    with open(big, "wb") as f:
        f.truncate(100 << 30)
    t = time.perf_counter()
    ident = model_fingerprint([("model", big)])
    assert time.perf_counter() - t < 2.0
    assert ident.files[0].size == 100 << 30


def test_gguf_metadata_walk_matches_the_gguf_reader(request):
    gguf = pytest.importorskip("gguf")  # an engine dependency: absent where the package stands alone
    smollm2_path = request.getfixturevalue("smollm2_gguf")
    with open(smollm2_path, "rb") as f:
        end = gguf_metadata_end(f)
    reader = gguf.GGUFReader(smollm2_path)
    alignment = 32
    # tensor data starts at the first aligned offset after the tensor-info table
    assert reader.data_offset == (end + alignment - 1) // alignment * alignment
    ident = model_fingerprint([("model", smollm2_path)])
    assert ident.files[0].size == os.path.getsize(smollm2_path)


def test_canonical_config_is_order_independent_and_strict():
    a = {"kv_type": "f16", "rope": [{"base": 1e6, "scale": 1.0}], "n_ctx": 8192, "name": "ünï"}
    b = dict(reversed(list(a.items())))
    assert canonical_config(a) == canonical_config(b)
    assert (
        canonical_config(a)
        == '{"kv_type":"f16","n_ctx":8192,"name":"ünï","rope":[{"base":1000000.0,"scale":1.0}]}'.encode()
    )
    assert config_fingerprint(a) == config_fingerprint(b)
    assert config_fingerprint({**a, "n_ctx": 4096}).fingerprint != config_fingerprint(a).fingerprint
    for bad in ({"x": float("nan")}, {1: "a"}, {"x": object()}):
        with pytest.raises(ValueError):
            canonical_config(bad)


def test_config_differences_name_nested_keys():
    f = {"kv_type": "f16", "rope": {"base": 10000.0}, "only_file": 1, "flag": True}
    e = {"kv_type": "i8", "rope": {"base": 1e6}, "only_engine": 2, "flag": 1}
    assert config_differences(f, e) == [
        "flag: file True, engine 1",
        "kv_type: file 'f16', engine 'i8'",
        "only_engine: file has no such key, engine 2",
        "only_file: file 1, engine has no such key",
        "rope.base: file 10000.0, engine 1000000.0",
    ]
