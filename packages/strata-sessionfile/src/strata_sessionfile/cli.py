"""``strata-sessionfile inspect FILE [--json] [--verify] [--layers] [--key-file KEY] [--endpoint-url URL]``.

FILE is a path or an object, ``s3://BUCKET/KEY`` (credentials and region the standard AWS way;
``--endpoint-url`` for a non-AWS store). ``--key-file`` verifies the file's MAC with that 32-byte key (and,
with ``--verify``, its payload digest); a file without a MAC is then refused.

The human output groups what repeats (identical layers on one line, a per-layer config list such as the
RoPE entries grouped by value) and gives sizes in decimal units beside the byte counts; ``--layers`` adds
the full per-layer table, ``--json`` prints everything (the same object whatever the other flags).

Exit codes (spec section 11): 0 valid, 1 invalid (the reason is printed), 2 unreadable, 3 unsupported here
(``--verify`` of a compressed file without its codec's module, an ``s3://`` object without boto3), 4 not
authenticated by the key, 64 usage. A reader that stops reading early (``| head``) cuts the output short
without changing the exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Sequence
from typing import TypeVar

from . import errors as E
from ._fileio import discard_writes
from .auth import SessionKey
from .codec import dtype_name
from .format import Part
from .llamacpp import (
    GGML_TYPE_BY_NAME,
    SlotOptions,
    config_of,
    describe,
    is_slot_file,
    read_slot_file,
    session_to_slot,
    slot_to_session,
)
from .reader import inspect
from .records import Inspection
from .seam import S3_SCHEME, s3_location

EXIT_VALID = 0
EXIT_INVALID = 1
EXIT_UNREADABLE = 2
EXIT_UNSUPPORTED = 3
EXIT_UNAUTHENTICATED = 4
EXIT_USAGE = 64
# The exit code of each kind of refusal, most specific first (anything else is EXIT_INVALID).
EXIT_FOR_ERROR: tuple[tuple[type[E.SessionFileError], int], ...] = (
    (E.FileAccessError, EXIT_UNREADABLE),
    (E.CompressionUnavailable, EXIT_UNSUPPORTED),
    (E.AuthenticationFailed, EXIT_UNAUTHENTICATED),
)
EXIT_KIND = {
    EXIT_UNREADABLE: "unreadable",
    EXIT_UNSUPPORTED: "unsupported",
    EXIT_UNAUTHENTICATED: "unauthenticated",
}


def _compression_dict(lay) -> dict | None:
    comp = lay.compressed
    if comp is None:
        return None
    stored = comp.section_length
    return {
        "codec": comp.codec.name.lower(),
        "level": comp.level,
        "block_size": comp.block_size,
        "n_blocks": comp.n_blocks,
        "frames_bytes": comp.frames_length,
        "stored_bytes": stored,
        "data_bytes": lay.data_length,
        "ratio": round(stored / lay.data_length, 4) if lay.data_length else None,
    }


def inspection_dict(info: Inspection) -> dict:
    h, md, lay = info.header, info.metadata, info.layout
    st = md.state
    stored = lay.trailer_offset - lay.data_offset
    return {
        "valid": True,
        "path": info.path,
        "payload_verified": info.payload_verified,
        "header": {
            "format_version": h.format_version,
            "flags": h.flags,
            "model_fingerprint": h.model_fingerprint.hex(),
            "config_fingerprint": h.config_fingerprint.hex(),
            "payload_length": h.payload_length,
            "header_hash": f"{h.header_hash:016x}",
        },
        "payload_hash": info.payload_hash.hex() if info.payload_hash else None,
        "authentication": {
            "authenticated": info.authenticated,
            "key_id": info.key_id.hex() if info.key_id else None,
            "mac_verified": info.mac_verified,
        },
        "model_files": [{"role": f.role, "size": f.size, "digest": f.digest.hex()} for f in md.model.files],
        "config": md.config.mapping,
        "state": {
            "n_tokens": st.n_tokens,
            "position": st.position,
            "first_tokens": list(st.tokens[:8]),
            "last_tokens": list(st.tokens[-8:]),
            "sampler_state_bytes": len(st.sampler_state),
            "checkpoint_token_index": st.checkpoint.token_index,
            "checkpoint_data_bytes": len(st.checkpoint.data),
            "engine_fields_bytes": len(st.engine_fields),
        },
        "layers": [
            {
                "role": g.spec.role.name.lower(),
                "index": g.spec.index,
                "n_kv_heads": g.spec.n_kv_heads,
                "head_dim_k": g.spec.head_dim_k,
                "head_dim_v": g.spec.head_dim_v,
                "k_dtype": dtype_name(g.spec.k_dtype),
                "v_dtype": dtype_name(g.spec.v_dtype),
                "window": g.spec.window,
                "tokens_held": g.tokens_held,
                "part_bytes": {p.name.lower(): g.part_size(p) for p in Part},
            }
            for g in md.layers
        ],
        "sections": {
            "header": 64,
            "metadata": lay.data_offset - 64,
            "data": stored,
            "trailer": lay.file_size - lay.trailer_offset,
            "file_size": lay.file_size,
            "data_offset": lay.data_offset,
            "kv_bytes": lay.data_length,
        },
        "compression": _compression_dict(lay),
    }


# --- human output -----------------------------------------------------------------------------------
_UNITS = ("kB", "MB", "GB", "TB", "PB")
_PART_NAMES = {"k": "K", "v": "V", "k_scales": "K scales", "v_scales": "V scales", "extra": "extra"}


def human_size(n: int) -> str:
    """Bytes in decimal units, three significant digits: 512 B, 4.10 kB, 1.24 MB, 74.7 MB."""
    if n < 1000:
        return f"{n} B"
    value, step = n / 1000, 0
    while value >= 999.5 and step < len(_UNITS) - 1:  # 999.5 would print as 1000 in this unit
        value, step = value / 1000, step + 1
    unit = _UNITS[step]
    return (
        f"{value:.2f} {unit}"
        if value < 9.995
        else f"{value:.1f} {unit}"
        if value < 99.95
        else f"{value:.0f} {unit}"
    )


def sized(n: int) -> str:
    """A byte count, with its human size beside it from 1 kB on: "1,244,928 bytes (1.24 MB)"."""
    return f"{n:,} bytes" if n < 1000 else f"{n:,} bytes ({human_size(n)})"


def index_ranges(indices: list[int]) -> str:
    """Sorted indices as runs: [0, 1, 2, 3, 4, 6, 7, 11] -> "0-4, 6-7, 11"."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


