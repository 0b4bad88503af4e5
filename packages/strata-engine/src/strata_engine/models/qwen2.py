"""The qwen2 family (Qwen2 and Qwen2.5).

x = embed(tokens)
for each layer:
    h = rms_norm(x) * attn_norm
    q, k, v = h Wq^T + bq, h Wk^T + bk, h Wv^T + bv
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


class Qwen2Model(Decoder):
    def __init__(self, config: ModelConfig, ops: Ops, w: TensorCensus):
        """w: the weights' loader (`WeightLoader`), or a `TensorCensus` that only names them."""
        super().__init__(config, ops, w)
        H, Hkv, D = config.n_head, config.n_head_kv, config.head_dim
        self.layers = [
            DecoderLayer(
                **attention_weights(config, w, i),
                **mlp_weights(config, w, i),
                bqkv=w.fused(
                    (f"blk.{i}.attn_q.bias", (H * D,)),
                    (f"blk.{i}.attn_k.bias", (Hkv * D,)),
                    (f"blk.{i}.attn_v.bias", (Hkv * D,)),
                ),
            )
            for i in range(config.n_layer)
        ]
