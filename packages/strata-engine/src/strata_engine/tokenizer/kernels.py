"""The compiled hot loops of the encoders (numba, compiled once and cached on disk): the GPT-2 and Llama 3
word splits, the BPE merge loop over integer symbols with a binary heap, open-addressing hash tables (merge pairs,
token texts, the per-call word cache).

They take and return NumPy arrays only, so they run without the GIL (`nogil`): a thread tokenizing a
long prompt does not hold up the others. bpe.py and spm.py build their tables and call them;
reference.py is the pure-Python oracle they must agree with.
"""

from __future__ import annotations

import enum

import numpy as np
from numba import njit

from .unicode import CharClass

_LETTER = int(CharClass.LETTER)
_NUMBER = int(CharClass.NUMBER)
_SPACE = int(CharClass.SPACE)
_APOSTROPHE, _BLANK, _SPACE_MARK, _CR, _LF = ord("'"), ord(" "), ord("\u2581"), ord("\r"), ord("\n")
_S, _T, _M, _D, _R, _V, _L, _E = (ord(c) for c in "stmdrvle")


class WordSplit(enum.IntEnum):
    """The compiled word splitters of byte-level BPE (`bpe_encode`'s `word_split`)."""

    GPT2 = 0  # gpt2_word_end
    LLAMA3 = 1  # llama3_word_end


_LLAMA3_SPLIT = int(WordSplit.LLAMA3)


# A key word of a hash table slot that holds nothing (pair keys are >= 0).
_EMPTY = -1
# The per-call word cache stops growing at this many slots (half of them used).
_WORD_CACHE_SLOTS = 1 << 18

_FNV_OFFSET = np.uint64(14695981039346656037)
_FNV_PRIME = np.uint64(1099511628211)
_MIX = np.uint64(0xFF51AFD7ED558CCD)
_SHIFT = np.uint64(33)
_LOW32 = np.int64(0xFFFFFFFF)


def pack_items(pieces, replace_space: str | None = None):
    """(code points, item_start, item_stop, item_token) of raw-text pieces (str) and token ids (int), as
    the encoders take them; `replace_space` stands for every U+0020 of the text."""
    texts: list[str] = []
    starts: list[int] = []
    tokens: list[int] = []
    at = 0
    for piece in pieces:
        starts.append(at)
        if isinstance(piece, int):
            tokens.append(piece)
        else:
            texts.append(piece)
            tokens.append(-1)
            at += len(piece)
    text = "".join(texts)
    if replace_space is not None:
        text = text.replace(" ", replace_space)
    cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)
    item_start = np.array(starts, np.int64)
    item_stop = np.empty_like(item_start)
    item_stop[:-1] = item_start[1:]
    item_stop[-1:] = at
    return cps, item_start, item_stop, np.array(tokens, np.int64)


def table_slots(n: int) -> int:
    """A power of two at least twice `n`: the open-addressing tables stay at most half full."""
    return 1 << max(4, (2 * n - 1).bit_length())


# -- hashing ------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _mix(h):
    h ^= h >> _SHIFT
    h *= _MIX
    return h ^ (h >> _SHIFT)


@njit(cache=True, nogil=True)
def _hash_span(cps, start, stop):
    h = _FNV_OFFSET
    for i in range(start, stop):
        h = (h ^ np.uint64(cps[i])) * _FNV_PRIME
    return _mix(h)


@njit(cache=True, nogil=True)
def _same_span(a, a_start, b, b_start, n):
    for k in range(n):
        if a[a_start + k] != b[b_start + k]:
            return False
    return True


@njit(cache=True, nogil=True)
def _pair_slot(key, mask):
    return np.int64(_mix(np.uint64(key)) & np.uint64(mask))


