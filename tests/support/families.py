"""Tiny random-weight models of each family, built from transformers' own config and model classes and
written to GGUF with the `gguf` package as llama.cpp's convert_hf_to_gguf.py writes them (its metadata keys,
the Q/K row permutation of `llama`, the llama3 `rope_freqs.weight`), in f32, f16 or Q8_0; and transformers'
float32 logits on exactly the weights a file holds (read back from it and dequantized by `gguf`).

No model is downloaded: the weights are random (seeded), every feature of the family switched on (llama3 RoPE
scaling and Phi-3's longrope with an original context shorter than the test prompts, GQA, Q/K/V biases,
per-head QK norms, sliding windows, Gemma 2's soft-caps, untied output where the family allows it).

The K-quant files (Q4_K, Q6_K, and Q4_K_M's mix as llama-quantize chooses it) are encoded by kquants.py (gguf-py
does not quantize K-quants), of a wider model of the family (WIDE: every matrix row a whole number of 256-value
super-blocks, where the f32 / f16 / Q8_0 files' E = 128 rows are not).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import gguf
import numpy as np

from support.kquants import quantize

T = gguf.GGMLQuantizationType


@attrs.frozen
class FileType:
    """How a file stores its matrices (1-D tensors stay f32): `matrix` for each, or with `mixed` llama-quantize's
    Q4_K_M choice (`mixed_type`); `wide`: the family's WIDE model (K-quants' 256-value rows)."""

    ftype: gguf.LlamaFileType
    matrix: gguf.GGMLQuantizationType
    wide: bool = False
    mixed: bool = False


# convert_hf_to_gguf.py's --outtype f32 / f16 / q8_0.
FILE_TYPES: dict[str, FileType] = {
    "f32": FileType(gguf.LlamaFileType.ALL_F32, T.F32),
    "f16": FileType(gguf.LlamaFileType.MOSTLY_F16, T.F16),
    "q8_0": FileType(gguf.LlamaFileType.MOSTLY_Q8_0, T.Q8_0),
}
# llama-quantize's --pure Q4_K / Q6_K and its Q4_K_M (kquants.py encodes them).
K_FILE_TYPES: dict[str, FileType] = {
    "q4_k": FileType(gguf.LlamaFileType.MOSTLY_Q4_K_S, T.Q4_K, wide=True),
    "q6_k": FileType(gguf.LlamaFileType.MOSTLY_Q6_K, T.Q6_K, wide=True),
    "q4_k_m": FileType(gguf.LlamaFileType.MOSTLY_Q4_K_M, T.Q4_K, wide=True, mixed=True),
}
ALL_FILE_TYPES = {**FILE_TYPES, **K_FILE_TYPES}
# The K-quant files' model: E = 256 (and H * D, the FFN) so every row is whole super-blocks; head_dim as in _COMMON.
WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4)
N_VOCAB = 512
BOS, EOS = 256, 257  # after the 256 byte tokens
# Weights' spread: transformers' default (0.02) leaves logits nearly flat, so no top-1 would be decided.
INIT_STD = 0.08


@attrs.frozen
class Family:
    """One family's tiny model: its GGUF architecture, transformers' config and model classes, the config's
    arguments, and how llama.cpp's converter names (and permutes) its tensors."""

    arch: str
    config_class: str
    model_class: str
    config: dict[str, Any]
    permute_qk: bool  # `llama`: Q/K rows permuted for interleaved RoPE (LlamaModel.permute)
    rope_factors: bool = False  # llama3 RoPE scaling: rope_freqs.weight
    keys: Callable[[gguf.GGUFWriter, Any], None] = lambda w, c: _text_model_keys(w, c)  # the converter's
    layer_tensors: dict[str, str] = attrs.field(factory=dict)  # the family's own names over LAYER_TENSORS'
    # added to every norm weight by the converter (gemma: transformers multiplies by 1 + weight)
    norm_offset: float = 0.0

    def gguf_layer_tensor(self, hf_rest: str) -> str:
        return self.layer_tensors.get(hf_rest) or LAYER_TENSORS[hf_rest]


