"""The lean GGUF reader: agreement with gguf-py on the real models, speed, and refusal of bad files."""

from __future__ import annotations

import struct
import time

import gguf
import numpy as np
import pytest
from strata_engine.errors import EngineError, GGUFError, UnsupportedTensorType
from strata_engine.gguf import SUPPORTED_TYPES, dequantize_tensor, read_gguf


def _write_small_gguf(path, *, tensors=None, extra_kv=None):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("test.u32", 7)
    w.add_float32("test.f32", 1.5)
    w.add_bool("test.flag", True)
    w.add_string("test.name", "héllo")
    w.add_array("test.strings", ["a", "", "東京"])
    w.add_array("test.ints", [1, 2, 3])
    for k, v in (extra_kv or {}).items():
        w.add_string(k, v)
    for name, (arr, qtype) in (tensors or {}).items():
        w.add_tensor(name, arr, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_small_file_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((4, 64)).astype(np.float32)
    q8 = gguf.quants.quantize(f32, gguf.GGMLQuantizationType.Q8_0)
    path = tmp_path / "small.gguf"
    _write_small_gguf(
        path,
        tensors={"a": (f32, gguf.GGMLQuantizationType.F32), "b": (q8, gguf.GGMLQuantizationType.Q8_0)},
    )
    g = read_gguf(path)
    assert g.version == 3
    assert g.metadata["general.architecture"] == "llama"
    assert g.metadata["test.u32"] == 7
    assert g.metadata["test.f32"] == 1.5
    assert g.metadata["test.flag"] is True
    assert g.metadata["test.name"] == "héllo"
    assert g.metadata["test.strings"] == ["a", "", "東京"]
    assert g.metadata["test.ints"].tolist() == [1, 2, 3]
    assert g.tensors["a"].shape == (4, 64)
    assert g.tensors["b"].ggml_type == gguf.GGMLQuantizationType.Q8_0
    assert g.data_offset % g.alignment == 0
    np.testing.assert_array_equal(dequantize_tensor(g, "a"), f32)
    np.testing.assert_allclose(dequantize_tensor(g, "b"), f32, atol=0.05)
    np.testing.assert_allclose(dequantize_tensor(g, "b", rows=np.array([2])), f32[2:3], atol=0.05)


@pytest.mark.parametrize("qtype_name", ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_dequantize_matches_quantized_input(tmp_path, qtype_name):
    qtype = gguf.GGMLQuantizationType[qtype_name]
    assert qtype in SUPPORTED_TYPES
    rng = np.random.default_rng(1)
    f32 = rng.standard_normal((3, 256)).astype(np.float32)
    q = gguf.quants.quantize(f32, qtype)
    path = tmp_path / "q.gguf"
    _write_small_gguf(path, tensors={"t": (q, qtype)})
    out = dequantize_tensor(read_gguf(path), "t")
    assert out.dtype == np.float32 and out.shape == f32.shape
    tol = {"F16": 1e-3, "BF16": 2e-2}.get(qtype_name, 0.35)
    np.testing.assert_allclose(out, f32, atol=tol)


def test_unsupported_tensor_type_is_named(tmp_path):
    rng = np.random.default_rng(2)
    f32 = rng.standard_normal((2, 256)).astype(np.float32)
    q = gguf.quants.quantize(f32, gguf.GGMLQuantizationType.TQ2_0)
    path = tmp_path / "tq.gguf"
    _write_small_gguf(path, tensors={"t": (q, gguf.GGMLQuantizationType.TQ2_0)})
    g = read_gguf(path)
    with pytest.raises(UnsupportedTensorType, match="TQ2_0"):
        dequantize_tensor(g, "t")


def test_bad_magic_and_version(tmp_path):
    path = tmp_path / "x.gguf"
    _write_small_gguf(path)
    data = bytearray(path.read_bytes())
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUX" + data[4:])
    with pytest.raises(GGUFError, match="magic"):
        read_gguf(bad)
    bad.write_bytes(data[:4] + struct.pack("<I", 9) + data[8:])
    with pytest.raises(GGUFError, match="version 9"):
        read_gguf(bad)
    assert issubclass(GGUFError, EngineError)


def test_every_truncation_is_refused(tmp_path):
    rng = np.random.default_rng(3)
    path = tmp_path / "t.gguf"
    _write_small_gguf(
        path, tensors={"a": (rng.standard_normal((2, 32)).astype(np.float32), gguf.GGMLQuantizationType.F32)}
    )
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    for n in range(0, len(data) - 1, 7):
        cut.write_bytes(data[:n])
        with pytest.raises(GGUFError):
            read_gguf(cut)


def test_absurd_counts_are_refused(tmp_path):
    path = tmp_path / "x.gguf"
    _write_small_gguf(path)
    data = bytearray(path.read_bytes())
    data[16:24] = struct.pack("<Q", 2**60)  # n_kv
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="cannot fit"):
        read_gguf(bad)


def test_invalid_utf8_key_is_refused_with_offset(tmp_path):
    path = tmp_path / "x.gguf"
    _write_small_gguf(path)
    data = bytearray(path.read_bytes())
    i = data.index(b"general.architecture")
    data[i] = 0xFF
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=f"offset {i - 8}"):
        read_gguf(bad)


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_real_models_agree_with_gguf_py(which, smollm2_path, gemma3_path):
    path = smollm2_path if which == "smollm2" else gemma3_path
    t0 = time.perf_counter()
    g = read_gguf(path)
    elapsed = time.perf_counter() - t0
    assert elapsed < 2.0, f"lean parse took {elapsed:.2f}s"
    ref = gguf.GGUFReader(str(path))
    assert g.data_offset == ref.data_offset
    assert set(g.tensors) == {t.name for t in ref.tensors}
    for t in ref.tensors:
        mine = g.tensors[t.name]
        assert mine.offset == t.data_offset
        assert mine.n_bytes == t.n_bytes
        assert mine.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
        assert mine.ggml_type == t.tensor_type
    assert set(g.metadata) == {k for k in ref.fields if not k.startswith("GGUF.")}
    tokens = ref.fields["tokenizer.ggml.tokens"]
    sample = range(0, len(tokens.data), 997)
    assert [g.metadata["tokenizer.ggml.tokens"][i] for i in sample] == [
        bytes(tokens.parts[tokens.data[i]]).decode("utf-8") for i in sample
    ]
    start, end = g.metadata_range
    assert start == 24 and end > start
