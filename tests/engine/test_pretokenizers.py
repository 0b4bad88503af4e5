"""The byte-level BPE pre-tokenizers (`tokenizer/bpe.py` PRE_TOKENIZERS, one per llama.cpp pre-type): each
regex against the pattern as the models' tokenizer.json writes it, run by the `regex` module (its own Unicode
tables and case folding); the compiled word splitters word for word against the regexes; the compiled
encoders against the pure-Python ones on SmolLM2's vocabulary under each pre-tokenizer; llama.cpp's
clean_spaces pass and Phi-3's stripping of the whitespace after special tokens. The same files against
llama.cpp itself: tests/crossengine/test_pretokenizers.py."""

from __future__ import annotations

import unicodedata

import numpy as np
import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st
from strata_engine.tokenizer import Implementation, Tokenizer, TokenType
from strata_engine.tokenizer.bpe import PRE_TOKENIZERS, clean_up_spaces
from strata_engine.tokenizer.kernels import WordSplit, llama3_word_end
from strata_engine.tokenizer.reference import ReferenceBytePairEncoder
from strata_engine.tokenizer.unicode import codepoint_classes, llama3_pattern, qwen2_pattern
from support.pretokenizers import one_name_per_pre_type
from support.tokenizer_texts import PIECES, mixed_texts

PRE_TYPES = one_name_per_pre_type()

# The split as the models' tokenizer.json writes it (llama-vocab.cpp quotes it above each adapted regex).
HF_PATTERNS = {
    llama3_pattern: r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    qwen2_pattern: r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}  # fmt: skip

# Where the `regex` module's classes differ from llama.cpp's by design: its \s also holds U+001C..U+001F,
# its case folding makes U+017F (long s) and U+212A (Kelvin) an s and a k; and characters this Python's
# Unicode does not assign.
_FOLDED_OR_SPACED = "\x1c\x1d\x1e\x1f\u017f\u212a"
_COMPARABLE = st.characters(blacklist_categories=("Cs", "Cn"), max_codepoint=0x3FFFF).filter(
    lambda ch: ch not in _FOLDED_OR_SPACED and unicodedata.category(ch) != "Cn"
)
_TEXT = st.lists(st.one_of(st.sampled_from(PIECES), st.text(_COMPARABLE, max_size=8)), max_size=30).map(
    "".join
)


def _regex_words(pattern: str, text: str) -> list[str]:
    return [m.group() for m in regex.finditer(pattern, text)]


def _compiled_words(text: str, max_digits: int) -> list[str]:
    """kernels.llama3_word_end applied from the start of `text` to its end."""
    cps = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    classes = codepoint_classes()
    words, at = [], 0
    while at < cps.size:
        end = int(llama3_word_end(cps, classes, at, cps.size, max_digits))
        words.append(text[at:end])
        at = end
    return words


def test_every_pre_type_has_a_compiled_split():
    for name, spec in PRE_TOKENIZERS.items():
        assert isinstance(spec.word_split, WordSplit), name
        assert (spec.word_split is WordSplit.LLAMA3) == (spec.max_digits > 0), name
        assert all(split in HF_PATTERNS for split in spec.splits) or name == "smollm", name


@pytest.mark.parametrize("make", HF_PATTERNS, ids=lambda make: make.__name__)
@settings(max_examples=300, deadline=None)
@given(text=_TEXT)
def test_regex_equals_tokenizer_json_pattern(make, text):
    """Python's `re` on llama.cpp's adapted regex, classes from unicodedata, splits as `regex` does on the
    original (every piece of the text is in some match: these patterns leave no gaps)."""
    words = _regex_words(HF_PATTERNS[make], text)
    assert [m.group() for m in make().finditer(text)] == words
    assert "".join(words) == text


@pytest.mark.parametrize("name", [n for n in PRE_TYPES if PRE_TOKENIZERS[n].word_split is WordSplit.LLAMA3])
@settings(max_examples=300, deadline=None)
@given(text=st.one_of(_TEXT, st.text(st.sampled_from(" \t\r\n\u3000a1'!é東"), max_size=60)))
def test_compiled_split_equals_regex(name, text):
    spec = PRE_TOKENIZERS[name]
    (make,) = spec.splits
    assert _compiled_words(text, spec.max_digits) == [m.group() for m in make().finditer(text)]


@pytest.fixture(scope="module")
def encoders(metadata) -> dict[str, tuple[Tokenizer, Tokenizer]]:
    """pre-type name -> (compiled, reference) tokenizers of SmolLM2's vocabulary and merges under it."""
    out = {}
    for name in PRE_TYPES:
        meta = {**metadata["smollm2"], "tokenizer.ggml.pre": name}
        out[name] = (
            Tokenizer.from_gguf_metadata(meta),
            Tokenizer.from_gguf_metadata(meta, Implementation.REFERENCE),
        )
    return out


def _assert_same_ids(pair: tuple[Tokenizer, Tokenizer], text: str) -> None:
    compiled, oracle = pair
    for parse_special in (True, False):
        assert compiled.encode(text, parse_special=parse_special) == oracle.encode(
            text, parse_special=parse_special
        )


