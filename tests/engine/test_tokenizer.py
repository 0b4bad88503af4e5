"""Tokenizers built from GGUF metadata: identical to llama.cpp (and transformers) on every reference
text of both real models, the compiled encoders identical to the pure-Python reference ones, round
trips, special-token handling, streaming UTF-8, bad metadata."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strata_engine.errors import InvalidToken, TokenizerError, UnsupportedTokenizer
from strata_engine.tokenizer import Implementation, Tokenizer, TokenType, Utf8Stream
from support.data import load_reference
from support.gguf_variants import phi3_named_metadata
from support.tokenizer_texts import PIECES

from .runners import MODELS, reference

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reference_tokenizers(metadata) -> dict[str, Tokenizer]:
    """The pure-Python encoders (tokenizer/reference.py), the oracle of the compiled ones."""
    return {
        name: Tokenizer.from_gguf_metadata(meta, Implementation.REFERENCE) for name, meta in metadata.items()
    }


def _assert_same_ids(tokenizers, reference_tokenizers, text: str) -> None:
    for name, tok in tokenizers.items():
        oracle = reference_tokenizers[name]
        for parse_special in (True, False):
            expected = oracle.encode(text, add_special=True, parse_special=parse_special)
            assert tok.encode(text, add_special=True, parse_special=parse_special) == expected, (
                name,
                text[:200],
            )


def _cases(peer: str):
    return [
        pytest.param(model, case, id=f"{model}-{i}")
        for model in MODELS
        for i, case in enumerate(reference(peer, model)["tokenize"])
    ]


@pytest.mark.parametrize(("model", "case"), _cases("llamacpp"))
def test_identical_to_llamacpp(tokenizers, model, case):
    assert case["add_special"] is True
    assert tokenizers[model].encode(case["text"], add_special=True) == case["tokens"]


@pytest.mark.parametrize(("model", "case"), _cases("transformers"))
def test_identical_to_transformers(tokenizers, model, case):
    assert tokenizers[model].encode(case["text"], add_special=case.get("add_special", True)) == case["tokens"]


@pytest.mark.parametrize("model", MODELS)
def test_round_trip_reference_texts(tokenizers, model):
    tok = tokenizers[model]
    for case in reference("llamacpp", model)["tokenize"]:
        text = case["text"]
        assert tok.decode(tok.encode(text)) == text
        # add_special only adds the BOS the model asks for; special=False hides control tokens
        with_bos = tok.encode(text, add_special=True)
        assert with_bos == ([tok.bos_id] if tok.add_bos else []) + tok.encode(text)
        assert tok.decode(with_bos, special=False) == tok.decode(tok.encode(text), special=False)
    if tok.add_bos:
        assert tok.decode(tok.encode("x", add_special=True)).startswith(tok.token_text(tok.bos_id))


def test_facts_from_metadata(tokenizers):
    smol, gemma = tokenizers["smollm2"], tokenizers["gemma3"]
    assert (smol.n_vocab, smol.bos_id, smol.eos_id, smol.add_bos) == (49152, 1, 2, False)
    assert (gemma.n_vocab, gemma.bos_id, gemma.eos_id, gemma.add_bos) == (262144, 2, 1, True)
    assert {2, 0} <= smol.end_of_generation  # <|im_end|> (eos), <|endoftext|>
    assert {1, 106} <= gemma.end_of_generation  # <eos>, <end_of_turn>
    assert 105 not in gemma.end_of_generation  # <start_of_turn>
    # "</s>" (a user-defined token there): llama.cpp b11549 ends generation on it by text, a control token
    assert 212 in gemma.end_of_generation and gemma.vocab.token_type(212) is TokenType.CONTROL
    assert gemma.vocab.token_type(107) is TokenType.USER_DEFINED  # "\n"


def test_parse_special(tokenizers):
    smol, gemma = tokenizers["smollm2"], tokenizers["gemma3"]
    text = "<|im_start|>user"
    assert smol.encode(text)[0] == 1
    assert 1 not in smol.encode(text, parse_special=False)
    assert smol.decode(smol.encode(text, parse_special=False)) == text
    assert gemma.encode("<start_of_turn>user")[0] == 105
    assert 105 not in gemma.encode("<start_of_turn>user", parse_special=False)
    # user-defined tokens ("\n", runs of spaces) are split out even without parse_special
    assert gemma.encode("a\nb", parse_special=False) == gemma.encode("a\nb")
    assert 107 in gemma.encode("a\nb", parse_special=False)


def test_longest_special_token_wins(tokenizers):
    gemma = tokenizers["gemma3"]
    # "\n\n\n" is one user-defined token (109), not three "\n"
    assert gemma.encode("a\n\n\nb") == gemma.encode("a") + [109] + gemma.encode("b")


def test_pieces_and_byte_fallback(tokenizers):
    smol, gemma = tokenizers["smollm2"], tokenizers["gemma3"]
    assert smol.piece(smol.encode(" Paris")[0]) == " Paris"
    assert smol.piece(2) == "<|im_end|>" and smol.piece(2, special=False) == ""
    # a character with no token of its own goes through the <0xNN> byte tokens
    byte_ids = gemma.encode("\U000e0000")
    assert all(gemma.vocab.token_type(i) is TokenType.BYTE for i in byte_ids)
    assert b"".join(gemma.token_bytes(i) for i in byte_ids) == "\U000e0000".encode()
    assert gemma.decode(byte_ids) == "\U000e0000"


def test_streaming_utf8_holds_incomplete_characters(tokenizers):
    for tok in tokenizers.values():
        text = "naïve 東京 🚀 café"
        ids = tok.encode(text)
        stream = Utf8Stream()
        shown = []
        for token_id in ids:
            chunk = stream.push(tok.token_bytes(token_id))
            assert "\ufffd" not in chunk
            shown.append(chunk)
        shown.append(stream.finish())
        assert "".join(shown) == text
    stream = Utf8Stream()
    emoji = "🚀".encode()
    assert stream.push(emoji[:2]) == "" and stream.pending == emoji[:2]
    assert stream.push(emoji[2:]) == "🚀"
    assert stream.push(emoji[:1]) == "" and stream.finish() == "\ufffd"


def test_random_text_round_trip(tokenizers):
    rng = random.Random(1234)
    # (no U+2581: SentencePiece reads it as a space, so it cannot round-trip, in llama.cpp either)
    alphabet = "abcXYZ 09\t\n.,'-_<>|\u00e9\u00fc\u6771\u4eac\U0001f680\u0120 "
    for tok in tokenizers.values():
        for _ in range(50):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
            assert tok.decode(tok.encode(text, parse_special=False)) == text


def test_lone_surrogate_becomes_replacement_character(tokenizers):
    for tok in tokenizers.values():
        assert tok.encode("a\ud800b") == tok.encode("a\ufffdb")


def _corpus() -> list[str]:
    """Every reference text, the prompts, and this repository's documents (prose, code, tables)."""
    texts = list(load_reference("prompts.json")["tokenize"]) + list(
        load_reference("prompts.json")["complete"]
    )
    for model in MODELS:
        texts += [
            case["text"]
            for peer in ("llamacpp", "transformers")
            for case in reference(peer, model)["tokenize"]
        ]
    texts += [path.read_text(encoding="utf-8") for path in sorted((REPO / "spec").glob("*.md"))]
    texts.append((REPO / "README.md").read_text(encoding="utf-8"))
    texts.append(
        (REPO / "packages/strata-engine/src/strata_engine/tokenizer/kernels.py").read_text(encoding="utf-8")
    )
    return texts


