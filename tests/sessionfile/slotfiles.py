"""llama.cpp slot files for the tests, encoded here from spec/llama-cpp-slot.md's byte table (not with the
library's writer), a tiny GGUF model (its key/value table only) they belong to, and the bad files of
spec/bad-llamacpp: `python tests/sessionfile/slotfiles.py` writes them.
"""

from __future__ import annotations

import json
import random
import struct
import sys
from pathlib import Path

from strata_sessionfile import errors as E

BAD_DIR = Path(__file__).resolve().parents[2] / "spec" / "bad-llamacpp"
N_LAYER, N_HEAD, N_HEAD_KV, N_EMBD = 2, 4, 2, 16  # head size 4: K/V rows of 8 values
ROW = N_HEAD_KV * N_EMBD // N_HEAD
F16, F32, Q8_0, UNKNOWN_TYPE = 1, 0, 8, 99


def _gguf_string(s: str) -> bytes:
    return struct.pack("<Q", len(s)) + s.encode()


def tiny_gguf(arch: str = "llama", n_layer: int = N_LAYER, vocab: int = 0) -> bytes:
    """A GGUF v3 file with no tensors: the keys llama.cpp's cache geometry comes from (and, with `vocab`, a
    token list of that many strings before them, as real files have)."""
    words = b"".join(_gguf_string(f"t{i}") for i in range(vocab))
    tokens = (
        [(_gguf_string("tokenizer.ggml.tokens"), 9, struct.pack("<IQ", 8, vocab) + words)] if vocab else []
    )
    kv = [
        *tokens,
        (_gguf_string("general.architecture"), 8, _gguf_string(arch)),
        (_gguf_string(f"{arch}.block_count"), 4, struct.pack("<I", n_layer)),
        (_gguf_string(f"{arch}.embedding_length"), 4, struct.pack("<I", N_EMBD)),
        (_gguf_string(f"{arch}.attention.head_count"), 4, struct.pack("<I", N_HEAD)),
        (_gguf_string(f"{arch}.attention.head_count_kv"), 4, struct.pack("<I", N_HEAD_KV)),
    ]
    body = b"".join(k + struct.pack("<I", t) + v for k, t, v in kv)
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv)) + body


def slot_bytes(
    n: int = 5,
    *,
    v_trans: bool = False,
    seed: int = 0,
    packed: bool = True,
    positions: list[int] | None = None,
    n_seq_id: int = 1,
    streams: tuple[int, ...] = (0,),
    n_stream: int = 1,
    n_layer: int = N_LAYER,
    n_rot: tuple[int, int] = (0, 0),
    k_type: int = F16,
    k_row_bytes: int | None = None,
    version: int = 4,
    magic: bytes = b"qsgg",
) -> bytes:
    """A slot file of n tokens of one sequence, f16 K/V of random values (llama-server's packed token list)."""
    rng = random.Random(seed)
    tokens = [rng.randrange(1000) for _ in range(n)]
    words = [-1, 1, n, *tokens, 0] if packed else tokens
    out = bytearray(magic + struct.pack("<II", version, len(words)) + struct.pack(f"<{len(words)}i", *words))
    out += struct.pack("<I", n_stream)
    for s in range(n_stream):
        cells = n if s in streams else 0
        out += struct.pack("<I", cells)
        if not cells:
            continue
        for pos in positions if positions is not None else range(n):
            out += struct.pack("<iI", pos, n_seq_id) + struct.pack(f"<{n_seq_id}i", *[0] * n_seq_id)
        out += struct.pack("<IIII", int(v_trans), n_layer, *n_rot)
        for _ in range(n_layer):
            row = k_row_bytes if k_row_bytes is not None else ROW * 2
            out += struct.pack("<iQ", k_type, row) + rng.randbytes(n * row)
        for _ in range(n_layer):
            if v_trans:
                out += struct.pack("<iII", F16, 2, ROW) + rng.randbytes(ROW * n * 2)
            else:
                out += struct.pack("<iQ", F16, ROW * 2) + rng.randbytes(n * ROW * 2)
    return bytes(out)


def bad_slot_files() -> dict[str, tuple[bytes, type[E.SessionFileError]]]:
    """Each breaks one rule; the class is the refusal a conversion against tiny_gguf() must raise."""
    good = slot_bytes(6, seed=1)
    trans = slot_bytes(6, seed=1, v_trans=True)
    tokens_end = 12 + 4 * (6 + 4)
    cells_at = tokens_end + 4  # the stream's cell count
    data_head = cells_at + 4 + 6 * 12
    cleared = bytearray(trans)
    cleared[data_head : data_head + 4] = struct.pack("<I", 0)  # V transposed, flag says rows
    return {
        "bad_magic": (slot_bytes(magic=b"ggsq"), E.SlotBadMagic),
        "version_3": (slot_bytes(version=3), E.SlotUnsupportedVersion),
        "empty": (b"", E.SlotTruncated),
        "truncated_in_k": (good[: len(good) // 2], E.SlotTruncated),
        "truncated_last_byte": (good[:-1], E.SlotTruncated),
        "token_count_past_end": (good[:8] + struct.pack("<I", 1 << 20) + good[12:], E.SlotTruncated),
        "cell_count_past_end": (
            good[:cells_at] + struct.pack("<I", 1 << 22) + good[cells_at + 4 :],
            E.SlotTruncated,
        ),
        "trailing_data": (good + b"\0" * 7, E.SlotTrailingData),
        "zero_streams": (
            good[:tokens_end] + struct.pack("<I", 0) + good[tokens_end + 4 :],
            E.SlotLimitExceeded,
        ),
        "unknown_k_type": (slot_bytes(k_type=UNKNOWN_TYPE), E.SlotUnsupportedType),
        "k_row_of_another_model": (slot_bytes(k_row_bytes=ROW * 4), E.SlotGeometryMismatch),
        "layer_count_of_another_model": (slot_bytes(n_layer=N_LAYER + 1), E.SlotGeometryMismatch),
        "transposed_v_given_as_rows": (bytes(cleared), E.SlotGeometryMismatch),
        "two_sequences_per_cell": (slot_bytes(n_seq_id=2), E.SlotCellsInvalid),
        "two_streams_with_cells": (slot_bytes(n_stream=2, streams=(0, 1)), E.SlotCellsInvalid),
        "positions_with_a_gap": (slot_bytes(5, positions=[0, 1, 2, 3, 5]), E.SlotCellsInvalid),
        "position_twice": (slot_bytes(5, positions=[0, 1, 1, 2, 3]), E.SlotCellsInvalid),
        "rotated_cache": (slot_bytes(n_rot=(64, 64)), E.SlotRotated),
        "packed_tokens_version_2": (good[:16] + struct.pack("<I", 2) + good[20:], E.SlotUnsupportedVersion),
    }


def write_all() -> None:
    BAD_DIR.mkdir(parents=True, exist_ok=True)
    (BAD_DIR / "model.gguf").write_bytes(tiny_gguf())
    expected = {}
    for name, (data, cls) in bad_slot_files().items():
        (BAD_DIR / f"{name}.bin").write_bytes(data)
        expected[f"{name}.bin"] = cls.reason
    (BAD_DIR / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    write_all()
