"""Binds spec/session-file-v1.md's tables (magic, version, header offsets, limits, dtypes, reasons) to the
code's constants, so the spec and the implementation cannot drift apart."""

from __future__ import annotations

import re
from pathlib import Path

from strata_sessionfile import errors as E
from strata_sessionfile import format as F

SPEC = (Path(__file__).resolve().parents[2] / "spec" / "session-file-v1.md").read_text()


def section(title: str) -> str:
    start = SPEC.index(title)
    level = len(title) - len(title.lstrip("#"))
    nxt = re.search(rf"^#{{1,{level}}} ", SPEC[start + len(title) :], re.M)
    return SPEC[start : start + len(title) + (nxt.start() if nxt else len(SPEC))]


def table_rows(text: str) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not set(line) <= set("|- "):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows[1:] if rows else rows


def hex_bytes(s: str) -> bytes:
    return bytes.fromhex(re.search(r"`([0-9a-f ]+)`", s).group(1))


def test_header_table_matches_code():
    header = section("## 2. Header")
    rows = table_rows(header[: header.index("Flags:")])
    assert [(int(r[0]), int(r[1]), r[3]) for r in rows] == [(o, s, n) for o, s, _c, n in F.HEADER_FIELDS]
    assert sum(int(r[1]) for r in rows) == F.HEADER_SIZE == 64
    assert hex_bytes(rows[0][4]) == F.MAGIC
    assert "MUST be 1" in rows[1][4] and F.FORMAT_VERSION == 1
    assert "[0, 56)" in rows[-1][4] and F.HEADER_HASHED_SIZE == 56


def test_trailer_and_alignment_match_code():
    text = section("## 4. Trailer")
    rows = table_rows(text[: text.index("### 4.1")])
    assert [(int(r[0]), int(r[1]), r[2]) for r in rows] == [(0, 16, "payload_hash"), (16, 8, "end_marker")]
    assert hex_bytes(rows[1][3]) == F.END_MARKER
    assert F.TRAILER_SIZE == 24 and "multiple of 4096" in SPEC and F.DATA_ALIGNMENT == 4096


def test_authenticated_trailer_matches_code():
    """Section 4.1's trailer, domain tags and key size are the code's; its MAC recipe is the code's MAC."""
    import hashlib
    import hmac

    from strata_sessionfile.auth import SessionKey, auth_extension

    text = section("### 4.1 Authenticated files")
    rows = table_rows(text)
    assert [(int(r[0]), int(r[1]), r[2]) for r in rows] == [
        (0, 16, "payload_hash"),
        (16, 16, "key_id"),
        (32, 32, "payload_digest"),
        (64, 32, "mac"),
        (96, 8, "end_marker"),
    ]
    assert sum(int(r[1]) for r in rows) == F.AUTH_TRAILER_SIZE == 104
    assert F.AUTH_EXTENSION_STRUCT.size == 80 and f"trailer bytes [0, {F.MAC_COVERED_TRAILER})" in rows[3][3]
    domains = [d.encode() + b"\x00" for d in re.findall(r"`(strata-session-[a-z-]+-v1)\\0`", text)]
    assert domains == [F.KEY_ID_DOMAIN, F.MAC_DOMAIN]
    assert f"exactly {F.KEY_SIZE} bytes" in text
    key = bytes(range(32))
    header, payload_hash, digest = bytes(range(64)), bytes(16), hashlib.sha256(b"").digest()
    key_id = hmac.new(key, F.KEY_ID_DOMAIN, "sha256").digest()[:16]
    mac = hmac.new(key, F.MAC_DOMAIN + header + payload_hash + key_id + digest, "sha256").digest()
    assert auth_extension(SessionKey(key), header, payload_hash, digest) == key_id + digest + mac


def test_limits_table_matches_code():
    rows = table_rows(section("## 5. Limits"))
    assert {r[0]: int(r[1]) for r in rows} == {lim.name: lim.value for lim in F.LIMITS}


