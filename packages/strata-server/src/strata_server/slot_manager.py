"""Which slot a request gets: ``--parallel N`` slots, each idle or busy, with what it holds and when it
was last used; requests that find none idle wait in arrival order (bounded), as llama-server defers them.

What each slot holds is the ledger's (ledger.py); this module keeps who holds the slot. The choice is
llama-server's (``get_available_slot``, tools/server/server-context.cpp): a request naming
``id_slot`` gets that slot (it waits for that slot alone). Otherwise, among idle slots holding tokens, the
one whose held tokens share the longest prefix with the prompt, as a fraction of the prompt's length,
when that fraction exceeds ``--slot-prompt-similarity`` (0 turns the rule off); else the least recently
used idle slot (on a tie the highest id, as the peer's ``<=`` scan).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import attrs

from .errors import SlotBusy
from .ledger import SlotLedger
from .tokens import common_prefix

DEFAULT_SIMILARITY = 0.1  # llama-server's --slot-prompt-similarity default


def invalid_slot_message(id_slot: object, n_slots: int) -> str:
    """The 400's message for a slot id outside 0..n_slots-1 (the peer wraps ids around; Strata refuses)."""
    have = "one slot, 0" if n_slots == 1 else f"slots 0..{n_slots - 1}"
    return f"Invalid slot ID: {id_slot}; this server has {have}"


@attrs.define
class Slot:
    id: int
    busy: bool = False
    last_used: float = -1.0  # monotonic time it was last released; -1: never used


@attrs.define(eq=False)
class _Waiter:
    id_slot: int | None
    prompt: Sequence[int] | None
    granted: int | None = None
    event: threading.Event = attrs.Factory(threading.Event)


class SlotManager:
    def __init__(self, ledger: SlotLedger, similarity: float = DEFAULT_SIMILARITY) -> None:
        self.similarity = similarity
        self.ledger = ledger  # what the slots hold (the choice reads it); this manager keeps who holds them
        self.slots = tuple(Slot(i) for i in range(ledger.n_slots))
        self._lock = threading.Lock()
        self._queue: list[_Waiter] = []  # arrival order

    @property
    def n_slots(self) -> int:
        return len(self.slots)

    # --- choosing --------------------------------------------------------------------------------

    def choose(self, id_slot: int | None = None, prompt: Sequence[int] | None = None) -> Slot | None:
        """The idle slot a request would get now, or None (the caller holds the lock)."""
        if id_slot is not None:
            slot = self.slots[id_slot]
            return None if slot.busy else slot
        idle = [s for s in self.slots if not s.busy]
        if not idle:
            return None
        if prompt and self.similarity > 0:
            best, best_sim = None, 0.0
            for slot in idle:
                sim = self._similarity(slot.id, prompt)
                if sim > best_sim and sim > self.similarity:
                    best, best_sim = slot, sim
            if best is not None:
                return best
        return min(idle, key=lambda s: (s.last_used, -s.id))

    def _similarity(self, slot_id: int, prompt: Sequence[int]) -> float:
        held = self.ledger.tokens(slot_id)
        if held is None or not len(held) or not prompt:
            return 0.0
        return common_prefix(held, prompt) / len(prompt)

    # --- leasing ---------------------------------------------------------------------------------

    def acquire(
        self, wait_s: float, *, id_slot: int | None = None, prompt: Sequence[int] | None = None
    ) -> int:
        """A slot for one request, marked busy; waits its turn up to ``wait_s`` seconds, then ``SlotBusy``."""
        if id_slot is not None and not 0 <= id_slot < self.n_slots:
            raise ValueError(f"slot {id_slot} is outside 0..{self.n_slots - 1}")
        waiter = _Waiter(id_slot, prompt)
        with self._lock:
            self._queue.append(waiter)
            self._dispatch()
        if not waiter.event.wait(max(wait_s, 0.0)):
            with self._lock:
                if waiter.granted is None:  # not granted meanwhile: leave the queue
                    self._queue.remove(waiter)
                    raise SlotBusy(wait_s, self._describe(id_slot))
        assert waiter.granted is not None
        return waiter.granted

    def _describe(self, id_slot: int | None) -> str:
        if id_slot is not None or self.n_slots == 1:
            return f"slot {id_slot or 0}"
        return f"every slot (0..{self.n_slots - 1})"

    def _dispatch(self) -> None:
        """Grant idle slots to waiters in arrival order (each takes the slot it would choose)."""
        for waiter in list(self._queue):
            slot = self.choose(waiter.id_slot, waiter.prompt)
            if slot is None:
                continue
            slot.busy = True
            waiter.granted = slot.id
            self._queue.remove(waiter)
            waiter.event.set()

    def release(self, slot_id: int, *, used: bool = True) -> None:
        """``used`` False (a slot action, the store's idle save): its last use stays what it was, as the
        peer's slot tasks leave ``t_last_used``."""
        with self._lock:
            slot = self.slots[slot_id]
            assert slot.busy, f"slot {slot_id} released twice"
            slot.busy = False
            if used:
                slot.last_used = time.monotonic()
            self._dispatch()

    # --- reporting -------------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._queue)

    @property
    def n_busy(self) -> int:
        with self._lock:
            return sum(s.busy for s in self.slots)

    def is_busy(self, slot_id: int) -> bool:
        with self._lock:
            return self.slots[slot_id].busy

    def snapshot(self) -> list[Slot]:
        with self._lock:
            return [attrs.evolve(s) for s in self.slots]

    def wait_all_idle(self, timeout: float) -> bool:
        """Wait until no slot is busy (shutdown); False after ``timeout``."""
        deadline = time.monotonic() + timeout
        while self.n_busy:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True