@njit(cache=True, nogil=True)
def build_pair_table(lefts, rights, ranks, n_slots):
    """Open-addressing table (left << 32 | right) -> rank; the first rank given for a pair wins."""
    keys = np.full(n_slots, _EMPTY, np.int64)
    values = np.zeros(n_slots, np.int32)
    mask = n_slots - 1
    for k in range(lefts.size):
        key = (np.int64(lefts[k]) << 32) | np.int64(rights[k])
        slot = _pair_slot(key, mask)
        while keys[slot] != _EMPTY and keys[slot] != key:
            slot = (slot + 1) & mask
        if keys[slot] == _EMPTY:
            keys[slot] = key
            values[slot] = ranks[k]
    return keys, values


@njit(cache=True, nogil=True)
def _pair_rank(keys, values, left, right):
    key = (np.int64(left) << 32) | np.int64(right)
    mask = keys.size - 1
    slot = _pair_slot(key, mask)
    while True:
        found = keys[slot]
        if found == key:
            return np.int64(values[slot])
        if found == _EMPTY:
            return np.int64(-1)
        slot = (slot + 1) & mask


@njit(cache=True, nogil=True)
def build_text_table(tok_cps, tok_off, n_slots):
    """Open-addressing table text -> token id over the token texts `tok_cps[tok_off[i]:tok_off[i + 1]]`;
    of equal texts the last id wins (as `Vocabulary.token_to_id`)."""
    hashes = np.zeros(n_slots, np.uint64)
    ids = np.full(n_slots, _EMPTY, np.int32)
    mask = n_slots - 1
    for token in range(tok_off.size - 1):
        start, stop = tok_off[token], tok_off[token + 1]
        h = _hash_span(tok_cps, start, stop)
        slot = np.int64(h & np.uint64(mask))
        while ids[slot] != _EMPTY:
            other = ids[slot]
            if (
                hashes[slot] == h
                and tok_off[other + 1] - tok_off[other] == stop - start
                and _same_span(tok_cps, tok_off[other], tok_cps, start, stop - start)
            ):
                break
            slot = (slot + 1) & mask
        hashes[slot] = h
        ids[slot] = token
    return hashes, ids


@njit(cache=True, nogil=True)
def _text_id(hashes, ids, tok_cps, tok_off, cps, start, stop):
    """The token whose text is cps[start:stop], or -1."""
    h = _hash_span(cps, start, stop)
    mask = ids.size - 1
    slot = np.int64(h & np.uint64(mask))
    n = stop - start
    while True:
        token = ids[slot]
        if token == _EMPTY:
            return np.int64(-1)
        if (
            hashes[slot] == h
            and tok_off[token + 1] - tok_off[token] == n
            and _same_span(tok_cps, tok_off[token], cps, start, n)
        ):
            return np.int64(token)
        slot = (slot + 1) & mask


# -- the merge heap: (priority << 32 | left position) keys, the pair's expected length beside ----------


@njit(cache=True, nogil=True)
def _heap_push(keys, values, size, key, value):
    i = size
    while i > 0:
        parent = (i - 1) >> 1
        if keys[parent] <= key:
            break
        keys[i] = keys[parent]
        values[i] = values[parent]
        i = parent
    keys[i] = key
    values[i] = value
    return size + 1


@njit(cache=True, nogil=True)
def _heap_pop(keys, values, size):
    """Drop the root (read keys[0], values[0] first); the new size."""
    size -= 1
    key, value = keys[size], values[size]
    i = 0
    while True:
        child = 2 * i + 1
        if child >= size:
            break
        if child + 1 < size and keys[child + 1] < keys[child]:
            child += 1
        if keys[child] >= key:
            break
        keys[i] = keys[child]
        values[i] = values[child]
        i = child
    if size > 0:
        keys[i] = key
        values[i] = value
    return size


@njit(cache=True, nogil=True)
def _link(nxt, prv, m):
    for k in range(m):
        nxt[k] = k + 1
        prv[k] = k - 1
    if m:
        nxt[m - 1] = -1


