"""llama.cpp slot files (strata_sessionfile.llamacpp) without llama.cpp and without numpy: files encoded
from the spec's byte table (slotfiles.py) against a tiny GGUF model, converted to format v1 and back byte
for byte, in both V layouts; the bad files of spec/bad-llamacpp each refused by name, nothing written; the
CLI's convert and inspect. The real llama.cpp round trips are in tests/crossengine.
"""

from __future__ import annotations

import importlib.util
import json
import struct
import sys

import pytest
import strata_sessionfile as sf
from strata_sessionfile import Part
from strata_sessionfile import errors as E
from strata_sessionfile import llamacpp as L
from strata_sessionfile.cli import EXIT_INVALID, EXIT_VALID, main

from . import slotfiles

BAD = json.loads((slotfiles.BAD_DIR / "expected.json").read_text())


@pytest.fixture
def model(tmp_path):
    path = tmp_path / "tiny.gguf"
    path.write_bytes(slotfiles.tiny_gguf())
    return path


def _part(path, layer: int, part: Part) -> bytes:
    info = sf.inspect(path)
    ext = next(e for e in info.layout.extents if e.layer == layer and e.part is part)
    with open(path, "rb") as f:
        f.seek(info.layout.data_offset + ext.data_offset)
        return f.read(ext.size)


def test_geometry_of_the_tiny_model(model):
    g = L.model_geometry(model)
    assert g.architecture == "llama"
    assert [(la.n_kv_heads, la.head_dim_k, la.window) for la in g.layers] == [(2, 4, 0)] * slotfiles.N_LAYER


def test_geometry_walks_past_a_long_vocabulary(tmp_path):
    path = tmp_path / "v.gguf"
    path.write_bytes(slotfiles.tiny_gguf(vocab=5000))
    assert len(L.model_geometry(path).layers) == slotfiles.N_LAYER
    path.write_bytes(slotfiles.tiny_gguf(vocab=5000)[:-200])  # the table cut short
    with pytest.raises(E.SlotModelUnsupported):
        L.model_geometry(path)


@pytest.mark.parametrize("v_trans", [False, True])
def test_slot_file_to_v1_and_back_byte_for_byte(model, tmp_path, v_trans):
    src = tmp_path / "slot.bin"
    src.write_bytes(slotfiles.slot_bytes(7, v_trans=v_trans, seed=3))
    L.slot_to_session(src, model, tmp_path / "s.ssf")
    info = sf.inspect(tmp_path / "s.ssf")
    assert info.metadata.state.n_tokens == 7 and info.metadata.state.position == 7
    assert info.header.model_fingerprint == sf.model_fingerprint([("model", model)]).fingerprint
    assert [g.spec.k_dtype for g in info.metadata.layers] == [sf.DType.F16] * slotfiles.N_LAYER
    L.session_to_slot(tmp_path / "s.ssf", model, tmp_path / "back.bin", L.SlotOptions(v_trans=v_trans))
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()


def test_transposed_v_becomes_rows_in_position_order(model, tmp_path):
    """V of a transposed file, read by hand from its byte table, is the v1 file's [token][value] rows."""
    n = 5
    data = slotfiles.slot_bytes(n, v_trans=True, seed=4)
    (tmp_path / "t.bin").write_bytes(data)
    L.slot_to_session(tmp_path / "t.bin", model, tmp_path / "t.ssf")
    row = slotfiles.ROW
    # the last layer's transposed V is the file's last row * n * 2 bytes: [value][cell]
    v = data[len(data) - row * n * 2 :]
    want = b"".join(v[(j * n + t) * 2 : (j * n + t) * 2 + 2] for t in range(n) for j in range(row))
    assert _part(tmp_path / "t.ssf", slotfiles.N_LAYER - 1, Part.V) == want


