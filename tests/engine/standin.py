"""A stand-in for i15-batch's `SlotSet` (I15-INTERFACE.md) until it lands: sibling runners of one loaded
model, a decode step looping over the slots, and `prefill_steps` made of prefills of growing prefixes (the
prompt cache evaluates one chunk each). Tests only; models without sliding-window rings only."""

from __future__ import annotations

import numpy as np
from strata_engine.runner import ModelRunner, PrefillResult, common_prefix_len


class StandInRunner:
    def __init__(self, inner: ModelRunner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def prefill_steps(self, tokens, on_chunk=None):
        tokens = [int(t) for t in tokens]
        inner = self._inner
        resume = min(common_prefix_len(tokens, inner.tokens_held), len(tokens) - 1)
        inner.cut_back(resume)
        pos, logits = resume, None
        while pos < len(tokens):
            end = min(pos + inner.settings.prefill_chunk, len(tokens))
            logits = inner.prefill(tokens[:end]).logits
            pos = end
            if on_chunk is not None:
                on_chunk(resume, pos)
            yield
        return PrefillResult(logits=logits, cache_n=resume, prompt_n=len(tokens) - resume)


class StandInSlots:
    def __init__(self, base: ModelRunner, n_slots: int, **settings):
        self.runners = tuple(StandInRunner(base.sibling(**settings)) for _ in range(n_slots))
        self.n_slots = n_slots

    def decode(self, steps):
        return np.stack([self.runners[slot].decode(token) for slot, token in steps])
