"""The vocabulary of a GGUF file: token texts, types, scores, special ids, and the split of a text
around special tokens (llama.cpp's `tokenizer_st_partition`)."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from ..errors import InvalidToken, TokenizerError
from ..protocol import FimToken


class TokenType(enum.IntEnum):
    """`tokenizer.ggml.token_type` values (the on-disk codes, llama.cpp's `llama_token_type`)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Texts that end generation (llama.cpp b11549 detects these by text; a token with one of these texts is
# treated as a control token even if the file says otherwise).
END_OF_GENERATION_TEXTS: frozenset[str] = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
        "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
        "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
        "<｜end▁of▁sentence｜>", "[e~[", "<|ifm|im_end|>",
    }
)  # fmt: skip
# Where one of these ends generation too, "</s>" is a normal token instead (gemma4's and plamo's vocabularies).
NORMAL_END_TAG_MARKERS = frozenset({"<|tool_response>", "<|plamo:eos|>"})
END_TAG = "</s>"

# Fill-in-the-middle tokens: the GGUF keys that name each (the first present wins; the last of PRE, SUF
# and MID is llama.cpp's deprecated name), else the first of the texts the vocabulary holds (llama.cpp
# looks these up by text, as the end-of-generation ones; a token found so is treated as a control token).
FIM_KEYS: dict[FimToken, tuple[str, ...]] = {
    FimToken.PRE: ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"),
    FimToken.SUF: ("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"),
    FimToken.MID: ("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"),
    FimToken.PAD: ("tokenizer.ggml.fim_pad_token_id",),
    FimToken.REP: ("tokenizer.ggml.fim_rep_token_id",),
    FimToken.SEP: ("tokenizer.ggml.fim_sep_token_id",),
}
FIM_TEXTS: dict[FimToken, tuple[str, ...]] = {
    FimToken.PRE: (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ),
    FimToken.SUF: (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ),
    FimToken.MID: (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ),
    FimToken.PAD: ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    FimToken.REP: ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    FimToken.SEP: ("<|file_sep|>",),
}
# FIM tokens that end a generation (llama.cpp adds them to its end-of-generation set).
FIM_END_OF_GENERATION = (FimToken.PAD, FimToken.REP, FimToken.SEP)

# llama.cpp's per-token attributes by model name (llama_vocab::impl::load): where general.name, lowercased,
# contains one of these, every special token but the RSTRIP_KEPT ones drops the whitespace after it.
RSTRIP_MODEL_NAMES = ("phi-3", "phi3")
RSTRIP_KEPT = frozenset({"<unk>", "<s>", "<|endoftext|>"})
# The texts llama.cpp sets attributes of by name there: a vocabulary lacking one fails its load.
RSTRIP_NAMED = RSTRIP_KEPT | {"</s>"}
# What the stripping drops: C's isspace in the "C" locale, byte by byte (no non-ASCII space).
_C_SPACES = " \t\n\v\f\r"

# Types rendered as their literal text when special tokens are shown, and the types that only a
# parse_special tokenization recognises in text (user-defined tokens are always recognised).
_SPECIAL_TYPES = (TokenType.CONTROL, TokenType.UNKNOWN)
_PARTITION_TYPES = (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED)


@attrs.frozen(eq=False)
class SpecialToken:
    text: str
    id: int
    needs_parse_special: bool
    rank: int = 0  # position in `Vocabulary.special_tokens` (longest first)
    rstrip: bool = False  # the whitespace after it is dropped (llama.cpp's LLAMA_TOKEN_ATTR_RSTRIP)

    def split(self, fragment: str) -> list[str | int]:
        """`fragment` around every non-overlapping occurrence of this token, as llama.cpp splits it."""
        out: list[str | int] = []
        start = 0
        while (at := fragment.find(self.text, start)) >= 0:
            if at > start:
                out.append(fragment[start:at])
            out.append(self.id)
            start = at + len(self.text)
            while self.rstrip and start < len(fragment) and fragment[start] in _C_SPACES:
                start += 1
        if start < len(fragment):
            out.append(fragment[start:])
        return out


# Above this many special tokens sharing a first character (gemma3 has ~6,400 starting with "<"), their
# presence in a text is found by looking up the text at each position of that character rather than by
# one substring search per token.
_SCAN_GROUP_SIZE = 64


