"""Copies of a real GGUF with its metadata changed or added to (tensors copied as they are, more may be
added), for tests that need a model the packages do not ship: one with fill-in-the-middle tokens, one holding
a key or tensor the engine does not compute."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np

TOKENS_KEY = "tokenizer.ggml.tokens"
TYPES_KEY = "tokenizer.ggml.token_type"
# SmolLM2's control tokens <gh_stars>, <issue_start>, <issue_comment>, renamed to StarCoder's FIM texts.
SMOLLM2_FIM_NAMES = {7: "<fim_prefix>", 8: "<fim_suffix>", 9: "<fim_middle>"}


def with_renamed_tokens(src: Path, dst: Path, names: dict[int, str]) -> Path:
    """`src` with the vocabulary's token `id` renamed `names[id]`; everything else the same."""

    def rename(key: str, value: Any) -> Any:
        return [names.get(i, text) for i, text in enumerate(value)] if key == TOKENS_KEY else value

    return _copy(src, dst, rename)


def phi3_named_metadata(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """What makes a SentencePiece file (gemma3's) a Phi-3 one to llama.cpp's tokenizer: a Phi-3 general.name, the
    one text it sets attributes of by that name that gemma3 lacks (<|endoftext|>: an unused token renamed), and,
    as in Phi-3's vocabulary, no special token starting with whitespace (gemma3's user-defined runs of newlines,
    spaces and tabs made normal: which of two such runs of one length strips the other would be up to the
    order llama.cpp's std::sort leaves equal lengths in)."""
    tokens = [("<|endoftext|>" if t == "<unused1>" else t) for t in metadata[TOKENS_KEY]]
    types = [
        gguf.TokenType.NORMAL if kind == gguf.TokenType.USER_DEFINED and text[:1].isspace() else kind
        for text, kind in zip(tokens, np.asarray(metadata[TYPES_KEY]).tolist(), strict=True)
    ]
    return {"general.name": "Phi3 Mini 4k Instruct", TOKENS_KEY: tokens, TYPES_KEY: types}


def with_metadata(src: Path, dst: Path, values: Mapping[str, Any]) -> Path:
    """`src` with the metadata keys of `values` given those values (of the types they have there)."""
    return _copy(src, dst, lambda key, value: values.get(key, value))


def with_additions(
    src: Path,
    dst: Path,
    *,
    metadata: Mapping[str, Any] | None = None,
    tensors: Mapping[str, np.ndarray] | None = None,
) -> Path:
    """`src` with metadata keys (a value: Python's bool, int, float or str, typed as gguf's writer types
    them) and float32 tensors added."""
    return _copy(src, dst, lambda key, value: value, metadata or {}, tensors or {})


def _copy(
    src: Path,
    dst: Path,
    edit: Callable[[str, Any], Any],
    extra_metadata: Mapping[str, Any] | None = None,
    extra_tensors: Mapping[str, np.ndarray] | None = None,
) -> Path:
    extra_metadata, extra_tensors = extra_metadata or {}, extra_tensors or {}
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer writes these itself
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, edit(field.name, field.contents()), value_type, sub_type=sub_type)
    for key, value in extra_metadata.items():
        writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
    for tensor in reader.tensors:
        writer.add_tensor_info(
            tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type
        )
    for name, data in extra_tensors.items():
        writer.add_tensor_info(
            name, data.shape, np.dtype(np.float32), data.nbytes, gguf.GGMLQuantizationType.F32
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    for data in extra_tensors.values():
        writer.write_tensor_data(np.ascontiguousarray(data, dtype=np.float32))
    writer.close()
    return dst


def of_architecture(dst: Path, arch: str) -> Path:
    """A small well-formed GGUF of architecture `arch` (one f32 tensor, no weights worth the name)."""
    writer = gguf.GGUFWriter(dst, arch=arch)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
