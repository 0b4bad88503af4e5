"""llama-server's flags and edge behaviours through falcon.testing with the in-process fake engine:
default sampling, aliases and tags, CORS, header names, /slots and /metrics at the edges, chat validation."""

from __future__ import annotations

import pytest
from strata_server.cli import load_config
from strata_server.config import ConfigError

from .checks import assert_error

# --- default sampling and output -----------------------------------------------------------------


def test_sampling_flags_parse_and_every_bad_value_is_reported(fake_model):
    config = load_config(
        [
            "--model",
            str(fake_model),
            "--temp",
            "0",
            "--top-k",
            "5",
            "--top-p",
            "0.5",
            "--min-p",
            "0.1",
            "-s",
            "42",
            "-n",
            "7",
            "--repeat-penalty",
            "1.1",
            "--repeat-last-n",
            "32",
            "--presence-penalty",
            "0.25",
            "--frequency-penalty",
            "0.5",
        ]
    )
    assert (config.temp, config.top_k, config.top_p, config.min_p, config.seed, config.n_predict) == (
        0.0,
        5,
        0.5,
        0.1,
        42,
        7,
    )
    assert (
        config.repeat_penalty,
        config.repeat_last_n,
        config.presence_penalty,
        config.frequency_penalty,
    ) == (1.1, 32, 0.25, 0.5)
    with pytest.raises(ConfigError) as info:
        load_config(
            [
                "--model",
                str(fake_model),
                "--temp",
                "nan",
                "--repeat-penalty",
                "0",
                "--seed",
                "-5",
                "-n",
                "-3",
                "--top-k",
                "many",
            ]
        )
    problems = "\n".join(info.value.problems)
    for expected in (
        "temp: nan is not a finite number",
        "repeat_penalty: 0.0 must be above 0",
        "seed: -5",
        "n_predict: -3 is below -2",
        "top_k: expected an integer",
    ):
        assert expected in problems, expected


def test_request_without_fields_gets_the_server_defaults(make_api):
    client, engine, _ = make_api(temp=0, n_predict=5, top_k=3, seed=9)
    body = client.simulate_post("/completion", json={"prompt": "hello"}).json
    assert body["tokens_predicted"] == 5
    settings = body["generation_settings"]
    assert (settings["temperature"], settings["top_k"], settings["seed"], settings["n_predict"]) == (
        0,
        3,
        9,
        5,
    )
    # The request's own fields win.
    own = client.simulate_post(
        "/completion", json={"prompt": "hello", "n_predict": 2, "temperature": 0.5, "top_k": 7}
    ).json
    assert own["tokens_predicted"] == 2
    assert (own["generation_settings"]["temperature"], own["generation_settings"]["top_k"]) == (0.5, 7)
    chat = client.simulate_post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
    ).json
    assert chat["usage"]["completion_tokens"] == 5


def test_a_request_s_n_predict_wins_over_the_server_s_and_minus_one_means_the_server_s(make_api):
    client, _, _ = make_api(temp=0, n_predict=4)
    for asked, predicted in ((8, 8), (2, 2), (-1, 4)):  # llama-server b11549: the request's count, larger too
        body = client.simulate_post(
            "/completion", json={"prompt": "hello", "n_predict": asked, "ignore_eos": True}
        ).json
        assert body["tokens_predicted"] == predicted and body["generation_settings"]["n_predict"] == predicted
    unlimited, _, _ = make_api(temp=0)  # llama-server's -1: until a stop or the full context
    assert (
        unlimited.simulate_post("/completion", json={"prompt": "hi", "ignore_eos": True}).json["stop_type"]
        == "limit"
    )


def test_props_default_generation_settings_reflect_the_flags(make_api):
    client, _, _ = make_api(temp=0.2, top_p=0.7, n_predict=64, repeat_penalty=1.2, presence_penalty=0.1)
    params = client.simulate_get("/props").json["default_generation_settings"]["params"]
    assert (
        params["temperature"],
        params["top_p"],
        params["n_predict"],
        params["repeat_penalty"],
        params["presence_penalty"],
        params["frequency_penalty"],
    ) == (0.2, 0.7, 64, 1.2, 0.1, 0.0)
    defaults = make_api()[0].simulate_get("/props").json["default_generation_settings"]["params"]
    assert (
        defaults["temperature"],
        defaults["top_k"],
        defaults["top_p"],
        defaults["min_p"],
        defaults["n_predict"],
        defaults["seed"],
    ) == (0.8, 40, 0.95, 0.05, -1, -1)


