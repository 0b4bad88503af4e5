"""Format v1 constants: magic, header layout, enums whose values are the on-disk codes, named limits.

spec/session-file-v1.md is normative; tests/sessionfile/test_spec_binding.py binds its tables to these
names so the two cannot drift.
"""

from __future__ import annotations

import enum
import struct

import attrs

# --- framing ----------------------------------------------------------------------------------------
MAGIC = b"\x89STRSES\n"  # 8 bytes; the high byte and the newline catch 7-bit and text-mode damage
END_MARKER = b"\nSESEND\x89"  # 8 bytes, the last bytes of every file
FORMAT_VERSION = 1
HEADER_SIZE = 64
TRAILER_SIZE = 24  # payload hash (16) + end marker (8)
DATA_ALIGNMENT = 4096  # the K/V data starts at a file offset that is a multiple of this
DEFAULT_BLOCK_SIZE = 16 << 20

# Header: offset, size, struct code, field name (spec table "Header").
HEADER_FIELDS: tuple[tuple[int, int, str, str], ...] = (
    (0, 8, "8s", "magic"),
    (8, 2, "H", "format_version"),
    (10, 2, "H", "flags"),
    (12, 4, "I", "reserved"),
    (16, 16, "16s", "model_fingerprint"),
    (32, 16, "16s", "config_fingerprint"),
    (48, 8, "Q", "payload_length"),
    (56, 8, "Q", "header_hash"),
)
HEADER_STRUCT = struct.Struct("<" + "".join(code for _, _, code, _ in HEADER_FIELDS))
HEADER_HASHED_SIZE = 56  # header_hash = XXH3-64 (seed 0) of header bytes [0, 56)
assert HEADER_STRUCT.size == HEADER_SIZE

TRAILER_STRUCT = struct.Struct(
    "<16s8s"
)  # payload_hash (XXH3-128 digest, big-endian as xxhash gives it), end marker
assert TRAILER_STRUCT.size == TRAILER_SIZE

# The trailer extension of an authenticated file (flag AUTHENTICATED, spec section 4.1), between the payload
# hash and the end marker: key id, payload digest (SHA-256 of the payload), MAC (HMAC-SHA256).
AUTH_EXTENSION_STRUCT = struct.Struct("<16s32s32s")
AUTH_TRAILER_SIZE = TRAILER_SIZE + AUTH_EXTENSION_STRUCT.size  # 104
MAC_COVERED_TRAILER = (
    64  # the MAC covers the header and trailer bytes [0, 64): payload hash, key id, payload digest
)
KEY_SIZE = 32  # bytes of a session key
KEY_ID_DOMAIN = b"strata-session-key-id-v1\x00"
MAC_DOMAIN = b"strata-session-mac-v1\x00"

# Metadata records (spec "Payload").
LAYER_STRUCT = struct.Struct(
    "<IBBBBIIIIIQ"
)  # index, role, k_dtype, v_dtype, reserved, heads, dk, dv, window, held, extra
MODEL_FILE_FIXED = struct.Struct("<Q16s")  # size, digest (after the u16-prefixed role)

# Domain tags keep the three hash uses apart.
MODEL_FINGERPRINT_DOMAIN = b"strata-model-fingerprint-v1\x00"
MODEL_FILE_DOMAIN = b"strata-model-file-v1\x00"
CONFIG_FINGERPRINT_DOMAIN = b"strata-config-fingerprint-v1\x00"


class Flags(enum.IntFlag):
    """Header flags (spec table "Flags"). Every bit not listed here is reserved and MUST be zero."""

    NONE = 0
    DATA_COMPRESSED = 1 << 0  # the data section is a compressed data section (spec section 3.3)
    AUTHENTICATED = 1 << 1  # the trailer carries a keyed MAC (spec section 4.1)


KNOWN_FLAGS = Flags.DATA_COMPRESSED | Flags.AUTHENTICATED


