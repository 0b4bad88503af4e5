"""The serve protocol's `SAVE`, `RESTORE` and `RESTORE_PREFIX` verbs (spec/engine-protocol.md), each on one
slot (`{"slot": i, "path": ...}`), run by the scheduler between two steps.

`register_session_verbs(registry, options)` installs the handlers. Each call builds an `EngineSession`
over the slot's runner and completer (the identity, the same for every slot, is computed once).

Answers: SAVE -> `{"n_saved", "n_written", "save_ms"}` after `progress` lines (copy / flush / rename);
(SAVE with `"sync": false`, a session store's save that fsyncs the file later, off the request's path: nothing fsynced);
RESTORE -> `{"n_restored", "n_read", "restore_ms", "mode", "read_pass_ms", "apply_ms"}` after `progress` lines (read / apply);
RESTORE_PREFIX (a session store's restore: keep a prefix, may drop the held conversation) -> the same plus
`n_kept`, or `session_refused` with reason `prefix_unreachable` when the prefix cannot be kept.
Failures: a save error -> `session_write_failed` (the old file is untouched); a refused restore ->
`session_refused` with the format package's `reason` (the slot's conversation is exactly as it was); a
failure once the slot's region was written -> the slot is erased and the error is `slot_failed` (the
other slots were never touched); only when that erase fails too -> `FailStop` (the loop writes the
`fail_stop` error line and exits with status 4).

Settings: the restore mode (`--restore-mode auto|staged|streaming`; auto stages when RAM allows), the
session key (`--session-key-file`: SAVE authenticates, a restore checks the MAC before the gate and refuses a
file without one unless `--session-key-optional`), the block size, and, for tests only, a fault point read from the environment variable
``STRATA_ENGINE_SESSION_FAULT`` (one of `FaultPoint`'s values) when the engine starts. No request can
set it: the HTTP server and the protocol never touch the engine's environment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any

import attrs
import strata_sessionfile as sf
from strata_sessionfile import errors as E
from strata_sessionfile import llamacpp
from strata_sessionfile.seam import S3_SCHEME, FileSink, s3_location

from ..errors import PrefixUnreachable
from ..protocol import (
    CommandRegistry,
    ErrorKind,
    FailStop,
    ProtocolError,
    Reason,
    Request,
    SaveFormat,
    ServeContext,
)
from ..wire import RestoreArgs, RestorePrefixArgs, SaveArgs, arguments_of, register
from .adapter import EngineSession, FaultPoint, PrefixCut, SamplerAccess
from .buffers import BlockBufferCache, block_buffers
from .fields import MAX_NOTES_BYTES
from .identity import runner_identity

log = logging.getLogger(__name__)

FAULT_ENV = "STRATA_ENGINE_SESSION_FAULT"


def _restore_mode(value: Any) -> sf.RestoreMode:
    return sf.RestoreMode(value)


# Smaller than the library's 16 MiB: the pipelines fill and drain sooner (bench/engine/DECISIONS.md "Session block size").
SESSION_BLOCK_SIZE = 4 << 20
PROGRESS_INTERVAL_S = 0.1


@attrs.frozen
class SessionOptions:
    restore_mode: sf.RestoreMode = attrs.field(default=sf.RestoreMode.AUTO, converter=_restore_mode)
    block_size: int | None = None  # None: SESSION_BLOCK_SIZE
    read_threads: int | None = None  # threads reading a RESTORE's file at once; None: the library's default
    fault: FaultPoint | None = None
    key: sf.SessionKey | None = None  # SAVE authenticates with it; RESTORE checks the MAC with it
    require_mac: bool = True  # with a key: refuse a file without a MAC (the library's default)
    object_store_endpoint: str | None = None  # s3:// paths: a non-AWS store's endpoint (None: AWS's)

    @classmethod
    def from_environ(
        cls,
        restore_mode: str = "auto",
        environ: Mapping[str, str] | None = None,
        *,
        key: sf.SessionKey | None = None,
        require_mac: bool = True,
        object_store_endpoint: str | None = None,
    ) -> SessionOptions:
        """The options for `strata-engine serve`; a fault point only from FAULT_ENV (tests)."""
        env = os.environ if environ is None else environ
        raw = env.get(FAULT_ENV, "").strip()
        fault = None
        if raw:
            try:
                fault = FaultPoint(raw)
            except ValueError:
                raise ValueError(
                    f"{FAULT_ENV}={raw!r}: expected one of {', '.join(f.value for f in FaultPoint)}"
                ) from None
            log.warning("session fault injection armed: %s (tests only)", fault.value)
        return cls(
            restore_mode=restore_mode,
            fault=fault,
            key=key,
            require_mac=require_mac,
            object_store_endpoint=object_store_endpoint,
        )


class GatedSession(EngineSession):
    """The adapter of a verb on the scheduler's session thread: the checks and the read pass (into a staging
    area) run beside the steps; the first write to the live pool waits for the gate (a step boundary), and
    the steps wait for the verb's end. A restore into the slot's own region in place (an empty slot, or
    `discard_held`) writes only that slot's region of a host pool, which no step reads."""

    def __init__(self, *args: Any, gate: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.gate = gate

    def begin_apply(self, plan: Any) -> None:
        self.gate.enter()
        super().begin_apply(plan)

    def commit_staged(self, state: Any) -> None:
        self.gate.enter()
        super().commit_staged(state)

    def commit(self, state: Any) -> None:
        self.gate.enter()
        super().commit(state)


class SessionVerbs:
    """The SAVE / RESTORE handlers and what they keep between calls (the runner's identity)."""

    def __init__(self, options: SessionOptions):
        self.options = options
        self._identity_of: tuple[Any, sf.EngineIdentity] | None = None
        self.buffers = BlockBufferCache()
        self._readers: sf.ReadThreads | None = None
        self._s3_client = None
        self._s3_lock = threading.Lock()
        self._slot_geometry: llamacpp.ModelGeometry | None = None

    def warm(self, ctx: ServeContext) -> None:
        """Start-up work that would otherwise land in the first SAVE/RESTORE: the identity (fingerprinting
        the model files), the reader threads, the pool's own (`KVPool.warm`), and the block buffers with
        their pages faulted in."""
        runner = ctx.runner_of(0)
        self.identity(runner)
        self.readers().start()
        if self.options.object_store_endpoint is not None:
            self.object_client()  # boto3's client costs ~0.2 s to make: start-up time, not the first restore's
        for slot in range(ctx.n_slots):
            ctx.runner_of(slot).pool.warm()
        count = self.read_threads() + 1  # a restore's buffers (a save uses the first two)
        for b in block_buffers(runner.pool, self.buffers, count, self.block_size(runner)):
            b[:] = bytes(len(b))

    def slot_geometry(self, runner) -> llamacpp.ModelGeometry:
        """The model's geometry as llama.cpp's slot files lay it out, read from the GGUF once: its key walk
        costs a large part of a slot file's restore (bench/sessionfile/DECISIONS.md)."""
        if self._slot_geometry is None:
            self._slot_geometry = llamacpp.model_geometry(runner.settings.model_path)
        return self._slot_geometry

    def read_threads(self) -> int:
        return (
            self.options.read_threads if self.options.read_threads is not None else sf.default_read_threads()
        )

    def readers(self) -> sf.ReadThreads:
        """The threads every RESTORE reads with, kept for the process's life (starting them per pass cost
        time in every restore: bench/gpu/DECISIONS.md "Session I/O on the device")."""
        if self._readers is None:
            self._readers = sf.ReadThreads(self.read_threads())
        return self._readers

    def object_client(self):
        """The boto3 client every s3:// path uses (made once; credentials and region the standard AWS way)."""
        with self._s3_lock:
            if self._s3_client is None:
                try:
                    from strata_sessionfile.objstore import s3_client
                except ImportError as exc:
                    raise ProtocolError(
                        ErrorKind.INVALID_REQUEST, f"s3:// paths: {exc}", reason=Reason.BAD_ARGUMENT.value
                    ) from None
                self._s3_client = s3_client(self.options.object_store_endpoint)
            return self._s3_client

    @staticmethod
    def _object(path: str) -> tuple[str, str] | None:
        """(bucket, key) of an s3:// path, None for a local one; a malformed URL is a bad argument."""
        if not path.startswith(S3_SCHEME):
            return None
        try:
            return s3_location(path)
        except ValueError as exc:
            raise ProtocolError(
                ErrorKind.INVALID_REQUEST, str(exc), reason=Reason.BAD_ARGUMENT.value
            ) from None

    def _sink(self, path: str, sync: bool = True) -> Any:
        """What a save writes: the path, a file not fsynced, or an object (durable once its upload completes:
        `sync` does not apply)."""
        location = self._object(path)
        if location is None:
            return path if sync else FileSink(path, sync=False)
        from strata_sessionfile.objstore import S3Sink

        return S3Sink(self.object_client(), *location)

    @contextlib.contextmanager
    def _source(self, path: str, location: tuple[str, str] | None) -> Iterator[Any]:
        """What a restore reads: the path, or the object with its version pinned now (closed afterwards)."""
        if location is None:
            yield path
            return
        from strata_sessionfile.objstore import S3Source

        with S3Source(self.object_client(), *location) as source:
            yield source

    def block_size(self, runner: Any) -> int:
        return self.options.block_size if self.options.block_size is not None else SESSION_BLOCK_SIZE

    def identity(self, runner: Any) -> sf.EngineIdentity:
        """The runner's identity; every slot of one engine has the same (one model, one per-slot context)."""
        key = (runner.model, runner.n_ctx)
        if self._identity_of is None or self._identity_of[0] != key:
            self._identity_of = (key, runner_identity(runner))
        return self._identity_of[1]

    def adapter(
        self,
        ctx: ServeContext,
        slot: int,
        cut: PrefixCut | None = None,
        discard_held: bool = False,
        gate: Any = None,
        notes: str | None = None,
    ) -> EngineSession:
        runner = ctx.runner_of(slot)
        return (EngineSession if gate is None else partial(GatedSession, gate=gate))(
            runner,
            SamplerAccess.of_completer(ctx.completer_of(slot)),
            identity=self.identity(runner),
            staging=self.options.restore_mode is not sf.RestoreMode.STREAMING,
            fault=self.options.fault,
            buffers=self.buffers,
            cut=cut,
            discard_held=discard_held,
            notes=notes,
        )

    @staticmethod
    def _progress(request: Request):
        """Progress lines: a phase's first and last, and between them at most one per PROGRESS_INTERVAL_S (a
        line per 4 MiB block would be ~30 lines for a 116 MB restore that takes tens of milliseconds)."""
        last: list = [None, None, 0.0]  # phase, bytes_done, time of the last line

        def report(p: sf.Progress) -> None:
            now = time.monotonic()
            if (p.phase, p.bytes_done) == (last[0], last[1]):
                return
            if p.phase == last[0] and p.bytes_done < p.bytes_total and now - last[2] < PROGRESS_INTERVAL_S:
                return
            last[:] = [p.phase, p.bytes_done, now]
            request.emit(
                {
                    "event": "progress",
                    "phase": p.phase.value,
                    "bytes_done": p.bytes_done,
                    "bytes_total": p.bytes_total,
                }
            )

        return report

    def save(self, ctx: ServeContext, request: Request) -> Mapping[str, Any]:
        parsed: SaveArgs = arguments_of(request)
        assert request.slot is not None
        if parsed.format is SaveFormat.LLAMA_CPP:
            return self._save_slot_file(ctx, request, parsed)
        sink = self._sink(parsed.path, parsed.sync)  # a malformed s3:// URL: a bad argument
        if parsed.notes is not None and len(parsed.notes.encode("utf-8", "surrogatepass")) > MAX_NOTES_BYTES:
            raise ProtocolError(
                ErrorKind.INVALID_REQUEST,
                f"notes: {len(parsed.notes.encode('utf-8', 'surrogatepass'))} bytes is over {MAX_NOTES_BYTES}",
                reason=Reason.BAD_ARGUMENT.value,
            )
        adapter = self.adapter(ctx, request.slot, gate=request.gate, notes=parsed.notes)
        try:
            report = sf.save(
                sink,
                adapter,
                block_size=self.block_size(adapter.runner),
                progress=self._progress(request),
                key=self.options.key,
            )
        except E.DirSyncFailed as exc:
            raise ProtocolError(
                ErrorKind.SESSION_WRITE_FAILED, str(exc), reason=exc.reason, extra={"file_in_place": True}
            ) from exc
        except E.SessionFileError as exc:
            raise ProtocolError(ErrorKind.SESSION_WRITE_FAILED, str(exc), reason=exc.reason) from exc
        return {
            "n_saved": report.n_tokens,
            "n_written": report.bytes_written,
            "save_ms": round(report.elapsed_s * 1000.0, 3),
        }

    def _save_slot_file(self, ctx: ServeContext, request: Request, parsed: SaveArgs) -> Mapping[str, Any]:
        """SAVE in llama.cpp's format: the session saved as format v1 into a temporary folder, then converted
        (crash-safe: the file at `path` is replaced only by a whole new one)."""
        if self._object(parsed.path) is not None:
            raise ProtocolError(
                ErrorKind.INVALID_REQUEST,
                "a llama.cpp slot file is saved to a local path",
                reason=Reason.BAD_ARGUMENT.value,
            )
        assert request.slot is not None
        adapter = self.adapter(ctx, request.slot, gate=request.gate)
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="strata-slot-") as tmp:
            try:
                saved = sf.save(
                    os.path.join(tmp, "session.ssf"), adapter, block_size=self.block_size(adapter.runner)
                )
                llamacpp.session_to_slot(
                    os.path.join(tmp, "session.ssf"),
                    adapter.runner.settings.model_path,
                    parsed.path,
                    llamacpp.SlotOptions(v_trans=parsed.v_trans),
                    geometry=self.slot_geometry(adapter.runner),
                )
            except E.SessionFileError as exc:
                raise ProtocolError(ErrorKind.SESSION_WRITE_FAILED, str(exc), reason=exc.reason) from exc
        return {
            "n_saved": saved.n_tokens,
            "n_written": os.path.getsize(parsed.path),
            "save_ms": round((time.perf_counter() - started) * 1000.0, 3),
        }

    def restore(self, ctx: ServeContext, request: Request) -> Mapping[str, Any]:
        parsed: RestoreArgs = arguments_of(request)
        assert request.slot is not None
        return self._restore(request, parsed.path, self.adapter(ctx, request.slot, gate=request.gate))

    def restore_prefix(self, ctx: ServeContext, request: Request) -> Mapping[str, Any]:
        parsed: RestorePrefixArgs = arguments_of(request)
        assert request.slot is not None
        runner = ctx.runner_of(request.slot)
        cut = None
        if parsed.cut_to is not None or parsed.min_keep:
            cut = PrefixCut(runner.n_ctx if parsed.cut_to is None else parsed.cut_to, parsed.min_keep)
        answer = self._restore(
            request, parsed.path, self.adapter(ctx, request.slot, cut, parsed.discard_held, request.gate)
        )
        return {**answer, "n_kept": runner.n_held}

    def _restore(self, request: Request, path: str, adapter: EngineSession) -> Mapping[str, Any]:
        location = self._object(path)  # a malformed s3:// URL: a bad argument, not a refused file
        if location is None and llamacpp.is_slot_file(path):
            # llama-server's file (--slot-save-path): straight into the slot, checked as its v1 file would be
            return self._applied(
                request,
                adapter,
                lambda: llamacpp.restore_slot(
                    path,
                    adapter.runner.settings.model_path,
                    adapter,
                    mode=self.options.restore_mode,
                    block_size=self.block_size(adapter.runner),
                    progress=self._progress(request),
                    geometry=self.slot_geometry(adapter.runner),
                ),
            )

        def run() -> sf.RestoreReport:
            with self._source(path, location) as source:
                return sf.restore(
                    source,
                    adapter,
                    mode=self.options.restore_mode,
                    block_size=self.block_size(adapter.runner),
                    progress=self._progress(request),
                    read_threads=self.readers(),
                    key=self.options.key,
                    require_mac=self.options.require_mac and self.options.key is not None,
                )

        return self._applied(request, adapter, run)

    def _applied(
        self, request: Request, adapter: EngineSession, run: Callable[[], sf.RestoreReport]
    ) -> Mapping[str, Any]:
        """`run` (a restore into `adapter`), its failures mapped to the protocol's: refused before the gate, the
        slot failed (erased) after it."""
        try:
            report = run()
        except E.FailStop as exc:
            self._slot_failed(adapter, request.slot, str(exc), exc.cause_reason, exc)
        except BaseException as exc:
            if adapter.live_touched:  # e.g. a staged switch that failed half-way: nothing vouches for the K/V
                adapter.fail_stop(exc if isinstance(exc, Exception) else RuntimeError(str(exc)))
                reason = exc.reason if isinstance(exc, E.SessionFileError) else "adapter_failed"
                self._slot_failed(
                    adapter,
                    request.slot,
                    f"restore failed after the slot's K/V was written: {exc}",
                    reason,
                    exc,
                )
            if isinstance(exc.__cause__, PrefixUnreachable):  # raised in check_plan, wrapped by the library
                raise ProtocolError(
                    ErrorKind.SESSION_REFUSED,
                    str(exc.__cause__),
                    reason=Reason.PREFIX_UNREACHABLE.value,
                    extra={"resume_point": exc.__cause__.resume_point},
                ) from exc
            if isinstance(exc, E.SessionFileError):
                raise ProtocolError(ErrorKind.SESSION_REFUSED, str(exc), reason=exc.reason) from exc
            raise
        return {
            "n_restored": report.n_tokens,
            "n_read": report.bytes_read,
            "restore_ms": round(report.elapsed_s * 1000.0, 3),
            "mode": report.mode.value,
            "read_pass_ms": round(report.read_pass_s * 1000.0, 3),
            "apply_ms": round(report.apply_s * 1000.0, 3),
        }

    @staticmethod
    def _slot_failed(
        adapter: EngineSession, slot: int | None, message: str, reason: str, cause: BaseException
    ):
        """A restore failed after the gate: only this slot's region was written, so erasing the slot confines
        the failure to it (`slot_failed`); if even the erase fails, nothing vouches for the pool (`FailStop`)."""
        try:
            adapter.runner.pool.ops.synchronize()  # no queued copy may land in the region after the erase
            adapter.runner.erase()
        except Exception as exc:
            log.exception("erasing slot %s after a failed restore failed", slot)
            raise FailStop(f"{message}; erasing slot {slot} failed too: {exc}", reason=reason) from cause
        log.error("slot %s erased after a restore failed past its gate: %s", slot, message)
        raise ProtocolError(
            ErrorKind.SLOT_FAILED,
            f"{message} (slot {slot} was erased; the other slots are intact)",
            reason=reason,
        ) from cause


def register_session_verbs(
    registry: CommandRegistry, options: SessionOptions | None = None, ctx: ServeContext | None = None
) -> SessionVerbs:
    """Install SAVE, RESTORE and RESTORE_PREFIX. With `ctx`, `SessionVerbs.warm` runs now (fingerprinting the model files
    takes ~0.2-0.7 s on a 262K-token vocabulary: start-up time, not the first verb's)."""
    verbs = SessionVerbs(options or SessionOptions())
    if ctx is not None:
        verbs.warm(ctx)
    register(registry, {"SAVE": verbs.save, "RESTORE": verbs.restore, "RESTORE_PREFIX": verbs.restore_prefix})
    return verbs
