"""What this engine writes in a session file beyond the K/V parts: the engine fields (a small canonical JSON
object) and the deepest ring checkpoint's bytes, encoded at a save and decoded and checked at a restore
(the layout: spec/engine-protocol.md, "Sessions").

engine_fields = ``{"checkpoint": {"position", "start"} | null, "layout": 1, "ring_start": int}``, plus
``"notes": str`` where the SAVE carried the client's text (a restore ignores it); the
checkpoint's data = every ring layer's K, V (and int8 scales) of positions [start, position), in ring-layer
order. A field that does not match what the token count implies is refused (`InconsistentState`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
from strata_sessionfile import Checkpoint, RunningState
from strata_sessionfile import errors as E
from strata_sessionfile.format import LIMIT

from ..kv import SCALE_DTYPE, KVGeometry, KVParts, RingCheckpoint
from .identity import SESSION_LAYOUT_VERSION

log = logging.getLogger(__name__)

MAX_NOTES_BYTES = 512 * 1024  # a SAVE's notes (UTF-8): a conversation's text as its client keeps it
MAX_ENGINE_FIELDS_BYTES = MAX_NOTES_BYTES + 4096


class EngineFieldsCodec:
    """The engine fields and checkpoint bytes of one K/V geometry."""

    def __init__(self, geometry: KVGeometry):
        self.geometry = geometry
        self.ring_layers = tuple(geometry.ring_layers)
        self.window = geometry.max_window  # None without sliding-window layers

    def ring_start(self, n: int) -> int:
        """The lowest position the rings hold for a conversation of n tokens (what the file carries)."""
        return 0 if self.window is None else n - min(n, self.window)  # window: None exactly without rings

    def checkpoint_token_bytes(self) -> int:
        return sum(self.geometry.token_bytes(i) for i in self.ring_layers)

    # ---- save ------------------------------------------------------------------------------------
    def encode(
        self,
        n: int,
        checkpoint: RingCheckpoint | None,
        to_host: Callable[[Any], np.ndarray],
        notes: str | None = None,
    ) -> tuple[Checkpoint, bytes]:
        """(the file's checkpoint, the engine fields) for a conversation of n tokens."""
        file_checkpoint, cp_fields = self._encode_checkpoint(checkpoint, to_host)
        fields: dict[str, Any] = {
            "layout": SESSION_LAYOUT_VERSION,
            "ring_start": self.ring_start(n),
            "checkpoint": cp_fields,
        }
        if notes is not None:  # absent otherwise: a file without notes is byte for byte what it was
            fields["notes"] = notes
        return file_checkpoint, json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    def _encode_checkpoint(
        self, cp: RingCheckpoint | None, to_host: Callable[[Any], np.ndarray]
    ) -> tuple[Checkpoint, dict | None]:
        if cp is None or not self.ring_layers:
            return Checkpoint(0, b""), None
        n_bytes = (cp.position - cp.start) * self.checkpoint_token_bytes()
        if n_bytes > LIMIT["MAX_CHECKPOINT_DATA_BYTES"]:
            log.warning("the deepest checkpoint (%d bytes) is over the format's limit: not saved", n_bytes)
            return Checkpoint(0, b""), None
        # One copy: join reads each (contiguous) array's buffer directly. A device pool keeps its
        # checkpoints on the device (kv/checkpoints.py): they come to the host here, at the save.
        chunks = [
            np.ascontiguousarray(to_host(arr)).data for i in self.ring_layers for arr in cp.layers[i].arrays()
        ]
        return Checkpoint(cp.position, b"".join(chunks)), {"position": cp.position, "start": cp.start}

    # ---- restore ---------------------------------------------------------------------------------
    def decode(self, st: RunningState, where: dict[str, Any]) -> tuple[int, tuple[RingCheckpoint, ...]]:
        """(ring_start, checkpoints) of a file's running state; InconsistentState where its engine fields or
        checkpoint bytes do not match its token count. Touches nothing."""
        n = st.n_tokens
        if not st.engine_fields and not st.checkpoint.data and not st.checkpoint.token_index:
            # a file another tool wrote (a converted llama.cpp slot file) holds the K/V and nothing of ours
            return self.ring_start(n), ()
        try:
            fields = json.loads(st.engine_fields.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise E.InconsistentState(
                f"engine fields are not JSON: {exc}", field="state.engine_fields", **where
            ) from None
        if not isinstance(fields, dict) or fields.get("layout") != SESSION_LAYOUT_VERSION:
            raise E.InconsistentState(
                f"engine fields {fields!r} are not layout {SESSION_LAYOUT_VERSION}",
                field="state.engine_fields",
                **where,
            )
        ring_start = self.ring_start(n)
        if fields.get("ring_start") != ring_start:
            raise E.InconsistentState(
                f"ring_start {fields.get('ring_start')!r} should be {ring_start}",
                field="state.engine_fields.ring_start",
                **where,
            )
        return ring_start, self._decode_checkpoint(st, fields.get("checkpoint", "missing"), where)

    def _decode_checkpoint(self, st: RunningState, cp_fields: Any, where: dict) -> tuple[RingCheckpoint, ...]:
        data, index = st.checkpoint.data, st.checkpoint.token_index
        if cp_fields is None:
            if data or index:
                raise E.InconsistentState(
                    "checkpoint data without its engine fields", field="state.checkpoint", **where
                )
            return ()
        if (
            not isinstance(cp_fields, dict)
            or self.window is None  # window: None exactly without rings
            or cp_fields.get("position") != index
            or cp_fields.get("start") != max(0, index - self.window + 1)
        ):
            raise E.InconsistentState(
                f"checkpoint fields {cp_fields!r} do not match token index {index}",
                field="state.engine_fields.checkpoint",
                **where,
            )
        start = cp_fields["start"]
        count = index - start
        expected = count * self.checkpoint_token_bytes()
        if len(data) != expected:
            raise E.InconsistentState(
                f"checkpoint data is {len(data)} bytes; {count} tokens of the ring layers are {expected}",
                field="state.checkpoint.data",
                **where,
            )
        geometry = self.geometry
        sdt = geometry.storage_dtype
        buf = np.frombuffer(data, dtype=np.uint8)  # bytes are immutable: read-only views, no copy
        pos = 0
        layers: dict[int, KVParts] = {}

        def take(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
            nonlocal pos
            dt = np.dtype(dtype)
            nbytes = int(np.prod(shape)) * dt.itemsize
            arr = buf[pos : pos + nbytes].view(dt).reshape(shape)
            arr.flags.writeable = False
            pos += nbytes
            return arr

        for i in self.ring_layers:
            g = geometry.layers[i]
            k, v = take((count, *g.row_shape), sdt), take((count, *g.row_shape), sdt)
            ks = vs = None
            if geometry.has_scales:
                ks, vs = (
                    take((count, *g.scale_shape), SCALE_DTYPE),
                    take((count, *g.scale_shape), SCALE_DTYPE),
                )
            layers[i] = KVParts(k, v, ks, vs)
        assert pos == len(data)
        return (RingCheckpoint(position=index, start=start, layers=layers),)