_COMMON = dict(
    vocab_size=N_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
)  # fmt: skip
FAMILIES: dict[str, Family] = {
    # Llama 3.x: llama3 RoPE scaling (original context 32: every regime of the factors at test positions).
    "llama3": Family(
        "llama", "LlamaConfig", "LlamaForCausalLM",
        dict(_COMMON, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 32}),
        permute_qk=True, rope_factors=True, keys=lambda w, c: _llama_keys(w, c),
    ),
    # Mistral-style: plain RoPE, GQA, tied output.
    "mistral": Family(
        "llama", "LlamaConfig", "LlamaForCausalLM",
        dict(_COMMON, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        permute_qk=True, keys=lambda w, c: _llama_keys(w, c),
    ),
    "qwen2": Family(
        "qwen2", "Qwen2Config", "Qwen2ForCausalLM",
        dict(_COMMON, rope_parameters={"rope_type": "default", "rope_theta": 1e6}), permute_qk=False,
    ),
    # head_dim 64: H * D (256) is not E (128), as in Qwen3's released sizes.
    "qwen3": Family(
        "qwen3", "Qwen3Config", "Qwen3ForCausalLM",
        dict(_COMMON, head_dim=64, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        permute_qk=False,
    ),
    # Phi-3: fused QKV and gate-up tensors, a sliding window shorter than the test prompts on every layer.
    "phi3": Family(
        "phi3", "Phi3Config", "Phi3ForCausalLM",
        dict(_COMMON, sliding_window=16, pad_token_id=0, bos_token_id=BOS, eos_token_id=EOS,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        permute_qk=False, keys=lambda w, c: _phi3_keys(w, c),
    ),
    # Phi-3.5 / Phi-4-mini: longrope (an original context shorter than the test prompts: the long factors), no
    # window (written as 0).
    "phi3_longrope": Family(
        "phi3", "Phi3Config", "Phi3ForCausalLM",
        dict(_COMMON, pad_token_id=0, bos_token_id=BOS, eos_token_id=EOS, original_max_position_embeddings=32,
             rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
                              "short_factor": np.linspace(1.0, 1.5, 16).tolist(),
                              "long_factor": np.linspace(1.0, 6.0, 16).tolist()}),
        permute_qk=False, keys=lambda w, c: _phi3_keys(w, c),
    ),
    # Gemma 2: both soft-caps low enough to bite (scores and logits of a few units), a sliding window shorter than
    # the test prompts on the even layers, head_dim 64 (H * D is not E; a head size the GPU's flash kernel
    # takes), query_pre_attn_scalar = head_dim (llama.cpp's scale for every size but the 27B), tied output.
    "gemma2": Family(
        "gemma2", "Gemma2Config", "Gemma2ForCausalLM",
        dict(_COMMON, head_dim=64, tie_word_embeddings=True, sliding_window=16, query_pre_attn_scalar=64,
             attn_logit_softcapping=2.0, final_logit_softcapping=5.0, pad_token_id=0, bos_token_id=BOS,
             eos_token_id=EOS, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        permute_qk=False, keys=lambda w, c: _gemma2_keys(w, c), norm_offset=1.0,
        layer_tensors={"post_attention_layernorm.weight": "post_attention_norm.weight",
                       "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                       "post_feedforward_layernorm.weight": "post_ffw_norm.weight"},
    ),
}  # fmt: skip
# Families the engine's own tests cover with the real model (tests/engine: gemma3), tiny here for the cross-engine
# cache tests (tests/crossengine/test_transformers_cache.py): not in FAMILIES, whose tests they would lengthen.
MORE_FAMILIES: dict[str, Family] = {
    # Gemma 3: six layers (five sliding, the sixth global: the GGUF leaves the pattern to the engine), a window
    # of 8, per-head QK norms, post norms, tied output; norm weights written +1 as the converter does.
    "gemma3": Family(
        "gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM",
        dict(_COMMON, num_hidden_layers=6, head_dim=32, sliding_window=8, query_pre_attn_scalar=256,
             tie_word_embeddings=True, pad_token_id=0, bos_token_id=BOS, eos_token_id=EOS),
        permute_qk=False, keys=lambda w, c: _gemma3_keys(w, c), norm_offset=1.0,
        layer_tensors={"post_attention_layernorm.weight": "post_attention_norm.weight",
                       "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                       "post_feedforward_layernorm.weight": "post_ffw_norm.weight"},
    ),
}  # fmt: skip
ALL_FAMILIES = {**FAMILIES, **MORE_FAMILIES}

# transformers' per-layer tensor names -> llama.cpp's (gguf's TensorNameMap, as the converter maps them)
LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight",
}  # fmt: skip
TOP_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}  # fmt: skip


def family_of(name: str, file_type: str) -> Family:
    """The family's tiny model as a file of `file_type` holds it (the WIDE one for the K-quants)."""
    family = ALL_FAMILIES[name]
    return (
        attrs.evolve(family, config=dict(family.config, **WIDE)) if ALL_FILE_TYPES[file_type].wide else family
    )


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v / ffn_down Q4_K_M keeps in Q6_K."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def mixed_type(name: str, n_layer: int, tied: bool) -> gguf.GGMLQuantizationType:
    """llama_tensor_get_type's choice for Q4_K_M: the output (token_embd where it is tied) and half the layers'
    V and down projections in Q6_K, a fused QKV in Q5_K, the rest Q4_K."""
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return T.Q6_K
    if name.endswith("attn_qkv.weight"):
        return T.Q5_K
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        return T.Q6_K if use_more_bits(int(name.split(".")[1]), n_layer) else T.Q4_K
    return T.Q4_K


def hf_model(family: Family, seed: int = 0) -> Any:
    """transformers' model of the family with random weights: matrices N(0, INIT_STD), norm weights near 1,
    biases random (transformers initializes them to zero, which would test nothing)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = getattr(transformers, family.config_class)(**family.config, attn_implementation="eager")
    model = getattr(transformers, family.model_class)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # a multiplier near 1 (gemma's is 1 + weight)
                p.copy_(1.0 - family.norm_offset + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(INIT_STD * torch.randn_like(p))
    return model


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (its n_head_kv folded in: the caller passes the heads)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(config: Any) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: the divisor of each RoPE frequency (old_context_len taken from the
    RoPE parameters, where Llama 3.x's config.json keeps it; the converter's default, 8192, is the same value
    for the released models)."""
    p = config.rope_parameters
    dim = config.head_dim or config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (p["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old = p["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def _tokenizer(w: gguf.GGUFWriter) -> None:
    """A byte-level BPE vocabulary the engine's tokenizer loads: the 256 byte tokens (GPT-2's printable
    characters), BOS / EOS, padding."""
    from strata_engine.tokenizer.unicode import bytes_to_unicode

    chars = bytes_to_unicode()
    tokens = list(chars) + ["<|bos|>", "<|eos|>"]
    tokens += [f"[PAD{i}]" for i in range(len(tokens), N_VOCAB)]
    types = [gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * 2
    types += [gguf.TokenType.UNUSED] * (N_VOCAB - len(types))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{chars[32]} {chars[116]}"])  # " t"
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_add_bos_token(True)


def _shape_keys(w: gguf.GGUFWriter, c: Any) -> None:
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)


def _text_model_keys(w: gguf.GGUFWriter, c: Any) -> None:
    """TextModel.set_gguf_parameters (llama3's RoPE type writes no scaling key: its factors are a tensor)."""
    _shape_keys(w, c)
    if getattr(c, "head_dim", None) is not None:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)


def _llama_keys(w: gguf.GGUFWriter, c: Any) -> None:
    """LlamaModel.set_gguf_parameters: TextModel's, the vocabulary size and the RoPE dimensions."""
    _text_model_keys(w, c)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.head_dim or c.hidden_size // c.num_attention_heads)


def _phi3_keys(w: gguf.GGUFWriter, c: Any) -> None:
    """Phi3MiniModel.set_gguf_parameters (its own: no key length; the window 0 where the config has none), and
    with longrope factors generate_extra_tensors' attention factor."""
    _shape_keys(w, c)
    original = c.rope_parameters.get("original_max_position_embeddings", c.original_max_position_embeddings)
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_sliding_window(c.sliding_window or 0)
    if c.rope_parameters.get("long_factor"):
        scale = c.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        )


def _gemma_keys(w: gguf.GGUFWriter, c: Any) -> None:
    """What Gemma2Model and Gemma3Model.set_gguf_parameters share: the shapes, the head size, the window."""
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_sliding_window(c.sliding_window)


def _gemma3_keys(w: gguf.GGUFWriter, c: Any) -> None:
    """Gemma3Model.set_gguf_parameters: gemma's, and the global layers' RoPE base."""
    _gemma_keys(w, c)
    w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])