@njit(cache=True, nogil=True)
def _unlink(size_of, nxt, prv, left, right, total):
    """Merge symbol `right` into `left` (their sizes add up to `total`); the new right neighbour or -1."""
    size_of[left] = total
    size_of[right] = 0
    after = nxt[right]
    nxt[left] = after
    if after >= 0:
        prv[after] = left
    return after


# -- output and the per-call word cache ------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _reserve(out, n_out, extra):
    if n_out + extra <= out.size:
        return out
    grown = np.empty(max(2 * out.size, n_out + extra), np.int32)
    grown[:n_out] = out[:n_out]
    return grown


@njit(cache=True, nogil=True)
def _emit(out, n_out, token):
    out = _reserve(out, n_out, np.int64(1))
    out[n_out] = token
    return out, n_out + 1


@njit(cache=True, nogil=True)
def _word_cache(n_chars):
    """(hashes, rows, used) of a word cache for a text of `n_chars`: a row is (start, length, first
    output, count) of a word's first occurrence, whose ids a repeat copies; start -1 where empty."""
    n_slots = 256
    while n_slots < n_chars and n_slots < _WORD_CACHE_SLOTS:
        n_slots *= 2
    rows = np.zeros((n_slots, 4), np.int64)
    rows[:, 0] = _EMPTY
    return np.zeros(n_slots, np.uint64), rows, np.zeros(1, np.int64)


@njit(cache=True, nogil=True)
def _cache_slot(cache, cps, start, stop):
    """The slot of the word cps[start:stop], or the empty slot where it would go; and its hash."""
    hashes, rows, _ = cache
    h = _hash_span(cps, start, stop)
    mask = hashes.size - 1
    slot = np.int64(h & np.uint64(mask))
    width = stop - start
    while rows[slot, 0] != _EMPTY:
        if hashes[slot] == h and rows[slot, 1] == width and _same_span(cps, rows[slot, 0], cps, start, width):
            break
        slot = (slot + 1) & mask
    return slot, h


@njit(cache=True, nogil=True)
def _cached_ids(cache, slot, out, n_out):
    """Append the ids of the word in `slot` (its first occurrence's); False where the slot is empty."""
    rows = cache[1]
    if rows[slot, 0] == _EMPTY:
        return False, out, n_out
    first, count = rows[slot, 2], rows[slot, 3]
    out = _reserve(out, n_out, count)
    out[n_out : n_out + count] = out[first : first + count]
    return True, out, n_out + count


@njit(cache=True, nogil=True)
def _cache_word(cache, slot, h, start, stop, first, n_out):
    """Remember that the word cps[start:stop] gave out[first:n_out] (while the table is half empty)."""
    hashes, rows, used = cache
    if 2 * used[0] < hashes.size:
        hashes[slot] = h
        rows[slot, 0] = start
        rows[slot, 1] = stop - start
        rows[slot, 2] = first
        rows[slot, 3] = n_out - first
        used[0] += 1


@njit(cache=True, nogil=True)
def _utf8(cp, dest, at):
    """Write code point `cp` as UTF-8 at dest[at:]; the position after it."""
    if cp < 0x80:
        dest[at] = cp
        return at + 1
    if cp < 0x800:
        dest[at] = 0xC0 | (cp >> 6)
        dest[at + 1] = 0x80 | (cp & 0x3F)
        return at + 2
    if cp < 0x10000:
        dest[at] = 0xE0 | (cp >> 12)
        dest[at + 1] = 0x80 | ((cp >> 6) & 0x3F)
        dest[at + 2] = 0x80 | (cp & 0x3F)
        return at + 3
    dest[at] = 0xF0 | (cp >> 18)
    dest[at + 1] = 0x80 | ((cp >> 12) & 0x3F)
    dest[at + 2] = 0x80 | ((cp >> 6) & 0x3F)
    dest[at + 3] = 0x80 | (cp & 0x3F)
    return at + 4


