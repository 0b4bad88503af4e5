"""strata-server (the real engine, gunicorn, SmolLM2) restores the file llama-server wrote in a shared
--slot-save-path with the request a llama-server client sends, `POST /slots/0?action=restore`: every token
reused, the greedy reply the same as strata-server's own cold one; a damaged or foreign slot file is
refused by name and the conversation held is kept.
"""

from __future__ import annotations

import pytest
import requests
from strata_sessionfile import llamacpp as L
from support.server_process import ServerProcess

from .llama_server import FLASH_ATTN, LlamaServer

PROMPT = "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n"
N_REPLY = 8


@pytest.fixture(scope="module")
def strata(smollm2_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("shared-slots")
    server = ServerProcess(
        "-m",
        str(smollm2_path),
        "-c",
        "2048",
        "--slot-save-path",
        str(folder),
        log_path=folder.parent / "strata.log",
    ).start(wait_healthy=600)
    server.folder = folder  # type: ignore[attr-defined]
    yield server
    server.stop()


def complete(url: str, tokens: list[int], *, cache_prompt: bool = True) -> dict:
    body = {
        "prompt": tokens,
        "n_predict": N_REPLY,
        "temperature": 0,
        "cache_prompt": cache_prompt,
        "return_tokens": True,
        "id_slot": 0,
    }
    return requests.post(url + "/completion", json=body, timeout=600).json()


@pytest.mark.parametrize("layout", ["v_trans", "v_rows"])
def test_strata_server_restores_llama_servers_slot_file(strata, smollm2_path, layout):
    llama = LlamaServer(smollm2_path, strata.folder, FLASH_ATTN[layout])
    prompt = llama.tokenize(PROMPT)
    llama.complete(prompt, N_REPLY)
    name = f"llama-{layout}.bin"
    n = llama.post("/slots/0?action=save", {"filename": name})["n_saved"]

    r = requests.post(strata.url + "/slots/0?action=restore", json={"filename": name}, timeout=600)
    assert r.status_code == 200, r.text
    assert r.json()["n_restored"] == n
    # the slot holds the prompt and llama-server's reply: its tokens come from the file
    slot_tokens = list(L.read_slot_file(strata.folder / name).tokens[:n])
    turn = slot_tokens + llama.tokenize("<|im_end|>\n<|im_start|>user\nAnd two more?")[1:]
    warm = complete(strata.url, turn)
    assert warm["timings"]["cache_n"] == n
    requests.post(strata.url + "/slots/0?action=erase", timeout=60)
    cold = complete(strata.url, turn, cache_prompt=False)  # neither the slot nor the session store
    assert cold["timings"]["cache_n"] == 0
    assert warm["tokens"] == cold["tokens"]

    # a damaged one, and one of another model's geometry: refused by name, the conversation kept
    data = (strata.folder / name).read_bytes()
    (strata.folder / "cut.bin").write_bytes(data[: len(data) // 3])
    r = requests.post(strata.url + "/slots/0?action=restore", json={"filename": "cut.bin"}, timeout=600)
    assert r.status_code == 400 and "slot_truncated" in r.text, r.text
    again = complete(strata.url, turn)
    assert again["timings"]["cache_n"] >= len(turn) - 1


@pytest.mark.parametrize("layout", ["v_trans", "v_rows"])
def test_strata_server_saves_for_llama_server(strata, smollm2_path, layout):
    """`?action=save` with `"format": "llama.cpp"`: llama-server restores the file and reuses every token."""
    llama = LlamaServer(smollm2_path, strata.folder, FLASH_ATTN[layout])
    prompt = llama.tokenize(PROMPT)
    complete(strata.url, prompt)
    name = f"for-llama-{layout}.bin"
    body = {"filename": name, "format": "llama.cpp", "v_trans": layout == "v_trans"}
    r = requests.post(strata.url + "/slots/0?action=save", json=body, timeout=600)
    assert r.status_code == 200, r.text
    n = r.json()["n_saved"]
    assert L.is_slot_file(strata.folder / name)

    restored = llama.post("/slots/0?action=restore", {"filename": name})
    assert restored.get("n_restored") == n, restored
    held = list(L.read_slot_file(strata.folder / name).tokens)
    turn = held + llama.tokenize("<|im_end|>\n<|im_start|>user\nAnd two more?")[1:]
    warm = llama.complete(turn, N_REPLY)
    assert warm["timings"]["cache_n"] == n
    bad = requests.post(strata.url + "/slots/0?action=save", json={**body, "format": "gguf"}, timeout=60)
    assert bad.status_code == 400 and "'format' must be one of" in bad.text


def test_strata_server_refuses_another_models_slot_file(strata, gemma3_path):
    """A slot file llama-server wrote with gemma3, restored into a SmolLM2 strata-server: refused by name
    (its geometry is not this model's), and the conversation slot 0 holds is kept."""
    llama = LlamaServer(gemma3_path, strata.folder, FLASH_ATTN["v_rows"])
    llama.complete(llama.tokenize("The sky is"), 2)
    assert llama.post("/slots/0?action=save", {"filename": "gemma3.bin"})["n_saved"] > 0

    held = complete(strata.url, list(range(100, 140)))
    turn = list(range(100, 140)) + held["tokens"]
    r = requests.post(strata.url + "/slots/0?action=restore", json={"filename": "gemma3.bin"}, timeout=600)
    assert r.status_code == 400 and "slot_geometry_mismatch" in r.text, r.text
    again = complete(strata.url, turn)
    assert again["timings"]["cache_n"] >= len(turn) - 1
