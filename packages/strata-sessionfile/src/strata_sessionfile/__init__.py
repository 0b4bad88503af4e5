"""strata-sessionfile: the Strata session file format v1.

One file per conversation: a 64-byte header (magic, version, flags, model and config fingerprints,
payload length, header hash), a payload (metadata: model identity, canonical config, running state,
K/V geometry; then every layer's parts K, V, K scales, V scales, extra), and a trailer (payload hash,
end marker). spec/session-file-v1.md is normative.

Public API
----------
Identity
    ``model_fingerprint(files) -> ModelIdentity`` from ``(role, path)`` pairs in load order;
    ``config_fingerprint(mapping) -> ConfigIdentity``; ``engine_identity(files, mapping)``.
Writing
    ``save(path, adapter, *, block_size=16 MiB, progress=None, buffers=None, compression=None, key=None) -> SaveReport``
    (crash-safe: temp file, fsync, rename, folder fsync; the kernel's writeback of each block is started
    as soon as it is written). ``BlockBuffers(block_size, count=2)``: reusable block buffers an engine may
    keep and pass as ``buffers=`` to every save and restore (a restore with N reader threads uses N + 1). ``compression``: None
    (default), ``"zstd"`` or ``Compression(codec="zstd", level=3, threads=0)``; needs the optional
    zstandard package (``pip install strata-sessionfile[zstd]``), as does restoring such a file. ``key``: a
    ``SessionKey`` (``SessionKey.from_file(path)``: 32 bytes) or its bytes; the file then carries a keyed MAC.
Reading
    ``inspect(path, *, verify=True, identity=None, limits=None, read_threads=None) -> Inspection`` (the read
    pass alone); ``restore(path, adapter, *, mode="auto"|"streaming"|"staged", block_size, progress,
    memory_available, buffers, read_threads=None) -> RestoreReport``; ``memory_available()`` is the default
    RAM probe (MemAvailable) of the preflight; ``default_read_threads()`` the readers a restore uses when
    ``read_threads`` is None (min(4, cores - 1), at least 1; the payload is hashed and handed over in file
    order whatever the number); ``ReadThreads(n)`` reader threads an engine keeps and passes as
    ``read_threads=`` (started once, not per call; ``close()`` ends them). Both take ``key=`` (check the MAC
    before anything reaches the adapter) and ``require_mac=`` (default: True when a key is given).
Byte sources and sinks (``strata_sessionfile.seam``)
    ``save``, ``restore`` and ``inspect`` take a local path or a ``ByteSource`` / ``ByteSink``;
    ``strata_sessionfile.objstore`` has ``S3Source`` (ranged GETs, the object's version pinned) and
    ``S3Sink`` (a multipart upload; the object appears when it completes), with boto3
    (``pip install strata-sessionfile[s3]``).
Adapter protocol (``strata_sessionfile.adapter``)
    ``SessionSource`` (save), ``SessionTarget`` (restore, streaming), ``StagingTarget`` (optional staged
    restore), ``BufferProvider`` (optional own block buffers), ``LandingTarget`` (optional: a restore reads
    straight into the engine's host memory), ``AsyncCopyTarget`` (optional: ``copy_in`` / ``stage_in`` may
    return before their copies finish), ``MergingCopyTarget`` (optional: told when a block's pieces were all
    handed over), ``SessionAdapter`` (source + target).
Records
    ``Compression`` (save option), ``RunningState``, ``Checkpoint``, ``LayerSpec``, ``LayerGeometry``, ``Snapshot``, ``EngineLimits``,
    ``EngineIdentity``, ``RestorePlan``, ``Progress``/``Phase``, ``SaveReport``, ``RestoreReport``,
    ``Inspection``; enums ``Part``, ``DType``, ``LayerRole``, ``RestoreMode``.
Errors (``strata_sessionfile.errors``)
    ``SessionFileError`` and subclasses, each with a stable ``reason`` string (``errors.all_reasons()``).
llama.cpp slot files (``strata_sessionfile.llamacpp``; spec/llama-cpp-slot.md)
    ``read_slot_file(path, geometry)``, ``model_geometry(gguf)``, ``slot_to_session(slot, gguf, out, config=)``,
    ``session_to_slot(ssf, gguf, out, SlotOptions(v_trans=, k_type=, v_type=))``, ``restore_slot(slot, gguf,
    target)`` (straight into an engine, no v1 file between); the CLI's ``convert``.
Transfer (``transfer(source, target)``)
    a session from a ``SessionSource`` straight into a ``SessionTarget``, with the checks and apply modes a
    restore of the file ``save(source)`` writes would have.
transformers caches (``strata_sessionfile.hf``; spec/transformers-cache.md; needs torch and transformers)
    ``load_model(gguf)`` / ``GGUFModel.bind(model, gguf)``, ``new_cache(model)``,
    ``save_cache(model, cache, tokens, path, kv_dtype=, config=)``, ``load_cache(model, path, dtype=) -> (cache,
    tokens)``; ``CacheSession``, the adapter under both.
Testing (``strata_sessionfile.testing``)
    ``MemoryAdapter`` (in-memory reference adapter), ``run_conformance(adapter_factory, workdir)`` (one
    function per case, listed in ``CASES``).

Inside: ``writer`` (``save`` as the named stages of ``SessionWriter``), ``reader`` (``inspect``, ``restore``)
over ``validate`` (the checks), ``datapass`` (the passes over the data section) and ``apply`` (streaming and
staged); ``pipelines`` (reader and writer threads), ``memory`` (buffers, the RAM probe); the byte seam:
``transfer`` (adapter to adapter, no file); ``seam`` (the interfaces), ``_fileio`` (local files: the only module that opens, reads or writes one) and
``objstore`` (an S3-compatible object store).
"""