def test_compiled_equals_reference_on_the_corpus(tokenizers, reference_tokenizers):
    for text in _corpus():
        _assert_same_ids(tokenizers, reference_tokenizers, text)


def test_compiled_equals_reference_on_a_long_mixed_prompt(tokenizers, reference_tokenizers):
    rng = random.Random(7)
    words = ["the", "of", "inference", "cache", "session", "Ünïcödé", "東京", "42", "x**2", "(){}", "\n", "  ",
             "don't", "I'M", "они", "ﻣﺮﺣﺒﺎ", "🚀", "👩‍👩‍👧", "<|im_end|>", "<end_of_turn>", "\t\t", "１２３"]  # fmt: skip
    text = " ".join(rng.choice(words) + str(rng.randint(0, 999)) for _ in range(6000))[:30000]
    _assert_same_ids(tokenizers, reference_tokenizers, text)
    for tok in tokenizers.values():
        assert tok.decode(tok.encode(text, parse_special=False)) == text


def test_compiled_sentencepiece_merges_across_words_where_a_token_does(tokenizers, reference_tokenizers):
    """The compiled SentencePiece encoder merges word by word, except after a character that precedes a
    U+2581 inside some token (gemma3's ">▁</"): texts around every such token agree with the oracle."""
    vocab = tokenizers["gemma3"].vocab
    spanning = [t for t in vocab.tokens if "\u2581" in t.lstrip("\u2581")]
    assert spanning  # else this test checks nothing
    for token in spanning:
        plain = token.replace("\u2581", " ")
        for text in (plain, f"x{plain}y", f" {plain} {plain}", f"a  {plain}\u2581b", token):
            _assert_same_ids({"gemma3": tokenizers["gemma3"]}, reference_tokenizers, text)


