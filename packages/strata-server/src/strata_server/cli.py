"""``strata-server``: llama-server-style flags -> ServerConfig -> gunicorn."""

from __future__ import annotations

import argparse
import errno
import shlex
import socket
import sys
from pathlib import Path
from typing import Any

import attrs
from strata_engine.settings import Pooling, add_setting_flags, values
from strata_sessionfile import RestoreMode

from .config import (
    DEFAULT_CACHE_DISK_MAX_MIB,
    DEFAULT_CACHE_IDLE_SECONDS,
    DEFAULT_CACHE_MIN_REUSE,
    DEFAULT_CACHE_STORE_QUEUE_MIB,
    DEFAULT_HOST,
    DEFAULT_MODEL_FILE,
    DEFAULT_MODEL_PACKAGE,
    DEFAULT_PORT,
    LOOPBACK_HOSTS,
    ConfigError,
    ServerConfig,
    build_config,
    cache_disk_warnings,
    read_config_file,
)

MODEL_REFUSED = 3  # exit status: the model file is unsupported, refused or unreadable (2: bad configuration)
PORT_TAKEN = 4  # exit status: an address to listen on is taken (or cannot be bound)
LIST_FLAGS = ("api_key", "allowed_hosts", "trusted_origins", "cors_origins", "alias", "tags", "host")

EPILOG = """\
Every flag can also be given in --config FILE (TOML, or JSON for a .json name) under its long name
with '_' (slot_save_path = "/var/lib/strata/slots"); flags override the file. All problems in the
flags and the file are reported together.

Security: every request must carry a Host header naming a loopback name, the bound address or an
--allowed-hosts entry (DNS-rebinding protection). With --api-key, every endpoint except /health,
/v1/health and OPTIONS needs the key (Authorization: Bearer KEY, Authorization: KEY, or X-Api-Key).
Slot actions also need Content-Type: application/json and no Origin header other than the server's
own or a --trusted-origins entry. Restore only session files this server wrote: the file's hashes
detect corruption, they do not authenticate it; with --session-key-file, every file written carries a MAC
and a file without one (unless --session-key-optional) or of another key is refused.
"""