from . import errors
from .adapter import (
    AsyncCopyTarget,
    BufferProvider,
    LandingTarget,
    MergingCopyTarget,
    SessionAdapter,
    SessionSource,
    SessionTarget,
    StagingTarget,
)
from .auth import SessionKey
from .compression import Compression
from .errors import SessionFileError
from .format import DEFAULT_BLOCK_SIZE, FORMAT_VERSION, DType, LayerRole, Part
from .identity import config_fingerprint, engine_identity, model_fingerprint
from .memory import BlockBuffers, memory_available
from .pipelines import ReadThreads, default_read_threads
from .reader import inspect, restore
from .records import (
    Checkpoint,
    ConfigIdentity,
    EngineIdentity,
    EngineLimits,
    Inspection,
    LayerGeometry,
    LayerSpec,
    ModelFile,
    ModelIdentity,
    Phase,
    Progress,
    RestoreMode,
    RestorePlan,
    RestoreReport,
    RunningState,
    SaveReport,
    Snapshot,
)
from .seam import ByteSink, ByteSource
from .transfer import transfer
from .validate import check_limits
from .writer import save

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "FORMAT_VERSION",
    "AsyncCopyTarget",
    "BlockBuffers",
    "BufferProvider",
    "ByteSink",
    "ByteSource",
    "Checkpoint",
    "Compression",
    "ConfigIdentity",
    "DType",
    "EngineIdentity",
    "EngineLimits",
    "Inspection",
    "LayerGeometry",
    "LayerRole",
    "LayerSpec",
    "ModelFile",
    "LandingTarget",
    "MergingCopyTarget",
    "ModelIdentity",
    "Part",
    "Phase",
    "Progress",
    "RestoreMode",
    "RestorePlan",
    "RestoreReport",
    "RunningState",
    "SaveReport",
    "SessionAdapter",
    "SessionFileError",
    "SessionKey",
    "SessionSource",
    "SessionTarget",
    "Snapshot",
    "StagingTarget",
    "check_limits",
    "config_fingerprint",
    "default_read_threads",
    "ReadThreads",
    "memory_available",
    "engine_identity",
    "errors",
    "inspect",
    "model_fingerprint",
    "restore",
    "save",
    "transfer",
]
