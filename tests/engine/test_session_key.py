"""`strata-engine serve --session-key-file FILE [--session-key-optional]` (spec/engine-protocol.md): SAVE writes
authenticated files; RESTORE and RESTORE_PREFIX check the MAC before the gate and refuse a file without one
(unless optional) or of another key with the library's reason, keeping the held conversation."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys

import numpy as np
import pytest
import strata_sessionfile as sf
import xxhash
from strata_engine.client import EngineProcess
from strata_sessionfile.format import Flags
from support.data import smollm2_model_path

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def random_tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1000, 20000, n)]


def digest(tokens: list[int]) -> str:
    return xxhash.xxh3_64_hexdigest(np.asarray(tokens, dtype="<i4").tobytes())


def key_file(path, secret: bytes | None = None):
    path.write_bytes(secret if secret is not None else secrets.token_bytes(32))
    return path


@pytest.fixture
def engines(tmp_path):
    """Three SmolLM2 engines: keyed (key A, MAC required), other (key B, MAC optional), plain (no key)."""
    started = {}
    try:
        started["keyed"] = EngineProcess(
            smollm2_model_path(),
            "--ctx-size",
            "1024",
            "--session-key-file",
            str(key_file(tmp_path / "a.key")),
        )
        started["other"] = EngineProcess(
            smollm2_model_path(),
            "--ctx-size",
            "1024",
            "--session-key-optional",
            "--session-key-file",
            str(key_file(tmp_path / "b.key")),
        )
        started["plain"] = EngineProcess(smollm2_model_path(), "--ctx-size", "1024")
        yield started
    finally:
        for engine in started.values():
            engine.quit()


def test_keyed_save_restores_and_unauthenticated_files_are_refused_before_the_gate(engines, tmp_path):
    keyed, other, plain = engines["keyed"], engines["other"], engines["plain"]
    prompt, more = random_tokens(400, 11), random_tokens(30, 12)
    files = {}
    for name, engine in engines.items():
        engine.complete(prompt, 4)
        files[name] = tmp_path / f"{name}.ssf"
        assert engine.result("SAVE", {"path": str(files[name])})["n_saved"] == 403
    key_a = sf.SessionKey.from_file(tmp_path / "a.key")
    assert sf.inspect(files["keyed"], key=key_a).header.flags & Flags.AUTHENTICATED
    assert not sf.inspect(files["plain"]).header.flags & Flags.AUTHENTICATED

    # The keyed engine continues its own file: the same greedy turn as the plain engine's held conversation.
    reference = plain.complete(prompt + more, 8)
    assert reference["timings"]["cache_n"] == 400
    keyed.result("ERASE")
    restored = keyed.result("RESTORE_PREFIX", {"path": str(files["keyed"]), "discard_held": True})
    assert restored["n_kept"] == 403
    turn = keyed.complete(prompt + more, 8)
    assert turn["timings"]["cache_n"] == 400 and turn["tokens"] == reference["tokens"]

    flipped = tmp_path / "flipped.ssf"
    data = bytearray(files["keyed"].read_bytes())
    data[-24] ^= 0x01  # a byte of the trailer's MAC
    flipped.write_bytes(bytes(data))
    held = keyed.result("STATUS")["slots"][0]["tokens_held_digest"]
    refusals = [
        (keyed, "RESTORE", {"path": str(files["plain"])}, "mac_missing"),
        (keyed, "RESTORE_PREFIX", {"path": str(files["plain"]), "discard_held": True}, "mac_missing"),
        (keyed, "RESTORE", {"path": str(files["other"])}, "mac_wrong_key"),
        (keyed, "RESTORE_PREFIX", {"path": str(flipped), "discard_held": True}, "mac_mismatch"),
        (other, "RESTORE", {"path": str(files["keyed"])}, "mac_wrong_key"),
    ]
    other_held = other.result("STATUS")["slots"][0]["tokens_held_digest"]
    for engine, verb, argument, reason in refusals:
        error = engine.command(verb, argument)["error"]
        assert (error["type"], error["reason"]) == ("session_refused", reason), (verb, argument)
    assert keyed.result("STATUS")["slots"][0]["tokens_held_digest"] == held  # refused before the gate: kept
    assert other.result("STATUS")["slots"][0]["tokens_held_digest"] == other_held

    # --session-key-optional restores a file without a MAC; an engine without a key restores a keyed file.
    other.result("ERASE")
    assert other.result("RESTORE", {"path": str(files["plain"])})["n_restored"] == 403
    assert other.result("STATUS")["slots"][0]["tokens_held_digest"] == digest(file_tokens(files["plain"]))
    plain.result("ERASE")
    assert plain.result("RESTORE", {"path": str(files["keyed"])})["n_restored"] == 403


def file_tokens(path) -> list[int]:
    return np.frombuffer(sf.inspect(path, verify=False).metadata.state.tokens, dtype="<i4").tolist()


def run_serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "strata_engine.cli", "serve", "--model", str(smollm2_model_path()), *args],
        capture_output=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.parametrize("case", ["short", "missing", "optional_alone"])
def test_a_bad_key_setting_exits_2(tmp_path, case):
    args = {
        "short": ["--session-key-file", str(key_file(tmp_path / "short.key", b"x" * 31))],
        "missing": ["--session-key-file", str(tmp_path / "absent.key")],
        "optional_alone": ["--session-key-optional"],
    }[case]
    done = run_serve(*args)
    assert done.returncode == 2
    fatal = json.loads(done.stdout.splitlines()[-1])
    assert fatal["event"] == "fatal" and "session-key" in fatal["message"]