Item = TypeVar("Item")


def _groups(items: list[Item]) -> list[tuple[list[int], Item]]:
    """(indices, item) for each distinct item (compared as canonical JSON), in order of first appearance."""
    groups: dict[str, tuple[list[int], Item]] = {}
    for i, item in enumerate(items):
        groups.setdefault(json.dumps(item, sort_keys=True), ([], item))[0].append(i)
    return list(groups.values())


def _show(value) -> str:
    """A config value for people: scalars bare (integral floats without ".0"), a mapping as "key value, ..."."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return value or '""'
    if isinstance(value, dict):
        return ", ".join(
            f"{k} {'(' + _show(v) + ')' if isinstance(v, dict) else _show(v)}" for k, v in value.items()
        )
    return "[" + ", ".join(_show(v) for v in value) + "]"


def _show_list(items: list, n_layers: int) -> list[str]:
    """A config list, identical entries grouped; entries count as layers when there is one per main layer."""
    if not items:
        return ["[]"]
    one, many = ("layer", "layers") if len(items) == n_layers else ("entry", "entries")
    groups = _groups(items)
    if len(groups) == 1 and len(items) > 1:
        return [f"all {len(items)} {many}: {_show(items[0])}"]
    return [f"{many if len(idx) > 1 else one} {index_ranges(idx)}: {_show(item)}" for idx, item in groups]


def config_lines(config: dict, n_layers: int) -> list[str]:
    """The engine's config mapping, one key a line; a per-layer list (e.g. RoPE) grouped."""
    width = max((len(k) for k in config), default=0) + 2
    lines = []
    for key, value in config.items():
        shown = _show_list(value, n_layers) if isinstance(value, list) else [_show(value)]
        lines.append(f"{key:<{width}}{shown[0]}")
        lines += [" " * width + more for more in shown[1:]]
    return lines


def _layer_shape(g: dict) -> str:
    heads = f"{g['n_kv_heads']} head{'s' if g['n_kv_heads'] != 1 else ''}"
    dims = (
        str(g["head_dim_k"])
        if g["head_dim_k"] == g["head_dim_v"]
        else f"{g['head_dim_k']} K / {g['head_dim_v']} V"
    )
    window = f", window {g['window']:,}" if g["window"] else ""
    parts = [f"{human_size(n)} {_PART_NAMES[p]}" for p, n in g["part_bytes"].items() if n]
    return (
        f"{heads} x {dims}, {g['k_dtype']}/{g['v_dtype']}{window}, {g['tokens_held']:,} held, "
        f"{' + '.join(parts) or 'no K/V'}"
    )


