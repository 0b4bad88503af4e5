"""Copies of a real GGUF with its metadata changed (tensors copied as they are), for tests that need a
model the packages do not ship: one with fill-in-the-middle tokens."""

from __future__ import annotations

from pathlib import Path

import gguf

TOKENS_KEY = "tokenizer.ggml.tokens"
# SmolLM2's control tokens <gh_stars>, <issue_start>, <issue_comment>, renamed to StarCoder's FIM texts.
SMOLLM2_FIM_NAMES = {7: "<fim_prefix>", 8: "<fim_suffix>", 9: "<fim_middle>"}


def with_renamed_tokens(src: Path, dst: Path, names: dict[int, str]) -> Path:
    """`src` with the vocabulary's token `id` renamed `names[id]`; everything else the same."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer writes these itself
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == TOKENS_KEY:
            value = [names.get(i, text) for i, text in enumerate(value)]
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    return dst
