"""The golden and bad files of spec/: their definitions, and `python tests/sessionfile/golden.py` to write them.

Golden files are written by the library's own writer from fully specified sessions (MemoryAdapter with
explicit part bytes); each gets a JSON of its expected decoded content. Bad files are golden bytes with
one rule broken (hashes refreshed where needed so the intended rule, not an earlier one, trips).

Compressed golden files (``*_zstd``) are written with a fixed level, one thread and 4 KiB blocks; their
bytes depend on libzstd's output, so their JSON records the libzstd version that wrote them.

Authenticated golden files (``*_mac``) are written with GOLDEN_KEY (bytes 0x00..0x1f); bad files named
``mac_*`` are read with that key, every other bad file without one.
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
import sys
import tempfile
from pathlib import Path

import xxhash
from strata_sessionfile import errors as E
from strata_sessionfile import inspect, save
from strata_sessionfile.auth import SessionKey
from strata_sessionfile.compression import Compression
from strata_sessionfile.format import (
    AUTH_EXTENSION_STRUCT,
    BLOCK_ENTRY_STRUCT,
    END_MARKER,
    HEADER_SIZE,
    LAYER_STRUCT,
    MAC_COVERED_TRAILER,
    TRAILER_SIZE,
    DType,
    Flags,
    LayerRole,
    Part,
    trailer_size,
)
from strata_sessionfile.identity import config_fingerprint, model_identity_from_files
from strata_sessionfile.records import (
    Checkpoint,
    EngineIdentity,
    LayerGeometry,
    LayerSpec,
    ModelFile,
    RunningState,
    Snapshot,
)
from strata_sessionfile.testing import MemoryAdapter, pattern_bytes

SPEC = Path(__file__).resolve().parents[2] / "spec"
GOLDEN_DIR = SPEC / "golden"
BAD_DIR = SPEC / "bad"


def _identity(config: dict) -> EngineIdentity:
    model = model_identity_from_files([ModelFile("model", 98362432, bytes(range(16)))])
    return EngineIdentity(model, config_fingerprint(config))


GOLDEN_CONFIG = {
    "engine": "golden",
    "engine_version": "1.0.0",
    "backend": "numpy",
    "kv_type": "f16",
    "n_ctx": 64,
    "rope": [{"base": 10000.0, "scale": 1.0}],
    "flash": False,
}


GOLDEN_BLOCK_SIZE = 4096
# name -> how that golden file is compressed (absent: not compressed).
GOLDEN_COMPRESSION = {
    "empty_zstd": Compression("zstd", level=3),
    "kv_f16_zstd": Compression("zstd", level=3),
    "kv_f16_zstd_mac": Compression("zstd", level=3),
}
GOLDEN_KEY = SessionKey(bytes(range(32)))
OTHER_KEY = SessionKey(bytes([0xA5]) * 32)
# name -> the key that golden file is authenticated with (absent: not authenticated).
GOLDEN_KEYS = {"small_f16_mac": GOLDEN_KEY, "kv_f16_zstd_mac": GOLDEN_KEY}


def trailer_start(data: bytes | bytearray) -> int:
    """Where the trailer of file bytes ``data`` starts (its size from the header's flags)."""
    return len(data) - trailer_size(struct.unpack_from("<H", data, 10)[0])


def kv_like_f16(n_values: int, seed: int, *, scale: float, sparsity: float = 0.0) -> bytes:
    """K/V-like f16 bytes: values from a normal distribution (a fraction ``sparsity`` of them zero)."""
    rng = random.Random(seed)
    values = [0.0 if rng.random() < sparsity else rng.gauss(0.0, scale) for _ in range(n_values)]
    return struct.pack(f"<{n_values}e", *values)


def zstd_version() -> str:
    import zstandard

    return ".".join(map(str, zstandard.ZSTD_VERSION))


def golden_sessions() -> dict[str, tuple[EngineIdentity, Snapshot, list[list[bytes]]]]:
    """name -> (identity, snapshot, part bytes per layer per part)."""
    out = {}
    f16 = [LayerSpec(i, LayerRole.MAIN, 2, 4, 4, DType.F16, DType.F16) for i in range(2)]

    def parts_for(layers, seed):
        return [
            [pattern_bytes(g.part_size(p), seed * 100 + li * 5 + p) for p in Part]
            for li, g in enumerate(layers)
        ]

    ident = _identity(GOLDEN_CONFIG)
    layers = tuple(LayerGeometry(s, 0) for s in f16)
    out["empty"] = (ident, Snapshot(RunningState([]), layers), parts_for(layers, 1))

    layers = tuple(LayerGeometry(s, 5) for s in f16)
    state = RunningState([1, 9038, 2, 17, 4], 5, b"", Checkpoint(3, b""), b"")
    out["small_f16"] = (ident, Snapshot(state, layers), parts_for(layers, 2))

    mixed_specs = [
        LayerSpec(0, LayerRole.MAIN, 1, 8, 8, DType.I8, DType.I8, 4),  # sliding window of 4, int8 with scales
        LayerSpec(1, LayerRole.MAIN, 1, 8, 8, DType.I8, DType.I8, 0),
        LayerSpec(2, LayerRole.MAIN, 1, 4, 4, DType.F32, DType.BF16, 0, 12),  # extra (recurrent) state
        LayerSpec(0, LayerRole.DRAFT, 1, 4, 4, DType.F16, DType.F16, 0),
    ]
    n = 6
    layers = tuple(
        LayerGeometry(s, s.capacity(n) - (1 if s.role == LayerRole.DRAFT else 0)) for s in mixed_specs
    )
    state = RunningState(
        [105, 2364, 107, 3, 3, 236764], 7, b"\x01rng-state\x02", Checkpoint(5, b"cp"), b'{"n_discarded":1}'
    )
    mixed_ident = _identity({**GOLDEN_CONFIG, "kv_type": "i8", "sliding_window": 4})
    out["mixed_i8_window_draft"] = (mixed_ident, Snapshot(state, layers), parts_for(layers, 3))

    # Compressed: an empty session (no blocks), and 25 tokens of K/V-like f16 in 4 blocks (the last one short):
    # K dense normal values (compress poorly), V with most values zero (compresses well).
    out["empty_zstd"] = out["empty"]
    kv_specs = [LayerSpec(i, LayerRole.MAIN, 2, 32, 32, DType.F16, DType.F16) for i in range(2)]
    n = 25
    layers = tuple(LayerGeometry(s, n) for s in kv_specs)
    values = n * 2 * 32
    kv_parts = [
        [
            kv_like_f16(values, 10 + li, scale=1.0),
            kv_like_f16(values, 20 + li, scale=0.5, sparsity=0.9),
            b"",
            b"",
            b"",
        ]
        for li in range(2)
    ]
    state = RunningState(list(range(100, 100 + n)), n, b"", Checkpoint(n, b""), b"")
    out["kv_f16_zstd"] = (ident, Snapshot(state, layers), kv_parts)
    # Authenticated (GOLDEN_KEYS): a plain and a compressed file.
    out["small_f16_mac"] = out["small_f16"]
    out["kv_f16_zstd_mac"] = out["kv_f16_zstd"]
    return out


def adapter_for(ident, snap, parts, *, staging: bool = False) -> MemoryAdapter:
    """A MemoryAdapter holding exactly this session (and accepting every golden file's limits)."""
    a = MemoryAdapter(ident, [g.spec for g in snap.layers], max_tokens=64, vocab_size=300000, staging=staging)
    a.state, a.layers = snap.state, snap.layers
    a.parts = [[bytearray(p) for p in layer] for layer in parts]
    return a


def golden_adapter(name: str, *, staging: bool = False) -> MemoryAdapter:
    """A MemoryAdapter holding golden session ``name`` (its engine: a golden file of that name restores into it)."""
    return adapter_for(*golden_sessions()[name], staging=staging)


def expected_json(ident: EngineIdentity, snap: Snapshot, parts, data: bytes) -> dict:
    hdr = data[:HEADER_SIZE]
    st = snap.state
    tail = trailer_start(data)
    out = {
        "file_size": len(data),
        "header": {
            "magic": hdr[:8].hex(),
            "format_version": 1,
            "flags": struct.unpack_from("<H", hdr, 10)[0],
            "model_fingerprint": ident.model.fingerprint.hex(),
            "config_fingerprint": ident.config.fingerprint.hex(),
            "payload_length": tail - HEADER_SIZE,
            "header_hash": hdr[56:64][::-1].hex(),
        },
        "model_files": [
            {"role": f.role, "size": f.size, "digest": f.digest.hex()} for f in ident.model.files
        ],
        "config": ident.config.mapping,
        "state": {
            "tokens": list(st.tokens),
            "position": st.position,
            "sampler_state": st.sampler_state.hex(),
            "checkpoint": {"token_index": st.checkpoint.token_index, "data": st.checkpoint.data.hex()},
            "engine_fields": st.engine_fields.hex(),
        },
        "layers": [
            {
                "index": g.spec.index,
                "role": g.spec.role.name.lower(),
                "n_kv_heads": g.spec.n_kv_heads,
                "head_dim_k": g.spec.head_dim_k,
                "head_dim_v": g.spec.head_dim_v,
                "k_dtype": g.spec.k_dtype.name.lower(),
                "v_dtype": g.spec.v_dtype.name.lower(),
                "window": g.spec.window,
                "tokens_held": g.tokens_held,
                "extra_bytes": g.spec.extra_bytes,
                "parts": {p.name.lower(): parts[li][p][: g.part_size(p)].hex() for p in Part},
            }
            for li, g in enumerate(snap.layers)
        ],
        "payload_hash": data[tail : tail + 16].hex(),
    }
    if struct.unpack_from("<H", data, 10)[0] & Flags.AUTHENTICATED:
        key_id, digest, mac = AUTH_EXTENSION_STRUCT.unpack_from(data, tail + 16)
        out["authentication"] = {"key_id": key_id.hex(), "payload_digest": digest.hex(), "mac": mac.hex()}
    return out


def golden_bytes(name: str) -> tuple[bytes, dict]:
    ident, snap, parts = golden_sessions()[name]
    compression = GOLDEN_COMPRESSION.get(name)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"{name}.ssf"
        save(
            path,
            adapter_for(ident, snap, parts),
            block_size=GOLDEN_BLOCK_SIZE,
            compression=compression,
            key=GOLDEN_KEYS.get(name),
        )
        data = path.read_bytes()
        expected = expected_json(ident, snap, parts, data)
        if compression is not None:
            comp = inspect(path, verify=False).layout.compressed
            expected["compression"] = {
                "codec": compression.codec,
                "level": compression.level,
                "block_size": comp.block_size,
                "n_blocks": comp.n_blocks,
                "frame_sizes": list(comp.frame_sizes),
                "libzstd": zstd_version(),
            }
    return data, expected


# --- bad files --------------------------------------------------------------------------------------
def refresh(
    data: bytes | bytearray, *, header: bool = True, payload: bool = True, key: SessionKey | None = None
) -> bytes:
    """Recompute the header hash and/or the payload hash of (edited) file bytes; with ``key``, the payload
    digest is left as it is and the MAC recomputed (a file the key's holder made inconsistent)."""
    b = bytearray(data)
    tail = trailer_start(b)
    if payload:
        b[tail : tail + 16] = xxhash.xxh3_128_digest(bytes(b[HEADER_SIZE:tail]))
    if header:
        b[56:64] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(b[:56])))
    if key is not None:
        b[tail + 64 : tail + 96] = key.mac(
            bytes(b[:HEADER_SIZE]), bytes(b[tail : tail + MAC_COVERED_TRAILER])
        )
    return bytes(b)


