"""`strata-engine`: `serve` (the engine protocol on stdin/stdout) and `generate` (text for people)."""

from __future__ import annotations

from . import process_env  # noqa: F401  (first: the process's environment precedes numpy's OpenBLAS)

# isort: split
import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence

import strata_sessionfile as sf

from .errors import EngineError, UsageError
from .protocol import ExitStatus
from .sampling import SamplingParams
from .serve import serve
from .settings import EngineSettings, add_setting_flags, values


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print and exit; the caller reports it instead
        raise UsageError(f"{self.prog}: {message}")


def _add_settings(parser: argparse.ArgumentParser) -> None:
    add_setting_flags(parser)
    parser.add_argument("--log-level", default="WARNING", help="log level on stderr (default WARNING)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="strata-engine", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    serve_parser = commands.add_parser(
        "serve",
        help="serve spec/engine-protocol.md on stdin/stdout",
        description="Load a model and serve the engine protocol: one command per line on stdin, JSON lines "
        "on stdout. Exit statuses: 0 clean, 1 fatal, 2 bad settings, 3 model not loadable, 4 fail-stop.",
    )
    _add_settings(serve_parser)
    serve_parser.add_argument(
        "--restore-mode",
        choices=values(sf.RestoreMode),
        default=sf.RestoreMode.AUTO.value,
        help="RESTORE: staged (one read into a staging area, then a switch), streaming (two passes, bounded "
        "RAM) or auto (staged when RAM allows; default)",
    )
    serve_parser.add_argument(
        "--session-key-file",
        type=_session_key,
        default=None,
        metavar="FILE",
        help="a file of 32 random bytes: SAVE writes files authenticated by this key, RESTORE and RESTORE_PREFIX "
        "refuse a file without its MAC (see --session-key-optional) before anything reaches the K/V",
    )
    serve_parser.add_argument(
        "--session-key-optional",
        action="store_true",
        help="with --session-key-file: also restore files without a MAC (a file with one must still match the key)",
    )
    serve_parser.add_argument(
        "--object-store-endpoint",
        default=None,
        metavar="URL",
        help="the endpoint of a non-AWS S3-compatible store for SAVE / RESTORE / RESTORE_PREFIX paths s3://BUCKET/KEY "
        "(credentials and region the standard AWS way; needs boto3: strata-engine[s3]) (default: AWS's)",
    )
    generate = commands.add_parser("generate", help="complete a prompt and stream the text to stdout")
    _add_settings(generate)
    generate.add_argument(
        "--prompt", "-p", required=True, help="the prompt (or the user message with --chat)"
    )
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    generate.add_argument("--system", default=None, help="a system message (with --chat)")
    generate.add_argument(
        "-n", "--n-predict", type=int, default=128, help="tokens to generate (-1: until a stop)"
    )
    sampling = SamplingParams()
    generate.add_argument("--temperature", type=float, default=sampling.temperature)
    generate.add_argument("--top-k", type=int, default=sampling.top_k)
    generate.add_argument("--top-p", type=float, default=sampling.top_p)
    generate.add_argument("--min-p", type=float, default=sampling.min_p)
    generate.add_argument("--repeat-penalty", type=float, default=sampling.repeat_penalty)
    generate.add_argument("--repeat-last-n", type=int, default=sampling.repeat_last_n)
    generate.add_argument("--seed", type=int, default=-1)
    generate.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    generate.add_argument("--ignore-eos", action="store_true")
    return parser


def _session_key(path: str) -> sf.SessionKey:
    """An argument that names a session key file (exactly 32 bytes): the key."""
    try:
        return sf.SessionKey.from_file(path)
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"cannot use {path} as a session key: {exc}") from None


def _generate(args: argparse.Namespace) -> ExitStatus:
    from .chat import ChatTemplate
    from .completion import Completer, parse_request
    from .slots import SlotSet
    from .tokenizer import Tokenizer

    try:
        settings = EngineSettings.from_flags(vars(args))
    except EngineError as exc:
        print(f"strata-engine generate: {exc}", file=sys.stderr)
        return ExitStatus.USAGE
    if not settings.model_path.is_file():
        print(f"strata-engine generate: model file not found: {settings.model_path}", file=sys.stderr)
        return ExitStatus.MODEL_LOAD
    start = time.perf_counter()
    try:
        runner = SlotSet.load(settings).runners[0]  # the prompt goes to slot 0, with its share of the context
        tokenizer = Tokenizer.from_gguf_metadata(runner.gguf.metadata)
        template = ChatTemplate.for_model(runner.gguf.metadata, tokenizer, settings.chat_template)
    except (EngineError, OSError, ValueError) as exc:
        print(f"strata-engine generate: cannot load {settings.model_path}: {exc}", file=sys.stderr)
        return ExitStatus.MODEL_LOAD
    print(f"[loaded {settings.model_path.name} in {time.perf_counter() - start:.1f} s]", file=sys.stderr)
    request_obj: dict = {
        "n_predict": args.n_predict, "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
        "min_p": args.min_p, "repeat_penalty": args.repeat_penalty, "repeat_last_n": args.repeat_last_n,
        "seed": args.seed, "stop": args.stop, "ignore_eos": args.ignore_eos,
    }  # fmt: skip
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        request_obj["messages"] = messages
    else:
        request_obj["prompt"] = args.prompt
    try:
        request = parse_request(request_obj)
        completer = Completer(runner, tokenizer, template)

        def show(event) -> None:
            sys.stdout.write(event.content)
            sys.stdout.flush()

        result = completer.complete(request, on_token=show)
    except EngineError as exc:
        print(f"\nstrata-engine generate: {exc}", file=sys.stderr)
        return ExitStatus.USAGE
    except KeyboardInterrupt:
        print("\n[interrupted]", file=sys.stderr)
        return ExitStatus.CLEAN
    t = result.timings
    sys.stdout.write("\n")
    print(
        f"[stop: {result.stop_type.value}{' ' + json.dumps(result.stopping_word) if result.stopping_word else ''}; "
        f"prompt {t.prompt_n} tokens in {t.prompt_ms:.0f} ms ({t.prompt_per_second:.1f} tok/s); "
        f"generated {t.predicted_n} tokens in {t.predicted_ms:.0f} ms ({t.predicted_per_second:.1f} tok/s)]",
        file=sys.stderr,
    )
    return ExitStatus.CLEAN


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        print(str(exc), file=sys.stderr)
        if argv is None and len(sys.argv) > 1 and sys.argv[1] == "serve":
            # the server reads stdout: say it there too
            sys.stdout.write(json.dumps({"event": "fatal", "message": str(exc)}) + "\n")
            sys.stdout.flush()
        return ExitStatus.USAGE
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "serve":
        from .session import SessionOptions

        try:
            if args.session_key_optional and args.session_key_file is None:
                raise ValueError("--session-key-optional needs --session-key-file")
            session_options = SessionOptions.from_environ(
                args.restore_mode,
                key=args.session_key_file,
                require_mac=not args.session_key_optional,
                object_store_endpoint=args.object_store_endpoint,
            )
            settings = EngineSettings.from_flags(vars(args))
        except (ValueError, EngineError) as exc:
            print(f"strata-engine serve: {exc}", file=sys.stderr)
            sys.stdout.write(json.dumps({"event": "fatal", "message": str(exc)}) + "\n")
            return ExitStatus.USAGE
        status = serve(settings, session_options=session_options, restart_argv=sys.orig_argv)
    else:
        status = _generate(args)
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader is gone; keep the interpreter from complaining at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
