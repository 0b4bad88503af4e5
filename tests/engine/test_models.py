"""ModelConfig from the real GGUFs (the facts DESIGN.md lists) and clear errors for what is unsupported."""

from __future__ import annotations

import math
import os

import attrs
import gguf
import numpy as np
import pytest
from strata_engine.config import Activation, ModelConfig, RopeStyle
from strata_engine.errors import (
    MissingTensor,
    ModelConfigError,
    SettingsError,
    TensorShapeMismatch,
    UnsupportedArchitecture,
)
from strata_engine.gguf import read_gguf
from strata_engine.ops import resolve_settings
from strata_engine.runner import ModelRunner
from strata_engine.settings import Backend, ComputeDType, EngineSettings

from .runners import load_runner, sibling

# |logit difference| between the numba and numpy CPU kernels per K/V type: f32 sums in another order
# (measured up to 7e-5); with f16 K/V, values near a rounding boundary round to neighbouring f16s
# (measured up to 8e-3).
KERNEL_LOGIT_BOUND = {"f32": 1e-3, "f16": 2.5e-2}


def test_smollm2_config(smollm2_path):
    c = ModelConfig.from_gguf(read_gguf(smollm2_path))
    assert (c.architecture, c.n_layer, c.n_embd, c.n_ff, c.n_head, c.n_head_kv, c.head_dim) == (
        "llama",
        30,
        576,
        1536,
        9,
        3,
        64,
    )
    assert (c.n_ctx_train, c.n_vocab) == (8192, 49152)
    assert c.rope_style is RopeStyle.INTERLEAVED and c.activation is Activation.SILU
    assert all(layer.rope_base == 100000.0 and layer.window is None for layer in c.layers)
    assert c.rms_eps == pytest.approx(1e-5) and c.tied_output and not c.has_sliding_window
    assert c.attn_scale == pytest.approx(1 / 8) and c.embed_scale == 1.0


def test_gemma3_config(gemma3_path):
    c = ModelConfig.from_gguf(read_gguf(gemma3_path))
    assert (c.architecture, c.n_layer, c.n_embd, c.n_ff, c.n_head, c.n_head_kv, c.head_dim) == (
        "gemma3",
        18,
        640,
        2048,
        4,
        1,
        256,
    )
    assert (c.n_ctx_train, c.n_vocab) == (32768, 262144)
    assert c.rope_style is RopeStyle.NEOX and c.activation is Activation.GELU_TANH
    for il, layer in enumerate(c.layers):
        if il % 6 == 5:
            assert (layer.rope_base, layer.window) == (1e6, None)
        else:
            assert (layer.rope_base, layer.window) == (10000.0, 512)
    assert c.attn_scale == pytest.approx(1 / 16) and c.embed_scale == pytest.approx(math.sqrt(640))
    assert c.qk_norm and c.post_norms and c.tied_output and c.rms_eps == pytest.approx(1e-6)
    assert len(c.rope_fingerprint()) == 18