def layer_lines(layers: list[dict]) -> list[str]:
    """One line per group of identical layers (the same role, shape, dtypes, window and tokens held)."""

    def same(g):
        return {k: v for k, v in g.items() if k != "index"}

    lines = []
    for idx, g in _groups([same(g) for g in layers]):
        numbers = [layers[i]["index"] for i in idx]
        role = "" if g["role"] == "main" else f"{g['role']} "
        label = f"{role}layer{'s' if len(idx) > 1 else ''} {index_ranges(numbers)}"
        each = " each" if len(idx) > 1 and any(g["part_bytes"].values()) else ""
        lines.append(f"{label}: {_layer_shape(g)}{each}")
    return lines


def _print_layer_table(d: dict, w) -> None:
    w(
        f"  {'layer':>10} {'heads':>5} {'dk':>5} {'dv':>5} {'k/v':>9} {'window':>6} {'held':>8} "
        f"{'K':>11} {'V':>11} {'Ksc':>9} {'Vsc':>9} {'extra':>9}\n"
    )
    for g in d["layers"]:
        pb = g["part_bytes"]
        w(
            f"  {g['role'] + ' ' + str(g['index']):>10} {g['n_kv_heads']:>5} {g['head_dim_k']:>5} {g['head_dim_v']:>5} "
            f"{g['k_dtype'] + '/' + g['v_dtype']:>9} {g['window'] or '-':>6} {g['tokens_held']:>8} {pb['k']:>11} "
            f"{pb['v']:>11} {pb['k_scales']:>9} {pb['v_scales']:>9} {pb['extra']:>9}\n"
        )


def _print_text(d: dict, out, *, layer_table: bool = False) -> None:
    h = d["header"]
    w = out.write
    sec = d["sections"]
    w(f"{d['path']}: strata session file v{h['format_version']}, {sized(sec['file_size'])}\n")
    w(f"  model fingerprint   {h['model_fingerprint']}\n  config fingerprint  {h['config_fingerprint']}\n")
    w(
        f"  payload             {sized(h['payload_length'])}, hash "
        f"{d['payload_hash'] + ' (verified)' if d['payload_verified'] else 'not verified (use --verify)'}\n"
    )
    a = d["authentication"]
    if a["authenticated"]:
        checked = (
            "MAC verified" + (", payload digest verified" if d["payload_verified"] else "")
            if a["mac_verified"]
            else "not verified (use --key-file)"
        )
        w(f"  authentication      HMAC-SHA256, key id {a['key_id']}, {checked}\n")
    else:
        w("  authentication      none\n")
    for f in d["model_files"]:
        w(f"  model file          {f['role']}: {sized(f['size'])}, digest {f['digest']}\n")
    n_main = sum(1 for g in d["layers"] if g["role"] == "main")
    w("  config\n")
    for line in config_lines(d["config"], n_main):
        w(f"    {line}\n")
    s = d["state"]
    w(
        f"  tokens held         {s['n_tokens']:,} (position {s['position']:,}, first {s['first_tokens']}, "
        f"last {s['last_tokens']})\n"
    )
    w(
        f"  checkpoint          token {s['checkpoint_token_index']:,}, {sized(s['checkpoint_data_bytes'])} of data\n"
    )
    w(
        f"  sampler state       {sized(s['sampler_state_bytes'])}; engine fields {sized(s['engine_fields_bytes'])}\n"
    )
    w(
        f"  sections            header 64, metadata {sized(sec['metadata'])}, data {sized(sec['data'])} at "
        f"{sec['data_offset']:,}, trailer {sec['trailer']}\n"
    )
    c = d["compression"]
    if c is None:
        w("  compression         none\n")
    else:
        ratio = f"{c['ratio']:.3f}" if c["ratio"] is not None else "-"
        w(
            f"  compression         {c['codec']} level {c['level']}, {c['n_blocks']:,} blocks of {sized(c['block_size'])}; "
            f"{sized(c['stored_bytes'])} stored for {sized(c['data_bytes'])} of K/V (ratio {ratio})\n"
        )
    w(f"  layers              {len(d['layers'])}, {sized(sec['kv_bytes'])} of K/V\n")
    for line in layer_lines(d["layers"]):
        w(f"    {line}\n")
    if layer_table:
        _print_layer_table(d, w)


