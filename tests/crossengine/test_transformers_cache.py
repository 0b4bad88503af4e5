"""transformers caches through format v1 (strata_sessionfile.hf) against the real transformers (loading the
GGUF strata-engine loads, f32) and strata-engine (f32 K/V): transformers' cache -> strata-engine continues
as transformers does; strata-engine's file -> transformers continues as strata-engine does; each family's K
rows equal strata-engine's own (SmolLM2's and llama's permuted, gemma3's, qwen2's, qwen3's and phi3's not);
the conformance kit; refusals. SmolLM2 is the real model, one transformers model and one runner for the
module; the other families are tiny random models (support/families.py) that load_model loads.
"""

from __future__ import annotations

import functools

import attrs
import numpy as np
import pytest
import strata_sessionfile as sf
import torch
from strata_engine.session import EngineSession, runner_identity
from strata_engine.settings import EngineSettings
from strata_engine.slots import SlotSet
from strata_sessionfile import errors as E
from strata_sessionfile import hf
from strata_sessionfile.testing import run_conformance
from support.families import BOS, FAMILIES, reference_logits, reference_model
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

# Token ids of each vocabulary (the tokenizers are strata-engine's business, not this test's): SmolLM2's starts
# with <|im_start|>, gemma3's with its bos.
SMOLLM2_PROMPT = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
# The tiny models' (byte tokens): longer than gemma3's window (8), so its sliding layers hold a part.
TINY_PROMPT = [BOS, *b"The cat sat on a"]
N_REPLY = 8


def _runner(path, n_ctx: int = 512):
    return SlotSet.load(EngineSettings(model_path=path, kv_type="f32", n_ctx=n_ctx)).runners[0]


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return hf.load_model(smollm2_path)


@pytest.fixture(scope="module")
def smollm2_runner(smollm2_path):
    return _runner(smollm2_path)


def hf_greedy(model: hf.GGUFModel, cache, first_input: list[int], n: int = N_REPLY) -> list[int]:
    """transformers' greedy continuation of what ``cache`` holds, ``first_input`` fed first."""
    out: list[int] = []
    ids = first_input
    with torch.no_grad():
        for _ in range(n):
            logits = model.module(torch.tensor([ids]), past_key_values=cache, use_cache=True).logits
            out.append(int(logits[0, -1].argmax()))
            ids = [out[-1]]
    return out


def engine_greedy(runner, first_logits, n: int = N_REPLY) -> list[int]:
    out = [int(np.argmax(first_logits))]
    while len(out) < n:
        out.append(int(np.argmax(runner.decode(out[-1]))))
    return out


def test_transformers_cache_continues_in_strata_engine(smollm2, smollm2_runner, tmp_path):
    prompt = SMOLLM2_PROMPT
    cache = hf.new_cache(smollm2)
    with torch.no_grad():
        logits = smollm2.module(torch.tensor([prompt[:-1]]), past_key_values=cache, use_cache=True).logits
    assert logits.shape[1] == len(prompt) - 1
    path = tmp_path / "hf.ssf"
    hf.save_cache(smollm2, cache, prompt[:-1], path, config=runner_identity(smollm2_runner).config)
    expected = hf_greedy(smollm2, cache, [prompt[-1]])  # transformers' own continuation

    runner = smollm2_runner
    runner.erase()
    sf.restore(path, EngineSession(runner))
    assert runner.n_held == len(prompt) - 1
    res = runner.prefill(prompt)
    assert res.cache_n == len(prompt) - 1  # every token transformers computed is reused
    assert engine_greedy(runner, res.logits) == expected


def test_strata_engine_file_continues_in_transformers(smollm2, smollm2_runner, tmp_path):
    runner = smollm2_runner
    runner.erase()
    res = runner.prefill(SMOLLM2_PROMPT)
    path = tmp_path / "engine.ssf"
    sf.save(path, EngineSession(runner))
    expected = engine_greedy(runner, res.logits)

    cache, tokens = hf.load_cache(smollm2, path)
    assert tokens == SMOLLM2_PROMPT and cache.get_seq_length() == len(SMOLLM2_PROMPT)
    assert [expected[0], *hf_greedy(smollm2, cache, [expected[0]], N_REPLY - 1)] == expected


