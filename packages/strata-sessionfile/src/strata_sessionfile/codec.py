"""Encoding and decoding of the header and the metadata section; the layout of the data section.

Every read here is bounds-checked before it is trusted: a length is compared with the bytes left and
with its named limit before anything is sliced or allocated.
"""

from __future__ import annotations

import array
import json
import struct
import sys

import xxhash

from . import errors as E
from .format import (
    DATA_ALIGNMENT,
    DTYPES,
    END_MARKER,
    FORMAT_VERSION,
    HEADER_HASHED_SIZE,
    HEADER_SIZE,
    HEADER_STRUCT,
    KNOWN_FLAGS,
    LAYER_STRUCT,
    LIMIT,
    MAGIC,
    MODEL_FILE_FIXED,
    TRAILER_SIZE,
    DType,
    LayerRole,
    Part,
    align_up,
)
from .identity import canonical_config, config_identity_from_canonical, model_identity_from_files
from .records import (
    Checkpoint,
    ConfigIdentity,
    Header,
    LayerGeometry,
    LayerSpec,
    Layout,
    ModelFile,
    ModelIdentity,
    PartExtent,
    RunningState,
    SessionMetadata,
    token_bytes,
)

METADATA_OFFSET = HEADER_SIZE
_U32 = struct.Struct("<I")
_U16 = struct.Struct("<H")
_U64 = struct.Struct("<Q")
_STATE_FIXED = struct.Struct("<IQ")  # n_tokens, position
_CHECKPOINT_FIXED = struct.Struct("<II")  # token_index, data length