@njit(cache=True, nogil=True)
def _scratch(room):
    """Per-word arrays for words of up to `room` symbols: symbol, size, next, previous, and the heap's
    keys and values (at most 3 entries a symbol: one per initial pair, two per merge)."""
    return (
        np.empty(room, np.int32),
        np.empty(room, np.int32),
        np.empty(room, np.int32),
        np.empty(room, np.int32),
        np.empty(3 * room, np.int64),
        np.empty(3 * room, np.int32),
    )


# -- GPT-2 byte-level BPE --------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _run_end(cps, classes, i, end, cls):
    while i < end and classes[cps[i]] & cls:
        i += 1
    return i


@njit(cache=True, nogil=True)
def _other_end(cps, classes, i, end):
    while i < end and classes[cps[i]] == 0:
        i += 1
    return i


@njit(cache=True, nogil=True)
def gpt2_word_end(cps, classes, i, end):
    """End of the GPT-2 regex's match at `i` in cps[:end] (the regex is spelled out in
    unicode.gpt2_pattern; alternatives are tried in its order, lookahead stops at `end`)."""
    c = cps[i]
    if c == _APOSTROPHE and i + 1 < end:  # 's|'t|'re|'ve|'m|'ll|'d
        c1 = cps[i + 1]
        if c1 == _S or c1 == _T or c1 == _M or c1 == _D:
            return i + 2
        if i + 2 < end:
            c2 = cps[i + 2]
            if (c1 == _R and c2 == _E) or (c1 == _V and c2 == _E) or (c1 == _L and c2 == _L):
                return i + 3
    spaced = c == _BLANK and i + 1 < end
    next_class = classes[cps[i + 1]] if spaced else 0
    own_class = classes[c]
    for cls in (_LETTER, _NUMBER):  # ' ?\p{L}+', ' ?\p{N}+'
        if spaced and next_class & cls:
            return _run_end(cps, classes, i + 1, end, cls)
        if own_class & cls:
            return _run_end(cps, classes, i, end, cls)
    if spaced and next_class == 0:  # ' ?[^\s\p{L}\p{N}]+'
        return _other_end(cps, classes, i + 1, end)
    if own_class == 0:
        return _other_end(cps, classes, i, end)
    j = _run_end(cps, classes, i, end, np.int64(_SPACE))  # '\s+(?!\S)|\s+'
    if j < end and j - i >= 2:
        return j - 1
    return j


@njit(cache=True, nogil=True)
def _ascii_lower(c):
    return c + 32 if 65 <= c <= 90 else c


@njit(cache=True, nogil=True)
def llama3_word_end(cps, classes, i, end, max_digits):
    """End of the Llama 3 regex's match at `i` in cps[:end] (unicode.llama3_pattern; Qwen2's where
    `max_digits` is 1); alternatives are tried in the regex's order, lookahead stops at `end`."""
    c = cps[i]
    if c == _APOSTROPHE and i + 1 < end:  # (?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])
        c1 = _ascii_lower(cps[i + 1])
        if c1 == _S or c1 == _T or c1 == _M or c1 == _D:
            return i + 2
        if i + 2 < end:
            c2 = _ascii_lower(cps[i + 2])
            if (c1 == _R and c2 == _E) or (c1 == _V and c2 == _E) or (c1 == _L and c2 == _L):
                return i + 3
    own_class = classes[c]
    if own_class & _LETTER:  # [^\r\n\p{L}\p{N}]?\p{L}+, without the optional character
        return _run_end(cps, classes, i, end, np.int64(_LETTER))
    if c != _CR and c != _LF and not own_class & _NUMBER and i + 1 < end and classes[cps[i + 1]] & _LETTER:
        return _run_end(cps, classes, i + 1, end, np.int64(_LETTER))
    if own_class & _NUMBER:  # \p{N}{1,max_digits}
        j = i + 1
        while j < end and j - i < max_digits and classes[cps[j]] & _NUMBER:
            j += 1
        return j
    start = i + 1 if c == _BLANK and i + 1 < end and classes[cps[i + 1]] == 0 else i
    if classes[cps[start]] == 0:  # ' ?[^\s\p{L}\p{N}]+[\r\n]*'
        j = _other_end(cps, classes, start, end)
        while j < end and (cps[j] == _CR or cps[j] == _LF):
            j += 1
        return j
    j = _run_end(cps, classes, i, end, np.int64(_SPACE))  # what is left starts with \s
    for k in range(j - 1, i - 1, -1):  # '\s*[\r\n]+': up to the run's last line break
        if cps[k] == _CR or cps[k] == _LF:
            return k + 1
    if j < end and j - i >= 2:  # '\s+(?!\S)|\s+'
        return j - 1
    return j