@attrs.frozen(eq=False)
class _SpecialIndex:
    """Special tokens grouped by first character, to find the ones a text contains quickly."""

    by_text: Mapping[str, SpecialToken]
    groups: Mapping[str, tuple[SpecialToken, ...]]
    lengths: Mapping[str, tuple[int, ...]]  # distinct text lengths per first character

    @classmethod
    def build(cls, specials: Sequence[SpecialToken]) -> _SpecialIndex:
        groups: dict[str, list[SpecialToken]] = {}
        for special in specials:
            groups.setdefault(special.text[0], []).append(special)
        return cls(
            by_text={s.text: s for s in specials},
            groups={c: tuple(g) for c, g in groups.items()},
            lengths={c: tuple(sorted({len(s.text) for s in g})) for c, g in groups.items()},
        )

    def present(self, text: str) -> list[SpecialToken]:
        """The special tokens occurring in `text`, longest first."""
        found: list[SpecialToken] = []
        for first in set(text).intersection(self.groups):
            group = self.groups[first]
            if len(group) <= _SCAN_GROUP_SIZE:
                found.extend(s for s in group if s.text in text)
                continue
            seen: set[str] = set()
            lengths = self.lengths[first]
            at = text.find(first)
            while at >= 0:
                for n in lengths:
                    candidate = text[at : at + n]
                    if len(candidate) < n:
                        break
                    if candidate in self.by_text:
                        seen.add(candidate)
                at = text.find(first, at + 1)
            found.extend(self.by_text[t] for t in seen)
        found.sort(key=lambda s: s.rank)
        return found


