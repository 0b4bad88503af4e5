"""The apply modes of a restore, after the read pass (streaming) or the metadata checks (staged).

Streaming (``apply_streaming``): the file must be unchanged (fstat) and its metadata, padding,
compression header, block table and trailer byte-identical to what the read pass saw; the data section
is re-read and handed to the adapter block by block while the hash is recomputed. The first delivered
block is the gate (``begin_apply``); after it every failure calls ``fail_stop`` and raises ``FailStop``.

Staged (``apply_staged``): one pass into the adapter's staging area while hashing; ``commit_staged``
only after every check, else ``discard_staged``.

An adapter whose copies finish after ``copy_in`` / ``stage_in`` return (``AsyncCopyTarget``) is waited for
before a block buffer is refilled and at the end of each pass; one that holds a piece's copy back to
merge it with the next (``MergingCopyTarget``) is told after each block's last piece, so that block's copy
runs while it is hashed.
"""

from __future__ import annotations

from collections.abc import Callable

from . import errors as E
from .adapter import (
    AsyncCopyTarget,
    LandingTarget,
    MergingCopyTarget,
    SessionTarget,
    StagingTarget,
    adapter_call,
)
from .codec import METADATA_OFFSET
from .datapass import land_data, stream_data
from .memory import HUGE_PAGE
from .pipelines import ReadThreads, read_exact_parallel
from .records import Phase, RestorePlan
from .validate import OpenedFile, check_digest, check_unchanged


def fail_stop(adapter: SessionTarget, exc: BaseException, path: str) -> E.FailStop:
    """Tell the adapter its K/V can no longer be vouched for; the FailStop to raise."""
    if not isinstance(exc, E.SessionFileError):
        exc = E.AdapterFailed(f"{type(exc).__name__}: {exc}", path=path)
    try:
        adapter.fail_stop(exc)
    except Exception:  # the engine is going down anyway; the original error is what matters
        pass
    return E.FailStop(exc, path=path)


def copy_waiter(adapter) -> Callable[[], None] | None:
    if not isinstance(adapter, AsyncCopyTarget):
        return None
    return lambda: adapter_call(adapter.wait_copies)


def block_handed_over(adapter) -> Callable[[], None]:
    """What to call after a block's last piece went to copy_in / stage_in: a MergingCopyTarget's flush."""
    if not isinstance(adapter, MergingCopyTarget):
        return lambda: None
    return lambda: adapter_call(adapter.flush_copies)


def _check_prefix_again(opened: OpenedFile, readers: ReadThreads) -> None:
    """Rule A1: everything but the data section is byte-identical to what the read pass validated."""
    source = opened.source
    # A bytearray on the left compares with memcmp (bench/sessionfile/DECISIONS.md, "Large metadata").
    prefix_again = bytearray(len(opened.prefix))
    try:
        read_exact_parallel(source, memoryview(prefix_again), METADATA_OFFSET, readers, HUGE_PAGE)
    except E.Truncated as exc:
        raise E.FileChanged(
            f"the file shrank between the read pass and the apply pass ({exc})", path=opened.path
        ) from None
    trailer_again = source.read(len(opened.trailer), opened.layout.trailer_offset, short_error=E.FileChanged)
    comp = opened.layout.compressed
    head_again = table_again = b""
    if comp is not None:
        head_again = source.read(len(opened.section_head), comp.header_offset, short_error=E.FileChanged)
        table_again = source.read(len(opened.table), comp.table_offset, short_error=E.FileChanged)
    if (
        prefix_again != opened.prefix
        or trailer_again != opened.trailer
        or head_again != opened.section_head
        or table_again != opened.table
    ):
        raise E.FileChanged(
            "the metadata, compression header, block table or trailer changed between the read "
            "pass and the apply pass",
            path=opened.path,
        )
    del prefix_again
    opened.bytes_read += len(opened.prefix) + len(trailer_again) + len(head_again) + len(table_again)


def apply_streaming(
    opened: OpenedFile,
    adapter: SessionTarget,
    plan: RestorePlan,
    buffers,
    block_size,
    progress,
    lander: LandingTarget | None,
    readers: ReadThreads,
) -> None:
    """``lander``: the adapter where the file's bytes land straight in its memory, else None."""
    # Before the gate: the file must be exactly what the read pass validated.
    check_unchanged(opened, "between the read pass and the apply pass")
    _check_prefix_again(opened, readers)
    # The prefix re-read is byte-identical to the one the read pass hashed (checked above): start from there.
    hasher = opened.pass_hasher()
    gate = [False]
    handed_over = block_handed_over(adapter)

    def open_gate() -> None:
        gate[0] = True
        adapter_call(adapter.begin_apply, plan)

    def deliver(view: memoryview, segments) -> None:
        if not gate[0]:
            open_gate()
        for layer, part, part_offset, length, buf_offset in segments:
            adapter_call(
                adapter.copy_in, layer, part, part_offset, view[buf_offset : buf_offset + length].toreadonly()
            )
        handed_over()

    try:
        if lander is not None:  # the gate first: from here on the file's bytes land in the live K/V
            open_gate()
        _read_payload(opened, adapter, buffers, block_size, hasher, deliver, progress, lander, readers)
        if not gate[0]:
            open_gate()
        check_digest(opened, hasher, "apply pass")
        check_unchanged(opened, "during the apply pass")
        adapter_call(adapter.commit, plan.state)
    except BaseException as exc:
        if gate[0]:
            raise fail_stop(adapter, exc, opened.path) from exc
        raise


def _read_payload(
    opened: OpenedFile, adapter, buffers, block_size, hasher, deliver, progress,
    lander: LandingTarget | None, readers: ReadThreads,
) -> None:  # fmt: skip
    """The apply pass over the payload: landed in `lander`'s memory, else streamed through `deliver`."""
    if lander is not None:
        opened.bytes_read += land_data(
            opened, lander.landing_views, block_size, hasher, progress, Phase.APPLY, readers
        )
    else:
        opened.bytes_read += stream_data(
            opened, buffers, block_size, hasher, deliver, progress, Phase.APPLY, readers, copy_waiter(adapter)
        )


def apply_staged(
    opened: OpenedFile,
    adapter: StagingTarget,
    plan: RestorePlan,
    buffers,
    block_size,
    progress,
    lander: LandingTarget | None,
    readers: ReadThreads,
) -> None:
    hasher = opened.pass_hasher()
    handed_over = block_handed_over(adapter)

    def deliver(view: memoryview, segments) -> None:
        for layer, part, part_offset, length, buf_offset in segments:
            adapter_call(
                adapter.stage_in,
                layer,
                part,
                part_offset,
                view[buf_offset : buf_offset + length].toreadonly(),
            )
        handed_over()

    try:
        adapter_call(adapter.begin_staging, plan)
        # the lander's bytes go straight into the staging area
        _read_payload(opened, adapter, buffers, block_size, hasher, deliver, progress, lander, readers)
        check_digest(opened, hasher, "staged pass")
        check_unchanged(opened, "during the staged pass")
        adapter_call(adapter.commit_staged, plan.state)
    except BaseException:
        try:
            adapter.discard_staged()
        except Exception:  # the original failure is what the caller must see
            pass
        raise
