"""The families beyond the real models' (Llama 3.x with its llama3 RoPE scaling, Mistral-style `llama`, Qwen2.5,
Qwen3, Phi-3 with a sliding window, Phi-3.5 / Phi-4-mini's longrope, Gemma 2 with both soft-caps and its alternating
window) against transformers, on tiny random-weight models written to GGUF as llama.cpp's converter writes them
(support/families.py): f32, f16 and Q8_0 files, every CPU kernel set, and the K-quants (the wider model's Q4_K_M
mix of Q4_K, Q5_K and Q6_K) with the compiled kernels.

For each, strata-engine's logits at every position (every row of chunked prefill passes, through
`embedding.hidden_states`; and the last row of a prefill then decode steps, through the runner) are compared
with transformers' float32 forward on exactly the weights the file holds: max |d| <= EXACT_BOUND, and the
top-1 token equal wherever the reference's top-2 margin exceeds twice the bound. Only the GGUF writer is ours;
llama.cpp's reading of the same files, which proves that writer right independently, is
tests/crossengine/test_families_llamacpp.py.
Then: the llama3 RoPE factors and gemma2's soft-caps change the result beyond the bound (ignoring them would be
seen), a session
saved after a prompt restores in a fresh runner with the next logits equal bit for bit, and a tensor or key
a family does not compute is refused by name.
"""

from __future__ import annotations

import functools
from pathlib import Path

import attrs
import numpy as np
import pytest
import strata_sessionfile as sf
from strata_engine.config import ModelConfig, RopeStyle
from strata_engine.embedding import hidden_states
from strata_engine.errors import ModelConfigError, SettingsError, UncomputedModelPart
from strata_engine.gguf import read_gguf
from strata_engine.models import account_tensors, build_model
from strata_engine.ops import get_ops
from strata_engine.ops.numba_q8 import HAS_VNNI
from strata_engine.session import EngineSession
from strata_engine.settings import EngineSettings
from support.families import (
    ALL_FILE_TYPES,
    BOS,
    FAMILIES,
    FILE_TYPES,
    family_of,
    hf_model,
    llama3_rope_factors,
    reference_logits,
    reference_model,
)
from support.gguf_variants import with_additions

from .runners import load_runner, sibling

# |logit difference| against transformers' float32 forward (bench/engine/DECISIONS.md "The families' bounds"):
# float32 compute and K/V, sums in another order only.
EXACT_BOUND = 1e-4
# With the q8 products (numba-q8 where AVX512-VNNI runs them) activations are quantized to int8 per 32 values:
# the tiny phi3 files moved by 0.144 (0.127 with longrope), the other families by less than 0.1.
Q8_BOUND = 0.2
# The same on the K-quant files' WIDE model (E = 256: logits of twice the variance): phi3_longrope's Q4_K_M moved by
# 0.225, the others by 0.07-0.18 (float32 compute on the same files: 1e-5).
Q8_WIDE_BOUND = 0.35
# On the GPU with float32 compute and K/V (cuBLAS float32 accumulation, no TF32; the exact attention path).
GPU_F32_BOUND = 1e-3
# On the GPU with the default compute dtype (f16 for llama, bf16 for the others) and f16 K/V.
GPU_DEFAULT_BOUND = 0.25
KERNELS = ("numpy", "numba", "numba-q8")
# Every file type with every kernel set; the K-quants as Q4_K_M's mix (Q4_K, Q5_K and Q6_K tensors: each type's
# reading) with the compiled kernels, exact and q8.
FILES_AND_KERNELS = [(t, k) for t in FILE_TYPES for k in KERNELS] + [
    ("q4_k_m", "numba"),
    ("q4_k_m", "numba-q8"),
]
PROMPT = [BOS] + np.random.default_rng(40).integers(0, 256, 39).tolist()
PREFILL_CHUNK = 16  # chunked passes at depth: K/V written and attended across chunks


@pytest.fixture
def files(family_files):
    return family_files


@functools.cache
def _reference(path: Path, family: str, file_type: str = "f32") -> np.ndarray:
    return reference_logits(reference_model(family_of(family, file_type), path), PROMPT)


