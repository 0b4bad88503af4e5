"""What the model families share: weight loading with shape checks, and the K/V access they call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, cast

import attrs
import numpy as np

from ..config import ModelConfig
from ..errors import MissingTensor, TensorShapeMismatch
from ..gguf import GGUFFile, dequantize_tensor
from ..ops import Ops
from ..ops.arena import WeightArena
from ..ops.packed import PackedWeight, pack_tensor, stack_rows

# The packed weights' arena reserves this many times the file's bytes (virtual: only what they fill is touched):
# unpacked layouts (Q6_K's float32 scales, a fused weight of mixed types as int8) outgrow their blocks.
ARENA_FILE_MULTIPLE = 3


class KVAccess(Protocol):
    """What a forward pass needs from the K/V placement (see kv.placement): store the chunk's K/V
    [T, Hkv, D] at positions pos0.., then (q given) attend over everything the queries may see (scores times
    `scale`, then soft-capped by `softcap` where it is > 0: `Ops.attention`)."""

    def attend(
        self,
        layer: int,
        pos0: int,
        q: Any | None,
        k_new: Any,
        v_new: Any,
        *,
        q_pos0: int,
        window: int | None,
        scale: float,
        softcap: float,
    ) -> Any | None: ...


class BatchedKVAccess(KVAccess, Protocol):
    """A slot's K/V placement (`kv.placement.PoolPlacement`): also attends a batched decode step's rows, one
    per slot, together (`spans`: the step's `Span`s, this placement among them)."""

    def attend_rows(
        self,
        layer: int,
        spans: Sequence[Span],
        q: Any,
        k_new: Any,
        v_new: Any,
        *,
        window: int | None,
        scale: float,
        softcap: float,
    ) -> Any: ...


RopeTables = dict[float, tuple[Any, Any]]  # RoPE base -> (cos, sin) [T, rope_dim / 2]


@attrs.frozen
class Span:
    """One conversation's consecutive rows of a forward pass: n tokens at positions pos0 .. pos0 + n - 1,
    whose K/V go to (and whose queries attend over) `kv`: that conversation's slot."""

    kv: KVAccess
    pos0: int
    n: int


@attrs.frozen
class Rows:
    """The rows of a forward pass, conversation by conversation, in row order: a prefill chunk is one span
    of T rows; a batched decode step is B spans of one row each (one per slot). Everything but attention
    is row-wise, so the model computes it over all rows at once; attention runs span by span, or a batched
    step's rows in one call (`attend_rows` of the first span's placement: a batched step's spans are slots' placements)."""

    spans: tuple[Span, ...]

    @classmethod
    def chunk(cls, kv: KVAccess, pos0: int, n: int) -> Rows:
        return cls((Span(kv, pos0, n),))

    @property
    def n_rows(self) -> int:
        return sum(s.n for s in self.spans)

    def attend(
        self, ops: Ops, layer: int, q: Any | None, k: Any, v: Any, *, window: int | None, scale: float,
        softcap: float, last_only: bool = False,
    ) -> Any | None:  # fmt: skip
        """Store each span's K/V rows k, v [T, Hkv, D] in its slot and (q given) attend its queries over that
        slot's keys: q [T, H, D] (every row), or [B, H, D] (each span's last row: `last_only`) -> [T or B, H*D]."""
        if len(self.spans) == 1:  # one chunk: its rows as they are
            s = self.spans[0]
            q_pos0 = s.pos0 + s.n - 1 if last_only else s.pos0
            return s.kv.attend(
                layer, s.pos0, q, k, v, q_pos0=q_pos0, window=window, scale=scale, softcap=softcap
            )
        if q is not None and all(
            s.n == 1 for s in self.spans
        ):  # a batched decode step: the slots' placements
            # A batched step's spans hold slots' placements (slots.py), never a graph's or an embedding's K/V.
            kv = cast(BatchedKVAccess, self.spans[0].kv)
            return kv.attend_rows(layer, self.spans, q, k, v, window=window, scale=scale, softcap=softcap)
        out, r = [], 0
        for b, s in enumerate(self.spans):
            q_s = None if q is None else q[b : b + 1] if last_only else q[r : r + s.n]
            q_pos0 = s.pos0 + s.n - 1 if last_only else s.pos0
            out.append(s.kv.attend(layer, s.pos0, q_s, k[r : r + s.n], v[r : r + s.n], q_pos0=q_pos0,
                                   window=window, scale=scale, softcap=softcap))  # fmt: skip
            r += s.n
        return None if q is None else ops.xp.concatenate(out)

    def last_of_each(self, ops: Ops, a: Any, row: Any | None = None) -> Any:
        """The rows of a [T, ...] whose logits are wanted, each span's last, as [B, ...]. A single span's may
        be named by `row`, a device int32 [1] (a captured step padded past its last token: graph.py)."""
        if len(self.spans) == 1:
            return a[-1:] if row is None else ops.take_row(a, row)
        if all(s.n == 1 for s in self.spans):
            return a
        return a[ops.xp.asarray(np.cumsum([s.n for s in self.spans]) - 1)]


def rope_tables(ops: Ops, config: ModelConfig, rows: Rows) -> RopeTables:
    """The cos / sin tables of every row's position [T, rope_dim / 2], for every RoPE base the layers use."""
    tables = {}
    for base in {lc.rope_base for lc in config.layers}:
        per_span = [
            ops.rope_tables(s.pos0, s.n, base, config.rope_dim, config.rope_factors, config.rope_scale)
            for s in rows.spans
        ]
        tables[base] = (
            per_span[0]
            if len(per_span) == 1
            else tuple(ops.xp.concatenate([t[i] for t in per_span]) for i in (0, 1))
        )
    return tables


@attrs.frozen(eq=False)
class DecoderLayer:
    """One pre-norm block's weights; a part the family lacks is None."""

    attn_norm: Any  # [E]
    wqkv: Any  # [(H + 2 Hkv) D, E] = [Wq; Wk; Wv]
    wo: Any  # [E, H*D]
    ffn_norm: Any  # [E]
    w_gate_up: Any  # [2F, E] = [Wg; Wu]
    w_down: Any  # [E, F]
    bqkv: Any = None  # [(H + 2 Hkv) D] = [bq; bk; bv] (qwen2)
    q_norm: Any = None  # [D], per head (qwen3, gemma3)
    k_norm: Any = None  # [D]
    post_attn_norm: Any = None  # [E]: the attention branch normalised before the residual add (gemma3)
    post_ffn_norm: Any = None  # [E]


def attention_weights(c: ModelConfig, w: TensorCensus, i: int) -> dict[str, Any]:
    """Layer i's attention norm and separate Q/K/V/O matrices, stacked as [Wq; Wk; Wv]."""
    E, H, Hkv, D = c.n_embd, c.n_head, c.n_head_kv, c.head_dim
    return dict(
        attn_norm=w(f"blk.{i}.attn_norm.weight", (E,)),
        wqkv=w.fused(
            (f"blk.{i}.attn_q.weight", (H * D, E)),
            (f"blk.{i}.attn_k.weight", (Hkv * D, E)),
            (f"blk.{i}.attn_v.weight", (Hkv * D, E)),
        ),
        wo=w(f"blk.{i}.attn_output.weight", (E, H * D)),
    )


def mlp_weights(c: ModelConfig, w: TensorCensus, i: int) -> dict[str, Any]:
    """Layer i's MLP norm and separate gate/up/down matrices, stacked as [Wg; Wu]."""
    E, F = c.n_embd, c.n_ff
    return dict(
        ffn_norm=w(f"blk.{i}.ffn_norm.weight", (E,)),
        w_gate_up=w.fused((f"blk.{i}.ffn_gate.weight", (F, E)), (f"blk.{i}.ffn_up.weight", (F, E))),
        w_down=w(f"blk.{i}.ffn_down.weight", (E, F)),
    )


class Decoder:
    """The forward pass the families share (each family's module names its weights and says its math):

    x = embed(tokens) * embed_scale
    for each layer il (RoPE base and window: config.layers[il]):
        h = rms_norm(x) * attn_norm
        q, k, v = h Wq^T (+ bq), h Wk^T (+ bk), h Wv^T (+ bv)
        q, k = rms_norm_per_head(q) * q_norm, rms_norm_per_head(k) * k_norm      (where the family has them)
        q, k = rope(q, k, pos)
        s = q k^T * attn_scale, soft-capped: attn_softcap * tanh(s / attn_softcap)      (where the cap is > 0)
        a = softmax(s + causal/window mask) v Wo^T                             (GQA: H/Hkv queries a K/V head)
        x = x + (rms_norm(a) * post_attn_norm, or a)
        h = rms_norm(x) * ffn_norm
        m = (act(h Wg^T) * h Wu^T) Wd^T
        x = x + (rms_norm(m) * post_ffn_norm, or m)
    logits = (rms_norm(x_last) * output_norm) W_out^T, soft-capped by final_softcap       (where it is > 0)

    Wq, Wk, Wv are stored stacked as one [Wq; Wk; Wv] and Wg, Wu as [Wg; Wu] (one product each on the
    GPU); each residual add is fused with the norm that follows it (`add_rms_norm`).

    The rows may belong to several conversations (`Rows`: a batched decode step has one row per slot): every
    step is row-wise except the K/V store and attention, which each conversation's rows do in and over its own
    slot's K/V, with RoPE at each row's own position."""

    config: ModelConfig
    ops: Ops
    tok_embd: Any  # [V, E]
    output_norm: Any  # [E]
    output: Any  # [V, E]
    layers: list[DecoderLayer]

    def __init__(self, config: ModelConfig, ops: Ops, w: TensorCensus):
        """The weights every family has under llama.cpp's names; the family's constructor adds its layers."""
        self.config = c = config
        self.ops = ops
        H, Hkv, D = c.n_head, c.n_head_kv, c.head_dim
        self.qkv_sizes = (H * D, Hkv * D, Hkv * D)
        self.tok_embd = w("token_embd.weight", (c.n_vocab, c.n_embd))
        self.output_norm = w("output_norm.weight", (c.n_embd,))
        self.output = self.tok_embd if c.tied_output else w("output.weight", (c.n_vocab, c.n_embd))

    def forward(self, tokens: np.ndarray, rows: Rows, want_logits: bool) -> np.ndarray | None:
        """Evaluate tokens [T] (rows: whose conversation and position each is); store their K/V; logits
        [B, V] of each span's last token if asked (a chunk: B = 1; a batched decode step: B = T)."""
        h = self.hidden(tokens, rows, rope_tables(self.ops, self.config, rows), want_logits)
        return None if h is None else self.logits(h)

    def logits(self, h: Any) -> np.ndarray:
        """Host float32 logits [B, V] of output-normed rows h [B, E] (soft-capped where the family caps them)."""
        return self.ops.logits(h, self.output, self.config.final_softcap)

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
            q, k, v = ops.project(h, layer.wqkv, self.qkv_sizes, layer.bqkv)  # [T, H*D], [T, Hkv*D] x 2
            q, k = ops.qk_norm_rope(
                q, k, c.head_dim, layer.q_norm, layer.k_norm, cos, sin, c.rope_style, c.rms_eps
            )
            v = v.reshape(T, c.n_head_kv, c.head_dim)
            last_only = (
                il == c.n_layer - 1 and not all_rows
            )  # past the last K/V write only the logits' rows matter
            if last_only:
                if not want_logits:
                    rows.attend(
                        ops, il, None, k, v, window=lc.window, scale=c.attn_scale, softcap=c.attn_softcap
                    )
                    return None
                q, x = (
                    rows.last_of_each(ops, q, last_row),
                    rows.last_of_each(ops, x, last_row),
                )  # [B, H, D], [B, E]
            attn = rows.attend(
                ops,
                il,
                q,
                k,
                v,
                window=lc.window,
                scale=c.attn_scale,
                softcap=c.attn_softcap,
                last_only=last_only,
            )  # [T|B, H*D]
            x, h = ops.add_rms_norm(
                x, ops.matmul(attn, layer.wo), layer.post_attn_norm, layer.ffn_norm, c.rms_eps
            )
            m = ops.gated_mlp(h, layer.w_gate_up, layer.w_down, c.activation)
            next_norm = self.layers[il + 1].attn_norm if il + 1 < c.n_layer else self.output_norm
            x, h = ops.add_rms_norm(x, m, layer.post_ffn_norm, next_norm, c.rms_eps)
        return h  # each span's last row (or every row), output-normed


class TensorCensus:
    """A loader that loads nothing: a family built on it checks each tensor it names (presence, shape) and
    records the name, so every tensor of the file is accounted for before a weight is read (`unread`)."""

    def __init__(self, gguf_file: GGUFFile):
        self.file = gguf_file
        self.named: set[str] = set()

    def __call__(self, name: str, shape: tuple[int, ...]) -> Any:
        self._info(name, shape)

    def fused(self, *named: tuple[str, tuple[int, ...]]) -> Any:
        for name, shape in named:
            self._info(name, shape)

    def read_by_config(self, names: Sequence[str]) -> None:
        """Tensors the config builder read and holds by value (RoPE factors): computed, not unread."""
        self.named.update(names)

    def unread(self) -> list[str]:
        """The file's tensors that no weight of the family was loaded from."""
        return sorted(set(self.file.tensors) - self.named)

    def _info(self, name: str, shape: tuple[int, ...]) -> Any:
        info = self.file.tensors.get(name)
        if info is None:
            raise MissingTensor(f"{self.file.path}: tensor {name!r} is missing")
        if info.shape != shape:
            raise TensorShapeMismatch(
                f"{self.file.path}: tensor {name!r} has shape {info.shape}, expected {shape}"
            )
        self.named.add(name)
        return info


class WeightLoader(TensorCensus):
    """Loads named tensors, checking each shape (numpy order): dequantized to the compute dtype, or, for
    ops that pack weights (`Ops.packs_weights`), quantized matrices repacked from their GGUF blocks into one
    arena on huge pages (`ops.arena`)."""

    def __init__(self, gguf_file: GGUFFile, ops: Ops):
        super().__init__(gguf_file)
        self.ops = ops
        self.arena = WeightArena(ARENA_FILE_MULTIPLE * gguf_file.file_size) if ops.packs_weights else None

    def __call__(self, name: str, shape: tuple[int, ...]) -> Any:
        packed = self._packed(name, shape)
        return self._placed(packed) if packed is not None else self.ops.weight(self._host(name, shape))

    def fused(self, *named: tuple[str, tuple[int, ...]]) -> Any:
        """Weights with one input size stacked by rows ([W_1; W_2; ...]): one product computes all."""
        packed = [self._packed(name, shape) for name, shape in named]
        parts = [p for p in packed if p is not None]
        if len(parts) == len(packed):
            return self._placed(stack_rows(parts))
        return self.ops.weight(np.concatenate([self._host(name, shape) for name, shape in named]))

    def _packed(self, name: str, shape: tuple[int, ...]) -> PackedWeight | None:
        """The tensor packed (None: the ops do not pack, or it is a vector or a float tensor)."""
        info = self._info(name, shape)
        if not self.ops.packs_weights or len(shape) != 2:
            return None
        return pack_tensor(self.file.tensor_bytes(name), info.ggml_type, shape, name)

    def _placed(self, w: PackedWeight) -> PackedWeight:
        w = self.ops.packed_layout(w)
        return w if self.arena is None else self.arena.weight(w)

    def _host(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        self._info(name, shape)
        return dequantize_tensor(self.file, name)
