"""`strata-engine`: `serve` (the engine protocol on stdin/stdout) and `generate` (text for people)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import strata_sessionfile as sf

from .errors import EngineError, UsageError
from .protocol import ExitStatus
from .serve import serve
from .settings import (
    DEFAULT_POLL,
    MIN_N_CTX_SLOT,
    Backend,
    ChatTemplateName,
    ComputeDType,
    CpuKernels,
    EngineSettings,
    KVType,
    values,
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print and exit; the caller reports it instead
        raise UsageError(f"{self.prog}: {message}")


def _add_settings(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m", required=True, type=Path, help="the GGUF model file")
    parser.add_argument(
        "--ctx-size",
        "-c",
        type=int,
        default=None,
        help="context size in tokens, the total of all slots: each of the --parallel N slots gets CTX_SIZE / N, "
        "rounded down, as llama-server's (default: the model's, at most 8192)",
    )
    parser.add_argument(
        "--parallel",
        "-np",
        type=int,
        default=1,
        metavar="N",
        help=f"slots: conversations held at once, each with CTX_SIZE / N tokens of context (at least {MIN_N_CTX_SLOT} "
        "when N > 1; default 1)",
    )
    parser.add_argument("--kv-type", choices=values(KVType), default=KVType.F16.value, help="K/V storage type (default f16)")
    parser.add_argument(
        "--kv-resident",
        type=int,
        default=None,
        help="keep the K/V in a host pool with an N-token resident ring in front of it",
    )
    parser.add_argument(
        "--no-prompt-cache",
        action="store_true",
        help="do not reuse the held conversation's prefix on the next request",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="tokens per prefill batch (default 512 on numpy, 4096 on cupy); a quarter of it while other slots generate",
    )
    parser.add_argument(
        "--compute-dtype",
        choices=values(ComputeDType),
        default=None,
        help="activations (default f32 on numpy; on cupy f16, or bf16 for models whose activations overflow "
        "f16: gemma3); logits are computed in f32 either way",
    )
    parser.add_argument(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="run every decode step and prefill chunk op by op instead of replaying captured CUDA graphs (cupy)",
    )
    parser.add_argument(
        "--backend", choices=values(Backend), default=Backend.NUMPY.value, help="compute backend (default numpy)"
    )
    parser.add_argument(
        "--cpu-kernels",
        choices=values(CpuKernels),
        default=None,
        help="the numpy backend's kernels: numba-q8 (the default with f32 compute: packed weights, compiled "
        "kernels, the packed products' activations quantized to int8 per 32-value block and multiplied with "
        "integer dot products as llama.cpp does, results within ~1e-3 of the float32 products; on a CPU without "
        "AVX512-VNNI numba's float32 products), numba (the same kernels with float32 products: closest to "
        "transformers) or numpy (float32 weights and BLAS: the reference the kernels are tested against)",
    )
    parser.add_argument(
        "--threads",
        "-t",
        type=int,
        default=None,
        help="CPU threads for the kernels and BLAS (default: the cores this process may use)",
    )
    parser.add_argument(
        "--poll",
        type=int,
        default=DEFAULT_POLL,
        metavar="0-100",
        help=f"how long an idle kernel thread polls for work before it sleeps, as llama-server's --poll (default: "
        f"{DEFAULT_POLL}: awake through a decode step; 0: sleep at once, for a machine whose cores other work needs)",
    )
    template = parser.add_mutually_exclusive_group()
    template.add_argument(
        "--chat-template",
        default=None,
        metavar="NAME|JINJA",
        help=f"chat template instead of the model's: a built-in name ({', '.join(values(ChatTemplateName))}) or a "
        "jinja template",
    )
    template.add_argument(
        "--chat-template-file", type=_file_text, default=None, metavar="FILE", help="a file with a jinja chat template"
    )
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
    generate.add_argument("--temperature", type=float, default=0.8)
    generate.add_argument("--top-k", type=int, default=40)
    generate.add_argument("--top-p", type=float, default=0.95)
    generate.add_argument("--min-p", type=float, default=0.05)
    generate.add_argument("--repeat-penalty", type=float, default=1.0)
    generate.add_argument("--repeat-last-n", type=int, default=64)
    generate.add_argument("--seed", type=int, default=-1)
    generate.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    generate.add_argument("--ignore-eos", action="store_true")
    return parser


def _settings(args: argparse.Namespace) -> EngineSettings:
    return EngineSettings(
        model_path=args.model,
        n_ctx=args.ctx_size,
        n_slots=args.parallel,
        kv_type=args.kv_type,
        compute_dtype=args.compute_dtype,
        kv_resident=args.kv_resident,
        prompt_cache=not args.no_prompt_cache,
        prefill_chunk=args.prefill_chunk,
        cuda_graphs=args.cuda_graphs,
        backend=args.backend,
        cpu_kernels=args.cpu_kernels,
        threads=args.threads,
        poll=args.poll,
        chat_template=_chat_template(args),
    )


def _chat_template(args: argparse.Namespace) -> str | None:
    return args.chat_template_file if args.chat_template_file is not None else args.chat_template


def _file_text(path: str) -> str:
    """An argument that names a UTF-8 text file: its text (argparse reports a failure as a usage error)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc}") from None


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

    settings = _settings(args)
    try:
        settings.validate()
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
            session_options = SessionOptions.from_environ(args.restore_mode, key=args.session_key_file,
                                                          require_mac=not args.session_key_optional,
                                                          object_store_endpoint=args.object_store_endpoint)
        except ValueError as exc:
            print(f"strata-engine serve: {exc}", file=sys.stderr)
            sys.stdout.write(json.dumps({"event": "fatal", "message": str(exc)}) + "\n")
            return ExitStatus.USAGE
        status = serve(_settings(args), session_options=session_options, restart_argv=sys.orig_argv)
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
