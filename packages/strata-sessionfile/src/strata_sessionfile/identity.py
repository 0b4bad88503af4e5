"""Identity: the model fingerprint (sampled model files, by role) and the config fingerprint.

Model fingerprint (spec "Model fingerprint"): for each (role, path) in the order given, a per-file
digest = XXH3-128 over MODEL_FILE_DOMAIN, the file size (u64 LE), the metadata block, and 16 fixed
samples of 64 KiB. The metadata block is, for a GGUF file, bytes [0, end of the tensor-info table);
for any other file (or a GGUF whose header cannot be walked) its first 1 MiB. The fingerprint is
XXH3-128 over MODEL_FINGERPRINT_DOMAIN and, per file, u16 role length, role (UTF-8), u64 size, digest.

Config fingerprint: XXH3-128 over CONFIG_FINGERPRINT_DOMAIN and the canonical JSON of the engine's
mapping (keys sorted, no whitespace, UTF-8, integers as integers, floats as Python's shortest
round-trip repr, no NaN/Infinity). The canonical bytes are stored in the file so a refusal can name
the keys that differ.
"""

from __future__ import annotations

import collections
import json
import math
import os
import struct
import threading
from collections.abc import Mapping, Sequence

import xxhash

from .format import CONFIG_FINGERPRINT_DOMAIN, LIMIT, MODEL_FILE_DOMAIN, MODEL_FINGERPRINT_DOMAIN
from .records import ConfigIdentity, EngineIdentity, ModelFile, ModelIdentity

SAMPLE_COUNT = 16
SAMPLE_SIZE = 64 << 10
OPAQUE_METADATA_SIZE = 1 << 20
GGUF_MAGIC = b"GGUF"
MAX_GGUF_METADATA = 256 << 20  # a GGUF header walk stops here and falls back to the opaque prefix

