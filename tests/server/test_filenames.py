"""The peer's fs_validate_filename, ported, plus the symlink refusal."""

from __future__ import annotations

import pytest
from strata_server.filenames import InvalidFilename, resolve_slot_file, validate_filename

from .checks import BAD_NAMES


@pytest.mark.parametrize("name", BAD_NAMES)
def test_rejected(name):
    with pytest.raises(InvalidFilename):
        validate_filename(name)


# Each accepted name beside a near miss the peer refuses: the rule between the two is what is tested.
NEAR_MISSES = [
    (".hidden", "."),
    ("café.bin", "café\x00.bin"),
    ("x" * 255, "x" * 256),
    ("a.b", "a..b"),
    ("日本語.bin", "日本語\u2215.bin"),
    ("a b", "a b "),
    ("a-b_c~1", "a-b_c~1."),
]


@pytest.mark.parametrize(("name", "near_miss"), NEAR_MISSES)
def test_accepted_beside_a_refused_near_miss(tmp_path, name, near_miss):
    assert resolve_slot_file(tmp_path, name, must_exist=False) == tmp_path / name  # validated, then resolved
    with pytest.raises(InvalidFilename):
        validate_filename(near_miss)
    with pytest.raises(InvalidFilename):
        resolve_slot_file(tmp_path, near_miss, must_exist=False)


def test_byte_limit_counts_utf8():
    validate_filename("é" * 127)  # 254 bytes
    with pytest.raises(InvalidFilename, match="256 bytes"):
        validate_filename("é" * 128)


def test_resolve(tmp_path):
    (tmp_path / "real.bin").write_bytes(b"x")
    (tmp_path / "link.bin").symlink_to(tmp_path / "real.bin")
    (tmp_path / "dangling.bin").symlink_to(tmp_path / "nowhere")
    assert resolve_slot_file(tmp_path, "real.bin", must_exist=True) == tmp_path / "real.bin"
    assert resolve_slot_file(tmp_path, "new.bin", must_exist=False) == tmp_path / "new.bin"
    with pytest.raises(FileNotFoundError):
        resolve_slot_file(tmp_path, "new.bin", must_exist=True)
    for name in ("link.bin", "dangling.bin"):
        for must_exist in (True, False):
            with pytest.raises(InvalidFilename, match="symbolic link"):
                resolve_slot_file(tmp_path, name, must_exist=must_exist)
