"""``/infill``'s prompt: llama-server's fill-in-the-middle layout (``format_prompt_infill``).

    [FIM_REP]myproject\\n                 (the repository-level context, when the model has FIM_REP)
    [FIM_SEP]{filename}\\n{text}  ...     (each input_extra chunk; without FIM_SEP: "\\n\\n--- snippet ---\\n\\n")
    [FIM_SEP]filename\\n                  (when the model has FIM_SEP)
    [BOS] [FIM_PRE]{prefix}{prompt}[FIM_SUF]{suffix}[FIM_MID]

As the peer, the prefix keeps its last 3/4 of a batch (n_batch = 2048, llama-server's default) and the
suffix its first quarter less the prompt; the extra context keeps its last n_ctx - n_batch - 2 n_predict
tokens (n_predict: the server's -n). The model writes the middle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from strata_engine.protocol import FimToken

from .errors import ApiError, ErrorType, invalid_request

N_BATCH = 2048  # llama-server's --batch-size default, by which it cuts the prefix and suffix
REPO_NAME = "myproject\n"  # the peer's fixed project name
CURRENT_FILE = "filename\n"  # and its fixed name of the file being completed
DEFAULT_FILENAME = "tmp"
SNIPPET_SEPARATOR = "\n\n--- snippet ---\n\n"  # between extra chunks of a model without FIM_SEP

# The tokens infill needs, and what the peer says is missing when a model lacks one.
REQUIRED: dict[FimToken, str] = {
    FimToken.PRE: "prefix token is missing. ",
    FimToken.SUF: "suffix token is missing. ",
    FimToken.MID: "middle token is missing. ",
}


def fim_tokens(engine_info: Mapping[str, Any]) -> dict[FimToken, int]:
    """The model's FIM tokens from the engine's ready line; llama-server's 501 when infill cannot work."""
    named = engine_info.get("fim_tokens") or {}
    fim = {role: int(named[role.value]) for role in FimToken if named.get(role.value) is not None}
    missing = "".join(message for role, message in REQUIRED.items() if role not in fim)
    if missing:
        raise ApiError(ErrorType.NOT_SUPPORTED, f"Infill is not supported by this model: {missing}")
    return fim


@attrs.frozen
class InfillRequest:
    input_prefix: str | list
    input_suffix: str | list
    input_extra: tuple[Mapping[str, str], ...]
    prompt: str


def parse_infill(body: Mapping[str, Any]) -> InfillRequest:
    """The peer's checks, with its messages."""
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise invalid_request('"prompt" must be a string')
    for key in ("input_prefix", "input_suffix"):
        if key not in body:
            raise invalid_request(f'"{key}" is required')
        if not _text_or_mixed(body[key]):
            raise invalid_request(f'"{key}" must be a string or a list of strings and token ids')
    extra = body.get("input_extra", [])
    if not isinstance(extra, list):
        raise invalid_request('"input_extra" must be an array of {"filename": string, "text": string}')
    for chunk in extra:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise invalid_request('extra_context chunk must contain a "text" field with a string value')
        if "filename" in chunk and not isinstance(chunk["filename"], str):
            raise invalid_request('extra_context chunk\'s "filename" field must be a string')
    return InfillRequest(body["input_prefix"], body["input_suffix"], tuple(extra), prompt)


def _text_or_mixed(value: Any) -> bool:
    return isinstance(value, str) or (
        isinstance(value, list)
        and all(isinstance(v, str) or (isinstance(v, int) and not isinstance(v, bool)) for v in value)
    )


def extra_context(
    fim: Mapping[FimToken, int], chunks: Sequence[Mapping[str, str]], tokenize: Callable[[str], list[int]]
) -> list[int]:
    """The repository-level context before the FIM prefix (texts tokenized without special tokens)."""
    out: list[int] = []
    if FimToken.REP in fim:
        out += [fim[FimToken.REP], *tokenize(REPO_NAME)]
    for chunk in chunks:
        if FimToken.SEP in fim:
            out += [fim[FimToken.SEP], *tokenize(chunk.get("filename", DEFAULT_FILENAME) + "\n")]
        else:
            out += tokenize(SNIPPET_SEPARATOR)
        out += tokenize(chunk["text"])
    if FimToken.SEP in fim:
        out += [fim[FimToken.SEP], *tokenize(CURRENT_FILE)]
    return out


def infill_tokens(
    fim: Mapping[FimToken, int],
    *,
    prefix: Sequence[int],
    suffix: Sequence[int],
    prompt: Sequence[int],
    extra: Sequence[int],
    bos: int | None,
    n_predict: int,
    n_ctx: int,
    n_batch: int = N_BATCH,
) -> list[int]:
    """The infill prompt (module docstring); ``bos`` is None for a model that adds none."""
    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra))
    head = [fim[FimToken.PRE], *prefix[len(prefix) - n_prefix :], *prompt]
    tail = [fim[FimToken.SUF], *suffix[:n_suffix]]
    return [*extra[len(extra) - n_extra :], *([] if bos is None else [bos]), *head, *tail, fim[FimToken.MID]]
