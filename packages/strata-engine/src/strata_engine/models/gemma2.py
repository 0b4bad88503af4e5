"""The gemma2 family (Gemma 2 text models).

x = embed(tokens) * sqrt(E)
for each layer il (local when il % 2 == 0: the file's sliding window; global otherwise: full attention;
                   one RoPE base):
    h = rms_norm(x) * attn_norm                                  (norm weights already hold the +1)
    q, k, v = h Wq^T, h Wk^T, h Wv^T
    q, k = rope_neox(q, k, pos)                                  (rotate-half)
    s = q k^T * attn_scale                                       (1/sqrt(D); 1/sqrt(E/H) for the 27B)
    s = attn_softcap * tanh(s / attn_softcap)                    (attention logit soft-cap)
    a = softmax(s + causal/window mask) v Wo^T
    x = x + rms_norm(a) * post_attention_norm
    h = rms_norm(x) * ffn_norm
    m = (gelu_tanh(h Wg^T) * h Wu^T) Wd^T
    x = x + rms_norm(m) * post_ffw_norm
z = (rms_norm(x_last) * output_norm) token_embd^T                (tied output)
logits = final_softcap * tanh(z / final_softcap)                 (final logit soft-cap)

The pass itself is `common.Decoder`'s; the caps are the config's (`attn_softcap`, `final_softcap`).
"""

from __future__ import annotations

from ..config import ModelConfig
from ..ops import Ops
from .common import Decoder, DecoderLayer, TensorCensus, attention_weights, mlp_weights


class Gemma2Model(Decoder):
    def __init__(self, config: ModelConfig, ops: Ops, w: TensorCensus):
        """w: the weights' loader (`WeightLoader`), or a `TensorCensus` that only names them."""
        super().__init__(config, ops, w)
        E = config.n_embd
        self.layers = [
            DecoderLayer(
                **attention_weights(config, w, i),
                **mlp_weights(config, w, i),
                post_attn_norm=w(f"blk.{i}.post_attention_norm.weight", (E,)),
                post_ffn_norm=w(f"blk.{i}.post_ffw_norm.weight", (E,)),
            )
            for i in range(config.n_layer)
        ]