@njit(cache=True, nogil=True)
def _bpe_merge(sym, size_of, nxt, prv, m, pair_keys, pair_values, merge_result, heap_keys, heap_values):
    """Merge the word sym[:m] (one byte each) by rank, lowest first, leftmost among equals."""
    _link(nxt, prv, m)
    size = np.int64(0)
    for k in range(m - 1):
        rank = _pair_rank(pair_keys, pair_values, sym[k], sym[k + 1])
        if rank >= 0:
            size = _heap_push(heap_keys, heap_values, size, (rank << 32) | k, np.int64(2))
    while size:
        key, total = heap_keys[0], heap_values[0]
        size = _heap_pop(heap_keys, heap_values, size)
        left = key & _LOW32
        right = nxt[left]
        # outdated when either side has merged since (a symbol only grows)
        if size_of[left] == 0 or right < 0 or size_of[left] + size_of[right] != total:
            continue
        sym[left] = merge_result[key >> 32]
        after = _unlink(size_of, nxt, prv, left, right, total)
        before = prv[left]
        if before >= 0:
            rank = _pair_rank(pair_keys, pair_values, sym[before], sym[left])
            if rank >= 0:
                size = _heap_push(
                    heap_keys, heap_values, size, (rank << 32) | before, size_of[before] + total
                )
        if after >= 0:
            rank = _pair_rank(pair_keys, pair_values, sym[left], sym[after])
            if rank >= 0:
                size = _heap_push(heap_keys, heap_values, size, (rank << 32) | left, total + size_of[after])


