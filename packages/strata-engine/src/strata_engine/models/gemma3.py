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

Wq, Wk, Wv are stored stacked as one [Wq; Wk; Wv] and Wg, Wu as [Wg; Wu] (one product each on the
GPU); each residual add is fused with the norm that follows it (`add_rms_norm`).

The rows may belong to several conversations (`Rows`: a batched decode step has one row per slot): every
step is row-wise except the K/V store and attention, which each conversation's rows do in and over its own
slot's K/V, with RoPE at each row's own position.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from ..config import ModelConfig
from ..ops import Ops
from .common import RopeTables, Rows, TensorCensus, rope_tables


@attrs.frozen(eq=False)
class Gemma3Layer:
    attn_norm: Any  # [E]
    wqkv: Any  # [(H + 2 Hkv) D, E] = [Wq; Wk; Wv]
    q_norm: Any  # [D]
    k_norm: Any  # [D]
    wo: Any  # [E, H*D]
    post_attn_norm: Any  # [E]
    ffn_norm: Any  # [E]
    w_gate_up: Any  # [2F, E] = [Wg; Wu]
    w_down: Any  # [E, F]
    post_ffn_norm: Any  # [E]


class Gemma3Model:
    def __init__(self, config: ModelConfig, ops: Ops, w: TensorCensus):
        """w: the weights' loader (`WeightLoader`), or a `TensorCensus` that only names them."""
        self.config = c = config
        self.ops = ops
        E, F, H, Hkv, D = c.n_embd, c.n_ff, c.n_head, c.n_head_kv, c.head_dim
        self.qkv_sizes = (H * D, Hkv * D, Hkv * D)
        self.tok_embd = w("token_embd.weight", (c.n_vocab, E))
        self.output_norm = w("output_norm.weight", (E,))
        self.output = self.tok_embd if c.tied_output else w("output.weight", (c.n_vocab, E))
        self.layers = [
            Gemma3Layer(
                attn_norm=w(f"blk.{i}.attn_norm.weight", (E,)),
                wqkv=w.fused(
                    (f"blk.{i}.attn_q.weight", (H * D, E)),
                    (f"blk.{i}.attn_k.weight", (Hkv * D, E)),
                    (f"blk.{i}.attn_v.weight", (Hkv * D, E)),
                ),
                q_norm=w(f"blk.{i}.attn_q_norm.weight", (D,)),
                k_norm=w(f"blk.{i}.attn_k_norm.weight", (D,)),
                wo=w(f"blk.{i}.attn_output.weight", (E, H * D)),
                post_attn_norm=w(f"blk.{i}.post_attention_norm.weight", (E,)),
                ffn_norm=w(f"blk.{i}.ffn_norm.weight", (E,)),
                w_gate_up=w.fused((f"blk.{i}.ffn_gate.weight", (F, E)), (f"blk.{i}.ffn_up.weight", (F, E))),
                w_down=w(f"blk.{i}.ffn_down.weight", (E, F)),
                post_ffn_norm=w(f"blk.{i}.post_ffw_norm.weight", (E,)),
            )
            for i in range(c.n_layer)
        ]

    def forward(self, tokens: np.ndarray, rows: Rows, want_logits: bool) -> np.ndarray | None:
        """Evaluate tokens [T] (rows: whose conversation and position each is); store their K/V; logits
        [B, V] of each span's last token if asked (a chunk: B = 1; a batched decode step: B = T)."""
        h = self.hidden(tokens, rows, rope_tables(self.ops, self.config, rows), want_logits)
        return None if h is None else self.ops.logits(h, self.output)

    def hidden(
        self,
        tokens: Any,
        rows: Rows,
        tables: RopeTables,
        want_logits: bool,
        last_row: Any = None,
        all_rows: bool = False,
    ) -> Any | None:
        """The forward pass up to the output norm: h [B, E] of each span's last token (None without logits).
        tokens: ids [T] on the host or the device; tables: cos, sin [T, rope_dim/2] per RoPE base;
        last_row: the row of a single span's last real token when it is not T - 1 (`Rows.last_of_each`);
        all_rows: h [T, E] of every token instead (embeddings)."""
        c, ops = self.config, self.ops
        T = len(tokens)
        x = ops.embed(self.tok_embd, tokens, scale=c.embed_scale)  # [T, E]
        h = ops.rms_norm(x, self.layers[0].attn_norm, c.rms_eps)
        for il, layer in enumerate(self.layers):
            lc = c.layers[il]
            cos, sin = tables[lc.rope_base]
            q, k, v = ops.project(h, layer.wqkv, self.qkv_sizes)  # [T, H*D], [T, Hkv*D], [T, Hkv*D]
            q, k = ops.qk_norm_rope(
                q, k, c.head_dim, layer.q_norm, layer.k_norm, cos, sin, c.rope_style, c.rms_eps
            )
            v = v.reshape(T, c.n_head_kv, c.head_dim)
            last_only = (
                il == c.n_layer - 1 and not all_rows
            )  # past the last K/V write only the logits' rows matter
            if last_only:
                if not want_logits:
                    rows.attend(ops, il, None, k, v, window=lc.window, scale=c.attn_scale)
                    return None
                q, x = (
                    rows.last_of_each(ops, q, last_row),
                    rows.last_of_each(ops, x, last_row),
                )  # [B, H, D], [B, E]
            attn = rows.attend(
                ops, il, q, k, v, window=lc.window, scale=c.attn_scale, last_only=last_only
            )  # [T|B, H*D]
            x, h = ops.add_rms_norm(
                x, ops.matmul(attn, layer.wo), layer.post_attn_norm, layer.ffn_norm, c.rms_eps
            )
            m = ops.gated_mlp(h, layer.w_gate_up, layer.w_down, c.activation)
            next_norm = self.layers[il + 1].attn_norm if il + 1 < c.n_layer else self.output_norm
            x, h = ops.add_rms_norm(x, m, layer.post_ffn_norm, next_norm, c.rms_eps)
        return h  # each span's last row (or every row), output-normed
