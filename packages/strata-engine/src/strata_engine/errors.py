"""The engine's exceptions: one root, `EngineError`, with subclasses named after what went wrong.

The serve loop maps these to error lines in one place; nothing else in the engine needs to catch
anything broader than `EngineError`.
"""

from __future__ import annotations


class EngineError(Exception):
    """Root of every error the engine raises on purpose."""


class GGUFError(EngineError):
    """A GGUF file is malformed, truncated or inconsistent (the message names the field and offset)."""


class UnsupportedTensorType(GGUFError):
    """A tensor uses a ggml type this engine cannot dequantize."""


class UnsupportedArchitecture(EngineError):
    """`general.architecture` names a model family this engine does not implement."""


class ModelConfigError(EngineError):
    """The metadata lacks a key the model family needs, or holds an impossible value.

    `problems` lists every problem found, so a bad file is reported in one go.
    """

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid model configuration: " + "; ".join(self.problems))


class MissingTensor(EngineError):
    """A tensor the model family needs is absent from the file, or has the wrong shape."""


class SettingsError(EngineError):
    """Engine settings are invalid (`problems` lists every problem found)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid engine settings: " + "; ".join(self.problems))


class ContextOverflow(EngineError):
    """A prompt (or a decode step) would hold more tokens than the context allows."""

    def __init__(self, n_prompt_tokens: int, n_ctx: int):
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx
        super().__init__(
            f"the request needs {n_prompt_tokens} tokens of context but the context size is {n_ctx}"
        )


class InvalidToken(EngineError):
    """A token id outside the vocabulary."""


class KVStateError(EngineError):
    """A K/V write or a running-state restore does not fit the pool (range, shape, dtype, checkpoints)."""
