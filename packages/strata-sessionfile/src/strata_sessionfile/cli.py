"""``strata-sessionfile inspect FILE [--json] [--verify]``.

Exit codes (spec section 11): 0 valid, 1 invalid (the reason is printed), 2 unreadable, 3 unsupported here
(``--verify`` of a compressed file without its codec's module), 64 usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from . import errors as E
from .codec import dtype_name
from .format import Part
from .reader import inspect
from .records import Inspection

EXIT_VALID = 0
EXIT_INVALID = 1
EXIT_UNREADABLE = 2
EXIT_UNSUPPORTED = 3
EXIT_USAGE = 64


def _compression_dict(lay) -> dict | None:
    comp = lay.compressed
    if comp is None:
        return None
    stored = comp.section_length
    return {"codec": comp.codec.name.lower(), "level": comp.level, "block_size": comp.block_size,
            "n_blocks": comp.n_blocks, "frames_bytes": comp.frames_length, "stored_bytes": stored,
            "data_bytes": lay.data_length, "ratio": round(stored / lay.data_length, 4) if lay.data_length else None}


def inspection_dict(info: Inspection) -> dict:
    h, md, lay = info.header, info.metadata, info.layout
    st = md.state
    stored = lay.trailer_offset - lay.data_offset
    return {
        "valid": True,
        "path": info.path,
        "payload_verified": info.payload_verified,
        "header": {"format_version": h.format_version, "flags": h.flags,
                   "model_fingerprint": h.model_fingerprint.hex(), "config_fingerprint": h.config_fingerprint.hex(),
                   "payload_length": h.payload_length, "header_hash": f"{h.header_hash:016x}"},
        "payload_hash": info.payload_hash.hex() if info.payload_hash else None,
        "model_files": [{"role": f.role, "size": f.size, "digest": f.digest.hex()} for f in md.model.files],
        "config": md.config.mapping,
        "state": {"n_tokens": st.n_tokens, "position": st.position, "first_tokens": list(st.tokens[:8]),
                  "last_tokens": list(st.tokens[-8:]), "sampler_state_bytes": len(st.sampler_state),
                  "checkpoint_token_index": st.checkpoint.token_index,
                  "checkpoint_data_bytes": len(st.checkpoint.data), "engine_fields_bytes": len(st.engine_fields)},
        "layers": [{"role": g.spec.role.name.lower(), "index": g.spec.index, "n_kv_heads": g.spec.n_kv_heads,
                    "head_dim_k": g.spec.head_dim_k, "head_dim_v": g.spec.head_dim_v,
                    "k_dtype": dtype_name(g.spec.k_dtype), "v_dtype": dtype_name(g.spec.v_dtype),
                    "window": g.spec.window, "tokens_held": g.tokens_held,
                    "part_bytes": {p.name.lower(): g.part_size(p) for p in Part}} for g in md.layers],
        "sections": {"header": 64, "metadata": lay.data_offset - 64, "data": stored, "trailer": 24,
                     "file_size": lay.file_size, "data_offset": lay.data_offset, "kv_bytes": lay.data_length},
        "compression": _compression_dict(lay),
    }


def _print_text(d: dict, out) -> None:
    h = d["header"]
    w = out.write
    w(f"{d['path']}: strata session file v{h['format_version']}, {d['sections']['file_size']} bytes\n")
    w(f"  model fingerprint   {h['model_fingerprint']}\n  config fingerprint  {h['config_fingerprint']}\n")
    w(f"  payload             {h['payload_length']} bytes, hash "
      f"{d['payload_hash'] + ' (verified)' if d['payload_verified'] else 'not verified (use --verify)'}\n")
    for f in d["model_files"]:
        w(f"  model file          {f['role']}: {f['size']} bytes, digest {f['digest']}\n")
    w(f"  config              {json.dumps(d['config'], sort_keys=True)}\n")
    s = d["state"]
    w(f"  tokens held         {s['n_tokens']} (position {s['position']}, first {s['first_tokens']}, "
      f"last {s['last_tokens']})\n")
    w(f"  checkpoint          token {s['checkpoint_token_index']}, {s['checkpoint_data_bytes']} bytes of data\n")
    w(f"  sampler state       {s['sampler_state_bytes']} bytes; engine fields {s['engine_fields_bytes']} bytes\n")
    sec = d["sections"]
    w(f"  sections            header 64, metadata {sec['metadata']}, data {sec['data']} at {sec['data_offset']}, "
      f"trailer 24\n")
    c = d["compression"]
    if c is None:
        w("  compression         none\n")
    else:
        ratio = f"{c['ratio']:.3f}" if c["ratio"] is not None else "-"
        w(f"  compression         {c['codec']} level {c['level']}, {c['n_blocks']} blocks of {c['block_size']} bytes; "
          f"{c['stored_bytes']} bytes stored for {c['data_bytes']} of K/V (ratio {ratio})\n")
    w(f"  {'layer':>10} {'heads':>5} {'dk':>5} {'dv':>5} {'k/v':>9} {'window':>6} {'held':>8} "
      f"{'K':>11} {'V':>11} {'Ksc':>9} {'Vsc':>9} {'extra':>9}\n")
    for g in d["layers"]:
        pb = g["part_bytes"]
        w(f"  {g['role'] + ' ' + str(g['index']):>10} {g['n_kv_heads']:>5} {g['head_dim_k']:>5} {g['head_dim_v']:>5} "
          f"{g['k_dtype'] + '/' + g['v_dtype']:>9} {g['window'] or '-':>6} {g['tokens_held']:>8} {pb['k']:>11} "
          f"{pb['v']:>11} {pb['k_scales']:>9} {pb['v_scales']:>9} {pb['extra']:>9}\n")


def _cmd_inspect(args) -> int:
    try:
        info = inspect(args.file, verify=args.verify)
    except E.FileAccessError as exc:
        code, valid = EXIT_UNREADABLE, None
        err = exc
    except E.CompressionUnavailable as exc:
        code, valid = EXIT_UNSUPPORTED, None
        err = exc
    except E.SessionFileError as exc:
        code, valid = EXIT_INVALID, False
        err = exc
    else:
        d = inspection_dict(info)
        if args.json:
            print(json.dumps(d, indent=1, sort_keys=True))
        else:
            _print_text(d, sys.stdout)
        return EXIT_VALID
    if args.json:
        print(json.dumps({"valid": valid, "readable": code != EXIT_UNREADABLE, "reason": err.reason,
                          "message": str(err), "field": err.field, "offset": err.offset}))
    else:
        kind = {EXIT_UNREADABLE: "unreadable", EXIT_UNSUPPORTED: "unsupported"}.get(code, "invalid")
        print(f"{kind} ({err.reason}): {err}", file=sys.stderr)
    return code


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # usage errors exit 64, not argparse's 2 (2 means unreadable here)
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(prog="strata-sessionfile", description="Strata session file tools (format v1)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("inspect", help="validate a session file and print what it holds",
                       description="Exit codes: 0 valid, 1 invalid (reason printed), 2 unreadable, 3 unsupported here "
                       "(--verify of a compressed file without its codec), 64 usage.")
    p.add_argument("file")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--verify", action="store_true", help="also stream the payload and check its hash")
    args = parser.parse_args(argv)
    return _cmd_inspect(args)


if __name__ == "__main__":
    sys.exit(main())