def _usage(message: str) -> int:
    print(f"strata-sessionfile inspect: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _inspect(args, key: SessionKey | None) -> Inspection:
    """The inspection of a local path, or of an ``s3://`` object (ImportError when boto3 is missing)."""
    if not args.file.startswith(S3_SCHEME):
        return inspect(args.file, verify=args.verify, key=key)
    from .objstore import S3Source, s3_client

    bucket, object_key = s3_location(args.file)
    with S3Source(s3_client(args.endpoint_url), bucket, object_key) as source:
        return inspect(source, verify=args.verify, key=key)


def _cmd_inspect(args) -> int:
    key = None
    if args.key_file is not None:
        try:
            key = SessionKey.from_file(args.key_file)
        except (OSError, ValueError) as exc:
            return _usage(f"--key-file: {exc}")
    if args.file.startswith(S3_SCHEME):
        try:
            s3_location(args.file)
        except ValueError as exc:
            return _usage(str(exc))
    elif args.endpoint_url is not None:
        return _usage("--endpoint-url applies to an s3:// object only")
    if not args.file.startswith(S3_SCHEME) and is_slot_file(args.file):
        return _inspect_slot(args)
    try:
        info = _inspect(args, key)
    except ImportError:
        print(
            "unsupported (s3): reading s3:// objects needs boto3: pip install 'strata-sessionfile[s3]'",
            file=sys.stderr,
        )
        return EXIT_UNSUPPORTED
    except E.SessionFileError as exc:
        code = next((code for cls, code in EXIT_FOR_ERROR if isinstance(exc, cls)), EXIT_INVALID)
        valid = False if code in (EXIT_INVALID, EXIT_UNAUTHENTICATED) else None
        err = exc
    else:
        d = inspection_dict(info)
        if args.json:
            print(json.dumps(d, indent=1, sort_keys=True))
        else:
            _print_text(d, sys.stdout, layer_table=args.layers)
        return EXIT_VALID
    if args.json:
        print(
            json.dumps(
                {
                    "valid": valid,
                    "readable": code != EXIT_UNREADABLE,
                    "reason": err.reason,
                    "message": str(err),
                    "field": err.field,
                    "offset": err.offset,
                }
            )
        )
    else:
        kind = EXIT_KIND.get(code, "invalid")
        print(f"{kind} ({err.reason}): {err}", file=sys.stderr)
    return code


def _error_exit(err: E.SessionFileError, as_json: bool) -> int:
    code = next((code for cls, code in EXIT_FOR_ERROR if isinstance(err, cls)), EXIT_INVALID)
    if as_json:
        print(json.dumps({"valid": False, "reason": err.reason, "message": str(err), "offset": err.offset}))
    else:
        print(f"{EXIT_KIND.get(code, 'invalid')} ({err.reason}): {err}", file=sys.stderr)
    return code


def _inspect_slot(args) -> int:
    """A llama.cpp slot file: its structure (no model given, so the layers are checked against each other
    and the file's size only)."""
    try:
        d = {"valid": True, **describe(read_slot_file(args.file))}
    except E.SessionFileError as exc:
        return _error_exit(exc, args.json)
    if args.json:
        print(json.dumps(d, indent=1, sort_keys=True))
        return EXIT_VALID
    print(
        f"{d['path']}: llama.cpp sequence state file, version {d['version']} (llama.cpp {', '.join(d['builds'])})"
    )
    print(
        f"  {d['n_tokens']} tokens, {human_size(d['file_size'])}; {d['checkpoints']} context checkpoints appended"
    )
    for i, s in enumerate(d["sections"]):
        print(
            f"  cache {i}: {s['n_cells']} cells (positions {s['positions']}), {s['n_layer']} layers, "
            f"K {'/'.join(s['k_types'])}, V {'/'.join(s['v_types'])}{' transposed' if s['v_trans'] else ''}, "
            f"{s['k_row_values']} K values per row"
        )
    print("  convert: strata-sessionfile convert FILE --model M.gguf -o OUT.ssf")
    return EXIT_VALID


def _cmd_convert(args) -> int:
    """``convert SLOT --model M.gguf -o OUT.ssf [--like ENGINE.ssf]`` or
    ``convert FILE.ssf --to llama.cpp --model M.gguf -o OUT.bin [--v-trans] [--k-type T] [--v-type T]
    [--no-rotate]``."""
    try:
        if args.to == "llama.cpp":
            opts = SlotOptions(
                k_type=GGML_TYPE_BY_NAME[args.k_type] if args.k_type else None,
                v_type=GGML_TYPE_BY_NAME[args.v_type] if args.v_type else None,
                v_trans=args.v_trans,
                rotate=not args.no_rotate,
            )
            report = session_to_slot(args.file, args.model, args.output, opts)
            print(f"{args.output}: llama.cpp slot file of {report.n_tokens} tokens")
        else:
            if not is_slot_file(args.file):
                return _usage(
                    f"{args.file} is not a llama.cpp slot file (give --to llama.cpp for a session file)"
                )
            config = config_of(args.like) if args.like else None
            saved = slot_to_session(args.file, args.model, args.output, config=config)
            print(
                f"{args.output}: session file of {saved.n_tokens} tokens, {human_size(saved.bytes_written)}"
            )
    except E.SessionFileError as exc:
        return _error_exit(exc, False)
    return EXIT_VALID


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # usage errors exit 64, not argparse's 2 (2 means unreadable here)
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    parser = _Parser(prog="strata-sessionfile", description="Strata session file tools (format v1)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser(
        "inspect",
        help="validate a session file and print what it holds",
        description="Exit codes: 0 valid, 1 invalid (reason printed), 2 unreadable, 3 unsupported here "
        "(--verify of a compressed file without its codec, s3:// without boto3), 4 not authenticated "
        "by --key-file's key, 64 usage.",
    )
    p.add_argument("file", help="a session file's path, or an object: s3://BUCKET/KEY")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--verify", action="store_true", help="also stream the payload and check its hash")
    p.add_argument(
        "--layers",
        action="store_true",
        help="also print every layer's row (the summary groups identical layers)",
    )
    p.add_argument(
        "--key-file",
        metavar="KEY",
        help="a 32-byte session key: verify the file's MAC (refuse a file "
        "without one); with --verify also its payload digest",
    )
    p.add_argument(
        "--endpoint-url",
        metavar="URL",
        help="the S3 endpoint of an s3:// FILE (a non-AWS store); "
        "credentials and region come from the standard AWS environment and config files",
    )
    c = sub.add_parser(
        "convert",
        help="convert a llama.cpp slot file to a session file, or back (--to llama.cpp)",
        description="The slot file carries no model identity: --model names the GGUF it was written with; "
        "its layers, heads, head sizes, types and windows are checked against it and its fingerprint is "
        "written into the session file.",
    )
    c.add_argument("file", help="a llama.cpp slot file, or (with --to llama.cpp) a session file")
    c.add_argument("--model", required=True, help="the GGUF model the conversation belongs to")
    c.add_argument("-o", "--output", required=True, help="the file to write (replaced atomically)")
    c.add_argument("--to", choices=("session", "llama.cpp"), default="session")
    c.add_argument(
        "--like", metavar="ENGINE.ssf", help="take the config identity of this engine's session file"
    )
    c.add_argument(
        "--v-trans", action="store_true", help="lay V out transposed (llama.cpp without flash attention)"
    )
    c.add_argument(
        "--k-type", choices=sorted(GGML_TYPE_BY_NAME), help="K type of the slot file (default: kept)"
    )
    c.add_argument(
        "--v-type", choices=sorted(GGML_TYPE_BY_NAME), help="V type of the slot file (default: kept)"
    )
    c.add_argument(
        "--no-rotate",
        action="store_true",
        help="a q8_0 cache without llama.cpp's Hadamard rotation (for llama.cpp run with LLAMA_ATTN_ROT_DISABLE=1)",
    )
    return parser, p


def inspect_parser() -> argparse.ArgumentParser:
    """The ``inspect`` command's arguments (the spec's usage line is bound to them)."""
    return _parsers()[1]


class _ReaderMayLeave:
    """stdout whose reader may stop reading (``| head``): the rest of the output is dropped and the exit code
    stays the verdict's (Python's default: a BrokenPipeError traceback and exit 1, which reads "invalid")."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.left = False

    def write(self, text: str) -> int:
        if not self.left:
            try:
                self.stream.write(text)
            except BrokenPipeError:
                self._leave()
        return len(text)

    def flush(self) -> None:
        if not self.left:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._leave()

    def _leave(self) -> None:
        self.left = True
        # the interpreter's own flush at exit must not meet the closed pipe again
        with contextlib.suppress(OSError, ValueError):
            discard_writes(self.stream.fileno())


def main(argv: Sequence[str] | None = None) -> int:
    args = _parsers()[0].parse_args(argv)
    out = _ReaderMayLeave(sys.stdout)
    with contextlib.redirect_stdout(out):  # type: ignore[type-var]
        code = COMMANDS[args.command](args)
        out.flush()
    return code


COMMANDS = {"inspect": _cmd_inspect, "convert": _cmd_convert}

if __name__ == "__main__":
    sys.exit(main())
