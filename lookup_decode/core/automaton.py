"""Numba kernels of the suffix index: an online suffix automaton over int32 token ids.

The automaton (Blumer et al. 1985; the classic online construction) gives, after each appended
token, the longest suffix of the text that also ends at an earlier position: `link(last)`.
Each state keeps `first`, the end position of its earliest occurrence, which is O(1) to maintain.
Transitions live in one open-addressing hash table keyed by (state, token), so the alphabet
(a model vocabulary of 50k-250k ids) costs nothing per state; each state also threads its
outgoing edges in a linked list, which the clone step of the construction needs to copy.

Every kernel takes arrays and ints and writes into caller-owned buffers; `index.py` owns the
buffers' layout and grows them (`pool.py` keeps many of them and calls these kernels from its own).
"""

import numpy as np
from numba import njit

# meta[] slots: the automaton's scalar state, kept in one int64 array so kernels can update it.
# ANCHOR: where the copied source region was expected to continue when the copy last broke (-1: none).
N_TOKENS, N_STATES, N_EDGES, LAST, MATCH_END, MATCH_LEN, ANCHOR = range(7)
META_SIZE = 7
# Local re-sync compares at most this many tokens backwards per candidate; a longer global match is
# taken as is (it is strong evidence already, and the bound keeps a miss O(window * LOCAL_MAX)).
LOCAL_MAX = 64
# `follow` re-synchronises near a copy that broke only once the copy held this many tokens: a chance match of a few
# tokens (a prompt walked over a request's prediction) sets no anchor.
ANCHOR_MIN = 4
_EMPTY = -1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@njit(cache=True, nogil=True)
def _slot(hkey, key):
    """Slot of `key` in the linear-probing table `hkey` (int64 [2^b]), or of the empty slot where it would go."""
    mask = hkey.shape[0] - 1
    h = np.uint64(key) * _GOLDEN
    i = np.int64((h >> np.uint64(32)) & np.uint64(mask))
    while hkey[i] != key and hkey[i] != _EMPTY:
        i = (i + 1) & mask
    return i


@njit(cache=True, nogil=True)
def _edge(hkey, hval, state, token):
    """Edge index of the transition (state, token), or -1."""
    i = _slot(hkey, (np.int64(state) << 31) | token)
    if hkey[i] == _EMPTY:
        return -1
    return hval[i]


@njit(cache=True, nogil=True)
def _add_edge(etok, eto, enext, shead, hkey, hval, meta, state, token, target):
    e = meta[N_EDGES]
    meta[N_EDGES] = e + 1
    etok[e] = token
    eto[e] = target
    enext[e] = shead[state]
    shead[state] = e
    key = (np.int64(state) << 31) | token
    i = _slot(hkey, key)
    hkey[i] = key
    hval[i] = e


@njit(cache=True, nogil=True)
def _new_state(slen, slink, sfirst, shead, meta, length, link, first):
    s = meta[N_STATES]
    meta[N_STATES] = s + 1
    slen[s] = length
    slink[s] = link
    sfirst[s] = first
    shead[s] = -1
    return s


@njit(cache=True, nogil=True)
def init_automaton(slen, slink, sfirst, shead, meta):
    """Reset meta and create the root state (empty string)."""
    meta[:] = 0
    meta[MATCH_END] = -1
    meta[ANCHOR] = -1
    _new_state(slen, slink, sfirst, shead, meta, 0, -1, -1)
    meta[LAST] = 0


@njit(cache=True, nogil=True)
def local_match(toks, i, top, length, anchor, window):
    """End of the occurrence of toks[i - length + 1: i + 1] whose continuation starts nearest to `anchor`,
    within `window` of it (ties: the earlier one); -1 when none.

    Only occurrences ending at or before `top` count. Cost O(window * length).
    """
    lo = max(anchor - window - 1, length - 1)
    hi = min(anchor + window - 1, top)
    best, best_dist = -1, window + 1
    for e in range(lo, hi + 1):
        if toks[e] != toks[i]:
            continue
        m = 1
        while m < length and toks[e - m] == toks[i - m]:
            m += 1
        dist = abs(e + 1 - anchor)
        if m == length and dist < best_dist:
            best, best_dist = e, dist
    return best


