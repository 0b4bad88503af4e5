"""`strata-sessionfile inspect`: the human output (grouped layers and config, human sizes), --layers,
JSON, --verify, and the documented exit codes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from strata_sessionfile import DType, LayerRole, LayerSpec, save
from strata_sessionfile.cli import (
    EXIT_INVALID,
    EXIT_UNAUTHENTICATED,
    EXIT_UNREADABLE,
    EXIT_UNSUPPORTED,
    EXIT_USAGE,
    EXIT_VALID,
    human_size,
    index_ranges,
    main,
)
from strata_sessionfile.testing import MemoryAdapter, fake_identity, make_snapshot

from . import golden

GOOD = golden.GOLDEN_DIR / "mixed_i8_window_draft.ssf"


def _section(out: str, title: str) -> list[str]:
    """The indented lines under a title line of the human output ("  config", "  layers ...")."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line == f"  {title}" or line.startswith(f"  {title}  "))
    block = []
    for line in lines[start + 1 :]:
        if not line.startswith("    "):
            break
        block.append(line[4:])
    return block


def _engine_like_file(path, specs, rope: list[dict], n_tokens: int) -> None:
    """A file whose config has the shape strata-engine writes: one RoPE entry per layer."""
    config = {"engine": "strata-engine", "kv_type": "f16", "n_layer": len(specs), "rope": rope}
    adapter = MemoryAdapter(fake_identity("engine-like", config), specs)
    save(path, adapter.load_snapshot(make_snapshot(specs, n_tokens, seed=1)), block_size=1 << 20)


def test_inspect_text_of_a_mixed_file_has_a_line_per_kind_of_layer(capsys):
    assert main(["inspect", str(GOOD), "--verify"]) == EXIT_VALID
    out = capsys.readouterr().out
    assert "(verified)" in out and "tokens held         6 (position 7" in out
    assert "  layers              4, 476 bytes of K/V\n" in out
    assert _section(out, "layers") == [
        "layer 0: 1 head x 8, i8/i8, window 4, 4 held, 32 B K + 32 B V + 16 B K scales + 16 B V scales",
        "layer 1: 1 head x 8, i8/i8, 6 held, 48 B K + 48 B V + 24 B K scales + 24 B V scales",
        "layer 2: 1 head x 4, f32/bf16, 6 held, 96 B K + 48 B V + 12 B extra",
        "draft layer 0: 1 head x 4, f16/f16, 5 held, 40 B K + 40 B V",
    ]
    assert "rope            entry 0: base 10000, scale 1" in _section(out, "config")
    assert "sliding_window  4" in _section(out, "config")
    assert "heads    dk    dv" not in out  # the per-layer table only with --layers
    assert "model: 98,362,432 bytes (98.4 MB)" in out and "metadata 4,032 bytes (4.03 kB)" in out


def test_inspect_text_of_a_uniform_file_is_one_line_per_repeat(tmp_path, capsys):
    """A SmolLM2-shaped file: 30 identical layers and 30 identical RoPE entries, each on one line."""
    specs = [LayerSpec(i, LayerRole.MAIN, 3, 64, 64, DType.F16, DType.F16) for i in range(30)]
    rope = [{"style": "interleaved", "base": 100000.0, "dim": 64, "window": None}] * 30
    path = tmp_path / "uniform.ssf"
    _engine_like_file(path, specs, rope, n_tokens=1200)
    assert main(["inspect", str(path)]) == EXIT_VALID
    out = capsys.readouterr().out
    assert _section(out, "layers") == [
        "layers 0-29: 3 heads x 64, f16/f16, 1,200 held, 461 kB K + 461 kB V each"
    ]
    assert "  layers              30, 27,648,000 bytes (27.6 MB) of K/V\n" in out
    assert _section(out, "config") == [
        "engine   strata-engine",
        "kv_type  f16",
        "n_layer  30",
        "rope     all 30 layers: base 100000, dim 64, style interleaved, window null",
    ]
    assert main(["inspect", str(path), "--layers"]) == EXIT_VALID
    table = capsys.readouterr().out.split("heads    dk    dv")[1].splitlines()[1:]
    assert len(table) == 30 and table[29].split() == [
        "main",
        "29",
        "3",
        "64",
        "64",
        "f16/f16",
        "-",
        "1200",
        "460800",
        "460800",
        "0",
        "0",
        "0",
    ]


