"""Frozen value types shared by the writer, the reader and the adapter protocol."""

from __future__ import annotations

import array
import enum
import json
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING

import attrs

from .format import DTYPES, DType, Flags, LayerRole, Part

if TYPE_CHECKING:
    from .compression import CompressedLayout


def _as_token_array(tokens: Iterable[int]) -> array.array:
    if isinstance(tokens, array.array) and tokens.typecode == "i":
        return tokens
    return array.array("i", tokens)


# One converter per element type: mypy's attrs plugin types ``converter=tuple`` as taking
# ``Iterable[_T_co]`` with the type variable unbound, which no argument satisfies.
def _model_files(files: Iterable[ModelFile]) -> tuple[ModelFile, ...]:
    return tuple(files)


def _layer_specs(specs: Iterable[LayerSpec]) -> tuple[LayerSpec, ...]:
    return tuple(specs)


def _layer_geometries(layers: Iterable[LayerGeometry]) -> tuple[LayerGeometry, ...]:
    return tuple(layers)


def _part_extents(extents: Iterable[PartExtent]) -> tuple[PartExtent, ...]:
    return tuple(extents)


def token_bytes(tokens: array.array) -> bytes:
    """The tokens as little-endian int32 bytes."""
    if sys.byteorder == "little":
        return tokens.tobytes()
    swapped = array.array("i", tokens)
    swapped.byteswap()
    return swapped.tobytes()


@attrs.frozen
class Header:
    format_version: int
    flags: int
    model_fingerprint: bytes
    config_fingerprint: bytes
    payload_length: int
    header_hash: int


@attrs.frozen
class ModelFile:
    """One model file as the fingerprint saw it: its role, size and sampled digest (16 bytes)."""

    role: str
    size: int
    digest: bytes


@attrs.frozen
class ModelIdentity:
    fingerprint: bytes  # 16 bytes, the header's model fingerprint
    files: tuple[ModelFile, ...] = attrs.field(converter=_model_files)


@attrs.frozen
class ConfigIdentity:
    fingerprint: bytes  # 16 bytes, the header's config fingerprint
    canonical: bytes  # canonical JSON of the engine's config mapping (spec "Config fingerprint")

    @property
    def mapping(self) -> dict:
        return json.loads(self.canonical.decode("utf-8"))


@attrs.frozen
class EngineIdentity:
    model: ModelIdentity
    config: ConfigIdentity


@attrs.frozen
class Checkpoint:
    """The deepest checkpoint: where the next turn resumes (a token index) and any engine data for it."""

    token_index: int = 0
    # A decoded file's: a read-only view of its metadata bytes (shown as the bytes it holds).
    data: bytes | memoryview = attrs.field(default=b"", repr=lambda d: repr(bytes(d)))


@attrs.frozen(eq=True)
class RunningState:
    tokens: array.array = attrs.field(converter=_as_token_array)  # int32 token ids held
    position: int = 0
    sampler_state: bytes = b""
    checkpoint: Checkpoint = Checkpoint()
    engine_fields: bytes = b""  # opaque to this library (an engine may put JSON here)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


@attrs.frozen
class LayerSpec:
    """What a layer is, independent of how many tokens it holds."""

    index: int  # the engine's own layer number
    role: LayerRole = attrs.field(converter=LayerRole)
    n_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    k_dtype: DType = attrs.field(converter=DType)
    v_dtype: DType = attrs.field(converter=DType)
    window: int = 0  # 0 = full attention; W > 0 = sliding window holding at most the last W tokens
    extra_bytes: int = 0  # size of the EXTRA part (recurrent/extra state), 0 when absent

    def capacity(self, n_tokens: int) -> int:
        """Tokens a main layer of this spec holds when the session holds n_tokens."""
        return min(n_tokens, self.window) if self.window else n_tokens


@attrs.frozen
class LayerGeometry:
    spec: LayerSpec
    tokens_held: int  # stored in logical order, oldest first

    def part_size(self, part: Part) -> int:
        s = self.spec
        if part is Part.K:
            return self.tokens_held * s.n_kv_heads * s.head_dim_k * DTYPES[s.k_dtype].itemsize
        if part is Part.V:
            return self.tokens_held * s.n_kv_heads * s.head_dim_v * DTYPES[s.v_dtype].itemsize
        if part is Part.K_SCALES:
            return self.tokens_held * s.n_kv_heads * DTYPES[s.k_dtype].scale_itemsize
        if part is Part.V_SCALES:
            return self.tokens_held * s.n_kv_heads * DTYPES[s.v_dtype].scale_itemsize
        return s.extra_bytes

    def part_sizes(self) -> tuple[int, int, int, int, int]:
        return tuple(self.part_size(p) for p in Part)  # type: ignore[return-value]

    @property
    def n_bytes(self) -> int:
        return sum(self.part_sizes())


