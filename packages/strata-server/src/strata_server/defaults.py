"""The server's default sampling and output settings (``--temp``, ``--top-k``, ..., ``-n``) under a
request's own fields, as llama-server applies its command-line defaults."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from .config import ServerConfig
from .params import CompletionOptions

# ServerConfig field -> the engine's COMPLETE field (and the request's, and generation_settings' key).
DEFAULT_FIELDS: dict[str, str] = {
    "temp": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "seed": "seed",
    "n_predict": "n_predict",
    "repeat_penalty": "repeat_penalty",
    "repeat_last_n": "repeat_last_n",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}


def sampling_defaults(config: ServerConfig) -> dict[str, Any]:
    return {engine: getattr(config, name) for name, engine in DEFAULT_FIELDS.items()}


def with_defaults(sampling: Mapping[str, Any], config: ServerConfig) -> dict[str, Any]:
    """A request's engine fields over the server's defaults. As the peer (b11549): a request's ``n_predict`` of
    -1 (or none) means the server's ``-n``; a request's own count wins over it, larger or not."""
    merged = {**sampling_defaults(config), **sampling}
    n_predict = merged["n_predict"]
    if n_predict < 0:
        n_predict = config.n_predict
    merged["n_predict"] = max(n_predict, -1)  # llama.cpp's -2 ("until the context is full") is -1 here
    return merged


def server_options(
    options: CompletionOptions, config: ServerConfig, eog_tokens: Sequence[int] | None
) -> CompletionOptions:
    """A request's options as the engine runs them: its sampling over the server's defaults, and with
    ``ignore_eos`` every end-of-generation token banned (listed in ``logit_bias`` with a null bias, after the
    request's own pairs), as llama-server does: such a token is never sampled, not only never a stop."""
    options = attrs.evolve(options, sampling=with_defaults(options.sampling, config))
    if not options.sampling.get("ignore_eos") or not eog_tokens:
        return options
    bans = tuple((int(token), False) for token in eog_tokens)
    return attrs.evolve(options, logit_bias=options.logit_bias + bans)