@pytest.mark.parametrize("cut", [1, 7, 16, 40])
@pytest.mark.parametrize("numba", [False, True])
def test_transposed_v_any_byte_range_in_position_order(model, tmp_path, cut, numba, monkeypatch):
    """copy_out of a transposed V straight into the caller's view: a range cut mid-row at either end, cells
    out of position order, gives exactly those bytes of the rows (numpy's and numba's transposes alike)."""
    pytest.importorskip("numpy")
    if numba:
        pytest.importorskip("numba")
    else:  # transpose_into takes numba's kernel only where numba is loaded
        monkeypatch.delitem(sys.modules, "numba", raising=False)
    n, positions = 9, [3, 4, 5, 0, 1, 2, 8, 6, 7]
    data = slotfiles.slot_bytes(n, v_trans=True, seed=7, positions=positions)
    (tmp_path / "t.bin").write_bytes(data)
    geo = L.model_geometry(model)
    source = L.SlotSource(L.read_slot_file(tmp_path / "t.bin", geo), geo, None, b"")
    row = slotfiles.ROW
    v = data[len(data) - row * n * 2 :]  # the last layer's transposed V: [value][cell]
    rows = b"".join(
        v[(j * n + positions.index(t)) * 2 : (j * n + positions.index(t)) * 2 + 2]
        for t in range(n)
        for j in range(row)
    )
    got = bytearray(len(rows))
    try:
        for offset in range(0, len(rows), cut):
            piece = memoryview(got)[offset : offset + cut]
            source.copy_out(slotfiles.N_LAYER - 1, Part.V, offset, piece)
    finally:
        source.close()
    assert bytes(got) == rows


class _CutPieces(L.SlotTarget):
    """A SlotTarget handed each piece in cuts of `cut` bytes (rows cut mid-value and across pieces)."""

    cut = 1

    def stage_in(self, layer, part, offset, src):
        for lo in range(0, len(src), self.cut):
            super().stage_in(layer, part, offset + lo, src[lo : lo + self.cut])


@pytest.mark.parametrize("cut", [3, 16, 50])
@pytest.mark.parametrize("v_trans", [False, True])
def test_slot_file_written_from_pieces_cut_mid_row(model, tmp_path, cut, v_trans):
    """The slot file written from pieces that cut rows anywhere is the one written from whole blocks (a V
    transposed into the kept columns; K converted to f32, so no part is a straight copy)."""
    pytest.importorskip("numpy")
    src = tmp_path / "slot.bin"
    src.write_bytes(slotfiles.slot_bytes(11, v_trans=v_trans, seed=8))
    L.slot_to_session(src, model, tmp_path / "s.ssf")
    opts = L.SlotOptions(k_type=L.GGMLType.F32, v_trans=v_trans)
    L.session_to_slot(tmp_path / "s.ssf", model, tmp_path / "whole.bin", opts)
    target = _CutPieces(
        str(tmp_path / "cut.bin"),
        L.model_geometry(model),
        sf.model_fingerprint([("model", model)]),
        L.config_of(tmp_path / "s.ssf"),
        opts,
    )
    target.cut = cut
    sf.restore(tmp_path / "s.ssf", target, mode="staged")
    assert (tmp_path / "cut.bin").read_bytes() == (tmp_path / "whole.bin").read_bytes()


def test_slot_target_refuses_pieces_out_of_order(model, tmp_path):
    pytest.importorskip("numpy")
    (tmp_path / "slot.bin").write_bytes(slotfiles.slot_bytes(6, v_trans=True, seed=2))
    L.slot_to_session(tmp_path / "slot.bin", model, tmp_path / "s.ssf")

    class Skipping(L.SlotTarget):
        def stage_in(self, layer, part, offset, src):
            if part is Part.V:
                offset += 2  # as if a piece were lost
            super().stage_in(layer, part, offset, src)

    target = Skipping(
        str(tmp_path / "x.bin"),
        L.model_geometry(model),
        sf.model_fingerprint([("model", model)]),
        L.config_of(tmp_path / "s.ssf"),
        L.SlotOptions(v_trans=True),
    )
    with pytest.raises(E.AdapterFailed):
        sf.restore(tmp_path / "s.ssf", target, mode="staged")
    assert not (tmp_path / "x.bin").exists()


@pytest.mark.parametrize("shape", [(8, 16), (13, 21), (1, 5), (192, 7)])
@pytest.mark.parametrize("dtype", ["<u2", "<u4"])
def test_numba_transpose_kernel_equals_numpy(shape, dtype):
    np = pytest.importorskip("numpy")
    kernel = pytest.importorskip("strata_sessionfile._transpose_kernel")
    src = np.random.default_rng(1).integers(0, 1 << 16, (shape[1] + 3, shape[0] + 5)).astype(dtype)
    view = src[2 : 2 + shape[1], 1 : 1 + shape[0]]  # strided, as a run of cells is
    dst = np.zeros(shape, dtype)
    kernel.transpose_blocked(dst, view)
    assert (dst == view.T).all()


