"""Sampling as small pure functions over logits and candidate sets, chained as llama.cpp's default
sampler: logit bias -> penalties (repeat, frequency, presence) -> top-k -> top-p -> min-p ->
temperature -> draw (greedy when temperature <= 0). A request's constraint mask (constraints.py) comes
before all of them, as llama.cpp applies its grammar first.

A `Candidates` is a set of token ids with their logits; every filter returns a new one. The random
draw uses a NumPy PCG64 generator whose state is a `SamplerState` (captured into and restored from the
session file, 41 bytes), so a seeded generation is reproducible and resumes exactly after a restore.
The probabilities a response reports (`n_probs`) are those of the raw logits (`top_n_logprobs`), or with
`post_sampling_probs` those of the chain's last distribution (`final_probs`).
"""

from __future__ import annotations

import secrets
import struct
from collections.abc import Sequence

import attrs
import numpy as np

from .errors import SamplerStateError


@attrs.frozen
class Candidates:
    ids: np.ndarray  # int64 [n]
    logits: np.ndarray  # float64 [n]
    sorted: bool = False  # descending by logit

    @classmethod
    def from_logits(cls, logits: np.ndarray) -> Candidates:
        # float32 as given (no copy of a 262K vocabulary); the filters work in float64 once it is small
        return cls(np.arange(logits.shape[-1], dtype=np.int64), np.asarray(logits))

    def __len__(self) -> int:
        return int(self.ids.shape[0])


# -- distributions -------------------------------------------------------------------------------------


def logsumexp(logits: np.ndarray) -> float:
    top = float(np.max(logits))
    return top + float(np.log(np.sum(np.exp(logits - np.float32(top)), dtype=np.float64)))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    return np.asarray(logits, dtype=np.float64) - logsumexp(logits)


def softmax(logits: np.ndarray) -> np.ndarray:
    return np.exp(log_softmax(logits))


def best_indices(values: np.ndarray, n: int) -> np.ndarray:
    """Indices of the `n` largest `values`, largest first (ties in index order)."""
    size = values.shape[-1]
    n = min(n, size)
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    best = np.argpartition(values, size - n)[size - n :]
    return best[np.lexsort((best, -values[best]))]