# --- header names, /slots and /metrics at the edges ----------------------------------------------


def wsgi_header_names(app, path: str, method: str = "GET", headers: dict | None = None) -> list[str]:
    import falcon.testing

    names: list[str] = []
    environ = falcon.testing.create_environ(
        path, method=method, headers={"Host": "127.0.0.1:8080", **(headers or {})}
    )
    b"".join(app(environ, lambda status, hdrs, exc_info=None: names.extend(k for k, _ in hdrs)))
    return names


def test_response_header_names_are_cased_as_the_peer_sends_them(fake_model):
    from strata_server import build_config, create_app
    from strata_server.wsgi import peer_header_name, with_peer_header_case

    from .fake_engine import FakeEngine
    from .fakes import FakeEngineClient

    config = build_config({}, {"model": str(fake_model), "metrics": True})
    app = with_peer_header_case(create_app(FakeEngineClient(FakeEngine(str(fake_model))), config))
    metrics = wsgi_header_names(app, "/metrics")
    assert "Process-Start-Time-Unix" in metrics and "Content-Type" in metrics
    options = wsgi_header_names(
        app, "/completion", "OPTIONS", {"Origin": "http://x.example", "Access-Control-Request-Method": "POST"}
    )
    assert "Access-Control-Allow-Methods" in options and "Access-Control-Allow-Origin" in options
    assert peer_header_name("x-accel-buffering") == "X-Accel-Buffering"


def test_slots_n_remain_is_minus_one_and_n_decoded_zero_once_a_task_ended(make_api):
    client, _, _ = make_api(temp=0)
    client.simulate_post("/completion", json={"prompt": "hello", "n_predict": 3})
    next_token = client.simulate_get("/slots").json[0]["next_token"][0]
    assert next_token == {
        "has_next_token": False,
        "has_new_line": next_token["has_new_line"],
        "n_remain": -1,
        "n_decoded": 0,  # llama-server b11549's idle slot, whatever its last task decoded
    }


def test_metrics_generation_rate_is_zero_after_one_token(make_api):
    client, _, _ = make_api(temp=0, metrics=True)
    client.simulate_post("/completion", json={"prompt": "hello", "n_predict": 1})
    text = client.simulate_get("/metrics").text
    assert "llamacpp:tokens_predicted_total 1\n" in text
    assert (
        "llamacpp:predicted_tokens_seconds 0\n" in text
        and "llamacpp:tokens_predicted_seconds_total 0\n" in text
    )
    client.simulate_post("/completion", json={"prompt": "hello", "n_predict": 4})
    rate = next(
        line
        for line in client.simulate_get("/metrics").text.splitlines()
        if line.startswith("llamacpp:predicted_tokens_seconds ")
    )
    assert float(rate.split()[1]) > 0


# --- CORS ------------------------------------------------------------------------------------------


