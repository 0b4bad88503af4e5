"""Engine settings: one frozen attrs object, validated as a whole (every problem reported together),
and the vocabularies its values come from (K/V types, compute dtypes, backends, EMBED's poolings),
defined here once for the engine, its command line and strata-server (this module loads no numpy).
Restore modes are strata_sessionfile's `RestoreMode`.

Settings hold the plain strings (`kv_type="f16"`): what the ready line, STATUS and the config
fingerprint write; each vocabulary's enum is a `StrEnum` whose values are those strings.
"""

from __future__ import annotations

import enum
from pathlib import Path

import attrs

from .errors import SettingsError


class KVType(enum.StrEnum):
    """How the K/V pool stores keys and values (kv/layout.py's `KV_STORAGE` has each one's layout)."""

    F32 = "f32"
    F16 = "f16"
    INT8 = "int8"  # float32 scales per token, per head, per 32-value block


class ComputeDType(enum.StrEnum):
    """The dtype of activations and dequantized weights."""

    F32 = "f32"
    F64 = "f64"  # a numerics check (numpy)
    F16 = "f16"  # cupy only
    BF16 = "bf16"  # cupy only, where this CuPy has the dtype


class Backend(enum.StrEnum):
    """Where the engine computes."""

    NUMPY = "numpy"
    CUPY = "cupy"
    AUTO = "auto"  # cupy where a CUDA device is usable; resolved when the runner loads


class ChatTemplateName(enum.StrEnum):
    """Built-in chat templates that `--chat-template` takes by name (llama-server's names for them)."""

    CHATML = "chatml"  # SmolLM2's turns
    GEMMA = "gemma"  # gemma3's turns


class Pooling(enum.StrEnum):
    """How EMBED pools a prompt's hidden states (llama-server's `--pooling`; its `rank` is not offered)."""

    NONE = "none"  # every token's
    MEAN = "mean"
    CLS = "cls"  # the first token's
    LAST = "last"


# A GGUF's `<arch>.pooling_type` codes (llama.cpp's `llama_pooling_type`; its 4, rank, is not offered).
GGUF_POOLING: dict[int, Pooling] = {0: Pooling.NONE, 1: Pooling.MEAN, 2: Pooling.CLS, 3: Pooling.LAST}


class CpuKernels(enum.StrEnum):
    """What computes the numpy backend's products and attention."""

    NUMBA = "numba"  # packed int8 weights, compiled kernels over all threads, attention over stored K/V
    # numba with the products' activations quantized to int8 per 32-value block and integer dot products
    # (AVX512-VNNI; llama.cpp's Q8_1 math, ops/q8.py); a machine without VNNI gets numba's float32 products
    NUMBA_Q8 = "numba-q8"
    NUMPY = "numpy"  # float32 weights and numpy/BLAS everywhere: the oracle the kernels are tested against


def values(vocabulary: type[enum.Enum]) -> tuple[str, ...]:
    """A vocabulary's words in order (for --help, choices and messages)."""
    return tuple(member.value for member in vocabulary)


def chat_template_problem(value: str) -> str | None:
    """Why `value` cannot be a --chat-template (None: it can be): neither a built-in name nor jinja. Whether
    the jinja parses is the engine's check at start-up."""
    if value in values(ChatTemplateName) or "{{" in value or "{%" in value:
        return None
    return f"{value[:64]!r} is neither a built-in name ({', '.join(values(ChatTemplateName))}) nor a jinja template"


# The numpy backend's kernels unless told otherwise (the numba kernels compute in f32 only: another compute
# dtype gets the numpy ones). numba-q8: llama.cpp's own product math (its answers, its speed); on a CPU
# without VNNI it runs numba's float32 products.
DEFAULT_CPU_KERNELS = CpuKernels.NUMBA_Q8
# The kernels that are numba's (packed weights, f32 compute).
NUMBA_KERNELS = frozenset({CpuKernels.NUMBA, CpuKernels.NUMBA_Q8})
# How long an idle kernel thread polls for work before it sleeps (llama-server's --poll: 0-100, its default 50).
MAX_POLL = 100
DEFAULT_POLL = 50

# A context size the engine picks when none is given: the model's training context, capped here so a
# 32K-context model does not preallocate 32K tokens of K/V by default (llama-server caps the same way
# only when asked; the cap is stated in --help and in `ModelRunner.n_ctx`).
DEFAULT_N_CTX_CAP = 8192

# The least context a slot of several may get (n_ctx // n_slots): less holds no chat turn worth serving, and
# is almost surely a mistyped -c or -np. One slot keeps any positive n_ctx (tests provoke overflows with tiny ones).
MIN_N_CTX_SLOT = 16