def _gemma2_keys(w: gguf.GGUFWriter, c: Any) -> None:
    """Gemma2Model.set_gguf_parameters: gemma's, no RoPE base (llama.cpp's default, 10000), both soft-caps."""
    _gemma_keys(w, c)
    w.add_attn_logit_softcapping(c.attn_logit_softcapping)
    w.add_final_logit_softcapping(c.final_logit_softcapping)


def write_gguf(model: Any, family: Family, path: Path, file_type: str) -> Path:
    """The model as convert_hf_to_gguf.py --outtype `file_type` writes it."""
    ft, c = ALL_FILE_TYPES[file_type], model.config
    w = gguf.GGUFWriter(str(path), family.arch)
    family.keys(w, c)
    w.add_file_type(ft.ftype)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _tokenizer(w)
    for name, tensor in _gguf_tensors(model, family).items():
        data = tensor.astype(np.float32)
        kind = mixed_type(name, c.num_hidden_layers, c.tie_word_embeddings) if ft.mixed else ft.matrix
        kind = kind if data.ndim == 2 else T.F32  # a row that is not whole blocks raises (quantize)
        w.add_tensor(name, quantize(data, kind) if kind != T.F32 else data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gguf_tensors(model: Any, family: Family) -> dict[str, np.ndarray]:
    c = model.config
    out = {}
    for hf_name, p in model.state_dict().items():
        data = p.detach().numpy()
        if hf_name.endswith("norm.weight"):
            data = data + np.float32(family.norm_offset)
        if hf_name in TOP_TENSORS:
            if hf_name == "lm_head.weight" and c.tie_word_embeddings:
                continue
            out[TOP_TENSORS[hf_name]] = data
            continue
        _, _, i, rest = hf_name.split(".", 3)
        if family.permute_qk and rest == "self_attn.q_proj.weight":
            data = permute(data, c.num_attention_heads)
        elif family.permute_qk and rest == "self_attn.k_proj.weight":
            data = permute(data, c.num_key_value_heads)
        out[f"blk.{i}.{family.gguf_layer_tensor(rest)}"] = data
    if family.rope_factors:
        out["rope_freqs.weight"] = llama3_rope_factors(c)
    if long := c.rope_parameters.get("long_factor"):  # Phi3MiniModel.generate_extra_tensors
        out["rope_factors_long.weight"] = np.asarray(long, dtype=np.float32)
        out["rope_factors_short.weight"] = np.asarray(c.rope_parameters["short_factor"], dtype=np.float32)
    return out


def file_weights(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF file as float32 in numpy order, dequantized by gguf-py."""
    reader = gguf.GGUFReader(path)
    return {
        t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        for t in reader.tensors
    }


def reference_model(family: Family, path: Path) -> Any:
    """transformers' float32 model holding exactly the weights of the GGUF file (Q/K rows un-permuted)."""
    import torch

    model = hf_model(family)
    weights = file_weights(path)
    c = model.config
    state = {}
    for hf_name in model.state_dict():
        if hf_name in TOP_TENSORS:
            name = TOP_TENSORS[hf_name]
            if hf_name == "lm_head.weight" and c.tie_word_embeddings:
                name = "token_embd.weight"
            state[hf_name] = weights[name]
            continue
        _, _, i, rest = hf_name.split(".", 3)
        data = weights[f"blk.{i}.{family.gguf_layer_tensor(rest)}"]
        if family.permute_qk and rest == "self_attn.q_proj.weight":
            data = unpermute(data, c.num_attention_heads)
        elif family.permute_qk and rest == "self_attn.k_proj.weight":
            data = unpermute(data, c.num_key_value_heads)
        state[hf_name] = data
    state = {
        k: v - np.float32(family.norm_offset) if k.endswith("norm.weight") else v for k, v in state.items()
    }
    model.load_state_dict({k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in state.items()})
    return model


def reference_logits(model: Any, tokens: list[int]) -> np.ndarray:
    """transformers' float32 logits [T, V] at every position of `tokens`."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


FamilyFiles = Callable[[str, str], Path]