def _tiny_gguf(path, arch, kv=None, tensors=()):
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (kv or {}).items():
        w.add_uint32(key, value)
    for name, shape in tensors:
        w.add_tensor(name, np.zeros(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture_is_named(tmp_path):
    path = _tiny_gguf(tmp_path / "m.gguf", "mamba")
    with pytest.raises(UnsupportedArchitecture, match="'mamba'"):
        ModelConfig.from_gguf(read_gguf(path))


def test_config_problems_are_reported_together(tmp_path):
    path = _tiny_gguf(
        tmp_path / "m.gguf", "llama", {"llama.attention.head_count": 6, "llama.attention.head_count_kv": 4}
    )
    with pytest.raises(ModelConfigError) as exc:
        ModelConfig.from_gguf(read_gguf(path))
    text = "; ".join(exc.value.problems)
    for expected in ("embedding_length is missing", "block_count is missing", "not a multiple", "token_embd"):
        assert expected in text


TINY_LLAMA = {
    "llama.embedding_length": 8,
    "llama.feed_forward_length": 16,
    "llama.block_count": 1,
    "llama.attention.head_count": 2,
    "llama.context_length": 64,
}


def test_missing_tensor_is_named(tmp_path):
    path = _tiny_gguf(
        tmp_path / "m.gguf",
        "llama",
        TINY_LLAMA,
        [("token_embd.weight", (10, 8)), ("output_norm.weight", (8,))],
    )
    with pytest.raises(MissingTensor, match="blk.0.attn_norm.weight"):
        load_runner(EngineSettings(model_path=path))


def test_tensor_of_the_wrong_shape_is_not_called_missing(tmp_path):
    path = _tiny_gguf(
        tmp_path / "m.gguf",
        "llama",
        TINY_LLAMA,
        [("token_embd.weight", (10, 8)), ("output_norm.weight", (7,))],
    )
    with pytest.raises(TensorShapeMismatch, match=r"'output_norm.weight' has shape \(7,\), expected \(8,\)"):
        load_runner(EngineSettings(model_path=path))


def test_settings_problems_are_collected():
    with pytest.raises(SettingsError) as exc:
        EngineSettings(model_path="x", kv_type="q4", prefill_chunk=0, n_ctx=-1, cpu_kernels="c", threads=0)
    assert len(exc.value.problems) == 5
    with pytest.raises(SettingsError, match="cpu_kernels 'numba' computes in f32"):
        EngineSettings(model_path="x", cpu_kernels="numba", compute_dtype="f64")
    with pytest.raises(SettingsError, match="kv_type: 'q4'"):
        attrs.evolve(EngineSettings(model_path="x"), kv_type="q4")  # checked however they are built
    assert resolve_settings(EngineSettings(model_path="x", kv_type="int8"), "llama").cpu_kernels == "numba-q8"


def test_backend_defaults_fill_only_what_was_not_given():
    numpy_defaults = resolve_settings(EngineSettings(model_path="x"), "gemma3")
    assert (numpy_defaults.compute_dtype, numpy_defaults.prefill_chunk, numpy_defaults.cpu_kernels) == (
        "f32", 512, "numba-q8",
    )  # fmt: skip
    assert numpy_defaults.threads == len(os.sched_getaffinity(0))
    given = resolve_settings(
        EngineSettings(model_path="x", compute_dtype="f64", prefill_chunk=7, threads=1), "llama"
    )
    assert (given.compute_dtype, given.prefill_chunk, given.cpu_kernels, given.threads) == (
        "f64",
        7,
        "numpy",
        1,
    )
    # what a cupy runner fills in (resolving "cupy" needs no device): f16 where the activations fit it
    gpu = {
        arch: resolve_settings(EngineSettings(model_path="x", backend="cupy"), arch)
        for arch in ("llama", "gemma3")
    }
    assert {arch: (s.compute_dtype, s.prefill_chunk) for arch, s in gpu.items()} == {
        "llama": ("f16", 4096),
        "gemma3": ("bf16", 4096),
    }
    assert type(gpu["llama"].compute_dtype) is ComputeDType  # a StrEnum: the plain word in the ready line
    # pure: what the caller resolved, nothing looked up
    pure = EngineSettings(model_path="x", backend="auto").with_backend_defaults(
        "llama", backend=Backend.CUPY, threads=3
    )
    assert (pure.backend, pure.compute_dtype, pure.cpu_kernels, pure.threads) == ("cupy", "f16", "numpy", 3)


def test_every_architecture_has_its_default_compute_dtypes():
    from strata_engine.config import ARCHITECTURES
    from strata_engine.settings import DEFAULT_COMPUTE_DTYPE, DEFAULT_PREFILL_CHUNK

    assert set(DEFAULT_COMPUTE_DTYPE) == set(ARCHITECTURES)
    for row in DEFAULT_COMPUTE_DTYPE.values():
        assert set(row) == set(DEFAULT_PREFILL_CHUNK) == {"numpy", "cupy"}


def test_a_loaded_runner_names_what_runs_and_has_no_graph_on_numpy(smollm2_path):
    runner = load_runner(EngineSettings(model_path=smollm2_path, n_ctx=64))
    assert (runner.settings.backend, runner.settings.compute_dtype, runner.settings.prefill_chunk) == (
        "numpy", "f32", 512,
    )  # fmt: skip
    assert runner.graphs.decode is None  # CUDA graphs are a cupy-backend affair


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_numba_kernels_agree_with_the_numpy_oracle(request, name):
    """The same prompt through both CPU kernels (packed weights and compiled kernels against float32
    weights and BLAS), f32 and f16 K/V: a 40-token prefill (BLAS products, key blocks), a 5-token turn
    (packed products, the attention kernel) and 8 decode steps give the same greedy tokens and logits
    within KERNEL_LOGIT_BOUND. Their session identity is the same: a file saved with one restores with
    the other."""
    from strata_engine.session.identity import runner_identity

    path = request.getfixturevalue(f"{name}_path")
    loaded = [
        load_runner(EngineSettings(model_path=path, n_ctx=128, cpu_kernels=k)) for k in ("numba", "numpy")
    ]
    assert [r.settings.cpu_kernels for r in loaded] == ["numba", "numpy"]
    assert runner_identity(loaded[0]) == runner_identity(loaded[1])
    for kv_type, bound in KERNEL_LOGIT_BOUND.items():
        _agree([sibling(r, kv_type=kv_type) for r in loaded], bound)


def _agree(runners: list[ModelRunner], bound: float) -> None:
    rng = np.random.default_rng(14)
    prompt = [2] + rng.integers(100, 5000, 39).tolist()
    runs = []
    for runner in runners:
        logits = [runner.prefill(prompt).logits, runner.prefill(prompt + [301, 302, 303, 304, 305]).logits]
        tokens = []
        for _ in range(8):
            tokens.append(int(np.argmax(logits[-1])))
            logits.append(runner.decode(tokens[-1]))
        runs.append((tokens, logits))
    (fast_tokens, fast), (slow_tokens, slow) = runs
    assert fast_tokens == slow_tokens
    for step, (a, b) in enumerate(zip(fast, slow, strict=True)):
        assert np.abs(a - b).max() <= bound, f"step {step}: {np.abs(a - b).max():.2e}"


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_a_warmed_runner_compiles_nothing_in_a_request(request, name):
    """After `SlotSet.load` (its kernel warm-up) with the q8 products and f16 K/V, prompt chunks longer than
    the warm-up's (a first turn, then a second at depth: gemma3's sliding layers wrap their rings) and decode
    steps neither compile nor load from numba's disk cache a kernel signature: a request would pay seconds."""
    from strata_engine.kernel_cache import kernel_dispatchers

    path = request.getfixturevalue(f"{name}_path")
    runner = load_runner(EngineSettings(model_path=path, n_ctx=1024, cpu_kernels="numba-q8", kv_type="f16"))
    kernels = list(kernel_dispatchers())
    before = {k.py_func.__name__: len(k.overloads) for k in kernels}
    rng = np.random.default_rng(16)
    prompt = [2] + rng.integers(100, 5000, 299).tolist()
    runner.prefill(prompt)
    logits = runner.prefill(prompt + rng.integers(100, 5000, 330).tolist()).logits
    for _ in range(3):
        logits = runner.decode(int(np.argmax(logits)))
    assert {k.py_func.__name__: len(k.overloads) for k in kernels} == before


def test_a_warmed_slot_set_compiles_nothing_in_a_batched_step(smollm2_path):
    """The warm-up's pass shaped as a batched decode step (two one-row spans) compiles what a step over several
    slots runs (the K/V rows' store into their slots, the batched attention): the first batched step of a
    server with -np 2 or more loads or compiles no kernel signature; nor does a later slot's own prompt and
    step, although only the first slot ran the warm-up (the slots share the kernels)."""
    from strata_engine.kernel_cache import kernel_dispatchers
    from strata_engine.slots import SlotSet

    slots = SlotSet.load(EngineSettings(model_path=smollm2_path, n_ctx=512, n_slots=2, cpu_kernels="numba-q8",
                                        kv_type="f16"))  # fmt: skip
    kernels = list(kernel_dispatchers())
    before = {k.py_func.__name__: len(k.overloads) for k in kernels}
    first = [int(np.argmax(slots.runners[i].prefill([2, 300 + i, 400, 500]).logits)) for i in range(2)]
    rows = slots.decode([(0, first[0]), (1, first[1])])
    assert len(rows) == 2
    long_prompt = [2] + np.random.default_rng(3).integers(100, 5000, 120).tolist()
    slots.runners[1].erase()
    slots.runners[1].decode(int(np.argmax(slots.runners[1].prefill(long_prompt).logits)))
    assert {k.py_func.__name__: len(k.overloads) for k in kernels} == before


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_a_warmed_runner_compiles_nothing_in_an_embedding(request, name):
    """EMBED evaluates on scratch K/V held in float32 (embedding.ScratchKV), not the pool's storage type: the
    warm-up covers those attention signatures too, so a server's first embedding request (prompt chunks past
    the warm-up's, at depth) neither compiles nor loads a kernel: on a cold cache that took over 120 s."""
    from strata_engine.embedding import hidden_states
    from strata_engine.kernel_cache import kernel_dispatchers

    path = request.getfixturevalue(f"{name}_path")
    runner = load_runner(EngineSettings(model_path=path, n_ctx=1024, cpu_kernels="numba-q8", kv_type="f16"))
    kernels = list(kernel_dispatchers())
    before = {k.py_func.__name__: len(k.overloads) for k in kernels}
    prompt = [2] + np.random.default_rng(17).integers(100, 5000, 700).tolist()
    hidden_states(runner.model, prompt, runner.settings.prefill_chunk)
    after = {k.py_func.__name__: len(k.overloads) for k in kernels}
    assert {n: (before.get(n), c) for n, c in after.items() if before.get(n) != c} == {}
