"""The slot ledger alone: every event (a COMPLETE started and completed, a restore, a save that corrects the
tracked tokens, an erase, the engine's exit) and what the slot then holds."""

from __future__ import annotations

import numpy as np
from strata_server.ledger import Origin, SlotLedger
from strata_server.tokens import EMPTY, as_tokens, common_prefix, known_tokens


def held(ledger: SlotLedger, slot_id: int) -> list[int] | None:
    tokens = ledger.tokens(slot_id)
    return None if tokens is None else tokens.tolist()


def result(tokens: list[int], n_held: int, content: str = "x") -> dict:
    return {
        "tokens": tokens,
        "n_tokens_held": n_held,
        "content": content,
        "tokens_evaluated": 4,
        "timings": {"prompt_n": 3, "cache_n": 1},
    }


def test_a_completion_holds_its_prompt_and_what_it_generated_up_to_what_the_engine_held():
    ledger = SlotLedger(2)
    assert held(ledger, 0) == [] and ledger[0].origin is Origin.NONE and ledger[0].last_task is None
    before = ledger[0].last_active
    ledger.started(0, as_tokens([5, 6, 7, 8]))
    assert held(ledger, 0) is None  # unknown while it runs
    assert ledger[0].origin is Origin.EVALUATED and ledger[0].last_active >= before
    ledger.completed(0, result([9, 10, 11], n_held=6, content="a\nb"), {"temperature": 0.0})
    assert held(ledger, 0) == [5, 6, 7, 8, 9, 10]  # the last generated token was never evaluated
    task = ledger[0].last_task
    assert task is not None and task.id_task == 0 and task.n_decoded == 3 and task.has_new_line
    assert (task.n_prompt_tokens, task.n_prompt_tokens_processed, task.n_prompt_tokens_cache) == (4, 3, 1)
    assert task.params == {"temperature": 0.0}
    assert held(ledger, 1) == [] and ledger[1].last_task is None  # the other slot is untouched

    # The next turn continues the conversation: its origin stays; the task counter is the server's.
    ledger.restored(1, as_tokens([1, 2]), Origin.STORE, "b.ssf")
    ledger.started(1, as_tokens([1, 2, 3]))
    assert ledger[1].origin is Origin.STORE and ledger[1].file == "b.ssf" and ledger[1].n_restored == 2
    ledger.completed(1, result([4], n_held=4), {})
    assert held(ledger, 1) == [1, 2, 3, 4] and ledger[1].last_task.id_task == 1


def test_a_text_prompt_or_no_prompt_cache_leaves_what_is_held_unknown_or_evaluated():
    ledger = SlotLedger(1)
    ledger.restored(0, as_tokens([1, 2, 3]), Origin.SLOT_FILE, "chat.bin")
    ledger.started(0, as_tokens([1, 2, 3, 4]), cache_prompt=False)  # the engine erases what it held
    assert ledger[0].origin is Origin.EVALUATED and ledger[0].file is None and ledger[0].n_restored == 0
    ledger.completed(0, result([7], n_held=5), {})
    assert held(ledger, 0) == [1, 2, 3, 4, 7]
    ledger.started(0, known_tokens("some text"))  # tokenized by the engine: not known here
    ledger.completed(0, result([8], n_held=9), {})
    assert held(ledger, 0) is None and ledger[0].n_tokens is None
    # A COMPLETE that ended without a result (an error, the engine gone) leaves it unknown too.
    ledger.started(0, as_tokens([1]))
    assert held(ledger, 0) is None


def test_restore_save_erase_and_the_engine_exit():
    ledger = SlotLedger(2)
    ledger.started(0, as_tokens([1, 2]))
    ledger.completed(0, result([3], n_held=3), {})
    ledger.restored(0, as_tokens([4, 5, 6]), Origin.SLOT_FILE, "chat.bin")
    record = ledger[0]
    assert held(ledger, 0) == [4, 5, 6] and record.origin is Origin.SLOT_FILE and record.file == "chat.bin"
    assert (
        record.n_restored == 3 and record.last_task is None
    )  # the task before it ran on another conversation
    ledger.restored(1, None, Origin.SLOT_FILE, "unreadable.bin")
    assert held(ledger, 1) is None and ledger[1].n_restored == 0

    # A save shows what the slot holds: the file's tokens replace the tracked ones, unless the slot moved on.
    tracked = ledger.tokens(0)
    ledger.saved(0, tracked, as_tokens([4, 5]))
    assert held(ledger, 0) == [4, 5]
    ledger.saved(0, tracked, as_tokens([9]))  # `tracked` is no longer what it holds: ignored
    assert held(ledger, 0) == [4, 5]

    ledger.erased(0)
    assert held(ledger, 0) == [] and ledger[0].origin is Origin.NONE and ledger[0].file is None
    ledger.restored(0, as_tokens([1]), Origin.STORE, "a.ssf")
    ledger.engine_exited(4)
    for record in ledger.snapshot():
        assert record.n_tokens == 0 and record.origin is Origin.NONE and record.last_task is None


def test_common_prefix_of_lists_and_arrays():
    assert common_prefix([1, 2, 3], as_tokens([1, 2, 4])) == 2
    assert common_prefix(as_tokens([1, 2]), [1, 2, 3]) == 2 and common_prefix([], [1]) == 0
    assert common_prefix(np.arange(5), np.arange(5)) == 5
    assert known_tokens([1, 2]).tolist() == [1, 2] and known_tokens(["a", 1]) is None
    assert EMPTY.size == 0 and not EMPTY.flags.writeable
