"""transformers caches (a ``DynamicCache`` of the model families strata-engine runs) saved as format v1 and
loaded back (spec/transformers-cache.md is the mapping).

``load_model(gguf)`` loads a GGUF with transformers' GGUF support (the very file strata-engine and llama.cpp
load; what its loader drops, e.g. Phi-3's window and Llama 3.x's RoPE factors, taken from the file) and
binds it: ``GGUFModel`` holds the transformers model, the GGUF's model identity (the fingerprint
strata-engine computes), the layers' K/V geometry (checked against the GGUF's) and the K row mapping.
``save_cache(model, cache, tokens, path)`` and ``load_cache(model, path) -> (cache, tokens)`` drive
``CacheSession``, a SessionSource / SessionTarget / StagingTarget / LandingTarget over one cache, through the
library's save and restore: every check of the format, the crash-safe write and the two-pass read apply.

K rows: format v1 keeps a head's K row as the GGUF lays it out (llama.cpp's and strata-engine's rows).
transformers un-permutes a ``llama`` GGUF's Q/K weights back to rotate-half order, so there a file row is
transformers' row with the dimensions interleaved (file[2i + h] = hf[h * D/2 + i]); a ``gemma3`` (or
qwen2, qwen3, phi3) GGUF is not permuted by llama.cpp's converter nor by transformers: the rows are the same (both checked against
strata-engine in tests/crossengine). An architecture whose mapping was not checked is refused.

Sliding-window layers: format v1 keeps the last ``window`` positions (an engine may evaluate the last token
again); transformers' ``DynamicSlidingWindowLayer(window)`` keeps ``window - 1``. ``new_cache`` and
``load_cache`` give sliding layers that keep ``window`` (``DynamicSlidingWindowLayer(window + 1)``: the
mask sizes follow it, the mask's window stays the config's); saving a cache that dropped a position the
file keeps is refused (``CacheLengthMismatch``).

dtypes: the file holds ``kv_dtype`` (default: the cache's), the loaded cache ``dtype`` (default: the
model's); f32, f16 and bf16, converted by torch where they differ (an i8 file is refused). torch,
transformers and numpy are imported when first used: strata-sessionfile stands alone without them.
"""

from __future__ import annotations

import array
import enum
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from . import errors as E
from .adapter import StagesByApplying
from .format import DEFAULT_BLOCK_SIZE, DTYPES, DType, LayerRole, Part
from .identity import config_fingerprint, model_fingerprint
from .llamacpp import (
    ModelGeometry,
    ModelLayer,
    config_of,
    gguf_metadata,
    gguf_tensor_names,
    model_geometry,
)
from .reader import restore
from .records import (
    ConfigIdentity,
    EngineIdentity,
    EngineLimits,
    LayerGeometry,
    LayerSpec,
    ModelIdentity,
    RestorePlan,
    RunningState,
    SaveReport,
    Snapshot,
)
from .writer import save

MODEL_ROLE = "model"  # the GGUF's role in the model fingerprint (strata-engine's)
FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer_types words


class KRows(enum.Enum):
    """How a head's K row in the file relates to transformers' K row of the same model."""

    SAME = "same"
    INTERLEAVED = "interleaved"  # file[2i + h] = hf[h * D/2 + i]: llama.cpp's converter permuted Q/K


