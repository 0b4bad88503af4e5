"""`strata-engine` command line: exit statuses (2 bad settings, 3 model not loadable) with a fatal line
on stdout for `serve`, and `generate` streaming text for people."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from strata_engine.cli import build_parser, main
from strata_engine.client import EngineProcess
from strata_engine.kernel_cache import RESTARTED_ENV
from strata_engine.settings import EngineSettings
from support.data import smollm2_model_path

from .engine_cli import run_cli


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--ctx-size", "0"], "n_ctx"),
        (["--prefill-chunk", "-1", "--kv-resident", "0"], "prefill_chunk"),
        (["--kv-type", "f8"], "--kv-type"),
        (["--ctx-size", "many"], "--ctx-size"),
        (["--no-such-flag"], "unrecognized"),
        (["--threads", "0"], "threads"),
        (["--poll", "101"], "poll: 101 must be from 0 to 100"),
        (["--parallel", "0"], "n_slots"),
        (["-c", "60", "-np", "4"], "15 tokens of context, fewer than 16"),
    ],
)
def test_bad_settings_exit_2(args, fragment):
    done = run_cli("serve", "--model", str(smollm2_model_path()), *args)
    assert done.returncode == 2
    fatal = json.loads(done.stdout.splitlines()[-1])
    assert fatal["event"] == "fatal" and fragment in fatal["message"]
    if "prefill_chunk" in args[0]:
        assert "kv_resident" in fatal["message"]  # every problem at once


def test_missing_model_exits_3(tmp_path):
    done = run_cli("serve", "--model", str(tmp_path / "absent.gguf"))
    assert done.returncode == 3
    fatal = json.loads(done.stdout)
    assert fatal["event"] == "fatal" and "not found" in fatal["message"]


def test_unloadable_model_exits_3(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    done = run_cli("serve", "--model", str(bogus))
    assert done.returncode == 3
    lines = done.stdout.splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["event"] == "fatal"


def test_generate_usage_errors_exit_2(capsys):
    assert main(["generate", "--model", str(smollm2_model_path())]) == 2  # no --prompt
    assert "--prompt" in capsys.readouterr().err


def test_generate_streams_text():
    done = run_cli(
        "generate", "--model", str(smollm2_model_path()), "-c", "64", "--prompt", "The capital of France is",
        "-n", "3", "--temperature", "0",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode() == " Paris.\n\n"
    assert b"stop: limit" in done.stderr


def _settings(*args: str) -> EngineSettings:
    return EngineSettings.from_flags(vars(build_parser().parse_args(["serve", "--model", "m.gguf", *args])))


def test_gpu_flags_reach_the_settings():
    settings = _settings("--no-cuda-graphs", "--compute-dtype", "bf16", "--backend", "cupy")
    assert settings.cuda_graphs is False and settings.compute_dtype == "bf16"
    defaults = _settings()
    assert defaults.cuda_graphs is True and defaults.compute_dtype is None and defaults.prefill_chunk is None


def test_threads_flag_limits_the_blas_pool():
    from strata_engine.ops.threads import set_threads
    from threadpoolctl import threadpool_info, threadpool_limits

    assert _settings("-t", "1").threads == 1
    assert _settings().threads is None
    with threadpool_limits(limits=None):  # puts the pools back as they were afterwards
        set_threads(1)
        blas = [pool for pool in threadpool_info() if pool["user_api"] == "blas"]
        assert blas and all(pool["num_threads"] == 1 for pool in blas)


def test_poll_is_set_before_the_kernel_threads_start_and_only_then():
    """libgomp reads its spin count when numba starts its threads: a fresh process gets --poll's, and a later
    level says it cannot apply."""
    code = (
        "import os\n"
        "from strata_engine.cli import build_parser\n"
        "from strata_engine.settings import EngineSettings\n"
        "from strata_engine.ops import get_ops\n"
        "from strata_engine.ops.threads import SPINS_PER_POLL_LEVEL, set_poll\n"
        "s = EngineSettings.from_flags(vars(build_parser().parse_args(['serve', '--model', 'm.gguf', '--poll', '7'])))\n"
        "get_ops('numpy', 'f32', 'numba', 2, s.poll)\n"
        "print(os.environ['GOMP_SPINCOUNT'] == str(7 * SPINS_PER_POLL_LEVEL), set_poll(9), os.environ['GOMP_SPINCOUNT'])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False", "700"]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--chat-template", "llama9"], "neither a built-in name (chatml, llama2, "),
        (["--chat-template", "{{ oops"], "does not parse"),
        (["--chat-template-file", "/no/such/template.jinja"], "cannot read"),
        (["--chat-template", "chatml", "--chat-template-file", __file__], "not allowed with"),
    ],
)
def test_bad_chat_templates_exit_2(args, fragment):
    done = run_cli("serve", "--model", str(smollm2_model_path()), *args)
    assert done.returncode == 2
    assert fragment in json.loads(done.stdout.splitlines()[-1])["message"]


STARTING_OVER = b"starting over"


def _serve_once(cache: Path, **env: str) -> tuple[EngineProcess, str, bytes]:
    """A `serve` on numba's cache `cache` (the tokenizer's kernels are the only ones it compiles: numpy
    products): its pid after the ready line, one greedy completion, then its stderr after QUIT."""
    process = EngineProcess(smollm2_model_path(), "--ctx-size", "128", "--cpu-kernels", "numpy",
                           env={"NUMBA_CACHE_DIR": str(cache), **env})  # fmt: skip
    content = process.complete("The capital of France is", 6)["content"]
    assert process.quit() == 0
    return process, content, b"".join(process.stderr)


def test_a_serve_that_compiled_kernels_starts_over_before_its_ready_line(tmp_path):
    """With an empty numba cache, `serve` compiles kernels while it loads, then starts itself over (the same
    pid and pipes) before its ready line, so that the process serving loaded every kernel from the cache and
    holds none of the compiler's memory; the next start finds them cached and goes straight on; a process
    already started over never starts over again (a cache numba cannot write would loop)."""
    first, text, err = _serve_once(tmp_path / "cache")
    assert STARTING_OVER in err, err.decode(errors="replace")
    assert any((tmp_path / "cache").rglob("*.nbi"))
    again, text_again, err_again = _serve_once(tmp_path / "cache")
    assert STARTING_OVER not in err_again and text_again == text
    once, text_once, err_once = _serve_once(tmp_path / "other", **{RESTARTED_ENV: "1"})
    assert STARTING_OVER not in err_once and text_once == text


def test_only_the_cli_sets_the_engine_process_environment():
    """Importing the library (as the server does) leaves os.environ alone; the CLI sets the engine's
    OpenBLAS thread timeout before numpy loads."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    show = "import os, sys; print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'), 'numpy' in sys.modules)"
    library = f"import strata_engine, strata_engine.settings, strata_engine.protocol; {show}"
    cli = f"import strata_engine.cli; {show}"
    outputs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
               for code in (library, cli)]  # fmt: skip
    assert [o.stdout.split() for o in outputs] == [["None", "False"], ["4", "True"]], [
        o.stderr for o in outputs
    ]
