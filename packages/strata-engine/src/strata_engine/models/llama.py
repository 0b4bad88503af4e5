"""The llama family (SmolLM2, Llama 3.x, Mistral-style files: all `llama` GGUFs).

x = embed(tokens)
for each layer:
    h = rms_norm(x) * attn_norm
    q, k, v = h Wq^T, h Wk^T, h Wv^T            (GGUF rows are permuted for interleaved RoPE)
    q, k = rope_interleaved(q, k, pos)          (theta_i = pos * base^(-2i/D) / rope_freqs[i]: Llama 3.x)
    x = x + softmax(q k^T / sqrt(D) + causal) v Wo^T     (GQA: Hkv K/V heads, H/Hkv queries each)
    h = rms_norm(x) * ffn_norm
    x = x + (silu(h Wg^T) * h Wu^T) Wd^T
logits = (rms_norm(x_last) * output_norm) W_out^T           (W_out = token_embd when tied)

The pass itself is `common.Decoder`'s; `rope_freqs.weight`, where present, is read by the config (its
`rope_factors`).
"""

from __future__ import annotations

from ..config import ModelConfig
from ..ops import Ops
from .common import Decoder, DecoderLayer, TensorCensus, attention_weights, mlp_weights


class LlamaModel(Decoder):
    def __init__(self, config: ModelConfig, ops: Ops, w: TensorCensus):
        """w: the weights' loader (`WeightLoader`), or a `TensorCensus` that only names them."""
        super().__init__(config, ops, w)
        self.layers = [
            DecoderLayer(**attention_weights(config, w, i), **mlp_weights(config, w, i))
            for i in range(config.n_layer)
        ]
