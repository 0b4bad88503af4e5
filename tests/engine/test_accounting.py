"""No silent ignore: every metadata key and tensor of a GGUF file is computed, provably harmless, or refused
with its name (a Llama 3 file's `rope_freqs.weight` loaded and rotated every position with the wrong
frequencies before). In memory on the real files' tables (metadata or tensors added), and through
`strata-engine serve` on real files written with one key or tensor added."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import gguf
import numpy as np
import pytest
from strata_engine.accounting import READ_KEYS
from strata_engine.chat import ChatTemplate
from strata_engine.config import ModelConfig
from strata_engine.embedding import model_pooling
from strata_engine.errors import ModelConfigError, UncomputedModelPart
from strata_engine.gguf import read_gguf
from strata_engine.gguf.reader import TensorInfo
from strata_engine.models import account_tensors
from strata_engine.tokenizer import Tokenizer
from support.gguf_variants import with_additions

from .engine_cli import run_cli

MODELS = ("smollm2", "gemma3")
FAMILY_FILES = ("llama3", "qwen2", "qwen3", "phi3", "phi3_longrope", "gemma2")  # support/families.py
ARCH = {"smollm2": "llama", "gemma3": "gemma3"}


def _with_metadata(file, **added):
    return attrs.evolve(file, metadata={**file.metadata, **added})


def _with_tensor(file, name: str, shape: tuple[int, ...]):
    info = TensorInfo(
        name=name,
        shape=shape,
        ggml_type=gguf.GGMLQuantizationType.F32,
        offset=0,
        n_bytes=4 * int(np.prod(shape)),
    )
    return attrs.evolve(file, tensors={**file.tensors, name: info})


def _refusal(file, refused: type[Exception] = UncomputedModelPart) -> str | None:
    """The refusal's message, or None when the file is accepted."""
    try:
        account_tensors(ModelConfig.from_gguf(file), file)
    except refused as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("name", MODELS)
def test_the_real_models_are_accounted_for(model_files, name):
    assert _refusal(model_files[name]) is None


# Keys that change the arithmetic where present (the suffix after `<arch>.`; "*" for either family).
COMPUTATION_KEYS = [
    ("*", "rope.scaling.type", "linear"),
    ("*", "rope.scaling.type", "yarn"),
    ("*", "rope.scaling.type", "llama3"),
    ("*", "rope.scaling.factor", 8.0),
    ("*", "rope.scaling.attn_factor", 0.5),
    ("*", "attn_logit_softcapping", 50.0),
    ("*", "final_logit_softcapping", 30.0),
    ("*", "expert_count", 8),
    ("*", "expert_used_count", 2),
    ("*", "attention.clamp_kqv", 8.0),
    ("*", "attention.causal", False),
    ("*", "use_parallel_residual", True),
    ("*", "attention.layer_norm_epsilon", 1e-5),
    ("*", "rope.dimension_sections", 4),
    ("*", "embedding_scale", 12.0),
    ("*", "no_such_key", 1),
    ("smollm2", "attention.sliding_window", 4096),  # llama computes no window
]
OTHER_KEYS = [
    ("general.type", "adapter"),
    ("general.quantization_version", 1),
    ("tokenizer.ggml.precompiled_charsmap", "x"),
    ("tokenizer.ggml.add_sep_token", True),
    ("split.count", 2),
    ("adapter.lora.alpha", 16.0),
    ("qwen2.attention.head_count", 4),  # another family's key
]


def _key_cases() -> Iterator[Any]:
    for name in MODELS:
        for model, suffix, value in COMPUTATION_KEYS:
            if model in ("*", name):
                yield pytest.param(name, f"{ARCH[name]}.{suffix}", value, id=f"{name}-{suffix}-{value}")
        for key, value in OTHER_KEYS:
            yield pytest.param(name, key, value, id=f"{name}-{key}")


@pytest.mark.parametrize(("name", "key", "value"), list(_key_cases()))
def test_a_key_that_changes_the_computation_is_refused_by_name(model_files, name, key, value):
    message = _refusal(_with_metadata(model_files[name], **{key: value}))
    assert message is not None and f"metadata {key} = {value!r}" in message


@pytest.mark.parametrize("name", MODELS)
def test_harmless_values_of_unread_keys_are_accepted(model_files, name):
    file = model_files[name]
    arch = file.architecture
    added = {
        f"{arch}.expert_count": 0,
        f"{arch}.expert_used_count": 0,
        f"{arch}.rope.scaling.type": "none",
        f"{arch}.rope.scaling.factor": 1.0,
        f"{arch}.rope.scaling.original_context_length": 8192,
        f"{arch}.attention.causal": True,
        "general.license": "anything",
        "general.type": "model",
        "quantize.imatrix.file": "imatrix.dat",
        "tokenizer.chat_template.tool_use": "{{ messages }}",
        "tokenizer.ggml.padding_token_id": 0,
        "split.count": 1,
        "split.no": 0,
        "split.tensors.count": len(file.tensors),
    }
    assert _refusal(_with_metadata(file, **added)) is None


def test_scaling_keys_are_harmless_only_without_a_scaling(model_files):
    file = _with_metadata(model_files["smollm2"], **{"llama.rope.scaling.original_context_length": 8192})
    assert _refusal(file) is None
    message = _refusal(_with_metadata(file, **{"llama.rope.scaling.type": "yarn"}))
    assert "llama.rope.scaling.original_context_length" in message and "llama.rope.scaling.type" in message


class _Opaque:
    """A value no rule accepts unless it accepts anything."""

    def __repr__(self) -> str:
        return "<opaque>"


