"""A lean GGUF reader: header, metadata and tensor table, validated against the file size.

Layout (little-endian; GGUF v2 and v3)::

    u32 magic "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv x     (string key, u32 value_type, value)
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims] (ggml order, fastest first),
                 u32 ggml_type, u64 offset relative to the data section)
    padding to `general.alignment` (default 32)
    data section

A string is a u64 byte length followed by UTF-8 bytes; an array is (u32 element type, u64 count,
elements). Value-type and tensor-type codes are the on-disk codes of `gguf.GGUFValueType` and
`gguf.GGMLQuantizationType`.

Decoded metadata values:
  * scalars as Python int / float / bool / str;
  * arrays of strings as ``list[str]``;
  * numeric and bool arrays as read-only **numpy arrays** of the on-disk dtype (e.g. ``float32`` for
    ``tokenizer.ggml.scores``, ``int32`` for ``tokenizer.ggml.token_type``); use ``.tolist()`` for lists;
  * arrays of arrays as lists of the above.

`gguf.GGUFReader` builds a numpy view per field element, which takes ~10 s on gemma3's 262,144-token
vocabulary; here string arrays are decoded in one pass over the bytes and numeric arrays are
`np.frombuffer` slices, which keeps a full parse well under a second.

Every count and offset is checked against the file size before it is trusted; a problem raises
`GGUFError` naming the field and the byte offset.
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path
from typing import Any

import attrs
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from ..errors import GGUFError, UnsupportedTensorType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4

# Scalar value types: struct format and numpy dtype, keyed by the on-disk code.
_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_SCALAR_DTYPES: dict[GGUFValueType, np.dtype] = {
    vt: np.dtype(fmt) if vt != GGUFValueType.BOOL else np.dtype(np.bool_)
    for vt, fmt in _SCALAR_FORMATS.items()
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@attrs.frozen
class TensorInfo:
    """One entry of the tensor table.

    `shape` is in numpy order (slowest dimension first: a ggml ``[ne0, ne1]`` matrix is ``(ne1, ne0)``,
    i.e. ``(rows, row_length)``); `offset` is absolute in the file.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int
    n_bytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@attrs.frozen
class GGUFFile:
    """What `read_gguf` parsed. `metadata_range` is the ``[start, end)`` byte range of the key/value block
    (the model fingerprint hashes it); `data_offset` is where the aligned data section starts."""

    path: Path
    version: int
    file_size: int
    metadata: dict[str, Any] = attrs.field(repr=False)
    tensors: dict[str, TensorInfo] = attrs.field(repr=False)
    alignment: int
    data_offset: int
    metadata_range: tuple[int, int]
    tensor_info_range: tuple[int, int]

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: general.architecture is missing or not a string")
        return arch

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of one tensor as a read-only uint8 array (a memory map of the file)."""
        try:
            info = self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: no tensor named {name!r}") from None
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.n_bytes,))


def tensor_n_bytes(shape: tuple[int, ...], ggml_type: GGMLQuantizationType) -> int:
    """Bytes of a tensor of `shape` (numpy order) stored as `ggml_type`."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    n_elements = 1
    for d in shape:
        n_elements *= d
    row = shape[-1] if shape else 1
    if row % block_size:
        raise UnsupportedTensorType(
            f"row length {row} is not a multiple of the {ggml_type.name} block size {block_size}"
        )
    return n_elements // block_size * type_size


