"""Engine settings: one frozen attrs object, validated as a whole (every problem reported together),
and the vocabularies its values come from (K/V types, compute dtypes, backends, EMBED's poolings),
defined here once for the engine, its command line and strata-server (this module loads no numpy).
Restore modes are strata_sessionfile's `RestoreMode`.

`EngineSettings` is also the settings table: each field carries its flags, help and check (`Setting`),
from which the engine's parser (`add_setting_flags`), `EngineSettings.to_argv` and strata-server's flags
and config file are made. Settings hold each vocabulary's member (a `StrEnum`: the plain word wherever
it is written, in the ready line, STATUS and the config fingerprint).
"""

from __future__ import annotations

import argparse
import enum
import os
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

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
    """Built-in chat formats that `--chat-template` takes by name: llama.cpp b11549's LLM_CHAT_TEMPLATES, every
    one (chat_formats.FORMATS renders them)."""

    CHATML = "chatml"
    LLAMA2 = "llama2"
    LLAMA2_SYS = "llama2-sys"
    LLAMA2_SYS_BOS = "llama2-sys-bos"
    LLAMA2_SYS_STRIP = "llama2-sys-strip"
    MISTRAL_V1 = "mistral-v1"
    MISTRAL_V3 = "mistral-v3"
    MISTRAL_V3_TEKKEN = "mistral-v3-tekken"
    MISTRAL_V7 = "mistral-v7"
    MISTRAL_V7_TEKKEN = "mistral-v7-tekken"
    PHI3 = "phi3"
    PHI4 = "phi4"
    FALCON3 = "falcon3"
    ZEPHYR = "zephyr"
    MONARCH = "monarch"
    GEMMA = "gemma"
    ORION = "orion"
    OPENCHAT = "openchat"
    VICUNA = "vicuna"
    VICUNA_ORCA = "vicuna-orca"
    DEEPSEEK = "deepseek"
    DEEPSEEK2 = "deepseek2"
    DEEPSEEK3 = "deepseek3"
    DEEPSEEK_OCR = "deepseek-ocr"
    COMMAND_R = "command-r"
    LLAMA3 = "llama3"
    CHATGLM3 = "chatglm3"
    CHATGLM4 = "chatglm4"
    GLMEDGE = "glmedge"
    MINICPM = "minicpm"
    EXAONE3 = "exaone3"
    EXAONE4 = "exaone4"
    EXAONE_MOE = "exaone-moe"
    RWKV_WORLD = "rwkv-world"
    GRANITE = "granite"
    GRANITE_4_0 = "granite-4.0"
    GRANITE_4_1 = "granite-4.1"
    GIGACHAT = "gigachat"
    MEGREZ = "megrez"
    YANDEX = "yandex"
    BAILING = "bailing"
    BAILING_THINK = "bailing-think"
    BAILING2 = "bailing2"
    LLAMA4 = "llama4"
    SMOLVLM = "smolvlm"
    HUNYUAN_MOE = "hunyuan-moe"
    GPT_OSS = "gpt-oss"
    HUNYUAN_DENSE = "hunyuan-dense"
    HUNYUAN_VL = "hunyuan-vl"
    KIMI_K2 = "kimi-k2"
    SEED_OSS = "seed_oss"
    GROK_2 = "grok-2"
    PANGU_EMBEDDED = "pangu-embedded"
    SOLAR_OPEN = "solar-open"


# the message keys a chat template sees besides role and content (OpenAI's tool-calling fields)
MESSAGE_EXTRAS = ("tool_calls", "tool_call_id", "name", "reasoning_content")


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
    "gemma2": {Backend.NUMPY: ComputeDType.F32, Backend.CUPY: ComputeDType.BF16},  # gemma3's residual stream
    "gemma3": {Backend.NUMPY: ComputeDType.F32, Backend.CUPY: ComputeDType.BF16},
    # Qwen2.5 and Qwen3 are trained in bf16 and their activation outliers are known to overflow f16
    "qwen2": {Backend.NUMPY: ComputeDType.F32, Backend.CUPY: ComputeDType.BF16},
    "qwen3": {Backend.NUMPY: ComputeDType.F32, Backend.CUPY: ComputeDType.BF16},
    "phi3": {Backend.NUMPY: ComputeDType.F32, Backend.CUPY: ComputeDType.BF16},  # trained in bf16 likewise
}


