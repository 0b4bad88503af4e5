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
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from ..config import ModelConfig
from ..gguf import GGUFFile
from ..ops import NumpyOps
from .common import KVAccess, WeightLoader


@attrs.frozen(eq=False)
class Gemma3Layer:
    attn_norm: Any  # [E]
    wq: Any  # [H*D, E]
    wk: Any  # [Hkv*D, E]
    wv: Any  # [Hkv*D, E]
    q_norm: Any  # [D]
    k_norm: Any  # [D]
    wo: Any  # [E, H*D]
    post_attn_norm: Any  # [E]
    ffn_norm: Any  # [E]
    w_gate: Any  # [F, E]
    w_up: Any  # [F, E]
    w_down: Any  # [E, F]
    post_ffn_norm: Any  # [E]


class Gemma3Model:
    def __init__(self, config: ModelConfig, ops: NumpyOps, gguf_file: GGUFFile):
        self.config = c = config
        self.ops = ops
        w = WeightLoader(gguf_file, ops)
        E, F, H, Hkv, D = c.n_embd, c.n_ff, c.n_head, c.n_head_kv, c.head_dim
        self.tok_embd = w("token_embd.weight", (c.n_vocab, E))
        self.output_norm = w("output_norm.weight", (E,))
        self.output = self.tok_embd if c.tied_output else w("output.weight", (c.n_vocab, E))
        self.layers = [
            Gemma3Layer(
                attn_norm=w(f"blk.{i}.attn_norm.weight", (E,)),
                wq=w(f"blk.{i}.attn_q.weight", (H * D, E)),
                wk=w(f"blk.{i}.attn_k.weight", (Hkv * D, E)),
                wv=w(f"blk.{i}.attn_v.weight", (Hkv * D, E)),
                q_norm=w(f"blk.{i}.attn_q_norm.weight", (D,)),
                k_norm=w(f"blk.{i}.attn_k_norm.weight", (D,)),
                wo=w(f"blk.{i}.attn_output.weight", (E, H * D)),
                post_attn_norm=w(f"blk.{i}.post_attention_norm.weight", (E,)),
                ffn_norm=w(f"blk.{i}.ffn_norm.weight", (E,)),
                w_gate=w(f"blk.{i}.ffn_gate.weight", (F, E)),
                w_up=w(f"blk.{i}.ffn_up.weight", (F, E)),
                w_down=w(f"blk.{i}.ffn_down.weight", (E, F)),
                post_ffn_norm=w(f"blk.{i}.post_ffw_norm.weight", (E,)),
            )
            for i in range(c.n_layer)
        ]

    def forward(self, tokens: np.ndarray, pos0: int, kv: KVAccess, want_logits: bool) -> np.ndarray | None:
        """Evaluate tokens at positions pos0..; store their K/V; logits [V] of the last one if asked."""
        c, ops = self.config, self.ops
        T = len(tokens)
        tables = {
            base: ops.rope_tables(pos0, T, base, c.rope_dim) for base in {lc.rope_base for lc in c.layers}
        }
        x = ops.embed(self.tok_embd, tokens, scale=c.embed_scale)  # [T, E]
        for il, layer in enumerate(self.layers):
            lc = c.layers[il]
            cos, sin = tables[lc.rope_base]
            h = ops.rms_norm(x, layer.attn_norm, c.rms_eps)
            q = ops.matmul(h, layer.wq).reshape(T, c.n_head, c.head_dim)
            k = ops.matmul(h, layer.wk).reshape(T, c.n_head_kv, c.head_dim)
            v = ops.matmul(h, layer.wv).reshape(T, c.n_head_kv, c.head_dim)
            q = ops.rope(ops.rms_norm(q, layer.q_norm, c.rms_eps), cos, sin, c.rope_style)
            k = ops.rope(ops.rms_norm(k, layer.k_norm, c.rms_eps), cos, sin, c.rope_style)
            k_ctx, v_ctx, k_pos0 = kv.attend_kv(il, pos0, k, v)
            q_pos0 = pos0
            if il == c.n_layer - 1:  # past the last K/V write only the logits' row matters
                if not want_logits:
                    return None
                q, x, q_pos0 = q[-1:], x[-1:], pos0 + T - 1
            attn = ops.attention(
                q, k_ctx, v_ctx, q_pos0=q_pos0, k_pos0=k_pos0, window=lc.window, scale=c.attn_scale
            )
            x = x + ops.rms_norm(ops.matmul(attn, layer.wo), layer.post_attn_norm, c.rms_eps)
            h = ops.rms_norm(x, layer.ffn_norm, c.rms_eps)
            m = ops.gated_mlp(h, layer.w_gate, layer.w_up, layer.w_down, c.activation)
            x = x + ops.rms_norm(m, layer.post_ffn_norm, c.rms_eps)
        x_last = ops.rms_norm(x[-1:], self.output_norm, c.rms_eps)
        return ops.logits(x_last, self.output)[0]