@pytest.mark.parametrize("name", PRE_TYPES)
def test_compiled_equals_reference_on_mixed_texts(encoders, name):
    for text in mixed_texts(seed=3, count=300):
        _assert_same_ids(encoders[name], text)
        compiled, _ = encoders[name]
        assert compiled.decode(compiled.encode(text, parse_special=False)) == text


@pytest.mark.parametrize("name", PRE_TYPES)
@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(" \t\n\r\u3000a1'é東🚀<>|_!"), max_size=300))
def test_compiled_equals_reference_on_runs(encoders, name, text):
    _assert_same_ids(encoders[name], text)


def test_ignore_merges_takes_a_whole_word_token(metadata):
    """llama3's pre-types skip the merges for a word that is a token. With SmolLM2's merges cut to the first
    thousand, most longer tokens are out of the merges' reach: a word that is one of them still comes out
    whole under llama-bpe, and not under qwen2 (the same split for words without digits, merges kept)."""
    cut = {
        **metadata["smollm2"],
        "tokenizer.ggml.merges": metadata["smollm2"]["tokenizer.ggml.merges"][:1000],
    }
    llama, qwen = ({**cut, "tokenizer.ggml.pre": pre} for pre in ("llama-bpe", "qwen2"))
    compiled, oracle = (
        Tokenizer.from_gguf_metadata(llama),
        Tokenizer.from_gguf_metadata(llama, Implementation.REFERENCE),
    )
    merged = Tokenizer.from_gguf_metadata(qwen)
    words = ReferenceBytePairEncoder(compiled.vocab, [], "llama-bpe")
    whole_only_here = 0
    for token_id in range(1000, 8000):
        piece = compiled.piece(token_id)
        if compiled.vocab.token_type(token_id) is not TokenType.NORMAL or "\ufffd" in piece:
            continue
        if words.pre_tokenize(piece) != [piece] or any(ch.isdigit() for ch in piece):
            continue
        assert compiled.encode(piece) == oracle.encode(piece) == [token_id], token_id
        whole_only_here += merged.encode(piece) != [token_id]
    assert whole_only_here > 1000


def test_defaults_by_pre_type(metadata):
    """BOS where the file says nothing: llama3's pre-types add it, the others not; clean_spaces as llama.cpp
    sets it per name."""
    base = {k: v for k, v in metadata["smollm2"].items() if k != "tokenizer.ggml.add_bos_token"}
    for name, spec in PRE_TOKENIZERS.items():
        tok = Tokenizer.from_gguf_metadata({**base, "tokenizer.ggml.pre": name})
        assert (tok.add_bos, tok.clean_spaces) == (spec.add_bos, spec.clean_spaces), name
    assert PRE_TOKENIZERS["llama-bpe"].add_bos and not PRE_TOKENIZERS["qwen2"].add_bos
    assert PRE_TOKENIZERS["megrez"].clean_spaces and not PRE_TOKENIZERS["qwen2"].clean_spaces


def _clean_spaces_as_llamacpp(text: bytes) -> bytes:
    """llama_vocab::impl::detokenize's three clean_spaces passes, written as llama.cpp writes them (in place)."""
    buf = bytearray(text)

    def one_pass(step) -> None:
        n, total, i = len(buf), min(len(buf), 1), 1
        while i < n:
            total, i = step(n, total, i)
            i += 1
        del buf[total:]

    def punctuation(n, total, i):
        if buf[i - 1] == 32 and buf[i] in b"?!.,":
            total -= 1
        buf[total] = buf[i]
        return total + 1, i

    def lone_apostrophe(n, total, i):
        x = buf[i]
        if x == 39 and i + 1 < n and buf[i - 1] == 32 and buf[i + 1] == 32:
            total -= 1
            i += 1
            buf[i] = 0
        buf[total] = x
        return total + 1, i

    def contraction(n, total, i):
        x = buf[i]
        if buf[i - 1] == 32 and x == 39 and i + 1 < n:
            x1 = buf[i + 1]
            if x1 in b"sm" or (i + 2 < n and bytes([x1, buf[i + 2]]) in (b"re", b"ve")):
                total -= 1
        buf[total] = x
        return total + 1, i

    for step in (punctuation, lone_apostrophe, contraction):
        one_pass(step)
    return bytes(buf)


@settings(max_examples=500, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(" ' ?!.,smrevtdlx"), max_size=40))
def test_clean_up_spaces_equals_llamacpps_passes(text):
    data = text.encode()
    assert clean_up_spaces(data) == _clean_spaces_as_llamacpp(data)


def test_decode_cleans_spaces_only_when_asked(encoders):
    compiled, _ = encoders["llama-bpe"]
    ids = compiled.encode("Hello , world ! I 'm fine .", parse_special=False)
    assert compiled.decode(ids) == "Hello , world ! I 'm fine ."
    assert compiled.decode(ids, clean=True) == "Hello, world! I'm fine."
    qwen, _ = encoders["qwen2"]
    assert qwen.decode(ids, clean=True) == qwen.decode(ids)  # clean_spaces off for qwen2