def _k_rows(path, layer: int, shape: tuple[int, ...]) -> np.ndarray:
    """Layer ``layer``'s K part of a format v1 file, f32."""
    info = sf.inspect(path)
    ext = next(e for e in info.layout.extents if e.layer == layer and e.part is sf.Part.K)
    with open(path, "rb") as f:
        f.seek(info.layout.data_offset + ext.data_offset)
        return np.frombuffer(f.read(ext.size), "<f4").reshape(shape)


@pytest.fixture(scope="module")
def tiny(family_files):
    """family -> (the tiny f32 GGUF loaded by load_model and bound, a strata-engine runner of it), on first
    use."""

    @functools.cache
    def get(family: str) -> tuple[hf.GGUFModel, object]:
        path = family_files(family, "f32")
        return hf.load_model(path), _runner(path, n_ctx=128)

    return get


def _check_k_rows(model: hf.GGUFModel, cache, tokens: list[int], engine_file, tmp_path) -> None:
    """Every layer's K rows the adapter writes from ``cache`` are strata-engine's in ``engine_file`` (the same
    tokens), and the other mapping's are not: each mapping checked by the other one failing."""
    hf.save_cache(model, cache, tokens, tmp_path / "mine.ssf")
    other = attrs.evolve(model, k_rows=({hf.KRows.SAME, hf.KRows.INTERLEAVED} - {model.k_rows}).pop())
    hf.save_cache(other, cache, tokens, tmp_path / "other.ssf")
    for la in model.layers:
        shape = (min(len(tokens), la.window or len(tokens)), la.n_kv_heads, la.head_dim)
        mine, theirs, wrong = (
            _k_rows(p, la.index, shape) for p in (tmp_path / "mine.ssf", engine_file, tmp_path / "other.ssf")
        )
        scale = float(np.abs(theirs).max())
        assert float(np.abs(mine - theirs).max()) < 0.05 * scale, f"layer {la.index}"
        assert float(np.abs(wrong - theirs).max()) > 0.2 * scale, f"layer {la.index}"


def test_smollm2_k_rows_are_strata_engines(smollm2, smollm2_runner, tmp_path):
    """SmolLM2's (a `llama` GGUF) K rows needed the per-head permutation."""
    assert smollm2.k_rows is hf.KRows.INTERLEAVED
    cache = hf.new_cache(smollm2)
    with torch.no_grad():
        smollm2.module(torch.tensor([SMOLLM2_PROMPT]), past_key_values=cache, use_cache=True)
    smollm2_runner.erase()
    smollm2_runner.prefill(SMOLLM2_PROMPT)
    sf.save(tmp_path / "engine.ssf", EngineSession(smollm2_runner))
    _check_k_rows(smollm2, cache, SMOLLM2_PROMPT, tmp_path / "engine.ssf", tmp_path)


# What transformers' GGUF loader (5.x) drops, so that its config of the tiny file alone is refused (load_model
# fills it in from the file): llama3's RoPE factors (rope_freqs.weight), qwen3's key_length (head_dim 64 here;
# released Qwen3s' 128 is its default), Phi-3's window (16 on every layer; the config's none).
BY_CONFIG = {
    "llama3": ("llama3", E.CacheUnsupported, "rope_freqs"),
    "qwen3": ("qwen3", E.CacheGeometryMismatch, r"\(2, 128, 128, 0\); the GGUF 2, \(2, 64, 64, 0\)"),
    "phi3": ("phi3", E.CacheGeometryMismatch, r"\(2, 32, 32, 0\); the GGUF 2, \(2, 32, 32, 16\)"),
}

# family -> its K row mapping (llama3: RoPE scaled by rope_freqs.weight; mistral-style: plain `llama`; phi3:
# fused QKV, a window of 16 that the held prompt fills and the continuation passes)
TINY_K_ROWS = {
    "gemma3": hf.KRows.SAME,
    "qwen2": hf.KRows.SAME,
    "qwen3": hf.KRows.SAME,
    "phi3": hf.KRows.SAME,
    "mistral": hf.KRows.INTERLEAVED,
    "llama3": hf.KRows.INTERLEAVED,
}


@pytest.mark.parametrize("family", ["llama3", "qwen3", "phi3"])
def test_load_model_computes_the_files_model(family, tiny, family_files):
    """Where transformers' GGUF loader drops part of the model (BY_CONFIG), load_model's model computes what
    transformers' own model of the file's weights and the family's full config computes (support/families.py)."""
    path = family_files(family, "f32")
    tokens = [BOS, *b"The cat sat on a mat, the dog on a log, and both slept."]  # past the windows
    got = reference_logits(tiny(family)[0].module, tokens)
    want = reference_logits(reference_model(FAMILIES[family], path), tokens)
    assert float(np.abs(got - want).max()) < 1e-3 * float(np.abs(want).max())