def top_n_logprobs(logits: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The `n` most likely tokens of softmax(`logits`) with their log-probabilities, best first."""
    if n <= 0:
        return []
    lse = logsumexp(logits)
    return [(int(i), float(logits[i]) - lse) for i in best_indices(logits, n)]


def token_logprob(logits: np.ndarray, token: int) -> float:
    """log softmax(`logits`)[`token`]."""
    return float(logits[token]) - logsumexp(logits)


# -- logit transforms (llama.cpp's chain before its filters) ---------------------------------------------


def logit_bias(logits: np.ndarray, bias: Sequence[tuple[int, float]]) -> np.ndarray:
    """llama.cpp's logit-bias sampler: each (token, bias) pair adds `bias` to the token's logit; -inf
    bans it; a token listed twice gets both. No pairs: `logits` itself."""
    if not bias:
        return logits
    out = np.array(logits, dtype=np.float32, copy=True)
    ids = np.fromiter((t for t, _ in bias), dtype=np.int64, count=len(bias))
    values = np.fromiter((b for _, b in bias), dtype=np.float32, count=len(bias))
    np.add.at(out, ids, values)
    return out


def penalties(
    logits: np.ndarray,
    recent: Sequence[int],
    repeat: float = 1.0,
    frequency: float = 0.0,
    presence: float = 0.0,
) -> np.ndarray:
    """llama.cpp's penalties sampler: each token occurring c > 0 times in `recent` has its logit
    divided by `repeat` if positive (multiplied by it otherwise), then lowered by c * `frequency` +
    `presence`. Neutral values (1, 0, 0) or no recent tokens: `logits` itself."""
    if (repeat == 1.0 and frequency == 0.0 and presence == 0.0) or not len(recent):
        return logits
    out = np.array(logits, dtype=np.float32, copy=True)
    ids, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
    inside = (ids >= 0) & (ids < out.shape[-1])
    ids, counts = ids[inside], counts[inside].astype(np.float32)
    values = out[ids]
    values = np.where(values <= 0, values * np.float32(repeat), values / np.float32(repeat))
    out[ids] = values - (counts * np.float32(frequency) + np.float32(presence))
    return out


# -- filters over candidates ---------------------------------------------------------------------------


def sort_descending(c: Candidates) -> Candidates:
    if c.sorted:
        return c
    order = np.argsort(-c.logits, kind="stable")
    return Candidates(c.ids[order], c.logits[order], sorted=True)


def top_k(c: Candidates, k: int) -> Candidates:
    """The `k` highest logits, sorted; k <= 0 keeps everything."""
    n = len(c)
    if k <= 0 or k >= n:
        return c
    keep = np.argpartition(c.logits, n - k)[n - k :]
    return sort_descending(Candidates(c.ids[keep], c.logits[keep]))


def top_p(c: Candidates, p: float, min_keep: int = 1) -> Candidates:
    """The smallest most-likely prefix whose probability reaches `p`; p >= 1 keeps everything.

    Probabilities are over every candidate, but only the best ones are sorted: 256 first, four times
    more until they reach `p` (a full sort of a 262K vocabulary costs ~100 ms)."""
    if p >= 1.0:
        return c
    n = len(c)
    if n == 0:
        return c
    probs = softmax(c.logits)
    k = n if c.sorted else min(n, 256)
    while True:
        if c.sorted:
            order = np.arange(n)
        elif k >= n:
            order = np.argsort(-c.logits, kind="stable")
        else:
            best = np.argpartition(c.logits, n - k)[n - k :]
            order = best[np.argsort(-c.logits[best], kind="stable")]
        cumulative = np.cumsum(probs[order])
        if cumulative[-1] >= p or k >= n:
            break
        k = min(n, 4 * k)
    last = int(np.searchsorted(cumulative, p, side="left")) + 1
    keep = order[: min(max(last, min_keep), len(order))]
    return Candidates(c.ids[keep], c.logits[keep], sorted=True)


def min_p(c: Candidates, p: float, min_keep: int = 1) -> Candidates:
    """Tokens at least `p` times as likely as the best one; p <= 0 keeps everything."""
    if p <= 0.0:
        return c
    floor = np.max(c.logits) + np.log(p)
    keep = c.logits >= floor  # the best token always passes (p <= 1)
    if int(np.count_nonzero(keep)) < min(min_keep, len(c)):
        c = sort_descending(c)
        return Candidates(c.ids[:min_keep], c.logits[:min_keep], sorted=True)
    return Candidates(c.ids[keep], c.logits[keep], sorted=c.sorted)  # no sort needed: a mask keeps order


def temperature(c: Candidates, t: float) -> Candidates:
    return Candidates(c.ids, np.asarray(c.logits, dtype=np.float64) / t, sorted=c.sorted)


# -- draws ----------------------------------------------------------------------------------------------


def greedy(logits: np.ndarray) -> int:
    return int(np.argmax(logits))


@attrs.frozen
class Argmax:
    """A row's greedy token where the sampler needs nothing else: the first maximal index of the raw logits
    (np.argmax's, NaN first) and its logit, computed where the logits are (on the device, by a decode graph,
    so only these two words are downloaded; `of_logits` on the host)."""

    token: int
    logit: float

    @classmethod
    def of_logits(cls, logits: np.ndarray) -> Argmax:
        token = greedy(logits)
        return cls(token, float(logits[token]))

    @classmethod
    def of_words(cls, words: np.ndarray, rows: int) -> list[Argmax]:
        """The first `rows` rows of an int32 buffer [B indices, then their values' float32 bits] (the
        device's `argmax_rows` layout)."""
        n = words.shape[0] // 2
        values = words[n:].view(np.float32)
        return [cls(int(words[i]), float(values[i])) for i in range(rows)]


def final_probs(c: Candidates, is_greedy: bool) -> np.ndarray:
    """The chain's last distribution over `c` (same order): softmax of its logits, or for greedy 1 for the
    best candidate and 0 for the rest (llama.cpp's greedy temperature keeps one token)."""
    if not is_greedy:
        return softmax(c.logits)
    probs = np.zeros(len(c), dtype=np.float64)
    probs[int(np.argmax(c.logits))] = 1.0
    return probs


def draw(c: Candidates, rng: np.random.Generator) -> int:
    """One token from softmax(c.logits) by inverse CDF on one uniform draw."""
    probs = softmax(c.logits)
    cumulative = np.cumsum(probs)
    index = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    return int(c.ids[min(index, len(c) - 1)])


# -- parameters, state, the chain ----------------------------------------------------------------------


@attrs.frozen
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); -inf bans

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def adjusts(self) -> bool:
        """Whether `Sampler.adjusted` can change logits (a logit bias, a penalty away from its neutral value)."""
        penalised = self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
        )
        return bool(self.logit_bias) or penalised


