"""Optional compression of the data section (spec section 3.3): the save option, the codec registry, the
zstd codec, and the validation of a compressed data section's header and block table.

A compressed data section is a 16-byte compression header, then one independent frame per block of
``block_size`` uncompressed bytes (the last block may be shorter), then a block table of each frame's
compressed size. Every frame is decoded on its own into a buffer of exactly its block's size, so memory
stays bounded by the block size whatever the frame claims.

zstandard is an optional dependency (``pip install strata-sessionfile[zstd]``). It is imported only when a
compressed file is written or its frames are decoded; without it those refuse with
``CompressionUnavailable``. It is imported on every use (not cached here), so a test can hide it.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Callable, Iterator

import attrs

from . import errors as E
from .format import (
    BLOCK_ENTRY_STRUCT,
    COMPRESSION_HEADER_STRUCT,
    LIMIT,
    MIN_COMPRESSED_BLOCK_SIZE,
    Codec,
)

COMPRESSION_HEADER_SIZE = COMPRESSION_HEADER_STRUCT.size  # 16
ZSTD_MIN_LEVEL = -(1 << 17)  # zstd's fastest (negative) levels
ZSTD_MAX_LEVEL = 22
DEFAULT_LEVEL = 3


def zstd_frame_bound(n: int) -> int:
    """ZSTD_COMPRESSBOUND(n): the largest frame zstd writes for n input bytes (header and block headers included)."""
    return n + (n >> 8) + (((128 << 10) - n) >> 11 if n < (128 << 10) else 0)


def _load_zstd():
    try:
        import zstandard
    except ImportError as exc:
        raise E.CompressionUnavailable(
            "zstd compression needs the zstandard package: pip install 'strata-sessionfile[zstd]'"
        ) from exc
    return zstandard


def _zstd_window_limit(block_size: int) -> int:
    """The largest window a legitimate frame of block_size bytes needs: the next power of two (min 1 KiB).
    The decoder refuses a frame that asks for more, so a crafted header cannot make it allocate more."""
    return max(1 << 10, 1 << (block_size - 1).bit_length())


class ZstdCodec:
    code = Codec.ZSTD
    name = "zstd"
    min_level = ZSTD_MIN_LEVEL
    max_level = ZSTD_MAX_LEVEL

    @staticmethod
    def frame_bound(n: int) -> int:
        return zstd_frame_bound(n)

    @staticmethod
    def require() -> None:
        _load_zstd()

    @staticmethod
    def encoder(options: Compression) -> Callable[[memoryview], bytes]:
        """block bytes -> one frame holding its content size, no checksum (the payload hash covers the frames)."""
        zstd = _load_zstd()
        cctx = zstd.ZstdCompressor(
            level=options.level,
            threads=options.threads,
            write_checksum=False,
            write_content_size=True,
            write_dict_id=False,
        )
        return cctx.compress

    @staticmethod
    def decoder(block_size: int, path: str | None) -> Callable[[memoryview, int, int, int], bytes]:
        """(frame, expected size, block index, file offset) -> exactly ``expected`` decoded bytes, or a refusal."""
        zstd = _load_zstd()
        dctx = zstd.ZstdDecompressor(max_window_size=_zstd_window_limit(block_size))

        def decode(frame: memoryview, expected: int, index: int, offset: int) -> bytes:
            field = f"frames[{index}]"
            try:
                declared = zstd.get_frame_parameters(frame).content_size
            except zstd.ZstdError as exc:
                raise E.FrameCorrupt(
                    f"block {index} is not a zstd frame: {exc}", path=path, offset=offset, field=field
                ) from None
            if declared != expected:  # also CONTENTSIZE_UNKNOWN: never decode without a bound
                what = (
                    "does not declare its size"
                    if declared == zstd.CONTENTSIZE_UNKNOWN
                    else f"declares {declared} bytes"
                )
                raise E.DecompressedSizeMismatch(
                    f"block {index} {what}; the block holds {expected}", path=path, offset=offset, field=field
                )
            try:
                out = dctx.decompress(frame, max_output_size=expected, allow_extra_data=False)
            except zstd.ZstdError as exc:
                raise E.FrameCorrupt(
                    f"block {index} does not decode: {exc}", path=path, offset=offset, field=field
                ) from None
            if len(out) != expected:
                raise E.DecompressedSizeMismatch(
                    f"block {index} decoded to {len(out)} bytes; the block holds {expected}",
                    path=path,
                    offset=offset,
                    field=field,
                )
            return out

        return decode


CODECS: dict[Codec, type[ZstdCodec]] = {Codec.ZSTD: ZstdCodec}
CODEC_BY_NAME = {codec.name: code for code, codec in CODECS.items()}


def _check_codec(instance, attribute, value) -> None:
    if value not in CODEC_BY_NAME:
        raise ValueError(f"unknown compression codec {value!r}; known: {sorted(CODEC_BY_NAME)}")


@attrs.frozen
class Compression:
    """How ``save`` compresses the data section. ``threads``: 0 compresses on the save's writer thread (and
    gives the same bytes on every machine); N > 0 uses N zstd worker threads per frame; -1 one per CPU."""

    codec: str = attrs.field(default="zstd", validator=_check_codec)
    level: int = DEFAULT_LEVEL
    threads: int = 0

    def __attrs_post_init__(self) -> None:
        codec = CODECS[CODEC_BY_NAME[self.codec]]
        if not codec.min_level <= self.level <= codec.max_level:
            raise ValueError(f"{self.codec} level {self.level} out of {codec.min_level}..{codec.max_level}")
        if self.threads < -1:
            raise ValueError(f"threads must be -1, 0 or positive, not {self.threads}")

    @property
    def code(self) -> Codec:
        return CODEC_BY_NAME[self.codec]


def as_compression(value: Compression | str | None) -> Compression | None:
    """``save``'s ``compression=``: None or "none" (off), a codec name with its default level, or options."""
    if value is None or value == "none":
        return None
    if isinstance(value, Compression):
        return value
    if isinstance(value, str):
        return Compression(codec=value)
    raise TypeError(f"compression must be None, a codec name or a Compression, not {type(value).__name__}")