_MIXED_TEXT = st.lists(
    st.one_of(
        st.sampled_from(PIECES),
        st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=8),
    ),
    max_size=40,
).map("".join)


@settings(max_examples=400, deadline=None)
@given(text=_MIXED_TEXT)
def test_compiled_equals_reference_on_generated_text(tokenizers, reference_tokenizers, text):
    _assert_same_ids(tokenizers, reference_tokenizers, text)


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(" \t\n\u3000a1'é東🚀<>|_"), max_size=300))
def test_compiled_equals_reference_on_runs(tokenizers, reference_tokenizers, text):
    """Long runs of a few characters: long words, long merge chains, repeated words (the word cache)."""
    _assert_same_ids(tokenizers, reference_tokenizers, text)


def test_bad_metadata_is_reported(metadata):
    with pytest.raises(UnsupportedTokenizer, match="'bert'"):
        Tokenizer.from_gguf_metadata({**metadata["smollm2"], "tokenizer.ggml.model": "bert"})
    # a pre-tokenizer llama.cpp knows but this engine does not (GPT-4o's, Llama 4's), and none at all
    with pytest.raises(UnsupportedTokenizer, match="tokenizer.ggml.pre = 'gpt-4o' is not supported"):
        Tokenizer.from_gguf_metadata({**metadata["smollm2"], "tokenizer.ggml.pre": "gpt-4o"})
    without_pre = {k: v for k, v in metadata["smollm2"].items() if k != "tokenizer.ggml.pre"}
    with pytest.raises(UnsupportedTokenizer, match="'default'"):
        Tokenizer.from_gguf_metadata(without_pre)
    with pytest.raises(TokenizerError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})
    bad = {**metadata["gemma3"], "tokenizer.ggml.bos_token_id": 10**9, "tokenizer.ggml.scores": [0.0]}
    with pytest.raises(TokenizerError) as info:
        Tokenizer.from_gguf_metadata(bad)
    # every problem reported together
    assert "bos_token_id" in str(info.value) and "scores" in str(info.value)
    with pytest.raises(InvalidToken, match="outside the vocabulary"):
        Tokenizer.from_gguf_metadata(metadata["smollm2"]).decode([49152])