def test_dtype_role_and_part_codes_match_code():
    meta = section("### 3.1 Metadata")
    dtype_rows = table_rows(meta[meta.index("DType codes") :])
    assert {int(r[0]): (r[1], int(r[2])) for r in dtype_rows} == {
        int(c): (i.name, i.itemsize) for c, i in F.DTYPES.items()
    }
    for code, info in F.DTYPES.items():
        scale = int(dtype_rows[[int(r[0]) for r in dtype_rows].index(int(code))][3].split()[0])
        assert scale == info.scale_itemsize
    assert "`0` MAIN, `1` DRAFT" in meta and [int(r) for r in F.LayerRole] == [0, 1]
    assert "`<IBBBBIIIIIQ`" in meta and F.LAYER_STRUCT.format == "<IBBBBIIIIIQ" and F.LAYER_STRUCT.size == 36
    record_rows = table_rows(meta[meta.index("Layer record") : meta.index("LayerRole codes")])
    assert sum(int(r[1]) for r in record_rows) == 36
    part_rows = table_rows(section("### 3.2 Data section"))
    assert [(int(r[0]), r[1]) for r in part_rows] == [(int(p), p.name) for p in F.Part]


def test_reasons_table_lists_every_reason():
    rows = table_rows(section("## 10. Reasons"))
    assert {r[0]: r[1] for r in rows} == {reason: cls.__name__ for reason, cls in E.all_reasons().items()}


def test_every_validation_rule_names_a_known_reason():
    rows = table_rows(section("### 8.1 Validation rules"))
    reasons = set(E.all_reasons())
    for rule, _check, named in rows:
        for token in re.findall(r"`([a-z_]+)`", named):
            assert token in reasons, (rule, token)


def test_flags_table_matches_code():
    header = section("## 2. Header")
    rows = table_rows(header[header.index("Flags:") :])
    assert {r[2]: (1 << int(r[0]), int(r[1], 16)) for r in rows} == {
        f.name: (f.value, f.value) for f in F.Flags if f.value
    }
    assert F.KNOWN_FLAGS == sum(int(r[1], 16) for r in rows)


def test_compressed_section_tables_match_code():
    from strata_sessionfile.compression import CODECS, COMPRESSION_HEADER_SIZE, zstd_frame_bound

    text = section("### 3.3 Compressed data section")
    head = text[text.index("Compression header") : text.index("Codec codes")]
    assert f"`{F.COMPRESSION_HEADER_STRUCT.format}`" in head
    rows = table_rows(head)
    assert [(int(r[0]), int(r[1])) for r in rows] == [(0, 2), (2, 2), (4, 4), (8, 4), (12, 4)]
    assert sum(int(r[1]) for r in rows) == COMPRESSION_HEADER_SIZE == F.COMPRESSION_HEADER_STRUCT.size == 16
    assert [r[3] for r in rows] == ["codec", "reserved", "level", "block_size", "n_blocks"]
    assert f"{F.MIN_COMPRESSED_BLOCK_SIZE}..MAX_COMPRESSED_BLOCK_BYTES" in rows[3][4]
    codec_rows = table_rows(text[text.index("Codec codes") :])
    assert {int(r[0]): r[1] for r in codec_rows} == {int(c): codec.name for c, codec in CODECS.items()}
    bound = codec_rows[0][3]
    formula = re.search(r"`([^`]+)`", bound).group(1)
    for n in (0, 1, 4096, 131071, 131072, 1 << 20, 64 << 20):
        assert eval(formula, {"n": n}) == zstd_frame_bound(n)  # the spec's formula is the code's
    assert F.BLOCK_ENTRY_STRUCT.size == 4 and "4 × n_blocks" in text


