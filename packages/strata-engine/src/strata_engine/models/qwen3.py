"""The qwen3 family (Qwen3 dense models).

x = embed(tokens)
for each layer:
    h = rms_norm(x) * attn_norm
    q, k, v = h Wq^T, h Wk^T, h Wv^T                          (D = key_length, H * D need not be E)
    q, k = rms_norm_per_head(q) * q_norm, rms_norm_per_head(k) * k_norm
    q, k = rope_neox(q, k, pos)                              (rotate-half)
    x = x + softmax(q k^T / sqrt(D) + causal) v Wo^T         (GQA)
    h = rms_norm(x) * ffn_norm
    x = x + (silu(h Wg^T) * h Wu^T) Wd^T
logits = (rms_norm(x_last) * output_norm) W_out^T           (W_out = token_embd when tied)

The pass itself is `common.Decoder`'s.
"""

from __future__ import annotations

from ..config import ModelConfig
from ..ops import Ops
from .common import Decoder, DecoderLayer, TensorCensus, attention_weights, mlp_weights


class Qwen3Model(Decoder):
    def __init__(self, config: ModelConfig, ops: Ops, w: TensorCensus):
        """w: the weights' loader (`WeightLoader`), or a `TensorCensus` that only names them."""
        super().__init__(config, ops, w)
        D = config.head_dim
        self.layers = [
            DecoderLayer(
                **attention_weights(config, w, i),
                **mlp_weights(config, w, i),
                q_norm=w(f"blk.{i}.attn_q_norm.weight", (D,)),
                k_norm=w(f"blk.{i}.attn_k_norm.weight", (D,)),
            )
            for i in range(config.n_layer)
        ]