def build_parser() -> argparse.ArgumentParser:
    from strata_engine.model_check import supported_architectures

    parser = argparse.ArgumentParser(
        prog="strata-server",
        argument_default=argparse.SUPPRESS,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="llama-server-compatible HTTP API (completion, OpenAI chat, infill, embeddings, tokenize, slot "
        "save/restore/erase, metrics) over a supervised Strata engine, run under gunicorn.",
    )
    add = parser.add_argument
    add("--config", metavar="FILE", help="read settings from FILE (TOML or JSON); flags override it")
    engine = parser.add_argument_group(
        "model and engine", "the engine's settings (strata-engine serve takes the same flags)"
    )
    add_setting_flags(
        engine,
        typed=False,
        help_of={
            "model": f"GGUF model file of a supported architecture ({', '.join(supported_architectures())}; "
            "a file holding a key or tensor the engine does not compute is refused before the port is bound) "
            f"(default: SmolLM2-135M-Instruct Q4_1 from the {DEFAULT_MODEL_PACKAGE} package, {DEFAULT_MODEL_FILE})"
        },
    )  # the engine's settings: -m, -c, -np, --kv-type, ..., -t, --poll
    add(
        "-a",
        "--alias",
        metavar="NAME[,NAME...]",
        action="append",
        help="model names, all its aliases; as llama-server keeps them (unique, sorted), the first in sort order "
        "is the id reported by /v1/models and in responses (default: the model path)",
    )
    add("--tags", metavar="TAG[,TAG...]", action="append", help="model tags reported by /v1/models")
    add(
        "--host",
        metavar="ADDR[,ADDR...]",
        action="append",
        help=f"addresses to listen on, each of them (default: {DEFAULT_HOST}, loopback only)",
    )
    add("--port", metavar="N", help=f"port to listen on (default: {DEFAULT_PORT})")
    add(
        "-sps",
        "--slot-prompt-similarity",
        metavar="F",
        help="a request that names no id_slot goes to the idle "
        "slot whose held tokens share the longest prefix with its prompt when that prefix is more than F of the "
        "prompt, else to the least recently used idle slot; 0 turns the similarity rule off (default: 0.1, as "
        "llama-server)",
    )
    add(
        "-ctk",
        "--cache-type-k",
        metavar="TYPE",
        help="llama-server's K cache type flag; must equal the V type",
    )
    add(
        "-ctv",
        "--cache-type-v",
        metavar="TYPE",
        help="llama-server's V cache type flag; must equal the K type",
    )
    add(
        "--no-prefill-assistant",
        dest="prefill_assistant",
        action="store_false",
        help="a chat's final assistant message is a finished turn, not one for the model to continue "
        "(default: continued, as llama-server)",
    )
    add(
        "-rea",
        "--reasoning",
        metavar="on|off|auto",
        help="the chat templates' enable_thinking: on, off, or auto = on where the template reacts to it "
        "(default: auto, as llama-server); a request's chat_template_kwargs.enable_thinking wins",
    )
    add(
        "--reasoning-effort",
        metavar="LEVEL",
        help="the chat templates' reasoning_effort (and reasoning_strength): a level such as low, medium or high, "
        "or default: the template's own (default: default, as llama-server)",
    )
    add(
        "--reasoning-preserve",
        dest="reasoning_preserve",
        action="store_true",
        help="the chat templates' preserve_reasoning: keep the reasoning of every assistant turn, not just the last "
        "(default: on, as llama-server, unless --chat-template-kwargs says otherwise)",
    )
    add(
        "--no-reasoning-preserve",
        dest="reasoning_preserve",
        action="store_false",
        help="the chat templates' preserve_reasoning off",
    )
    add(
        "--chat-template-kwargs",
        metavar="JSON",
        help='a JSON object of more chat template variables, e.g. \'{"key": "value"}\'; a request\'s '
        "chat_template_kwargs win",
    )
    add(
        "--jinja",
        dest="jinja",
        action="store_true",
        help="llama-server's flag, always on: templates are jinja (a built-in --chat-template name renders "
        "llama.cpp's C++ format of that name, as llama-server with --no-jinja)",
    )
    add(
        "--embedding",
        "--embeddings",
        dest="embedding",
        action="store_true",
        help="answer /embeddings and /v1/embeddings (default: off, 501), as llama-server's --embeddings; completions "
        "still run, and an embedding leaves the slot's conversation as it was",
    )
    add(
        "--pooling",
        metavar="TYPE",
        help=f"how embeddings pool the tokens' states: one of {', '.join(values(Pooling))} "
        "(default: the model's own, none for a model that does not say)",
    )
    add(
        "--restore-mode",
        metavar="MODE",
        help=f"how a restore lands the K/V: one of {', '.join(values(RestoreMode))} (default: auto)",
    )
    add(
        "--slot-save-path",
        metavar="DIR",
        help="existing folder for slot files; enables "
        "POST /slots/{id}?action=save|restore|erase (default: disabled, 501)",
    )
    add("--api-key", metavar="KEY[,KEY...]", action="append", help="require one of these API keys")
    add("--api-key-file", metavar="FILE", help="file with one API key per line")
    add(
        "--metrics", action="store_true", help="enable GET /metrics (Prometheus text; default: disabled, 501)"
    )
    add("--webui", dest="webui", action="store_true", help="serve the chat page at GET / (default)")
    add("--no-webui", dest="webui", action="store_false", help="no chat page (GET / answers 404)")
    add("--slots", dest="slots", action="store_true", help="enable GET /slots (default)")
    add("--no-slots", dest="slots", action="store_false", help="disable GET /slots (501)")
    add(
        "--allowed-hosts",
        metavar="HOST[,HOST...]",
        action="append",
        help="extra Host header names to accept besides loopback names and the bound address ('*': any)",
    )
    add(
        "--trusted-origins",
        metavar="ORIGIN[,ORIGIN...]",
        action="append",
        help="Origins (http://host:port) allowed to use slot actions besides the server's own",
    )
    add(
        "--cors-origins",
        metavar="ORIGIN[,ORIGIN...]",
        action="append",
        help="CORS allowed origins: '*' (default; never with credentials), 'localhost' (any origin on a loopback "
        "host) and/or origins like http://host:port; a listed origin is echoed with credentials, as llama-server",
    )
    add(
        "--http-threads",
        "--threads-http",
        dest="http_threads",
        metavar="N",
        help="HTTP threads: gunicorn gthread threads (default: 32; requests waiting for the slot each hold one)",
    )
    add(
        "-to",
        "--timeout",
        metavar="S",
        help="read timeout in seconds (llama-server's): a connection whose request "
        "has not fully arrived within S is closed; stalled clients hold no thread meanwhile (default: 600)",
    )
    add(
        "--slot-wait",
        metavar="S",
        help="seconds a request waits its turn for a slot (every slot busy, or the one it named) before a "
        "503 (default: 600)",
    )
    add(
        "--engine-timeout",
        metavar="S",
        help="seconds of engine silence inside one command after which it is "
        "killed and restarted (default: 0 = never; a huge prompt on a CPU is silent for long)",
    )
    add(
        "--sse-ping-interval",
        metavar="S",
        help="keep-alive comment on a silent stream every S seconds (default: 30; 0: off)",
    )
    add(
        "--engine-command",
        metavar="CMD",
        help="command that starts the engine, before --model ... "
        "(default: this Python with -m strata_engine.cli serve)",
    )
    add("--log-level", metavar="LEVEL", help="debug, info, warning, error (default: info)")
    add(
        "-v",
        "--verbose",
        action="store_true",
        help="log everything (debug level), the engine's log too; every answer carries __verbose unless the "
        "request sets verbose: false (as llama-server)",
    )
    add(
        "-b",
        "--batch-size",
        metavar="N",
        help="llama-server's logical batch: a stream with return_progress reports the prompt's evaluation once "
        "per N tokens (default: 2048); given, it also caps the engine's prefill chunk",
    )
    add(
        "-ub",
        "--ubatch-size",
        metavar="N",
        help="llama-server's physical batch: the engine evaluates a prompt N tokens at a time at most (default: "
        "the engine's prefill chunk, 512 on the CPU)",
    )
    sampling = parser.add_argument_group(
        "default sampling and output (what a request that does not set the "
        "field gets; a request's own fields win)"
    )
    default = {
        field.name: field.default for field in attrs.fields(ServerConfig)
    }  # the engine's SamplingParams'
    sampling.add_argument(
        "--temp", metavar="T", help=f"temperature (default: {default['temp']}; 0 or less: greedy)"
    )
    sampling.add_argument("--top-k", metavar="N", help=f"top-k (default: {default['top_k']}; 0 or less: off)")
    sampling.add_argument("--top-p", metavar="P", help=f"top-p (default: {default['top_p']}; 1.0: off)")
    sampling.add_argument("--min-p", metavar="P", help=f"min-p (default: {default['min_p']}; 0: off)")
    sampling.add_argument(
        "-s", "--seed", metavar="N", help=f"sampler seed (default: {default['seed']}, random)"
    )
    sampling.add_argument(
        "-n",
        "--n-predict",
        "--predict",
        dest="n_predict",
        metavar="N",
        help=f"tokens to generate (default: {default['n_predict']}, until a stop or the full "
        "context); a request's own n_predict wins, as llama-server's",
    )
    sampling.add_argument(
        "--repeat-penalty",
        metavar="X",
        help=f"repetition penalty (default: {default['repeat_penalty']}; 1.0: off)",
    )
    sampling.add_argument(
        "--repeat-last-n",
        metavar="N",
        help="tokens the repetition penalty looks back over "
        f"(default: {default['repeat_last_n']}; -1: the context; 0: off)",
    )
    sampling.add_argument(
        "--presence-penalty",
        metavar="X",
        help=f"presence penalty (default: {default['presence_penalty']}; 0.0: off)",
    )
    sampling.add_argument(
        "--frequency-penalty",
        metavar="X",
        help=f"frequency penalty (default: {default['frequency_penalty']}; 0.0: off)",
    )
    add_store_flags(parser)
    return parser