# Tokens per prefill chunk unless told otherwise: the GPU's cost per chunk is mostly the ~12 kernel
# launches per layer issued from Python, not the arithmetic.
DEFAULT_PREFILL_CHUNK: dict[str, int] = {Backend.NUMPY: 512, Backend.CUPY: 4096}

# The compute dtype of an architecture on each backend unless told otherwise. On the GPU, f16 where the
# model's activations fit its range (3 more mantissa bits than bf16: fewer rounding flips of the greedy
# token), bf16 where they overflow it (gemma3's residual stream: NaN logits in f16). Logits come out in
# float32 either way (`Ops.logits`). A new architecture gets a row here (tests/engine/test_models.py).
DEFAULT_COMPUTE_DTYPE: dict[str, dict[str, ComputeDType]] = {
    "llama": {Backend.NUMPY: ComputeDType.F32, Backend.CUPY: ComputeDType.F16},
    "gemma3": {Backend.NUMPY: ComputeDType.F32, Backend.CUPY: ComputeDType.BF16},
}


@attrs.frozen
class EngineSettings:
    """What the engine runs with.

    model_path: the GGUF file.
    n_ctx: tokens of context of all slots together (K/V capacity of full-attention layers); None = min(the
        model's training context, 8192). Each slot gets n_ctx // n_slots (llama-server's rule: `n_ctx_slot`).
    n_slots: conversations held at once (llama-server's --parallel), each in its own region of the one
        K/V pool (`SlotSet`); a slot's context must be at least MIN_N_CTX_SLOT when there are several.
    kv_type: storage type of the K/V pool: "f32", "f16" (default) or "int8" (float32 scales per token,
        per head, per 32-value block of the head dimension).
    compute_dtype: activations and dequantized weights: "f32", "f64" (a numerics check; numpy), "f16"
        or "bf16" (cupy; bf16 where this CuPy has the dtype); None = the default for the backend and the
        model's architecture (`DEFAULT_COMPUTE_DTYPE`: f32 on numpy; on cupy f16, bf16 for gemma3).
    kv_resident: None = the pool is read directly (pool placement); N = the pool is a host pool and
        an N-token resident ring per layer sits in front of it (reads of recent tokens hit the ring).
    prompt_cache: reuse the longest valid common prefix of the held conversation on the next prefill.
    prefill_chunk: tokens evaluated per batched forward pass during prefill; None = the backend's default
        (`DEFAULT_PREFILL_CHUNK`).
    cuda_graphs: replay decode steps, and prefill chunks of models without sliding-window rings (padded
        to 32, 64, ... tokens), as CUDA graphs captured at start-up where the backend can (cupy, device
        pool, float K/V, f16/bf16 compute); False runs every step op by op (a check on the graphs).
    max_checkpoints: sliding-window ring checkpoints kept (the most recent, i.e. deepest, ones).
    backend: "numpy", "cupy", or "auto" (cupy where a CUDA device is usable; `ModelRunner.load`
        resolves it, so `runner.settings.backend` names the backend actually running).
    cpu_kernels: the numpy backend's kernels: "numba" (compiled, packed weights), "numba-q8" (numba's with
        the activations of the packed products quantized to int8 per 32-value block, integer dot products
        where the CPU has AVX512-VNNI) or "numpy" (the oracle);
        None = `DEFAULT_CPU_KERNELS` ("numba-q8") with f32 compute, else "numpy" (on cupy too, where the
        kernels do not run).
    threads: CPU threads for the kernels and BLAS; None = the cores this process may run on.
    poll: how long an idle kernel thread polls for work before it sleeps, 0-100 (llama-server's --poll):
        polling keeps a decode step's threads awake between its products (DEFAULT_POLL); 0 sleeps at once,
        for a machine whose cores other work needs. Set once per process, by the first runner loaded.
    chat_template: a `ChatTemplateName` or a jinja template used instead of the model's own; None = the
        model's (llama-server's --chat-template; --chat-template-file puts the file's text here).
    Neither cpu_kernels, threads nor poll changes what a session file holds: the config fingerprint leaves them out.
    """

    model_path: Path = attrs.field(converter=Path)
    n_ctx: int | None = None
    n_slots: int = 1
    kv_type: str = "f16"
    compute_dtype: str | None = None
    kv_resident: int | None = None
    prompt_cache: bool = True
    prefill_chunk: int | None = None
    max_checkpoints: int = 8
    backend: str = "numpy"
    cuda_graphs: bool = True
    cpu_kernels: str | None = None
    threads: int | None = None
    poll: int = DEFAULT_POLL
    chat_template: str | None = None

    def with_backend_defaults(self, architecture: str) -> EngineSettings:
        """The settings with "auto" resolved and every None default filled in for that backend and the
        model's architecture (`DEFAULT_COMPUTE_DTYPE`, `DEFAULT_PREFILL_CHUNK`)."""
        from .ops import resolve_backend  # imports cupy only to look for a device
        from .ops.threads import default_threads

        backend = resolve_backend(self.backend)
        compute_dtype = self.compute_dtype or DEFAULT_COMPUTE_DTYPE[architecture][backend].value
        on_f32_cpu = backend == Backend.NUMPY and compute_dtype == ComputeDType.F32
        return attrs.evolve(
            self,
            backend=backend,
            compute_dtype=compute_dtype,
            prefill_chunk=self.prefill_chunk or DEFAULT_PREFILL_CHUNK[backend],
            cpu_kernels=self.cpu_kernels or (DEFAULT_CPU_KERNELS if on_f32_cpu else CpuKernels.NUMPY).value,
            threads=self.threads or default_threads(),
        )

    def n_ctx_total(self, n_ctx_train: int) -> int:
        """The context of all slots together: n_ctx, or the model's training context capped."""
        return self.n_ctx if self.n_ctx is not None else min(n_ctx_train, DEFAULT_N_CTX_CAP)

    def n_ctx_slot(self, n_ctx_train: int) -> int:
        """Each slot's context: the total // n_slots."""
        return self.n_ctx_total(n_ctx_train) // self.n_slots

    def slot_problem(self, n_ctx: int) -> str | None:
        """Why a total context of n_ctx cannot be shared by the slots (None: it can)."""
        if self.n_slots > 1 and n_ctx // self.n_slots < MIN_N_CTX_SLOT:
            return (f"n_ctx {n_ctx} gives each of the {self.n_slots} slots {n_ctx // self.n_slots} tokens of context, "
                    f"fewer than {MIN_N_CTX_SLOT}")  # fmt: skip
        return None

    def problems(self) -> list[str]:
        out: list[str] = []
        if self.n_ctx is not None and (not isinstance(self.n_ctx, int) or self.n_ctx < 1):
            out.append(f"n_ctx must be a positive integer or None, got {self.n_ctx!r}")
        if not isinstance(self.n_slots, int) or isinstance(self.n_slots, bool) or self.n_slots < 1:
            out.append(f"n_slots must be a positive integer, got {self.n_slots!r}")
        elif isinstance(self.n_ctx, int) and self.n_ctx >= 1 and (problem := self.slot_problem(self.n_ctx)):
            out.append(problem)
        if self.kv_type not in values(KVType):
            out.append(f"kv_type must be one of {', '.join(values(KVType))}, got {self.kv_type!r}")
        if self.compute_dtype is not None and self.compute_dtype not in values(ComputeDType):
            out.append(
                f"compute_dtype must be one of {', '.join(values(ComputeDType))}, got {self.compute_dtype!r}"
            )
        if self.kv_resident is not None and (not isinstance(self.kv_resident, int) or self.kv_resident < 1):
            out.append(f"kv_resident must be a positive integer or None, got {self.kv_resident!r}")
        if self.prefill_chunk is not None and (
            not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 1
        ):
            out.append(f"prefill_chunk must be a positive integer or None, got {self.prefill_chunk!r}")
        if not isinstance(self.max_checkpoints, int) or self.max_checkpoints < 0:
            out.append(f"max_checkpoints must be a non-negative integer, got {self.max_checkpoints!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            out.append(f"threads must be a positive integer or None, got {self.threads!r}")
        if not isinstance(self.poll, int) or isinstance(self.poll, bool) or not 0 <= self.poll <= MAX_POLL:
            out.append(f"poll must be an integer from 0 to {MAX_POLL}, got {self.poll!r}")
        if self.backend not in values(Backend):
            out.append(f"backend must be one of {', '.join(values(Backend))}, got {self.backend!r}")
        elif self.backend == Backend.NUMPY and self.compute_dtype in (ComputeDType.F16, ComputeDType.BF16):
            out.append(f"compute_dtype {self.compute_dtype!r} needs the cupy backend")
        if self.cpu_kernels is not None and self.cpu_kernels not in values(CpuKernels):
            out.append(f"cpu_kernels must be one of {', '.join(values(CpuKernels))}, got {self.cpu_kernels!r}")
        elif self.cpu_kernels in NUMBA_KERNELS and self.compute_dtype not in (None, ComputeDType.F32):
            out.append(f"cpu_kernels {self.cpu_kernels!r} computes in f32, not compute_dtype {self.compute_dtype!r}")
        return out

    def validate(self) -> EngineSettings:
        problems = self.problems()
        if problems:
            raise SettingsError(problems)
        return self