# GGUF value type code -> fixed size (strings = 8, arrays = 9 handled apart).
_GGUF_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def sample_offsets(size: int) -> list[int]:
    """The 16 sample offsets: evenly spaced from 0 to size - 64 KiB, both ends included."""
    if size <= SAMPLE_SIZE:
        return [0]
    last = size - SAMPLE_SIZE
    return [last * i // (SAMPLE_COUNT - 1) for i in range(SAMPLE_COUNT)]


class _GGUFWalkError(Exception):
    pass


def gguf_metadata_end(f) -> int:
    """Offset just past the tensor-info table of a GGUF v2/v3 file (raises _GGUFWalkError if not one)."""
    f.seek(0)
    head = f.read(24)
    if len(head) < 24 or head[:4] != GGUF_MAGIC:
        raise _GGUFWalkError("not GGUF")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
    if version not in (2, 3) or n_tensors > 1 << 24 or n_kv > 1 << 24:
        raise _GGUFWalkError("unsupported GGUF header")
    pos = 24

    def read(n: int) -> bytes:
        nonlocal pos
        if pos + n > MAX_GGUF_METADATA:
            raise _GGUFWalkError("metadata too large")
        data = f.read(n)
        if len(data) != n:
            raise _GGUFWalkError("short")
        pos += n
        return data

    def skip(n: int) -> None:
        nonlocal pos
        if pos + n > MAX_GGUF_METADATA:
            raise _GGUFWalkError("metadata too large")
        pos += n
        f.seek(pos)

    def skip_value(vtype: int) -> None:
        if vtype in _GGUF_SCALAR_SIZES:
            skip(_GGUF_SCALAR_SIZES[vtype])
        elif vtype == 8:
            (n,) = struct.unpack("<Q", read(8))
            skip(n)
        elif vtype == 9:
            etype, count = struct.unpack("<IQ", read(12))
            if etype in _GGUF_SCALAR_SIZES:
                skip(_GGUF_SCALAR_SIZES[etype] * count)
            else:
                for _ in range(count):
                    skip_value(etype)
        else:
            raise _GGUFWalkError(f"bad value type {vtype}")

    for _ in range(n_kv):
        (klen,) = struct.unpack("<Q", read(8))
        skip(klen)
        (vtype,) = struct.unpack("<I", read(4))
        skip_value(vtype)
    for _ in range(n_tensors):
        (nlen,) = struct.unpack("<Q", read(8))
        skip(nlen)
        (n_dims,) = struct.unpack("<I", read(4))
        if n_dims > 8:
            raise _GGUFWalkError("bad n_dims")
        skip(8 * n_dims + 4 + 8)
    return pos


class _DigestCache:
    """Digests of the model files this process already fingerprinted, keyed on what changes when a file
    does: (device, inode, size, mtime_ns, ctime_ns). A model file does not change while an engine has it
    loaded, yet an engine that builds its identity per SAVE / RESTORE would re-read its sampled megabytes
    each time (bench/sessionfile/DECISIONS.md, "Model digests"); a file rewritten or replaced in place gets a
    new key and is read again. Bounded (least recently used out first) and thread-safe."""

    MAX_ENTRIES = 64

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: collections.OrderedDict[tuple, bytes] = collections.OrderedDict()

    def get(self, key: tuple) -> bytes | None:
        with self._lock:
            digest = self._items.get(key)
            if digest is not None:
                self._items.move_to_end(key)
            return digest

    def put(self, key: tuple, digest: bytes) -> None:
        with self._lock:
            self._items[key] = digest
            self._items.move_to_end(key)
            while len(self._items) > self.MAX_ENTRIES:
                self._items.popitem(last=False)


_DIGESTS = _DigestCache()


def _file_key(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def model_file_digest(path: str | os.PathLike) -> tuple[int, bytes]:
    """(size, 16-byte digest) of one model file, per the spec's sampling rule (cached per process for an
    unchanged file, see _DigestCache)."""
    with open(path, "rb", buffering=0) as f:
        st = os.fstat(f.fileno())
        key = _file_key(st)
        cached = _DIGESTS.get(key)
        if cached is not None:
            return st.st_size, cached
        size, digest = _sampled_digest(f, st.st_size)
        if _file_key(os.fstat(f.fileno())) == key:  # not cached if the file changed while it was read
            _DIGESTS.put(key, digest)
    return size, digest


def _sampled_digest(f, size: int) -> tuple[int, bytes]:
    """The spec's per-file digest of the open file `f` of `size` bytes."""
    h = xxhash.xxh3_128()
    h.update(MODEL_FILE_DOMAIN)
    h.update(struct.pack("<Q", size))
    try:
        meta_end = gguf_metadata_end(f)
    except _GGUFWalkError:
        meta_end = min(size, OPAQUE_METADATA_SIZE)
    f.seek(0)
    remaining = meta_end
    while remaining:
        chunk = f.read(min(remaining, 4 << 20))
        if not chunk:
            break
        h.update(chunk)
        remaining -= len(chunk)
    for off in sample_offsets(size):
        h.update(os.pread(f.fileno(), SAMPLE_SIZE, off))
    return size, h.digest()


def model_identity_from_files(files: Sequence[ModelFile]) -> ModelIdentity:
    h = xxhash.xxh3_128()
    h.update(MODEL_FINGERPRINT_DOMAIN)
    for mf in files:
        role = mf.role.encode("utf-8")
        if not role or len(role) > LIMIT["MAX_ROLE_BYTES"]:
            raise ValueError(f"model file role {mf.role!r} must be 1..{LIMIT['MAX_ROLE_BYTES']} UTF-8 bytes")
        h.update(struct.pack("<H", len(role)) + role + struct.pack("<Q", mf.size) + mf.digest)
    return ModelIdentity(h.digest(), tuple(files))


def model_fingerprint(files: Sequence[tuple[str, str | os.PathLike]]) -> ModelIdentity:
    """The model identity of every file an engine loads, given as (role, path) in load order."""
    if len(files) > LIMIT["MAX_MODEL_FILES"]:
        raise ValueError(f"{len(files)} model files is over MAX_MODEL_FILES")
    out = []
    for role, path in files:
        size, digest = model_file_digest(path)
        out.append(ModelFile(role, size, digest))
    return model_identity_from_files(out)


def _check_json_value(value, where: str):
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"config key {k!r} at {where or '<root>'} is not a string")
            out[k] = _check_json_value(v, f"{where}.{k}" if where else k)
        return out
    if isinstance(value, (list, tuple)):
        return [_check_json_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"config value at {where} is not finite")
        return value
    raise ValueError(f"config value at {where} has unsupported type {type(value).__name__}")


def canonical_config(mapping: Mapping) -> bytes:
    """The canonical JSON bytes of a config mapping (see module docstring)."""
    checked = _check_json_value(mapping, "")
    return json.dumps(
        checked, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def config_identity_from_canonical(canonical: bytes) -> ConfigIdentity:
    return ConfigIdentity(xxhash.xxh3_128_digest(CONFIG_FINGERPRINT_DOMAIN + canonical), canonical)


def config_fingerprint(mapping: Mapping) -> ConfigIdentity:
    """The config identity (fingerprint and canonical bytes) of an engine's config mapping."""
    canonical = canonical_config(mapping)
    if len(canonical) > LIMIT["MAX_CONFIG_BYTES"]:
        raise ValueError(f"canonical config is {len(canonical)} bytes, over MAX_CONFIG_BYTES")
    return config_identity_from_canonical(canonical)


def engine_identity(model_files: Sequence[tuple[str, str | os.PathLike]], config: Mapping) -> EngineIdentity:
    return EngineIdentity(model_fingerprint(model_files), config_fingerprint(config))


def _flatten(value, prefix: str, out: dict) -> None:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else k, out)
    else:
        out[prefix or "<root>"] = value


def config_differences(file_mapping: Mapping, engine_mapping: Mapping) -> list[str]:
    """Human-readable differences, one per dotted key: "kv_type: file 'f16', engine 'int8'"."""
    a: dict = {}
    b: dict = {}
    _flatten(file_mapping, "", a)
    _flatten(engine_mapping, "", b)
    diffs = []
    for key in sorted(set(a) | set(b)):
        if key not in b:
            diffs.append(f"{key}: file {a[key]!r}, engine has no such key")
        elif key not in a:
            diffs.append(f"{key}: file has no such key, engine {b[key]!r}")
        elif a[key] != b[key] or type(a[key]) is not type(b[key]):
            diffs.append(f"{key}: file {a[key]!r}, engine {b[key]!r}")
    return diffs


def model_differences(file_model: ModelIdentity, engine_model: ModelIdentity) -> list[str]:
    diffs = []
    fa, fb = file_model.files, engine_model.files
    if len(fa) != len(fb):
        diffs.append(f"model files: file lists {len(fa)}, engine loads {len(fb)}")
    for i, (x, y) in enumerate(zip(fa, fb, strict=False)):
        if x.role != y.role:
            diffs.append(f"model file {i} role: file {x.role!r}, engine {y.role!r}")
        elif x.size != y.size:
            diffs.append(f"model file {i} ({x.role}) size: file {x.size}, engine {y.size}")
        elif x.digest != y.digest:
            diffs.append(
                f"model file {i} ({x.role}) sampled digest differs: file {x.digest.hex()}, "
                f"engine {y.digest.hex()}"
            )
    return diffs