# SmolLM2's vocabulary lacks the byte tokens of 0x04 0x06 0x13 0x14 0x16 0x1D 0xC0 0xC1 0xF1 0xF2 0xF5..0xFF:
# like llama.cpp, encoding drops such bytes, so text using them (control characters, planes 4+) cannot
# round-trip there.
_ROUND_TRIP_TEXT = st.text(
    alphabet=st.characters(
        blacklist_categories=("Cs",), max_codepoint=0x3FFFF, blacklist_characters="\x04\x06\x13\x14\x16\x1d"
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(text=_ROUND_TRIP_TEXT)
def test_any_text_round_trips(tokenizers, text):
    for name, tok in tokenizers.items():
        if name == "gemma3" and "\u2581" in text:
            continue  # SentencePiece reads U+2581 as a space
        assert tok.decode(tok.encode(text, parse_special=False)) == text


def test_bytes_without_a_token_are_dropped_like_llamacpp(tokenizers):
    smol = tokenizers["smollm2"]
    assert smol.decode(smol.encode("a\x04b")) == "ab"


def _partition_as_llamacpp(vocab, text: str, parse_special: bool) -> list:
    """llama.cpp's tokenizer_st_partition, written plainly: every special token, longest first, splits
    every raw fragment at each of its non-overlapping occurrences."""
    fragments = [text] if text else []
    for special in vocab.special_tokens:
        if special.needs_parse_special and not parse_special:
            continue
        out = []
        for fragment in fragments:
            if isinstance(fragment, int):
                out.append(fragment)
                continue
            start = 0
            while (at := fragment.find(special.text, start)) >= 0:
                if at > start:
                    out.append(fragment[start:at])
                out.append(special.id)
                start = at + len(special.text)
                if special.rstrip:  # LLAMA_TOKEN_ATTR_RSTRIP: isspace() after it skipped
                    while start < len(fragment) and fragment[start] in " \t\n\v\f\r":
                        start += 1
            if start < len(fragment):
                out.append(fragment[start:])
        fragments = out
    return fragments


@pytest.fixture(scope="module")
def phi3_named(metadata) -> Tokenizer:
    """gemma3's vocabulary in a file named as Phi-3 files are (support/gguf_variants.py): llama.cpp strips the
    whitespace after each of its special tokens but <unk>, <s> and <|endoftext|>."""
    return Tokenizer.from_gguf_metadata({**metadata["gemma3"], **phi3_named_metadata(metadata["gemma3"])})


def test_special_token_partition_equals_llamacpps_algorithm(tokenizers, phi3_named):
    rng = random.Random(11)
    pieces = ["<start_of_turn>", "<end_of_turn>", "<unused12>", "<unused1", "<b>", "</b", "<", ">", "[multimodal]",
              "<|im_start|>", "<|im_end|>", "<|endoftext|>", "\n", " ", "  ", "\t", "x", "user", "<bos>", "<eos>",
              "<unk>", "\r\n", "\u3000"]  # fmt: skip
    for tok in [*tokenizers.values(), phi3_named]:
        for _ in range(80):
            text = "".join(
                rng.choice(pieces) * rng.choice([1, 1, 2, 7, 40]) for _ in range(rng.randint(0, 12))
            )
            for parse_special in (True, False):
                assert tok.vocab.partition(text, parse_special) == _partition_as_llamacpp(
                    tok.vocab, text, parse_special
                )


def test_phi3_special_tokens_strip_the_whitespace_after_them(tokenizers, phi3_named):
    stripping = {s.text for s in phi3_named.vocab.special_tokens if s.rstrip}
    assert {"<start_of_turn>", "<end_of_turn>", "<eos>", "[multimodal]"} <= stripping
    assert not stripping & {"<unk>", "<s>", "<|endoftext|>"}
    assert not any(s.rstrip for tok in tokenizers.values() for s in tok.vocab.special_tokens)
    gemma = tokenizers["gemma3"]
    # (the longer special tokens split first: "\n" after <end_of_turn> goes with the stripped run)
    turn = "<start_of_turn>\x0b\x0cuser Hi<end_of_turn>\n \t<unk>\x0b x"
    assert phi3_named.encode(turn) == gemma.encode("<start_of_turn>user Hi<end_of_turn><unk>\x0b x")


def test_a_phi3_name_needs_the_tokens_llamacpp_sets_by_name(metadata):
    with pytest.raises(TokenizerError, match=re.escape("the vocabulary lacks <|endoftext|>")):
        Tokenizer.from_gguf_metadata({**metadata["gemma3"], "general.name": "Phi3"})


def test_end_tag_is_normal_where_a_gemma4_marker_ends_generation(metadata):
    """llama.cpp's rule for gemma4 and plamo vocabularies: with <|tool_response>, "</s>" is a normal token."""
    tokens = [
        "<|tool_response>" if t == "<unused2>" else t for t in metadata["gemma3"]["tokenizer.ggml.tokens"]
    ]
    tok = Tokenizer.from_gguf_metadata({**metadata["gemma3"], "tokenizer.ggml.tokens": tokens})
    assert tokens.index("<|tool_response>") in tok.end_of_generation
    assert 212 not in tok.end_of_generation and tok.vocab.token_type(212) is TokenType.NORMAL