@pytest.mark.parametrize("family", list(TINY_K_ROWS))
def test_tiny_family_caches_cross_both_ways(family, tiny, tmp_path):
    """K rows equal strata-engine's on every layer; transformers' cache -> strata-engine continues as
    transformers does; strata-engine's file -> transformers continues as strata-engine does."""
    model, runner = tiny(family)
    assert model.k_rows is TINY_K_ROWS[family]
    held = TINY_PROMPT[:-1]
    runner.erase()
    runner.prefill(held)
    engine_file = tmp_path / "engine.ssf"
    sf.save(engine_file, EngineSession(runner))
    cache = hf.new_cache(model)
    with torch.no_grad():
        model.module(torch.tensor([held]), past_key_values=cache, use_cache=True)
    _check_k_rows(model, cache, held, engine_file, tmp_path)

    path = tmp_path / "hf.ssf"
    hf.save_cache(model, cache, held, path, config=runner_identity(runner).config)
    expected = hf_greedy(model, cache, [TINY_PROMPT[-1]])  # transformers' own continuation
    runner.erase()
    sf.restore(path, EngineSession(runner))
    res = runner.prefill(TINY_PROMPT)
    assert res.cache_n == len(held)  # every token transformers computed is reused
    assert engine_greedy(runner, res.logits) == expected

    loaded, tokens = hf.load_cache(model, engine_file)
    assert tokens == held
    assert hf_greedy(model, loaded, [TINY_PROMPT[-1]]) == expected


@pytest.mark.parametrize(("family", "error", "named"), BY_CONFIG.values(), ids=list(BY_CONFIG))
def test_what_transformers_loads_differently_is_refused(family, error, named, family_files):
    """What transformers' GGUF loader drops is refused by name, not converted wrong, where its config of the
    file is bound as it is (load_model fills it in)."""
    path = family_files(family, "f32")
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with pytest.raises(error, match=named):
        hf.GGUFModel.bind(config, path)


def test_longrope_and_unscaled_models_are_refused(tiny, family_files):
    """Phi-3's longrope factors (chosen by context size in strata-engine, by sequence length in transformers)
    are refused by name; a model computing unscaled RoPE for a llama3 GGUF too."""
    with pytest.raises(E.CacheUnsupported, match="rope_factors_long"):
        hf.load_model(family_files("phi3_longrope", "f32"))
    path = family_files("llama3", "f32")
    unscaled = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with pytest.raises(E.CacheUnsupported, match="RoPE frequencies"):
        hf.GGUFModel.bind(unscaled, path)


def _random_cache(model: hf.GGUFModel, n: int, seed: int, cache=None):
    g = torch.Generator().manual_seed(seed)
    cache = cache if cache is not None else hf.new_cache(model)
    for i, la in enumerate(model.layers):
        kv = [torch.randn(1, la.n_kv_heads, n, la.head_dim, generator=g) for _ in range(2)]
        cache.update(*kv, i)
    return cache


def test_conformance_kit(tiny, tmp_path):
    """On the tiny gemma3: its sliding layers too, and seconds where SmolLM2's 30 layers take half a minute."""
    gemma3 = tiny("gemma3")[0]

    def factory(seed: int) -> hf.CacheSession:
        n = 24 + seed  # past the window, and the three blocks of K/V the kit's gate cases need
        return hf.CacheSession(gemma3, _random_cache(gemma3, n, seed), range(seed, seed + n))

    assert "round_trip" in run_conformance(factory, tmp_path)


