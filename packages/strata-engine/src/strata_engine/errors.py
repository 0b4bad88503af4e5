"""The engine's exceptions: one root, `EngineError`, with subclasses named after what went wrong.

Every exception the engine raises on purpose is defined here (the protocol's own two, `ProtocolError`
and `FailStop`, sit beside the error kinds in protocol.py), and this module imports nothing: the
protocol module maps them to error lines in one place without importing the rest of the engine.
"""

from __future__ import annotations

from collections.abc import Sequence


class EngineError(Exception):
    """Root of every error the engine raises on purpose."""


class ProblemsError(EngineError):
    """An error that lists every problem found (`problems`), so bad input is reported in one go."""

    headline = "invalid input"

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__(f"{self.headline}: " + "; ".join(self.problems))


# ---- settings and model files ----------------------------------------------------------------------


class UsageError(EngineError):
    """The command line does not parse (`strata-engine` exits with the usage status)."""


class SettingsError(ProblemsError):
    """Engine settings are invalid (`problems` lists every problem found)."""

    headline = "invalid engine settings"


class GGUFError(EngineError):
    """A GGUF file is malformed, truncated or inconsistent (the message names the field and offset)."""


class UnsupportedTensorType(GGUFError):
    """A tensor uses a ggml type this engine cannot dequantize."""


class UnsupportedArchitecture(EngineError):
    """`general.architecture` names a model family this engine does not implement."""


class ModelConfigError(ProblemsError):
    """The metadata lacks a key the model family needs, or holds an impossible value."""

    headline = "invalid model configuration"


class UncomputedModelPart(ModelConfigError):
    """The file holds a metadata key or tensor that the engine would not compute (a Llama 3 file's
    `rope_freqs`, soft-capping, experts, ...): refused, each one named, rather than silently ignored."""

    headline = "the model file holds what strata-engine does not compute"


class MissingTensor(EngineError):
    """A tensor the model family needs is absent from the file."""


class TensorShapeMismatch(EngineError):
    """A tensor the model family needs has another shape than the configuration implies."""


class TokenizerError(EngineError):
    """The tokenizer metadata of a model file is missing, malformed or of an unsupported kind."""


class UnsupportedTokenizer(TokenizerError):
    """`tokenizer.ggml.model` or `tokenizer.ggml.pre` names a tokenizer this engine does not implement."""


# ---- requests ----------------------------------------------------------------------------------------


class InvalidRequest(ProblemsError):
    """A request field is missing or has a bad value; `problems` lists every one found."""

    headline = "invalid request"


class InvalidToken(EngineError):
    """A token id outside the vocabulary (to detokenize, to evaluate); `slot` names the slot of a batched
    decode step it was given for (None otherwise)."""

    def __init__(self, message: str, *, slot: int | None = None):
        self.slot = slot
        super().__init__(message if slot is None else f"slot {slot}: {message}")


class ChatTemplateError(EngineError):
    """The messages are malformed, or the template refused them or failed to render."""


class ConstraintError(EngineError):
    """A request's output constraint cannot be compiled; refused before anything is evaluated. The
    message is llama-server's for the same refusal, followed by the compiler's reason."""


class InvalidGrammar(ConstraintError):
    """`grammar` is not a GBNF grammar the constraint compiler accepts."""


class InvalidJsonSchema(ConstraintError):
    """`json_schema` is not a JSON schema the constraint compiler can enforce exactly."""


class ContextOverflow(EngineError):
    """A prompt (or a decode step) would hold more tokens than the context allows. With `at_least`, the
    prompt was refused before it was tokenized and `n_prompt_tokens` is a lower bound on its length.
    `slot` names the slot of a batched decode step that would overflow (None otherwise)."""

    def __init__(self, n_prompt_tokens: int, n_ctx: int, *, at_least: bool = False, slot: int | None = None):
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx
        self.at_least = at_least
        self.slot = slot
        needs = f"at least {n_prompt_tokens}" if at_least else str(n_prompt_tokens)
        where = "" if slot is None else f"slot {slot}: "
        super().__init__(
            f"{where}the request needs {needs} tokens of context but the context size is {n_ctx}"
        )


# ---- running state -----------------------------------------------------------------------------------


class KVStateError(EngineError):
    """A K/V write or a running-state restore does not fit the pool (range, shape, dtype, checkpoints)."""


class PrefixUnreachable(EngineError):
    """A RESTORE_PREFIX cannot keep `min_keep` tokens: no resume point of the file lies in [min_keep, cut_to]."""

    def __init__(self, message: str, resume_point: int):
        self.resume_point = resume_point
        super().__init__(message)


class SamplerStateError(EngineError):
    """A serialized sampler state is malformed."""


class GraphCaptureFailed(EngineError):
    """A step could not be captured as a CUDA graph; the runner then runs it op by op (and says so once)."""


class EngineProcessError(EngineError):
    """A client's engine process (client.EngineProcess) did not start, answered a command with an error line,
    or exited."""


class InjectedFault(EngineError):
    """The failure a test arms with STRATA_ENGINE_SESSION_FAULT (session.adapter.FaultPoint)."""