def test_inspect_text_groups_layers_that_repeat_apart(tmp_path, capsys):
    """A gemma3-shaped file: a sliding window on 5 of every 6 layers (two kinds of layer and of RoPE)."""
    specs = [
        LayerSpec(i, LayerRole.MAIN, 1, 256, 256, DType.F16, DType.F16, 0 if i % 6 == 5 else 8)
        for i in range(18)
    ]
    rope = [
        {"base": 1e6 if i % 6 == 5 else 10000.0, "dim": 256, "window": 0 if i % 6 == 5 else 8}
        for i in range(18)
    ]
    path = tmp_path / "windows.ssf"
    _engine_like_file(path, specs, rope, n_tokens=20)
    assert main(["inspect", str(path), "--verify"]) == EXIT_VALID
    out = capsys.readouterr().out
    assert _section(out, "layers") == [
        "layers 0-4, 6-10, 12-16: 1 head x 256, f16/f16, window 8, 8 held, 4.10 kB K + 4.10 kB V each",
        "layers 5, 11, 17: 1 head x 256, f16/f16, 20 held, 10.2 kB K + 10.2 kB V each",
    ]
    config = _section(out, "config")
    assert (
        config[config.index("rope     layers 0-4, 6-10, 12-16: base 10000, dim 256, window 8") + 1]
        == "         layers 5, 11, 17: base 1000000, dim 256, window 0"
    )


def test_inspect_json_does_not_depend_on_the_text_flags(capsys):
    assert main(["inspect", str(GOOD), "--json"]) == EXIT_VALID
    plain = json.loads(capsys.readouterr().out)
    assert main(["inspect", str(GOOD), "--json", "--layers"]) == EXIT_VALID
    assert json.loads(capsys.readouterr().out) == plain and len(plain["layers"]) == 4


@pytest.mark.parametrize(
    "n,text",
    [
        (0, "0 B"),
        (999, "999 B"),
        (1000, "1.00 kB"),
        (9995, "10.0 kB"),
        (99950, "100 kB"),
        (999_499, "999 kB"),
        (999_500, "1.00 MB"),
        (1_244_928, "1.24 MB"),
        (23_040 * 8192, "189 MB"),
        (10**12, "1.00 TB"),
    ],
)
def test_human_sizes(n, text):
    assert human_size(n) == text


def test_index_ranges():
    assert index_ranges([0, 1, 2, 3, 4, 6, 7, 11]) == "0-4, 6-7, 11"
    assert index_ranges([5]) == "5" and index_ranges([]) == ""


def test_inspect_json_matches_the_golden_description(capsys):
    assert main(["inspect", str(GOOD), "--json", "--verify"]) == EXIT_VALID
    d = json.loads(capsys.readouterr().out)
    expected = json.loads(GOOD.with_suffix(".json").read_text())
    assert d["valid"] and d["payload_verified"] and d["payload_hash"] == expected["payload_hash"]
    assert d["header"]["model_fingerprint"] == expected["header"]["model_fingerprint"]
    assert [g["tokens_held"] for g in d["layers"]] == [g["tokens_held"] for g in expected["layers"]]
    assert d["layers"][0]["part_bytes"]["k_scales"] == len(expected["layers"][0]["parts"]["k_scales"]) // 2


def test_without_verify_a_payload_flip_passes_and_with_it_fails(capsys):
    bad = golden.BAD_DIR / "payload_flip.ssf"
    assert main(["inspect", str(bad)]) == EXIT_VALID
    capsys.readouterr()
    assert main(["inspect", str(bad), "--verify", "--json"]) == EXIT_INVALID
    d = json.loads(capsys.readouterr().out)
    assert d == {**d, "valid": False, "readable": True, "reason": "payload_corrupt", "field": "payload_hash"}


@pytest.mark.parametrize("name", ["bad_magic.ssf", "truncated_payload.ssf", "config_not_canonical.ssf"])
def test_invalid_files_exit_1_with_reason(name, capsys):
    assert main(["inspect", str(golden.BAD_DIR / name)]) == EXIT_INVALID
    reason = json.loads((golden.BAD_DIR / "expected.json").read_text())[name]
    assert f"invalid ({reason})" in capsys.readouterr().err


def test_unreadable_exit_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing.ssf")]) == EXIT_UNREADABLE
    assert "not_found" in capsys.readouterr().err
    link = tmp_path / "link.ssf"
    os.symlink(GOOD, link)
    assert main(["inspect", str(link), "--json"]) == EXIT_UNREADABLE
    assert json.loads(capsys.readouterr().out)["reason"] == "symlink"
    assert main(["inspect", str(tmp_path)]) == EXIT_UNREADABLE


def test_usage_error_exit_64(capsys):
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == EXIT_USAGE


