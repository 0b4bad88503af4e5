"""The engine owns its settings vocabulary: strata-server's engine flags and config keys are the engine's table
(`EngineSettings`' rows), every one of them reaches the engine's own parser unchanged, and the server's sampling
defaults are the engine's `SamplingParams`."""

from __future__ import annotations

import argparse

import attrs
import pytest
from strata_engine.cli import build_parser as engine_parser
from strata_engine.sampling import SamplingParams
from strata_engine.settings import FLAGGED, KEYS, EngineSettings
from strata_server.cli import build_parser, load_config
from strata_server.config import ENGINE_KEYS, ConfigError, ServerConfig, build_config
from strata_server.defaults import DEFAULT_FIELDS
from strata_server.params import ENGINE_DEFAULTS

# A value other than the default for every engine setting the server offers: a new row of the table needs one.
EXAMPLES: dict[str, list[str]] = {
    "n_ctx": ["-c", "4096"], "n_slots": ["-np", "4"], "kv_type": ["--kv-type", "int8"],
    "kv_resident": ["--kv-resident", "256"], "prompt_cache": ["--no-prompt-cache"], "backend": ["--backend", "auto"],
    "cpu_kernels": ["--cpu-kernels", "numba"], "batch_invariant": ["--no-batch-invariant"], "threads": ["-t", "3"],
    "poll": ["--poll", "0"],
    "chat_template": ["--chat-template", "gemma"],
}  # fmt: skip


def _engine_reads(argv: list[str]) -> EngineSettings:
    """What `strata-engine serve` builds from these flags."""
    return EngineSettings.from_flags(vars(engine_parser().parse_args(["serve", *argv])))


def _options(parser: argparse.ArgumentParser) -> dict[str, set[str]]:
    """dest -> the flags that set it (a dest set by several flags: all of them)."""
    found: dict[str, set[str]] = {}
    for action in parser._actions:
        found.setdefault(action.dest, set()).update(action.option_strings)
    return found


def test_every_engine_flag_the_server_takes_round_trips_into_the_engine(fake_model):
    offered = {field for field, row in FLAGGED.items() if row.server}
    assert set(EXAMPLES) | {"model_path"} == offered
    default = EngineSettings(model_path=fake_model)
    every = [flag for example in EXAMPLES.values() for flag in example]
    for field, flags in [*EXAMPLES.items(), ("all", every)]:
        config = load_config(["--model", str(fake_model), *flags])
        if field != "all":
            assert getattr(config.engine, field) != getattr(default, field), field
        argv = config.engine.to_argv()
        assert _engine_reads(argv) == config.engine, field
        assert config.engine_argv()[-len(argv) :] == argv  # no serve option is given here
    assert _engine_reads(load_config(["--model", str(fake_model)]).engine.to_argv()) == default


def test_the_server_s_engine_flags_are_the_engine_s(fake_model, tmp_path):
    commands = next(a for a in engine_parser()._actions if isinstance(a, argparse._SubParsersAction))
    server, engine = _options(build_parser()), _options(commands.choices["serve"])
    for row in FLAGGED.values():
        if row.server:
            assert server[row.key] == engine[row.key] - {row.file_flag}, row.key
            assert row.file_flag is None or server[f"{row.key}_file"] == {row.file_flag}
        else:
            assert row.key not in server, row.key
    # the config file's keys are the flags' (llama-server's -c 0 and -t -1: the defaults)
    from_file = build_config({"model": str(fake_model), "ctx_size": 4096, "parallel": 4, "kv_type": "int8",
                              "prompt_cache": False, "threads": 3, "poll": 0})  # fmt: skip
    flags = load_config(["--model", str(fake_model), *EXAMPLES["n_ctx"], *EXAMPLES["n_slots"], *EXAMPLES["kv_type"],
                         *EXAMPLES["prompt_cache"], *EXAMPLES["threads"], *EXAMPLES["poll"]])  # fmt: skip
    assert from_file.engine == flags.engine
    unset = load_config(["--model", str(fake_model), "-c", "0", "-t", "-1", "--kv-resident", "0"])
    assert unset.engine == EngineSettings(model_path=fake_model)
    template = tmp_path / "template.jinja"
    template.write_text("{{ messages[0]['content'] }}", encoding="utf-8")
    from_template_file = load_config(
        ["--model", str(fake_model), "--chat-template-file", str(template)]
    ).engine
    assert (
        _engine_reads(["--model", str(fake_model), "--chat-template-file", str(template)])
        == from_template_file
    )
    assert _engine_reads(from_template_file.to_argv()) == from_template_file


def test_engine_problems_are_the_engine_s_checks_named_by_the_server_s_keys(fake_model):
    with pytest.raises(ConfigError) as info:
        load_config(["--model", str(fake_model), "-c", "60", "-np", "4", "--backend", "gpu", "-t", "x"])
    assert info.value.problems == [
        "threads: expected an integer, got 'x'", "backend: 'gpu' is not one of numpy, cupy, auto",
        "ctx_size 60 gives each of the 4 slots 15 tokens of context, fewer than 16",
    ]  # fmt: skip
    assert set(KEYS[field] for field in ENGINE_KEYS.values()) == set(ENGINE_KEYS)


def test_the_server_s_sampling_defaults_are_the_engine_s():
    sampling = attrs.asdict(SamplingParams())
    server = {field.name: field.default for field in attrs.fields(ServerConfig)}
    help_text = build_parser().format_help()
    for name, engine_name in DEFAULT_FIELDS.items():
        if engine_name in sampling:
            assert server[name] == sampling[engine_name] == ENGINE_DEFAULTS[engine_name], name
            assert f"(default: {sampling[engine_name]}" in help_text, name
    assert {engine_name for engine_name in DEFAULT_FIELDS.values()} >= set(sampling) - {"logit_bias"}