def test_writer_stages_match_code(tmp_path):
    from strata_sessionfile.testing import memory_adapter_factory
    from strata_sessionfile.writer import STAGES, SessionWriter, Stage

    text = section("## 7. Writing (save)")
    assert "`strata_sessionfile.writer.SessionWriter`" in text
    rows = table_rows(text[text.index("| stage |") :])
    assert [r[0] for r in rows] == [s.name for s in STAGES if s is not Stage.DONE]
    for name, _steps, _phase, failure in rows:
        quoted = re.search(r'"(\w+) the temporary file failed"', failure)
        if quoted:  # the verb the writer's error names is the stage's value
            assert Stage[name].value == quoted.group(1)
    # The progress phases each stage reports, as a save runs.
    seen = set()
    writer = SessionWriter(
        tmp_path / "s.ssf",
        memory_adapter_factory(n_tokens=40)(1),
        block_size=4096,
        progress=lambda p: seen.add((writer.stage.name, p.phase.value)),
    )
    for stage in (writer.plan, writer.create, writer.write, writer.flush, writer.rename, writer.sync_folder):
        stage()
    assert writer.stage is Stage.DONE
    assert seen == {(name, phase.strip("`")) for name, _steps, phase, _failure in rows if phase}


def test_reader_modules_and_defaults_match_code():
    import importlib

    from strata_sessionfile import _fileio, pipelines

    text = section("## 9. The adapter protocol")
    for module in re.findall(r"in `(\w+)`", text) + ["_fileio"]:
        importlib.import_module(f"strata_sessionfile.{module}")
    assert "`FileSource`" in text and "`FileSink`" in text and _fileio.FileSource and _fileio.FileSink
    streaming = section("### 8.2 Streaming mode")
    assert f"min({pipelines.MAX_READ_THREADS}, cores - 1)" in streaming
    assert f"`MAX_DECODE_WORKERS`, {pipelines.MAX_DECODE_WORKERS};" in streaming


def test_only_the_byte_seam_does_file_io():
    """Save, restore and inspect reach a session file's bytes only through _fileio (where another store
    plugs in): no other module of the library opens, reads, writes, syncs or renames a file."""
    import strata_sessionfile

    package = Path(strata_sessionfile.__file__).parent
    # What else may touch files: the model files (identity), /proc/meminfo (memory), the kit's damaged files.
    # ... and the session key file (auth).
    allowed = {"_fileio.py", "identity.py", "memory.py", "auth.py"}
    calls = re.compile(
        r"\bos\.(open|pread|preadv|pwrite|write|fsync|replace|rename|unlink|posix_fallocate)\(|"
        r"(?<![\w.])open\("
    )
    offenders = [
        f"{path.relative_to(package)}:{n}"
        for path in sorted(package.rglob("*.py"))
        if path.name not in allowed and path.parent.name != "testing"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if calls.search(line)
    ]
    assert offenders == []


def test_conformance_cases_match_code():
    from strata_sessionfile.testing import CASES

    text = section("## 9. The adapter protocol")
    listed = re.search(r"in the order they run:(.*?)\)\.", text, re.S).group(1)
    names = [n.strip() for n in re.sub(r"\([^)]*\)", "", listed).split(",")]
    assert names == [case.name for case in CASES]


def test_inspect_usage_and_exit_codes_match_code():
    from strata_sessionfile import cli

    text = section("## 11. `strata-sessionfile inspect`")
    usage = re.search(r"`strata-sessionfile inspect FILE ([^`]*)`", text).group(1)
    assert sorted(re.findall(r"--[a-z-]+", usage)) == sorted(
        a.option_strings[0] for a in cli.inspect_parser()._actions if a.option_strings and a.dest != "help"
    )
    codes = {int(r[0]): r[1].split(":")[0].split(" (")[0] for r in table_rows(text[text.index("| code |") :])}
    assert codes == {
        cli.EXIT_VALID: "valid",
        cli.EXIT_INVALID: "invalid",
        cli.EXIT_UNREADABLE: "unreadable",
        cli.EXIT_UNSUPPORTED: "unsupported here",
        cli.EXIT_UNAUTHENTICATED: "unauthenticated",
        cli.EXIT_USAGE: "usage error",
    }