# --- header -----------------------------------------------------------------------------------------
def header_hash(first56: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(first56)


def encode_header(model_fp: bytes, config_fp: bytes, payload_length: int, flags: int = 0) -> bytes:
    provisional = HEADER_STRUCT.pack(MAGIC, FORMAT_VERSION, flags, 0, model_fp, config_fp, payload_length, 0)
    return provisional[:HEADER_HASHED_SIZE] + _U64.pack(header_hash(provisional[:HEADER_HASHED_SIZE]))


def decode_header(raw: bytes, *, path: str | None = None) -> Header:
    """Validate and decode the 64 header bytes (rules H1-H6 of the spec)."""
    if len(raw) < HEADER_SIZE:
        raise E.Truncated(
            f"file is {len(raw)} bytes, shorter than the {HEADER_SIZE}-byte header",
            path=path,
            offset=len(raw),
        )
    magic, version, flags, reserved, model_fp, config_fp, payload_length, stored_hash = HEADER_STRUCT.unpack(
        raw[:HEADER_SIZE]
    )
    if magic != MAGIC:
        raise E.BadMagic(f"magic is {magic!r}, expected {MAGIC!r}", path=path, offset=0, field="magic")
    computed = header_hash(raw[:HEADER_HASHED_SIZE])
    if computed != stored_hash:
        raise E.HeaderCorrupt(
            f"header hash {stored_hash:#018x} does not match the header bytes ({computed:#018x})",
            path=path,
            offset=56,
            field="header_hash",
        )
    if version != FORMAT_VERSION:
        raise E.UnsupportedVersion(
            f"format version {version}; this reader supports {FORMAT_VERSION}",
            path=path,
            offset=8,
            field="format_version",
        )
    if flags & ~int(KNOWN_FLAGS):
        raise E.UnsupportedFlags(
            f"flags {flags:#06x} set bits this reader does not know", path=path, offset=10, field="flags"
        )
    if reserved != 0:
        raise E.HeaderCorrupt(
            f"reserved header field is {reserved:#x}, must be 0", path=path, offset=12, field="reserved"
        )
    if payload_length > LIMIT["MAX_PAYLOAD_BYTES"]:
        raise E.LimitExceeded(
            f"payload length {payload_length} is over MAX_PAYLOAD_BYTES",
            path=path,
            offset=48,
            field="payload_length",
        )
    return Header(version, flags, model_fp, config_fp, payload_length, stored_hash)


def encode_trailer(payload_digest: bytes, extension: bytes = b"") -> bytes:
    """The trailer: payload hash, the authentication extension of an authenticated file, end marker."""
    return payload_digest + extension + END_MARKER


def decode_trailer(raw: bytes, trailer_offset: int, *, path: str | None = None) -> bytes:
    """The payload hash of a trailer (24 bytes, or 104 with the authentication extension; rule M11)."""
    if len(raw) < TRAILER_SIZE:
        raise E.Truncated(
            f"trailer is {len(raw)} bytes, expected at least {TRAILER_SIZE}", path=path, offset=trailer_offset
        )
    digest, marker = bytes(raw[:16]), bytes(raw[-8:])
    if marker != END_MARKER:
        raise E.BadEndMarker(
            f"end marker is {marker!r}, expected {END_MARKER!r}",
            path=path,
            offset=trailer_offset + len(raw) - 8,
            field="end_marker",
        )
    return digest


# --- metadata: encode -------------------------------------------------------------------------------
def _check(cond: bool, exc_cls, message: str, field: str) -> None:
    if not cond:
        raise exc_cls(message, field=field)


def validate_snapshot_shape(state: RunningState, layers, exc_cls=E.InvalidSnapshot) -> None:
    """The format rules a writer must obey (the reader enforces the same ones, rules M*)."""
    n = state.n_tokens
    _check(n <= LIMIT["MAX_TOKENS"], exc_cls, f"{n} tokens is over MAX_TOKENS", "state.n_tokens")
    _check(
        0 <= state.position <= LIMIT["MAX_POSITION"],
        exc_cls,
        f"position {state.position} out of range",
        "state.position",
    )
    _check(
        state.position >= n,
        exc_cls,
        f"position {state.position} is below the {n} tokens held",
        "state.position",
    )
    for name, value, limit in (
        ("state.sampler_state", state.sampler_state, "MAX_SAMPLER_STATE_BYTES"),
        ("state.checkpoint.data", state.checkpoint.data, "MAX_CHECKPOINT_DATA_BYTES"),
        ("state.engine_fields", state.engine_fields, "MAX_ENGINE_FIELDS_BYTES"),
    ):
        _check(len(value) <= LIMIT[limit], exc_cls, f"{len(value)} bytes is over {limit}", name)
    _check(
        0 <= state.checkpoint.token_index <= n,
        exc_cls,
        f"checkpoint token index {state.checkpoint.token_index} is past the {n} tokens held",
        "state.checkpoint.token_index",
    )
    _check(len(layers) <= LIMIT["MAX_LAYERS"], exc_cls, f"{len(layers)} layers is over MAX_LAYERS", "layers")
    # Messages are formatted only for a failure (bench/sessionfile/DECISIONS.md, "Metadata decoding").
    seen = set()
    max_heads, max_dim, max_tokens, max_extra = (
        LIMIT["MAX_KV_HEADS"],
        LIMIT["MAX_HEAD_DIM"],
        LIMIT["MAX_TOKENS"],
        LIMIT["MAX_EXTRA_BYTES"],
    )
    for i, g in enumerate(layers):
        s = g.spec
        key = (s.role, s.index)
        if key in seen:
            raise exc_cls(f"layer {s.role.name.lower()} {s.index} appears twice", field=f"layers[{i}]")
        seen.add(key)
        if not 1 <= s.n_kv_heads <= max_heads:
            raise exc_cls(f"n_kv_heads {s.n_kv_heads} out of range", field=f"layers[{i}].n_kv_heads")
        for name, d in (("head_dim_k", s.head_dim_k), ("head_dim_v", s.head_dim_v)):
            if not 1 <= d <= max_dim:
                raise exc_cls(f"{name} {d} out of range", field=f"layers[{i}].{name}")
        if not 0 <= s.window <= max_tokens:
            raise exc_cls(f"window {s.window} out of range", field=f"layers[{i}].window")
        if not 0 <= s.extra_bytes <= max_extra:
            raise exc_cls(
                f"extra part of {s.extra_bytes} bytes is over MAX_EXTRA_BYTES",
                field=f"layers[{i}].extra_bytes",
            )
        cap = s.capacity(n)
        if s.role is LayerRole.MAIN:
            if g.tokens_held != cap:
                raise exc_cls(
                    f"main layer {s.index} holds {g.tokens_held} tokens; with {n} tokens held and window "
                    f"{s.window} it must hold {cap}",
                    field=f"layers[{i}].tokens_held",
                )
        elif not 0 <= g.tokens_held <= cap:
            raise exc_cls(
                f"draft layer {s.index} holds {g.tokens_held} tokens, more than {cap}",
                field=f"layers[{i}].tokens_held",
            )


def encode_metadata(
    model: ModelIdentity, config: ConfigIdentity, state: RunningState, layers: tuple[LayerGeometry, ...]
) -> bytes:
    """The metadata section: u32 length, then the fields of spec table "Metadata" (no padding)."""
    validate_snapshot_shape(state, layers)
    parts: list[bytes | memoryview] = [_U32.pack(len(model.files))]
    for mf in model.files:
        role = mf.role.encode("utf-8")
        parts += [_U16.pack(len(role)), role, MODEL_FILE_FIXED.pack(mf.size, mf.digest)]
    parts += [_U32.pack(len(config.canonical)), config.canonical]
    parts += [_STATE_FIXED.pack(state.n_tokens, state.position), token_bytes(state.tokens)]
    parts += [_U32.pack(len(state.sampler_state)), state.sampler_state]
    parts += [
        _CHECKPOINT_FIXED.pack(state.checkpoint.token_index, len(state.checkpoint.data)),
        state.checkpoint.data,
    ]
    parts += [_U32.pack(len(state.engine_fields)), state.engine_fields]
    parts.append(_U32.pack(len(layers)))
    for g in layers:
        s = g.spec
        parts.append(
            LAYER_STRUCT.pack(
                s.index,
                s.role,
                s.k_dtype,
                s.v_dtype,
                0,
                s.n_kv_heads,
                s.head_dim_k,
                s.head_dim_v,
                s.window,
                g.tokens_held,
                s.extra_bytes,
            )
        )
    body_length = sum(len(p) for p in parts)
    if body_length > LIMIT["MAX_METADATA_BYTES"]:
        raise E.InvalidSnapshot(f"metadata is {body_length} bytes, over MAX_METADATA_BYTES", field="metadata")
    return b"".join([_U32.pack(body_length), *parts])  # one copy of the (possibly MiB-sized) checkpoint


# --- metadata: decode -------------------------------------------------------------------------------
class _Cursor:
    """Reads fields from the metadata body; every read is bounds-checked against the body's end."""

    def __init__(self, body: memoryview, base: int, path: str | None) -> None:
        self.body = body
        self.pos = 0
        self.base = base  # file offset of body[0]
        self.path = path

    def offset(self) -> int:
        return self.base + self.pos

    def fail(self, cls, message: str, field: str, at: int | None = None):
        return cls(message, path=self.path, offset=self.offset() if at is None else at, field=field)

    def take(self, n: int, field: str) -> memoryview:
        if n > len(self.body) - self.pos:
            raise self.fail(
                E.MetadataInvalid,
                f"{n} bytes of {field} run past the end of the metadata ({len(self.body) - self.pos} left)",
                field,
            )
        out = self.body[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, st: struct.Struct, field: str) -> tuple:
        return st.unpack(self.take(st.size, field))

    def u32(self, field: str) -> int:
        return self.unpack(_U32, field)[0]

    def sized(self, field: str, limit_name: str, engine_limit: int | None = None) -> bytes:
        at = self.offset()
        (n,) = self.unpack(_U32, field + ".length")
        if n > LIMIT[limit_name]:
            raise self.fail(
                E.LimitExceeded, f"{field} is {n} bytes, over {limit_name} ({LIMIT[limit_name]})", field, at
            )
        if engine_limit is not None and n > engine_limit:
            raise self.fail(
                E.LimitExceeded, f"{field} is {n} bytes, over the engine's limit of {engine_limit}", field, at
            )
        return bytes(self.take(n, field))


def decode_metadata(
    body: memoryview | bytes,
    *,
    header: Header,
    path: str | None = None,
    base: int = METADATA_OFFSET + 4,
    known_config: bytes | None = None,
) -> SessionMetadata:
    """Decode and validate the metadata body (the bytes after its u32 length); rules M1-M12.

    ``known_config``: canonical config bytes known to be canonical (the restoring engine's own): a file
    whose config is exactly these bytes is not parsed and re-encoded to check it (bench/sessionfile/DECISIONS.md,
    "Metadata decoding")."""
    cur = _Cursor(memoryview(body), base, path)

    at = cur.offset()
    n_files = cur.u32("model.n_files")
    if n_files > LIMIT["MAX_MODEL_FILES"]:
        raise cur.fail(E.LimitExceeded, f"{n_files} model files is over MAX_MODEL_FILES", "model.n_files", at)
    files = []
    for i in range(n_files):
        (rlen,) = cur.unpack(_U16, f"model.files[{i}].role.length")
        if not 1 <= rlen <= LIMIT["MAX_ROLE_BYTES"]:
            raise cur.fail(
                E.MetadataInvalid,
                f"role length {rlen} out of 1..{LIMIT['MAX_ROLE_BYTES']}",
                f"model.files[{i}].role",
            )
        raw_role = bytes(cur.take(rlen, f"model.files[{i}].role"))
        try:
            role = raw_role.decode("utf-8")
        except UnicodeDecodeError:
            raise cur.fail(E.MetadataInvalid, "role is not UTF-8", f"model.files[{i}].role") from None
        size, digest = cur.unpack(MODEL_FILE_FIXED, f"model.files[{i}]")
        files.append(ModelFile(role, size, digest))
    model = model_identity_from_files(files)
    if model.fingerprint != header.model_fingerprint:
        raise E.MetadataInvalid(
            "the model file list does not hash to the header's model fingerprint",
            path=path,
            offset=base,
            field="model",
        )

    at = cur.offset()
    canonical = cur.sized("config", "MAX_CONFIG_BYTES")
    try:
        ok = canonical == known_config
        if not ok:
            mapping = json.loads(canonical.decode("utf-8"))
            ok = isinstance(mapping, dict) and canonical_config(mapping) == canonical
    except (UnicodeDecodeError, ValueError, RecursionError):
        ok = False
    if not ok:
        raise cur.fail(E.MetadataInvalid, "config is not canonical JSON of an object", "config", at)
    config = config_identity_from_canonical(canonical)
    if config.fingerprint != header.config_fingerprint:
        raise cur.fail(
            E.MetadataInvalid, "the config does not hash to the header's config fingerprint", "config", at
        )

    at = cur.offset()
    n_tokens, position = cur.unpack(_STATE_FIXED, "state")
    if n_tokens > LIMIT["MAX_TOKENS"]:
        raise cur.fail(E.LimitExceeded, f"{n_tokens} tokens is over MAX_TOKENS", "state.n_tokens", at)
    raw_tokens = cur.take(4 * n_tokens, "state.tokens")
    tokens = array.array("i")
    tokens.frombytes(raw_tokens)
    if sys.byteorder != "little":
        tokens.byteswap()
    # A negative id's sign bit is the top bit of its 4th byte (bench/sessionfile/DECISIONS.md, "Token ids").
    if not bytes(raw_tokens)[3::4].isascii():
        raise cur.fail(E.MetadataInvalid, "a token id is negative", "state.tokens", at + 12)
    sampler = cur.sized("state.sampler_state", "MAX_SAMPLER_STATE_BYTES")
    at = cur.offset()
    cp_index, cp_len = cur.unpack(_CHECKPOINT_FIXED, "state.checkpoint")
    if cp_len > LIMIT["MAX_CHECKPOINT_DATA_BYTES"]:
        raise cur.fail(
            E.LimitExceeded,
            f"checkpoint data of {cp_len} bytes is over MAX_CHECKPOINT_DATA_BYTES",
            "state.checkpoint.data",
            at,
        )
    # A view, not a copy: the checkpoint may be megabytes (a ring's window of K/V).
    cp_data = cur.take(cp_len, "state.checkpoint.data").toreadonly()
    engine_fields = cur.sized("state.engine_fields", "MAX_ENGINE_FIELDS_BYTES")
    state = RunningState(tokens, position, sampler, Checkpoint(cp_index, cp_data), engine_fields)

    at = cur.offset()
    n_layers = cur.u32("layers.count")
    if n_layers > LIMIT["MAX_LAYERS"]:
        raise cur.fail(E.LimitExceeded, f"{n_layers} layers is over MAX_LAYERS", "layers.count", at)
    layers = []
    for i in range(n_layers):
        at = cur.offset()
        (index, role, k_dtype, v_dtype, reserved, heads, dk, dv, window, held, extra) = cur.unpack(
            LAYER_STRUCT, f"layers[{i}]"
        )
        if role not in LayerRole._value2member_map_:
            raise cur.fail(E.MetadataInvalid, f"unknown layer role code {role}", f"layers[{i}].role", at + 4)
        for name, code, off in (("k_dtype", k_dtype, 5), ("v_dtype", v_dtype, 6)):
            if code not in DType._value2member_map_:
                raise cur.fail(
                    E.MetadataInvalid, f"unknown dtype code {code}", f"layers[{i}].{name}", at + off
                )
        if reserved:
            raise cur.fail(E.MetadataInvalid, "reserved byte is not 0", f"layers[{i}].reserved", at + 7)
        if held > LIMIT["MAX_TOKENS"]:
            raise cur.fail(
                E.LimitExceeded, f"tokens_held {held} over MAX_TOKENS", f"layers[{i}].tokens_held", at
            )
        spec = LayerSpec(index, role, heads, dk, dv, k_dtype, v_dtype, window, extra)
        layers.append(LayerGeometry(spec, held))
    if cur.pos != len(cur.body):
        raise cur.fail(
            E.MetadataInvalid,
            f"{len(cur.body) - cur.pos} bytes left after the last layer record",
            "metadata.length",
        )
    try:
        validate_snapshot_shape(state, layers, exc_cls=E.InconsistentState)
    except E.SessionFileError as exc:
        exc.path = path
        raise
    return SessionMetadata(model, config, state, tuple(layers))


# --- layout -----------------------------------------------------------------------------------------
def compute_layout(
    metadata_length: int, layers: tuple[LayerGeometry, ...], trailer_size: int = TRAILER_SIZE
) -> Layout:
    """Offsets of the data section and every non-empty part, from the metadata length and the geometry (and
    the trailer's size: larger in an authenticated file)."""
    data_offset = align_up(METADATA_OFFSET + 4 + metadata_length, DATA_ALIGNMENT)
    extents = []
    pos = 0
    for li, g in enumerate(layers):
        for part in Part:
            size = g.part_size(part)
            if size:
                extents.append(PartExtent(li, part, pos, size))
                pos += size
    trailer_offset = data_offset + pos
    return Layout(
        METADATA_OFFSET,
        metadata_length,
        data_offset,
        pos,
        trailer_offset,
        trailer_offset + trailer_size,
        tuple(extents),
    )


def payload_length_of(layout: Layout) -> int:
    return layout.trailer_offset - HEADER_SIZE


def dtype_name(code: DType) -> str:
    return DTYPES[code].name
