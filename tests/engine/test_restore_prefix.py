"""What a session store needs from the engine (spec/engine-protocol.md): PROMPT_TOKENS, RESTORE_PREFIX
(cut to a prefix, refuse before the gate when too little would be kept, land in place when the held
conversation may be dropped), SAVE with "sync": false (the same file, no fsync) and the ready line's session
fingerprints, on `strata-engine serve` child
processes with the real models."""

from __future__ import annotations

import numpy as np
import pytest
import strata_sessionfile as sf
import xxhash
from strata_engine.client import EngineProcess
from support.data import gemma3_model_path, smollm2_model_path

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def random_tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1000, 20000, n)]


def digest(tokens: list[int]) -> str:
    return xxhash.xxh3_64_hexdigest(np.asarray(tokens, dtype="<i4").tobytes())


@pytest.fixture(params=[(), ("--kv-type", "int8", "--kv-resident", "256")], ids=["f16", "int8-resident"])
def smollm2(request):
    engine = EngineProcess(smollm2_model_path(), "--ctx-size", "1024", *request.param)
    yield engine
    engine.quit()


def test_prompt_tokens_are_what_complete_evaluates(smollm2):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    tokens = smollm2.result("PROMPT_TOKENS", {"messages": messages, "n_predict": 3})["tokens"]
    by_messages = smollm2.result("COMPLETE", {"messages": messages, "n_predict": 3, "temperature": 0})
    assert by_messages["tokens_evaluated"] == len(tokens)
    by_tokens = smollm2.complete(tokens, 3, ignore_eos=False)
    assert by_tokens["timings"]["cache_n"] == len(tokens) - 1  # the whole prompt was held: the same tokens
    # evaluated afresh, as the messages were (from the cache its last token is evaluated alone: it may flip a
    # near tie)
    afresh = smollm2.complete(tokens, 3, ignore_eos=False, cache_prompt=False)
    assert afresh["timings"]["cache_n"] == 0 and afresh["content"] == by_messages["content"]
    too_long = smollm2.command("PROMPT_TOKENS", {"prompt": random_tokens(1025, 1)})
    assert too_long["error"]["type"] == "exceed_context_size"
    bad = smollm2.command("PROMPT_TOKENS", {"prompt": "x", "n_predict": "many"})
    assert bad["error"]["reason"] == "bad_field" and "n_predict" in bad["error"]["message"]


def test_restore_prefix_cuts_refuses_and_lands_in_place(smollm2, tmp_path):
    prompt, other = random_tokens(600, 2), random_tokens(40, 3)
    smollm2.complete(prompt, 4)
    path = tmp_path / "chat.ssf"
    assert smollm2.result("SAVE", {"path": str(path)})["n_saved"] == 603
    header = sf.inspect(path, verify=False).header
    assert smollm2.ready["session_fingerprints"] == {
        "model": header.model_fingerprint.hex(),
        "config": header.config_fingerprint.hex(),
    }
    # The reference: the engine that held the conversation cuts it to 300 through its prompt cache.
    reference = smollm2.complete(prompt[:300] + other, 8)
    assert reference["timings"]["cache_n"] == 300

    restored = smollm2.result("RESTORE_PREFIX", {"path": str(path), "cut_to": 300, "discard_held": True})
    assert (restored["n_restored"], restored["n_kept"]) == (603, 300)
    assert restored["mode"] == "staged"
    status = smollm2.result("STATUS")["slots"][0]
    assert (status["n_tokens_held"], status["tokens_held_digest"]) == (300, digest(prompt[:300]))
    turn = smollm2.complete(prompt[:300] + other, 8)
    assert turn["timings"]["cache_n"] == 300 and turn["tokens"] == reference["tokens"]

    held = smollm2.result("STATUS")["slots"][0]["tokens_held_digest"]
    refused = smollm2.command(
        "RESTORE_PREFIX", {"path": str(path), "cut_to": 100, "min_keep": 200, "discard_held": True}
    )
    assert refused["error"]["type"] == "session_refused"
    assert (refused["error"]["reason"], refused["error"]["resume_point"]) == ("prefix_unreachable", 100)
    assert smollm2.result("STATUS")["slots"][0]["tokens_held_digest"] == held  # refused before the gate: kept

    whole = smollm2.result("RESTORE_PREFIX", {"path": str(path)})  # no cut, the held conversation staged
    assert (whole["n_restored"], whole["n_kept"]) == (603, 603)

    corrupt = tmp_path / "corrupt.ssf"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    corrupt.write_bytes(bytes(data))
    refused = smollm2.command("RESTORE_PREFIX", {"path": str(corrupt), "discard_held": True})
    assert (refused["error"]["type"], refused["error"]["reason"]) == ("session_refused", "payload_corrupt")
    assert (
        smollm2.result("STATUS")["slots"][0]["n_tokens_held"] == 0
    )  # refused during the in-place read: nothing held
    after = smollm2.complete(prompt[:300] + other, 8)
    cold = smollm2.complete(prompt[:300] + other, 8, cache_prompt=False)  # erased first: nothing left behind
    assert after["timings"]["cache_n"] == 0 and after["tokens"] == cold["tokens"]

    for bad in (
        {"path": str(path), "cut_to": -1},
        {"path": ""},
        {"path": str(path), "discard_held": 1},
        {"path": str(path), "min_keep": "2"},
    ):
        error = smollm2.command("RESTORE_PREFIX", bad)["error"]
        assert (error["type"], error["reason"]) == ("invalid_request", "bad_field"), bad