class _Fields(dict):
    def __missing__(self, field: str) -> str:
        return "0"  # a numbered key's first (general.base_model.{id}.name, ...)


def _gguf_py_keys(arch: str) -> Iterator[str]:
    """Every metadata key gguf-py's `Keys` names, for this architecture."""
    for group in vars(gguf.Keys).values():
        for value in vars(group).values() if isinstance(group, type) else ():
            if isinstance(value, str) and "." in value:
                yield value.format_map(_Fields(arch=arch))


# The keys gguf-py names whose every value the engine accepts unread: reviewed here, one by one, so a rule
# that accepts a computing key cannot slip in unseen.
ACCEPTED_UNREAD = ("general.", "quantize.", "tokenizer.chat_template.", "tokenizer.ggml.padding_token_id",
                   "tokenizer.ggml.sep_token_id", "tokenizer.ggml.cls_token_id", "tokenizer.ggml.mask_token_id",
                   "tokenizer.huggingface.json", "{arch}.rope.scaling.finetuned",
                   "{arch}.rope.scaling.original_context_length")  # fmt: skip


@pytest.mark.parametrize("name", MODELS + FAMILY_FILES)
def test_every_key_gguf_py_knows_is_read_or_refused(model_files, family_files, name):
    """Each key the GGUF converters write, added with a value no rule accepts, is refused unless the engine
    reads it (its reader then refuses the value or uses it) or the key only describes (general.*, ...): for the
    real models and each family's tiny model (support/families.py)."""
    file = model_files[name] if name in MODELS else read_gguf(family_files(name, "f32"))
    arch = file.architecture
    reviewed = tuple(p.format(arch=arch) for p in ACCEPTED_UNREAD)
    kept = [
        key
        for key in sorted(set(_gguf_py_keys(arch)) - set(file.metadata) - set(READ_KEYS))
        if _refusal(_with_metadata(file, **{key: _Opaque()}), ModelConfigError) is None
    ]
    assert [key for key in kept if not key.startswith(reviewed)] == []
    assert (
        "general.author" in kept and "general.type" not in kept
    )  # the rules ran: descriptive kept, typed refused


# Tensors the families do not compute: Q/K/V biases and QK norms where the family has none, RoPE factors in
# gemma3, an expert router, and a layer past block_count (llama's `rope_freqs.weight` is computed: the llama3
# RoPE scaling, tests/engine/test_families.py).
EXTRA_TENSORS = {
    "smollm2": [("blk.0.attn_q.bias", (576,)), ("blk.0.attn_q_norm.weight", (64,)),
                ("blk.0.ffn_gate_inp.weight", (8, 576)), ("blk.30.attn_norm.weight", (576,))],
    "gemma3": [("rope_freqs.weight", (128,)), ("blk.0.attn_k.bias", (256,)), ("blk.0.ffn_gate_inp.weight", (8, 640)),
               ("blk.18.attn_norm.weight", (640,))],
}  # fmt: skip


def test_llama_rope_factors_of_the_wrong_length_are_refused_by_name(model_files):
    """A `rope_freqs.weight` is read (llama3 RoPE scaling) only at rope_dim / 2 values."""
    message = _refusal(_with_tensor(model_files["smollm2"], "rope_freqs.weight", (31,)), ModelConfigError)
    assert message is not None and "rope_freqs.weight has shape (31,), expected (32,)" in message


@pytest.mark.parametrize(
    ("name", "tensor", "shape"), [(n, t, s) for n, ts in EXTRA_TENSORS.items() for t, s in ts]
)
def test_a_tensor_the_family_does_not_compute_is_refused_by_name(model_files, name, tensor, shape):
    message = _refusal(_with_tensor(model_files[name], tensor, shape))
    assert message is not None and f"tensor {tensor!r}" in message


class _Recording(Mapping):
    def __init__(self, data: Mapping[str, Any]):
        self.data, self.read = data, set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return self.data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)


def test_the_keys_read_outside_the_config_are_the_table_s(metadata):
    """The tokenizer, the chat renderer and the embedding pooling read exactly the keys `READ_KEYS` declares
    (general.alignment: the GGUF reader, tested in test_gguf.py)."""
    read = set()
    for meta in metadata.values():
        recording = _Recording(meta)
        tokenizer = Tokenizer.from_gguf_metadata(recording)
        ChatTemplate.for_model(recording, tokenizer)
        model_pooling(recording, meta["general.architecture"])
        read |= recording.read
    pooling = {f"{meta['general.architecture']}.pooling_type" for meta in metadata.values()}
    assert read - pooling <= set(READ_KEYS)
    assert set(READ_KEYS) - {"general.alignment"} <= read


@pytest.mark.parametrize(
    ("name", "metadata", "tensors", "named"),
    [
        ("smollm2", {}, {"blk.0.attn_q.bias": np.ones(576, np.float32)}, "blk.0.attn_q.bias"),
        ("gemma3", {"gemma3.final_logit_softcapping": 30.0}, {}, "gemma3.final_logit_softcapping"),
    ],
    ids=["smollm2-q-bias", "gemma3-final-softcap"],
)
def test_serve_refuses_a_real_file_naming_what_it_would_not_compute(
    request, tmp_path, name, metadata, tensors, named
):
    src = request.getfixturevalue(f"{name}_path")
    path = with_additions(src, tmp_path / "changed.gguf", metadata=metadata, tensors=tensors)
    done = run_cli("serve", "--model", str(path))
    assert done.returncode == 3
    fatal = json.loads(done.stdout.splitlines()[-1])
    assert fatal["event"] == "fatal" and named in fatal["message"] and "does not compute" in fatal["message"]