class _Cursor:
    """Bounds-checked little-endian reads from a buffer; every error names what was being read and where."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf = buf
        self.pos = 0
        self.size = len(buf)
        self.path = path

    def fail(self, what: str, offset: int | None = None) -> GGUFError:
        return GGUFError(f"{self.path}: {what} at offset {self.pos if offset is None else offset}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"{what} needs {n} bytes but only {self.size - self.pos} remain in the file")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def string(self, what: str) -> str:
        start = self.pos
        n = self.u64(f"{what} length")
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} is not valid UTF-8 ({exc.reason})", start) from None

    def scalar(self, vtype: GGUFValueType, what: str) -> Any:
        fmt = _SCALAR_FORMATS[vtype]
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def value_type(self, what: str) -> GGUFValueType:
        at = self.pos
        code = self.u32(what)
        try:
            return GGUFValueType(code)
        except ValueError:
            raise self.fail(f"{what}: unknown value type code {code}", at) from None

    def value(self, vtype: GGUFValueType, what: str) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if vtype == GGUFValueType.ARRAY:
            return self.array(what)
        return self.scalar(vtype, what)

    def array(self, what: str) -> Any:
        etype = self.value_type(f"{what} element type")
        count = self.u64(f"{what} element count")
        if etype == GGUFValueType.STRING:
            return self.string_array(count, what)
        if etype == GGUFValueType.ARRAY:
            # Each element needs at least 12 bytes (type + count): refuse absurd counts before looping.
            self.need(count * 12, f"{what} ({count} nested arrays)")
            return [self.array(f"{what}[{i}]") for i in range(count)]
        dtype = _SCALAR_DTYPES[etype]
        self.need(count * dtype.itemsize, f"{what} ({count} x {etype.name})")
        arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
        arr.flags.writeable = False
        self.pos += count * dtype.itemsize
        return arr

    def string_array(self, count: int, what: str) -> list[str]:
        # Every string needs at least its 8-byte length: a count that cannot fit is refused up front.
        self.need(count * 8, f"{what} ({count} strings)")
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        out: list[str] = [""] * count
        for i in range(count):
            if pos + 8 > size:
                self.pos = pos
                raise self.fail(f"{what}[{i}] length runs past the end of the file")
            (n,) = unpack(buf, pos)
            pos += 8
            end = pos + n
            if end > size:
                self.pos = pos
                raise self.fail(f"{what}[{i}] ({n} bytes) runs past the end of the file")
            try:
                out[i] = str(buf[pos:end], "utf-8")
            except UnicodeDecodeError as exc:
                raise self.fail(f"{what}[{i}] is not valid UTF-8 ({exc.reason})", pos) from None
            pos = end
        self.pos = pos
        return out


def read_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Parse and validate the header, metadata and tensor table of a GGUF file (tensor data is not read)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise GGUFError(f"{path}: cannot open ({exc.strerror})") from exc
    try:
        file_size = os.fstat(fd).st_size
        if file_size < 24:
            raise GGUFError(f"{path}: {file_size} bytes is too small for a GGUF header (24 bytes)")
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                return _parse(view, path, file_size)
            finally:
                view.release()
    finally:
        os.close(fd)


def _parse(buf: memoryview, path: Path, file_size: int) -> GGUFFile:
    cur = _Cursor(buf, path)
    magic = bytes(buf[0:4])
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: bad magic {magic!r} at offset 0 (expected {GGUF_MAGIC!r})")
    cur.pos = 4
    version = cur.u32("version")
    if version not in SUPPORTED_VERSIONS:
        raise GGUFError(f"{path}: unsupported GGUF version {version} at offset 4 (supported: 2, 3)")
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("metadata count")
    # Each key/value needs >= 13 bytes (8 key length + 1 key byte + 4 type), each tensor entry >= 28.
    if n_kv * 13 + n_tensors * 28 > file_size - cur.pos:
        raise GGUFError(
            f"{path}: header claims {n_kv} metadata entries and {n_tensors} tensors, "
            f"which cannot fit in {file_size} bytes"
        )

    meta_start = cur.pos
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key_at = cur.pos
        key = cur.string(f"metadata key #{i}")
        if key in metadata:
            raise cur.fail(f"duplicate metadata key {key!r}", key_at)
        vtype = cur.value_type(f"metadata {key!r} type")
        metadata[key] = cur.value(vtype, f"metadata {key!r}")
    meta_end = cur.pos

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"{path}: general.alignment must be a power of two, got {alignment!r}")

    raw_tensors: list[tuple[str, tuple[int, ...], GGMLQuantizationType, int, int]] = []
    for i in range(n_tensors):
        entry_at = cur.pos
        name = cur.string(f"tensor #{i} name")
        n_dims = cur.u32(f"tensor {name!r} n_dims")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dimensions (1..{MAX_DIMS} allowed)", entry_at)
        dims = tuple(cur.u64(f"tensor {name!r} dim {d}") for d in range(n_dims))
        type_at = cur.pos
        code = cur.u32(f"tensor {name!r} type")
        try:
            ggml_type = GGMLQuantizationType(code)
        except ValueError:
            raise UnsupportedTensorType(
                f"{path}: tensor {name!r} has unknown ggml type code {code} at offset {type_at}"
            ) from None
        rel_offset = cur.u64(f"tensor {name!r} offset")
        raw_tensors.append((name, tuple(reversed(dims)), ggml_type, rel_offset, entry_at))
    tensor_info_end = cur.pos

    data_offset = -(-tensor_info_end // alignment) * alignment
    if data_offset > file_size:
        raise GGUFError(f"{path}: data section would start at {data_offset}, past the file end {file_size}")

    tensors: dict[str, TensorInfo] = {}
    for name, shape, ggml_type, rel_offset, entry_at in raw_tensors:
        if name in tensors:
            raise GGUFError(f"{path}: duplicate tensor name {name!r} at offset {entry_at}")
        if rel_offset % alignment:
            raise GGUFError(
                f"{path}: tensor {name!r} offset {rel_offset} (entry at {entry_at}) is not aligned to {alignment}"
            )
        try:
            n_bytes = tensor_n_bytes(shape, ggml_type)
        except UnsupportedTensorType as exc:
            raise UnsupportedTensorType(f"{path}: tensor {name!r}: {exc}") from None
        start = data_offset + rel_offset
        if start + n_bytes > file_size:
            raise GGUFError(
                f"{path}: tensor {name!r} data [{start}, {start + n_bytes}) runs past the file end {file_size}"
            )
        tensors[name] = TensorInfo(name=name, shape=shape, ggml_type=ggml_type, offset=start, n_bytes=n_bytes)

    # Overlapping tensors mean a corrupt table: check neighbours in offset order.
    ordered = sorted(tensors.values(), key=lambda t: t.offset)
    for a, b in zip(ordered, ordered[1:], strict=False):
        if a.offset + a.n_bytes > b.offset:
            raise GGUFError(f"{path}: tensors {a.name!r} and {b.name!r} overlap at offset {b.offset}")

    return GGUFFile(
        path=path,
        version=version,
        file_size=file_size,
        metadata=metadata,
        tensors=tensors,
        alignment=alignment,
        data_offset=data_offset,
        metadata_range=(meta_start, meta_end),
        tensor_info_range=(meta_end, tensor_info_end),
    )