@attrs.frozen(eq=False)
class Vocabulary:
    tokens: Sequence[str] = attrs.field(repr=False)
    types: np.ndarray = attrs.field(repr=False)  # int32 [n_vocab], TokenType codes (after overrides)
    scores: Sequence[float] | None = attrs.field(repr=False)
    token_to_id: Mapping[str, int] = attrs.field(repr=False)
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    end_of_generation: frozenset[int]
    fim: Mapping[FimToken, int]  # the fill-in-the-middle tokens the vocabulary has
    # Longest text first: a longer special token wins over a shorter one it contains.
    special_tokens: tuple[SpecialToken, ...] = attrs.field(repr=False)
    _special_index: _SpecialIndex = attrs.field(repr=False, alias="_special_index")

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def token_type(self, token_id: int) -> TokenType:
        return TokenType(int(self.types[token_id]))

    def check_id(self, token_id: int) -> None:
        if not (0 <= token_id < len(self.tokens)):
            raise InvalidToken(f"token id {token_id} is outside the vocabulary [0, {len(self.tokens)})")

    def partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split `text` into raw-text fragments and special token ids.

        Special tokens are taken longest first over the whole text, each splitting every raw fragment
        at all its non-overlapping occurrences, exactly as llama.cpp does; control and unknown tokens
        are recognised only with `parse_special`, user-defined ones always.
        """
        fragments: list[str | int] = [text] if text else []
        for special in self._special_index.present(text):
            if special.needs_parse_special and not parse_special:
                continue
            split: list[str | int] = []
            for fragment in fragments:
                if isinstance(fragment, int) or special.text not in fragment:
                    split.append(fragment)
                    continue
                split.extend(special.split(fragment))
            fragments = split
        return fragments

    @classmethod
    def from_gguf_metadata(
        cls, metadata: Mapping[str, Any], *, default_add_bos: bool, default_add_space_prefix: bool
    ) -> Vocabulary:
        problems: list[str] = []
        tokens_raw = metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens_raw, (list, tuple)) or not tokens_raw:
            raise TokenizerError("tokenizer.ggml.tokens is missing or empty")
        # llama.cpp renames empty texts so that every token has a distinct, non-empty text
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens_raw)]
        n_vocab = len(tokens)

        types_raw = metadata.get("tokenizer.ggml.token_type")
        if types_raw is None:
            types = np.full(n_vocab, TokenType.NORMAL, dtype=np.int32)
        else:
            types = np.array(types_raw, dtype=np.int32)
            if types.shape != (n_vocab,):
                problems.append(f"tokenizer.ggml.token_type has {types.size} entries for {n_vocab} tokens")
            else:
                unknown_codes = set(np.unique(types).tolist()) - {t.value for t in TokenType}
                if unknown_codes:
                    # llama.cpp reads an unknown type as UNDEFINED
                    types[np.isin(types, list(unknown_codes))] = TokenType.UNDEFINED

        scores_raw = metadata.get("tokenizer.ggml.scores")
        scores: list[float] | None = None
        if scores_raw is not None:
            scores = np.asarray(scores_raw, dtype=np.float32).tolist()
            if len(scores) != n_vocab:
                problems.append(f"tokenizer.ggml.scores has {len(scores)} entries for {n_vocab} tokens")

        def special_id(key: str) -> int | None:
            value = metadata.get(key)
            if value is None:
                return None
            if not isinstance(value, (int, np.integer)) or not (0 <= int(value) < n_vocab):
                problems.append(f"{key} = {value!r} is not a token id in [0, {n_vocab})")
                return None
            return int(value)

        bos_id = special_id("tokenizer.ggml.bos_token_id")
        eos_id = special_id("tokenizer.ggml.eos_token_id")
        eot_id = special_id("tokenizer.ggml.eot_token_id")
        eom_id = special_id("tokenizer.ggml.eom_token_id")
        unk_id = special_id("tokenizer.ggml.unknown_token_id")
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", default_add_bos))
        add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", default_add_space_prefix))
        if add_bos and bos_id is None:
            problems.append("tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id is missing")
        if problems:
            raise TokenizerError("invalid tokenizer metadata: " + "; ".join(problems))

        token_to_id = {text: i for i, text in enumerate(tokens)}
        end_of_generation = {i for i in (eos_id, eot_id, eom_id) if i is not None}
        for text in END_OF_GENERATION_TEXTS:
            token_id = token_to_id.get(text)
            if token_id is not None:
                end_of_generation.add(token_id)
                if types[token_id] not in _SPECIAL_TYPES:
                    types[token_id] = TokenType.CONTROL

        fim = _fim_tokens(metadata, token_to_id, types)
        end_of_generation.update(fim[role] for role in FIM_END_OF_GENERATION if role in fim)
        end_tag = token_to_id.get(END_TAG)
        if end_tag in end_of_generation and any(
            tokens[i] in NORMAL_END_TAG_MARKERS for i in end_of_generation
        ):
            end_of_generation.discard(end_tag)
            types[end_tag] = TokenType.NORMAL

        partition_ids = np.nonzero(np.isin(types, [t.value for t in _PARTITION_TYPES]))[0].tolist()
        by_length = sorted(partition_ids, key=lambda i: -len(tokens[i].encode("utf-8")))
        model_name = str(metadata.get("general.name", "")).lower()
        rstrip = any(name in model_name for name in RSTRIP_MODEL_NAMES)
        if rstrip and (missing := sorted(RSTRIP_NAMED - token_to_id.keys())):
            raise TokenizerError(
                f"general.name = {metadata.get('general.name')!r} names a Phi-3 model, whose tokens "
                f"{', '.join(sorted(RSTRIP_NAMED))} llama.cpp sets attributes of; the vocabulary lacks {', '.join(missing)}"
            )
        specials = [
            SpecialToken(
                tokens[i],
                i,
                int(types[i]) != TokenType.USER_DEFINED,
                rank,
                rstrip and tokens[i] not in RSTRIP_KEPT,
            )
            for rank, i in enumerate(by_length)
        ]
        types.setflags(write=False)
        return cls(
            tokens=tokens,
            types=types,
            scores=scores,
            token_to_id=token_to_id,
            bos_id=bos_id,
            eos_id=eos_id,
            unk_id=unk_id,
            add_bos=add_bos,
            add_eos=add_eos,
            add_space_prefix=add_space_prefix,
            end_of_generation=frozenset(end_of_generation),
            fim=fim,
            special_tokens=tuple(specials),
            _special_index=_SpecialIndex.build(specials),
        )


def _fim_tokens(
    metadata: Mapping[str, Any], token_to_id: Mapping[str, int], types: np.ndarray
) -> dict[FimToken, int]:
    """Each FIM token the file names (`FIM_KEYS`) or the vocabulary holds by text (`FIM_TEXTS`, made control
    tokens). An id outside the vocabulary is ignored, as llama.cpp ignores it."""
    found: dict[FimToken, int] = {}
    for role, keys in FIM_KEYS.items():
        named = [metadata[k] for k in keys if isinstance(metadata.get(k), (int, np.integer))]
        if named and 0 <= int(named[0]) < len(types):
            found[role] = int(named[0])
            continue
        text = next((t for t in FIM_TEXTS[role] if t in token_to_id), None)
        if text is not None:
            found[role] = token_to_id[text]
            if types[found[role]] not in _SPECIAL_TYPES:
                types[found[role]] = TokenType.CONTROL
    return found