@pytest.mark.parametrize("scratch_rows", [0, 1, 3, 8, 13, 40])
@pytest.mark.parametrize("dtype", ["<u2", "<u4"])
def test_transpose_through_a_scratch_block_equals_numpy(scratch_rows, dtype):
    """The kernel's rows a block at a time through a scratch of any size (none, one row, blocks that do
    not divide the rows, more than all of them), from a strided run of cells, give numpy's transpose."""
    np = pytest.importorskip("numpy")
    pytest.importorskip("numba")
    src = np.random.default_rng(2).integers(0, 1 << 16, (24 + 3, 37 + 5)).astype(dtype)
    view = src[2 : 2 + 24, 1 : 1 + 37]  # [value][cell], strided, as a run of cells is
    dst = np.zeros((37, 24), dtype)
    L.transpose_into(dst, view, np.empty(scratch_rows * 24 * dst.itemsize, np.uint8))
    assert (dst == view.T).all()


def test_cells_out_of_order_are_put_in_position_order(model, tmp_path):
    n = 4
    data = slotfiles.slot_bytes(n, positions=[2, 3, 0, 1], seed=5)
    (tmp_path / "o.bin").write_bytes(data)
    L.slot_to_session(tmp_path / "o.bin", model, tmp_path / "o.ssf")
    first_k = 12 + 4 * (n + 4) + 8 + n * 12 + 16 + 12
    rows = [data[first_k + c * slotfiles.ROW * 2 : first_k + (c + 1) * slotfiles.ROW * 2] for c in range(n)]
    assert _part(tmp_path / "o.ssf", 0, Part.K) == rows[2] + rows[3] + rows[0] + rows[1]


def test_plain_token_list_is_read(model, tmp_path):
    (tmp_path / "p.bin").write_bytes(slotfiles.slot_bytes(3, packed=False, seed=6))
    slot = L.read_slot_file(tmp_path / "p.bin", L.model_geometry(model))
    (tmp_path / "q.bin").write_bytes(slotfiles.slot_bytes(3, packed=True, seed=6))
    assert slot.tokens == L.read_slot_file(tmp_path / "q.bin").tokens


def test_a_slot_file_converted_with_a_key_carries_its_mac(model, tmp_path):
    """A holder of the session key converts a slot file into an authenticated file (a keyed server's upload):
    it verifies under that key, is refused under another, and carries the same K/V as an unkeyed conversion."""
    from strata_sessionfile.format import Flags

    (tmp_path / "s.bin").write_bytes(slotfiles.slot_bytes(5, seed=8))
    key, other = sf.SessionKey(bytes(range(32))), sf.SessionKey(bytes(range(1, 33)))
    L.slot_to_session(tmp_path / "s.bin", model, tmp_path / "keyed.ssf", key=key)
    L.slot_to_session(tmp_path / "s.bin", model, tmp_path / "plain.ssf")
    keyed = sf.inspect(tmp_path / "keyed.ssf", verify=True, key=key)
    assert keyed.header.flags & Flags.AUTHENTICATED
    assert not sf.inspect(tmp_path / "plain.ssf", verify=True).header.flags & Flags.AUTHENTICATED
    with pytest.raises(E.SessionFileError) as refused:
        sf.inspect(tmp_path / "keyed.ssf", verify=True, key=other)
    assert refused.value.reason == "mac_wrong_key"
    with pytest.raises(E.SessionFileError) as missing:
        sf.inspect(tmp_path / "plain.ssf", verify=True, key=key)
    assert missing.value.reason == "mac_missing"
    for layer in range(2):
        for part in (Part.K, Part.V):
            assert _part(tmp_path / "keyed.ssf", layer, part) == _part(tmp_path / "plain.ssf", layer, part)


