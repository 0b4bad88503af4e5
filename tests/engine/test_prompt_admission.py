"""A prompt that cannot fit the context is refused before it is tokenized: `Tokenizer.min_tokens` is a
lower bound on the token count from the prompt's length in bytes, checked on real text for both models;
the completion path refuses a 50 MB prompt in every form (string, chat messages, mixed list) with the
context-overflow error and keeps the held conversation; so does `strata-engine serve`, which then goes
on serving. Only the time is not asserted (bench/engine/bench_tokenizer.py measures it)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strata_engine.completion import Completer, parse_request
from strata_engine.errors import ContextOverflow
from support.data import load_reference, smollm2_model_path

from .runners import MODELS, base_runner, reference, sibling

REPO = Path(__file__).resolve().parents[2]
N_CTX = 256
HUGE = 50_000_000  # bytes: a prompt within the server's 64 MiB body limit


def _texts() -> list[str]:
    texts = list(load_reference("prompts.json")["tokenize"])
    for model in MODELS:
        texts += [case["text"] for case in reference("llamacpp", model)["tokenize"]]
    texts += [path.read_text(encoding="utf-8") for path in sorted((REPO / "spec").glob("*.md"))]
    # what the bound must not overestimate: the longest tokens, special tokens, bytes SmolLM2 drops
    texts += [
        " " * 80,
        "\n" + " " * 80,
        "\n" * 31,
        "<|im_start|>" * 9,
        "<start_of_turn>\u2581" * 5,
        "\x04" * 50,
    ]
    return texts


@pytest.mark.parametrize("model", MODELS)
def test_min_tokens_is_a_lower_bound_on_real_text(tokenizers, model):
    tok = tokenizers[model]
    # the bound covers every token's bytes, and no slack beyond the longest special or vocabulary text
    assert tok.max_token_bytes >= max(len(tok.token_bytes(i)) for i in range(tok.n_vocab))
    assert tok.max_token_bytes <= max(len(t.encode()) for t in tok.vocab.tokens)
    for text in _texts():
        for add_special in (False, True):
            assert tok.min_tokens(text, add_special=add_special) <= len(
                tok.encode(text, add_special=add_special)
            )
    assert tok.min_tokens("x" * 10 * tok.max_token_bytes) == 10


def test_dropped_bytes_do_not_count(tokenizers):
    smol = tokenizers["smollm2"]
    assert smol.encode("\x04" * 1000) == [] and smol.min_tokens("\x04" * 1000) == 0
    assert smol.min_tokens("\x04" * 1000 + "a") == 1


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200))
def test_min_tokens_is_a_lower_bound_on_any_text(tokenizers, text):
    for tok in tokenizers.values():
        assert tok.min_tokens(text, add_special=True) <= len(tok.encode(text, add_special=True))


@pytest.fixture(scope="module")
def completer(tokenizers, templates):
    runner = sibling(base_runner("smollm2"), n_ctx=N_CTX)
    return Completer(runner, tokenizers["smollm2"], templates["smollm2"])


@pytest.mark.parametrize(
    "form",
    [
        {"prompt": "a" * HUGE},
        {"prompt": "東京 " * (HUGE // 7)},
        {"messages": [{"role": "user", "content": "word " * (HUGE // 5)}]},
        {"prompt": [1, "Hello " * (HUGE // 6), 2]},
    ],
    ids=["ascii", "cjk", "chat", "mixed"],
)
def test_a_huge_prompt_is_refused_before_tokenizing(completer, form):
    completer.complete(
        parse_request({"prompt": "The capital of France is", "n_predict": 2, "temperature": 0})
    )
    held = list(completer.runner.tokens_held)
    with pytest.raises(ContextOverflow) as info:
        completer.complete(parse_request({**form, "n_predict": 1}))
    assert info.value.at_least and info.value.n_ctx == N_CTX
    assert info.value.n_prompt_tokens > N_CTX and "at least" in str(info.value)
    assert list(completer.runner.tokens_held) == held  # the held conversation is untouched


def test_a_prompt_within_the_bound_is_measured_by_its_tokens(completer):
    text = " x" * (N_CTX + 1)  # 2 bytes a token: passes the bound, then counted exactly
    assert completer.tokenizer.min_tokens(text) <= N_CTX
    with pytest.raises(ContextOverflow) as info:
        completer.complete(parse_request({"prompt": text}))
    assert not info.value.at_least
    assert info.value.n_prompt_tokens == len(completer.tokenizer.encode(text)) > N_CTX


def test_serve_refuses_a_50_mb_prompt_and_goes_on():
    request = json.dumps({"id": "c", "prompt": "The quick brown fox. " * (HUGE // 21), "n_predict": 1})
    lines = f'COMPLETE {request}\nSTATUS {{"id": "s"}}\nQUIT {{"id": "q"}}\n'.encode()
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "strata_engine.cli", "serve", "--model", str(smollm2_model_path()),
         "--ctx-size", str(N_CTX)],
        input=lines, capture_output=True, timeout=600, check=False,
    )  # fmt: skip
    print(
        f"serve: a {len(request) / 1e6:.0f} MB COMPLETE answered, with start-up, in {time.perf_counter() - start:.1f} s"
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    ready, *answers = (json.loads(line) for line in done.stdout.splitlines())
    by_id = {line["id"]: line for line in answers}
    refused, status, quit_ = by_id["c"], by_id["s"], by_id["q"]
    assert ready["event"] == "ready" and len(answers) == 3 and answers[-1] is quit_
    assert refused["event"] == "error" and refused["error"]["type"] == "exceed_context_size"
    assert refused["error"]["reason"] == "prompt_too_long" and "at least" in refused["error"]["message"]
    assert refused["error"]["n_prompt_tokens"] > N_CTX == refused["error"]["n_ctx"]
    assert status["event"] == "result" and status["slots"][0]["n_tokens_held"] == 0
    assert quit_["event"] == "result"
