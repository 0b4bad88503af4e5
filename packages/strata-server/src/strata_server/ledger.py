"""The slot ledger: what each slot holds as far as the server knows, kept in one place.

Per slot: the tokens held (None: unknown, after a COMPLETE that failed or was cut off, or of a text prompt
the engine tokenized), where the conversation came from, the file it was restored from, the tokens that
restore kept, the last task (``GET /slots``) and the last activity (the store's idle saves). Every event
that changes what a slot holds is one method here; the slot manager's choice, the session store, ``GET
/slots`` and ``/metrics`` read it.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from .tokens import EMPTY, as_tokens, common_prefix
from .transcript import Notes, turn_notes


class Origin(enum.StrEnum):
    """Where a slot's conversation came from (GET /slots)."""

    NONE = "none"  # nothing held (start-up, erase, an engine restart)
    EVALUATED = "evaluated"  # its prompt was evaluated (nothing reused from the store)
    STORE = "store"  # restored from the session store, then continued
    SLOT_FILE = "slot_file"  # restored by POST /slots/0?action=restore


@attrs.frozen
class LastTask:
    """The last completion a slot ran, as ``GET /slots`` shows it."""

    id_task: int
    n_prompt_tokens: int
    n_prompt_tokens_processed: int
    n_prompt_tokens_cache: int
    params: Mapping[str, Any]
    has_new_line: bool
    n_decoded: int


@attrs.frozen
class SlotRecord:
    tokens: np.ndarray | None = EMPTY  # None: unknown
    origin: Origin = Origin.NONE
    file: str | None = None  # the store file (or slot file) it was restored from
    n_restored: int = 0  # tokens that restore kept
    last_task: LastTask | None = None
    last_active: float = attrs.Factory(time.monotonic)
    prompt: np.ndarray | None = None  # the prompt of the COMPLETE in flight (None: none, or not token ids)
    notes: Notes | None = None  # the chat turn's messages and reply that `tokens` hold (saved with them)

    @property
    def n_tokens(self) -> int | None:
        return None if self.tokens is None else len(self.tokens)


class SlotLedger:
    def __init__(self, n_slots: int) -> None:
        assert n_slots >= 1
        self._lock = threading.Lock()
        self._records = [SlotRecord() for _ in range(n_slots)]
        self._id_task = -1  # one counter for the server, as the peer's task ids

    @property
    def n_slots(self) -> int:
        return len(self._records)

    def __getitem__(self, slot_id: int) -> SlotRecord:
        with self._lock:
            return self._records[slot_id]

    def snapshot(self) -> list[SlotRecord]:
        with self._lock:
            return list(self._records)

    def tokens(self, slot_id: int) -> np.ndarray | None:
        return self[slot_id].tokens

    def _update(self, slot_id: int, **changes: Any) -> None:
        with self._lock:
            self._records[slot_id] = attrs.evolve(
                self._records[slot_id], last_active=time.monotonic(), **changes
            )

    # --- events ----------------------------------------------------------------------------------

    def started(self, slot_id: int, prompt: np.ndarray | None, *, cache_prompt: bool = True) -> None:
        """A COMPLETE of `prompt` was sent: what the slot holds is unknown until its result; a prompt that
        continues nothing the slot held starts a conversation of its own."""
        with self._lock:
            record = self._records[slot_id]
            shared = (
                common_prefix(prompt, record.tokens)
                if cache_prompt and prompt is not None and record.tokens is not None
                else 0
            )
            fresh: dict[str, Any] = (
                {} if shared else {"origin": Origin.EVALUATED, "file": None, "n_restored": 0}
            )
            self._records[slot_id] = attrs.evolve(
                record, tokens=None, prompt=prompt, notes=None, last_active=time.monotonic(), **fresh
            )

    def completed(
        self, slot_id: int, result: Mapping[str, Any], params: Mapping[str, Any], messages: Any = None
    ) -> None:
        """A COMPLETE's result: the slot holds (prompt + generated)[:n_tokens_held] (unknown when the prompt
        was text), and this is its last task; `messages`: a chat turn's, kept (with the reply) as its notes."""
        generated = [int(t) for t in result.get("tokens") or []]
        timings = result.get("timings") or {}
        with self._lock:
            record = self._records[slot_id]
            tokens = None
            if record.prompt is not None:
                tokens = as_tokens(
                    np.concatenate([record.prompt, np.asarray(generated, dtype="<i4")])[
                        : int(result.get("n_tokens_held", 0))
                    ]
                )
            notes = (
                turn_notes(messages, str(result.get("content", "")))
                if tokens is not None and messages is not None
                else None
            )
            self._id_task += 1
            task = LastTask(
                id_task=self._id_task,
                n_prompt_tokens=int(result.get("tokens_evaluated", 0)),
                n_prompt_tokens_processed=int(timings.get("prompt_n", 0)),
                n_prompt_tokens_cache=int(timings.get("cache_n", 0)),
                params=dict(params),
                has_new_line="\n" in str(result.get("content", "")),
                n_decoded=len(generated),
            )
            self._records[slot_id] = attrs.evolve(
                record,
                tokens=tokens,
                prompt=None,
                last_task=task,
                notes=notes,
                last_active=time.monotonic(),
            )

    def restored(self, slot_id: int, tokens: np.ndarray | None, origin: Origin, file: str) -> None:
        """A file's conversation was put in the slot (`tokens`: what the restore kept; None: unknown)."""
        self._update(
            slot_id,
            tokens=tokens,
            origin=origin,
            file=file,
            n_restored=0 if tokens is None else len(tokens),
            last_task=None,
            prompt=None,
            notes=None,
        )

    def saved(self, slot_id: int, tracked: np.ndarray, tokens: np.ndarray) -> None:
        """A save of the `tracked` tokens wrote `tokens`: the file's are what the slot holds, unless the
        slot moved on meanwhile."""
        with self._lock:
            record = self._records[slot_id]
            if record.tokens is tracked:
                self._records[slot_id] = attrs.evolve(record, tokens=tokens)

    def erased(self, slot_id: int) -> None:
        """The slot's conversation is gone (an erase, a restore that failed after its gate)."""
        self._update(
            slot_id,
            tokens=EMPTY,
            origin=Origin.NONE,
            file=None,
            n_restored=0,
            last_task=None,
            prompt=None,
            notes=None,
        )

    def engine_exited(self, _code: int) -> None:
        """Every slot's conversation died with the engine process."""
        for slot_id in range(self.n_slots):
            self.erased(slot_id)