def add_store_flags(parser: argparse.ArgumentParser) -> None:
    """The session store's flags (strata_server/store/)."""
    store = parser.add_argument_group(
        "session store",
        "keep every conversation in a bounded folder of session files: saved when its slot "
        "takes another conversation, when idle and at shutdown; the longest stored prefix of each prompt is "
        "restored, so only the rest is evaluated",
    )
    add = store.add_argument
    add(
        "--cache-disk",
        metavar="DIR",
        help="the store's folder (created 0700 if missing; one owned by another user or writable by group or "
        "others is refused, see --cache-disk-loose-permissions; servers of other "
        "models or settings may share it: their files are ignored) (default: off)",
    )
    add(
        "--cache-disk-loose-permissions",
        action="store_true",
        help="start even when the --cache-disk folder is owned by another user or writable by group or others "
        "(default: refused, as OpenSSH refuses a loose key file: another user could read every kept conversation "
        "or plant one the store restores); a warning is printed instead",
    )
    add(
        "--cache-disk-max",
        metavar="MiB",
        help="most MiB of this server's files in the store; the least "
        f"recently used are removed after each save (default: {DEFAULT_CACHE_DISK_MAX_MIB})",
    )
    add(
        "--cache-ram",
        metavar="MiB",
        help="llama-server's RAM prompt cache: a store of MiB in a private tmpfs "
        "folder that dies with the server (not together with --cache-disk) (default: 0, off)",
    )
    add(
        "--cache-min-reuse",
        metavar="N",
        help="restore a stored conversation only when it holds at least N "
        f"more prompt tokens than the slot (default: {DEFAULT_CACHE_MIN_REUSE})",
    )
    add(
        "--cache-idle-seconds",
        metavar="S",
        help="save a slot's conversation once it is idle S seconds, so a "
        f"crash loses at most the turn in flight (default: {DEFAULT_CACHE_IDLE_SECONDS:g}; 0: never)",
    )
    add(
        "--cache-store",
        metavar="s3://BUCKET/PREFIX",
        help="an S3-compatible object store shared by a fleet "
        "(credentials and region the standard AWS way). Behind --cache-disk: every saved conversation is uploaded, "
        "and a prompt the folder misses is looked up there and downloaded. Alone: conversations are saved straight "
        "to objects (multipart) and restored straight from them (ranged reads, the version pinned), nothing on "
        "disk; the server never deletes another's objects (a bucket lifecycle rule bounds the bucket) (default: off)",
    )
    add(
        "--cache-store-endpoint",
        metavar="URL",
        help="the object store's endpoint, for a non-AWS store (default: AWS's)",
    )
    add(
        "--cache-store-queue",
        metavar="MiB",
        help="most MiB of files waiting for their upload to --cache-store; a conversation's pending upload is "
        "replaced by its newer turn's, and the oldest are dropped when full (they go with their next save) "
        f"(default: {DEFAULT_CACHE_STORE_QUEUE_MIB})",
    )
    add(
        "--no-cache-write-behind",
        dest="cache_write_behind",
        action="store_false",
        help="with --cache-store: do not save and upload each conversation as its reply is sent; it then "
        "reaches the store only when its slot takes another, after --cache-idle-seconds, or at shutdown",
    )
    add(
        "--session-key-file",
        metavar="FILE",
        help="a file of 32 random bytes (head -c 32 /dev/urandom): every "
        "session file written (store, slot save) carries its MAC, and a file without it or of another key is "
        "refused before it reaches the model (default: off)",
    )
    add(
        "--session-key-optional",
        action="store_true",
        help="with --session-key-file: also accept session files "
        "without a MAC (files written by servers without a key); a file with one must still match the key",
    )


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    values = {key: value for key, value in vars(args).items() if key != "config"}
    for key in LIST_FLAGS:
        if key in values:
            values[key] = [part.strip() for item in values[key] for part in item.split(",") if part.strip()]
    if "engine_command" in values:
        values["engine_command"] = shlex.split(values["engine_command"])
    return values