_STATE_FORMAT = struct.Struct("<Q16s16sBI")  # seed, PCG64 state, increment, has_uint32, uinteger


@attrs.frozen
class SamplerState:
    """The random generator: the seed it started from and PCG64's exact position."""

    seed: int
    state: int
    inc: int
    has_uint32: int = 0
    uinteger: int = 0

    SIZE = _STATE_FORMAT.size

    @classmethod
    def seeded(cls, seed: int) -> SamplerState:
        return cls.of(np.random.Generator(np.random.PCG64(seed)), seed)

    @classmethod
    def of(cls, rng: np.random.Generator, seed: int) -> SamplerState:
        s = rng.bit_generator.state
        return cls(seed, s["state"]["state"], s["state"]["inc"], s["has_uint32"], s["uinteger"])

    def generator(self) -> np.random.Generator:
        bit_generator = np.random.PCG64()
        bit_generator.state = {
            "bit_generator": "PCG64",
            "state": {"state": self.state, "inc": self.inc},
            "has_uint32": self.has_uint32,
            "uinteger": self.uinteger,
        }
        return np.random.Generator(bit_generator)

    def to_bytes(self) -> bytes:
        return _STATE_FORMAT.pack(
            self.seed, self.state.to_bytes(16, "little"), self.inc.to_bytes(16, "little"),
            self.has_uint32, self.uinteger,
        )  # fmt: skip

    @classmethod
    def from_bytes(cls, data: bytes) -> SamplerState:
        if len(data) != _STATE_FORMAT.size:
            raise SamplerStateError(f"sampler state is {len(data)} bytes, expected {_STATE_FORMAT.size}")
        seed, state, inc, has_uint32, uinteger = _STATE_FORMAT.unpack(data)
        if has_uint32 not in (0, 1):
            raise SamplerStateError(f"sampler state byte 40 (has_uint32) is {has_uint32}, expected 0 or 1")
        inc_value = int.from_bytes(inc, "little")
        if inc_value % 2 == 0:
            raise SamplerStateError("sampler state increment (bytes 24..40) is even; PCG64 needs it odd")
        return cls(seed, int.from_bytes(state, "little"), inc_value, has_uint32, uinteger)


def random_seed() -> int:
    return secrets.randbits(32)


class Sampler:
    """The chain of one request over a generator it owns; `state` captures that generator."""

    def __init__(self, params: SamplingParams, state: SamplerState):
        self.params = params
        self._seed = state.seed
        self._rng = state.generator()

    @property
    def state(self) -> SamplerState:
        return SamplerState.of(self._rng, self._seed)

    def adjusted(self, logits: np.ndarray, recent: Sequence[int]) -> np.ndarray:
        """`logits` after the logit bias and the penalties over the last `repeat_last_n` of `recent`
        (-1: all of it); `logits` itself when neither applies."""
        p = self.params
        if not p.adjusts:  # the rule the device argmax relies on (Generation.argmax_only): one place
            return logits
        logits = logit_bias(logits, p.logit_bias)
        if p.repeat_last_n == 0:
            return logits
        window = recent if p.repeat_last_n < 0 else recent[max(0, len(recent) - p.repeat_last_n) :]
        return penalties(logits, window, p.repeat_penalty, p.frequency_penalty, p.presence_penalty)

    def candidates(self, logits: np.ndarray) -> Candidates:
        """What the filters keep of `logits` (top-k, top-p, min-p), temperature-scaled unless greedy."""
        p = self.params
        c = Candidates.from_logits(logits)
        c = top_k(c, p.top_k)
        c = top_p(c, p.top_p)
        c = min_p(c, p.min_p)
        return c if p.is_greedy else temperature(c, p.temperature)

    def sample(self, logits: np.ndarray) -> int:
        """A token from `logits` (already adjusted: see `adjusted`)."""
        if self.params.is_greedy:
            return greedy(logits)
        return draw(self.candidates(logits), self._rng)
