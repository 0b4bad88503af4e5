"""The read pass's checks before the data section (spec "Reading", rules H*, K1-K3, M*, B*, E*, Z1-Z9) and the
checks that close every pass (P1 the payload hash, K4 the authenticated payload digest, P2 / A1 the file
unchanged).

``open_metadata`` reads a source's header, metadata, padding, compression header, block table and
trailer, validating each before the next is trusted, and returns an ``OpenedFile``: what every later pass
needs, with the payload hash already run over the prefix.
"""

from __future__ import annotations

import array
import mmap
import sys
from collections.abc import Callable

import attrs

from . import errors as E
from .auth import PayloadHasher, SessionKey, check_authentication, payload_hasher
from .codec import METADATA_OFFSET, compute_layout, decode_header, decode_metadata, decode_trailer
from .compression import CODECS, COMPRESSION_HEADER_SIZE, decode_compressed_section
from .format import DATA_ALIGNMENT, HEADER_SIZE, LIMIT, Flags, align_up, trailer_size
from .identity import config_differences, model_differences
from .memory import HUGE_PAGE, fresh_buffer
from .pipelines import ReadAhead, ReadThreads, decode_workers, read_exact_parallel
from .records import EngineIdentity, EngineLimits, Header, Layout, SessionMetadata
from .seam import ByteSource, Stamp

_U32_SIZE = 4


@attrs.define
class OpenedFile:
    source: ByteSource
    path: str
    stamp: Stamp
    header: Header
    metadata: SessionMetadata
    layout: Layout
    prefix: bytearray | mmap.mmap  # payload bytes [64, data_offset): metadata length, metadata, padding
    trailer_digest: bytes
    bytes_read: int
    trailer: bytes = b""  # the trailer as on disk (24 bytes, 104 authenticated)
    auth_digest: bytes | None = None  # the authenticated payload digest each pass must reproduce (rule K4)
    section_head: bytes = b""  # a compressed data section's 16-byte compression header
    table: bytes = b""  # and its block table, as on disk
    prefix_hasher: PayloadHasher | None = None  # the payload hash after the prefix (hashed as it was read)
    ahead: ReadAhead | None = None  # the data section's first reads, started early (see reader.restore)

    def pass_hasher(self) -> PayloadHasher:
        """A pass's payload hash, started from the prefix's (copied: each pass hashes the data anew)."""
        assert self.prefix_hasher is not None, "a pass over the data needs the prefix hashed (hash_prefix)"
        return self.prefix_hasher.copy()


def binding_check(header: Header, body: bytes | memoryview, identity: EngineIdentity, path: str) -> None:
    """Rules B1, B2: both fingerprints; a refusal names what differs (from the stored model list and config)."""
    model_ok = header.model_fingerprint == identity.model.fingerprint
    config_ok = header.config_fingerprint == identity.config.fingerprint
    if model_ok and config_ok:
        return
    try:
        file_meta = decode_metadata(body, header=header, path=path)
    except E.SessionFileError:
        file_meta = None
    if not model_ok:
        diffs = model_differences(file_meta.model, identity.model) if file_meta else []
        raise E.ModelMismatch(
            "the file was written for another model",
            differences=diffs,
            path=path,
            offset=16,
            field="model_fingerprint",
        )
    diffs = config_differences(file_meta.config.mapping, identity.config.mapping) if file_meta else []
    raise E.ConfigMismatch(
        "the file was written with another engine configuration",
        differences=diffs,
        path=path,
        offset=32,
        field="config_fingerprint",
    )


def largest_id(tokens) -> int:
    """The largest token id: numpy's vectorised max where a caller already loaded it, else max() in C;
    numpy is never imported for this (its import costs a process that does not use it; see
    bench/sessionfile/DECISIONS.md, "Token ids")."""
    np = sys.modules.get("numpy")
    if np is not None and isinstance(tokens, array.array) and tokens.itemsize == 4:
        return int(np.frombuffer(tokens, dtype=np.int32).max())
    return max(tokens)


