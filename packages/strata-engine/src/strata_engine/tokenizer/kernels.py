"""The compiled hot loops of the encoders (numba, compiled once and cached on disk): the GPT-2 split,
the BPE merge loop over integer symbols with a binary heap, open-addressing hash tables (merge pairs,
token texts, the per-call word cache).

They take and return NumPy arrays only, so they run without the GIL (`nogil`): a thread tokenizing a
long prompt does not hold up the others. bpe.py and spm.py build their tables and call them;
reference.py is the pure-Python oracle they must agree with.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .unicode import CharClass

_LETTER = int(CharClass.LETTER)
_NUMBER = int(CharClass.NUMBER)
_SPACE = int(CharClass.SPACE)
_APOSTROPHE, _BLANK = ord("'"), ord(" ")
_S, _T, _M, _D, _R, _V, _L, _E = (ord(c) for c in "stmdrvle")

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
            if (hashes[slot] == h and tok_off[other + 1] - tok_off[other] == stop - start
                    and _same_span(tok_cps, tok_off[other], tok_cps, start, stop - start)):
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
        if (hashes[slot] == h and tok_off[token + 1] - tok_off[token] == n
                and _same_span(tok_cps, tok_off[token], cps, start, n)):
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


# -- output -------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _reserve(out, n_out, extra):
    if n_out + extra <= out.size:
        return out
    grown = np.empty(max(2 * out.size, n_out + extra), np.int32)
    grown[:n_out] = out[:n_out]
    return grown


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
    j = _run_end(cps, classes, i, end, _SPACE)  # '\s+(?!\S)|\s+'
    if j < end and j - i >= 2:
        return j - 1
    return j


@njit(cache=True, nogil=True)
def _bpe_merge(sym, size_of, nxt, prv, m, pair_keys, pair_values, merge_result, heap_keys, heap_values):
    """Merge the word sym[:m] (one byte each) by rank, lowest first, leftmost among equals."""
    _link(nxt, prv, m)
    size = 0
    for k in range(m - 1):
        rank = _pair_rank(pair_keys, pair_values, sym[k], sym[k + 1])
        if rank >= 0:
            size = _heap_push(heap_keys, heap_values, size, (rank << 32) | k, 2)
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
                size = _heap_push(heap_keys, heap_values, size, (rank << 32) | before, size_of[before] + total)
        if after >= 0:
            rank = _pair_rank(pair_keys, pair_values, sym[left], sym[after])
            if rank >= 0:
                size = _heap_push(heap_keys, heap_values, size, (rank << 32) | left, total + size_of[after])


@njit(cache=True, nogil=True)
def bpe_encode(cps, item_start, item_stop, item_token, classes, digits_apart, byte_symbol, pair_keys, pair_values,
               merge_result, n_vocab, fallback_off, fallback_ids):
    """Token ids of a sequence of items: text cps[item_start[k]:item_stop[k]], or, where item_token[k] >= 0,
    that token itself (a special token found by the partition).

    Words: every \\p{N} alone when `digits_apart`, then the GPT-2 split of what lies between. Each
    word's UTF-8 bytes start as `byte_symbol[b]`; symbols >= n_vocab are merge results that are not
    tokens, emitted as `fallback_ids[fallback_off[s - n_vocab]:fallback_off[s - n_vocab + 1]]`.
    A word seen before in this call copies its first occurrence's ids (the word cache)."""
    n = cps.size
    out = np.empty(n // 2 + item_token.size + 16, np.int32)
    n_out = 0
    n_slots = 256
    while n_slots < n and n_slots < _WORD_CACHE_SLOTS:
        n_slots *= 2
    mask = n_slots - 1
    cache_hash = np.zeros(n_slots, np.uint64)
    cache_start = np.full(n_slots, _EMPTY, np.int64)
    cache_len = np.zeros(n_slots, np.int64)
    cache_out = np.zeros(n_slots, np.int64)
    cache_n = np.zeros(n_slots, np.int64)
    cached = 0
    room = 64
    sym = np.empty(room, np.int32)
    size_of = np.empty(room, np.int32)
    nxt = np.empty(room, np.int32)
    prv = np.empty(room, np.int32)
    heap_keys = np.empty(3 * room, np.int64)
    heap_values = np.empty(3 * room, np.int32)
    utf8 = np.empty(4, np.uint8)
    for item in range(item_token.size):
        if item_token[item] >= 0:
            out = _reserve(out, n_out, 1)
            out[n_out] = item_token[item]
            n_out += 1
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
                j = gpt2_word_end(cps, classes, i, segment_end)
            width = j - i
            h = _hash_span(cps, i, j)
            slot = np.int64(h & np.uint64(mask))
            hit = False
            while cache_start[slot] != _EMPTY:
                if (cache_hash[slot] == h and cache_len[slot] == width
                        and _same_span(cps, cache_start[slot], cps, i, width)):
                    hit = True
                    break
                slot = (slot + 1) & mask
            if hit:
                first, count = cache_out[slot], cache_n[slot]
                out = _reserve(out, n_out, count)
                out[n_out : n_out + count] = out[first : first + count]
                n_out += count
                i = j
                continue
            if 4 * width > room:
                room = 4 * width
                sym = np.empty(room, np.int32)
                size_of = np.empty(room, np.int32)
                nxt = np.empty(room, np.int32)
                prv = np.empty(room, np.int32)
                heap_keys = np.empty(3 * room, np.int64)
                heap_values = np.empty(3 * room, np.int32)
            m = 0
            for k in range(i, j):
                n_bytes = _utf8(cps[k], utf8, 0)
                for b in range(n_bytes):
                    sym[m] = byte_symbol[utf8[b]]
                    size_of[m] = 1
                    m += 1
            _bpe_merge(sym, size_of, nxt, prv, m, pair_keys, pair_values, merge_result, heap_keys, heap_values)
            first = n_out
            k = 0  # the first symbol is never merged away
            while k >= 0:
                s = sym[k]
                if s < n_vocab:
                    out = _reserve(out, n_out, 1)
                    out[n_out] = s
                    n_out += 1
                else:
                    lo, hi = fallback_off[s - n_vocab], fallback_off[s - n_vocab + 1]
                    out = _reserve(out, n_out, hi - lo)
                    out[n_out : n_out + hi - lo] = fallback_ids[lo:hi]
                    n_out += hi - lo
                k = nxt[k]
            if 2 * cached < n_slots:
                cache_hash[slot] = h
                cache_start[slot] = i
                cache_len[slot] = width
                cache_out[slot] = first
                cache_n[slot] = n_out - first
                cached += 1
            i = j
    return out[:n_out]


# -- SentencePiece-style BPE ---------------------------------------------------------------------------


@njit(cache=True, nogil=True)
def _spm_push(cps, left, stop, size, heap_keys, heap_values, text_hashes, text_ids, tok_cps, tok_off, score_rank):
    """Queue the pair spanning cps[left:stop] if its concatenation is a token."""
    token = _text_id(text_hashes, text_ids, tok_cps, tok_off, cps, left, stop)
    if token < 0:
        return size
    return _heap_push(heap_keys, heap_values, size, (np.int64(score_rank[token]) << 32) | left, stop - left)


@njit(cache=True, nogil=True)
def spm_encode(cps, item_start, item_stop, item_token, text_hashes, text_ids, tok_cps, tok_off, max_token_len,
               score_rank, byte_ids, unk_id):
    """Token ids of a sequence of items (text cps[item_start[k]:item_stop[k]], spaces already U+2581, or
    the token item_token[k] where >= 0), and -1; or no ids and the byte that has neither a byte token
    nor an unknown token to stand for it.

    Symbols are spans cps[k:k + size_of[k]] of one text item; the adjacent pair whose concatenation is
    the token of the best score (`score_rank`, 0 best) merges first, leftmost among equals."""
    n = cps.size
    size_of = np.ones(n, np.int32)
    nxt = np.empty(n, np.int32)
    prv = np.empty(n, np.int32)
    longest = 0
    for item in range(item_token.size):
        longest = max(longest, item_stop[item] - item_start[item])
    heap_keys = np.empty(3 * longest, np.int64)
    heap_values = np.empty(3 * longest, np.int32)
    out = np.empty(n + item_token.size + 16, np.int32)
    n_out = 0
    utf8 = np.empty(4, np.uint8)
    for item in range(item_token.size):
        if item_token[item] >= 0:
            out = _reserve(out, n_out, 1)
            out[n_out] = item_token[item]
            n_out += 1
            continue
        first, stop = item_start[item], item_stop[item]
        if first == stop:
            continue
        for k in range(first, stop):  # positions are absolute: links point into cps
            nxt[k] = k + 1
            prv[k] = k - 1
        nxt[stop - 1] = -1
        prv[first] = -1
        size = 0
        if max_token_len >= 2:
            for k in range(first, stop - 1):
                size = _spm_push(cps, k, k + 2, size, heap_keys, heap_values, text_hashes, text_ids, tok_cps,
                                 tok_off, score_rank)
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
                size = _spm_push(cps, before, left + total, size, heap_keys, heap_values, text_hashes, text_ids,
                                 tok_cps, tok_off, score_rank)
            if after >= 0 and total + size_of[after] <= max_token_len:
                size = _spm_push(cps, left, after + size_of[after], size, heap_keys, heap_values, text_hashes,
                                 text_ids, tok_cps, tok_off, score_rank)
        k = first
        while k >= 0:
            end = k + size_of[k]
            token = -1
            if size_of[k] <= max_token_len:
                token = _text_id(text_hashes, text_ids, tok_cps, tok_off, cps, k, end)
            if token >= 0:
                out = _reserve(out, n_out, 1)
                out[n_out] = token
                n_out += 1
            else:  # only an unmerged character can miss the vocabulary: byte fallback
                for c in range(k, end):
                    n_bytes = _utf8(cps[c], utf8, 0)
                    out = _reserve(out, n_out, n_bytes)
                    for b in range(n_bytes):
                        byte_id = byte_ids[utf8[b]]
                        if byte_id < 0:
                            byte_id = unk_id
                        if byte_id < 0:
                            return out[:0], np.int64(utf8[b])
                        out[n_out] = byte_id
                        n_out += 1
            k = nxt[k]
    return out[:n_out], np.int64(-1)