# --- the compressed data section ------------------------------------------------------------------
def n_blocks_for(data_length: int, block_size: int) -> int:
    return -(-data_length // block_size)


def block_length(index: int, n_blocks: int, block_size: int, data_length: int) -> int:
    return block_size if index < n_blocks - 1 else data_length - block_size * (n_blocks - 1)


def encode_compression_header(options: Compression, block_size: int, n_blocks: int) -> bytes:
    return COMPRESSION_HEADER_STRUCT.pack(options.code, 0, options.level, block_size, n_blocks)


def encode_block_table(frame_sizes) -> bytes:
    table = array.array("I", frame_sizes)
    if sys.byteorder != "little":
        table.byteswap()
    return table.tobytes()


@attrs.frozen
class CompressedLayout:
    """Where a compressed data section's parts lie (absolute offsets) and each frame's size."""

    codec: Codec
    level: int
    block_size: int  # uncompressed bytes per block; the last block may be shorter
    n_blocks: int
    header_offset: int  # = the layout's data_offset
    frames_offset: int
    frames_length: int
    table_offset: int
    data_length: int  # uncompressed bytes of the data section
    frame_sizes: array.array = attrs.field(repr=False)

    @property
    def max_frame(self) -> int:
        return max(self.frame_sizes, default=0)

    @property
    def section_length(self) -> int:
        return self.table_offset + BLOCK_ENTRY_STRUCT.size * self.n_blocks - self.header_offset

    def frames(self) -> Iterator[tuple[int, int]]:
        """(file offset, compressed size) of every frame, in file order."""
        pos = self.frames_offset
        for size in self.frame_sizes:
            yield pos, size
            pos += size


def decode_compressed_section(
    head: bytes,
    read_table: Callable[[int, int], bytes],
    *,
    data_offset: int,
    trailer_offset: int,
    data_length: int,
    path: str | None,
) -> CompressedLayout:
    """Validate the compression header and the block table (rules Z1-Z8) before any frame is read.

    ``read_table(offset, n)`` reads the table once its size is known to lie inside the section."""
    section = trailer_offset - data_offset
    if section < COMPRESSION_HEADER_SIZE or len(head) != COMPRESSION_HEADER_SIZE:
        raise E.CompressionInvalid(
            f"the data section of {section} bytes cannot hold the "
            f"{COMPRESSION_HEADER_SIZE}-byte compression header",
            path=path,
            offset=data_offset,
            field="compression",
        )
    code, reserved, level, block_size, n_blocks = COMPRESSION_HEADER_STRUCT.unpack(head)
    if code not in Codec._value2member_map_:
        raise E.UnsupportedCompression(
            f"compression codec {code}; this reader knows "
            f"{', '.join(f'{c.value} ({c.name.lower()})' for c in Codec)}",
            path=path,
            offset=data_offset,
            field="compression.codec",
        )
    if reserved:
        raise E.CompressionInvalid(
            f"reserved field is {reserved:#x}, must be 0",
            path=path,
            offset=data_offset + 2,
            field="compression.reserved",
        )
    if block_size < MIN_COMPRESSED_BLOCK_SIZE:
        raise E.CompressionInvalid(
            f"block size {block_size} is below {MIN_COMPRESSED_BLOCK_SIZE}",
            path=path,
            offset=data_offset + 8,
            field="compression.block_size",
        )
    if block_size > LIMIT["MAX_COMPRESSED_BLOCK_BYTES"]:
        raise E.LimitExceeded(
            f"block size {block_size} is over MAX_COMPRESSED_BLOCK_BYTES",
            path=path,
            offset=data_offset + 8,
            field="compression.block_size",
        )
    if n_blocks > LIMIT["MAX_COMPRESSED_BLOCKS"]:
        raise E.LimitExceeded(
            f"{n_blocks} blocks is over MAX_COMPRESSED_BLOCKS",
            path=path,
            offset=data_offset + 12,
            field="compression.n_blocks",
        )
    want = n_blocks_for(data_length, block_size)
    if n_blocks != want:
        raise E.CompressionInvalid(
            f"{n_blocks} blocks; {data_length} data bytes in blocks of {block_size} make {want}",
            path=path,
            offset=data_offset + 12,
            field="compression.n_blocks",
        )
    table_bytes = BLOCK_ENTRY_STRUCT.size * n_blocks
    frames_offset = data_offset + COMPRESSION_HEADER_SIZE
    table_offset = trailer_offset - table_bytes
    if table_offset < frames_offset:
        raise E.CompressionInvalid(
            f"the block table of {table_bytes} bytes does not fit in the data section of {section} bytes",
            path=path,
            offset=data_offset + 12,
            field="compression.n_blocks",
        )
    sizes = array.array("I")
    sizes.frombytes(read_table(table_offset, table_bytes))
    if sys.byteorder != "little":
        sizes.byteswap()
    bound = CODECS[Codec(code)].frame_bound
    full_bound = bound(block_size)
    for i, size in enumerate(sizes):
        limit = full_bound if i < n_blocks - 1 else bound(block_length(i, n_blocks, block_size, data_length))
        if not 1 <= size <= limit:
            raise E.CompressionInvalid(
                f"block {i}'s frame size {size} is out of range 1..{limit} for its "
                f"{block_length(i, n_blocks, block_size, data_length)} bytes",
                path=path,
                offset=table_offset + 4 * i,
                field=f"block_table[{i}]",
            )
    frames_length = table_offset - frames_offset
    total = sum(sizes)
    if total != frames_length:
        raise E.CompressionInvalid(
            f"the block table adds up to {total} frame bytes; the section holds {frames_length}",
            path=path,
            offset=table_offset,
            field="block_table",
        )
    return CompressedLayout(
        Codec(code),
        level,
        block_size,
        n_blocks,
        data_offset,
        frames_offset,
        frames_length,
        table_offset,
        data_length,
        sizes,
    )
