"""llama.cpp's sequence state files (``llama_state_seq_save_file``, magic ``ggsq``, version 4: llama.cpp
b11549), read and written, and converted to and from format v1 (spec/llama-cpp-slot.md is the byte table).

Reading walks the file once, checking every count and length against the bytes left (and, given the
model's geometry, against the layers) before reading or allocating anything; the K/V bytes themselves are
never held whole: a conversion copies them layer part by layer part (a transposed V or a q8_0 part is
rearranged one layer at a time). Such a file carries no model identity, so a conversion takes the GGUF
model it was written with and checks the layers, heads, head sizes, types and sliding windows against it.

f16, bf16 and f32 rows are copied byte for byte (llama.cpp's K rows are the rows strata-engine keeps: the
GGUF's own head layout, RoPE applied, for llama and gemma3 alike). q8_0 (de)quantizing and dtype changes
need numpy, imported only then: this package stands alone without it.
"""

from __future__ import annotations

import array
import enum
import os
import struct
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from . import errors as E
from ._fileio import FileSink, FileSource
from .adapter import SessionTarget, StagesByApplying, adapter_call
from .auth import SessionKey
from .format import DEFAULT_BLOCK_SIZE, DTYPES, LIMIT, DType, LayerRole, Part
from .identity import config_fingerprint, model_fingerprint
from .reader import inspect, restore
from .records import (
    ConfigIdentity,
    EngineIdentity,
    EngineLimits,
    LayerGeometry,
    LayerSpec,
    ModelIdentity,
    Progress,
    RestoreMode,
    RestorePlan,
    RestoreReport,
    RunningState,
    Snapshot,
)
from .transfer import transfer
from .writer import save

SLOT_MAGIC = 0x67677371  # LLAMA_FILE_MAGIC_GGSQ, 'ggsq' read as a little-endian u32
SLOT_MAGIC_BYTES = struct.pack("<I", SLOT_MAGIC)
SLOT_VERSION = 4  # LLAMA_STATE_SEQ_VERSION
SLOT_BUILDS = ("b11549",)  # llama.cpp builds whose files this module was checked against
MAX_STREAMS = 256  # llama.cpp's n_stream is at most its n_seq_max
MAX_CACHE_SECTIONS = 2  # one KV cache, or an iSWA pair (base then SWA)
MODEL_ROLE = "model"
PACKED_MARKER = -1  # LLAMA_TOKEN_NULL: llama-server's packed token list (server_tokens::serialize)
PACKED_VERSION = 1  # SERVER_TOKENS_STATE_VERSION
CKPT_MAGIC = 0x504B4353  # "SCKP": llama-server's context checkpoints appended to a slot file
CKPT_VERSION = 1

U32 = struct.Struct("<I")
I32 = struct.Struct("<i")
U64 = struct.Struct("<Q")
CELL = struct.Struct("<iIi")  # pos, n_seq_id (1), seq_id: one cell of one sequence, no cell ext
DATA_HEAD = struct.Struct("<IIII")  # v_trans, n_layer, n_rot_k, n_rot_v
ROW_HEAD = struct.Struct("<iQ")  # ggml type, row size
TRANS_HEAD = struct.Struct("<iII")  # ggml type, element size, n_embd_v_gqa


class GGMLType(enum.IntEnum):
    """The ggml type codes a K/V cache uses (ggml.h's ggml_type)."""

    F32 = 0
    F16 = 1
    Q8_0 = 8
    BF16 = 30


@attrs.frozen
class GGMLTypeInfo:
    name: str
    block: int  # elements per block
    block_bytes: int
    v1: DType  # the format v1 dtype its rows become (q8_0: dequantized to f16)

    def row_size(self, n: int) -> int:
        return n // self.block * self.block_bytes


GGML_TYPES: dict[GGMLType, GGMLTypeInfo] = {
    GGMLType.F32: GGMLTypeInfo("f32", 1, 4, DType.F32),
    GGMLType.F16: GGMLTypeInfo("f16", 1, 2, DType.F16),
    GGMLType.BF16: GGMLTypeInfo("bf16", 1, 2, DType.BF16),
    GGMLType.Q8_0: GGMLTypeInfo("q8_0", 32, 34, DType.F16),
}
GGML_TYPE_BY_NAME = {info.name: t for t, info in GGML_TYPES.items()}
V1_TO_GGML = {DType.F32: GGMLType.F32, DType.F16: GGMLType.F16, DType.BF16: GGMLType.BF16}


# --- the model's geometry (a bounded read of the GGUF's key/value table) ----------------------------
@attrs.frozen
class ModelLayer:
    index: int
    n_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    window: int  # 0 = full attention

    @property
    def n_embd_k(self) -> int:
        return self.n_kv_heads * self.head_dim_k

    @property
    def n_embd_v(self) -> int:
        return self.n_kv_heads * self.head_dim_v


@attrs.frozen
class ModelGeometry:
    architecture: str
    layers: tuple[ModelLayer, ...]

    @property
    def sections(self) -> tuple[tuple[ModelLayer, ...], ...]:
        """The layers of each KV cache llama.cpp writes, in file order: full attention, then sliding window."""
        full = tuple(la for la in self.layers if not la.window)
        swa = tuple(la for la in self.layers if la.window)
        return tuple(s for s in (full, swa) if s)


def _no_windows(meta: Mapping[str, Any], n_layer: int) -> list[int]:
    return [0] * n_layer


def _gemma3_windows(meta: Mapping[str, Any], n_layer: int) -> list[int]:
    # llama.cpp's set_swa_pattern(6): every 6th layer is global (the GGUF does not say)
    window = int(meta.get("gemma3.attention.sliding_window", 512))
    return [0 if il % 6 == 5 else window for il in range(n_layer)]


# Architectures whose llama.cpp cache this module knows: the sliding window of each layer (no cell ext).
ARCH_WINDOWS = {"llama": _no_windows, "qwen2": _no_windows, "qwen3": _no_windows, "gemma3": _gemma3_windows}
GGUF_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
GGUF_STRING, GGUF_ARRAY = 8, 9
MAX_GGUF_KV_BYTES = 256 << 20  # the key/value table must lie in the file's first 256 MiB
MAX_KEPT_ARRAY = 4096  # arrays longer than this (the vocabulary) are skipped, not decoded