def test_cors_localhost_and_lists_behave_as_the_peer_for_listed_origins(make_api):
    client, _, _ = make_api(cors_origins="localhost,https://app.example")
    for origin in (
        "http://localhost:5173",
        "http://127.0.0.1:3000",
        "http://[::1]:8000",
        "https://app.example",
    ):
        ok = client.simulate_get("/health", headers={"Origin": origin})
        assert ok.headers["access-control-allow-origin"] == origin, origin
        assert ok.headers["access-control-allow-credentials"] == "true"
        preflight = client.simulate_options(
            "/v1/chat/completions",
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert preflight.headers["access-control-allow-origin"] == origin
        assert preflight.headers["access-control-allow-credentials"] == "true"
        assert preflight.headers["access-control-allow-headers"] == "*"
    for origin in ("http://localhost.evil.example", "http://other.example", "null"):
        refused = client.simulate_get("/health", headers={"Origin": origin})
        assert "access-control-allow-origin" not in refused.headers, origin
    # A wildcard beside listed origins: the listed ones as the peer, the rest without credentials.
    mixed, _, _ = make_api(cors_origins=["*", "http://app.example"])
    assert (
        mixed.simulate_get("/health", headers={"Origin": "http://app.example"}).headers[
            "access-control-allow-credentials"
        ]
        == "true"
    )
    other = mixed.simulate_get("/health", headers={"Origin": "http://x.example"})
    assert other.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-credentials" not in other.headers


def test_cors_origin_values_are_checked(fake_model):
    with pytest.raises(ConfigError, match="cors_origins: 'ftp://x' is not '\\*', 'localhost' or an origin"):
        load_config(["--model", str(fake_model), "--cors-origins", "localhost,ftp://x"])


# --- aliases, tags, hosts ----------------------------------------------------------------------------


def test_alias_and_tags_are_lists(make_api, fake_model):
    client, _, config = make_api(alias="tiny,small", tags=["chat", "test"])
    assert config.alias == ("tiny", "small")
    for path in ("/v1/models", "/models"):
        models = client.simulate_get(path).json
        entry = models["data"][0]
        # llama-server b11549 keeps the aliases in a std::set: sorted, the first of them the id
        assert (
            entry["id"] == "small"
            and entry["aliases"] == ["small", "tiny"]
            and entry["tags"] == ["chat", "test"]
        )
        assert models["models"][0]["name"] == "small" and models["models"][0]["tags"] == ["chat", "test"]
    assert client.simulate_get("/props").json["model_alias"] == "small"
    flags = load_config(["--model", str(fake_model), "-a", "a,b", "--alias", "c", "--tags", "x,y"])
    assert flags.alias == ("a", "b", "c") and flags.tags == ("x", "y")
    plain, _, _ = make_api()
    entry = plain.simulate_get("/v1/models").json["data"][0]
    assert entry["id"] == str(fake_model) and entry["aliases"] == [] and entry["tags"] == []


def test_host_list_binds_every_address(fake_model):
    config = load_config(["--model", str(fake_model), "--host", "127.0.0.1,::1", "--port", "9000"])
    assert config.host == ("127.0.0.1", "::1") and config.binds() == ["127.0.0.1:9000", "[::1]:9000"]


# --- threads and verbosity ---------------------------------------------------------------------------


def test_threads_are_the_engine_s_and_http_threads_are_gunicorn_s(tmp_path, fake_model):
    config = load_config(["--model", str(fake_model), "-t", "2", "--http-threads", "8", "--verbose"])
    argv = config.engine_argv()
    assert argv[argv.index("--threads") + 1] == "2" and argv[argv.index("--log-level") + 1] == "DEBUG"
    assert config.http_threads == 8 and config.effective_log_level() == "debug"
    default = load_config(["--model", str(fake_model)])
    assert "--threads" not in default.engine_argv() and "--log-level" not in default.engine_argv()
    assert (
        default.engine.threads is None
        and default.http_threads == 32
        and default.effective_log_level() == "info"
    )
    assert (
        load_config(["--model", str(fake_model), "--threads-http", "4"]).http_threads == 4
    )  # the peer's name
    q8 = load_config(["--model", str(fake_model), "--cpu-kernels", "numba-q8"]).engine_argv()
    assert q8[q8.index("--cpu-kernels") + 1] == "numba-q8" and "--cpu-kernels" not in default.engine_argv()
    with pytest.raises(ConfigError, match="cpu_kernels: 'fast' is not one of numba, numba-q8, numpy"):
        load_config(["--model", str(fake_model), "--cpu-kernels", "fast"])
    path = tmp_path / "strata.toml"
    path.write_text(
        f'model = "{fake_model}"\nthreads = 3\nhttp_threads = 5\nverbose = true\n', encoding="utf-8"
    )
    from_file = load_config(["--config", str(path)])
    assert (from_file.engine.threads, from_file.http_threads, from_file.verbose) == (3, 5, True)
    with pytest.raises(ConfigError) as info:
        load_config(["--model", str(fake_model), "-t", "0", "--http-threads", "0"])
    assert len(info.value.problems) == 2


def test_poll_reaches_the_engine_and_is_bounded(fake_model):
    quiet = load_config(["--model", str(fake_model), "--poll", "0"]).engine_argv()
    assert quiet[quiet.index("--poll") + 1] == "0"
    assert "--poll" not in load_config(["--model", str(fake_model)]).engine_argv()  # the engine's default, 50
    with pytest.raises(ConfigError, match="poll: 101 must be from 0 to 100"):
        load_config(["--model", str(fake_model), "--poll", "101"])


# --- chat template -------------------------------------------------------------------------------------


def test_chat_template_flags_reach_the_engine_and_bad_ones_are_reported(tmp_path, fake_model):
    named = load_config(["--model", str(fake_model), "--chat-template", "gemma"]).engine_argv()
    assert named[named.index("--chat-template") + 1] == "gemma"
    jinja = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert load_config(["--model", str(fake_model), "--chat-template", jinja]).engine_argv()[-1] == jinja
    path = tmp_path / "template.jinja"
    path.write_text(jinja, encoding="utf-8")
    from_file = load_config(["--model", str(fake_model), "--chat-template-file", str(path)]).engine_argv()
    assert from_file[from_file.index("--chat-template") + 1] == jinja  # the file's text, read once
    with pytest.raises(ConfigError) as info:
        load_config(["--model", str(fake_model), "--chat-template", "llama9"])
    (problem,) = info.value.problems
    assert problem.startswith("chat_template: 'llama9' is neither a built-in name (chatml, llama2, ")
    assert problem.endswith("solar-open) nor a jinja template")
    with pytest.raises(ConfigError) as info:
        load_config(
            [
                "--model",
                str(fake_model),
                "--chat-template",
                "chatml",
                "--chat-template-file",
                str(tmp_path / "missing.jinja"),
            ]
        )
    assert len(info.value.problems) == 2  # both given; the file unreadable


def test_reasoning_and_template_kwargs_flags(fake_model):
    """--reasoning and --chat-template-kwargs make the template kwargs every chat starts from, as
    llama-server's default_template_kwargs (preserve_reasoning always; enable_thinking for on|off)."""
    base = ["--model", str(fake_model), "--jinja"]
    assert load_config(base).template_kwargs() == {"preserve_reasoning": True}
    assert load_config([*base, "-rea", "off"]).template_kwargs() == {
        "preserve_reasoning": True,
        "enable_thinking": False,
    }
    given = load_config(
        [*base, "--reasoning", "on", "--chat-template-kwargs", '{"a": [1], "preserve_reasoning": false}']
    )
    assert given.template_kwargs() == {"preserve_reasoning": False, "a": [1], "enable_thinking": True}
    with pytest.raises(ConfigError) as info:
        load_config([*base, "--reasoning", "maybe", "--chat-template-kwargs", "[1]"])
    assert info.value.problems == [
        "reasoning: 'maybe' is not one of on, off, auto",
        "chat_template_kwargs: must be a JSON object, got '[1]'",
    ]


def test_reasoning_effort_and_preserve_flags(fake_model):
    """--reasoning-effort and --[no-]reasoning-preserve set the templates' reasoning_effort and
    preserve_reasoning over --chat-template-kwargs (llama-server b11549's flags); `default` leaves the effort
    to the template."""
    base = ["--model", str(fake_model), "--chat-template-kwargs", '{"preserve_reasoning": false}']
    assert load_config(base).template_kwargs() == {"preserve_reasoning": False}
    assert load_config([*base, "--reasoning-preserve"]).template_kwargs() == {"preserve_reasoning": True}
    flags = [*base[:2], "--no-reasoning-preserve", "--reasoning-effort", "high"]
    assert load_config(flags).template_kwargs() == {"preserve_reasoning": False, "reasoning_effort": "high"}
    assert "reasoning_effort" not in load_config([*base, "--reasoning-effort", "default"]).template_kwargs()
    with pytest.raises(ConfigError) as info:
        load_config([*base, "--reasoning-effort", ""])
    assert info.value.problems == [
        "reasoning_effort: empty (give a level, or 'default' for the template's own)"
    ]


# --- chat validation, assistant prefill, input token count -------------------------------------------

CHAT_PATHS = ("/v1/chat/completions", "/apply-template", "/v1/chat/completions/input_tokens")


def test_two_trailing_assistant_messages_are_refused(make_api):
    client, engine, _ = make_api()
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "a"},
        {"role": "assistant", "content": "b"},
    ]
    for path in CHAT_PATHS:
        assert_error(
            client.simulate_post(path, json={"messages": messages}),
            400,
            "invalid_request_error",
            "Cannot have 2 or more assistant messages at the end of the list.",
        )
    assert engine.commands == []
    # With --no-prefill-assistant a final assistant message is a finished turn: nothing to continue.
    finished, _, _ = make_api(prefill_assistant=False)
    assert (
        finished.simulate_post("/apply-template", json={"messages": messages})
        .json["prompt"]
        .endswith("<|im_start|>assistant\nb<|im_end|>\n<|im_start|>assistant\n")
    )


