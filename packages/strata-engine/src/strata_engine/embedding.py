"""Embeddings (EMBED): a prompt's hidden states after the model's output norm, pooled and normalized as
llama-server pools and normalizes them.

The prompt is evaluated from position 0 on scratch K/V of its own (`ScratchKV`), in chunks of the
prefill chunk: the held conversation -- its K/V pool, tokens and checkpoints -- is never touched, so the
next completion still reuses it (llama-server computes embeddings in a slot, dropping that slot's
cache). Attention is causal, as llama.cpp's for these decoder models.

Pooling (`Pooling`, llama-server's `--pooling`): `none` gives every token's state, `mean` their mean,
`cls` the first token's, `last` the last one's. A model's own pooling is its GGUF
`<arch>.pooling_type`; a model that does not say pools nothing, as llama.cpp. Pooled states are
normalized with llama-server's `embd_normalize` (`normalize`); per-token states are not.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import numpy as np

from .errors import ContextOverflow, InvalidRequest, InvalidToken
from .jobs import ChunkJob
from .models.common import Rows, rope_tables
from .protocol import Request, ServeContext
from .settings import GGUF_POOLING, Pooling
from .wire import EUCLIDEAN, EmbedArgs, arguments_of

POOLERS: dict[Pooling, Callable[[np.ndarray], np.ndarray]] = {
    Pooling.NONE: lambda h: h,
    Pooling.MEAN: lambda h: h.mean(axis=0, keepdims=True),
    Pooling.CLS: lambda h: h[:1],
    Pooling.LAST: lambda h: h[-1:],
}


def model_pooling(metadata: Mapping[str, Any], architecture: str) -> Pooling:
    """The model's own pooling: its GGUF `<arch>.pooling_type`, else none (llama.cpp's default)."""
    code = metadata.get(f"{architecture}.pooling_type")
    return GGUF_POOLING.get(int(code), Pooling.NONE) if isinstance(code, (int, np.integer)) else Pooling.NONE


def normalize(v: np.ndarray, p: int) -> np.ndarray:
    """llama.cpp's `common_embd_normalize` of one vector: p = -1 none, 0 max absolute scaled to int16's
    range, 1 taxicab, 2 euclidean, above 2 the p-norm."""
    a = np.abs(v.astype(np.float64))
    if p == -1:
        norm = 1.0
    elif p == 0:
        norm = a.max(initial=0.0) / 32760.0
    elif p == EUCLIDEAN:
        norm = float(np.sqrt(np.sum(a * a)))
    else:
        norm = float(np.sum(a**p) ** (1.0 / p))
    return (v * (1.0 / norm if norm > 0.0 else 0.0)).astype(np.float32)


class ScratchKV:
    """`models.common.KVAccess` over one sequence's K/V, held here in the compute dtype from position 0:
    nothing is written to the runner's pool."""

    def __init__(self, ops: Any, n_layer: int):
        self.ops = ops
        self.k: list[Any] = [None] * n_layer
        self.v: list[Any] = [None] * n_layer

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
    ) -> Any | None:
        xp = self.ops.xp
        held_k, held_v = self.k[layer], self.v[layer]
        # contiguous from the first chunk (k_new, v_new may be views of a fused product): one kernel signature
        k = xp.ascontiguousarray(k_new) if held_k is None else xp.concatenate([held_k, k_new])
        v = xp.ascontiguousarray(v_new) if held_v is None else xp.concatenate([held_v, v_new])
        self.k[layer], self.v[layer] = k, v
        if q is None:
            return None
        lo = 0 if window is None else max(0, pos0 - window + 1)
        return self.ops.attention(
            q, k[lo:], v[lo:], q_pos0=q_pos0, k_pos0=lo, window=window, scale=scale, softcap=softcap
        )


def hidden_state_steps(
    model: Any,
    tokens: Sequence[int],
    chunk: int,
    chunk_size: Callable[[], int] | None = None,
    on_chunk: Callable[[int], None] | None = None,
) -> Generator[None, None, np.ndarray]:
    """Every token's output-normed hidden state [T, E] (float32, host), from position 0 on scratch K/V: each
    next() evaluates one chunk (`chunk` tokens, or chunk_size()'s, asked before each chunk, at most `chunk`)
    and tells on_chunk(its tokens); the return value is the states."""
    kv = ScratchKV(model.ops, model.config.n_layer)
    rows = []
    pos = 0
    while True:
        size = chunk if chunk_size is None else max(1, min(int(chunk_size()), chunk))
        ids = np.asarray(tokens[pos : pos + size], dtype=np.int64)
        span = Rows.chunk(kv, pos, len(ids))
        h = model.hidden(
            ids, span, rope_tables(model.ops, model.config, span), want_logits=True, all_rows=True
        )
        rows.append(model.ops.to_host(h).astype(np.float32))
        pos += len(ids)
        if on_chunk is not None:
            on_chunk(len(ids))
        if pos >= len(tokens):
            return np.concatenate(rows)
        yield


def hidden_states(model: Any, tokens: Sequence[int], chunk: int) -> np.ndarray:
    steps = hidden_state_steps(model, tokens, chunk)
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


def _check(runner: Any, tokens: Sequence[int]) -> None:
    if not tokens:
        raise InvalidRequest(["tokens must not be empty"])
    if len(tokens) > runner.n_ctx:
        raise ContextOverflow(len(tokens), runner.n_ctx)
    n_vocab = runner.config.n_vocab
    if not 0 <= min(tokens) <= max(tokens) < n_vocab:
        raise InvalidToken(
            f"token ids outside the vocabulary [0, {n_vocab}): "
            f"{[t for t in tokens if not 0 <= t < n_vocab][:8]}"
        )


def pool_rows(states: np.ndarray, pooling: Pooling, p: int) -> np.ndarray:
    """The embedding rows: one per token (pooling none, not normalized), else one, normalized."""
    pooled = POOLERS[pooling](states)
    return pooled if pooling is Pooling.NONE else np.stack([normalize(row, p) for row in pooled])


def embed(runner: Any, tokens: Sequence[int], pooling: Pooling, p: int = EUCLIDEAN) -> np.ndarray:
    """The embedding rows of `tokens`, evaluated start to end."""
    _check(runner, tokens)
    return pool_rows(hidden_states(runner.model, tokens, runner.settings.prefill_chunk), pooling, p)


def handle_embed(ctx: ServeContext, request: Request) -> ChunkJob:
    """EMBED: checked now, then its job evaluated a chunk per step (slot 0's runner lends its model and
    context size; no slot is touched)."""
    args: EmbedArgs = arguments_of(request)
    runner = ctx.runner_of(0)
    tokens, p = args.tokens, args.normalize
    pooling = args.pooling or model_pooling(runner.gguf.metadata, runner.config.architecture)
    _check(runner, tokens)

    def finish(states: np.ndarray) -> Mapping[str, Any]:
        return {"embedding": pool_rows(states, pooling, p).tolist(), "n_tokens": len(tokens)}

    return ChunkJob(
        request,
        lambda chunk_size, on_chunk: hidden_state_steps(
            runner.model, tokens, runner.settings.prefill_chunk, chunk_size, on_chunk
        ),
        finish,
        len(tokens),
    )