def _layer_record_offset(data: bytes, i: int) -> int:
    """File offset of layer record i: the records are the last n_layers * 36 bytes of the metadata."""
    mlen = struct.unpack_from("<I", data, 64)[0]
    return 68 + mlen - LAYER_STRUCT.size * (_n_layers(data) - i)


def _n_layers(data: bytes) -> int:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "x.ssf"
        p.write_bytes(data)
        return len(inspect(p, verify=False).metadata.layers)


def bad_files() -> dict[str, tuple[bytes, type[E.SessionFileError]]]:
    small, _ = golden_bytes("small_f16")
    mixed, _ = golden_bytes("mixed_i8_window_draft")
    out: dict[str, tuple[bytes, type[E.SessionFileError]]] = {}

    def edit(base: bytes, offset: int, new: bytes, **kw) -> bytes:
        b = bytearray(base)
        b[offset : offset + len(new)] = new
        return refresh(b, **kw) if kw.get("header", True) or kw.get("payload", True) else bytes(b)

    out["empty_file"] = (b"", E.Truncated)
    out["truncated_header"] = (small[:40], E.Truncated)
    out["truncated_payload"] = (small[: len(small) - 100], E.Truncated)
    out["truncated_trailer"] = (small[:-1], E.Truncated)
    out["trailing_data"] = (small + b"\x00", E.TrailingData)
    out["bad_magic"] = (edit(small, 0, b"\x89STRSEZ\n"), E.BadMagic)
    out["header_hash"] = (edit(small, 56, b"\x00", header=False, payload=False), E.HeaderCorrupt)
    out["header_bit_flip"] = (
        edit(small, 20, bytes([small[20] ^ 4]), header=False, payload=False),
        E.HeaderCorrupt,
    )
    out["unsupported_version"] = (edit(small, 8, struct.pack("<H", 2)), E.UnsupportedVersion)
    out["unsupported_flags"] = (
        edit(small, 10, struct.pack("<H", 4)),
        E.UnsupportedFlags,
    )  # bits 0 and 1 are known
    out["compressed_flag_on_plain_data"] = (edit(small, 10, struct.pack("<H", 1)), E.UnsupportedCompression)
    out["reserved_header"] = (edit(small, 12, struct.pack("<I", 7)), E.HeaderCorrupt)
    out["payload_too_large"] = (edit(small, 48, struct.pack("<Q", 1 << 50)), E.LimitExceeded)
    out["payload_flip"] = (
        edit(small, len(small) - 30, bytes([small[-30] ^ 1]), header=False, payload=False),
        E.PayloadCorrupt,
    )
    out["end_marker"] = (edit(small, len(small) - 1, b"\x00", header=False, payload=False), E.BadEndMarker)
    out["metadata_overrun"] = (edit(small, 64, struct.pack("<I", 1 << 20)), E.MetadataInvalid)
    out["metadata_too_large"] = (edit(small, 64, struct.pack("<I", 1 << 30)), E.LimitExceeded)
    rec = _layer_record_offset(small, 1)
    out["unknown_dtype"] = (edit(small, rec + 5, b"\x09"), E.MetadataInvalid)
    out["unknown_role"] = (edit(small, rec + 4, b"\x07"), E.MetadataInvalid)
    out["layer_reserved_nonzero"] = (edit(small, rec + 7, b"\x01"), E.MetadataInvalid)
    out["layer_holds_too_many"] = (edit(small, rec + 24, struct.pack("<I", 6)), E.InconsistentState)
    out["zero_heads"] = (edit(small, rec + 8, struct.pack("<I", 0)), E.InconsistentState)
    # position below n_tokens: the first state field after the config
    cfg_len_off = 68 + 4 + 2 + len("model") + 24
    cfg_len = struct.unpack_from("<I", small, cfg_len_off)[0]
    state_off = cfg_len_off + 4 + cfg_len
    out["position_below_tokens"] = (edit(small, state_off + 4, struct.pack("<Q", 2)), E.InconsistentState)
    out["negative_token"] = (edit(small, state_off + 12, struct.pack("<i", -5)), E.MetadataInvalid)
    cp_off = state_off + 12 + 4 * 5 + 4
    out["checkpoint_past_end"] = (edit(small, cp_off, struct.pack("<I", 6)), E.InconsistentState)
    out["config_not_canonical"] = (edit(small, cfg_len_off + 4, b" "), E.MetadataInvalid)
    out["model_list_mismatch"] = (
        edit(small, 68 + 4 + 2 + len("model"), struct.pack("<Q", 1)),
        E.MetadataInvalid,
    )
    mlen = struct.unpack_from("<I", small, 64)[0]
    out["padding_nonzero"] = (edit(small, 68 + mlen, b"\x01"), E.MetadataInvalid)
    # A window layer that claims to hold a full history: consistent layout sizes are kept by swapping
    # the record's window to 0 while it holds 4 of 6 tokens.
    mrec = _layer_record_offset(mixed, 0)
    out["window_inconsistent"] = (edit(mixed, mrec + 20, struct.pack("<I", 0)), E.InconsistentState)
    out["extra_size_mismatch"] = (
        edit(mixed, _layer_record_offset(mixed, 2) + 28, struct.pack("<Q", 13)),
        E.MetadataInvalid,
    )  # the geometry no longer adds up to the payload length
    out["too_many_layers"] = (
        edit(small, _layer_record_offset(small, 0) - 4, struct.pack("<I", 5000)),
        E.LimitExceeded,
    )
    out.update(bad_compressed_files())
    out.update(bad_authenticated_files())
    return out