def trailer_size(flags: int) -> int:
    """The trailer's size for a header's flags: 24, or 104 with the authentication extension."""
    return AUTH_TRAILER_SIZE if flags & Flags.AUTHENTICATED else TRAILER_SIZE


class Codec(enum.IntEnum):
    """Compression codecs of a compressed data section (the on-disk code)."""

    ZSTD = 1


# Compressed data section (spec section 3.3): a 16-byte header, the frames, the block table.
COMPRESSION_HEADER_STRUCT = struct.Struct("<HHiII")  # codec, reserved, level, block_size, n_blocks
BLOCK_ENTRY_STRUCT = struct.Struct("<I")  # one block table entry: the frame's compressed size
MIN_COMPRESSED_BLOCK_SIZE = 4096


class LayerRole(enum.IntEnum):
    MAIN = 0
    DRAFT = 1


class Part(enum.IntEnum):
    """A layer's parts, in file order."""

    K = 0
    V = 1
    K_SCALES = 2
    V_SCALES = 3
    EXTRA = 4


class DType(enum.IntEnum):
    F32 = 1
    F16 = 2
    BF16 = 3
    I8 = 4  # symmetric int8; needs one f32 scale per token per head


@attrs.frozen
class DTypeInfo:
    name: str
    itemsize: int
    scale_itemsize: int  # bytes of scale per token per head; 0 = no scale part


DTYPES: dict[DType, DTypeInfo] = {
    DType.F32: DTypeInfo("f32", 4, 0),
    DType.F16: DTypeInfo("f16", 2, 0),
    DType.BF16: DTypeInfo("bf16", 2, 0),
    DType.I8: DTypeInfo("i8", 1, 4),
}
DTYPE_BY_NAME = {info.name: code for code, info in DTYPES.items()}


@attrs.frozen
class Limit:
    name: str
    value: int
    what: str


# Named limits (spec table "Limits"). A file over any of them is refused with LimitExceeded.
LIMITS: tuple[Limit, ...] = (
    Limit("MAX_TOKENS", 1 << 24, "tokens held by the session"),
    Limit("MAX_POSITION", 1 << 40, "the running position"),
    Limit("MAX_MODEL_FILES", 1024, "model files in the identity list"),
    Limit("MAX_ROLE_BYTES", 255, "UTF-8 bytes of one model file role"),
    Limit("MAX_CONFIG_BYTES", 1 << 20, "canonical config bytes"),
    Limit("MAX_SAMPLER_STATE_BYTES", 1 << 20, "sampler state bytes"),
    Limit("MAX_CHECKPOINT_DATA_BYTES", 16 << 20, "checkpoint engine data bytes"),
    Limit("MAX_ENGINE_FIELDS_BYTES", 1 << 20, "engine-defined field bytes"),
    Limit("MAX_LAYERS", 4096, "layers (all roles)"),
    Limit("MAX_KV_HEADS", 1024, "K/V heads of one layer"),
    Limit("MAX_HEAD_DIM", 8192, "head dimension of K or V"),
    Limit("MAX_EXTRA_BYTES", 1 << 32, "bytes of one layer's extra part"),
    Limit("MAX_METADATA_BYTES", 128 << 20, "metadata section bytes"),
    Limit("MAX_PAYLOAD_BYTES", 1 << 48, "payload bytes"),
    Limit(
        "MAX_COMPRESSED_BLOCK_BYTES", 64 << 20, "uncompressed bytes of one block of a compressed data section"
    ),
    Limit("MAX_COMPRESSED_BLOCKS", 1 << 22, "blocks of a compressed data section"),
)
LIMIT = {limit.name: limit.value for limit in LIMITS}
MAX_TOKENS = LIMIT["MAX_TOKENS"]
MAX_LAYERS = LIMIT["MAX_LAYERS"]
MAX_METADATA_BYTES = LIMIT["MAX_METADATA_BYTES"]
MAX_PAYLOAD_BYTES = LIMIT["MAX_PAYLOAD_BYTES"]


def align_up(n: int, alignment: int = DATA_ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment
