"""The error hierarchy: one root, ``SessionFileError``, and one subclass per thing that went wrong.

Every class carries ``reason``, a stable machine-readable string (listed in spec/session-file-v1.md,
"Reasons"), so a server can map refusals to HTTP answers without parsing messages. Messages name the
field and the byte offset where that helps.
"""

from __future__ import annotations

import errno as _errno
from collections.abc import Sequence


class SessionFileError(Exception):
    """Root of every error this package raises about a session file or a save/restore."""

    reason: str = "session_file_error"

    def __init__(
        self, message: str, *, path: str | None = None, offset: int | None = None, field: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.path = path
        self.offset = offset
        self.field = field

    def __str__(self) -> str:
        where = []
        if self.field is not None:
            where.append(f"field {self.field}")
        if self.offset is not None:
            where.append(f"offset {self.offset}")
        prefix = f"{self.path}: " if self.path else ""
        suffix = f" ({', '.join(where)})" if where else ""
        return f"{prefix}{self.message}{suffix}"


# --- opening the file -------------------------------------------------------------------------------
class FileAccessError(SessionFileError):
    """The path cannot be opened as a session file (before any byte is read)."""

    reason = "file_access"


class NotFound(FileAccessError):
    reason = "not_found"


class PermissionDenied(FileAccessError):
    reason = "permission_denied"


class SymlinkRefused(FileAccessError):
    reason = "symlink"


class NotRegularFile(FileAccessError):
    reason = "not_regular_file"


class MultipleLinks(FileAccessError):
    reason = "multiple_links"


class ReadFailed(FileAccessError):
    """The operating system failed a read (EIO and friends), or the object store failed a request."""

    reason = "read_failed"


class StoreUnavailable(ReadFailed):
    """The object store did not answer (connection refused or lost, timeout, 5xx after retries)."""

    reason = "store_unavailable"


# --- the bytes are not a valid v1 session file ------------------------------------------------------
class InvalidFile(SessionFileError):
    """The file's bytes break a rule of the format."""

    reason = "invalid_file"


class Truncated(InvalidFile):
    reason = "truncated"


class TrailingData(InvalidFile):
    reason = "trailing_data"


class BadMagic(InvalidFile):
    reason = "bad_magic"


class UnsupportedVersion(InvalidFile):
    reason = "unsupported_version"


class UnsupportedFlags(InvalidFile):
    reason = "unsupported_flags"


class HeaderCorrupt(InvalidFile):
    reason = "header_corrupt"


class MetadataInvalid(InvalidFile):
    """A metadata field is malformed (bad enum code, length past the end, non-zero reserved bytes...)."""

    reason = "metadata_invalid"


class PayloadCorrupt(InvalidFile):
    reason = "payload_corrupt"


class BadEndMarker(InvalidFile):
    reason = "bad_end_marker"


class UnsupportedCompression(InvalidFile):
    """The compressed data section names a codec this reader does not know."""

    reason = "unsupported_compression"


class CompressionInvalid(InvalidFile):
    """The compression header or the block table breaks a rule (an entry out of range, sizes that do not add up)."""

    reason = "compression_invalid"


class FrameCorrupt(InvalidFile):
    """A compressed block does not decode as exactly one frame of its codec."""

    reason = "frame_corrupt"


class DecompressedSizeMismatch(InvalidFile):
    """A compressed block declares or decodes to a size other than its block's."""

    reason = "decompressed_size_mismatch"


class InconsistentState(InvalidFile):
    """The snapshot contradicts itself (a layer holds more tokens than the session, a checkpoint past the end...)."""

    reason = "inconsistent_state"


class LimitExceeded(InvalidFile):
    """A count or size is over a named format limit or over the running engine's limit."""

    reason = "limit_exceeded"


# --- the file is valid but not for this engine ------------------------------------------------------
class BindingMismatch(SessionFileError):
    reason = "binding_mismatch"

    def __init__(self, message: str, *, differences: Sequence[str] = (), **kw) -> None:
        if differences:
            message = f"{message}: " + "; ".join(differences)
        super().__init__(message, **kw)
        self.differences = tuple(differences)


class ModelMismatch(BindingMismatch):
    reason = "model_mismatch"


class ConfigMismatch(BindingMismatch):
    reason = "config_mismatch"


class GeometryMismatch(BindingMismatch):
    reason = "geometry_mismatch"


# --- keyed authentication (a reader holding a key) --------------------------------------------------
class AuthenticationFailed(SessionFileError):
    """The file is not authenticated by this reader's key (spec section 4.1, rules K1-K4)."""

    reason = "authentication_failed"


class MacMissing(AuthenticationFailed):
    """The file carries no MAC, and this reader accepts only authenticated files."""

    reason = "mac_missing"


class MacWrongKey(AuthenticationFailed):
    """The file's MAC was made with another key (its key id is not this reader's)."""

    reason = "mac_wrong_key"


class MacMismatch(AuthenticationFailed):
    """The MAC does not match the header and the payload hashes under this reader's key."""

    reason = "mac_mismatch"


class PayloadNotAuthentic(AuthenticationFailed):
    """The payload's SHA-256 differs from the authenticated payload digest."""

    reason = "payload_not_authentic"


# --- conditions of the restore ----------------------------------------------------------------------
class FileChanged(SessionFileError):
    """The file grew, shrank or changed between (or during) the passes."""

    reason = "file_changed"


class ObjectReplaced(FileChanged):
    """The object's pinned version (ETag, version id) is no longer what the store holds: replaced or deleted
    since the read pass began."""

    reason = "object_replaced"


class CompressionUnavailable(SessionFileError):
    """The file (or the save) uses a codec whose module is not installed (``pip install strata-sessionfile[zstd]``).

    The file may well be valid: this installation cannot decode it."""

    reason = "compression_unavailable"


class InsufficientMemory(SessionFileError):
    reason = "insufficient_memory"


class AdapterFailed(SessionFileError):
    """The engine's adapter raised something that is not a SessionFileError (kept as __cause__)."""

    reason = "adapter_failed"


class StagingUnavailable(SessionFileError):
    """A staged restore was asked for, but the adapter cannot stage (no StagingTarget, or can_stage said no)."""

    reason = "staging_unavailable"


class FailStop(SessionFileError):
    """A restore failed after the gate: the adapter was told to fail-stop; the live K/V is lost.

    ``cause`` is the error that struck after the gate; ``cause_reason`` its reason.
    """

    reason = "fail_stop"

    def __init__(self, cause: SessionFileError, **kw) -> None:
        super().__init__(f"restore failed after the first applied block: {cause}", **kw)
        self.cause = cause
        self.cause_reason = cause.reason


# --- saving -----------------------------------------------------------------------------------------
class InvalidSnapshot(SessionFileError):
    """The adapter's snapshot cannot be written (over a limit, inconsistent)."""

    reason = "invalid_snapshot"


class WriteFailed(SessionFileError):
    """Writing the temporary file failed; the old file at the target is untouched, the temporary removed."""

    reason = "write_failed"


class NoSpace(WriteFailed):
    reason = "no_space"


class DirSyncFailed(SessionFileError):
    """The new file is in place (renamed over the target) but flushing the folder failed."""

    reason = "dir_sync_failed"

    def __init__(self, message: str, *, report=None, **kw) -> None:
        super().__init__(message, **kw)
        self.report = report


# --- llama.cpp sequence state files (strata_sessionfile.llamacpp; spec/llama-cpp-slot.md) ---------------
class SlotFileError(SessionFileError):
    """A llama.cpp slot file (``llama_state_seq_save_file``) cannot be read or written as asked."""

    reason = "slot_file_error"


class SlotBadMagic(SlotFileError):
    """The first four bytes are not llama.cpp's sequence state magic ``ggsq``."""

    reason = "slot_bad_magic"


class SlotUnsupportedVersion(SlotFileError):
    """A sequence state version other than the one this reader knows (4, llama.cpp b11549)."""

    reason = "slot_unsupported_version"


class SlotTruncated(SlotFileError):
    """A count or length runs past the end of the file (checked before anything is read or allocated)."""

    reason = "slot_truncated"


class SlotTrailingData(SlotFileError):
    """Bytes follow the last cache section."""

    reason = "slot_trailing_data"


class SlotLimitExceeded(SlotFileError):
    """A count is over the format's limits (tokens, streams, layers)."""

    reason = "slot_limit_exceeded"


class SlotUnsupportedType(SlotFileError):
    """A ggml type this converter does not read or write (or a quantized type laid out transposed)."""

    reason = "slot_unsupported_type"


class SlotCellsInvalid(SlotFileError):
    """The cells do not form one conversation: several sequences per cell, several streams with cells,
    positions that are not one run, or fewer tokens than cells."""

    reason = "slot_cells_invalid"


class SlotGeometryMismatch(SlotFileError):
    """The file's layers disagree with the model's geometry (layer count, K/V row size, heads, head size,
    sliding windows, V transposition)."""

    reason = "slot_geometry_mismatch"


class SlotRotated(SlotFileError):
    """The K/V rows carry a Hadamard rotation (n_rot != 0) that llama.cpp does not make: of unquantized rows, or
    not a power of two from 64 dividing the head size (llama.cpp's own rotation of a q8_0 cache is undone)."""

    reason = "slot_rotated"


class SlotModelUnsupported(SlotFileError):
    """The GGUF model's architecture or metadata is not one whose cache layout this converter knows."""

    reason = "slot_model_unsupported"


class ConversionUnavailable(SlotFileError):
    """The conversion asked for needs numpy (quantizing or dequantizing q8_0, changing a dtype), which is
    not installed; the file may well be valid."""

    reason = "conversion_unavailable"


# --- transformers caches (strata_sessionfile.hf; spec/transformers-cache.md) ----------------------------
class CacheError(SessionFileError):
    """A transformers cache cannot be saved or loaded as asked."""

    reason = "cache_error"


class CacheUnsupported(CacheError):
    """The model's architecture has no verified K row mapping, the cache is not a DynamicCache of attention
    layers on one sequence, a dtype cannot be converted, or torch / transformers are not installed."""

    reason = "cache_unsupported"


class CacheGeometryMismatch(CacheError):
    """The cache's or the file's layers, K/V heads, head sizes or sliding windows are not the model's (or the
    transformers model is not the GGUF's)."""

    reason = "cache_geometry_mismatch"


class CacheLengthMismatch(CacheError):
    """A cache layer holds other tokens than the token list says: fewer or more, or a sliding-window layer
    that dropped a position the file must keep."""

    reason = "cache_length_mismatch"


def _all_subclasses(cls: type[SessionFileError]) -> list[type[SessionFileError]]:
    out: list[type[SessionFileError]] = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


def all_reasons() -> dict[str, type[SessionFileError]]:
    """Every reason string and its class (the spec's "Reasons" table is bound to this by a test)."""
    table = {SessionFileError.reason: SessionFileError}
    for cls in _all_subclasses(SessionFileError):
        assert cls.reason not in table, f"duplicate reason {cls.reason}"
        table[cls.reason] = cls
    return table


def write_error_from_os(exc: OSError, what: str, path: str) -> WriteFailed:
    cls = NoSpace if exc.errno in (_errno.ENOSPC, _errno.EDQUOT) else WriteFailed
    return cls(f"{what} failed: {exc.strerror or exc}", path=path)