class _GGUFCursor:
    """Sequential reads of a GGUF's key/value table through a FileSource, bounded by the table limit."""

    CHUNK = 1 << 20  # read ahead: the table is tens of thousands of small fields (the vocabulary)

    def __init__(self, src: FileSource, size: int) -> None:
        self.src, self.pos, self.end = src, 0, min(size, MAX_GGUF_KV_BYTES)
        self.buf, self.buf_at = b"", 0

    def take(self, n: int) -> bytes:
        if self.pos + n > self.end:
            raise E.SlotModelUnsupported(
                "GGUF key/value table runs past its bound", path=self.src.path, offset=self.pos
            )
        lo = self.pos - self.buf_at
        if lo < 0 or lo + n > len(self.buf):
            self.buf_at, lo = self.pos, 0
            self.buf = self.src.read(min(max(n, self.CHUNK), self.end - self.pos), self.pos)
        self.pos += n
        return self.buf[lo : lo + n]

    def scalar(self, code: str) -> Any:
        st = struct.Struct(code)
        return st.unpack(self.take(st.size))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        if n > self.end - self.pos:
            raise E.SlotModelUnsupported(
                "GGUF string runs past the table", path=self.src.path, offset=self.pos
            )
        return self.take(n).decode("utf-8", "replace")

    def value(self, vtype: int) -> Any:
        if vtype in GGUF_SCALARS:
            return self.scalar(GGUF_SCALARS[vtype])
        if vtype == GGUF_STRING:
            return self.string()
        if vtype == GGUF_ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in GGUF_SCALARS and count > MAX_KEPT_ARRAY:
                size = struct.calcsize(GGUF_SCALARS[etype]) * count
                if size > self.end - self.pos:
                    raise E.SlotModelUnsupported(
                        "GGUF array past the table", path=self.src.path, offset=self.pos
                    )
                self.pos += size
                return None
            if etype == GGUF_STRING and count > MAX_KEPT_ARRAY:  # the vocabulary: walked, not decoded
                for _ in range(count):
                    n = self.scalar("<Q")
                    if n > self.end - self.pos:
                        raise E.SlotModelUnsupported(
                            "GGUF string past the table", path=self.src.path, offset=self.pos
                        )
                    self.pos += n
                return None
            if count > self.end - self.pos:  # every element takes at least one byte
                raise E.SlotModelUnsupported("GGUF array past the table", path=self.src.path, offset=self.pos)
            items = [self.value(etype) for _ in range(count)]
            return items if count <= MAX_KEPT_ARRAY else None
        raise E.SlotModelUnsupported(f"GGUF value type {vtype} unknown", path=self.src.path, offset=self.pos)


def gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The GGUF file's key/value table (arrays over MAX_KEPT_ARRAY items left out), read in bounded steps."""
    return _read_gguf(path, tensors=False)[0]


def gguf_tensor_names(path: str | os.PathLike) -> frozenset[str]:
    """The names of the GGUF file's tensors (their infos follow the key/value table, in the same bound)."""
    return _read_gguf(path, tensors=True)[1]


def _read_gguf(path: str | os.PathLike, *, tensors: bool) -> tuple[dict[str, Any], frozenset[str]]:
    with FileSource(os.fspath(path)) as src:
        cur = _GGUFCursor(src, src.stamp().size)
        if cur.take(4) != b"GGUF":
            raise E.SlotModelUnsupported("not a GGUF file", path=src.path, offset=0)
        version, n_tensors, n_kv = struct.unpack("<IQQ", cur.take(20))
        if version not in (2, 3) or n_kv > 1 << 20 or n_tensors > 1 << 20:
            raise E.SlotModelUnsupported(
                f"GGUF version {version} with {n_kv} keys, {n_tensors} tensors", path=src.path, offset=4
            )
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            meta[key] = cur.value(cur.scalar("<I"))
        names = set()
        for _ in range(n_tensors if tensors else 0):
            names.add(cur.string())
            n_dims = cur.scalar("<I")
            if n_dims > 8:
                raise E.SlotModelUnsupported(
                    f"GGUF tensor of {n_dims} dimensions", path=src.path, offset=cur.pos
                )
            cur.take(8 * n_dims + 4 + 8)  # dimensions, type, offset
        return meta, frozenset(names)


def _per_layer(value: Any, n_layer: int, key: str) -> list[int]:
    if isinstance(value, list):
        if len(value) != n_layer:
            raise E.SlotModelUnsupported(f"{key} lists {len(value)} layers, not {n_layer}", field=key)
        return [int(v) for v in value]
    return [int(value)] * n_layer