@attrs.frozen
class Snapshot:
    """A frozen view of the session an adapter exposes for a save."""

    state: RunningState
    layers: tuple[LayerGeometry, ...] = attrs.field(converter=_layer_geometries)


@attrs.frozen
class EngineLimits:
    """The running engine's exact limits; the read pass checks every count of the file against them.

    ``layers``: the engine's layer specs in file order; a file must match them exactly (``None`` skips
    the check and leaves it to ``check_plan``). ``vocab_size``: every token id must be below it.
    """

    max_tokens: int
    layers: tuple[LayerSpec, ...] | None = attrs.field(
        default=None, converter=attrs.converters.optional(_layer_specs)
    )
    vocab_size: int | None = None
    max_sampler_state_bytes: int | None = None
    max_checkpoint_data_bytes: int | None = None
    max_engine_fields_bytes: int | None = None


@attrs.frozen
class SessionMetadata:
    """The decoded metadata section."""

    model: ModelIdentity
    config: ConfigIdentity
    state: RunningState
    layers: tuple[LayerGeometry, ...] = attrs.field(converter=_layer_geometries)


@attrs.frozen
class PartExtent:
    layer: int  # position in the layers tuple
    part: Part
    data_offset: int  # offset of the part's first byte from the start of the data section
    size: int


@attrs.frozen
class Layout:
    """Where everything lies in the file (absolute offsets)."""

    metadata_offset: int  # the u32 metadata length
    metadata_length: int  # bytes after that u32
    data_offset: int
    data_length: int
    trailer_offset: int
    file_size: int
    extents: tuple[PartExtent, ...] = attrs.field(
        converter=_part_extents, repr=False
    )  # non-empty parts, file order
    # compression.CompressedLayout of a compressed data section: data_length and extents are then uncompressed.
    compressed: CompressedLayout | None = None


@attrs.frozen
class FileStamp:
    """What fstat says; compared between and after the passes to see a file that changed (a local file's
    ``seam.Stamp``)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int


class Phase(enum.StrEnum):
    COPY = "copy"
    FLUSH = "flush"
    RENAME = "rename"
    READ = "read"
    APPLY = "apply"


@attrs.frozen
class Progress:
    phase: Phase
    bytes_done: int
    bytes_total: int


@attrs.frozen
class SaveReport:
    path: str
    n_tokens: int
    bytes_written: int
    elapsed_s: float
    copy_s: float
    flush_s: float
    rename_s: float
    payload_hash: bytes
    compression: str | None = None  # the codec name, None when the data section is not compressed
    kv_bytes: int = 0  # uncompressed bytes of the data section (every layer's parts)


class RestoreMode(enum.StrEnum):
    AUTO = "auto"
    STREAMING = "streaming"  # two passes: read pass, then apply pass (gate at the first applied block)
    STAGED = "staged"  # one pass into the adapter's staging area; commit only after every check


@attrs.frozen
class RestorePlan:
    """What the read pass (or the staged pass's metadata check) established; handed to the adapter."""

    path: str
    header: Header
    metadata: SessionMetadata
    layout: Layout
    stamp: object  # the source's seam.Stamp: a FileStamp, an objstore.ObjectStamp
    mode: RestoreMode

    @property
    def state(self) -> RunningState:
        return self.metadata.state

    @property
    def layers(self) -> tuple[LayerGeometry, ...]:
        return self.metadata.layers


@attrs.frozen
class RestoreReport:
    path: str
    mode: RestoreMode
    n_tokens: int
    bytes_read: int  # every byte read from the file, both passes
    file_size: int
    elapsed_s: float
    read_pass_s: float
    apply_s: float


@attrs.frozen
class Inspection:
    """The outcome of the read pass alone (``inspect``)."""

    path: str
    header: Header
    metadata: SessionMetadata
    layout: Layout
    payload_verified: bool
    payload_hash: bytes | None
    mac_verified: bool = (
        False  # the MAC was checked with the reader's key (and, if payload_verified, the payload digest)
    )
    key_id: bytes | None = None  # an authenticated file's key id (spec 4.1), checked or not

    @property
    def authenticated(self) -> bool:
        """The file carries a MAC (flag AUTHENTICATED), checked or not."""
        return bool(self.header.flags & Flags.AUTHENTICATED)