# transformers model_type -> the K row mapping, checked against strata-engine (tests/crossengine): llama.cpp's
# converter permutes `llama` only; qwen2, qwen3 and phi3 (fused QKV, NeoX RoPE) are rotate-half in both.
K_ROWS: dict[str, KRows] = {
    "llama": KRows.INTERLEAVED,
    "gemma3_text": KRows.SAME,
    "qwen2": KRows.SAME,
    "qwen3": KRows.SAME,
    "phi3": KRows.SAME,
}
# A GGUF tensor of RoPE factors -> the rope_type transformers' config needs to apply them (its GGUF loader reads
# neither tensor; load_model applies rope_freqs.weight itself, see ROPE_FREQS).
ROPE_FACTOR_TENSORS: dict[str, str] = {"rope_freqs.weight": "llama3", "rope_factors_long.weight": "longrope"}
# llama3 RoPE scaling's per-frequency divisors (llama.cpp's freq_factors: theta_i = base^(-2i/d) / factor_i)
ROPE_FREQS = "rope_freqs.weight"
# GGUF metadata transformers' GGUF loader (5.17) does not map -> the config attribute load_model sets from it
# (0, a GGUF's "no window", is None in transformers' config).
LOADER_GAPS: dict[str, tuple[tuple[str, str], ...]] = {
    "phi3": (("attention.sliding_window", "sliding_window"),),
    "qwen3": (("attention.key_length", "head_dim"),),
}
# GGUF architecture -> its layers' windows where strata_sessionfile.llamacpp does not read them (llama.cpp
# b11549 runs Phi-3 without its window; strata-engine and transformers apply it on every layer).
ENGINE_WINDOWS: dict[str, str] = {"phi3": "attention.sliding_window"}
# format v1 dtype -> torch dtype name (i8 has no transformers cache counterpart)
TORCH_DTYPES: dict[DType, str] = {DType.F32: "float32", DType.F16: "float16", DType.BF16: "bfloat16"}
# the dtypes numpy holds (bf16 is converted by torch)
NUMPY_DTYPES: dict[DType, str] = {DType.F32: "<f4", DType.F16: "<f2"}


def _libs() -> tuple[Any, Any, Any]:
    """(numpy, torch, transformers.cache_utils), or CacheUnsupported naming what is missing."""
    try:
        import numpy as np
        import torch
        from transformers import cache_utils
    except ImportError as exc:
        raise E.CacheUnsupported(
            f"transformers caches need numpy, torch and transformers ({exc.name} is not installed)"
        ) from None
    if sys.byteorder != "little":  # torch's bytes are the machine's; the format's are little-endian
        raise E.CacheUnsupported("transformers caches are converted on little-endian machines only")
    return np, torch, cache_utils


def _torch_dtype(dtype: DType, field: str) -> Any:
    name = TORCH_DTYPES.get(dtype)
    if name is None:
        raise E.CacheUnsupported(
            f"{DTYPES[dtype].name} K/V has no transformers cache dtype (known: "
            f"{', '.join(DTYPES[d].name for d in TORCH_DTYPES)})",
            field=field,
        )
    return getattr(_libs()[1], name)


def _file_dtype(torch_dtype: Any, field: str) -> DType:
    for dt, name in TORCH_DTYPES.items():
        if str(torch_dtype) == f"torch.{name}":
            return dt
    raise E.CacheUnsupported(f"cache dtype {torch_dtype} is not f32, f16 or bf16", field=field)


# --- the model ------------------------------------------------------------------------------------------
@attrs.frozen
class CacheLayer:
    """One attention layer's K/V shape as transformers' config and the GGUF both give it."""

    index: int
    n_kv_heads: int
    head_dim: int
    window: int  # 0 = full attention

    def spec(self, dtype: DType) -> LayerSpec:
        return LayerSpec(
            index=self.index,
            role=LayerRole.MAIN,
            n_kv_heads=self.n_kv_heads,
            head_dim_k=self.head_dim,
            head_dim_v=self.head_dim,
            k_dtype=dtype,
            v_dtype=dtype,
            window=self.window,
        )


def _config_layers(config: Any) -> tuple[CacheLayer, ...]:
    n = int(config.num_hidden_layers)
    # no layer_types: every layer slides where the config has a window (transformers' DynamicCache's rule)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or [SLIDING if window else FULL] * n
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    unknown = sorted({t for t in types if t not in (FULL, SLIDING)})
    if unknown or len(types) != n:
        raise E.CacheUnsupported(
            f"layer types {unknown or len(types)} (known: {FULL}, {SLIDING} on every one of {n} layers)",
            field="config.layer_types",
        )
    return tuple(
        CacheLayer(
            i,
            int(config.num_key_value_heads),
            int(head_dim),
            int(getattr(config, "sliding_window", None) or 0) * (t == SLIDING),
        )
        for i, t in enumerate(types)
    )