def test_continue_final_message_with_add_generation_prompt_is_refused(make_api):
    client, _, _ = make_api()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    for extra in (
        {"continue_final_message": True},
        {"continue_final_message": True, "add_generation_prompt": True},
    ):
        for path in CHAT_PATHS:
            assert_error(
                client.simulate_post(path, json={"messages": messages, **extra}),
                400,
                "invalid_request_error",
                "Cannot set both add_generation_prompt and continue_final_message to true.",
            )
    continued = client.simulate_post(
        "/apply-template",
        json={"messages": messages, "continue_final_message": True, "add_generation_prompt": False},
    ).json["prompt"]
    assert continued == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHel"
    # A final assistant message is continued by default too (the peer's assistant prefill).
    assert client.simulate_post("/apply-template", json={"messages": messages}).json["prompt"] == continued


def test_chat_input_tokens_counts_the_rendered_prompt(make_api):
    from .fake_engine import tokenize

    client, _, _ = make_api()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    for path in ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"):
        body = client.simulate_post(path, json={"messages": messages, "max_tokens": 9}).json
        prompt = client.simulate_post("/apply-template", json={"messages": messages}).json["prompt"]
        assert body == {"input_tokens": len(tokenize(prompt))}
    chat = client.simulate_post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json
    assert chat["usage"]["prompt_tokens"] == body["input_tokens"]
    assert_error(
        client.simulate_post("/v1/chat/completions/input_tokens", json={"messages": []}),
        400,
        "invalid_request_error",
    )