def test_console_script_runs(tmp_path):
    copy = tmp_path / "g.ssf"
    shutil.copyfile(GOOD, copy)
    exe = shutil.which("strata-sessionfile", path=os.path.dirname(sys.executable))
    assert exe is not None
    proc = subprocess.run([exe, "inspect", str(copy), "--verify"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "(verified)" in proc.stdout


@pytest.fixture
def golden_key_file(tmp_path):
    path = tmp_path / "golden.key"
    path.write_bytes(bytes(range(32)))  # the golden key (spec section 12)
    return path


def test_key_file_verifies_the_mac(golden_key_file, capsys):
    mac = golden.GOLDEN_DIR / "small_f16_mac.ssf"
    assert main(["inspect", str(mac), "--verify", "--key-file", str(golden_key_file)]) == EXIT_VALID
    out = capsys.readouterr().out
    key_id = json.loads(mac.with_suffix(".json").read_text())["authentication"]["key_id"]
    assert f"authentication      HMAC-SHA256, key id {key_id}, MAC verified, payload digest verified" in out
    assert "trailer 104" in out
    assert main(["inspect", str(mac), "--json"]) == EXIT_VALID
    assert json.loads(capsys.readouterr().out)["authentication"] == {
        "authenticated": True,
        "key_id": key_id,
        "mac_verified": False,
    }
    assert main(["inspect", str(mac)]) == EXIT_VALID
    assert "not verified (use --key-file)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "name,reason",
    [
        ("mac_missing.ssf", "mac_missing"),
        ("mac_wrong_key.ssf", "mac_wrong_key"),
        ("mac_flipped.ssf", "mac_mismatch"),
        ("mac_payload_digest_mismatch.ssf", "payload_not_authentic"),
    ],
)
def test_a_file_the_key_did_not_authenticate_exits_4(name, reason, golden_key_file, capsys):
    argv = ["inspect", str(golden.BAD_DIR / name), "--verify", "--key-file", str(golden_key_file)]
    assert main(argv) == EXIT_UNAUTHENTICATED
    assert f"unauthenticated ({reason})" in capsys.readouterr().err
    assert main([*argv, "--json"]) == EXIT_UNAUTHENTICATED
    d = json.loads(capsys.readouterr().out)
    assert (d["valid"], d["readable"], d["reason"]) == (False, True, reason)


def test_bad_key_file_and_misplaced_endpoint_are_usage_errors(tmp_path, capsys):
    short = tmp_path / "short.key"
    short.write_bytes(bytes(31))
    assert main(["inspect", str(GOOD), "--key-file", str(short)]) == EXIT_USAGE
    assert "exactly 32 bytes" in capsys.readouterr().err
    assert main(["inspect", str(GOOD), "--key-file", str(tmp_path / "none.key")]) == EXIT_USAGE
    assert main(["inspect", str(GOOD), "--endpoint-url", "http://127.0.0.1:1"]) == EXIT_USAGE
    assert main(["inspect", "s3://bucket-only"]) == EXIT_USAGE


NO_BOTO3 = r"""
import json, sys, tempfile
sys.modules["boto3"] = sys.modules["botocore"] = None  # as where boto3 is not installed: import fails
from strata_sessionfile import restore, save
from strata_sessionfile.cli import main
from strata_sessionfile.testing import memory_adapter_factory
factory = memory_adapter_factory(n_tokens=24)
with tempfile.TemporaryDirectory() as d:
    save(d + "/s.ssf", factory(1), block_size=4096)
    target = factory(2)
    restore(d + "/s.ssf", target, block_size=4096)
    restored = target.live_digest() == factory(1).live_digest()
try:
    import strata_sessionfile.objstore
    message = None
except ImportError as exc:
    message = str(exc)
print(json.dumps({"restored": restored, "objstore": message, "exit": main(["inspect", "s3://bucket/key"])}))
"""


def test_the_package_stands_without_boto3():
    """Local save and restore need no boto3; the object store module says what to install; inspect of an
    s3:// object exits 3 (unsupported here)."""
    proc = subprocess.run([sys.executable, "-c", NO_BOTO3], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["restored"] and "strata-sessionfile[s3]" in out["objstore"]
    assert out["exit"] == EXIT_UNSUPPORTED and "needs boto3" in proc.stderr


def test_a_reader_that_stops_early_changes_neither_the_verdict_nor_stderr():
    """`inspect FILE | head`: the pipe's reader is gone before the output is written; the exit code is the
    file's verdict (0), with no BrokenPipeError traceback."""
    command = [sys.executable, "-m", "strata_sessionfile.cli", "inspect", str(GOOD), "--layers"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader leaves before anything is written
    _, err = proc.communicate(timeout=120)
    assert (proc.returncode, err.decode()) == (EXIT_VALID, "")