def check_limits(metadata: SessionMetadata, limits: EngineLimits, path: str | None = None) -> None:
    """Every count of the file against the running engine's exact limits (rules B3-B6)."""
    st = metadata.state
    if st.n_tokens > limits.max_tokens:
        raise E.LimitExceeded(
            f"the file holds {st.n_tokens} tokens; the engine's context is {limits.max_tokens}",
            path=path,
            field="state.n_tokens",
        )
    if limits.vocab_size is not None and st.n_tokens:
        top = largest_id(st.tokens)
        if top >= limits.vocab_size:
            raise E.LimitExceeded(
                f"token id {top} is outside the engine's vocabulary of {limits.vocab_size}",
                path=path,
                field="state.tokens",
            )
    for field, size, limit in (
        ("state.sampler_state", len(st.sampler_state), limits.max_sampler_state_bytes),
        ("state.checkpoint.data", len(st.checkpoint.data), limits.max_checkpoint_data_bytes),
        ("state.engine_fields", len(st.engine_fields), limits.max_engine_fields_bytes),
    ):
        if limit is not None and size > limit:
            raise E.LimitExceeded(
                f"{size} bytes is over the engine's limit of {limit}", path=path, field=field
            )
    if limits.layers is None:
        return
    file_layers = metadata.layers
    if len(file_layers) != len(limits.layers):
        raise E.GeometryMismatch(
            f"the file has {len(file_layers)} layers, the engine {len(limits.layers)}",
            path=path,
            field="layers.count",
        )
    diffs = []
    for i, (g, spec) in enumerate(zip(file_layers, limits.layers, strict=True)):
        if g.spec == spec:
            continue
        for field in attrs.fields(type(spec)):
            a, b = getattr(g.spec, field.name), getattr(spec, field.name)
            if a != b:
                show = (lambda v: v.name.lower()) if hasattr(a, "name") else repr
                diffs.append(f"layer {i} {field.name}: file {show(a)}, engine {show(b)}")
    if diffs:
        more = [f"... and {len(diffs) - 12} more"] if len(diffs) > 12 else []
        raise E.GeometryMismatch(
            "the file's K/V geometry differs from the engine's",
            differences=diffs[:12] + more,
            path=path,
            field="layers",
        )


def open_metadata(
    source: ByteSource,
    identity: EngineIdentity | None,
    limits: EngineLimits | None,
    readers: ReadThreads,
    require_codec: bool = True,
    hash_prefix: bool = True,
    key: SessionKey | None = None,
    require_mac: bool = False,
) -> OpenedFile:
    """Everything before the data section, validated in the spec's order (binding with ``identity``, the
    engine's limits with ``limits``; ``require_codec``: a compressed file's codec must be installed; ``key``
    and ``require_mac``: the authentication rules K1-K3, before the metadata is parsed)."""
    path = source.path
    stamp = source.stamp()
    size = stamp.size
    if size < HEADER_SIZE:
        raise E.Truncated(
            f"file is {size} bytes, shorter than the {HEADER_SIZE}-byte header", path=path, offset=size
        )
    header_raw = source.read(HEADER_SIZE, 0)
    header = decode_header(header_raw, path=path)
    tsize = trailer_size(header.flags)
    expected = HEADER_SIZE + header.payload_length + tsize
    if size < expected:
        raise E.Truncated(f"file is {size} bytes; its header promises {expected}", path=path, offset=size)
    if size > expected:
        raise E.TrailingData(
            f"file is {size} bytes; its header promises {expected}", path=path, offset=expected
        )
    trailer_offset = expected - tsize
    trailer = source.read(tsize, trailer_offset)
    auth_digest = check_authentication(
        header_raw, header.flags, trailer, trailer_offset, key, require_mac, path
    )
    if header.payload_length < _U32_SIZE:
        raise E.MetadataInvalid(
            f"payload of {header.payload_length} bytes cannot hold the metadata length",
            path=path,
            offset=48,
            field="payload_length",
        )
    raw_len = source.read(_U32_SIZE, METADATA_OFFSET)
    mlen = int.from_bytes(raw_len, "little")
    if mlen > LIMIT["MAX_METADATA_BYTES"]:
        raise E.LimitExceeded(
            f"metadata of {mlen} bytes is over MAX_METADATA_BYTES",
            path=path,
            offset=METADATA_OFFSET,
            field="metadata.length",
        )
    if _U32_SIZE + mlen > header.payload_length:
        raise E.MetadataInvalid(
            f"metadata of {mlen} bytes runs past the payload of {header.payload_length}",
            path=path,
            offset=METADATA_OFFSET,
            field="metadata.length",
        )
    # One buffer for the prefix [64, data_offset), filled in the order the checks need it: no copy of it.
    pad_start = METADATA_OFFSET + _U32_SIZE + mlen
    prefix = fresh_buffer(align_up(pad_start, DATA_ALIGNMENT) - METADATA_OFFSET)
    prefix[:_U32_SIZE] = raw_len
    body = memoryview(prefix)[_U32_SIZE : _U32_SIZE + mlen]
    # Read by the reader threads at once, hashed here in order (bench/sessionfile/DECISIONS.md, "Large metadata").
    hasher = payload_hasher(auth_digest is not None, raw_len) if hash_prefix else None
    read_exact_parallel(
        source,
        body,
        METADATA_OFFSET + _U32_SIZE,
        readers,
        HUGE_PAGE,
        hasher.update if hasher is not None else None,
    )
    if identity is not None:
        binding_check(header, body, identity, path)
    metadata = decode_metadata(
        body,
        header=header,
        path=path,
        known_config=identity.config.canonical if identity is not None else None,
    )
    layout = compute_layout(mlen, metadata.layers, tsize)
    section_head = table = b""
    if header.flags & Flags.DATA_COMPRESSED:
        if trailer_offset < layout.data_offset:
            raise E.MetadataInvalid(
                f"the payload of {header.payload_length} bytes ends before the data section at "
                f"{layout.data_offset}",
                path=path,
                offset=48,
                field="payload_length",
            )
        if trailer_offset - layout.data_offset >= COMPRESSION_HEADER_SIZE:
            section_head = source.read(COMPRESSION_HEADER_SIZE, layout.data_offset)

        def read_table(offset: int, n: int) -> bytes:
            nonlocal table
            table = source.read(n, offset)
            return table

        compressed = decode_compressed_section(
            section_head,
            read_table,
            data_offset=layout.data_offset,
            trailer_offset=trailer_offset,
            data_length=layout.data_length,
            path=path,
        )
        if require_codec:
            CODECS[compressed.codec].require()
        layout = attrs.evolve(
            layout, trailer_offset=trailer_offset, file_size=expected, compressed=compressed
        )
    elif layout.file_size != expected:
        raise E.MetadataInvalid(
            f"the geometry implies a payload of {layout.trailer_offset - HEADER_SIZE} bytes; "
            f"the header says {header.payload_length}",
            path=path,
            offset=48,
            field="payload_length",
        )
    assert layout.data_offset - METADATA_OFFSET == len(prefix)
    padding = memoryview(prefix)[pad_start - METADATA_OFFSET :]
    source.read_into(padding, pad_start)
    if any(padding):
        raise E.MetadataInvalid(
            "padding before the data section is not all zero", path=path, offset=pad_start, field="padding"
        )
    if hasher is not None:
        hasher.update(padding)
    trailer_digest = decode_trailer(trailer, trailer_offset, path=path)
    if limits is not None:
        check_limits(metadata, limits, path)
    return OpenedFile(
        source,
        path,
        stamp,
        header,
        metadata,
        layout,
        prefix,
        trailer_digest,
        HEADER_SIZE + len(prefix) + len(trailer) + len(section_head) + len(table),
        trailer,
        auth_digest,
        section_head,
        table,
        hasher,
    )