@njit(cache=True, nogil=True)
def extend(toks, slen, slink, sfirst, shead, etok, eto, enext, hkey, hval, meta, new, window):
    """Append `new` (int32 [m]) to the text and update the automaton and the current match.

    Buffers must already hold room for the result: toks >= n + m, states >= 2(n + m) + 1,
    edges >= 3(n + m), hash slots >= 2 * edges (index.py guarantees it). Amortized O(1) per token.

    Match rule, applied after each token c at position i:
    1. Follow: if the earlier occurrence being copied (ending at meta[MATCH_END]) continues with c,
       follow it (the match grows by one and stays aligned with the same source region).
    2. Re-sync: otherwise the copy broke. The source token after the old match end is taken as
       replaced by c, so the region would continue one further (the anchor; with no match at all,
       the anchor advances by one per token). Among occurrences of the longest matching suffix
       whose continuation starts within `window` of the anchor, take the nearest (ties: the
       earlier), so small insertions, deletions and substitutions stay in the same region.
       Skipped when window == 0 or the suffix is longer than LOCAL_MAX.
    3. Otherwise jump to the earliest earlier occurrence of the longest matching suffix.
    Either way meta[MATCH_LEN] is the length of the longest suffix of the text that also ends
    before i (0 when none does); the rules only choose which of its occurrences is copied.
    """
    for t in range(new.shape[0]):
        c = np.int64(new[t])
        i = meta[N_TOKENS]
        toks[i] = c
        meta[N_TOKENS] = i + 1
        last = meta[LAST]
        cur = _new_state(slen, slink, sfirst, shead, meta, slen[last] + 1, -1, i)
        p = last
        while p != -1 and _edge(hkey, hval, p, c) == -1:
            _add_edge(etok, eto, enext, shead, hkey, hval, meta, p, c, cur)
            p = slink[p]
        if p == -1:
            slink[cur] = 0
        else:
            q = eto[_edge(hkey, hval, p, c)]
            if slen[p] + 1 == slen[q]:
                slink[cur] = q
            else:
                clone = _new_state(slen, slink, sfirst, shead, meta, slen[p] + 1, slink[q], sfirst[q])
                e = shead[q]
                while e != -1:
                    _add_edge(etok, eto, enext, shead, hkey, hval, meta, clone, etok[e], eto[e])
                    e = enext[e]
                while p != -1:
                    e = _edge(hkey, hval, p, c)
                    if e == -1 or eto[e] != q:
                        break
                    eto[e] = clone
                    p = slink[p]
                slink[q] = clone
                slink[cur] = clone
        meta[LAST] = cur

        end = meta[MATCH_END]
        if meta[MATCH_LEN] > 0 and end + 1 < i and toks[end + 1] == c:
            meta[MATCH_END] = end + 1
            meta[MATCH_LEN] += 1
        else:
            if meta[MATCH_LEN] > 0:
                meta[ANCHOR] = end + 2
            elif meta[ANCHOR] >= 0:
                meta[ANCHOR] += 1
            s = slink[cur]
            length = slen[s]
            meta[MATCH_LEN] = length
            meta[MATCH_END] = sfirst[s] if length > 0 else -1
            if window > 0 and 0 < length <= LOCAL_MAX and meta[ANCHOR] >= 0:
                e = local_match(toks, i, i - 1, length, meta[ANCHOR], window)
                if e >= 0:
                    meta[MATCH_END] = e


@njit(cache=True, nogil=True)
def branched(shead, enext, state):
    """1 if `state` has more than one outgoing edge (the text went on in more than one way after it), else 0."""
    e = shead[state]
    return 1 if e != -1 and enext[e] != -1 else 0


@njit(cache=True, nogil=True)
def match_branched(slink, shead, enext, meta):
    """`branched` of the state of the current match (the longest suffix that occurred before: link(last))."""
    return branched(shead, enext, slink[meta[LAST]])


@njit(cache=True, nogil=True)
def rehash(shead, etok, enext, n_states, hkey, hval):
    """Rebuild the (state, token) -> edge table into an empty, larger `hkey`/`hval`."""
    for s in range(n_states):
        e = shead[s]
        while e != -1:
            key = (np.int64(s) << 31) | np.int64(etok[e])
            i = _slot(hkey, key)
            hkey[i] = key
            hval[i] = e
            e = enext[e]


@njit(cache=True, nogil=True)
def draft_length(toks, n, start, max_tokens, eos):
    """Number of tokens of toks[start:n] to draft: at most max_tokens, stopping before any id in eos (int32 [e])."""
    stop = min(n, start + max_tokens)
    for j in range(start, stop):
        for k in range(eos.shape[0]):
            if toks[j] == eos[k]:
                return j - start
    return max(stop - start, 0)


@njit(cache=True, nogil=True)
def follow(toks, n, slen, slink, sfirst, eto, hkey, hval, cursor, new, window):
    """Advance `cursor` over `new` (int32 [m]), tokens of *another* text (matching statistics).

    cursor (int64 [5]): automaton state, length of the longest suffix of the other text that occurs
    in this one, end position of the occurrence being copied, length matched there, anchor. The rule
    of `extend`: keep following the copied occurrence while toks[end + 1] continues the other text;
    otherwise, with window > 0, the occurrence of the longest matching suffix whose continuation starts
    nearest to the anchor (where the last copy of >= ANCHOR_MIN tokens would have gone on, advanced by one per
    token matched nowhere) within `window` — a diff's
    re-synchronisation after an insertion, deletion or substitution, the way a request's prediction is
    followed — else the earliest one (the state's `first`). Reads the automaton only; O(1) amortized
    per token (O(window * length) after a break, with window > 0).
    """
    state, length, end, occ, anchor = cursor[0], cursor[1], cursor[2], cursor[3], cursor[4]
    for t in range(new.shape[0]):
        c = np.int64(new[t])
        while state != 0 and _edge(hkey, hval, state, c) == -1:
            state = slink[state]
            length = slen[state]
        e = _edge(hkey, hval, state, c)
        if e == -1:
            state, length = 0, 0
        else:
            state, length = eto[e], length + 1
        if occ > 0 and end + 1 < n and toks[end + 1] == c:
            end, occ = end + 1, occ + 1
        else:
            if occ >= ANCHOR_MIN:
                anchor = end + 2
            elif anchor >= 0:
                anchor += 1
            occ = length
            end = sfirst[state] if length > 0 else -1
            if window > 0 and 0 < length <= LOCAL_MAX and anchor >= 0:
                e = local_match(toks, end, n - 1, length, anchor, window)
                if e >= 0:
                    end = e
    cursor[0], cursor[1], cursor[2], cursor[3], cursor[4] = state, length, end, occ, anchor
