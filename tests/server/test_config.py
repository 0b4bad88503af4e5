"""Config: defaults < file < flags; every problem reported at once; the CLI's --help and exit status."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from strata_server.cli import build_parser, load_config, main
from strata_server.config import DEFAULT_PORT, ConfigError, build_config, default_model_path


def test_defaults(smollm2_path):
    config = build_config()
    assert config.port == DEFAULT_PORT == 8080 and config.host == ("127.0.0.1",)
    assert config.engine.model_path == default_model_path() == smollm2_path
    assert config.slot_save_path is None and config.metrics is False and config.slots is True
    assert config.engine_argv()[-2:] == [
        "--model",
        str(smollm2_path),
    ]  # every other setting the engine's default


def test_file_then_flags(tmp_path, fake_model, slot_dir):
    path = tmp_path / "strata.toml"
    path.write_text(
        f'model = "{fake_model}"\nport = 9000\nslot_save_path = "{slot_dir}"\nmetrics = true\n'
        'api_key = ["a", "b"]\nctx_size = 2048\n',
        encoding="utf-8",
    )
    config = load_config(["--config", str(path), "--port", "9100", "-c", "1024", "--api-key", "z"])
    assert config.port == 9100 and config.engine.n_ctx == 1024 and config.metrics is True
    assert config.slot_save_path == slot_dir.resolve() and config.api_key == ("z",)
    assert "--ctx-size" in config.engine_argv() and "1024" in config.engine_argv()
    tuned = load_config(
        [
            "--model",
            str(fake_model),
            "--kv-resident",
            "256",
            "--no-prompt-cache",
            "--restore-mode",
            "streaming",
            "--kv-type",
            "int8",
        ]
    ).engine_argv()
    assert tuned[tuned.index("--kv-type") :] == [
        "--kv-type",
        "int8",
        "--kv-resident",
        "256",
        "--no-prompt-cache",
        "--restore-mode",
        "streaming",
    ]
    json_path = tmp_path / "strata.json"
    json_path.write_text(
        json.dumps({"model": str(fake_model), "allowed_hosts": "a.lan,b.lan"}), encoding="utf-8"
    )
    assert load_config(["--config", str(json_path)]).allowed_hosts == ("a.lan", "b.lan")


def test_every_problem_reported_together(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(
        'port = "eighty"\nbogus_key = 1\nthreads = 0\nslot_save_path = "/no/such/dir"\nmetrics = "maybe"\n',
        encoding="utf-8",
    )
    with pytest.raises(ConfigError) as info:
        load_config(
            [
                "--config",
                str(path),
                "--model",
                "/no/model.gguf",
                "-ctk",
                "f16",
                "-ctv",
                "f32",
                "--trusted-origins",
                "not-an-origin",
            ]
        )
    problems = "\n".join(info.value.problems)
    for expected in (
        "port: expected an integer, got 'eighty'",
        "bogus_key: unknown setting",
        "threads: 0 must be at least 1",
        "slot_save_path: not a directory: /no/such/dir",
        "metrics: expected true or false",
        "model: not a file: /no/model.gguf",
        "kv_type: K and V share one type",
        "trusted_origins: 'not-an-origin'",
    ):
        assert expected in problems, expected
    assert len(info.value.problems) == 8


def test_bad_config_file_syntax(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("port = = 1", encoding="utf-8")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(["--config", str(path)])


def test_cli_exit_status_and_help(capsys):
    assert main(["--port", "0", "--kv-type", "q9"]) == 2
    err = capsys.readouterr().err
    assert "port: 0 is outside 1..65535" in err and "kv_type: 'q9'" in err
    help_text = build_parser().format_help()
    for flag in (
        "--model",
        "--host",
        "--port",
        "--ctx-size",
        "--slot-save-path",
        "--api-key",
        "--api-key-file",
        "--metrics",
        "--cache-type-k",
        "--alias",
        "--config",
        "--allowed-hosts",
        "--trusted-origins",
        "default: 8080",
        "SmolLM2",
    ):
        assert flag in help_text, flag


def test_help_and_readme_list_every_supported_architecture():
    """The list comes from the engine's tables at run time; the README names each too."""
    from pathlib import Path

    from strata_engine.model_check import supported_architectures

    architectures = supported_architectures()
    assert "llama" in architectures and "gemma3" in architectures
    help_text = " ".join(build_parser().format_help().split())
    assert f"supported architecture ({', '.join(architectures)};" in help_text
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    models = " ".join(readme[readme.index("Models: ") :].split("\n\n")[0].split())
    for arch in architectures:
        assert f"`{arch}`" in models, arch


def test_console_script_help():
    result = subprocess.run(
        [sys.executable, "-m", "strata_server.cli", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "default: 8080" in result.stdout


def test_parallel_flags_file_and_checks(tmp_path, fake_model):
    config = load_config(["--model", str(fake_model), "-np", "4", "-sps", "0.5", "-c", "4096"])
    assert config.engine.n_slots == 4 and config.slot_prompt_similarity == 0.5
    argv = config.engine_argv()
    assert argv[argv.index("--parallel") + 1] == "4" and argv[argv.index("--ctx-size") + 1] == "4096"
    assert (
        "--parallel" not in load_config(["--model", str(fake_model)]).engine_argv()
    )  # 1: the engine's default
    path = tmp_path / "strata.toml"
    path.write_text(f'model = "{fake_model}"\nparallel = 2\nslot_prompt_similarity = 0.0\n', encoding="utf-8")
    from_file = load_config(["--config", str(path)])
    assert from_file.engine.n_slots == 2 and from_file.slot_prompt_similarity == 0.0
    with pytest.raises(ConfigError) as info:
        load_config(["--model", str(fake_model), "--parallel", "0", "--slot-prompt-similarity", "1.5"])
    assert info.value.problems == [
        "parallel: 0 must be at least 1",
        "slot_prompt_similarity: 1.5 is outside 0..1 (0: off)",
    ]
    help_text = build_parser().format_help()
    for text in ("-np N, --parallel N", "-sps F, --slot-prompt-similarity F", "N / --parallel"):
        assert text in help_text, text