# --- bad authenticated files (the mac_* ones are read with GOLDEN_KEY) ------------------------------------
def authenticated_bytes(name: str, key: SessionKey) -> bytes:
    """Golden session ``name`` written with ``key``."""
    ident, snap, parts = golden_sessions()[name]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "x.ssf"
        save(path, adapter_for(ident, snap, parts), block_size=GOLDEN_BLOCK_SIZE, key=key)
        return path.read_bytes()


def bad_authenticated_files() -> dict[str, tuple[bytes, type[E.SessionFileError]]]:
    small, _ = golden_bytes("small_f16")
    mac, _ = golden_bytes("small_f16_mac")
    tail = trailer_start(mac)
    out: dict[str, tuple[bytes, type[E.SessionFileError]]] = {}

    def flipped(offset: int) -> bytes:
        b = bytearray(mac)
        b[offset] ^= 1
        return bytes(b)

    # The flag set on a file whose trailer has no extension: 80 bytes short of what the header promises.
    out["authenticated_flag_without_extension"] = (
        refresh(small[:10] + struct.pack("<H", Flags.AUTHENTICATED) + small[12:], payload=False),
        E.Truncated,
    )
    out["mac_missing"] = (small, E.MacMissing)  # a valid file, but a reader with a key requires a MAC
    out["mac_wrong_key"] = (authenticated_bytes("small_f16", OTHER_KEY), E.MacWrongKey)
    out["mac_flipped"] = (flipped(tail + 64), E.MacMismatch)
    out["mac_key_id_flipped"] = (flipped(tail + 16), E.MacWrongKey)
    out["mac_payload_digest_flipped"] = (flipped(tail + 32), E.MacMismatch)
    out["mac_payload_hash_flipped"] = (
        flipped(tail),
        E.MacMismatch,
    )  # the MAC is checked before the payload hash
    # A data byte changed, the payload hash refreshed: only the MAC's payload digest (SHA-256) tells. The MAC is
    # recomputed with the key, so K1-K3 pass and K4 refuses; without the key, XXH3 alone would accept it.
    b = bytearray(mac)
    b[tail - 1] ^= 1
    out["mac_payload_digest_mismatch"] = (refresh(b, header=False, key=GOLDEN_KEY), E.PayloadNotAuthentic)
    assert (
        hashlib.sha256(out["mac_payload_digest_mismatch"][0][HEADER_SIZE:tail]).digest()
        != mac[tail + 32 : tail + 64]
    )
    return out


