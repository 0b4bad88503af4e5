"""The phi3 family (Phi-3, Phi-3.5 and Phi-4-mini).

x = embed(tokens)
for each layer:
    h = rms_norm(x) * attn_norm
    q | k | v = h Wqkv^T                                     (one fused tensor, attn_qkv)
    q, k = rope_neox(q, k, pos)       (rotate-half; longrope: theta_i / factors[i], cos and sin times attn_factor,
                                       the long factors where the context exceeds the original one)
    x = x + softmax(q k^T / sqrt(D) + causal/window mask) v Wo^T    (every layer's window: sliding_window)
    h = rms_norm(x) * ffn_norm
    g | u = h Wgu^T                                          (one fused tensor, ffn_up: [Wg; Wu])
    x = x + (silu(g) * u) Wd^T
logits = (rms_norm(x_last) * output_norm) W_out^T

The pass itself is `common.Decoder`'s: the file's fused tensors are its stacked [Wq; Wk; Wv] and [Wg; Wu];
the longrope factors (`rope_factors_long/short.weight`) are read by the config (`ModelConfig.for_context`).
"""

from __future__ import annotations

from ..config import ModelConfig
from ..ops import Ops
from .common import Decoder, DecoderLayer, TensorCensus


class Phi3Model(Decoder):
    def __init__(self, config: ModelConfig, ops: Ops, w: TensorCensus):
        """w: the weights' loader (`WeightLoader`), or a `TensorCensus` that only names them."""
        super().__init__(config, ops, w)
        c = config
        E, F, H, Hkv, D = c.n_embd, c.n_ff, c.n_head, c.n_head_kv, c.head_dim
        self.layers = [
            DecoderLayer(
                attn_norm=w(f"blk.{i}.attn_norm.weight", (E,)),
                wqkv=w(f"blk.{i}.attn_qkv.weight", ((H + 2 * Hkv) * D, E)),
                wo=w(f"blk.{i}.attn_output.weight", (E, H * D)),
                ffn_norm=w(f"blk.{i}.ffn_norm.weight", (E,)),
                w_gate_up=w(f"blk.{i}.ffn_up.weight", (2 * F, E)),
                w_down=w(f"blk.{i}.ffn_down.weight", (E, F)),
            )
            for i in range(c.n_layer)
        ]