def model_geometry(path: str | os.PathLike) -> ModelGeometry:
    """The K/V geometry llama.cpp's cache has for this GGUF model."""
    meta = gguf_metadata(path)
    arch = meta.get("general.architecture")
    windows_of = ARCH_WINDOWS.get(arch) if isinstance(arch, str) else None
    if windows_of is None:
        raise E.SlotModelUnsupported(
            f"architecture {arch!r} (known: {', '.join(sorted(ARCH_WINDOWS))})", path=os.fspath(path)
        )
    try:
        n_layer = int(meta[f"{arch}.block_count"])
        n_head = _per_layer(meta[f"{arch}.attention.head_count"], n_layer, "head_count")
        n_embd = int(meta[f"{arch}.embedding_length"])
    except KeyError as exc:
        raise E.SlotModelUnsupported(f"GGUF lacks {exc.args[0]}", path=os.fspath(path)) from None
    heads_kv = _per_layer(meta.get(f"{arch}.attention.head_count_kv", n_head), n_layer, "head_count_kv")
    dk = int(meta.get(f"{arch}.attention.key_length", n_embd // max(n_head[0], 1)))
    dv = int(meta.get(f"{arch}.attention.value_length", dk))
    windows = windows_of(meta, n_layer)
    layers = tuple(ModelLayer(il, heads_kv[il], dk, dv, windows[il]) for il in range(n_layer))
    return ModelGeometry(str(arch), layers)


# --- the file's structure ---------------------------------------------------------------------------
@attrs.frozen
class SlotPart:
    """One layer's K or V in the file: where its bytes start and how they are laid out."""

    ggml_type: GGMLType
    offset: int
    row_bytes: int  # bytes of one cell's row (a transposed V: bytes of one element)
    n_embd: int  # elements of one cell's row
    transposed: bool = False


@attrs.frozen
class SlotSection:
    """One KV cache's part of the file: its stream with cells, their positions, each layer's K and V."""

    n_stream: int
    stream: int  # the stream that holds cells (-1: none)
    positions: array.array  # int32 positions, cell order
    v_trans: bool
    n_rot_k: int
    n_rot_v: int
    k: tuple[SlotPart, ...]
    v: tuple[SlotPart, ...]

    @property
    def n_cells(self) -> int:
        return len(self.positions)


@attrs.frozen
class SlotFile:
    path: str
    size: int
    tokens: array.array  # int32
    sections: tuple[SlotSection, ...]
    checkpoints: int = 0  # llama-server's context checkpoints appended after the state (not converted)


class _Walk:
    """A cursor over the slot file that checks each length against the bytes left before reading."""

    def __init__(self, src: FileSource, size: int) -> None:
        self.src, self.size, self.pos = src, size, 0

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise E.SlotTruncated(
                f"{what} needs {n} bytes, {self.size - self.pos} are left",
                path=self.src.path,
                offset=self.pos,
            )

    def take(self, n: int, what: str) -> bytes:
        self.need(n, what)
        data = self.src.read(n, self.pos, short_error=E.SlotTruncated)
        self.pos += n
        return data

    def u32(self, what: str) -> int:
        return U32.unpack(self.take(4, what))[0]

    def skip(self, n: int, what: str) -> int:
        self.need(n, what)
        at = self.pos
        self.pos += n
        return at


def _ggml_type(code: int, where: str, path: str, offset: int) -> GGMLType:
    try:
        return GGMLType(code)
    except ValueError:
        raise E.SlotUnsupportedType(
            f"ggml type {code} (known: {', '.join(i.name for i in GGML_TYPES.values())})",
            path=path,
            offset=offset,
            field=where,
        ) from None


def _read_cells(w: _Walk, n_cells: int, sec: int) -> array.array:
    w.need(n_cells * CELL.size, f"section {sec}: {n_cells} cells")
    at = w.pos
    raw = w.take(n_cells * CELL.size, "cells")
    words = array.array("i", raw)
    if sys.byteorder != "little":
        words.byteswap()
    for i in range(n_cells):
        if words[3 * i + 1] != 1:  # a cell of one sequence (llama.cpp refuses others at load, too)
            raise E.SlotCellsInvalid(
                f"cell {i} belongs to {words[3 * i + 1] & 0xFFFFFFFF} sequences, not 1",
                path=w.src.path,
                offset=at + i * CELL.size + 4,
                field=f"sections[{sec}].cells[{i}].n_seq_id",
            )
    return words[0::3]


def _read_parts(
    w: _Walk, n_cells: int, n_layer: int, sec: int, model: tuple[ModelLayer, ...] | None, v_trans: bool
) -> tuple[tuple[SlotPart, ...], tuple[SlotPart, ...]]:
    path = w.src.path

    def row_part(kind: str, il: int, expect: int | None) -> SlotPart:
        at = w.pos
        code, row = ROW_HEAD.unpack(w.take(ROW_HEAD.size, f"{kind} header"))
        t = _ggml_type(code, f"sections[{sec}].{kind}[{il}].type", path, at)
        info = GGML_TYPES[t]
        if row == 0 or row % info.block_bytes:
            raise E.SlotGeometryMismatch(
                f"{kind} row of {row} bytes is not whole {info.name} blocks",
                path=path,
                offset=at + 4,
                field=f"sections[{sec}].{kind}[{il}].row_size",
            )
        n_embd = row // info.block_bytes * info.block
        if expect is not None and n_embd != expect:
            raise E.SlotGeometryMismatch(
                f"{kind} rows hold {n_embd} values; the model's layer has {expect}",
                path=path,
                offset=at + 4,
                field=f"sections[{sec}].{kind}[{il}].row_size",
            )
        off = w.skip(n_cells * row, f"{kind} rows of layer {il}")
        return SlotPart(t, off, row, n_embd)

    def trans_part(il: int, expect: int | None) -> SlotPart:
        at = w.pos
        code, el, n_embd = TRANS_HEAD.unpack(w.take(TRANS_HEAD.size, "transposed V header"))
        t = _ggml_type(code, f"sections[{sec}].v[{il}].type", path, at)
        info = GGML_TYPES[t]
        if info.block != 1 or el != info.block_bytes:
            raise E.SlotUnsupportedType(
                f"transposed V of type {info.name} with {el}-byte elements",
                path=path,
                offset=at,
                field=f"sections[{sec}].v[{il}]",
            )
        if (expect is not None and n_embd != expect) or n_embd == 0:
            raise E.SlotGeometryMismatch(
                f"transposed V holds {n_embd} values per cell; the model's layer has {expect}",
                path=path,
                offset=at + 8,
                field=f"sections[{sec}].v[{il}].n_embd_v_gqa",
            )
        off = w.skip(n_embd * n_cells * el, f"transposed V of layer {il}")
        return SlotPart(t, off, el, n_embd, transposed=True)

    ks = tuple(row_part("k", il, model[il].n_embd_k if model else None) for il in range(n_layer))
    if v_trans:
        vs = tuple(trans_part(il, model[il].n_embd_v if model else None) for il in range(n_layer))
    else:
        vs = tuple(row_part("v", il, model[il].n_embd_v if model else None) for il in range(n_layer))
    return ks, vs


def read_slot_file(path: str | os.PathLike, geometry: ModelGeometry | None = None) -> SlotFile:
    """Walk a slot file: its tokens, and per KV cache the cells' positions and where each layer's K and V
    lie (not their bytes). With ``geometry``, the layers are checked against the model's as they come."""
    with FileSource(os.fspath(path)) as src:
        size = src.stamp().size
        w = _Walk(src, size)
        head = w.take(12, "header")
        magic, version, n_tokens = struct.unpack("<III", head)
        if magic != SLOT_MAGIC:
            raise E.SlotBadMagic(f"magic {head[:4]!r}, not {SLOT_MAGIC_BYTES!r}", path=src.path, offset=0)
        if version != SLOT_VERSION:
            raise E.SlotUnsupportedVersion(
                f"sequence state version {version}; this reader knows {SLOT_VERSION} (llama.cpp "
                f"{', '.join(SLOT_BUILDS)})",
                path=src.path,
                offset=4,
            )
        if n_tokens > LIMIT["MAX_TOKENS"]:
            raise E.SlotLimitExceeded(f"{n_tokens} tokens", path=src.path, offset=8, field="n_token_count")
        tokens = _unpack_tokens(array.array("i", w.take(4 * n_tokens, f"{n_tokens} tokens")), src.path)
        expected = geometry.sections if geometry else None
        sections: list[SlotSection] = []
        while w.pos < size and len(sections) < (len(expected) if expected else MAX_CACHE_SECTIONS):
            sections.append(_read_section(w, len(sections), expected[len(sections)] if expected else None))
        if expected is not None and len(sections) != len(expected):
            raise E.SlotTruncated(
                f"{len(sections)} KV cache sections; the model's cache writes {len(expected)}",
                path=src.path,
                offset=w.pos,
            )
        appendix = _skip_checkpoints(w) if w.pos < size else 0
        if w.pos != size:
            raise E.SlotTrailingData(
                f"{size - w.pos} bytes after the last section", path=src.path, offset=w.pos
            )
        return SlotFile(src.path, size, tokens, tuple(sections), appendix)


def _unpack_tokens(words: array.array, path: str) -> array.array:
    """The token list: llama-server b11549 packs it (marker -1, version, count, tokens, media count);
    a plain list (older servers, llama_state_seq_save_file's own callers) starts with a token id."""
    if sys.byteorder != "little":
        words.byteswap()
    if not words or words[0] != PACKED_MARKER:
        return words
    if len(words) < 3 or words[1] != PACKED_VERSION:
        raise E.SlotUnsupportedVersion(
            f"packed token list version {words[1] if len(words) > 1 else None}, not {PACKED_VERSION}",
            path=path,
            offset=16,
            field="tokens.version",
        )
    n = words[2]
    if not 0 <= n <= len(words) - 4:
        raise E.SlotTruncated(f"packed token list of {n} tokens in {len(words)} words", path=path, offset=20)
    if words[3 + n] != 0:
        raise E.SlotUnsupportedType(
            f"{words[3 + n]} media chunks (multimodal prompts are not converted)",
            path=path,
            field="tokens.media",
        )
    if any(words[4 + n :]):  # the writer pads to whole words with zeros
        raise E.SlotTrailingData("bytes after the packed token list", path=path, field="tokens")
    return words[3 : 3 + n]


def _skip_checkpoints(w: _Walk) -> int:
    """Walk llama-server's context-checkpoint appendix ("SCKP") after the state; its count."""
    at = w.pos
    if w.size - at < 4 or w.src.read(4, at) != U32.pack(CKPT_MAGIC):
        raise E.SlotTrailingData(f"{w.size - at} bytes after the last section", path=w.src.path, offset=at)
    _magic, version, count = struct.unpack("<III", w.take(12, "checkpoint appendix"))
    if version != CKPT_VERSION:
        raise E.SlotUnsupportedVersion(
            f"checkpoint appendix version {version}", path=w.src.path, offset=at + 4
        )
    for i in range(count):
        w.take(16, f"checkpoint {i}")
        for blob in ("target", "draft", "spec"):
            (n,) = U64.unpack(w.take(8, f"checkpoint {i} {blob} length"))
            w.skip(n, f"checkpoint {i} {blob} state")
    return count


def _read_section(w: _Walk, sec: int, model: tuple[ModelLayer, ...] | None) -> SlotSection:
    path = w.src.path
    at = w.pos
    n_stream = w.u32("n_stream")
    if not 1 <= n_stream <= MAX_STREAMS:
        raise E.SlotLimitExceeded(
            f"{n_stream} streams", path=path, offset=at, field=f"sections[{sec}].n_stream"
        )
    stream, positions = -1, array.array("i")
    parts: tuple[tuple[SlotPart, ...], tuple[SlotPart, ...]] = ((), ())
    v_trans, n_rot_k, n_rot_v = False, 0, 0
    for s in range(n_stream):
        at = w.pos
        n_cells = w.u32(f"stream {s} cell count")
        if n_cells == 0:
            continue
        if stream >= 0:
            raise E.SlotCellsInvalid(
                f"streams {stream} and {s} both hold cells", path=path, offset=at, field=f"sections[{sec}]"
            )
        if n_cells > LIMIT["MAX_TOKENS"]:
            raise E.SlotLimitExceeded(
                f"{n_cells} cells", path=path, offset=at, field=f"sections[{sec}].cell_count"
            )
        stream = s
        positions = _read_cells(w, n_cells, sec)
        at = w.pos
        v_trans_u, n_layer, n_rot_k, n_rot_v = DATA_HEAD.unpack(w.take(DATA_HEAD.size, "data header"))
        if v_trans_u > 1:
            raise E.SlotGeometryMismatch(
                f"v_trans is {v_trans_u}", path=path, offset=at, field=f"sections[{sec}].v_trans"
            )
        if n_layer > LIMIT["MAX_LAYERS"] or (model is not None and n_layer != len(model)):
            raise E.SlotGeometryMismatch(
                f"{n_layer} layers; the model's cache has {len(model) if model else 'at most ' + str(LIMIT['MAX_LAYERS'])}",
                path=path,
                offset=at + 4,
                field=f"sections[{sec}].n_layer",
            )
        v_trans = bool(v_trans_u)
        parts = _read_parts(w, n_cells, n_layer, sec, model, v_trans)
    return SlotSection(n_stream, stream, positions, v_trans, n_rot_k, n_rot_v, parts[0], parts[1])


def is_slot_file(path: str | os.PathLike) -> bool:
    """Whether the file starts with llama.cpp's sequence state magic."""
    try:
        with FileSource(os.fspath(path)) as src:
            return src.stamp().size >= 4 and src.read(4, 0) == SLOT_MAGIC_BYTES
    except E.SessionFileError:
        return False


def describe(slot: SlotFile) -> dict[str, Any]:
    """What ``inspect`` prints about a slot file."""
    return {
        "format": "llama.cpp sequence state",
        "version": SLOT_VERSION,
        "builds": list(SLOT_BUILDS),
        "path": slot.path,
        "file_size": slot.size,
        "n_tokens": len(slot.tokens),
        "checkpoints": slot.checkpoints,
        "first_tokens": list(slot.tokens[:8]),
        "sections": [
            {
                "n_stream": s.n_stream,
                "stream": s.stream,
                "n_cells": s.n_cells,
                "positions": [min(s.positions), max(s.positions)] if s.n_cells else None,
                "v_trans": s.v_trans,
                "n_rot_k": s.n_rot_k,
                "n_rot_v": s.n_rot_v,
                "n_layer": len(s.k),
                "k_types": sorted({GGML_TYPES[p.ggml_type].name for p in s.k}),
                "v_types": sorted({GGML_TYPES[p.ggml_type].name for p in s.v}),
                "k_row_values": sorted({p.n_embd for p in s.k}),
            }
            for s in slot.sections
        ],
    }


# --- numpy, only for what needs arithmetic ------------------------------------------------------------
def _numpy(why: str) -> Any:
    try:
        import numpy as np
    except ImportError:
        raise E.ConversionUnavailable(f"{why} needs numpy (pip install numpy)") from None
    return np


def hadamard(np: Any, n: int) -> Any:
    """The orthonormal Walsh-Hadamard matrix of size n (a power of two), as llama.cpp's ggml_gen_hadamard
    builds it (Sylvester's order, scaled by 1/sqrt(n)): symmetric, its own inverse."""
    h = np.ones((1, 1), np.float32)
    while len(h) < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.float32(np.sqrt(n))


def _rotate(np: Any, x: Any, n_rot: int) -> Any:
    """Each run of n_rot values times the Hadamard matrix (llama_mul_mat_hadamard): rotates, and undoes it."""
    return x if not n_rot else (x.reshape(-1, n_rot) @ hadamard(np, n_rot)).reshape(-1)


def dequantize_q8_0(raw: bytes | memoryview, n_values: int, n_rot: int = 0) -> bytes:
    """q8_0 blocks (f16 scale, 32 int8) as little-endian f16 values; ``n_rot``: llama.cpp's Hadamard rotation
    of the cache, undone."""
    np = _numpy("dequantizing q8_0")
    blocks = np.frombuffer(raw, dtype=np.dtype([("d", "<f2"), ("q", "i1", 32)]))
    out = blocks["q"].astype(np.float32) * blocks["d"].astype(np.float32)[:, None]
    return _rotate(np, out.reshape(-1)[:n_values], n_rot).astype("<f2").tobytes()


def quantize_q8_0(raw: bytes | memoryview, src_dtype: DType, n_rot: int = 0) -> bytes:
    """Values (f16/f32/bf16) as q8_0 blocks, rounding as ggml's quantize_row_q8_0_ref does; ``n_rot``: first
    rotated as llama.cpp rotates a quantized cache."""
    np = _numpy("quantizing q8_0")
    x = _rotate(np, _as_f32(np, raw, src_dtype), n_rot).reshape(-1, 32)
    amax = np.abs(x).max(axis=1)
    d = amax / 127.0
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    q = np.round(x * inv[:, None]).astype(np.int8)
    blocks = np.empty(len(x), dtype=np.dtype([("d", "<f2"), ("q", "i1", 32)]))
    blocks["d"], blocks["q"] = d.astype("<f2"), q
    return blocks.tobytes()


def _as_f32(np: Any, raw: bytes | memoryview, dtype: DType) -> Any:
    if dtype is DType.F32:
        return np.frombuffer(raw, "<f4")
    if dtype is DType.F16:
        return np.frombuffer(raw, "<f2").astype(np.float32)
    if dtype is DType.BF16:
        return (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
    raise E.SlotUnsupportedType(f"no conversion from {DTYPES[dtype].name}")


def convert_values(raw: bytes | memoryview, src: DType, dst: GGMLType, n_rot: int = 0) -> bytes:
    """Values of dtype ``src`` as ``dst`` rows (ggml's rounding: f16 round-to-nearest, bf16 truncation-free;
    q8_0 rotated by ``n_rot`` first)."""
    if V1_TO_GGML.get(src) is dst:
        return bytes(raw)
    if dst is GGMLType.Q8_0:
        return quantize_q8_0(raw, src, n_rot)
    np = _numpy(f"converting {DTYPES[src].name} to {GGML_TYPES[dst].name}")
    x = _as_f32(np, raw, src)
    if dst is GGMLType.F32:
        return x.astype("<f4").tobytes()
    if dst is GGMLType.F16:
        return x.astype("<f2").tobytes()
    bits = x.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").tobytes()


# --- slot file -> format v1 ---------------------------------------------------------------------------
def _runs(positions: array.array, first: int) -> list[tuple[int, int, int]]:
    """(logical start, cell start, count) runs putting the cells in position order, positions
    ``first, first + 1, ...``; SlotCellsInvalid where the positions are not exactly that run."""
    n = len(positions)
    if positions == array.array("i", range(first, first + n)):  # in order already (compared in C)
        return [(0, 0, n)] if n else []
    where = [-1] * n
    for cell, pos in enumerate(positions):
        t = pos - first
        if not 0 <= t < n or where[t] >= 0:
            raise E.SlotCellsInvalid(
                f"cell {cell} holds position {pos}; the cells must hold positions {first}..{first + n - 1} once each",
                field=f"cells[{cell}].pos",
            )
        where[t] = cell
    runs: list[tuple[int, int, int]] = []
    for t, cell in enumerate(where):
        if runs and runs[-1][1] + runs[-1][2] == cell:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((t, cell, 1))
    return runs


@attrs.frozen
class _LayerSource:
    """Where one model layer's K and V come from in the slot file."""

    k: SlotPart
    v: SlotPart
    n_cells: int
    runs: tuple[tuple[int, int, int], ...]
    spec: LayerSpec
    held: int
    k_rot: int = 0  # llama.cpp's Hadamard rotation of a quantized K / V (0: none)
    v_rot: int = 0


def llamacpp_rotation(ggml_type: GGMLType, head_dims: Sequence[int], part: Part) -> int:
    """The Hadamard rotation llama.cpp b11549 gives a cache of this type (llama_kv_cache's constructor): a
    quantized one whose layers share one head size, a multiple of 64; K by the largest power of two that
    divides it, V by 64. 0: none (unquantized, or LLAMA_ATTN_ROT_DISABLE=1 on its side)."""
    dims = set(head_dims)
    if GGML_TYPES[ggml_type].block == 1 or len(dims) != 1 or next(iter(dims)) % 64:
        return 0
    n, dim = 64, next(iter(dims))
    while part is Part.K and dim % (2 * n) == 0:
        n *= 2
    return n


def _check_rotation(
    n_rot: int, parts: Sequence[SlotPart], head_dims: Sequence[int], sec: int, kind: str
) -> int:
    """A rotation this converter undoes: of q8_0 rows only, by a power of two from 64 that divides every head."""
    if n_rot == 0:
        return 0
    quantized = all(GGML_TYPES[p.ggml_type].block > 1 for p in parts)
    if not quantized or n_rot < 64 or n_rot & (n_rot - 1) or any(d % n_rot for d in head_dims):
        raise E.SlotRotated(
            f"n_rot_{kind} {n_rot} over {sorted({GGML_TYPES[p.ggml_type].name for p in parts})} rows of heads "
            f"{sorted(set(head_dims))}: not a rotation llama.cpp makes (a power of two from 64 dividing the head "
            "size, of a quantized cache)",
            field=f"sections[{sec}].n_rot_{kind}",
        )
    return n_rot


class SlotSource:
    """A SessionSource over a slot file: ``save(out, SlotSource(...))`` writes it as format v1."""

    def __init__(
        self, slot: SlotFile, geometry: ModelGeometry, identity: EngineIdentity, engine_fields: bytes
    ):
        self.slot, self.geometry, self._identity = slot, geometry, identity
        self.engine_fields = engine_fields
        full = [s for s, layers in zip(slot.sections, geometry.sections, strict=True) if not layers[0].window]
        n = full[0].n_cells if full else max(int(max(s.positions)) + 1 for s in slot.sections if s.n_cells)
        if n > len(slot.tokens):
            raise E.SlotCellsInvalid(
                f"{n} cells but {len(slot.tokens)} tokens", path=slot.path, field="n_token_count"
            )
        self.n = n
        self.layers = self._layers(n)
        self._src: FileSource | None = None
        self._cache: tuple[int, Part, bytes] | None = None  # one rearranged layer part at a time
        self._cols: tuple[int, Part, Any] | None = None  # one transposed V's columns at a time (numpy)
        self._cols_buf: Any = None
        self._scratch: Any = None  # a block of rows being transposed (numba's kernel, TRANSPOSE_SCRATCH)

    def _layers(self, n: int) -> list[_LayerSource]:
        out: dict[int, _LayerSource] = {}
        for sec_no, (section, model) in enumerate(
            zip(self.slot.sections, self.geometry.sections, strict=True)
        ):
            window = model[0].window
            held = min(n, window) if window else n
            if section.n_cells != held:
                raise E.SlotCellsInvalid(
                    f"cache {sec_no} holds {section.n_cells} cells; a conversation of {n} tokens keeps {held} there",
                    path=self.slot.path,
                    field=f"sections[{sec_no}].cell_count",
                )
            if held == 0:
                continue
            try:
                runs = tuple(_runs(section.positions, n - held))
            except E.SlotCellsInvalid as exc:
                exc.path, exc.field = self.slot.path, f"sections[{sec_no}].{exc.field}"
                raise
            try:
                k_rot = _check_rotation(
                    section.n_rot_k, section.k, [la.head_dim_k for la in model], sec_no, "k"
                )
                v_rot = _check_rotation(
                    section.n_rot_v, section.v, [la.head_dim_v for la in model], sec_no, "v"
                )
            except E.SlotRotated as exc:
                exc.path = self.slot.path
                raise
            for la, k, v in zip(model, section.k, section.v, strict=True):
                spec = LayerSpec(
                    index=la.index,
                    role=LayerRole.MAIN,
                    n_kv_heads=la.n_kv_heads,
                    head_dim_k=la.head_dim_k,
                    head_dim_v=la.head_dim_v,
                    k_dtype=GGML_TYPES[k.ggml_type].v1,
                    v_dtype=GGML_TYPES[v.ggml_type].v1,
                    window=la.window,
                )
                out[la.index] = _LayerSource(k, v, section.n_cells, runs, spec, held, k_rot, v_rot)
        return [out[i] for i in sorted(out)]

    def identity(self) -> EngineIdentity:
        return self._identity

    def snapshot(self) -> Snapshot:
        state = RunningState(
            tokens=self.slot.tokens[: self.n], position=self.n, engine_fields=self.engine_fields
        )
        return Snapshot(state, tuple(LayerGeometry(la.spec, la.held) for la in self.layers))

    def close(self) -> None:
        if self._src is not None:
            self._src.close()
            self._src = None

    def copy_out(self, layer: int, part: Part, offset: int, dest: memoryview) -> None:
        la = self.layers[layer]
        sp = la.k if part is Part.K else la.v
        if sp.transposed and (np := _optional_numpy()) is not None:
            self._untranspose_into(np, layer, part, la, sp, offset, dest)
        elif sp.transposed or sp.ggml_type is GGMLType.Q8_0:
            data = self._rearranged(layer, part, la, sp)
            dest[:] = memoryview(data)[offset : offset + len(dest)]
        else:
            self._gather_rows(sp, la, offset, dest)

    def _columns(self, np: Any, layer: int, part: Part, la: _LayerSource, sp: SlotPart) -> Any:
        """The layer part's transposed V ([value][cell]), read once into one buffer kept for every layer."""
        if self._cols is not None and self._cols[:2] == (layer, part):
            return self._cols[2]
        size = sp.n_embd * la.n_cells * sp.row_bytes
        if self._cols_buf is None or len(self._cols_buf) < size:
            self._cols_buf = np.empty(size, np.uint8)
        self._source().read_into(memoryview(self._cols_buf)[:size], sp.offset)
        cols = self._cols_buf[:size].view(f"<u{sp.row_bytes}").reshape(sp.n_embd, la.n_cells)
        self._cols = (layer, part, cols)
        return cols

    def _untranspose_into(
        self, np: Any, layer: int, part: Part, la: _LayerSource, sp: SlotPart, offset: int, dest: memoryview
    ) -> None:
        """Bytes [offset, offset + len(dest)) of the part's rows, transposed from its columns straight into
        dest: whole rows in place, a row cut by either end of dest through one row's scratch."""
        cols = self._columns(np, layer, part, la, sp)
        row, end = sp.n_embd * sp.row_bytes, offset + len(dest)
        first, last = -(-offset // row), end // row  # the whole rows in dest
        if first < last:
            rows = np.frombuffer(dest, cols.dtype, (last - first) * sp.n_embd, first * row - offset)
            if self._scratch is None and "numba" in sys.modules:  # only the kernel goes through it
                self._scratch = np.empty(TRANSPOSE_SCRATCH, np.uint8)
            _untranspose_runs(cols, rows.reshape(-1, sp.n_embd), first, la.runs, self._scratch)
        for t in {t for t, cut in ((offset // row, offset % row), (end // row, end % row)) if cut}:
            one = np.empty((1, sp.n_embd), cols.dtype)
            _untranspose_runs(cols, one, t, la.runs)
            lo, hi = max(offset, t * row), min(end, (t + 1) * row)
            dest[lo - offset : hi - offset] = one.view(np.uint8).reshape(-1)[lo - t * row : hi - t * row]

    def _source(self) -> FileSource:
        if self._src is None:
            self._src = FileSource(self.slot.path)
        return self._src

    def _gather_rows(self, sp: SlotPart, la: _LayerSource, offset: int, dest: memoryview) -> None:
        """Bytes [offset, offset + len(dest)) of the part's rows in position order, read straight into dest."""
        row, end, src = sp.row_bytes, offset + len(dest), self._source()
        for t0, cell0, count in la.runs:
            lo, hi = max(offset, t0 * row), min(end, (t0 + count) * row)
            if lo < hi:
                src.read_into(dest[lo - offset : hi - offset], sp.offset + cell0 * row + lo - t0 * row)

    def _rearranged(self, layer: int, part: Part, la: _LayerSource, sp: SlotPart) -> bytes:
        """The whole layer part in format v1's layout (rows in position order, dequantized): one at a time."""
        if self._cache is not None and self._cache[:2] == (layer, part):
            return self._cache[2]
        src = self._source()
        if sp.transposed:
            raw = src.read(sp.n_embd * la.n_cells * sp.row_bytes, sp.offset)
            data = _untranspose(raw, sp.row_bytes, sp.n_embd, la.n_cells, la.runs)
        else:
            rows = bytearray(la.held * sp.row_bytes)
            self._gather_rows(sp, la, 0, memoryview(rows))
            data = dequantize_q8_0(bytes(rows), la.held * sp.n_embd, la.k_rot if part is Part.K else la.v_rot)
        self._cache = (layer, part, data)
        return data


def _model_identity(model: str | os.PathLike) -> ModelIdentity:
    return model_fingerprint([(MODEL_ROLE, model)])


def llamacpp_config(slot: SlotFile, geometry: ModelGeometry) -> dict[str, Any]:
    """The config mapping a converted file carries when no engine's config is given: where it came from."""
    sec = slot.sections[0]
    return {
        "engine": "llama.cpp",
        "sequence_state_version": SLOT_VERSION,
        "architecture": geometry.architecture,
        "n_layer": len(geometry.layers),
        "k_type": GGML_TYPES[sec.k[0].ggml_type].name if sec.k else None,
        "v_type": GGML_TYPES[sec.v[0].ggml_type].name if sec.v else None,
        "v_trans": sec.v_trans,
    }


def slot_to_session(
    slot_path: str | os.PathLike,
    model: str | os.PathLike,
    out: str | os.PathLike,
    *,
    config: ConfigIdentity | Mapping[str, Any] | None = None,
    engine_fields: bytes = b"",
    block_size: int = 4 << 20,
    geometry: ModelGeometry | None = None,
    key: SessionKey | bytes | None = None,
):
    """Convert a llama.cpp slot file written with ``model`` into a format v1 file at ``out``; the file
    carries ``model``'s fingerprint and ``config`` (an engine's config identity, or a mapping; default: a
    mapping naming llama.cpp). ``geometry``: ``model_geometry(model)``, kept by a caller that converts often.
    ``key``: the file is authenticated with it (``save``'s MAC), as a holder of the key writes it.
    Returns the SaveReport."""
    geometry = geometry or model_geometry(model)
    slot = read_slot_file(slot_path, geometry)
    if config is None:
        config = llamacpp_config(slot, geometry)
    cfg = config if isinstance(config, ConfigIdentity) else config_fingerprint(config)
    source = SlotSource(slot, geometry, EngineIdentity(_model_identity(model), cfg), engine_fields)
    try:
        return save(out, source, block_size=block_size, key=key)
    finally:
        source.close()


def _stat(path: str | os.PathLike) -> tuple[int, ...]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def restore_slot(
    slot_path: str | os.PathLike,
    model: str | os.PathLike,
    target: SessionTarget,
    *,
    engine_fields: bytes = b"",
    mode: RestoreMode | str = RestoreMode.AUTO,
    block_size: int = DEFAULT_BLOCK_SIZE,
    progress: Callable[[Progress], None] | None = None,
    geometry: ModelGeometry | None = None,
) -> RestoreReport:
    """Restore a llama.cpp slot file written with ``model`` straight into an engine (``target``), with no
    format v1 file in between: the engine sees the plan and the checks a restore of the converted file
    would give it (``transfer``). The slot file names no engine configuration: it is bound to the target's
    (as ``slot_to_session(config=...)`` binds it); the model is ``model``'s fingerprint. A file changed
    while it is restored is refused (``FileChanged``; staged: the live session kept)."""
    geometry = geometry or model_geometry(model)
    before = _stat(slot_path)
    slot = read_slot_file(slot_path, geometry)
    config = adapter_call(target.identity).config
    source = SlotSource(slot, geometry, EngineIdentity(_model_identity(model), config), engine_fields)
    try:
        return transfer(
            source,
            target,
            path=os.fspath(slot_path),
            mode=mode,
            block_size=block_size,
            progress=progress,
            changed=lambda: _stat(slot_path) != before,
        )
    finally:
        source.close()


def config_of(session_path: str | os.PathLike) -> ConfigIdentity:
    """The config identity a format v1 file carries (to write another file for the same engine)."""
    return inspect(session_path, verify=False).metadata.config


# --- format v1 -> slot file -----------------------------------------------------------------------------
@attrs.frozen
class SlotOptions:
    """How llama.cpp's cache that will load the file is laid out (``None`` type: keep the file's dtype)."""

    k_type: GGMLType | None = None
    v_type: GGMLType | None = None
    v_trans: bool = False  # llama.cpp with flash attention off transposes V
    rotate: bool = True  # a q8_0 cache rotated as llama.cpp rotates it (False: for LLAMA_ATTN_ROT_DISABLE=1)
    n_stream: int = 1  # llama-server's unified cache has one
    stream: int = 0


class SlotTarget(
    StagesByApplying
):  # the temporary file is the staging area: nothing is published before the commit
    """A SessionTarget that writes the restored session as a slot file (crash-safe, through FileSink)."""

    def __init__(
        self,
        out: str,
        geometry: ModelGeometry,
        model: ModelIdentity,
        config: ConfigIdentity,
        opts: SlotOptions,
    ):
        self.out, self.geometry, self.opts = out, geometry, opts
        self._identity = EngineIdentity(model, config)
        self.sink: FileSink | None = None
        self._parts: dict[tuple[int, Part], _OutPart] = {}
        self._pending: dict[tuple[int, Part], bytearray] = {}
        self._meta: list[tuple[int, bytes]] = []
        self.n_tokens = 0
        self.size = 0
        self._cols_buf: Any = None
        self._carry_of: tuple[int, Part] | None = None  # the part whose pieces are coming in (numpy)
        self._carry, self._next = b"", 0  # its row cut by the last piece's end; the next piece's offset

    def identity(self) -> EngineIdentity:
        return self._identity

    def limits(self) -> EngineLimits:
        return EngineLimits(max_tokens=LIMIT["MAX_TOKENS"])

    def _check_layers(self, plan: RestorePlan) -> None:
        model = self.geometry.layers
        got = plan.layers
        problems = []
        if len(got) != len(model):
            problems.append(f"{len(got)} layers; the model has {len(model)}")
        for i, (g, la) in enumerate(zip(got, model, strict=False)):
            s = g.spec
            have = (s.index, s.n_kv_heads, s.head_dim_k, s.head_dim_v, s.window, s.extra_bytes)
            want = (la.index, la.n_kv_heads, la.head_dim_k, la.head_dim_v, la.window, 0)
            if have != want:
                problems.append(
                    f"layer {i} is (index, heads, dk, dv, window, extra) {have}; the model's {want}"
                )
            for dt in (s.k_dtype, s.v_dtype):
                if dt not in V1_TO_GGML:
                    problems.append(f"layer {i} holds {DTYPES[dt].name}, which llama.cpp's cache cannot take")
        if problems:
            raise E.SlotGeometryMismatch("; ".join(problems[:8]), path=plan.path, field="layers")

    def check_plan(self, plan: RestorePlan) -> None:
        self._check_layers(plan)
        n = plan.state.n_tokens
        if plan.state.position != n:
            raise E.SlotCellsInvalid(
                f"position {plan.state.position} differs from the {n} tokens held", path=plan.path
            )
        self._layout(plan)

    def _layout(self, plan: RestorePlan) -> None:
        """Every byte of the slot file but the K/V values (kept as (offset, bytes) pieces), and where each
        layer part's values go."""
        opts, st = self.opts, plan.state
        n = st.n_tokens
        tok = array.array("i", st.tokens)
        if sys.byteorder != "little":
            tok.byteswap()
        pos = 0
        packed = struct.pack("<iII", PACKED_MARKER, PACKED_VERSION, n) + tok.tobytes() + U32.pack(0)
        meta = bytearray(struct.pack("<III", SLOT_MAGIC, SLOT_VERSION, len(packed) // 4) + packed)
        by_index = {g.spec.index: (i, g) for i, g in enumerate(plan.layers)}
        for section in self.geometry.sections:
            window = section[0].window
            held = min(n, window) if window else n
            meta += U32.pack(opts.n_stream)
            for s in range(opts.n_stream):
                cells = held if s == opts.stream else 0
                meta += U32.pack(cells)
                if not cells:
                    continue
                meta += b"".join(CELL.pack(p, 1, 0) for p in range(n - held, n))
                rot = {part: self._rotation(section, part) for part in (Part.K, Part.V)}
                meta += DATA_HEAD.pack(int(opts.v_trans), len(section), rot[Part.K], rot[Part.V])
                for part in (Part.K, Part.V):
                    for la in section:
                        layer, g = by_index[la.index]
                        src = g.spec.k_dtype if part is Part.K else g.spec.v_dtype
                        dst = (opts.k_type if part is Part.K else opts.v_type) or V1_TO_GGML[src]
                        info = GGML_TYPES[dst]
                        n_embd = la.n_embd_k if part is Part.K else la.n_embd_v
                        if n_embd % info.block:
                            raise E.SlotUnsupportedType(
                                f"{n_embd} values per row are not whole {info.name} blocks"
                            )
                        trans = part is Part.V and opts.v_trans
                        if trans:
                            if info.block != 1:
                                raise E.SlotUnsupportedType(f"V of type {info.name} cannot be transposed")
                            meta += TRANS_HEAD.pack(dst, info.block_bytes, n_embd)
                        else:
                            meta += ROW_HEAD.pack(dst, info.row_size(n_embd))
                        self._meta.append((pos, bytes(meta)))
                        pos += len(meta)
                        meta = bytearray()
                        size = held * info.row_size(n_embd)
                        out = _OutPart(pos, size, src, dst, n_embd, held, trans, rot[part])
                        self._parts[(layer, part)] = out
                        pos += size
        self._meta.append((pos, bytes(meta)))
        self.size = pos + len(meta)
        self.n_tokens = n

    def _rotation(self, section: tuple[ModelLayer, ...], part: Part) -> int:
        """The rotation llama.cpp gives this cache's K or V of the options' type (none unless rotating)."""
        ggml_type = self.opts.k_type if part is Part.K else self.opts.v_type
        if not self.opts.rotate or ggml_type is None:
            return 0
        return llamacpp_rotation(
            ggml_type, [la.head_dim_k if part is Part.K else la.head_dim_v for la in section], part
        )

    def begin_apply(self, plan: RestorePlan) -> None:
        self.sink = FileSink(self.out)
        self.sink.create()
        self.sink.reserve(self.size)
        for at, data in self._meta:
            self.sink.write_at(data, at)

    def copy_in(self, layer: int, part: Part, offset: int, src: memoryview) -> None:
        out = self._parts[(layer, part)]
        assert self.sink is not None
        if not out.transposed and V1_TO_GGML[out.src] is out.dst:
            self.sink.write_at(src, out.offset + offset)  # type: ignore[arg-type]  # pwrite takes any buffer
            return
        np = _optional_numpy()
        if np is not None:
            self._rows_in(np, layer, part, out, offset, src)
            return
        # without numpy only a transpose of the same dtype gets here: the whole layer part, then rearranged
        buf = self._pending.get((layer, part))
        if buf is None:
            buf = self._pending[(layer, part)] = bytearray(out.held * out.n_embd * DTYPES[out.src].itemsize)
        buf[offset : offset + len(src)] = src
        if offset + len(src) == len(buf):
            del self._pending[(layer, part)]
            self.sink.write_at(
                _transpose(bytes(buf), GGML_TYPES[out.dst].block_bytes, out.n_embd), out.offset
            )

    def _rows_in(self, np: Any, layer: int, part: Part, out: _OutPart, offset: int, src: memoryview) -> None:
        """A part's pieces, in order: their whole rows converted and written (a transposed V: transposed into
        the layer's columns, kept in one buffer and written once whole); a row cut by a piece's end waits
        for the next piece."""
        row, key = out.n_embd * DTYPES[out.src].itemsize, (layer, part)
        if self._carry_of != key:
            self._carry_of, self._carry, self._next = key, b"", 0
        if offset != self._next:
            raise E.AdapterFailed(
                f"layer {layer} {part.name}: a piece at byte {offset}, expected {self._next}"
            )
        if self._carry:  # the cut row first, completed from the head of this piece
            take = min(row - len(self._carry), len(src))
            self._carry += bytes(src[:take])
            if len(self._carry) == row:
                self._put_rows(np, out, (offset + take) // row - 1, memoryview(self._carry))
                self._carry = b""
            src, offset = src[take:], offset + take
        whole = len(src) // row * row
        if whole:
            self._put_rows(np, out, offset // row, src[:whole])
        self._carry += bytes(src[whole:])
        self._next = offset + len(src)
        if self._next == out.held * row:
            self._carry_of = None
            if out.transposed:
                assert self.sink is not None
                self.sink.write_at(self._columns(np, out).reshape(-1).view(np.uint8), out.offset)

    def _put_rows(self, np: Any, out: _OutPart, first: int, rows: memoryview) -> None:
        """Whole rows from row ``first`` on: converted, and written (a transposed V: into its columns)."""
        values = rows if V1_TO_GGML[out.src] is out.dst else convert_values(rows, out.src, out.dst, out.n_rot)
        if out.transposed:
            cols = self._columns(np, out)
            piece = np.frombuffer(values, cols.dtype).reshape(-1, out.n_embd)
            transpose_into(cols[:, first : first + len(piece)], piece)
        else:
            assert self.sink is not None
            self.sink.write_at(values, out.offset + first * GGML_TYPES[out.dst].row_size(out.n_embd))  # type: ignore[arg-type]

    def _columns(self, np: Any, out: _OutPart) -> Any:
        """The layer's transposed V ([value][token]) being filled: one buffer, kept for every layer."""
        el = GGML_TYPES[out.dst].block_bytes
        size = out.n_embd * out.held * el
        if self._cols_buf is None or len(self._cols_buf) < size:
            self._cols_buf = np.empty(size, np.uint8)
        return self._cols_buf[:size].view(f"<u{el}").reshape(out.n_embd, out.held)

    def commit(self, state: RunningState) -> None:
        assert self.sink is not None
        self.sink.flush()
        self.sink.publish()
        self.sink.sync_folder()
        self.sink = None

    def fail_stop(self, error: Exception) -> None:
        self.discard()

    def discard(self) -> None:
        if self.sink is not None:
            self.sink.discard()
            self.sink = None


@attrs.frozen
class _OutPart:
    offset: int
    size: int
    src: DType
    dst: GGMLType
    n_embd: int
    held: int
    transposed: bool
    n_rot: int = 0


TRANSPOSE_SCRATCH = 192 << 10  # bytes of rows transposed at a time: in L2 (512 of SmolLM2's 384-byte rows)
ELEMENT_CODES = {2: "H", 4: "I"}  # array typecodes by element size (f16/bf16, f32)


def _optional_numpy() -> Any:
    """numpy where installed: transposing a layer's V is one copy there, a loop over values without it."""
    try:
        import numpy as np
    except ImportError:
        return None
    return np


def _untranspose(
    raw: bytes, el: int, n_embd: int, n_cells: int, runs: Sequence[tuple[int, int, int]]
) -> bytes:
    """A transposed V ([value][cell]) as rows ([token][value]) in position order (``runs``), without numpy."""
    in_order = len(runs) == 1 and runs[0][1] == 0
    code = ELEMENT_CODES[el]
    src = array.array(code, raw)
    out = array.array(code, bytes(len(raw)))
    for j in range(n_embd):
        column = src[j * n_cells : (j + 1) * n_cells]
        if not in_order:
            column = array.array(code, b"".join(column[cell : cell + n].tobytes() for _, cell, n in runs))
        out[j::n_embd] = column
    return out.tobytes()


def _untranspose_runs(
    cols: Any, rows: Any, first: int, runs: Sequence[tuple[int, int, int]], scratch: Any = None
) -> None:
    """rows[i] = the values of position first + i: each run's cells (``_runs``) transposed into place."""
    hi_all = first + len(rows)
    for t0, cell0, count in runs:
        lo, hi = max(first, t0), min(hi_all, t0 + count)
        if lo < hi:
            transpose_into(rows[lo - first : hi - first], cols[:, cell0 + lo - t0 : cell0 + hi - t0], scratch)


def transpose_into(dst: Any, src: Any, scratch: Any = None) -> None:
    """dst[...] = src.T (2-D numpy arrays of one dtype): numba's blocked kernel where this process has numba
    loaded already (an engine), else numpy's strided copy (bench/sessionfile/DECISIONS.md, "llama.cpp slot
    files"): importing numba costs more than it saves one conversion. ``scratch`` (a uint8 buffer, for the
    kernel into C-contiguous rows): the rows transposed a block at a time into it, then copied whole."""
    kernel = _numba_transpose() if "numba" in sys.modules else None
    if kernel is None or not (src.flags.aligned and dst.flags.aligned):
        dst[...] = src.T
    elif scratch is None or not dst.flags.c_contiguous:
        kernel(dst, src)
    else:
        _transpose_through(kernel, dst, src, scratch)


def _transpose_through(kernel: Callable[[Any, Any], None], dst: Any, src: Any, scratch: Any) -> None:
    """The kernel into a block of rows that stays in L2, copied whole into dst: the caller's cold rows are
    written in long runs, not 16 bytes a row at a time (x0.8 of the CPU, "The transposed V's floor")."""
    block = len(scratch) // (dst.itemsize * dst.shape[1])
    if block >= len(dst) or block == 0:
        kernel(dst, src)
        return
    rows = scratch[: block * dst.shape[1] * dst.itemsize].view(dst.dtype).reshape(block, dst.shape[1])
    for t in range(0, len(dst), block):
        n = min(block, len(dst) - t)
        kernel(rows[:n], src[:, t : t + n])
        dst[t : t + n] = rows[:n]


def _numba_transpose() -> Callable[[Any, Any], None] | None:
    try:
        from ._transpose_kernel import transpose_blocked
    except ImportError:  # numba loaded but unusable (a partial install): numpy's copy
        return None
    return transpose_blocked


def _transpose(data: bytes, el: int, n_embd: int) -> bytes:
    """Rows ([token][value]) as llama.cpp's transposed V ([value][token]), without numpy."""
    src = array.array(ELEMENT_CODES[el], data)
    return b"".join(src[j::n_embd].tobytes() for j in range(n_embd))


def session_to_slot(
    session_path: str | os.PathLike,
    model: str | os.PathLike,
    out: str | os.PathLike,
    opts: SlotOptions = SlotOptions(),
    *,
    block_size: int = 4 << 20,
    geometry: ModelGeometry | None = None,
):
    """Convert a format v1 file of ``model`` into a llama.cpp slot file at ``out`` (crash-safe: the old
    file at ``out`` stays until the new one is whole). The file's model fingerprint must be ``model``'s;
    its layers must be the model's. Returns the RestoreReport."""
    geometry = geometry or model_geometry(model)
    config = config_of(session_path)
    target = SlotTarget(os.fspath(out), geometry, _model_identity(model), config, opts)
    try:
        return restore(session_path, target, mode="staged", block_size=block_size)
    finally:
        target.discard()
