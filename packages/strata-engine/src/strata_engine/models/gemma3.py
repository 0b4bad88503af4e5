"""The gemma3 family (Gemma 3 text models).

x = embed(tokens) * sqrt(E)
for each layer il (global when il % 6 == 5: full attention, rope base 1e6;
                   local otherwise: 512-token sliding window, rope base 1e4):
    h = rms_norm(x) * attn_norm                                  (norm weights already hold the +1)
    q, k, v = h Wq^T, h Wk^T, h Wv^T
    q, k = rms_norm_per_head(q) * q_norm, rms_norm_per_head(k) * k_norm
    q, k = rope_neox(q, k, pos, base_il)                         (rotate-half)
    a = softmax(q k^T / sqrt(256) + causal/window mask) v Wo^T
    x = x + rms_norm(a) * post_attention_norm
    h = rms_norm(x) * ffn_norm
    m = (gelu_tanh(h Wg^T) * h Wu^T) Wd^T
    x = x + rms_norm(m) * post_ffw_norm
logits = (rms_norm(x_last) * output_norm) token_embd^T            (tied output)

The pass itself is `common.Decoder`'s.
"""

from __future__ import annotations

from ..config import ModelConfig
from ..ops import Ops
from .common import Decoder, DecoderLayer, TensorCensus, attention_weights, mlp_weights


class Gemma3Model(Decoder):
    def __init__(self, config: ModelConfig, ops: Ops, w: TensorCensus):
        """w: the weights' loader (`WeightLoader`), or a `TensorCensus` that only names them."""
        super().__init__(config, ops, w)
        E, D = config.n_embd, config.head_dim
        self.layers = [
            DecoderLayer(
                **attention_weights(config, w, i),
                **mlp_weights(config, w, i),
                q_norm=w(f"blk.{i}.attn_q_norm.weight", (D,)),
                k_norm=w(f"blk.{i}.attn_k_norm.weight", (D,)),
                post_attn_norm=w(f"blk.{i}.post_attention_norm.weight", (E,)),
                post_ffn_norm=w(f"blk.{i}.post_ffw_norm.weight", (E,)),
            )
            for i in range(config.n_layer)
        ]
