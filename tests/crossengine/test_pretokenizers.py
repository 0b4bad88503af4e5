"""strata-engine's byte-level BPE pre-tokenizers and Phi-3's special-token stripping against llama.cpp b11549
(llama-server in-process): for each distinct pre-tokenizer of the engine's table, SmolLM2's file with only
tokenizer.ggml.pre changed (its vocabulary and merges kept), tokenized by both on the reference texts and
mixed texts of every kind the tokenizer tests use; the ids must be equal. The same for gemma3's SentencePiece
vocabulary in a file named as Phi-3 files are (llama.cpp picks the stripping by general.name)."""

from __future__ import annotations

from pathlib import Path

import pytest
from strata_engine.gguf.reader import read_gguf
from strata_engine.tokenizer import Tokenizer
from support.data import load_reference
from support.gguf_variants import phi3_named_metadata, with_metadata
from support.pretokenizers import one_name_per_pre_type
from support.tokenizer_texts import mixed_texts

from .llama_server import FLASH_ATTN, LlamaServer


def _texts() -> list[str]:
    texts = list(load_reference("prompts.json")["tokenize"])
    texts += [case["text"] for case in load_reference("llamacpp-smollm2-135m.json")["tokenize"]]
    return texts + mixed_texts(seed=40, count=150)


class _Pair:
    """llama-server and strata-engine's tokenizer on one file."""

    def __init__(self, path: Path, slots: Path) -> None:
        self.server = LlamaServer(path, slots, FLASH_ATTN["v_rows"])
        self.tokenizer = Tokenizer.from_gguf_metadata(read_gguf(path).metadata)

    def assert_same_ids(self, text: str) -> None:
        for parse_special in (True, False):
            body = {"content": text, "add_special": True, "parse_special": parse_special}
            expected = self.server.post("/tokenize", body)["tokens"]
            got = self.tokenizer.encode(text, add_special=True, parse_special=parse_special)
            assert got == expected, (text, parse_special)


@pytest.fixture(scope="module", params=one_name_per_pre_type())
def bpe_pair(request, smollm2_path, tmp_path_factory) -> _Pair:
    folder = tmp_path_factory.mktemp(f"pre-{request.param}")
    path = with_metadata(smollm2_path, folder / "model.gguf", {"tokenizer.ggml.pre": request.param})
    return _Pair(path, folder)


def test_pre_tokenizer_equals_llamacpp(bpe_pair):
    for text in _texts():
        bpe_pair.assert_same_ids(text)


def test_clean_spaces_equals_llamacpps_echoed_prompt(bpe_pair):
    """llama-server echoes a completion's prompt through llama_detokenize: clean_spaces where the pre-type
    has it on (its /detokenize does not clean)."""
    tok = bpe_pair.tokenizer
    for text in [
        "Hello , world ! I 'm ' x ' fine .",
        "a ' b 's c 're d 'd e 'll ?! , .",
        *mixed_texts(41, 20),
    ]:
        ids = tok.encode(text, parse_special=False)
        echoed = bpe_pair.server.post("/completion", {"prompt": ids, "n_predict": 1})["prompt"]
        assert tok.decode(ids, clean=True) == echoed, text
        assert tok.decode(ids) == bpe_pair.server.post("/detokenize", {"tokens": ids})["content"], text


@pytest.fixture(scope="module")
def phi3_named_pair(gemma3_path, tmp_path_factory) -> _Pair:
    folder = tmp_path_factory.mktemp("phi3-named")
    values = phi3_named_metadata(read_gguf(gemma3_path).metadata)
    path = with_metadata(gemma3_path, folder / "model.gguf", values)
    return _Pair(path, folder)


def test_phi3_special_token_stripping_equals_llamacpp(phi3_named_pair):
    turns = [
        "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n",
        "<start_of_turn> \t\x0b\x0cuser  \n\n  x<end_of_turn>\r\n<unk> y <eos>  z<bos>\n\nw",
        "a<end_of_turn>\n\n\n<start_of_turn>\n   \n",
        "<s> a</s>\t b<|endoftext|>  c<unused0>\n",
    ]
    texts = turns + [case["text"] for case in load_reference("llamacpp-gemma3-270m.json")["tokenize"]]
    for text in texts + mixed_texts(seed=42, count=100):
        phi3_named_pair.assert_same_ids(text)
