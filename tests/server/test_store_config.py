"""The session store's settings: flags and config file, defaults stated in --help, every problem at once."""

from __future__ import annotations

import os

import pytest
from strata_server.cli import build_parser, load_config
from strata_server.config import ConfigError
from strata_server.store import store_settings
from strata_server.store.store import MIB


def test_off_by_default_and_the_defaults_in_help(fake_model):
    config = load_config(["--model", str(fake_model)])
    assert config.cache_disk is None and config.cache_ram == 0 and store_settings(config) is None
    help_text = " ".join(build_parser().format_help().split())
    for flag, default in (
        ("--cache-disk-max", "10240"),
        ("--cache-min-reuse", "256"),
        ("--cache-idle-seconds", "30"),
        ("--cache-ram", "0"),
    ):
        assert flag in help_text
        assert f"(default: {default}" in help_text.rsplit(flag, 1)[1][:300], flag
        assert "--cache-disk DIR" in help_text


def test_flags_and_file(tmp_path, fake_model):
    path = tmp_path / "strata.toml"
    path.write_text(
        f'cache_disk = "{tmp_path / "store"}"\ncache_disk_max = 64\ncache_idle_seconds = 2.5\n',
        encoding="utf-8",
    )
    config = load_config(["--config", str(path), "--model", str(fake_model), "--cache-min-reuse", "512"])
    settings = store_settings(config)
    assert settings.folder == (tmp_path / "store").resolve() and settings.max_bytes == 64 * MIB
    assert (settings.min_reuse, settings.idle_s, settings.ephemeral) == (512, 2.5, False)
    ram = store_settings(load_config(["--model", str(fake_model), "--cache-ram", "128", "--port", "9123"]))
    assert ram.ephemeral and ram.max_bytes == 128 * MIB and ram.idle_s == 0
    assert ram.folder.name.startswith(f"strata-cache-ram-{os.geteuid()}-9123-")  # then a random part


def test_every_store_problem_reported_together(tmp_path, fake_model):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(
            [
                "--model",
                str(fake_model),
                "--cache-disk",
                str(not_a_folder),
                "--cache-disk-max",
                "0",
                "--cache-min-reuse",
                "0",
                "--cache-idle-seconds",
                "-1",
                "--cache-ram",
                "16",
            ]
        )
    problems = "\n".join(info.value.problems)
    for expected in (
        "cache_disk: not a directory",
        "cache_disk_max: 0 MiB must be at least 1",
        "cache_min_reuse: 0 must be at least 1 token",
        "cache_idle_seconds: -1.0 is negative",
        "cache_ram: a RAM tier in front of --cache-disk is not built",
    ):
        assert expected in problems, expected
    assert len(info.value.problems) == 5


def test_the_object_store_and_the_session_key(tmp_path, fake_model):
    key = tmp_path / "session.key"
    key.write_bytes(bytes(range(32)))
    config = load_config(
        [
            "--model",
            str(fake_model),
            "--cache-disk",
            str(tmp_path / "store"),
            "--cache-store",
            "s3://bucket/fleet/a/",
            "--cache-store-endpoint",
            "http://127.0.0.1:8333",
            "--session-key-file",
            str(key),
            "--session-key-optional",
        ]
    )
    settings = store_settings(config)
    assert (settings.remote.bucket, settings.remote.prefix, settings.remote.endpoint_url) == (
        "bucket",
        "fleet/a",
        "http://127.0.0.1:8333",
    )
    assert settings.key is not None and not settings.require_mac
    argv = config.engine_argv()
    assert (
        argv[argv.index("--session-key-file") + 1] == str(key.resolve()) and "--session-key-optional" in argv
    )
    assert "--session-key-file" not in load_config(["--model", str(fake_model)]).engine_argv()


def test_object_store_and_key_problems_reported_together(tmp_path, fake_model):
    short = tmp_path / "short.key"
    short.write_bytes(b"k" * 16)
    with pytest.raises(ConfigError) as info:
        load_config(
            ["--model", str(fake_model), "--cache-store", "http://x", "--session-key-file", str(short)]
        )
    problems = info.value.problems
    assert any(p.startswith("cache_store:") and "s3://BUCKET/PREFIX" in p for p in problems)
    assert any(p.startswith("session_key_file:") and "32 bytes" in p for p in problems)
    with pytest.raises(ConfigError) as info:
        load_config(
            ["--model", str(fake_model), "--session-key-optional", "--cache-store-endpoint", "http://e"]
        )
    assert sorted(info.value.problems) == [
        "cache_store_endpoint: needs cache_store",
        "session_key_optional: needs session_key_file",
    ]


def test_the_object_store_alone_and_its_engine_flag(tmp_path, fake_model):
    """--cache-store without --cache-disk: no folder, no byte limit of the server's; the engine gets the endpoint
    (it reads and writes the objects itself); a RAM tier in front of the store is refused."""
    config = load_config(
        [
            "--model",
            str(fake_model),
            "--cache-store",
            "s3://bucket/fleet",
            "--cache-store-endpoint",
            "http://127.0.0.1:8333",
            "--cache-idle-seconds",
            "5",
        ]
    )
    settings = store_settings(config)
    assert settings.folder is None and settings.remote.bucket == "bucket" and settings.idle_s == 5
    argv = config.engine_argv()
    assert argv[argv.index("--object-store-endpoint") + 1] == "http://127.0.0.1:8333"
    aws = load_config(["--model", str(fake_model), "--cache-store", "s3://bucket"])
    assert store_settings(aws).remote.prefix == "" and "--object-store-endpoint" not in aws.engine_argv()
    with pytest.raises(ConfigError) as info:
        load_config(["--model", str(fake_model), "--cache-store", "s3://bucket/fleet", "--cache-ram", "64"])
    assert info.value.problems == [
        "cache_store: a RAM tier in front of the object store is not built; give "
        "--cache-disk DIR in front of it, or neither"
    ]
    help_text = " ".join(build_parser().format_help().split())
    assert "Alone: conversations are saved straight to objects" in help_text


def test_write_behind_on_by_default_its_queue_and_its_flags(tmp_path, fake_model):
    base = ["--model", str(fake_model), "--cache-disk", str(tmp_path / "store"), "--cache-store", "s3://b/p"]
    settings = store_settings(load_config(base))
    assert settings.write_behind and settings.remote.queue_bytes == 1024 * MIB
    settings = store_settings(load_config([*base, "--no-cache-write-behind", "--cache-store-queue", "64"]))
    assert not settings.write_behind and settings.remote.queue_bytes == 64 * MIB
    help_text = " ".join(build_parser().format_help().split())
    assert "(default: 1024)" in help_text.rsplit("--cache-store-queue", 1)[1][:400]
    assert "--no-cache-write-behind" in help_text
    with pytest.raises(ConfigError) as info:
        load_config([*base, "--cache-store-queue", "0"])
    assert info.value.problems == ["cache_store_queue: 0 MiB must be at least 1"]