# ---- the settings table: each field's flags, help, default and check --------------------------------------

_ROW = "strata_engine.setting"  # the attrs metadata key under which a field keeps its row


def _same(name: str) -> str:
    return name


def _shown(value: Any) -> str:
    """A value as a message quotes it (a vocabulary's member as its plain word)."""
    return repr(value.value if isinstance(value, enum.Enum) else value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _at_least(low: int) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if not _is_int(value):
            return f"{_shown(value)} is not an integer"
        return None if value >= low else f"{value} must be at least {low}"

    return check


def _from_to(low: int, high: int) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        return (
            None
            if _is_int(value) and low <= value <= high
            else f"{_shown(value)} must be from {low} to {high}"
        )

    return check


def _one_of(vocabulary: type[enum.Enum]) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        return (
            None
            if value in values(vocabulary)
            else f"{_shown(value)} is not one of {', '.join(values(vocabulary))}"
        )

    return check


def _boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else f"{_shown(value)} is not true or false"


def _path(value: Any) -> str | None:
    return None if isinstance(value, Path) else f"{_shown(value)} is not a path"


def _optional(check: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    return lambda value: None if value is None else check(value)


def _to_path(value: Any) -> Any:
    """The model's converter: a path for a string; anything else stays for the checks to report."""
    return Path(value) if isinstance(value, (str, os.PathLike)) else value


def _word(vocabulary: type[enum.Enum]) -> Callable[[Any], Any]:
    """A field's converter: the vocabulary's member for its word; anything else stays for the checks to report."""
    return lambda value: vocabulary(value) if value in values(vocabulary) else value


def _converted(field: attrs.Attribute, value: Any) -> Any:
    """`value` as the field's converter makes it (unchanged where it has none)."""
    convert = field.converter
    # attrs' stub types it as its `Converter` wrapper; a plain callable, as every field here gives, is kept as is
    return convert(value) if convert is not None else value  # type: ignore[operator]


def _file_text(path: str) -> str:
    """A flag value that names a UTF-8 text file: its text (argparse reports a failure as a usage error)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc}") from None


@attrs.frozen
class Setting:
    """One row of the settings table: how an `EngineSettings` field is given on a command line and checked.
    The engine's parser, `EngineSettings.to_argv`, and strata-server's flags and config file read it."""

    flags: tuple[str, ...]  # llama-server's names for it where it has the setting; none: not a flag
    help: str  # "{default}" stands for the field's default, "{words}" for its vocabulary's words
    check: Callable[
        [Any], str | None
    ]  # why a value cannot be (None: it can); the message leaves out the name
    metavar: str | None = None
    vocabulary: type[enum.Enum] | None = None  # the words a value is one of (the field holds the member)
    unset: int | None = None  # strata-server's value that means the default, as llama-server's -c 0 and -t -1
    file_flag: str | None = None  # a flag naming a UTF-8 file whose text is the value
    server: bool = True  # strata-server offers the flag too

    @property
    def long(self) -> str:
        return next(flag for flag in self.flags if flag.startswith("--"))

    @property
    def negated(self) -> bool:
        """A --no-X flag: given, the setting (default true) is false."""
        return self.long.startswith("--no-")

    @property
    def key(self) -> str:
        """The name on a command line and in strata-server's config file: the long flag's, "no-" left out."""
        return self.long.removeprefix("--").removeprefix("no-").replace("-", "_")


def _setting(*flags: str, help: str, check: Callable[[Any], str | None] | None = None, default: Any = attrs.NOTHING,
             vocabulary: type[enum.Enum] | None = None, converter: Callable[[Any], Any] | None = None,
             **row: Any) -> Any:  # fmt: skip
    """An `EngineSettings` field with its row of the table; a vocabulary's field holds its member, checked to be one
    (or None where that is the default)."""
    if vocabulary is not None:
        converter, check = _word(vocabulary), _one_of(vocabulary)
        check = check if default is not None else _optional(check)
    if check is None:
        raise TypeError(f"the setting {flags} has neither a check nor a vocabulary")
    row_of = Setting(flags, help, check, vocabulary=vocabulary, **row)
    return attrs.field(default=default, converter=converter, metadata={_ROW: row_of})


@attrs.frozen
class EngineSettings:
    """What the engine runs with, checked when built (every problem reported together in one `SettingsError`).

    Each field is a row of the settings table (`Setting`): the engine's command line, `to_argv` and
    strata-server's flags and config file are made from it, so a new setting is one field here.
    n_ctx: the total of all slots (the K/V capacity of full-attention layers); each slot gets n_ctx // n_slots
        (llama-server's rule: `n_ctx_slot`); None = min(the model's training context, DEFAULT_N_CTX_CAP).
    n_slots: conversations held at once (llama-server's --parallel), each in its own region of the one K/V
        pool (`SlotSet`); a slot's context must be at least MIN_N_CTX_SLOT when there are several.
    kv_type: the K/V pool's storage (`KVType`; int8: float32 scales per token, per head, per 32-value block).
    compute_dtype: activations and dequantized weights (`ComputeDType`); None = `DEFAULT_COMPUTE_DTYPE` for
        the backend and the model's architecture (f32 on numpy; on cupy f16, bf16 for gemma3).
    kv_resident: None = the pool is read directly (pool placement); N = the pool is a host pool and an
        N-token resident ring per layer sits in front of it (reads of recent tokens hit the ring).
    prefill_chunk: tokens per batched forward pass during prefill; None = `DEFAULT_PREFILL_CHUNK`.
    cuda_graphs: replay decode steps, and prefill chunks of models without sliding-window rings (padded to
        32, 64, ... tokens), as CUDA graphs captured at start-up where the backend can (cupy, device pool,
        float K/V, f16/bf16 compute); False runs every step op by op (a check on the graphs).
    max_checkpoints: sliding-window ring checkpoints kept (the most recent, i.e. deepest, ones); no flag.
    backend: `Backend`; "auto" is resolved by the runner that loads (`ops.resolve_settings`), so
        `runner.settings.backend` names the backend actually running.
    cpu_kernels: the numpy backend's kernels (`CpuKernels`); None = DEFAULT_CPU_KERNELS with f32 compute,
        else numpy (on cupy too, where the kernels do not run).
    threads: CPU threads for the kernels and BLAS; None = the cores this process may run on.
    poll: how long an idle kernel thread polls for work before it sleeps (DEFAULT_POLL keeps a decode step's
        threads awake between its products; 0 sleeps at once). Set once per process, by the first runner.
    chat_template: a `ChatTemplateName` or a jinja template used instead of the model's own; None = the model's.
    Neither cpu_kernels, threads nor poll changes what a session file holds: the config fingerprint leaves them out.
    """

    model_path: Path = _setting("-m", "--model", help="the GGUF model file", check=_path, converter=_to_path,
                                metavar="PATH")  # fmt: skip
    n_ctx: int | None = _setting(
        "-c", "--ctx-size", default=None, check=_optional(_at_least(1)), metavar="N", unset=0,
        help="context size in tokens, the total of all slots: each slot gets N / --parallel, rounded down, as "
        f"llama-server (default: the model's own, at most {DEFAULT_N_CTX_CAP})")  # fmt: skip
    n_slots: int = _setting(
        "-np", "--parallel", default=1, check=_at_least(1), metavar="N",
        help="slots: conversations held and generated at once, batched in one engine, each with --ctx-size / N "
        f"tokens of context (at least {MIN_N_CTX_SLOT} when N > 1) (default: {{default}})")  # fmt: skip
    kv_type: KVType = _setting("--kv-type", default=KVType.F16, vocabulary=KVType, metavar="TYPE",
                               help="K/V cache type, one of {words} (default: {default})")  # fmt: skip
    compute_dtype: ComputeDType | None = _setting(
        "--compute-dtype", default=None, vocabulary=ComputeDType, metavar="DTYPE", server=False,
        help="activations, one of {words} (default: f32 on numpy; on cupy f16, or bf16 for models whose "
        "activations overflow f16: gemma3); logits are computed in f32 either way")  # fmt: skip
    kv_resident: int | None = _setting(
        "--kv-resident",
        default=None,
        check=_optional(_at_least(1)),
        metavar="N",
        unset=0,
        help="keep the K/V in a host pool with an N-token resident ring in front of it (default: a device pool)",
    )
    prompt_cache: bool = _setting(
        "--no-prompt-cache",
        default=True,
        check=_boolean,
        help="do not reuse the held conversation's prefix on the next request",
    )
    prefill_chunk: int | None = _setting(
        "--prefill-chunk", default=None, check=_optional(_at_least(1)), metavar="N", server=False,
        help=f"tokens per prefill batch (default: {DEFAULT_PREFILL_CHUNK[Backend.NUMPY]} on numpy, "
        f"{DEFAULT_PREFILL_CHUNK[Backend.CUPY]} on cupy); a quarter of it while other slots generate")  # fmt: skip
    max_checkpoints: int = _setting(default=8, check=_at_least(0), help="ring checkpoints kept")
    backend: Backend = _setting("--backend", default=Backend.NUMPY, vocabulary=Backend, metavar="NAME",
                                help="compute backend, one of {words} (default: {default})")  # fmt: skip
    cuda_graphs: bool = _setting(
        "--no-cuda-graphs",
        default=True,
        check=_boolean,
        server=False,
        help="run every decode step and prefill chunk op by op instead of replaying captured CUDA graphs (cupy)",
    )
    cpu_kernels: CpuKernels | None = _setting(
        "--cpu-kernels", default=None, vocabulary=CpuKernels, metavar="NAME",
        help=f"the numpy backend's kernels, one of {{words}}: {DEFAULT_CPU_KERNELS.value} (the default with f32 "
        "compute: packed weights, compiled kernels, the packed products' activations quantized to int8 per 32-value "
        "block and multiplied with integer dot products as llama.cpp does, results within ~1e-3 of the float32 "
        "products; on a CPU without AVX512-VNNI numba's float32 products), numba (the same kernels with float32 "
        "products: closest to transformers) or numpy (float32 weights and BLAS: the reference the kernels are "
        "tested against)")  # fmt: skip
    batch_invariant: bool = _setting(
        "--no-batch-invariant",
        default=True,
        check=_boolean,
        help="let a slot's arithmetic depend on the batch and the prompt chunks (CPU: float32 products of several "
        "rows through BLAS or weight-row pairs, gemma3's long global attention through BLAS, the numpy kernels' "
        "plain BLAS products and chunk attention); by default a "
        "conversation's logits are the same bits whatever else runs",
    )
    threads: int | None = _setting(
        "-t",
        "--threads",
        default=None,
        check=_optional(_at_least(1)),
        metavar="N",
        unset=-1,
        help="CPU threads for the kernels and BLAS (default: the cores the engine may use)",
    )
    poll: int = _setting(
        "--poll",
        default=DEFAULT_POLL,
        check=_from_to(0, MAX_POLL),
        metavar=f"0-{MAX_POLL}",
        help="how long an idle kernel thread polls for work before it sleeps, as llama-server's --poll (default: "
        "{default}: awake through a decode step; 0: sleep at once, for a machine whose cores other work needs)",
    )
    chat_template: str | None = _setting(
        "--chat-template", default=None, check=_optional(chat_template_problem), metavar="NAME|JINJA",
        file_flag="--chat-template-file",
        help=f"chat template instead of the model's: a built-in name ({', '.join(values(ChatTemplateName))}) or a "
        "jinja template")  # fmt: skip

    def __attrs_post_init__(self) -> None:
        if found := _problems(attrs.asdict(self, recurse=False), _same):
            raise SettingsError(found)

    @classmethod
    def build(cls, given: Mapping[str, Any], name: Callable[[str], str] = _same) -> EngineSettings:
        """Settings from field values, each problem named by `name(field)` (a flag's key: `from_flags`)."""
        fields = attrs.fields_dict(cls)
        converted = {key: _converted(fields[key], value) for key, value in given.items()}
        defaults = {
            field.name: field.default for field in fields.values() if field.default is not attrs.NOTHING
        }
        if found := _problems({**defaults, **converted}, name):
            raise SettingsError(found)
        return cls(**given)

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any], name: Callable[[str], str] = _same) -> EngineSettings:
        """Settings from flag values by key (`Setting.key`: argparse's dests, strata-server's config names);
        other keys are ignored."""
        return cls.build({field: flags[row.key] for field, row in FLAGGED.items() if row.key in flags}, name)

    def to_argv(self) -> list[str]:
        """The engine's flags that give these settings (a field at its default is left out; max_checkpoints,
        which has no flag, is not carried)."""
        argv: list[str] = []
        for field in attrs.fields(type(self)):
            value, row = getattr(self, field.name), FLAGGED.get(field.name)
            if row is None or value == field.default:
                continue
            argv += [row.long] if isinstance(value, bool) else [row.long, str(value)]
        return argv

    def with_backend_defaults(self, architecture: str, *, backend: Backend, threads: int) -> EngineSettings:
        """The settings as they run on `backend` (the caller resolves "auto": `ops.resolve_settings`) with every
        None default filled in for it and the model's architecture (`DEFAULT_COMPUTE_DTYPE`,
        `DEFAULT_PREFILL_CHUNK`); `threads`: the count where none was given."""
        compute_dtype = self.compute_dtype or DEFAULT_COMPUTE_DTYPE[architecture][backend]
        on_f32_cpu = backend == Backend.NUMPY and compute_dtype == ComputeDType.F32
        return attrs.evolve(
            self,
            backend=backend,
            compute_dtype=compute_dtype,
            prefill_chunk=self.prefill_chunk or DEFAULT_PREFILL_CHUNK[backend],
            cpu_kernels=self.cpu_kernels or (DEFAULT_CPU_KERNELS if on_f32_cpu else CpuKernels.NUMPY),
            threads=self.threads or threads,
        )

    def n_ctx_total(self, n_ctx_train: int) -> int:
        """The context of all slots together: n_ctx, or the model's training context capped."""
        return self.n_ctx if self.n_ctx is not None else min(n_ctx_train, DEFAULT_N_CTX_CAP)

    def n_ctx_slot(self, n_ctx_train: int) -> int:
        """Each slot's context: the total // n_slots."""
        return self.n_ctx_total(n_ctx_train) // self.n_slots

    def slot_problem(self, n_ctx: int) -> str | None:
        """Why a total context of n_ctx cannot be shared by the slots (None: it can)."""
        return _slot_problem(n_ctx, self.n_slots, _same)


def _slot_problem(n_ctx: int, n_slots: int, name: Callable[[str], str]) -> str | None:
    if n_slots > 1 and n_ctx // n_slots < MIN_N_CTX_SLOT:
        return (f"{name('n_ctx')} {n_ctx} gives each of the {n_slots} slots {n_ctx // n_slots} tokens of context, "
                f"fewer than {MIN_N_CTX_SLOT}")  # fmt: skip
    return None


def _problems(given: Mapping[str, Any], name: Callable[[str], str]) -> list[str]:
    """Every problem of these field values: each field's own check, then those between fields whose own passed."""
    out, bad = [], set()
    for field, row in SETTINGS.items():
        if (text := row.check(given.get(field))) is not None:
            out.append(f"{name(field)}: {text}")
            bad.add(field)
    n_ctx, n_slots = given["n_ctx"], given["n_slots"]
    if (
        not {"n_ctx", "n_slots"} & bad
        and n_ctx is not None
        and (problem := _slot_problem(n_ctx, n_slots, name))
    ):
        out.append(problem)
    dtype, kernels = given["compute_dtype"], given["cpu_kernels"]
    if not {"backend", "compute_dtype"} & bad and given["backend"] == Backend.NUMPY and dtype in _CUPY_DTYPES:
        out.append(f"{name('compute_dtype')} {_shown(dtype)} needs the cupy backend")
    if (
        not {"cpu_kernels", "compute_dtype"} & bad
        and kernels in NUMBA_KERNELS
        and dtype not in (None, ComputeDType.F32)
    ):
        out.append(
            f"{name('cpu_kernels')} {_shown(kernels)} computes in f32, not {name('compute_dtype')} {_shown(dtype)}"
        )
    return out


_CUPY_DTYPES = frozenset({ComputeDType.F16, ComputeDType.BF16})
# field -> its row; those with flags; field -> the name its flags and strata-server's config file give it
SETTINGS: Mapping[str, Setting] = MappingProxyType(
    {f.name: f.metadata[_ROW] for f in attrs.fields(EngineSettings)}
)
FLAGGED: Mapping[str, Setting] = MappingProxyType(
    {field: row for field, row in SETTINGS.items() if row.flags}
)
KEYS: Mapping[str, str] = MappingProxyType(
    {field: row.key if row.flags else field for field, row in SETTINGS.items()}
)


def add_setting_flags(parser: argparse._ActionsContainer, *, typed: bool = True,
                      help_of: Mapping[str, str] = MappingProxyType({})) -> None:  # fmt: skip
    """The table's flags on `parser`, each value under its key and only where given (argparse.SUPPRESS).
    typed: the engine's (types, choices, the model required, the file flag read and exclusive with its
    setting's); else strata-server's: the flags it offers, their values as given (its config checks them),
    a file flag's under `<key>_file`, the `unset` value said in the help. `help_of`: a key's help where a parser says more (its own default)."""
    for field in attrs.fields(EngineSettings):
        row = FLAGGED.get(field.name)
        if row is None or not (typed or row.server):
            continue
        default = field.default.value if isinstance(field.default, enum.Enum) else field.default
        words = ", ".join(values(row.vocabulary)) if row.vocabulary else ""
        unset = "" if typed or row.unset is None else f"; {row.unset}: the default"
        options: dict[str, Any] = {
            "dest": row.key,
            "default": argparse.SUPPRESS,
            "help": help_of.get(row.key) or row.help.format(default=default, words=words) + unset,
        }
        if isinstance(default, bool):
            options["action"] = "store_false" if row.negated else "store_true"
        else:
            options["metavar"] = row.metavar
        if typed and "action" not in options:
            options.update(_typed(field, row))
        target: Any = parser.add_mutually_exclusive_group() if typed and row.file_flag else parser
        target.add_argument(*row.flags, **options)
        if row.file_flag is not None:
            target.add_argument(row.file_flag, dest=row.key if typed else f"{row.key}_file", metavar="FILE",
                                type=_file_text if typed else str, default=argparse.SUPPRESS,
                                help=f"a UTF-8 file whose text is {row.long}'s value")  # fmt: skip


def _typed(field: attrs.Attribute, row: Setting) -> dict[str, Any]:
    """argparse's type, choices and required for a field of the engine's parser."""
    if row.vocabulary is not None:
        return {"choices": values(row.vocabulary)}
    return {"type": flag_type(field.name), "required": field.default is attrs.NOTHING}


def flag_type(field: str) -> type:
    """The type of a setting's flag value: a vocabulary's word is a str, else the field's type (None aside)."""
    if SETTINGS[field].vocabulary is not None:
        return str
    annotation = attrs.fields_dict(EngineSettings)[field].type
    return next(t for t in typing.get_args(annotation) or (annotation,) if t is not type(None))


attrs.resolve_types(EngineSettings)
