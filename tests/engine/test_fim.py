"""Fill-in-the-middle tokens from the GGUF metadata (llama.cpp's keys) or, where none is named, the
vocabulary's texts (llama.cpp's list): what the ready line reports and /infill needs."""

from __future__ import annotations

from strata_engine.protocol import FimToken
from strata_engine.tokenizer import Tokenizer
from strata_engine.tokenizer.vocab import TokenType


def test_the_real_models_have_no_prefix_suffix_middle(tokenizers):
    smol, gemma = tokenizers["smollm2"], tokenizers["gemma3"]
    # SmolLM2's vocabulary has <reponame> (llama.cpp's FIM_REP, an end of generation) but no <fim_prefix>
    assert dict(smol.vocab.fim) == {FimToken.REP: 4} and smol.token_text(4) == "<reponame>"
    assert 4 in smol.end_of_generation
    assert dict(gemma.vocab.fim) == {}


def test_metadata_keys_name_them(metadata):
    keys = {
        "tokenizer.ggml.fim_pre_token_id": 7,
        "tokenizer.ggml.fim_suf_token_id": 8,
        "tokenizer.ggml.middle_token_id": 9,
        "tokenizer.ggml.fim_sep_token_id": 10,
    }
    tok = Tokenizer.from_gguf_metadata({**metadata["smollm2"], **keys})
    assert dict(tok.vocab.fim) == {
        FimToken.PRE: 7,
        FimToken.SUF: 8,
        FimToken.MID: 9,
        FimToken.SEP: 10,
        FimToken.REP: 4,
    }
    assert 10 in tok.end_of_generation and 7 not in tok.end_of_generation  # FIM_SEP ends a generation
    # an id outside the vocabulary is ignored, as llama.cpp ignores it
    out_of_range = Tokenizer.from_gguf_metadata(
        {**metadata["smollm2"], "tokenizer.ggml.fim_pre_token_id": 10**6}
    )
    assert FimToken.PRE not in out_of_range.vocab.fim


def test_vocabulary_texts_are_found_and_made_control_tokens(metadata):
    meta = dict(metadata["smollm2"])
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta["tokenizer.ggml.token_type"])
    names = {7: "<fim_prefix>", 8: "<fim_suffix>", 9: "<fim_middle>", 10: "<fim_pad>", 11: "<|file_sep|>"}
    for token_id, text in names.items():
        tokens[token_id] = text
    types[9] = TokenType.NORMAL  # llama.cpp makes a FIM token it found by text a control token
    tok = Tokenizer.from_gguf_metadata(
        {**meta, "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}
    )
    assert dict(tok.vocab.fim) == {
        FimToken.PRE: 7,
        FimToken.SUF: 8,
        FimToken.MID: 9,
        FimToken.PAD: 10,
        FimToken.REP: 4,
        FimToken.SEP: 11,
    }
    assert tok.vocab.token_type(9) is TokenType.CONTROL
    assert {10, 11, 4} <= tok.end_of_generation
    assert tok.encode("<fim_prefix>def<fim_middle>")[:1] == [7] and tok.encode("x<fim_middle>")[-1] == 9
    assert 7 not in tok.encode("<fim_prefix>def", parse_special=False)