# --- return_progress -------------------------------------------------------------------------------------


def sse_payloads(text: str) -> list:
    import json

    return [json.loads(frame[6:]) for frame in text.split("\n\n") if frame.startswith("data: {")]


def test_return_progress_streams_prompt_progress_chunks(make_api):
    client, _, _ = make_api(temp=0)
    for path, body in (
        ("/completion", {"prompt": "hello there"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]}),
    ):
        events = sse_payloads(
            client.simulate_post(
                path, json={**body, "n_predict": 2, "stream": True, "return_progress": True}
            ).text
        )
        progress = [e for e in events if "prompt_progress" in e]
        assert len(progress) == 1, path
        shown = progress[0]["prompt_progress"]
        assert (
            set(shown) == {"total", "cache", "processed", "time_ms"}
            and shown["processed"] == shown["total"] > 0
        )
        if path == "/v1/chat/completions":
            assert progress[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
        else:
            assert progress[0]["content"] == "" and progress[0]["stop"] is False
        plain = sse_payloads(client.simulate_post(path, json={**body, "n_predict": 2, "stream": True}).text)
        assert not any("prompt_progress" in e for e in plain)
    unstreamed = client.simulate_post(
        "/completion", json={"prompt": "x", "n_predict": 1, "return_progress": True}
    )
    assert unstreamed.status_code == 200 and "prompt_progress" not in unstreamed.json
    assert_error(
        client.simulate_post("/completion", json={"prompt": "x", "return_progress": "yes"}),
        400,
        "invalid_request_error",
        "'return_progress' must be true or false",
    )


# --- verbose -> __verbose ------------------------------------------------------------------------------


def test_verbose_adds_the_native_answer_as___verbose(make_api):
    client, _, _ = make_api(temp=0)
    messages = [{"role": "user", "content": "hello"}]
    chat = client.simulate_post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 3, "verbose": True}
    ).json
    native = chat["__verbose"]
    assert native["content"] == chat["choices"][0]["message"]["content"] and native["tokens_predicted"] == 3
    assert (
        native["prompt"]
        == client.simulate_post("/apply-template", json={"messages": messages}).json["prompt"]
    )
    assert native["stop"] is True and "generation_settings" in native and "timings" in native
    text = client.simulate_post(
        "/v1/completions", json={"prompt": "hello", "max_tokens": 2, "verbose": True}
    ).json
    assert (
        text["__verbose"]["prompt"] == "hello" and text["__verbose"]["content"] == text["choices"][0]["text"]
    )
    stream = sse_payloads(
        client.simulate_post(
            "/v1/chat/completions",
            json={"messages": messages, "max_tokens": 3, "verbose": True, "stream": True},
        ).text
    )
    final = next(e for e in stream if e["choices"] and e["choices"][0]["finish_reason"])
    assert final["__verbose"]["content"] == native["content"]
    assert (
        "__verbose"
        not in client.simulate_post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json
    )
    assert (
        "__verbose"
        not in client.simulate_post("/completion", json={"prompt": "x", "n_predict": 1, "verbose": True}).json
    )