def test_v1_of_another_model_is_refused(model, tmp_path):
    (tmp_path / "s.bin").write_bytes(slotfiles.slot_bytes(4))
    L.slot_to_session(tmp_path / "s.bin", model, tmp_path / "s.ssf")
    other = tmp_path / "other.gguf"
    other.write_bytes(slotfiles.tiny_gguf(n_layer=slotfiles.N_LAYER + 1))
    with pytest.raises(E.ModelMismatch):
        L.session_to_slot(tmp_path / "s.ssf", other, tmp_path / "x.bin")
    assert not (tmp_path / "x.bin").exists()


def test_slot_file_of_another_model_is_refused(model, tmp_path):
    (tmp_path / "s.bin").write_bytes(slotfiles.slot_bytes(4, n_layer=3))
    with pytest.raises(E.SlotGeometryMismatch) as info:
        L.slot_to_session(tmp_path / "s.bin", model, tmp_path / "s.ssf")
    assert info.value.field == "sections[0].n_layer"
    assert not (tmp_path / "s.ssf").exists()


def test_bad_files_are_reproducible():
    produced = slotfiles.bad_slot_files()
    assert sorted(f"{n}.bin" for n in produced) == sorted(BAD)
    for name, (data, cls) in produced.items():
        assert (slotfiles.BAD_DIR / f"{name}.bin").read_bytes() == data, name
        assert BAD[f"{name}.bin"] == cls.reason
    assert (slotfiles.BAD_DIR / "model.gguf").read_bytes() == slotfiles.tiny_gguf()


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_slot_file_raises_its_named_error(name, tmp_path):
    out = tmp_path / "out.ssf"
    with pytest.raises(E.SessionFileError) as info:
        L.slot_to_session(slotfiles.BAD_DIR / name, slotfiles.BAD_DIR / "model.gguf", out)
    assert info.value.reason == BAD[name], f"{name}: {type(info.value).__name__}: {info.value}"
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_not_a_gguf_model_is_refused(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"not a model at all")
    (tmp_path / "s.bin").write_bytes(slotfiles.slot_bytes())
    with pytest.raises(E.SlotModelUnsupported):
        L.slot_to_session(tmp_path / "s.bin", tmp_path / "m.gguf", tmp_path / "s.ssf")
    (tmp_path / "a.gguf").write_bytes(slotfiles.tiny_gguf(arch="mamba"))
    with pytest.raises(E.SlotModelUnsupported):
        L.model_geometry(tmp_path / "a.gguf")


def test_cli_inspect_recognises_a_slot_file(tmp_path, capsys):
    (tmp_path / "s.bin").write_bytes(slotfiles.slot_bytes(5, v_trans=True))
    assert main(["inspect", str(tmp_path / "s.bin")]) == EXIT_VALID
    out = capsys.readouterr().out
    assert "llama.cpp sequence state file, version 4" in out and "5 cells" in out and "transposed" in out
    assert main(["inspect", "--json", str(tmp_path / "s.bin")]) == EXIT_VALID
    d = json.loads(capsys.readouterr().out)
    assert d["n_tokens"] == 5 and d["sections"][0]["v_trans"] is True
    (tmp_path / "bad.bin").write_bytes(slotfiles.slot_bytes(5)[:-3])
    assert main(["inspect", str(tmp_path / "bad.bin")]) == EXIT_INVALID
    assert "slot_truncated" in capsys.readouterr().err


def test_cli_convert_both_ways(model, tmp_path, capsys):
    src = tmp_path / "s.bin"
    src.write_bytes(slotfiles.slot_bytes(6, seed=9))
    ssf, back = tmp_path / "s.ssf", tmp_path / "back.bin"
    assert main(["convert", str(src), "--model", str(model), "-o", str(ssf)]) == EXIT_VALID
    assert (
        main(["convert", str(ssf), "--to", "llama.cpp", "--model", str(model), "-o", str(back)]) == EXIT_VALID
    )
    assert back.read_bytes() == src.read_bytes()
    # --like: the config identity of another session file, carried over
    like = tmp_path / "like.ssf"
    L.slot_to_session(src, model, like, config={"engine": "someone", "n_ctx": 64})
    assert (
        main(["convert", str(src), "--model", str(model), "-o", str(ssf), "--like", str(like)]) == EXIT_VALID
    )
    assert sf.inspect(ssf).metadata.config.mapping == {"engine": "someone", "n_ctx": 64}


