"""`strata-sessionfile inspect`: output, JSON, --verify, and the documented exit codes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from strata_sessionfile.cli import EXIT_INVALID, EXIT_UNREADABLE, EXIT_USAGE, EXIT_VALID, main

from . import golden

GOOD = golden.GOLDEN_DIR / "mixed_i8_window_draft.ssf"


def test_inspect_text(capsys):
    assert main(["inspect", str(GOOD), "--verify"]) == EXIT_VALID
    out = capsys.readouterr().out
    assert "(verified)" in out and "draft 0" in out and "i8/i8" in out and "tokens held         6" in out


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
