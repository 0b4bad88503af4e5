"""``GET /slots`` and ``POST /slots/{id}?action=save|restore|erase``.

Order of checks as the peer's, with Strata's additions marked: 501 without --slot-save-path ->
(Strata) Origin and JSON Content-Type -> slot id (Strata: 0..N-1; the peer wraps it modulo N) -> action -> body -> filename
(Strata: never a symlink) -> the engine. A refused restore keeps the live conversation (the engine
validates before its gate); the peer wipes it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import falcon
import numpy as np
import strata_sessionfile as sf
from strata_engine.protocol import ErrorKind, SaveFormat
from strata_engine.settings import values

from ..context import ServerContext
from ..errors import ApiError, EngineDied, EngineReplyError, ErrorType, invalid_request
from ..filenames import InvalidFilename, resolve_slot_file
from ..ledger import LastTask, Origin, SlotRecord
from ..params import read_json
from ..security import check_slot_action
from ..slot_manager import invalid_slot_message
from ..tokens import as_tokens

_SLOT_ID = re.compile(r"^[+-]?\d+$")
BODYLESS_ACTIONS = frozenset({"erase"})  # actions that read no body: accepted without one, as llama-server
SLOT_ACTIONS_DISABLED = "This server does not support slots action. Start it with `--slot-save-path`"
SLOTS_ENDPOINT_DISABLED = "This server does not support slots endpoint. Start it with `--slots`"


def file_tokens(path: Path) -> np.ndarray | None:
    """The tokens a restored session file put in the slot (for the next request's slot choice); None: unknown."""
    try:
        return as_tokens(
            np.frombuffer(sf.inspect(path, verify=False, read_threads=1).metadata.state.tokens, dtype="<i4")
        )
    except (sf.SessionFileError, OSError):
        return None


def last_task_fields(task: LastTask) -> dict[str, Any]:
    """The peer's fields of a slot's last task in ``GET /slots``."""
    return {
        "id_task": task.id_task,
        "n_prompt_tokens": task.n_prompt_tokens,
        "n_prompt_tokens_processed": task.n_prompt_tokens_processed,
        "n_prompt_tokens_cache": task.n_prompt_tokens_cache,
        "params": dict(task.params),
        # A recorded task has ended: the peer (b11549) shows n_remain -1 and n_decoded 0 then, whatever the task
        # asked and decoded (its count is in /metrics and the task's answer).
        "next_token": [
            {
                "has_next_token": False,
                "has_new_line": task.has_new_line,
                "n_remain": -1,
                "n_decoded": 0,
            }
        ],
    }


def conversation_fields(record: SlotRecord) -> dict[str, Any]:
    """Strata's ``conversation`` of a slot in ``GET /slots``: where what it holds came from."""
    return {
        "origin": record.origin.value,
        "file": record.file,
        "n_restored": record.n_restored,
        "n_tokens": record.n_tokens,
    }


class SlotsResource:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.actions: dict[str, Callable[[falcon.Request, int], dict]] = {
            "save": self._save,
            "restore": self._restore,
            "erase": self._erase,
        }

    # --- GET /slots -------------------------------------------------------------------------------

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        if not self.ctx.config.slots:
            raise ApiError(ErrorType.NOT_SUPPORTED, SLOTS_ENDPOINT_DISABLED)
        slots = self.ctx.engine.slots.snapshot()
        if all(s.busy for s in slots) and req.get_param_as_bool("fail_on_no_slot", default=False):
            raise ApiError(ErrorType.UNAVAILABLE, "no slot available")
        n_ctx = self.ctx.n_ctx_slot()
        answer = []
        for s, record in zip(slots, self.ctx.ledger.snapshot(), strict=True):
            slot: dict[str, Any] = {"id": s.id, "n_ctx": n_ctx, "speculative": False, "is_processing": s.busy}
            if record.last_task is not None:
                slot.update(last_task_fields(record.last_task))
            if self.ctx.store is not None:  # Strata's: where the slot's conversation came from
                slot["conversation"] = conversation_fields(record)
            answer.append(slot)
        resp.media = answer

    # --- POST /slots/{id_slot} -------------------------------------------------------------------

    def on_post_slot(self, req: falcon.Request, resp: falcon.Response, id_slot: str) -> None:
        if self.ctx.config.slot_save_path is None:
            raise ApiError(ErrorType.NOT_SUPPORTED, SLOT_ACTIONS_DISABLED)
        check_slot_action(req, self.ctx.policy, bodyless_ok=req.get_param("action") in BODYLESS_ACTIONS)
        if not _SLOT_ID.match(id_slot):
            raise invalid_request("Invalid slot ID")
        n_slots = self.ctx.n_slots()
        if not 0 <= int(id_slot) < n_slots:
            raise invalid_request(invalid_slot_message(id_slot, n_slots))
        action = self.actions.get(req.get_param("action") or "")
        if action is None:
            raise invalid_request("Invalid action")
        resp.media = action(req, int(id_slot))

    def _body(self, req: falcon.Request) -> dict:
        """The request's JSON object, read once (the stream reads only once)."""
        if "slot_body" not in req.context:
            req.context.slot_body = read_json(req, self.ctx.config.max_body_bytes)
        return req.context.slot_body

    def _filename(self, req: falcon.Request) -> str:
        body = self._body(req)
        if "filename" not in body:
            raise invalid_request("'filename' is required")
        filename = body["filename"]
        if not isinstance(filename, str):
            raise invalid_request(f"'filename' must be a string, got {type(filename).__name__}")
        return filename

    def _save_format(self, req: falcon.Request) -> dict:
        """`"format": "llama.cpp"` (and `"v_trans": true` for a llama-server without flash attention): the
        file is llama.cpp's slot file, so a user can go back to llama-server."""
        body = self._body(req)
        fmt = body.get("format", SaveFormat.STRATA.value)
        if fmt not in values(SaveFormat):
            raise invalid_request(f"'format' must be one of {', '.join(values(SaveFormat))}, got {fmt!r}")
        v_trans = body.get("v_trans", False)
        if not isinstance(v_trans, bool):
            raise invalid_request(f"'v_trans' must be a boolean, got {type(v_trans).__name__}")
        return {"format": fmt, "v_trans": v_trans} if fmt != SaveFormat.STRATA else {}

    def _path(self, filename: str, *, must_exist: bool) -> Path:
        folder = self.ctx.config.slot_save_path
        assert folder is not None
        try:
            return resolve_slot_file(folder, filename, must_exist=must_exist)
        except InvalidFilename as exc:
            if must_exist:
                self.ctx.metrics.record_refusal("invalid_filename")
            raise invalid_request(f"Invalid filename: {exc}", reason="invalid_filename") from None
        except FileNotFoundError:
            self.ctx.metrics.record_refusal("not_found")
            raise invalid_request(
                f"Unable to restore slot: no file named {filename!r} in the slot save folder; "
                "the conversation is kept",
                reason="not_found",
            ) from None

    def _save(self, req: falcon.Request, slot_id: int) -> dict:
        filename = self._filename(req)
        path = self._path(filename, must_exist=False)
        with self.ctx.engine.acquire(self.ctx.config.slot_wait, id_slot=slot_id) as lease:
            lease.used = False
            try:
                result = lease.call("SAVE", {"path": str(path), **self._save_format(req)})
            except EngineReplyError as exc:
                self.ctx.metrics.record_save_failure()
                if exc.kind == ErrorKind.SESSION_WRITE_FAILED:
                    if exc.error.get("file_in_place"):
                        outcome = (
                            f"the new {filename!r} is in place, but flushing the folder failed, so it "
                            "may not survive a power loss"
                        )
                    else:
                        outcome = f"any previous file named {filename!r} is untouched"
                    raise ApiError(
                        ErrorType.SERVER,
                        f"Unable to save slot: {exc.message}; {outcome}",
                        reason=exc.reason or "write_failed",
                    ) from None
                raise
        n_written = int(result.get("n_written", 0))
        save_ms = float(result.get("save_ms", 0.0))
        self.ctx.metrics.record_save(n_written, save_ms)
        return {
            "id_slot": slot_id,
            "filename": filename,
            "n_saved": int(result.get("n_saved", 0)),
            "n_written": n_written,
            "timings": {"save_ms": save_ms},
        }

    def _restore(self, req: falcon.Request, slot_id: int) -> dict:
        filename = self._filename(req)
        path = self._path(filename, must_exist=True)
        with self.ctx.engine.acquire(self.ctx.config.slot_wait, id_slot=slot_id) as lease:
            lease.used = False
            try:
                result = lease.call("RESTORE", {"path": str(path)})
            except EngineReplyError as exc:
                if exc.kind == ErrorKind.SESSION_REFUSED:
                    reason = str(exc.reason or "refused")
                    self.ctx.metrics.record_refusal(reason)
                    raise invalid_request(
                        f"Unable to restore slot: {filename!r} was refused ({reason}): "
                        f"{exc.message}; the conversation is kept",
                        reason=reason,
                    ) from None
                if exc.kind == ErrorKind.SLOT_FAILED:  # protocol v2: that slot erased, the others go on
                    self.ctx.metrics.record_fail_stop()
                    self.ctx.ledger.erased(slot_id)
                    raise ApiError(
                        ErrorType.SERVER,
                        f"Unable to restore slot: {filename!r} failed after the "
                        f"restore began writing ({exc.reason or 'slot_failed'}): {exc.message}; slot "
                        f"{slot_id} was erased (its conversation is lost), the other slots are untouched",
                        reason=exc.reason or "slot_failed",
                    ) from None
                if exc.kind == ErrorKind.FAIL_STOP:
                    self.ctx.metrics.record_fail_stop()
                    self.ctx.ledger.erased(slot_id)
                    raise ApiError(
                        ErrorType.SERVER,
                        f"Unable to restore slot: {filename!r} failed after the "
                        f"restore began writing ({exc.reason or 'fail_stop'}): {exc.message}; the "
                        "engine is restarting and the conversation is lost",
                        reason=exc.reason or "fail_stop",
                    ) from None
                raise
            except EngineDied as exc:
                self.ctx.metrics.record_fail_stop()
                self.ctx.ledger.erased(slot_id)
                raise ApiError(
                    ErrorType.SERVER,
                    f"Unable to restore slot: the engine stopped during the restore "
                    f"({exc.detail}); it is restarting and the conversation is lost",
                    reason="engine_died",
                ) from None
        n_read = int(result.get("n_read", 0))
        restore_ms = float(result.get("restore_ms", 0.0))
        self.ctx.metrics.record_restore(n_read, restore_ms)
        self.ctx.ledger.restored(slot_id, file_tokens(path), Origin.SLOT_FILE, path.name)
        return {
            "id_slot": slot_id,
            "filename": filename,
            "n_restored": int(result.get("n_restored", 0)),
            "n_read": n_read,
            "timings": {"restore_ms": restore_ms},
        }

    def _erase(self, req: falcon.Request, slot_id: int) -> dict:
        with self.ctx.engine.acquire(self.ctx.config.slot_wait, id_slot=slot_id) as lease:
            lease.used = False
            result = lease.call("ERASE", {})
        self.ctx.metrics.record_erase()
        self.ctx.ledger.erased(slot_id)
        return {"id_slot": slot_id, "n_erased": int(result.get("n_erased", 0))}