def _bound(kernels: str, file_type: str = "f32") -> float:
    if kernels == "numba-q8" and HAS_VNNI:
        return Q8_WIDE_BOUND if ALL_FILE_TYPES[file_type].wide else Q8_BOUND
    return EXACT_BOUND


def _check(got: np.ndarray, ref: np.ndarray, bound: float, what: str) -> None:
    worst = float(np.abs(got - ref).max())
    assert worst <= bound, f"{what}: max |d| {worst:.2e} > {bound:.0e}"
    top2 = np.sort(ref, axis=-1)[..., -2:]
    decided = (top2[..., 1] - top2[..., 0]) > 2 * bound
    assert decided.any(), f"{what}: no position's top-1 is decided (the model is too flat to test)"
    assert (np.argmax(got, -1) == np.argmax(ref, -1))[decided].all(), f"{what}: top-1 differs"


@pytest.mark.parametrize(
    ("file_type", "kernels"), FILES_AND_KERNELS, ids=[f"{t}-{k}" for t, k in FILES_AND_KERNELS]
)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_at_every_position_match_transformers(files, family, file_type, kernels):
    path = files(family, file_type)
    ref = _reference(path, family, file_type)
    runner = load_runner(EngineSettings(model_path=path, n_ctx=128, cpu_kernels=kernels, kv_type="f32"))
    model = runner.model
    every_row = model.logits(hidden_states(model, PROMPT, PREFILL_CHUNK))
    _check(every_row, ref, _bound(kernels, file_type), "chunked prefill, every row")
    split = 24
    steps = [runner.prefill(PROMPT[:split]).logits] + [runner.decode(t) for t in PROMPT[split:]]
    _check(
        np.stack(steps), ref[split - 1 :], _bound(kernels, file_type), "prefill's last row, then decode steps"
    )


def test_llama3_rope_factors_are_computed(files):
    """The file's rope_freqs.weight is the converter's llama3 factors, the config holds them, and the same
    weights rotated without them leave transformers by far more than the bound."""
    path = files("llama3", "f32")
    config = ModelConfig.from_gguf(read_gguf(path))
    factors = llama3_rope_factors(hf_model(FAMILIES["llama3"]).config)
    assert config.rope_factors == tuple(factors.tolist()) and len(set(factors.tolist())) > 2  # all 3 regimes
    assert config.rope_fingerprint()[0]["factors"] == factors.tolist()
    unscaled = build_model(attrs.evolve(config, rope_factors=None), get_ops(), read_gguf(path))
    logits = unscaled.logits(hidden_states(unscaled, PROMPT, PREFILL_CHUNK))
    assert np.abs(logits - _reference(path, "llama3")).max() > 100 * EXACT_BOUND


@pytest.mark.parametrize("cap", ["attn_softcap", "final_softcap"])
def test_gemma2_soft_caps_are_computed(files, cap):
    """The file's caps are the config's, and the same weights without either cap leave transformers by far more
    than the bound (the test model's scores and logits are a few units: both caps bite)."""
    path = files("gemma2", "f32")
    config = ModelConfig.from_gguf(read_gguf(path))
    hf = hf_model(FAMILIES["gemma2"]).config
    assert (config.attn_softcap, config.final_softcap) == (
        hf.attn_logit_softcapping,
        hf.final_logit_softcapping,
    )
    uncapped = build_model(attrs.evolve(config, **{cap: 0.0}), get_ops(), read_gguf(path))
    logits = uncapped.logits(hidden_states(uncapped, PROMPT, PREFILL_CHUNK))
    assert np.abs(logits - _reference(path, "gemma2")).max() > 100 * EXACT_BOUND