def test_refusals_are_named(smollm2, smollm2_runner, tmp_path):
    prompt = SMOLLM2_PROMPT[:4]
    cache = _random_cache(smollm2, len(prompt), 0)
    good = tmp_path / "good.ssf"
    hf.save_cache(smollm2, cache, prompt, good)
    with pytest.raises(E.CacheLengthMismatch, match="4 positions"):
        hf.save_cache(smollm2, cache, prompt + [5], tmp_path / "short.ssf")
    with pytest.raises(E.CacheGeometryMismatch, match="layers"):
        hf.save_cache(smollm2, type(cache)(), prompt, tmp_path / "empty.ssf")
    big = _random_cache(smollm2, len(prompt), 0, cache=hf.new_cache(smollm2))
    big.layers[3].keys = torch.cat([big.layers[3].keys] * 2)  # two sequences
    with pytest.raises(E.CacheGeometryMismatch, match="one sequence"):
        hf.save_cache(smollm2, big, prompt, tmp_path / "batch.ssf")
    with pytest.raises(E.CacheUnsupported, match="i8"):
        hf.save_cache(smollm2, cache, prompt, tmp_path / "i8.ssf", kv_dtype=sf.DType.I8)
    # a file of another model, an f16/int8 engine's file, a truncated one: refused, nothing returned
    runner = smollm2_runner
    runner.erase()
    runner.prefill(prompt)
    engine_file = tmp_path / "engine.ssf"
    sf.save(
        engine_file,
        EngineSession(runner, identity=sf.EngineIdentity(_other_model(), runner_identity(runner).config)),
    )
    with pytest.raises(E.ModelMismatch):
        hf.load_cache(smollm2, engine_file)
    data = good.read_bytes()
    (tmp_path / "cut.ssf").write_bytes(data[: len(data) // 2])
    with pytest.raises(E.Truncated):
        hf.load_cache(smollm2, tmp_path / "cut.ssf")
    with pytest.raises(E.ConfigMismatch):
        hf.load_cache(smollm2, good, config=runner_identity(runner).config)
    cache2, tokens = hf.load_cache(smollm2, good, dtype=torch.float16)
    assert tokens == prompt and cache2.layers[0].keys.dtype == torch.float16
    assert torch.equal(cache2.layers[7].values, cache.layers[7].values.half())


def _other_model() -> sf.ModelIdentity:
    from strata_sessionfile.identity import model_identity_from_files

    return model_identity_from_files([sf.ModelFile("model", 1, b"\x01" * 16)])


def test_sliding_layers_past_the_window(tiny, tmp_path):
    """gemma3 past its window: the file's sliding layers hold the last `window` positions, the loaded cache
    holds them again and attends as transformers' own cache does; transformers' own cache (window - 1 kept)
    is refused by name."""
    gemma3 = tiny("gemma3")[0]
    window = max(la.window for la in gemma3.layers)
    n = window + 2
    ids = torch.randint(3, 250, (1, n), generator=torch.Generator().manual_seed(0))
    ours = hf.new_cache(gemma3)
    with torch.no_grad():
        gemma3.module(ids, past_key_values=ours, use_cache=True)
    theirs = DynamicCache(
        config=gemma3.config
    )  # transformers' own layers over the same K/V (one prefill, not two)
    for i, layer in enumerate(ours.layers):
        theirs.update(layer.keys, layer.values, i)
        if layer.is_sliding:
            theirs.layers[i].cumulative_length = n
    path = tmp_path / "window.ssf"
    hf.save_cache(gemma3, ours, ids[0].tolist(), path)
    held = {g.spec.window: g.tokens_held for g in sf.inspect(path).metadata.layers}
    assert held == {0: n, window: window}
    with pytest.raises(E.CacheLengthMismatch, match="new_cache"):
        hf.save_cache(gemma3, theirs, ids[0].tolist(), tmp_path / "theirs.ssf")

    loaded, tokens = hf.load_cache(gemma3, path)
    assert tokens == ids[0].tolist() and loaded.get_seq_length() == n
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(loaded.layers, ours.layers, strict=True))
    step = torch.tensor([[7]])
    with torch.no_grad():
        got, want = (gemma3.module(step, past_key_values=c, use_cache=True).logits for c in (loaded, theirs))
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_an_f16_engine_takes_the_cache_as_f16(tiny, family_files, tmp_path):
    """The README's path to strata-server (f16 K/V by default): kv_dtype="f16" and the engine's config."""
    model = tiny("qwen2")[0]
    runner = SlotSet.load(
        EngineSettings(model_path=family_files("qwen2", "f32"), kv_type="f16", n_ctx=128)
    ).runners[0]
    held = TINY_PROMPT[:-1]
    cache = hf.new_cache(model)
    with torch.no_grad():
        model.module(torch.tensor([held]), past_key_values=cache, use_cache=True)
    path = tmp_path / "f16.ssf"
    hf.save_cache(model, cache, held, path, config=runner_identity(runner).config, kv_dtype="f16")
    sf.restore(path, EngineSession(runner))
    assert runner.prefill(TINY_PROMPT).cache_n == len(held)
