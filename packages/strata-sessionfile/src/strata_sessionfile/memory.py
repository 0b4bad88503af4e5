"""Memory a save or restore works in: block buffers (the caller's, the adapter's or fresh maps), fresh
buffers to read a large metadata into, and the RAM probe of a restore's preflight."""

from __future__ import annotations

import mmap

from . import errors as E
from .adapter import BufferProvider, adapter_call
from .format import DEFAULT_BLOCK_SIZE

MIN_BLOCK_SIZE = 4096
HUGE_PAGE = 2 << 20


class BlockBuffers:
    """Block buffers (anonymous memory maps) that a caller may keep and pass to every save/restore, so no
    call pays for allocating and faulting in fresh buffers. A save uses two; a restore with N reader
    threads N + 1 (with fewer it reads with fewer threads)."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, count: int = 2) -> None:
        if block_size < MIN_BLOCK_SIZE:
            raise ValueError(f"block_size must be at least {MIN_BLOCK_SIZE}")
        if count < 2:
            raise ValueError("count must be at least 2")
        self.block_size = block_size
        self._maps = [mmap.mmap(-1, block_size) for _ in range(count)]
        self.views = [memoryview(m) for m in self._maps]

    def close(self) -> None:
        for v in self.views:
            v.release()
        for m in self._maps:
            m.close()


def block_buffers(
    adapter, block_size: int, buffers: BlockBuffers | None = None, count: int = 2
) -> list[memoryview]:
    """``count`` block buffers: the caller's (BlockBuffers: all it has, which may be fewer), the adapter's own
    (BufferProvider), or fresh maps."""
    if buffers is not None:
        if buffers.block_size < block_size:
            raise ValueError(f"the given buffers hold {buffers.block_size} bytes, block_size is {block_size}")
        return buffers.views[:count]
    if isinstance(adapter, BufferProvider):
        bufs = list(adapter_call(adapter.block_buffers, count, block_size))
        if len(bufs) < count or any(len(b) < block_size or b.readonly for b in bufs[:count]):
            raise E.AdapterFailed(
                f"block_buffers must return {count} writable memoryviews of {block_size} bytes"
            )
        return [memoryview(b).cast("B") for b in bufs[:count]]
    return BlockBuffers(block_size, count).views


def fresh_buffer(n: int) -> bytearray | mmap.mmap:
    """``n`` zero bytes to read into; from 2 MiB an anonymous map asking for transparent huge pages (one
    page fault per 2 MiB instead of per 4 KiB: bench/sessionfile/DECISIONS.md, "Large metadata")."""
    if n < HUGE_PAGE:
        return bytearray(n)
    area = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            area.madvise(advice)
        except OSError:  # huge pages off: the advice is only a hint
            pass
    return area


def memory_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes, or None where unknown."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