def test_gemma2_config_fills_in_what_llama_cpp_does(files):
    """Without the caps' and the window's keys: llama.cpp's defaults (50, 30, 4096); 46 layers (the 27B): the
    attention scale 1/sqrt(E / H) instead of 1/sqrt(head_dim); a cap of 0 (llama.cpp would divide by it) refused."""
    file = read_gguf(files("gemma2", "f32"))
    keys = (
        "gemma2.attn_logit_softcapping",
        "gemma2.final_logit_softcapping",
        "gemma2.attention.sliding_window",
    )
    bare = attrs.evolve(file, metadata={k: v for k, v in file.metadata.items() if k not in keys})
    config = ModelConfig.from_gguf(bare)
    assert (config.attn_softcap, config.final_softcap) == (50.0, 30.0)
    assert [lc.window for lc in config.layers] == [4096, None]
    assert config.attn_scale == 1 / 8  # head_dim 64
    big = ModelConfig.from_gguf(attrs.evolve(file, metadata={**file.metadata, "gemma2.block_count": 46}))
    assert big.attn_scale == pytest.approx(1 / np.sqrt(128 / 4))
    assert [lc.window for lc in big.layers[:4]] == [16, None, 16, None]
    with pytest.raises(ModelConfigError, match="gemma2.attn_logit_softcapping must be positive"):
        ModelConfig.from_gguf(attrs.evolve(file, metadata={**file.metadata, keys[0]: 0.0}))


def test_phi3_longrope_factors_follow_the_context(files):
    """The long factors where the context exceeds the original one (llama.cpp's choice; transformers' for a
    sequence that long), the short ones within it; cos / sin times the file's attention factor either way; a
    sibling across the original context is refused (its rotation would differ from the loaded model's)."""
    path = files("phi3_longrope", "f32")
    config = ModelConfig.from_gguf(read_gguf(path))
    params = hf_model(FAMILIES["phi3_longrope"]).config.rope_parameters
    assert config.long_rope is not None and config.long_rope.original_context == 32
    long, short = config.for_context(128), config.for_context(32)
    assert long.rope_factors == tuple(np.float32(params["long_factor"]).tolist())
    assert short.rope_factors == tuple(np.float32(params["short_factor"]).tolist())
    assert long.rope_scale == short.rope_scale == pytest.approx(np.sqrt(1 + np.log(8) / np.log(32)))
    runner = load_runner(EngineSettings(model_path=path, n_ctx=128, cpu_kernels="numpy"))
    assert runner.config == long
    with pytest.raises(SettingsError, match="longrope"):
        sibling(runner, n_ctx=32)


def test_configs_name_each_family_s_facts(files):
    configs = {name: ModelConfig.from_gguf(read_gguf(files(name, "f32"))) for name in FAMILIES}
    facts = {
        name: (c.architecture, c.rope_style, c.qkv_bias, c.qk_norm, c.n_head, c.n_head_kv, c.head_dim, c.tied_output)
        for name, c in configs.items()
    }  # fmt: skip
    assert facts == {
        "llama3": ("llama", RopeStyle.INTERLEAVED, False, False, 4, 2, 32, False),
        "mistral": ("llama", RopeStyle.INTERLEAVED, False, False, 4, 2, 32, True),
        "qwen2": ("qwen2", RopeStyle.NEOX, True, False, 4, 2, 32, False),
        "qwen3": ("qwen3", RopeStyle.NEOX, False, True, 4, 2, 64, False),
        "phi3": ("phi3", RopeStyle.NEOX, False, False, 4, 2, 32, False),
        "phi3_longrope": ("phi3", RopeStyle.NEOX, False, False, 4, 2, 32, False),
        "gemma2": ("gemma2", RopeStyle.NEOX, False, False, 4, 2, 64, True),
    }
    assert {lc.window for lc in configs["phi3"].layers} == {16}
    assert [lc.window for lc in configs["gemma2"].layers] == [16, None]  # local, global
    assert (configs["gemma2"].attn_softcap, configs["gemma2"].final_softcap) == (2.0, 5.0)
    assert all(
        (c.attn_softcap, c.final_softcap) == (0.0, 0.0) for name, c in configs.items() if name != "gemma2"
    )
    assert all(
        lc.window is None
        for name in ("llama3", "mistral", "qwen2", "qwen3", "phi3_longrope")
        for lc in configs[name].layers
    )
    assert (
        configs["mistral"].rope_factors is None and "factors" not in configs["mistral"].rope_fingerprint()[0]
    )


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("compute", ["f32", "default"])
def test_gpu_logits_match_transformers(files, family, compute):
    """On the device (CuPy, CUDA graphs for the decode steps): a prefill's last row, then decode steps."""
    path = files(family, "q8_0")
    ref = _reference(path, family)
    exact = compute == "f32"
    runner = load_runner(
        EngineSettings(model_path=path, n_ctx=128, backend="cupy", compute_dtype="f32" if exact else None,
                       kv_type="f32" if exact else "f16")
    )  # fmt: skip
    split = 24
    steps = [runner.prefill(PROMPT[:split]).logits] + [runner.decode(t) for t in PROMPT[split:]]
    _check(
        np.stack(steps), ref[split - 1 :], GPU_F32_BOUND if exact else GPU_DEFAULT_BOUND, f"cupy {compute}"
    )