def _check_against_gguf(layers: tuple[CacheLayer, ...], gguf: ModelGeometry, path: str) -> None:
    """transformers' config must describe the GGUF's cache: layers, heads, head sizes and windows."""
    mine = [(la.n_kv_heads, la.head_dim, la.head_dim, la.window) for la in layers]
    theirs = [(la.n_kv_heads, la.head_dim_k, la.head_dim_v, la.window) for la in gguf.layers]
    if mine != theirs:
        where = next(
            (i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b),
            min(len(mine), len(theirs)),
        )
        raise E.CacheGeometryMismatch(
            f"transformers' config has {len(mine)} layers, layer {where} (heads, dk, dv, window) "
            f"{mine[where] if where < len(mine) else None}; the GGUF {len(theirs)}, "
            f"{theirs[where] if where < len(theirs) else None}",
            path=path,
            field=f"layers[{where}]",
        )


def _gguf_geometry(path: str) -> ModelGeometry:
    """The GGUF's K/V cache as strata-engine lays it out: llama.cpp's, or for ENGINE_WINDOWS' architectures
    read here (one window on every layer, head size from the key length or embedding / heads)."""
    meta = gguf_metadata(path)
    arch = meta.get("general.architecture")
    window_key = ENGINE_WINDOWS.get(arch) if isinstance(arch, str) else None
    if window_key is None:
        return model_geometry(path)
    try:
        n_layer = int(meta[f"{arch}.block_count"])
        n_head = int(meta[f"{arch}.attention.head_count"])
        n_embd = int(meta[f"{arch}.embedding_length"])
    except (KeyError, TypeError) as exc:
        raise E.CacheUnsupported(f"the GGUF lacks {exc.args[0]}", path=path, field="gguf") from None
    heads_kv = int(meta.get(f"{arch}.attention.head_count_kv", n_head))
    dk = int(meta.get(f"{arch}.attention.key_length", n_embd // max(n_head, 1)))
    window = int(meta.get(f"{arch}.{window_key}", 0))
    layers = tuple(ModelLayer(il, heads_kv, dk, dk, window) for il in range(n_layer))
    return ModelGeometry(str(arch), layers)


def _rope_types(config: Any) -> set[str]:
    """The config's RoPE types (gemma3 keeps one per layer type)."""
    params = getattr(config, "rope_parameters", None) or {}
    nested = [v for v in params.values() if isinstance(v, Mapping)]
    return {str(p.get("rope_type", "default")) for p in (nested or [params])}


def _rope_freqs(path: str) -> Any:
    """The GGUF's rope_freqs.weight (f32 numpy), read by gguf-py (transformers' GGUF loader's own reader)."""
    np = _libs()[0]
    from gguf import GGUFReader

    tensor = next((t for t in GGUFReader(path).tensors if t.name == ROPE_FREQS), None)
    if tensor is None:
        raise E.CacheUnsupported(f"the GGUF has no {ROPE_FREQS}", path=path, field=ROPE_FREQS)
    return np.asarray(tensor.data, dtype=np.float32).reshape(-1)


def _rotary_modules(module: Any) -> list[Any]:
    """The model's RoPE modules (those holding the frequencies: ``inv_freq``)."""
    return [m for m in module.modules() if hasattr(m, "inv_freq")]


def _scaled_frequencies(config: Any, factors: Any, path: str) -> Any:
    """The unscaled RoPE frequencies of ``config`` divided by the GGUF's factors (llama.cpp's formula)."""
    np, torch, _ = _libs()
    params = getattr(config, "rope_parameters", None) or {}
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    base = 1.0 / (float(params["rope_theta"]) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if factors.shape != base.shape:
        raise E.CacheGeometryMismatch(
            f"{ROPE_FREQS} has {factors.size} factors; the head size {head_dim} has {base.size} frequencies",
            path=path,
            field=ROPE_FREQS,
        )
    return torch.from_numpy((base / factors.astype(np.float64)).astype(np.float32))


def _check_rope(config: Any, module: Any, tensors: frozenset[str], path: str) -> None:
    """The GGUF's RoPE factor tensors must be applied by the model (its frequencies are the GGUF's), or by a
    config's rope_type where only a config is bound, or the K rows differ."""
    for name, rope_type in ROPE_FACTOR_TENSORS.items():
        if name not in tensors:
            continue
        if name == ROPE_FREQS and module is not None:
            torch = _libs()[1]
            want = _scaled_frequencies(config, _rope_freqs(path), path)
            got = _rotary_modules(module)
            if got and all(torch.allclose(m.inv_freq.float().cpu(), want, rtol=1e-5) for m in got):
                continue
            raise E.CacheUnsupported(
                f"the GGUF has {name} ({rope_type} RoPE) but the model's RoPE frequencies are not the GGUF's "
                f"scaled ones (load it with load_model, which applies them)",
                path=path,
                field="module.inv_freq",
            )
        if rope_type not in _rope_types(config):
            raise E.CacheUnsupported(
                f"the GGUF has {name} ({rope_type} RoPE) but transformers' config's rope_type is "
                f"{'/'.join(sorted(_rope_types(config)))} (its GGUF loader drops the factors: bind a model "
                f"whose config has rope_type {rope_type!r})",
                path=path,
                field="config.rope_parameters",
            )


@attrs.frozen
class GGUFModel:
    """A transformers model (or its config alone: enough to convert caches) bound to the GGUF it was loaded
    from. ``bind`` makes one; ``load_model`` loads and binds."""

    config: Any  # transformers' text config
    gguf: str
    identity: ModelIdentity
    layers: tuple[CacheLayer, ...]
    k_rows: KRows
    module: Any = None  # the transformers model (None: config only)

    @classmethod
    def bind(cls, model: Any, gguf: str | os.PathLike) -> GGUFModel:
        """``model``: a transformers model, or a config, of the GGUF file ``gguf`` (weights loaded from it, as
        ``load_model`` does, or the same weights: the file is what the fingerprint samples)."""
        path = os.fspath(gguf)
        module = model if hasattr(model, "config") else None
        config = (module.config if module is not None else model).get_text_config(decoder=True)
        k_rows = K_ROWS.get(config.model_type)
        if k_rows is None:
            raise E.CacheUnsupported(
                f"model type {config.model_type!r}: no checked K row mapping (known: {', '.join(sorted(K_ROWS))})",
                field="config.model_type",
            )
        layers = _config_layers(config)
        _check_against_gguf(layers, _gguf_geometry(path), path)
        _check_rope(config, module, gguf_tensor_names(path), path)
        identity = model_fingerprint([(MODEL_ROLE, path)])
        return cls(config, path, identity, layers, k_rows, module)

    @property
    def dtype(self) -> Any:
        """The torch dtype a loaded cache gets by default: the model's (float32 for a config alone)."""
        torch = _libs()[1]
        return self.module.dtype if self.module is not None else torch.float32

    def k_permutation(self, head_dim: int) -> tuple[list[int], list[int]] | None:
        """(file from transformers, transformers from file) index orders of a head's K row; None: the same."""
        if self.k_rows is KRows.SAME:
            return None
        half = head_dim // 2
        to_file = [(j % 2) * half + j // 2 for j in range(head_dim)]
        to_hf = [0] * head_dim
        for j, h in enumerate(to_file):
            to_hf[h] = j
        return to_file, to_hf


def load_model(gguf: str | os.PathLike, *, dtype: Any = None) -> GGUFModel:
    """The GGUF loaded by transformers (``from_pretrained(folder, gguf_file=name)``: dequantized, in ``dtype``,
    default float32) and bound to the file. What its GGUF loader drops is taken from the file: the config's
    LOADER_GAPS, a pad token outside the vocabulary (Phi-3's default), and rope_freqs.weight's factors (put
    into the model's RoPE frequencies)."""
    torch = _libs()[1]
    from transformers import AutoConfig, AutoModelForCausalLM

    path = os.path.abspath(os.fspath(gguf))
    folder, name = os.path.dirname(path), os.path.basename(path)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    _fill_loader_gaps(config, gguf_metadata(path))
    module = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, config=config, dtype=dtype or torch.float32
    ).eval()
    if ROPE_FREQS in gguf_tensor_names(path):
        want = _scaled_frequencies(config.get_text_config(decoder=True), _rope_freqs(path), path)
        for rotary in _rotary_modules(module):
            rotary.inv_freq = want.to(rotary.inv_freq.device)
            rotary.original_inv_freq = want.clone().to(
                rotary.inv_freq.device
            )  # what a dynamic RoPE update would go back to
    return GGUFModel.bind(module, path)


def _fill_loader_gaps(config: Any, meta: Mapping[str, Any]) -> None:
    text = config.get_text_config(decoder=True)
    arch = meta.get("general.architecture")
    for key, attr in LOADER_GAPS.get(text.model_type, ()):
        if f"{arch}.{key}" in meta:
            setattr(text, attr, int(meta[f"{arch}.{key}"]) or None)
    pad = getattr(text, "pad_token_id", None)
    if pad is not None and not 0 <= pad < int(text.vocab_size):  # nn.Embedding refuses it
        gguf_pad = meta.get("tokenizer.ggml.padding_token_id")
        text.pad_token_id = (
            gguf_pad if isinstance(gguf_pad, int) and 0 <= gguf_pad < text.vocab_size else None
        )


def new_cache(model: GGUFModel) -> Any:
    """An empty DynamicCache for ``model`` whose sliding-window layers keep the whole window (what format v1
    saves): pass it as ``past_key_values``."""
    cache_utils = _libs()[2]
    cache = cache_utils.DynamicCache(config=model.config)
    cache.layers = [_layer(cache_utils, la) for la in model.layers]
    return cache


def _layer(cache_utils: Any, la: CacheLayer) -> Any:
    return (
        cache_utils.DynamicSlidingWindowLayer(sliding_window=la.window + 1)
        if la.window
        else cache_utils.DynamicLayer()
    )


def transformers_config(model: GGUFModel, kv_dtype: DType) -> dict[str, Any]:
    """The config mapping of a file transformers wrote, when no engine's config is given."""
    import transformers

    return {
        "engine": "transformers",
        "engine_version": transformers.__version__,
        "architecture": model.config.model_type,
        "kv_type": DTYPES[kv_dtype].name,
        "n_layer": len(model.layers),
        "n_head_kv": model.layers[0].n_kv_heads if model.layers else 0,
        "head_dim": model.layers[0].head_dim if model.layers else 0,
        "windows": [la.window for la in model.layers],
        "k_rows": "gguf",
    }


# --- the adapter ----------------------------------------------------------------------------------------
class CacheSession(StagesByApplying):  # the restore is built aside either way
    """strata_sessionfile's adapter over one transformers cache of ``model``: saves ``cache`` (with
    ``tokens``), and a restore builds a new cache aside and adopts it at the commit (``cache``, ``state``),
    so a refused or failed restore leaves the held cache as it was.

    ``kv_dtype``: the file's dtype on a save (default: the cache's). ``dtype``: the torch dtype of a restored
    cache (default: the model's). ``config``: the config identity files carry and restores require (an
    engine's, so that engine takes the file; default: ``transformers_config``)."""

    def __init__(
        self,
        model: GGUFModel,
        cache: Any = None,
        tokens: Iterable[int] = (),
        *,
        state: RunningState | None = None,
        kv_dtype: DType | str | None = None,
        dtype: Any = None,
        config: ConfigIdentity | Mapping[str, Any] | None = None,
    ):
        self.model = model
        self.cache = cache
        if state is None:
            held = array.array("i", tokens)
            state = RunningState(tokens=held, position=len(held))
        self.state = state
        self.dtype = dtype if dtype is not None else model.dtype
        self.kv_dtype = self._kv_dtype(kv_dtype)
        if config is None:
            config = transformers_config(model, self.kv_dtype)
        cfg = config if isinstance(config, ConfigIdentity) else config_fingerprint(config)
        self._identity = EngineIdentity(model.identity, cfg)
        self._rows: list[tuple[Any, Any]] = []  # a save's per-layer K, V views [held, heads, dim]
        self._plan: RestorePlan | None = None
        self._incoming: list[list[Any]] | None = None  # a restore's bytes, per layer and part (numpy)
        self.failed: Exception | None = None

    def _kv_dtype(self, kv_dtype: DType | str | None) -> DType:
        if isinstance(kv_dtype, str):
            from .format import DTYPE_BY_NAME

            if kv_dtype not in DTYPE_BY_NAME:
                raise E.CacheUnsupported(f"kv_dtype {kv_dtype!r} (known: f32, f16, bf16)", field="kv_dtype")
            kv_dtype = DTYPE_BY_NAME[kv_dtype]
        if kv_dtype is not None:
            _torch_dtype(kv_dtype, "kv_dtype")
            return kv_dtype
        for layer in getattr(self.cache, "layers", ()):
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                return _file_dtype(layer.keys.dtype, "cache.layers[].keys")
        return _file_dtype(self.dtype, "dtype")

    def identity(self) -> EngineIdentity:
        return self._identity

    # ---- SessionSource (save) ------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        _np, _torch, cache_utils = _libs()
        n, layers = self.state.n_tokens, self.model.layers
        held_layers = getattr(self.cache, "layers", None) if self.cache is not None else []
        if held_layers is None or (len(held_layers) != len(layers) and (n or held_layers)):
            raise E.CacheGeometryMismatch(
                f"the cache has {len(held_layers) if held_layers is not None else 'no'} layers; the model {len(layers)}",
                field="cache.layers",
            )
        kinds = (cache_utils.DynamicLayer, cache_utils.DynamicSlidingWindowLayer)
        self._rows = []
        geometry = []
        for la, layer in zip(layers, held_layers or [None] * len(layers), strict=True):
            held = min(n, la.window) if la.window else n
            if held == 0:
                self._rows.append((None, None))
            else:
                if type(layer) not in kinds:
                    raise E.CacheUnsupported(
                        f"layer {la.index} is a {type(layer).__name__} (known: DynamicLayer, DynamicSlidingWindowLayer)",
                        field=f"cache.layers[{la.index}]",
                    )
                self._rows.append(
                    tuple(self._held_rows(la, layer, which, n, held) for which in ("keys", "values"))
                )
            geometry.append(LayerGeometry(la.spec(self.kv_dtype), held))
        return Snapshot(self.state, tuple(geometry))

    def _held_rows(self, la: CacheLayer, layer: Any, which: str, n: int, held: int) -> Any:
        """The layer's last ``held`` positions as a [held, heads, dim] view, checked against the model."""
        field = f"cache.layers[{la.index}].{which}"
        x = getattr(layer, which, None)
        if (
            x is None
            or x.dim() != 4
            or x.shape[0] != 1
            or x.shape[1] != la.n_kv_heads
            or x.shape[3] != la.head_dim
        ):
            raise E.CacheGeometryMismatch(
                f"shape {tuple(x.shape) if x is not None else None}; the model's is (1, {la.n_kv_heads}, tokens, "
                f"{la.head_dim}) (one sequence)",
                field=field,
            )
        _file_dtype(x.dtype, field)
        t = int(x.shape[2])
        seen = getattr(layer, "cumulative_length", t)  # a sliding layer: positions it has seen
        if seen != n or t < held or (not la.window and t != n):
            raise E.CacheLengthMismatch(
                f"holds {t} positions of {seen} seen; {n} tokens need the last {held}"
                + (
                    " (a sliding layer keeps window - 1: make the cache with new_cache(model))"
                    if t < held <= seen
                    else ""
                ),
                field=field,
            )
        return x[0, :, t - held :, :].transpose(0, 1)

    def copy_out(self, layer: int, part: Part, offset: int, dest: memoryview) -> None:
        np, torch, _ = _libs()
        rows = self._rows[layer][0 if part is Part.K else 1]
        la = self.model.layers[layer]
        row_bytes = la.n_kv_heads * la.head_dim * DTYPES[self.kv_dtype].itemsize
        t0, t1 = offset // row_bytes, -(-(offset + len(dest)) // row_bytes)
        chunk = rows[t0:t1].to(device="cpu")
        perm = self.model.k_permutation(la.head_dim) if part is Part.K else None
        file_np = NUMPY_DTYPES.get(self.kv_dtype)
        if file_np is not None and _file_dtype(chunk.dtype, "cache") in NUMPY_DTYPES:
            # numpy moves the rows: one gather and one cast, single-threaded (bench/sessionfile/DECISIONS.md)
            a = chunk.numpy()
            a = np.ascontiguousarray(a[..., perm[0]] if perm is not None else a, dtype=file_np)
            raw = a.view(np.uint8).reshape(-1)
        else:  # bf16 on either side: torch converts
            if perm is not None:
                chunk = chunk[..., perm[0]]
            chunk = chunk.to(dtype=_torch_dtype(self.kv_dtype, "kv_dtype")).contiguous()
            raw = chunk.view(torch.uint8).reshape(-1).numpy()
        lo = offset - t0 * row_bytes
        np.frombuffer(dest, dtype=np.uint8)[:] = raw[lo : lo + len(dest)]

    # ---- SessionTarget (restore) ---------------------------------------------------------------
    def limits(self) -> EngineLimits:
        return EngineLimits(
            max_tokens=int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 24),
            vocab_size=int(self.model.config.vocab_size),
        )

    def check_plan(self, plan: RestorePlan) -> None:
        st = plan.state
        if st.position != st.n_tokens:
            raise E.InconsistentState(
                f"position {st.position} differs from the {st.n_tokens} tokens held",
                path=plan.path,
                field="state.position",
            )
        layers = self.model.layers
        if len(plan.layers) != len(layers):
            raise E.CacheGeometryMismatch(
                f"{len(plan.layers)} layers; the model has {len(layers)}", path=plan.path, field="layers"
            )
        for i, (g, la) in enumerate(zip(plan.layers, layers, strict=True)):
            s = g.spec
            for dt, name in ((s.k_dtype, "k_dtype"), (s.v_dtype, "v_dtype")):
                _torch_dtype(dt, f"layers[{i}].{name}")
            want = la.spec(s.k_dtype)
            have = attrs.evolve(s, v_dtype=s.k_dtype)
            if have != want:
                raise E.CacheGeometryMismatch(
                    f"layer {i} is (index, role, heads, dk, dv, window, extra) "
                    f"{(s.index, s.role.name, s.n_kv_heads, s.head_dim_k, s.head_dim_v, s.window, s.extra_bytes)}; "
                    f"the model's {(la.index, 'MAIN', la.n_kv_heads, la.head_dim, la.head_dim, la.window, 0)}",
                    path=plan.path,
                    field=f"layers[{i}]",
                )
        self._plan = plan

    def begin_apply(self, plan: RestorePlan) -> None:
        np = _libs()[0]
        if self._plan is not plan:
            raise E.AdapterFailed("the cache was asked to apply a plan it did not check")
        self._incoming = [[np.empty(g.part_size(p), dtype=np.uint8) for p in Part] for g in plan.layers]

    def copy_in(self, layer: int, part: Part, offset: int, src: memoryview) -> None:
        np = _libs()[0]
        assert self._incoming is not None
        self._incoming[layer][part][offset : offset + len(src)] = np.frombuffer(src, dtype=np.uint8)

    def commit(self, state: RunningState) -> None:
        plan, incoming = self._plan, self._incoming
        if plan is None or incoming is None:
            raise E.AdapterFailed("commit without a plan the cache checked and applied")
        _np, torch, cache_utils = _libs()
        cache = cache_utils.DynamicCache(config=self.model.config)
        built = []
        for i, (g, la) in enumerate(zip(plan.layers, self.model.layers, strict=True)):
            layer = _layer(cache_utils, la)
            if g.tokens_held:
                k, v = (self._tensor(incoming[i][p], g, la, p, torch) for p in (Part.K, Part.V))
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k, v
            if la.window:
                layer.cumulative_length = state.n_tokens
            incoming[i] = []  # this layer's file bytes are no longer needed
            built.append(layer)
        cache.layers = built
        self.cache, self.state = cache, state
        self._incoming, self._plan = None, None

    def _tensor(self, raw: Any, g: LayerGeometry, la: CacheLayer, part: Part, torch: Any) -> Any:
        """A part's file bytes as transformers' [1, heads, held, dim] tensor in the cache dtype."""
        np = _libs()[0]
        dt = g.spec.k_dtype if part is Part.K else g.spec.v_dtype
        perm = self.model.k_permutation(la.head_dim) if part is Part.K else None
        shape = (g.tokens_held, la.n_kv_heads, la.head_dim)
        file_np, cache_dt = NUMPY_DTYPES.get(dt), _file_dtype(self.dtype, "dtype")
        if file_np is not None and cache_dt in NUMPY_DTYPES:
            # numpy: the gather writes [heads, held, dim] in order, the cast is skipped where dtypes agree
            x = raw.view(file_np).reshape(shape).transpose(1, 0, 2)
            y = np.ascontiguousarray(x[..., perm[1]] if perm is not None else x, dtype=NUMPY_DTYPES[cache_dt])
            return torch.from_numpy(y).unsqueeze(0)
        x = torch.from_numpy(raw).view(_torch_dtype(dt, f"layers[{la.index}]")).view(shape)
        if perm is not None:
            x = x[..., perm[1]]
        return x.transpose(0, 1).unsqueeze(0).to(self.dtype).contiguous()

    def fail_stop(self, error: Exception) -> None:
        """The bytes being applied cannot be vouched for: dropped (the held cache was never touched)."""
        self.failed = error
        self.discard()

    def discard(self) -> None:
        """What a restore built aside is dropped (the held cache was never touched)."""
        self._incoming, self._plan = None, None

    # ---- LandingTarget: the file is read straight into the bytes the commit converts ---------------
    def can_land(self, plan: RestorePlan) -> bool:
        return True

    def landing_views(self, layer: int, part: Part, offset: int, length: int) -> Sequence[memoryview]:
        assert self._incoming is not None
        return [memoryview(self._incoming[layer][part][offset : offset + length])]


# --- the two calls --------------------------------------------------------------------------------------
def save_cache(
    model: GGUFModel,
    cache: Any,
    tokens: Iterable[int],
    path: str | os.PathLike,
    *,
    kv_dtype: DType | str | None = None,
    config: ConfigIdentity | Mapping[str, Any] | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    compression: Any = None,
    key: Any = None,
) -> SaveReport:
    """Write ``cache`` (the K/V of ``tokens``, one sequence) as a format v1 file at ``path`` (crash-safe),
    bound to ``model``'s GGUF. ``config``: the config identity of the engine that will restore it (e.g.
    ``strata_engine.session.runner_identity(runner).config``); default: ``transformers_config``."""
    session = CacheSession(model, cache, tokens, kv_dtype=kv_dtype, config=config)
    return save(path, session, block_size=block_size, compression=compression, key=key)


def load_cache(
    model: GGUFModel,
    path: str | os.PathLike,
    *,
    dtype: Any = None,
    config: ConfigIdentity | Mapping[str, Any] | None = None,
    mode: str = "auto",
    block_size: int = DEFAULT_BLOCK_SIZE,
    key: Any = None,
) -> tuple[Any, list[int]]:
    """A format v1 file of ``model``'s GGUF (any engine's: the model fingerprint must be the GGUF's, every
    layer the model's) as a new DynamicCache in ``dtype`` and its tokens. ``config``: require this config
    identity; default: the file's own (its engine's settings do not change what the K/V rows mean here)."""
    cfg = config if config is not None else config_of(path)
    session = CacheSession(model, dtype=dtype, config=cfg)
    restore(path, session, mode=mode, block_size=block_size, key=key)
    return session.cache, list(session.state.tokens)