def preflight(
    opened: OpenedFile, block_size: int, n_buffers: int, memory_available: Callable[[], int | None] | None
) -> None:
    """Rule E5: what this restore will hold besides the engine's own memory fits in the RAM available."""
    if memory_available is None:
        return
    need = 2 * len(opened.prefix) + opened.metadata.state.n_tokens * 32
    comp = opened.layout.compressed
    if comp is None:
        need += n_buffers * block_size
    else:  # per decode worker a frame and its decoded block; the decoder's state (at most a block); the table
        need += (
            decode_workers() * (comp.max_frame + comp.block_size) + comp.block_size + 2 * len(opened.table)
        )
    have = memory_available()
    if have is not None and need > have:
        raise E.InsufficientMemory(
            f"this restore needs about {need} bytes of RAM; {have} are available", path=opened.path
        )


def check_digest(opened: OpenedFile, hasher, when: str) -> bytes:
    """Rules P1 and K4 (A3 after the gate): the payload hash a pass computed equals the trailer's, and an
    authenticated file's payload SHA-256 equals its authenticated payload digest."""
    digest = hasher.digest()
    if digest != opened.trailer_digest:
        raise E.PayloadCorrupt(
            f"payload hash {digest.hex()} does not match the trailer's "
            f"{opened.trailer_digest.hex()} ({when})",
            path=opened.path,
            offset=opened.layout.trailer_offset,
            field="payload_hash",
        )
    if opened.auth_digest is not None and hasher.payload_digest() != opened.auth_digest:
        raise E.PayloadNotAuthentic(
            f"the payload's SHA-256 does not match the authenticated payload digest ({when})",
            path=opened.path,
            offset=opened.layout.trailer_offset + 32,
            field="payload_digest",
        )
    return digest


def check_unchanged(opened: OpenedFile, when: str) -> None:
    """Rules P2, A1, A4: the source is the version the read pass opened."""
    now = opened.source.stamp()
    if now != opened.stamp:
        what = (
            "grew"
            if now.size > opened.stamp.size
            else "shrank"
            if now.size < opened.stamp.size
            else "was modified"
        )
        raise E.FileChanged(
            f"the file {what} {when} (size {opened.stamp.size} -> {now.size})", path=opened.path
        )