def load_config(argv: list[str] | None = None) -> ServerConfig:
    args = build_parser().parse_args(argv)
    file_values = read_config_file(Path(args.config)) if getattr(args, "config", None) else {}
    return build_config(file_values, flag_values(args))


def bind_problem(host: str, port: int) -> str | None:
    """Why `host:port` cannot be listened on (taken, or no such address), as gunicorn binds it; None if free."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        return str(exc)
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gunicorn: TIME_WAIT is no obstacle
        try:
            probe.bind(address)
        except OSError as exc:
            return "the port is taken" if exc.errno == errno.EADDRINUSE else str(exc)
    return None


def main(argv: list[str] | None = None) -> int:
    try:
        config = load_config(argv)
    except ConfigError as exc:
        sys.stderr.write(f"strata-server: {exc}\n")
        return 2
    from strata_engine.errors import EngineError
    from strata_engine.model_check import check_model_file

    from .gunicorn_app import StrataGunicorn

    # before the port is bound: a file strata-engine refuses never gets a listening server (another
    # --engine-command is its own judge of the files it takes)
    try:
        if not config.engine_command:
            check_model_file(config.engine.model_path)
    except (EngineError, OSError) as exc:
        sys.stderr.write(f"strata-server: cannot serve {config.engine.model_path}: {exc}\n")
        return MODEL_REFUSED
    # then the port, before the banner: gunicorn would print it, retry the bind for 5 s, then exit 1
    for host in config.host:
        if (problem := bind_problem(host, config.port)) is not None:
            sys.stderr.write(f"strata-server: cannot listen on {host} port {config.port}: {problem}\n")
            return PORT_TAKEN
    for warning in cache_disk_warnings(config):  # with --cache-disk-loose-permissions (else refused)
        sys.stderr.write(f"strata-server: warning: cache_disk: {warning}\n")
    exposed = [h for h in config.host if h not in LOOPBACK_HOSTS]
    if exposed and not config.api_key and not config.api_key_file:
        sys.stderr.write(f"strata-server: warning: listening on {', '.join(exposed)} without --api-key\n")
    if any(h in ("0.0.0.0", "::") for h in config.host) and not config.allowed_hosts:
        sys.stderr.write(
            "strata-server: warning: listening on every address, but only Host headers naming a "
            "loopback name are accepted; add the names clients use with --allowed-hosts\n"
        )
    sys.stderr.write(
        f"strata-server: {' '.join('http://' + b for b in config.binds())} model {config.engine.model_path}\n"
    )
    StrataGunicorn(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