@njit(cache=True, nogil=True)
def bpe_encode(
    cps,
    item_start,
    item_stop,
    item_token,
    classes,
    word_split,
    digits_apart,
    max_digits,
    byte_symbol,
    pair_keys,
    pair_values,
    merge_result,
    n_vocab,
    fallback_off,
    fallback_ids,
    whole_words,
):
    """Token ids of a sequence of items: text cps[item_start[k]:item_stop[k]], or, where item_token[k] >= 0,
    that token itself (a special token found by the partition).

    Words: every \\p{N} alone when `digits_apart`, then the `word_split` split (`WordSplit`) of what lies
    between. Each word's UTF-8 bytes start as `byte_symbol[b]`; symbols >= n_vocab are merge results that
    are not tokens, emitted as `fallback_ids[fallback_off[s - n_vocab]:fallback_off[s - n_vocab + 1]]`.
    `whole_words` (byte_chars, text_hashes, text_ids, tok_cps, tok_off), where byte_chars is not empty:
    a word whose GPT-2 characters (byte_chars[b]) are a token's text is that token, unmerged
    (`ignore_merges`). A word seen before in this call copies its first occurrence's ids (the word cache)."""
    out = np.empty(cps.size // 2 + item_token.size + 16, np.int32)
    n_out = np.int64(0)
    cache = _word_cache(cps.size)
    room = np.int64(64)
    sym, size_of, nxt, prv, heap_keys, heap_values = _scratch(room)
    word_chars = np.empty(room, np.uint32)
    byte_chars, text_hashes, text_ids, tok_cps, tok_off = whole_words
    whole = byte_chars.size > 0
    utf8 = np.empty(4, np.uint8)
    for item in range(item_token.size):
        if item_token[item] >= 0:
            out, n_out = _emit(out, n_out, np.int64(item_token[item]))
            continue
        stop = item_stop[item]
        segment_end = 0
        i = item_start[item]
        while i < stop:
            if digits_apart and classes[cps[i]] & _NUMBER:
                j = i + 1
            else:
                if i >= segment_end:
                    segment_end = stop
                    if digits_apart:
                        segment_end = i
                        while segment_end < stop and not classes[cps[segment_end]] & _NUMBER:
                            segment_end += 1
                if word_split == _LLAMA3_SPLIT:
                    j = llama3_word_end(cps, classes, i, segment_end, max_digits)
                else:
                    j = gpt2_word_end(cps, classes, i, segment_end)
            slot, h = _cache_slot(cache, cps, i, j)
            hit, out, n_out = _cached_ids(cache, slot, out, n_out)
            if hit:
                i = j
                continue
            if 4 * (j - i) > room:
                room = 4 * (j - i)
                sym, size_of, nxt, prv, heap_keys, heap_values = _scratch(room)
                word_chars = np.empty(room, np.uint32)
            m = np.int64(0)
            for k in range(i, j):
                n_bytes = _utf8(cps[k], utf8, 0)
                for b in range(n_bytes):
                    sym[m] = byte_symbol[utf8[b]]
                    size_of[m] = 1
                    if whole:
                        word_chars[m] = byte_chars[utf8[b]]
                    m += 1
            if whole and m > 1:
                token = _text_id(text_hashes, text_ids, tok_cps, tok_off, word_chars, 0, m)
                if token >= 0:
                    first = n_out
                    out, n_out = _emit(out, n_out, token)
                    _cache_word(cache, slot, h, i, j, first, n_out)
                    i = j
                    continue
            _bpe_merge(
                sym, size_of, nxt, prv, m, pair_keys, pair_values, merge_result, heap_keys, heap_values
            )
            first = n_out
            k = 0  # the first symbol is never merged away
            while k >= 0:
                s = sym[k]
                if s < n_vocab:
                    out, n_out = _emit(out, n_out, np.int64(s))
                else:
                    lo, hi = fallback_off[s - n_vocab], fallback_off[s - n_vocab + 1]
                    out = _reserve(out, n_out, hi - lo)
                    out[n_out : n_out + hi - lo] = fallback_ids[lo:hi]
                    n_out += hi - lo
                k = nxt[k]
            _cache_word(cache, slot, h, i, j, first, n_out)
            i = j
    return out[:n_out]


# -- SentencePiece-style BPE ---------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _spm_push(cps, base, left, stop, size, heap_keys, heap_values, tables):
    """Queue the pair spanning cps[base + left:base + stop] if its concatenation is a token."""
    text_hashes, text_ids, tok_cps, tok_off, score_rank = tables
    token = _text_id(text_hashes, text_ids, tok_cps, tok_off, cps, base + left, base + stop)
    if token < 0:
        return size
    return _heap_push(heap_keys, heap_values, size, (np.int64(score_rank[token]) << 32) | left, stop - left)


@njit(cache=True, nogil=True)
def _spm_merge(cps, base, m, size_of, nxt, prv, heap_keys, heap_values, tables, max_token_len):
    """Merge the word cps[base:base + m] (one character each): the pair whose concatenation is the token
    of the best score (`score_rank`, 0 best) first, leftmost among equals. Symbol k is the span
    cps[base + k:base + k + size_of[k]]."""
    _link(nxt, prv, m)
    for k in range(m):
        size_of[k] = 1
    size = np.int64(0)
    if max_token_len >= 2:
        for k in range(m - 1):
            size = _spm_push(cps, base, np.int64(k), np.int64(k + 2), size, heap_keys, heap_values, tables)
    while size:
        key, total = heap_keys[0], heap_values[0]
        size = _heap_pop(heap_keys, heap_values, size)
        left = key & _LOW32
        right = nxt[left]
        if size_of[left] == 0 or right < 0 or size_of[left] + size_of[right] != total:
            continue  # outdated: a side has merged since
        after = _unlink(size_of, nxt, prv, left, right, total)
        before = prv[left]
        if before >= 0 and size_of[before] + total <= max_token_len:
            size = _spm_push(
                cps, base, np.int64(before), np.int64(left + total), size, heap_keys, heap_values, tables
            )
        if after >= 0 and total + size_of[after] <= max_token_len:
            size = _spm_push(
                cps,
                base,
                np.int64(left),
                np.int64(after + size_of[after]),
                size,
                heap_keys,
                heap_values,
                tables,
            )


@njit(cache=True, nogil=True)
def spm_encode(
    cps,
    item_start,
    item_stop,
    item_token,
    text_hashes,
    text_ids,
    tok_cps,
    tok_off,
    max_token_len,
    score_rank,
    space_joiners,
    byte_ids,
    unk_id,
):
    """Token ids of a sequence of items (text cps[item_start[k]:item_stop[k]], spaces already U+2581, or
    the token item_token[k] where >= 0), and -1; or no ids and the byte that has neither a byte token
    nor an unknown token to stand for it.

    A text item is merged word by word, a word starting at each U+2581 that follows a character not in
    `space_joiners` (sorted: the characters that precede a U+2581 inside some token): no token spans
    such a boundary, so no merge does, and the words merge exactly as the whole text would. A word
    seen before in this call copies its first occurrence's ids (the word cache)."""
    tables = (text_hashes, text_ids, tok_cps, tok_off, score_rank)
    out = np.empty(cps.size // 2 + item_token.size + 16, np.int32)
    n_out = np.int64(0)
    cache = _word_cache(cps.size)
    room = np.int64(64)
    _, size_of, nxt, prv, heap_keys, heap_values = _scratch(room)
    utf8 = np.empty(4, np.uint8)
    for item in range(item_token.size):
        if item_token[item] >= 0:
            out, n_out = _emit(out, n_out, np.int64(item_token[item]))
            continue
        i, stop = item_start[item], item_stop[item]
        while i < stop:
            j = i + 1
            while j < stop and not (cps[j] == _SPACE_MARK and not _contains(space_joiners, cps[j - 1])):
                j += 1
            slot, h = _cache_slot(cache, cps, i, j)
            hit, out, n_out = _cached_ids(cache, slot, out, n_out)
            if hit:
                i = j
                continue
            m = j - i
            if m > room:
                room = m
                _, size_of, nxt, prv, heap_keys, heap_values = _scratch(room)
            _spm_merge(cps, i, m, size_of, nxt, prv, heap_keys, heap_values, tables, max_token_len)
            first = n_out
            k = 0
            while k >= 0:
                start, end = i + k, i + k + size_of[k]
                token = -1
                if size_of[k] <= max_token_len:
                    token = _text_id(text_hashes, text_ids, tok_cps, tok_off, cps, start, end)
                if token >= 0:
                    out, n_out = _emit(out, n_out, np.int64(token))
                else:  # only an unmerged character can miss the vocabulary: byte fallback
                    for c in range(start, end):
                        n_bytes = _utf8(cps[c], utf8, 0)
                        for b in range(n_bytes):
                            byte_id = byte_ids[utf8[b]]
                            if byte_id < 0:
                                byte_id = unk_id
                            if byte_id < 0:
                                return out[:0], np.int64(utf8[b])
                            out, n_out = _emit(out, n_out, np.int64(byte_id))
                k = nxt[k]
            _cache_word(cache, slot, h, i, j, first, n_out)
            i = j
    return out[:n_out], np.int64(-1)


@njit(cache=True, nogil=True)
def _contains(sorted_values, value):
    at = np.searchsorted(sorted_values, value)
    return at < sorted_values.size and sorted_values[at] == value