def test_ignore_eos_bans_every_end_of_generation_token_and_lists_it(make_api):
    """llama-server's ignore_eos: each end-of-generation token in logit_bias with a null bias (its -inf), after
    the request's own pairs; without ignore_eos only the request's."""
    client, _, _ = make_api(temp=0)
    body = {"prompt": "hello", "n_predict": 2, "logit_bias": [[5, 1.5]]}
    own = client.simulate_post("/completion", json=body).json["generation_settings"]["logit_bias"]
    assert own == [{"bias": 1.5, "token": 5}]
    ignoring = client.simulate_post("/completion", json={**body, "ignore_eos": True}).json
    assert ignoring["generation_settings"]["logit_bias"] == [
        {"bias": 1.5, "token": 5},
        {"bias": None, "token": 2},  # the fake engine's one end-of-generation token
    ]


def test_return_progress_cadence_is_llama_server_s_batches():
    """The engine tells every prefill chunk; a stream reports llama-server's cadence: the event before the
    evaluation, then one per --batch-size batch and the last (b11549 with -b 16 on a 61-token prompt:
    processed 0, 16, 32, 48, 61; the same prompt again: 60, 61)."""
    from strata_server.generation import ProgressCadence

    def sent(cache: int, total: int, chunk: int, n_batch: int) -> list[int]:
        cadence = ProgressCadence(n_batch)
        told = [cache, *range(cache + chunk, total, chunk), total]  # as the engine tells them
        return [n for n in told if cadence.due({"total": total, "cache": cache, "processed": n})]

    assert sent(0, 61, 8, 16) == [0, 16, 32, 48, 61]  # chunks smaller than a batch
    assert sent(0, 61, 16, 16) == [0, 16, 32, 48, 61]
    assert sent(60, 61, 16, 16) == [60, 61]
    assert sent(0, 61, 12, 16) == [0, 24, 36, 48, 61]  # a chunk crossing a batch's end reports on it
    assert sent(0, 600, 512, 2048) == [0, 600]


def test_batch_flags_cap_the_engine_s_prefill_chunk(fake_model):
    assert "--prefill-chunk" not in load_config(["--model", str(fake_model)]).engine_argv()
    for flags, chunk in ((["-b", "16"], "16"), (["-ub", "64"], "64"), (["-b", "256", "-ub", "32"], "32")):
        config = load_config(["--model", str(fake_model), *flags])
        argv = config.engine_argv()
        assert argv[argv.index("--prefill-chunk") + 1] == chunk
    assert load_config(["--model", str(fake_model), "-b", "16"]).progress_batch() == 16
    assert load_config(["--model", str(fake_model)]).progress_batch() == 2048
    with pytest.raises(ConfigError) as info:
        load_config(["--model", str(fake_model), "-b", "0"])
    assert info.value.problems == ["batch_size: 0 must be at least 1 token"]
