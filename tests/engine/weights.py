"""Packed weights for the kernel tests (test_ops.py, test_q8.py): random blocks of every ggml type the
CPU kernels take, made layouts no GGUF type packs to, and both models' real weight shapes."""

from __future__ import annotations

import numpy as np

# The f16 fields (byte offsets) of each packed ggml type's block, set to finite values in random blocks.
F16_FIELDS = {
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2),
    "Q6_K": (208,),
}  # fmt: skip


def random_packed(qtype, n, k, rng):
    """A random [n, k] tensor of ggml type `qtype` (finite f16 scales): (packed, gguf's float32)."""
    import gguf
    from strata_engine.gguf.dequant import dequantize_raw
    from strata_engine.gguf.reader import TensorInfo
    from strata_engine.ops.packed import pack_tensor

    block_values, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n * k // block_values, type_size), dtype=np.uint8)
    for off in F16_FIELDS[qtype.name]:
        raw[:, off : off + 2] = rng.uniform(-2, 2, (len(raw), 1)).astype(np.float16).view(np.uint8)
    info = TensorInfo(name="w", shape=(n, k), ggml_type=qtype, offset=0, n_bytes=raw.nbytes)
    return pack_tensor(raw.reshape(-1), qtype, (n, k), "w"), dequantize_raw(raw.reshape(-1), info)


# Layouts no GGUF type packs to (4-bit without a min; int8 16-value blocks with a min; f16 scales on
# 16-value blocks): (values dtype, block, scale dtype, with min). The kernels take every combination.
EXTRA_LAYOUTS = [(np.uint8, 32, np.uint16, False), (np.uint8, 32, np.float32, False), (np.int8, 16, np.float32, True),
                 (np.int8, 16, np.uint16, False), (np.int8, 32, np.uint16, True)]  # fmt: skip


def made_packed(layout, n, k, rng):
    """A random PackedWeight of the layout (values dtype, block, scale dtype, with min)."""
    from strata_engine.ops.packed import PackedWeight

    dtype, block, scale_dtype, with_min = layout
    if dtype == np.uint8:
        values = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    else:
        values = rng.integers(-128, 128, (n, k), dtype=np.int8)

    def scales():
        s = rng.uniform(-2, 2, (n, k // block)).astype(np.float16)
        return s.view(np.uint16) if scale_dtype == np.uint16 else s.astype(np.float32)

    return PackedWeight(values, scales(), scales() if with_min else None, block)


def real_weights(gguf_file, head_rows: int):
    """Both models' real weight shapes: layer 0's stacked QKV and gate/up, its down and output
    projections (packed as the loader packs them), and `head_rows` rows of the output head."""
    from strata_engine.gguf import dequantize_tensor
    from strata_engine.ops.packed import pack_tensor, stack_rows

    def packed(name):
        info = gguf_file.tensors[name]
        return pack_tensor(gguf_file.tensor_bytes(name), info.ggml_type, info.shape, name)

    def dense(*names):
        return np.concatenate([dequantize_tensor(gguf_file, n) for n in names])

    groups = [
        ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"),
        ("blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"),
        ("blk.0.ffn_down.weight",),
        ("blk.0.attn_output.weight",),
    ]
    out = [(stack_rows([packed(n) for n in names]), dense(*names)) for names in groups]
    head = packed("token_embd.weight").rows(0, head_rows)
    out.append((head, dequantize_tensor(gguf_file, "token_embd.weight", rows=np.arange(head_rows))))
    return out