def test_q8_0_round_trip_needs_numpy(model, tmp_path):
    """f16 -> q8_0 slot file -> f16 v1: within q8_0's rounding (numpy does the arithmetic)."""
    np = pytest.importorskip("numpy")
    src = tmp_path / "s.bin"
    n = 4
    rng = np.random.default_rng(0)
    values = rng.standard_normal(n * slotfiles.ROW * 4).astype("<f2")  # room for 32-value blocks
    assert values.size >= 32
    src.write_bytes(slotfiles.slot_bytes(n, seed=2))
    L.slot_to_session(src, model, tmp_path / "s.ssf")
    with pytest.raises(E.SlotUnsupportedType):  # 8 values per row are not whole 32-value blocks
        L.session_to_slot(
            tmp_path / "s.ssf", model, tmp_path / "q.bin", L.SlotOptions(k_type=L.GGMLType.Q8_0)
        )
    raw = values[:64].tobytes()
    q = L.quantize_q8_0(raw, sf.DType.F16)
    assert len(q) == 2 * 34
    back = np.frombuffer(L.dequantize_q8_0(q, 64), "<f2").astype(np.float32)
    step = np.abs(values[:64].astype(np.float32)).reshape(2, 32).max(axis=1) / 127
    assert np.all(np.abs(back - values[:64]).reshape(2, 32) <= step[:, None] * 0.51 + 1e-3)
    assert struct.unpack("<e", q[:2])[0] == pytest.approx(step[0], rel=1e-3)


def test_q8_0_without_numpy_is_a_named_refusal():
    """Where numpy is not installed (the package alone), q8_0 is refused by name, not with an ImportError."""
    if importlib.util.find_spec("numpy") is not None:
        pytest.skip("numpy is installed here: test_q8_0_round_trip_needs_numpy runs instead")
    with pytest.raises(E.ConversionUnavailable):
        L.dequantize_q8_0(bytes(34), 32)
    with pytest.raises(E.ConversionUnavailable):
        L.quantize_q8_0(bytes(64), sf.DType.F16)


def test_hadamard_is_llama_cpps_own_inverse():
    """ggml_gen_hadamard's matrix: Sylvester's order, first row and column +1/sqrt(n), symmetric, squared I."""
    np = pytest.importorskip("numpy")
    for n in (64, 128):
        h = L.hadamard(np, n)
        assert np.allclose(h, h.T) and np.allclose(h @ h, np.eye(n), atol=1e-5)
        assert np.allclose(h[0], 1 / np.sqrt(n)) and np.allclose(np.abs(h), 1 / np.sqrt(n))
        assert h[1, 1] < 0 and h[n // 2, n // 2] < 0 and h[n // 2, 0] > 0


@pytest.mark.parametrize(
    ("ggml_type", "dims", "part", "n_rot"),
    [
        (L.GGMLType.Q8_0, [64] * 3, Part.K, 64),
        (L.GGMLType.Q8_0, [128] * 3, Part.K, 128),
        (L.GGMLType.Q8_0, [256], Part.K, 256),
        (L.GGMLType.Q8_0, [128], Part.V, 64),
        (L.GGMLType.Q8_0, [80], Part.K, 0),
        (L.GGMLType.Q8_0, [64, 128], Part.K, 0),  # layers of two head sizes: llama.cpp rotates none
        (L.GGMLType.F16, [128], Part.K, 0),
    ],
)
def test_rotation_is_llama_cpps_rule(ggml_type, dims, part, n_rot):
    assert L.llamacpp_rotation(ggml_type, dims, part) == n_rot


def test_q8_0_rotation_undone_on_the_way_in_and_made_on_the_way_out():
    """Quantizing with a rotation and dequantizing with it gives back the values (q8_0's rounding spread
    over each run of n_rot values); dequantized without undoing it, they are other values."""
    np = pytest.importorskip("numpy")
    x = np.random.default_rng(3).standard_normal(4 * 128).astype("<f2")
    rotated = L.quantize_q8_0(x.tobytes(), sf.DType.F16, 64)
    back = np.frombuffer(L.dequantize_q8_0(rotated, len(x), 64), "<f2").astype(np.float32)
    assert np.abs(back - x.astype(np.float32)).max() < 0.05
    still = np.frombuffer(L.dequantize_q8_0(rotated, len(x)), "<f2").astype(np.float32)
    assert np.abs(still - x.astype(np.float32)).max() > 0.5
