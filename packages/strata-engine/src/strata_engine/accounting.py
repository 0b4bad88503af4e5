"""Every metadata key of a GGUF file accounted for: the engine reads it, or its value provably changes nothing
the engine computes, or the file is refused with each such key named. Nothing is silently ignored: a key
nobody reads (a RoPE scaling, a soft-cap, an expert count) would otherwise make a wrong model that loads.

The keys under `<arch>.` are read by the family's config builder (config.py records what it reads); the
tables below say what else is read, and by whom, and which values of an unread key are harmless. Tensors
are accounted for by the family itself (`models.account_tensors`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import attrs

from .gguf import GGUFFile
from .settings import GGUF_POOLING
from .tokenizer.vocab import FIM_KEYS


@attrs.frozen
class Harmless:
    """An unread key whose value, while `holds(value, file)`, changes nothing the engine computes; `what`
    says which values those are (for the refusal's message)."""

    holds: Callable[[Any, GGUFFile], bool]
    what: str


DESCRIPTIVE = Harmless(lambda value, file: True, "any value: it describes, computes nothing")


def _same(a: Any, b: Any) -> bool:
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def equal_to(*values: Any) -> Harmless:
    return Harmless(lambda value, file: any(_same(value, v) for v in values), " or ".join(map(repr, values)))


def _no_rope_scaling(value: Any, file: GGUFFile) -> bool:
    return file.metadata.get(f"{file.architecture}.rope.scaling.type", "none") == "none"


# Keys outside `<arch>.` that the engine reads, and where (tests/engine/test_accounting.py records the reads
# of the tokenizer, the chat renderer and the embedding pooling on real files and holds them to this table).
READ_KEYS: dict[str, str] = {
    "general.architecture": "the model family",
    "general.alignment": "the GGUF reader (tensor data alignment)",
    **{f"tokenizer.ggml.{k}": "the tokenizer" for k in (
        "model", "pre", "tokens", "token_type", "scores", "merges", "bos_token_id", "eos_token_id",
        "eot_token_id", "eom_token_id", "unknown_token_id", "add_bos_token", "add_eos_token", "add_space_prefix",
    )},
    **{key: "the tokenizer (fill-in-the-middle tokens)" for keys in FIM_KEYS.values() for key in keys},
    "tokenizer.chat_template": "the chat renderer",
    "general.name": "the tokenizer (a Phi-3 name drops the spaces after special tokens, as llama.cpp)",
}  # fmt: skip

# `<arch>.` keys read outside the config builder (the suffix after `<arch>.`), with the values their reader takes.
ARCH_KEYS_READ_ELSEWHERE: dict[str, Harmless] = {
    "pooling_type": Harmless(
        lambda value, file: any(_same(value, code) for code in GGUF_POOLING),
        f"the embedding pooling codes {sorted(GGUF_POOLING)}",
    ),
}

# Keys the engine does not read, with the values that leave its arithmetic unchanged.
HARMLESS_KEYS: dict[str, Harmless] = {
    "general.type": equal_to("model"),  # "adapter": a LoRA file, not a model
    "general.quantization_version": equal_to(2),  # the block layouts the dequantizers implement
    "tokenizer.ggml.padding_token_id": DESCRIPTIVE,  # no evaluation pads with it
    "tokenizer.ggml.add_sep_token": equal_to(False),
    "tokenizer.ggml.remove_extra_whitespaces": equal_to(False),
    "tokenizer.ggml.sep_token_id": DESCRIPTIVE,  # separators and masks of encoder models: no decoder uses them
    "tokenizer.ggml.cls_token_id": DESCRIPTIVE,
    "tokenizer.ggml.mask_token_id": DESCRIPTIVE,
    "tokenizer.huggingface.json": DESCRIPTIVE,  # the same tokenizer in Hugging Face's form; the ggml keys are read
    "split.count": equal_to(1),  # shards are not read
    "split.no": equal_to(0),
    "split.tensors.count": Harmless(
        lambda value, file: _same(value, len(file.tensors)), "the file's tensor count"
    ),
}
# By prefix, where the GGUF spec leaves a namespace open: the first matching prefix decides.
HARMLESS_PREFIXES: tuple[tuple[str, Harmless], ...] = (
    ("general.", DESCRIPTIVE),  # names, licences, provenance (the GGUF spec's general metadata)
    ("quantize.", DESCRIPTIVE),  # how the file was quantized (imatrix provenance)
    ("tokenizer.chat_template.", DESCRIPTIVE),  # named alternative templates: the default one is rendered
)
# `<arch>.` keys the config builder does not read (the suffix after `<arch>.`), harmless at these values.
HARMLESS_ARCH_KEYS: dict[str, Harmless] = {
    "expert_count": equal_to(0),
    "expert_used_count": equal_to(0),
    "rope.scaling.type": equal_to("none"),
    "rope.scaling.factor": equal_to(
        1.0, 0.0
    ),  # llama.cpp reads 0 as unset; any other factor scales positions
    "rope.scaling.attn_factor": equal_to(1.0),
    "rope.scaling.original_context_length": Harmless(
        _no_rope_scaling, "any value while rope.scaling.type is 'none'"
    ),
    "rope.scaling.finetuned": DESCRIPTIVE,
    "attention.causal": equal_to(True),
    "use_parallel_residual": equal_to(False),
}


def _shown(value: Any) -> str:
    text = repr(value)
    return (
        text
        if len(text) <= 60
        else f"<{type(value).__name__} of {len(value)}>"
        if hasattr(value, "__len__")
        else text[:60]
    )


def _harmless(key: str, arch: str) -> Harmless | None:
    if key.startswith(f"{arch}."):
        suffix = key[len(arch) + 1 :]
        return ARCH_KEYS_READ_ELSEWHERE.get(suffix) or HARMLESS_ARCH_KEYS.get(suffix)
    if key in HARMLESS_KEYS:
        return HARMLESS_KEYS[key]
    return next((rule for prefix, rule in HARMLESS_PREFIXES if key.startswith(prefix)), None)


def uncomputed_keys(file: GGUFFile, arch: str, read_by_builder: Iterable[str]) -> list[str]:
    """One problem per metadata key that nothing reads and whose value may change the computation."""
    read = set(read_by_builder) | set(READ_KEYS)
    problems = []
    for key, value in file.metadata.items():
        if key in read:
            continue
        rule = _harmless(key, arch)
        if rule is None:
            problems.append(f"metadata {key} = {_shown(value)}: strata-engine does not compute it")
        elif not rule.holds(value, file):
            problems.append(f"metadata {key} = {_shown(value)}: strata-engine computes only {rule.what}")
    return problems