def test_save_unsynced_writes_the_file_save_writes(smollm2, tmp_path):
    prompt = random_tokens(300, 4)
    smollm2.complete(prompt, 3)
    held = smollm2.result("STATUS")["slots"][0]["tokens_held_digest"]
    synced, unsynced = tmp_path / "synced.ssf", tmp_path / "unsynced.ssf.pending"
    assert smollm2.result("SAVE", {"path": str(synced)})["n_saved"] == 302
    answer = smollm2.result("SAVE", {"path": str(unsynced), "sync": False})
    assert (answer["n_saved"], answer["n_written"]) == (302, unsynced.stat().st_size)
    assert (
        unsynced.read_bytes() == synced.read_bytes()
    )  # complete once it appears: renamed from its temporary
    assert sorted(p.name for p in tmp_path.iterdir()) == ["synced.ssf", "unsynced.ssf.pending"]
    assert sf.inspect(unsynced).payload_verified
    failed = smollm2.command("SAVE", {"path": str(tmp_path / "no-such-folder" / "x.ssf"), "sync": False})
    assert failed["error"]["type"] == "session_write_failed"
    bad = smollm2.command("SAVE", {"path": str(synced), "sync": "no"})["error"]
    assert (bad["type"], bad["reason"]) == ("invalid_request", "bad_field")
    smollm2.complete(random_tokens(50, 5), 2)
    restored = smollm2.result("RESTORE_PREFIX", {"path": str(unsynced), "discard_held": True})
    assert restored["n_kept"] == 302
    assert smollm2.result("STATUS")["slots"][0]["tokens_held_digest"] == held


def test_restore_prefix_with_sliding_windows_keeps_a_resume_point_or_refuses(tmp_path):
    """gemma3 (512-token windows): a file of 703 tokens whose rings hold the last window can be cut to
    702 or 703, to its checkpoint (700, the end of its prompt), or nowhere else."""
    engine = EngineProcess(gemma3_model_path(), "--ctx-size", "1024")
    try:
        prompt, other = random_tokens(700, 4), random_tokens(20, 5)
        engine.complete(prompt, 4)
        path = tmp_path / "gemma.ssf"
        assert engine.result("SAVE", {"path": str(path)})["n_saved"] == 703
        reference = engine.complete(prompt + other, 6)  # leaves the reply at 700: resumes at the checkpoint
        assert reference["timings"]["cache_n"] == 700
        refused = engine.command("RESTORE_PREFIX", {"path": str(path), "cut_to": 650, "min_keep": 1})
        assert (refused["error"]["reason"], refused["error"]["resume_point"]) == ("prefix_unreachable", 0)
        assert engine.result("RESTORE_PREFIX", {"path": str(path), "cut_to": 702})["n_kept"] == 702
        cut = engine.result("RESTORE_PREFIX", {"path": str(path), "cut_to": 701, "discard_held": True})
        assert cut["n_kept"] == 700
        turn = engine.complete(prompt + other, 6)
        assert turn["timings"]["cache_n"] == 700 and turn["tokens"] == reference["tokens"]
    finally:
        engine.quit()
