"""The session store's settings: flags and config file, defaults stated in --help, every problem at once."""

from __future__ import annotations

import pytest
from strata_server.cli import build_parser, load_config
from strata_server.config import ConfigError
from strata_server.store import store_settings
from strata_server.store.store import MIB


def test_off_by_default_and_the_defaults_in_help(fake_model):
    config = load_config(["--model", str(fake_model)])
    assert config.cache_disk is None and config.cache_ram == 0 and store_settings(config) is None
    help_text = " ".join(build_parser().format_help().split())
    for flag, default in (("--cache-disk-max", "10240"), ("--cache-min-reuse", "256"),
                          ("--cache-idle-seconds", "30"), ("--cache-ram", "0")):
        assert flag in help_text
        assert f"(default: {default}" in help_text.rsplit(flag, 1)[1][:300], flag
        assert "--cache-disk DIR" in help_text


def test_flags_and_file(tmp_path, fake_model):
    path = tmp_path / "strata.toml"
    path.write_text(f'cache_disk = "{tmp_path / "store"}"\ncache_disk_max = 64\ncache_idle_seconds = 2.5\n',
                    encoding="utf-8")
    config = load_config(["--config", str(path), "--model", str(fake_model), "--cache-min-reuse", "512"])
    settings = store_settings(config)
    assert settings.folder == (tmp_path / "store").resolve() and settings.max_bytes == 64 * MIB
    assert (settings.min_reuse, settings.idle_s, settings.ephemeral) == (512, 2.5, False)
    ram = store_settings(load_config(["--model", str(fake_model), "--cache-ram", "128", "--port", "9123"]))
    assert ram.ephemeral and ram.max_bytes == 128 * MIB and ram.idle_s == 0
    assert ram.folder.name.endswith("-9123")


def test_every_store_problem_reported_together(tmp_path, fake_model):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(["--model", str(fake_model), "--cache-disk", str(not_a_folder), "--cache-disk-max", "0",
                     "--cache-min-reuse", "0", "--cache-idle-seconds", "-1", "--cache-ram", "16"])
    problems = "\n".join(info.value.problems)
    for expected in ("cache_disk: not a directory", "cache_disk_max: 0 MiB must be at least 1",
                     "cache_min_reuse: 0 must be at least 1 token", "cache_idle_seconds: -1.0 is negative",
                     "cache_ram: a RAM tier in front of --cache-disk is not built"):
        assert expected in problems, expected
    assert len(info.value.problems) == 5