# --- bad compressed files -----------------------------------------------------------------------------
def zstd_split(data: bytes) -> tuple[bytes, list[bytes], list[int]]:
    """(bytes up to the first frame, the frames, the block table) of a compressed file."""
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "x.ssf"
        p.write_bytes(data)
        comp = inspect(p, verify=False).layout.compressed
    return data[: comp.frames_offset], [data[o : o + n] for o, n in comp.frames()], list(comp.frame_sizes)


def zstd_rebuild(head: bytes, frames: list[bytes], table: list[int] | None = None) -> bytes:
    """A compressed file from its parts: payload length, payload hash and header hash made consistent."""
    table = [len(f) for f in frames] if table is None else table
    b = bytearray(head + b"".join(frames) + b"".join(BLOCK_ENTRY_STRUCT.pack(n) for n in table))
    b += bytes(16) + END_MARKER
    struct.pack_into("<Q", b, 48, len(b) - HEADER_SIZE - TRAILER_SIZE)
    return refresh(b)


def bad_compressed_files() -> dict[str, tuple[bytes, type[E.SessionFileError]]]:
    import zstandard

    data, _ = golden_bytes("kv_f16_zstd")
    head, frames, table = zstd_split(data)
    section = len(head) - 16  # the compression header's offset
    out: dict[str, tuple[bytes, type[E.SessionFileError]]] = {}

    def head_edit(rel: int, new: bytes) -> bytes:
        h = bytearray(head)
        h[section + rel : section + rel + len(new)] = new
        return bytes(h)

    out["zstd_unknown_codec"] = (
        zstd_rebuild(head_edit(0, struct.pack("<H", 2)), frames),
        E.UnsupportedCompression,
    )
    out["zstd_reserved_nonzero"] = (
        zstd_rebuild(head_edit(2, struct.pack("<H", 1)), frames),
        E.CompressionInvalid,
    )
    out["zstd_block_size_too_small"] = (
        zstd_rebuild(head_edit(8, struct.pack("<I", 2048)), frames),
        E.CompressionInvalid,
    )
    out["zstd_block_size_over_limit"] = (
        zstd_rebuild(head_edit(8, struct.pack("<I", 1 << 27)), frames),
        E.LimitExceeded,
    )
    out["zstd_block_count_mismatch"] = (
        zstd_rebuild(head_edit(12, struct.pack("<I", len(frames) + 1)), frames),
        E.CompressionInvalid,
    )
    out["zstd_too_many_blocks"] = (
        zstd_rebuild(head_edit(12, struct.pack("<I", 1 << 23)), frames),
        E.LimitExceeded,
    )
    out["zstd_table_does_not_fit"] = (zstd_rebuild(head, [], []), E.CompressionInvalid)
    out["zstd_index_out_of_range"] = (
        zstd_rebuild(head, frames, [table[0], 0x7FFFFFFF, *table[2:]]),
        E.CompressionInvalid,
    )
    out["zstd_index_zero"] = (zstd_rebuild(head, frames, [0, *table[1:]]), E.CompressionInvalid)
    out["zstd_sizes_do_not_add_up"] = (
        zstd_rebuild(head, frames, [table[0] - 1, *table[1:]]),
        E.CompressionInvalid,
    )
    broken = bytes([frames[1][0] ^ 0xFF]) + frames[1][1:]  # the frame's magic number
    out["zstd_bad_frame"] = (zstd_rebuild(head, [frames[0], broken, *frames[2:]]), E.FrameCorrupt)
    out["zstd_frame_trailing_bytes"] = (
        zstd_rebuild(head, [frames[0], frames[1] + b"\0", *frames[2:]]),
        E.FrameCorrupt,
    )
    # Block 1 re-encoded one byte short: a valid frame that declares 4095 bytes where the block holds 4096.
    block1 = zstandard.ZstdDecompressor().decompress(frames[1])
    short = zstandard.ZstdCompressor(level=3, write_checksum=False).compress(block1[:-1])
    out["zstd_decompressed_size_mismatch"] = (
        zstd_rebuild(head, [frames[0], short, *frames[2:]]),
        E.DecompressedSizeMismatch,
    )
    unsized = zstandard.ZstdCompressor(level=3, write_content_size=False).compress(block1)
    out["zstd_frame_size_not_declared"] = (
        zstd_rebuild(head, [frames[0], unsized, *frames[2:]]),
        E.DecompressedSizeMismatch,
    )
    return out


def write_all() -> None:
    GOLDEN_DIR.mkdir(parents=True, exist_ok=True)
    BAD_DIR.mkdir(parents=True, exist_ok=True)
    for name in golden_sessions():
        data, expected = golden_bytes(name)
        (GOLDEN_DIR / f"{name}.ssf").write_bytes(data)
        (GOLDEN_DIR / f"{name}.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    table = {}
    for name, (data, cls) in bad_files().items():
        (BAD_DIR / f"{name}.ssf").write_bytes(data)
        table[f"{name}.ssf"] = cls.reason
    (BAD_DIR / "expected.json").write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    write_all()
    print(f"wrote {GOLDEN_DIR} and {BAD_DIR}", file=sys.stderr)
