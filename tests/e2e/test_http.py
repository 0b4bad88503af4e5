"""The real server end to end: endpoints with `requests` and the OpenAI SDK, refusals through HTTP
each followed by a turn showing the conversation intact, security rules, the engine SIGKILLed
mid-generation."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import openai
import psutil
import pytest
import requests

from .servers import other_model_copy, reference_tokenizations, start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

GREEDY = {"temperature": 0, "n_predict": 4}
PROMPT = "<|im_start|>user\nName three colors of the rainbow.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def slots(module_tmp):
    path = module_tmp / "slots"
    path.mkdir()
    return path


@pytest.fixture(scope="module")
def server(module_tmp, slots):
    proc = start_server(
        module_tmp, "--slot-save-path", str(slots), "--metrics", "--api-key", "e2e-key", "--alias", "smollm2"
    )
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def http(server):
    session = requests.Session()
    session.headers["Authorization"] = "Bearer e2e-key"
    session.base = server.url
    return session


def post(http, path: str, body: dict, **kwargs) -> requests.Response:
    return http.post(http.base + path, json=body, timeout=300, **kwargs)


def slot(http, action: str, filename: str, **kwargs) -> requests.Response:
    return post(http, f"/slots/0?action={action}", {"filename": filename}, **kwargs)


def conversation_intact(http, held: int) -> None:
    """The same prompt again reuses everything but its last token: nothing was wiped."""
    body = post(http, "/completion", {"prompt": PROMPT, "temperature": 0, "n_predict": 1}).json()
    assert body["timings"]["cache_n"] == held, body["timings"]


def test_health_props_models(http, server, smollm2_path):
    assert requests.get(server.url + "/health", timeout=10).json() == {"status": "ok"}  # public
    assert requests.get(server.url + "/props", timeout=10).status_code == 401
    props = http.get(server.url + "/props", timeout=10).json()
    assert props["model_path"] == str(smollm2_path) and props["total_slots"] == 1
    assert props["default_generation_settings"]["n_ctx"] == 2048
    assert "<|im_start|>" in props["chat_template"] or props["chat_template"]
    models = http.get(server.url + "/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == "smollm2" and models["data"][0]["meta"]["n_vocab"] == 49152


def test_tokenize_matches_reference(http):
    for text, expected in reference_tokenizations()[:6]:
        got = post(http, "/tokenize", {"content": text, "add_special": True}).json()["tokens"]
        assert got == expected, text
        assert post(http, "/detokenize", {"tokens": got}).json()["content"].endswith(text[-3:])


def test_completion_stream_equals_plain_and_prompt_cache(http):
    plain = post(http, "/completion", {"prompt": PROMPT, **GREEDY, "cache_prompt": False}).json()
    assert plain["tokens_predicted"] > 0 and plain["timings"]["prompt_n"] == plain["tokens_evaluated"]
    again = post(http, "/completion", {"prompt": PROMPT, **GREEDY}).json()
    assert again["timings"]["cache_n"] == plain["tokens_evaluated"] - 1 and again["timings"]["prompt_n"] == 1
    assert again["content"] == plain["content"]
    with post(http, "/completion", {"prompt": PROMPT, **GREEDY, "stream": True}, stream=True) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        raw = response.content.decode()
    frames = [f for f in raw.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames) and "[DONE]" not in raw
    events = [json.loads(f[6:]) for f in frames]
    assert "".join(e["content"] for e in events[:-1]) == plain["content"]
    assert events[-1]["stop"] is True and events[-1]["timings"]["cache_n"] == plain["tokens_evaluated"] - 1


def test_openai_sdk_chat(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="e2e-key", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": "Say hello."}]
    # Both evaluate the prompt afresh: from the prompt cache the last prompt token is evaluated alone, whose logits
    # differ in round-off from a chunk's last row and may flip a near tie (llama-server's cache_prompt says the same).
    fresh = {"cache_prompt": False}
    reply = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=8, temperature=0, extra_body=fresh
    )
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens > 0
    assert reply.usage.prompt_tokens > 5
    stream = client.chat.completions.create(
        model="smollm2",
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=fresh,
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert (
        chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    )
    with_logprobs = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    entries = with_logprobs.choices[0].logprobs.content
    assert len(entries) == with_logprobs.usage.completion_tokens and len(entries[0].top_logprobs) == 2
    assert entries[0].logprob == entries[0].top_logprobs[0].logprob  # greedy: the chosen token is the top one
    completion = client.completions.create(model="smollm2", prompt="The sky is", max_tokens=4, temperature=0)
    assert completion.choices[0].text and completion.usage.completion_tokens == 4
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_errors(http, server):
    bad = http.post(
        server.url + "/completion", data="{oops", headers={"Content-Type": "application/json"}, timeout=30
    )
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    missing = http.get(server.url + "/nope", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "File Not Found"
    too_long = post(http, "/completion", {"prompt": "hello " * 3000, "n_predict": 1})
    error = too_long.json()["error"]
    assert too_long.status_code == 400 and error["type"] == "exceed_context_size_error"
    assert error["n_ctx"] == 2048 and error["n_prompt_tokens"] > 2048


def test_host_origin_content_type(http, server):
    evil = http.get(server.url + "/props", headers={"Host": "evil.example:8080"}, timeout=30)
    assert evil.status_code == 403 and evil.json()["error"]["type"] == "permission_error"
    rebinding = requests.get(server.url + "/health", headers={"Host": "attacker.example"}, timeout=30)
    assert rebinding.status_code == 403
    foreign = slot(http, "save", "x.bin", headers={"Origin": "http://evil.example"})
    assert foreign.status_code == 403
    form = http.post(
        server.url + "/slots/0?action=save",
        data=json.dumps({"filename": "x.bin"}),
        headers={"Content-Type": "text/plain"},
        timeout=30,
    )
    assert form.status_code == 415


def test_refusals_keep_the_conversation(http, slots, smollm2_path, module_tmp):
    first = post(http, "/completion", {"prompt": PROMPT, **GREEDY}).json()
    held = first["tokens_evaluated"] - 1
    saved = slot(http, "save", "good.bin")
    assert saved.status_code == 200, saved.text
    assert saved.json()["n_written"] == os.path.getsize(slots / "good.bin")
    post(http, "/completion", {"prompt": PROMPT, **GREEDY})

    outside = module_tmp / "outside.bin"
    outside.write_bytes((slots / "good.bin").read_bytes())
    (slots / "link.bin").symlink_to(outside)
    data = bytearray((slots / "good.bin").read_bytes())
    data[len(data) // 2] ^= 0x40
    (slots / "corrupt.bin").write_bytes(bytes(data))
    (slots / "truncated.bin").write_bytes(bytes(data[: len(data) // 3]))
    (slots / "other-model.bin").write_bytes(_file_from_other_model(smollm2_path, module_tmp))

    cases = [
        ("../good.bin", "Invalid filename"),
        (str(slots / "good.bin"), "Invalid filename"),
        ("a/b.bin", "Invalid filename"),
        ("bad\x01name", "Invalid filename"),
        ("link.bin", "symbolic link"),
        ("missing.bin", "'missing.bin'"),
        ("corrupt.bin", "corrupt"),
        ("truncated.bin", "trunc"),
        ("other-model.bin", "model_mismatch"),
    ]
    for filename, needle in cases:
        response = slot(http, "restore", filename)
        assert response.status_code == 400, (filename, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and needle in error["message"] + str(
            error.get("reason")
        ), (filename, error)
        conversation_intact(http, held)
    for filename in ("../escape.bin", "/tmp/abs.bin", "link.bin"):
        assert slot(http, "save", filename).status_code == 400
    assert outside.read_bytes() == (slots / "good.bin").read_bytes()
    metrics = http.get(http.base + "/metrics", timeout=30).text
    assert 'strata:slot_restore_refusals_total{reason="model_mismatch"} 1' in metrics


def _file_from_other_model(smollm2_path, folder) -> bytes:
    """Save a short conversation with an engine running a copy of SmolLM2 whose fingerprint differs."""
    from strata_server.engine.supervisor import EngineSupervisor

    model = other_model_copy(smollm2_path, folder)
    supervisor = EngineSupervisor(
        [sys.executable, "-m", "strata_engine.cli", "serve", "--model", str(model), "--ctx-size", "2048"]
    )
    supervisor.start()
    try:
        assert supervisor.wait_ready(180).info["model_path"] == str(model)
        with supervisor.acquire() as lease:
            lease.call("COMPLETE", {"prompt": PROMPT, "n_predict": 2, "temperature": 0})
            lease.call("SAVE", {"path": str(folder / "other.bin")})
    finally:
        supervisor.stop()
    return (folder / "other.bin").read_bytes()


def _engine_pid(server) -> int:
    master = psutil.Process(server.proc.pid)
    engines = [p for p in master.children(recursive=True) if "strata_engine" in " ".join(p.cmdline())]
    assert len(engines) == 1, engines
    return engines[0].pid


def _wait_healthy(server) -> None:
    deadline = time.monotonic() + 180
    while requests.get(server.url + "/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "engine not back"
        time.sleep(0.1)


def test_engine_sigkill_mid_generation(http, server):
    restarts_before = http.get(server.url + "/props", timeout=30).json()["strata"]["engine_restarts"]
    with post(
        http,
        "/completion",
        {"prompt": PROMPT, "n_predict": 400, "ignore_eos": True, "stream": True},
        stream=True,
    ) as response:
        assert response.status_code == 200
        lines = (line for line in response.iter_lines() if line and line != b":")
        next(lines)
        os.kill(_engine_pid(server), signal.SIGKILL)
        tail = list(lines)
    error = json.loads(tail[-1][len(b"data: ") :])["error"]
    assert error["code"] == 500 and "restarted" in error["message"]
    _wait_healthy(server)
    # Non-streaming: the client gets a 500 error object.
    import threading

    def kill_soon():
        time.sleep(1.0)
        os.kill(_engine_pid(server), signal.SIGKILL)

    killer = threading.Thread(target=kill_soon)
    killer.start()
    response = post(http, "/completion", {"prompt": PROMPT, "n_predict": 2000, "ignore_eos": True})
    killer.join()
    assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"
    _wait_healthy(server)
    after = post(http, "/completion", {"prompt": PROMPT, **GREEDY})
    assert after.status_code == 200 and after.json()["tokens_predicted"] > 0
    assert (
        http.get(server.url + "/props", timeout=30).json()["strata"]["engine_restarts"] == restarts_before + 2
    )


def test_longest_valid_filename_saves(http, slots):
    name = "x" * 255  # the peer's limit: fs_validate_filename accepts it
    response = slot(http, "save", name)
    assert response.status_code == 200, response.text
    assert (slots / name).is_file()


def test_slots_erase_template_options(http, server):
    post(http, "/completion", {"prompt": PROMPT, "temperature": 0, "n_predict": 1})
    slots = http.get(server.url + "/slots", timeout=30).json()
    assert slots[0]["id"] == 0 and slots[0]["n_ctx"] == 2048 and slots[0]["is_processing"] is False
    assert slots[0]["n_prompt_tokens"] > 0 and isinstance(slots[0]["next_token"], list)
    held = slots[0]["n_prompt_tokens"]  # prompt + 1 generated - 1
    erased = post(http, "/slots/0?action=erase", {})
    assert erased.json() == {"id_slot": 0, "n_erased": held}
    again = post(http, "/completion", {"prompt": PROMPT, "temperature": 0, "n_predict": 1}).json()
    assert again["timings"]["cache_n"] == 0
    rendered = post(http, "/apply-template", {"messages": [{"role": "user", "content": "Hi"}]}).json()[
        "prompt"
    ]
    assert rendered.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nHi<|im_end|>" in rendered
    preflight = requests.options(
        server.url + "/v1/chat/completions",
        timeout=30,
        headers={"Origin": "http://site.example", "Access-Control-Request-Method": "POST"},
    )
    assert preflight.status_code == 200 and preflight.headers["Access-Control-Allow-Origin"] == "*"
    assert "Access-Control-Allow-Credentials" not in preflight.headers
    bad_slot = post(http, "/slots/1?action=erase", {})
    assert bad_slot.status_code == 400 and "one slot" in bad_slot.json()["error"]["message"]


def test_a_prompt_sure_not_to_fit_is_refused_without_waiting_for_the_busy_slot(http):
    """The one slot generating, a prompt whose bytes alone exceed the context: refused at once (before it
    waits for the slot, which is still busy when the refusal arrives), its count a lower bound said so."""
    busy = {"prompt": PROMPT, "n_predict": 96, "ignore_eos": True, "temperature": 0, "stream": True}
    with http.post(http.base + "/completion", json=busy, stream=True, timeout=300) as stream:
        lines = (line for line in stream.iter_lines() if line)
        assert json.loads(next(lines)[len(b"data: ") :])["stop"] is False  # a token: the slot is busy
        huge = post(http, "/completion", {"prompt": "word " * 100_000, "n_predict": 1})
        still_busy = http.get(http.base + "/slots", timeout=60).json()[0]["is_processing"]
        final = json.loads(list(lines)[-1][len(b"data: ") :])
    assert huge.status_code == 400, huge.text
    error = huge.json()["error"]
    assert error["type"] == "exceed_context_size_error" and error["n_ctx"] == 2048
    assert error["message"] == (
        f"request (at least {error['n_prompt_tokens']} tokens) exceeds the available context size "
        "(2048 tokens), try increasing it"
    )
    assert error["n_prompt_tokens"] > 2048
    assert still_busy and final["stop"] and final["tokens_predicted"] == 96
