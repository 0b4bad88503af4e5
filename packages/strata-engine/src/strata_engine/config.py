"""ModelConfig: the shape and arithmetic of a model, from GGUF metadata plus the architecture facts the
files leave out (a table per family, `ARCHITECTURES`).

Unknown architectures raise `UnsupportedArchitecture` naming the architecture; missing or impossible
metadata raises `ModelConfigError` listing every problem at once, and a key the engine would not compute
(accounting.py) raises its subclass `UncomputedModelPart`, each such key named.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from typing import Any

import attrs

from .accounting import uncomputed_keys
from .errors import ModelConfigError, UncomputedModelPart, UnsupportedArchitecture
from .gguf import GGUFFile, dequantize_tensor


class RopeStyle(enum.Enum):
    """How RoPE pairs the dimensions of a head."""

    INTERLEAVED = "interleaved"  # pairs (2i, 2i+1): llama GGUFs (Q/K rows stored permuted for it)
    NEOX = "neox"  # pairs (i, i + d/2), "rotate half": gemma3, qwen2, qwen3


class Activation(enum.Enum):
    SILU = "silu"  # SwiGLU: silu(gate) * up
    GELU_TANH = "gelu_tanh"  # GeGLU with the tanh approximation of gelu


@attrs.frozen
class LayerConfig:
    """Per-layer attention facts. `window` None = full causal attention; N = a query at position p
    sees keys at positions p - N + 1 .. p (llama.cpp's and transformers' sliding-window rule)."""

    rope_base: float
    window: int | None


@attrs.frozen
class LongRope:
    """Phi-3's longrope scaling: RoPE frequency divisors for a context up to `original_context` tokens
    (`short`) and beyond (`long`), chosen by the context the model runs with (llama.cpp's rule), and cos / sin
    multiplied by `attn_factor`."""

    original_context: int
    short: tuple[float, ...]
    long: tuple[float, ...]
    attn_factor: float


@attrs.frozen
class ModelConfig:
    architecture: str
    n_vocab: int
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_dim: int
    n_ctx_train: int
    rms_eps: float
    rope_style: RopeStyle
    activation: Activation
    attn_scale: float
    embed_scale: float
    qk_norm: bool
    post_norms: bool
    tied_output: bool
    layers: tuple[LayerConfig, ...]
    # RoPE frequency divisors [rope_dim / 2] (llama.cpp's freq_factors: theta_i = p * base^(-2i/d) / factors[i]):
    # a Llama 3.x file's `rope_freqs.weight`; None: all 1
    rope_factors: tuple[float, ...] | None = None
    qkv_bias: bool = False  # Q/K/V projections add a bias (qwen2)
    # tensors the config builder read (their values are in the config): accounted for as computed
    config_tensors: tuple[str, ...] = ()
    rope_scale: float = 1.0  # cos / sin multiplied by it (longrope's attention factor)
    long_rope: LongRope | None = None  # `for_context` resolves it into rope_factors and rope_scale
    # soft-caps (gemma2): scores s -> cap * tanh(s / cap) after the scaling, logits likewise; 0 = none
    attn_softcap: float = 0.0
    final_softcap: float = 0.0

    def for_context(self, n_ctx: int) -> ModelConfig:
        """The config as it computes with n_ctx positions a conversation (longrope's factors chosen)."""
        lr = self.long_rope
        if lr is None:
            return self
        factors = lr.long if n_ctx > lr.original_context else lr.short
        return attrs.evolve(self, rope_factors=factors, rope_scale=lr.attn_factor)

    @property
    def n_group(self) -> int:
        """Query heads per K/V head (GQA)."""
        return self.n_head // self.n_head_kv

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def has_sliding_window(self) -> bool:
        return any(layer.window is not None for layer in self.layers)

    @property
    def max_window(self) -> int | None:
        windows = [layer.window for layer in self.layers if layer.window is not None]
        return max(windows) if windows else None

    def rope_fingerprint(self) -> list[dict[str, Any]]:
        """The resolved RoPE configuration per layer (part of the session file's config fingerprint; the
        factors only where a file has them, so files without keep the fingerprint they had)."""
        factors: dict[str, Any] = {} if self.rope_factors is None else {"factors": list(self.rope_factors)}
        if self.rope_scale != 1.0:
            factors["scale"] = self.rope_scale
        return [
            {
                "style": self.rope_style.value,
                "base": layer.rope_base,
                "dim": self.rope_dim,
                "window": layer.window,
                **factors,
            }
            for layer in self.layers
        ]

    @classmethod
    def from_gguf(cls, gguf_file: GGUFFile) -> ModelConfig:
        arch = gguf_file.architecture
        builder = ARCHITECTURES.get(arch)
        if builder is None:
            raise UnsupportedArchitecture(
                f"{gguf_file.path}: architecture {arch!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})"
            )
        return builder(_Meta(gguf_file, arch))


class _Meta:
    """Typed access to `<arch>.*` metadata that collects problems instead of failing on the first, and records
    every key the builder reads (the rest must be harmless: accounting.py)."""

    def __init__(self, gguf_file: GGUFFile, arch: str):
        self.file = gguf_file
        self.arch = arch
        self.problems: list[str] = []
        self.read: set[str] = set()
        self.tensors_read: list[str] = []

    def get(self, key: str, kind: type, default: Any = None, *, required: bool = True) -> Any:
        full = f"{self.arch}.{key}"
        self.read.add(full)
        value = self.file.metadata.get(full)
        if value is None:
            if required and default is None:
                self.problems.append(f"{full} is missing")
            return default
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
            self.problems.append(f"{full} must be {kind.__name__}, got {type(value).__name__}")
            return default
        return value

    def positive(self, key: str, default: int | None = None) -> int:
        value = self.get(key, int, default)
        if value is not None and value <= 0:
            self.problems.append(f"{self.arch}.{key} must be positive, got {value}")
        return value if value is not None else 1

    def vocab_size(self) -> int:
        info = self.file.tensors.get("token_embd.weight")
        stated = self.get("vocab_size", int, required=False)
        if info is None:
            self.problems.append("tensor token_embd.weight is missing")
            return 1
        if stated is not None and stated != info.shape[0]:
            self.problems.append(
                f"{self.arch}.vocab_size {stated} differs from token_embd.weight's {info.shape[0]} rows"
            )
        return info.shape[0]

    def tensor_values(self, name: str, shape: tuple[int, ...]) -> tuple[float, ...] | None:
        """A small tensor the config holds by value (RoPE factors), checked for shape; None where absent."""
        info = self.file.tensors.get(name)
        if info is None:
            return None
        if info.shape != shape:
            self.problems.append(f"tensor {name} has shape {info.shape}, expected {shape}")
            return None
        self.tensors_read.append(name)
        return tuple(float(v) for v in dequantize_tensor(self.file, name).reshape(-1))

    def finish(self) -> None:
        uncomputed = uncomputed_keys(self.file, self.arch, self.read)
        if self.problems or uncomputed:
            error = UncomputedModelPart if uncomputed else ModelConfigError
            raise error([f"{self.file.path}: {p}" for p in self.problems + uncomputed])


def _common(m: _Meta) -> dict[str, Any]:
    n_embd = m.positive("embedding_length")
    n_head = m.positive("attention.head_count")
    n_head_kv = m.positive("attention.head_count_kv", n_head)
    head_dim = m.positive("attention.key_length", n_embd // n_head)
    value_dim = m.positive("attention.value_length", head_dim)
    if value_dim != head_dim:
        m.problems.append(f"value length {value_dim} differs from key length {head_dim} (not supported)")
    if n_head % n_head_kv:
        m.problems.append(f"head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
    return dict(
        n_vocab=m.vocab_size(),
        n_embd=n_embd,
        n_ff=m.positive("feed_forward_length"),
        n_layer=m.positive("block_count"),
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        rope_dim=m.positive("rope.dimension_count", head_dim),
        n_ctx_train=m.positive("context_length"),
        rms_eps=m.get("attention.layer_norm_rms_epsilon", float, 1e-5),
        tied_output="output.weight" not in m.file.tensors,
    )


def _standard(
    m: _Meta, arch: str, rope_style: RopeStyle, *, reads_rope_factors: bool = False, reads_window: bool = False,
    **facts: Any,
) -> ModelConfig:  # fmt: skip
    """A pre-norm SwiGLU decoder with one RoPE base and one attention span for every layer (llama, qwen2, qwen3,
    phi3): what differs is the RoPE pairing, whether the file may carry RoPE factors or a sliding window (every
    layer's: phi3; 0 = none), and the facts given (biases, QK norms)."""
    c = _common(m)
    rope_base = m.get("rope.freq_base", float, 10000.0)
    rope_factors = m.tensor_values(ROPE_FACTORS_TENSOR, (c["rope_dim"] // 2,)) if reads_rope_factors else None
    window = m.get("attention.sliding_window", int, 0) if reads_window else 0
    if window < 0:
        m.problems.append(f"{m.arch}.attention.sliding_window must not be negative, got {window}")
    m.finish()
    return ModelConfig(
        architecture=arch,
        rope_style=rope_style,
        activation=Activation.SILU,
        attn_scale=1.0 / math.sqrt(c["head_dim"]),
        embed_scale=1.0,
        post_norms=False,
        layers=tuple(LayerConfig(rope_base=rope_base, window=window or None) for _ in range(c["n_layer"])),
        rope_factors=rope_factors,
        config_tensors=tuple(m.tensors_read),
        **facts,
        **c,
    )


# Llama 3.x's RoPE scaling: the converter writes the per-frequency divisors as this tensor (no metadata key).
ROPE_FACTORS_TENSOR = "rope_freqs.weight"


def _llama(m: _Meta) -> ModelConfig:
    return _standard(m, "llama", RopeStyle.INTERLEAVED, reads_rope_factors=True, qk_norm=False)


def _qwen2(m: _Meta) -> ModelConfig:
    return _standard(m, "qwen2", RopeStyle.NEOX, qk_norm=False, qkv_bias=True)


def _qwen3(m: _Meta) -> ModelConfig:
    return _standard(m, "qwen3", RopeStyle.NEOX, qk_norm=True)


def _long_rope(m: _Meta, rope_dim: int) -> LongRope | None:
    """Phi-3's longrope factors (both tensors, with their original context and attention factor), or None."""
    short = m.tensor_values("rope_factors_short.weight", (rope_dim // 2,))
    long = m.tensor_values("rope_factors_long.weight", (rope_dim // 2,))
    if short is None and long is None:
        return None
    if short is None or long is None:
        m.problems.append("longrope needs both rope_factors_short.weight and rope_factors_long.weight")
        return None
    return LongRope(
        original_context=m.positive("rope.scaling.original_context_length"),
        short=short,
        long=long,
        attn_factor=m.get("rope.scaling.attn_factor", float, 1.0),
    )


def _phi3(m: _Meta) -> ModelConfig:
    # the window as transformers applies it (llama.cpp b11549 turns Phi-3's off: it differs past the window)
    long_rope = _long_rope(m, m.get("rope.dimension_count", int, required=False) or 0)
    config = _standard(m, "phi3", RopeStyle.NEOX, reads_window=True, qk_norm=False)
    return attrs.evolve(config, long_rope=long_rope)


# gemma3 facts the GGUF leaves out: every 6th layer (il % 6 == 5) is global with the file's rope base
# (1e6); the others use a sliding window with rope base 10000; attention scale is
# query_pre_attn_scalar^-1/2 = 256^-1/2 for the released sizes; embeddings are scaled by sqrt(n_embd).
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_QUERY_PRE_ATTN_SCALAR = 256


def _gemma3(m: _Meta) -> ModelConfig:
    c = _common(m)
    global_base = m.get("rope.freq_base", float, 1_000_000.0)
    window = m.positive("attention.sliding_window", 512)
    m.finish()
    layers = tuple(
        LayerConfig(rope_base=global_base, window=None)
        if il % GEMMA3_GLOBAL_EVERY == GEMMA3_GLOBAL_EVERY - 1
        else LayerConfig(rope_base=GEMMA3_LOCAL_ROPE_BASE, window=window)
        for il in range(c["n_layer"])
    )
    return ModelConfig(
        architecture="gemma3",
        rope_style=RopeStyle.NEOX,
        activation=Activation.GELU_TANH,
        attn_scale=1.0 / math.sqrt(GEMMA3_QUERY_PRE_ATTN_SCALAR),
        embed_scale=math.sqrt(c["n_embd"]),
        qk_norm=True,
        post_norms=True,
        layers=layers,
        **c,
    )


# gemma2 facts, as llama.cpp b11549 fills in what the file leaves out: every other layer (il % 2 == 0) uses the
# sliding window (4096 unless the file says), the rest full attention, one RoPE base; the soft-caps default to
# 50 (attention scores) and 30 (logits); the attention scale is 1/sqrt(head_dim), but 1/sqrt(n_embd / n_head)
# for the 46-layer (27B) model, whose query_pre_attn_scalar is that. The output is token_embd whatever the file
# holds (an output.weight is then unread, so refused: llama.cpp's gemma2 never reads one).
GEMMA2_LOCAL_EVERY = 2
GEMMA2_DEFAULT_WINDOW = 4096
GEMMA2_DEFAULT_ATTN_SOFTCAP = 50.0
GEMMA2_DEFAULT_FINAL_SOFTCAP = 30.0
GEMMA2_27B_LAYERS = 46


def _gemma2(m: _Meta) -> ModelConfig:
    c = _common(m)
    rope_base = m.get("rope.freq_base", float, 10000.0)
    window = m.positive("attention.sliding_window", GEMMA2_DEFAULT_WINDOW)
    attn_softcap = m.get("attn_logit_softcapping", float, GEMMA2_DEFAULT_ATTN_SOFTCAP)
    final_softcap = m.get("final_logit_softcapping", float, GEMMA2_DEFAULT_FINAL_SOFTCAP)
    for key, cap in (("attn_logit_softcapping", attn_softcap), ("final_logit_softcapping", final_softcap)):
        if not cap > 0:  # llama.cpp divides by it: 0 or less is no cap it computes
            m.problems.append(f"gemma2.{key} must be positive, got {cap}")
    m.finish()
    query_scalar = c["n_embd"] // c["n_head"] if c["n_layer"] == GEMMA2_27B_LAYERS else c["head_dim"]
    layers = tuple(
        LayerConfig(rope_base=rope_base, window=window if il % GEMMA2_LOCAL_EVERY == 0 else None)
        for il in range(c["n_layer"])
    )
    return ModelConfig(
        architecture="gemma2",
        rope_style=RopeStyle.NEOX,
        activation=Activation.GELU_TANH,
        attn_scale=1.0 / math.sqrt(query_scalar),
        embed_scale=math.sqrt(c["n_embd"]),
        qk_norm=False,
        post_norms=True,
        layers=layers,
        attn_softcap=attn_softcap,
        final_softcap=final_softcap,
        **{**c, "tied_output": True},
    )


ARCHITECTURES: dict[str, Callable[[_Meta], ModelConfig]] = {
    "llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "phi3": _phi3, "gemma2": _gemma2, "gemma3": _gemma3,
}  # fmt: skip