@pytest.mark.parametrize("backend", ["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_session_restores_in_a_fresh_runner_with_the_next_logits_bit_equal(
    files, tmp_path, family, backend
):
    """Default kernels and K/V storage on the Q8_0 file: save after a prompt, restore into a runner loaded
    anew, and the next token's logits (and the one after) equal the runner's that never stopped."""
    settings = EngineSettings(model_path=files(family, "q8_0"), n_ctx=128, backend=backend)
    source = load_runner(settings)
    source.prefill(PROMPT)
    sf.save(tmp_path / "s.ssf", EngineSession(source))
    fresh = load_runner(settings)
    sf.restore(tmp_path / "s.ssf", EngineSession(fresh))
    assert fresh.n_held == len(PROMPT)
    for token in (7, 300):
        assert fresh.decode(token).tobytes() == source.decode(token).tobytes()


# What a family does not compute, added to its tiny file: refused, naming it.
REFUSED = [
    ("qwen2", {}, {"blk.0.attn_q_norm.weight": (32,)}, "blk.0.attn_q_norm.weight"),
    ("qwen3", {}, {"blk.1.attn_k.bias": (64,)}, "blk.1.attn_k.bias"),
    ("qwen3", {}, {"rope_freqs.weight": (32,)}, "rope_freqs.weight"),
    ("mistral", {}, {"blk.0.attn_v.bias": (64,)}, "blk.0.attn_v.bias"),
    ("qwen2", {"qwen2.rope.scaling.type": "yarn"}, {}, "qwen2.rope.scaling.type"),
    ("qwen3", {"qwen3.attention.sliding_window": 16}, {}, "qwen3.attention.sliding_window"),
    ("llama3", {"llama.rope.scaling.type": "linear"}, {}, "llama.rope.scaling.type"),
    ("qwen2", {}, {"rope_factors_long.weight": (16,)}, "rope_factors_long.weight"),
    ("phi3", {"phi3.rope.scaling.attn_factor": 1.19}, {}, "phi3.rope.scaling.attn_factor"),
    ("phi3", {}, {"blk.0.attn_q.weight": (128, 128)}, "blk.0.attn_q.weight"),
    ("gemma2", {}, {"blk.0.attn_q_norm.weight": (64,)}, "blk.0.attn_q_norm.weight"),
    ("gemma2", {}, {"rope_freqs.weight": (32,)}, "rope_freqs.weight"),
    ("gemma2", {}, {"output.weight": (512, 128)}, "output.weight"),
    ("gemma2", {"gemma2.rope.scaling.type": "linear"}, {}, "gemma2.rope.scaling.type"),
    ("gemma2", {"gemma2.expert_count": 4}, {}, "gemma2.expert_count"),
    ("llama3", {"llama.final_logit_softcapping": 30.0}, {}, "llama.final_logit_softcapping"),
    ("qwen2", {"qwen2.attn_logit_softcapping": 50.0}, {}, "qwen2.attn_logit_softcapping"),
]


@pytest.mark.parametrize(("family", "metadata", "tensors", "named"), REFUSED, ids=[r[3] for r in REFUSED])
def test_what_a_family_does_not_compute_is_refused_by_name(files, tmp_path, family, metadata, tensors, named):
    arrays = {name: np.ones(shape, np.float32) for name, shape in tensors.items()}
    path = with_additions(files(family, "f32"), tmp_path / "changed.gguf", metadata=metadata, tensors=arrays)
    file = read_gguf(path)
    with pytest.raises(UncomputedModelPart) as refusal:
        account_tensors(ModelConfig.from_gguf(file), file)
    assert named in str(refusal.value)
