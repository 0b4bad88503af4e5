"""Ring checkpoints: what makes an earlier turn boundary a valid resume point for sliding-window layers.

A ring layer keeps only its last `capacity` positions, so once the conversation has moved more than
`capacity - window + 1` tokens past a position r, the pool alone can no longer continue from r (the
window-1 keys before r were overwritten). A `RingCheckpoint` at position c copies, for every ring layer,
the encoded K/V of positions [max(0, c - window + 1), c): with the full layers' [0, c) (still in the pool
as long as the conversation was never cut back below c) that is everything needed to evaluate token c.

The runner takes one at the end of every prefill (a turn boundary: the next turn's prompt almost always
extends this prompt) and keeps the `max_checkpoints` deepest. **The deepest checkpoint** is the one at the
greatest position, i.e. the end of the latest prompt; the session file stores it as the next turn's resume
point, so a restored conversation can still resume there when the next prompt diverges inside the last
reply by more than the ring's slack. Cutting the conversation back to r drops every checkpoint above r.
"""

from __future__ import annotations

import attrs
import numpy as np

from ..errors import KVStateError
from .pool import KVParts, KVPool


@attrs.frozen(eq=False)
class RingCheckpoint:
    position: int  # tokens [0, position) were evaluated when it was taken
    start: int  # first position saved: max(0, position - window + 1)
    layers: dict[
        int, KVParts
    ]  # ring layer index -> encoded K/V of [start, position), read-only (host or device)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.layers.values())


def take_checkpoint(pool: KVPool) -> RingCheckpoint | None:
    """A checkpoint at the pool's current end, or None for a model without sliding-window layers."""
    window = pool.geometry.max_window
    if window is None:
        return None
    c = pool.n_tokens
    start = max(0, c - window + 1)
    if start < pool.ring_start:
        raise KVStateError(f"cannot checkpoint at {c}: the rings hold from {pool.ring_start} only")
    # A device pool's checkpoint stays on the device: host copies would wait for the prefill to end
    # (bench/gpu/DECISIONS.md "Work kept on the device"). Host copies (numpy) are made read-only; device ones are never handed out.
    layers = {}
    for i in pool.geometry.ring_layers:
        parts = pool.read_device(i, start, c)
        for arr in parts.arrays():
            if isinstance(arr, np.ndarray):
                arr.flags.writeable = False
        layers[i] = parts
    return RingCheckpoint(position=c, start=start, layers=layers)


def restore_checkpoint(pool: KVPool, checkpoint: RingCheckpoint) -> None:
    """Write the checkpoint's ring K/V back and cut the pool to its position. The caller guarantees that
    the full layers still hold [0, position) (the conversation never went below it since it was taken)
    and refills the placement afterwards."""
    if checkpoint.position > pool.n_tokens:
        raise KVStateError(f"checkpoint at {checkpoint.position} is beyond the held {pool.n_tokens} tokens")
    if set(checkpoint.layers) != set(pool.geometry.ring_layers):
        raise KVStateError("checkpoint layers do not match the pool's ring layers")
    for i, parts in checkpoint.layers.items():
        if parts.n_tokens != checkpoint.position - checkpoint.start:
            raise KVStateError(
                f"checkpoint layer {i} holds {parts.n_tokens} tokens, expected "
                f"{checkpoint.position - checkpoint.start}"
            )
        pool.write(i, checkpoint.start, parts)
    pool.set_extent(checkpoint.position, checkpoint.start)
