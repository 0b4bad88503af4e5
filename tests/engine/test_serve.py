"""The serve protocol end to end: `strata-engine serve` in a child process on the real SmolLM2 model."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from strata_engine.client import EngineProcess
from support.data import gemma3_model_path, load_reference, smollm2_model_path

N_CTX = 256
TIMEOUT_S = 180  # a cap for a loaded CI machine; a healthy run takes seconds


def engine_process(*args: str, model=None) -> EngineProcess:
    return EngineProcess(model or smollm2_model_path(), *args, timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def engine():
    process = engine_process("--ctx-size", str(N_CTX))
    yield process
    process.close()


def test_ready_line(engine):
    ready = engine.ready
    assert ready["event"] == "ready" and ready["protocol"] == 2 and ready["engine"] == "strata-engine"
    assert (ready["architecture"], ready["n_ctx"], ready["n_ctx_train"]) == ("llama", N_CTX, 8192)
    assert (ready["n_slots"], ready["n_ctx_slot"]) == (1, N_CTX)
    assert (ready["n_vocab"], ready["n_layer"], ready["n_embd"], ready["n_params"]) == (
        49152,
        30,
        576,
        134515008,
    )
    assert (ready["bos_token"], ready["eos_token"], ready["add_bos"]) == ("<|im_start|>", "<|im_end|>", False)
    assert ready["kv_type"] == "f16" and ready["backend"] == "numpy" and ready["prompt_cache"] is True
    assert ready["cpu_kernels"] == "numba-q8" and ready["threads"] == len(os.sched_getaffinity(0))
    assert "<|im_start|>" in ready["chat_template"]


def test_complete_greedy_matches_the_references(engine):
    case = load_reference("llamacpp-smollm2-135m.json")["complete"][0]
    n = 8
    lines = engine.all_lines(
        "COMPLETE", {"prompt": case["prompt"], "n_predict": n, "temperature": 0, "n_probs": 2}
    )
    tokens, result = lines[:-1], lines[-1]
    assert [t["event"] for t in tokens] == ["token"] * n and result["event"] == "result"
    ids = [t["token"] for t in tokens]
    assert ids == result["tokens"]
    # the default kernels (q8 products) are llama.cpp's math: its tokens up to the first step where its top-1
    # margin is 0.5 or less (transformers' float32 tokens are test_numerics', with the float32 products)
    for step, top5 in enumerate(case["top5"][:n]):
        if top5[0][1] - top5[1][1] <= 0.5:
            break
        assert ids[step] == case["tokens"][step]
    assert "".join(t["content"] for t in tokens) == result["content"]
    assert all(t["probs"][0]["id"] == t["token"] and len(t["probs"]) == 2 and "id" not in t for t in tokens)
    assert result["stop_type"] == "limit" and result["tokens_evaluated"] == len(case["prompt_tokens"])
    assert result["n_tokens_held"] == len(case["prompt_tokens"]) + n - 1 == result["tokens_cached"]
    timings = result["timings"]
    assert timings["prompt_n"] == len(case["prompt_tokens"]) and timings["predicted_n"] == n
    assert timings["prompt_ms"] > 0 and timings["predicted_per_second"] > 0

    status = engine.all_lines("STATUS")[-1]
    assert status["event"] == "result" and status["slots"][0]["n_tokens_held"] == result["n_tokens_held"]
    assert status["is_processing"] is False and len(status["slots"][0]["tokens_held_digest"]) == 16
    assert (status["n_slots"], status["n_ctx_slot"], status["slots"][0]["slot"]) == (1, N_CTX, 0)

    # the next turn reuses the held prefix
    again = engine.all_lines(
        "COMPLETE", {"prompt": case["prompt"] + result["content"], "n_predict": 1, "temperature": 0}
    )
    assert again[-1]["timings"]["cache_n"] >= len(case["prompt_tokens"])


def test_chat_messages_and_stop(engine):
    lines = engine.all_lines("COMPLETE", {
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "n_predict": 12, "temperature": 0, "stop": ["Paris"],
    })  # fmt: skip
    result = lines[-1]
    assert result["stop_type"] in ("word", "limit", "eos")
    assert "Paris" not in result["content"]
    if result["stop_type"] == "word":
        assert result["stopping_word"] == "Paris"


def test_tokenize_detokenize_template(engine):
    text = "<|im_start|>user\nhi<|im_end|>"
    assert engine.all_lines("TOKENIZE", {"content": text})[-1]["tokens"] == [1, 4093, 198, 6004, 2]
    unparsed = engine.all_lines("TOKENIZE", {"content": text, "parse_special": False})[-1]["tokens"]
    assert 1 not in unparsed
    pieces = engine.all_lines("TOKENIZE", {"content": "Hi 🚀", "with_pieces": True})[-1]["tokens"]
    assert "".join(
        p["piece"] if isinstance(p["piece"], str) else bytes(p["piece"]).decode("latin-1") for p in pieces
    )
    assert engine.all_lines("DETOKENIZE", {"tokens": [1, 4093, 198, 6004, 2]})[-1]["content"] == text
    prompt = engine.all_lines("APPLY_TEMPLATE", {"messages": [{"role": "user", "content": "hi"}]})[-1]
    assert prompt["prompt"].endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(
    ("line", "fragment", "reason"),
    [
        (b"BOGUS", "unknown verb", "unknown_verb"),
        (b"status", "unknown verb", "unknown_verb"),
        (b"", "empty line", "bad_line"),
        (b"STATUS now", "bad JSON", "bad_json"),
        (b'STATUS {"id": 5}', "id must be", "bad_field"),
        (b'ERASE {"slot": 1}', "slot must be", "bad_field"),
        (b"CANCEL {}", "needs the id", "bad_field"),
        (b"COMPLETE", "needs an argument", "bad_argument"),
        (b"COMPLETE {not json", "bad JSON", "bad_json"),
        (b"COMPLETE [1]", "JSON object", "bad_argument"),
        (b'COMPLETE {"prompt": "x", "top_p": null, "min_p": "low", "n_predict": -7}', "min_p", "bad_field"),
        (b'COMPLETE {"messages": [{"role": "user", "content": 3}]}', "content", "chat_template"),
        (b'TOKENIZE {"content": 5}', "content", "bad_field"),
        (b'DETOKENIZE {"tokens": [99999999]}', "outside the vocabulary", "bad_token"),
        (b"TOKENIZE \xff\xfe", "not UTF-8", "bad_line"),
        (b"RESTORE", "needs an argument", "bad_argument"),  # SAVE / RESTORE are real verbs now
    ],
)
def test_malformed_lines_get_an_error_and_the_engine_keeps_serving(engine, line, fragment, reason):
    answer = engine.all_lines(line)
    assert len(answer) == 1 and answer[0]["event"] == "error"
    error = answer[0]["error"]
    assert error["type"] == "invalid_request" and fragment in error["message"] and error["reason"] == reason
    if fragment == "min_p":
        assert "n_predict" in error["message"]  # every bad field at once
    assert engine.all_lines("STATUS")[-1]["event"] == "result"


def test_prompt_too_long(engine):
    answer = engine.all_lines("COMPLETE", {"prompt": list(range(100, 100 + N_CTX + 1))})[-1]
    assert answer["event"] == "error" and answer["error"]["type"] == "exceed_context_size"
    assert answer["error"]["n_prompt_tokens"] == N_CTX + 1 and answer["error"]["n_ctx"] == N_CTX


def test_cancel_mid_generation_then_erase(engine):
    engine.send('CANCEL {"id": "nothing"}')  # not in flight: ignored, no answer
    assert engine.all_lines("STATUS")[-1]["event"] == "result"
    engine.send("COMPLETE", {"id": "c", "prompt": "Once upon a time", "n_predict": 100, "temperature": 0})
    first = engine.next_line()
    assert first["event"] == "token" and first["id"] == "c"
    engine.send('CANCEL {"id": "c"}')
    rest = engine.until_terminal()
    result = rest[-1]
    assert result["event"] == "result" and result["stop_type"] == "cancelled"
    assert len(result["tokens"]) < 100 and len(result["tokens"]) == 1 + len(rest) - 1
    held = engine.all_lines("STATUS")[-1]["slots"][0]["n_tokens_held"]
    assert held == result["n_tokens_held"]
    assert engine.all_lines("ERASE")[-1]["n_erased"] == held
    assert engine.all_lines("STATUS")[-1]["slots"][0]["n_tokens_held"] == 0


def test_cancel_while_the_prompt_is_read_keeps_what_was_read():
    process = engine_process("--ctx-size", "2048", "--prefill-chunk", "16")
    try:
        assert process.ready["event"] == "ready"
        prompt = " ".join(f"word{i}" for i in range(100))  # ~250 tokens: a dozen chunks and more
        process.send(
            "COMPLETE",
            {"id": "p", "prompt": prompt, "n_predict": 8, "temperature": 0, "return_progress": True},
        )
        assert process.next_line()["event"] == "progress"  # the prompt is being read
        process.send('CANCEL {"id": "p"}')
        result = process.until_terminal()[-1]
        assert result["event"] == "result" and result["stop_type"] == "cancelled"
        assert result["tokens"] == [] and result["content"] == ""
        read = result["timings"]["prompt_n"]
        assert 16 <= read < result["tokens_evaluated"] and read % 16 == 0
        assert result["n_tokens_held"] == read
        # the next request for the same prompt starts where the cancelled one stopped
        process.send(
            "COMPLETE", {"prompt": prompt, "n_predict": 1, "temperature": 0, "return_progress": True}
        )  # a line per chunk: a loaded machine is slow
        again = process.until_terminal()[-1]
        assert again["stop_type"] == "limit" and again["timings"]["cache_n"] == read
    finally:
        process.close()


def test_quit_exits_zero():
    process = engine_process("--ctx-size", "64")
    try:
        assert process.ready["event"] == "ready"
        # a command sent while a COMPLETE runs is answered between its steps; QUIT waits for it to end
        process.send(
            "COMPLETE "
            + json.dumps({"id": "c", "prompt": "Hi", "n_predict": 2, "temperature": 0})
            + '\nSTATUS {"id": "s"}\nQUIT {"id": "q"}'
        )
        terminals = {}
        while "q" not in terminals:
            line = process.next_line()
            if line["event"] == "result":
                terminals[line["id"]] = line
        assert terminals["c"]["stop_type"] == "limit" and terminals["s"]["slots"][0]["request_id"] in (
            "c",
            None,
        )
        assert terminals["q"] == {"event": "result", "id": "q"}
        assert process.proc.wait(timeout=30) == 0
        assert process.lines.get(timeout=10) is None  # nothing after the QUIT result
    finally:
        process.close()


def test_end_of_input_completes_then_exits_zero():
    request = json.dumps({"prompt": "Hi", "n_predict": 2, "temperature": 0})
    done = subprocess.run(
        [sys.executable, "-m", "strata_engine.cli", "serve", "--model", str(smollm2_model_path()), "-c", "64"],
        input=f"COMPLETE {request}\n".encode(), capture_output=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["event"] for line in lines] == ["ready", "token", "token", "result"]


def test_line_reader_lines_polling_and_overlong_lines():
    import os

    from strata_engine.protocol import CommandRegistry, LineReader, OverlongLine, parse_line

    read_fd, write_fd = os.pipe()
    try:
        reader = LineReader(read_fd, max_line_bytes=16)
        assert reader.poll_line() is None  # nothing arrived: no blocking
        os.write(write_fd, b"STATUS\r\nERA")
        assert reader.poll_line() == b"STATUS\r" and reader.poll_line() is None
        os.write(write_fd, b"SE\n" + b"x" * 40 + b"\n")
        assert reader.read_line() == b"ERASE"
        overlong = reader.read_line()
        assert isinstance(overlong, OverlongLine)
        assert "longer than" in str(parse_line(overlong, CommandRegistry()).error)
        os.write(write_fd, b"y" * 20)  # overlong before its newline has arrived
        assert isinstance(reader.read_line(), OverlongLine)
        os.write(write_fd, b"yyy\nSTATUS\n")
        assert reader.read_line() == b"STATUS"
        os.write(write_fd, b"QUIT")
        os.close(write_fd)
        assert reader.read_line() == b"QUIT"  # a last line without its newline
        assert reader.read_line() is None and reader.eof
    finally:
        os.close(read_fd)


def test_line_writer_held_lines_go_out_together_at_the_end():
    import select

    from strata_engine.protocol import LineWriter, Request

    read_fd, write_fd = os.pipe()
    with open(write_fd, "wb") as stream, open(read_fd, "rb", buffering=0) as pipe:
        writer = LineWriter(stream)
        requests = [Request("COMPLETE", id=f"r{i}", slot=i, writer=writer) for i in range(3)]

        def readable() -> bool:
            return bool(select.select([pipe], [], [], 0)[0])

        with writer.held():
            for i, request in enumerate(requests):
                request.emit({"event": "token", "token": i, "piece": "é", "content": "é"})
            assert not readable()  # nothing written before the end
        lines = pipe.read(1 << 16).splitlines()
        assert [json.loads(line) for line in lines] == [
            {"event": "token", "id": f"r{i}", "token": i, "piece": "é", "content": "é"} for i in range(3)
        ]
        requests[0].answer({"n": 1})  # outside held(): written at once
        assert readable() and json.loads(pipe.read(1 << 16)) == {
            "event": "result",
            "id": "r0",
            "slot": 0,
            "n": 1,
        }


@pytest.mark.slow
def test_gemma3_serves_with_its_builtin_turns():
    process = engine_process("--ctx-size", "64", model=gemma3_model_path())
    try:
        ready = process.ready
        assert (ready["architecture"], ready["n_vocab"], ready["add_bos"]) == ("gemma3", 262144, True)
        assert (ready["bos_token"], ready["eos_token"], ready["chat_template_origin"]) == (
            "<bos>",
            "<eos>",
            "builtin:gemma3",
        )
        prompt = process.all_lines("APPLY_TEMPLATE", {"messages": [{"role": "user", "content": "hi"}]})
        assert prompt[-1]["prompt"] == "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
        case = load_reference("transformers-gemma3-270m.json")["complete"][0]
        lines = process.all_lines("COMPLETE", {"prompt": case["prompt"], "n_predict": 3, "temperature": 0})
        assert lines[-1]["tokens"] == case["tokens"][:3] and lines[-1]["tokens_evaluated"] == len(
            case["prompt_tokens"]
        )
        assert process.all_lines("QUIT")[-1] == {"event": "result"} and process.proc.wait(timeout=30) == 0
    finally:
        process.close()


def test_two_slots_stream_at_once_and_each_gets_its_tokens_alone():
    process = engine_process("--ctx-size", "512", "--parallel", "2", "--prefill-chunk", "16")
    try:
        ready = process.ready
        assert (ready["protocol"], ready["n_slots"], ready["n_ctx_slot"], ready["n_ctx"]) == (2, 2, 256, 512)
        requests = {
            rid: {
                "id": rid,
                "slot": slot,
                "prompt": prompt,
                "n_predict": 6,
                "temperature": 0,
                "ignore_eos": True,
            }
            for slot, (rid, prompt) in enumerate((("a", "Once upon a time"), ("b", "The capital of France")))
        }
        alone = {
            rid: process.all_lines("COMPLETE", {**r, "slot": 0, "cache_prompt": False})[-1]["tokens"]
            for rid, r in requests.items()
        }
        for request in requests.values():
            process.send("COMPLETE", (request))
        lines: list[dict] = []
        while sum(line["event"] == "result" for line in lines) < 2:
            lines.append(process.next_line())
        for rid in requests:
            mine = [line for line in lines if line["id"] == rid]
            assert [line["token"] for line in mine[:-1]] == mine[-1]["tokens"] == alone[rid]
            assert mine[-1]["slot"] == requests[rid]["slot"]
        order = [line["id"] for line in lines if line["event"] == "token"]
        assert (
            sum(x != y for x, y in zip(order, order[1:], strict=False)) > 1
        )  # interleaved, not one after the other
    finally:
        process.close()
