"""SuffixIndex: the draft source. Append accepted tokens, ask for the continuation of the current suffix.

The index is an online suffix automaton (see `automaton.py`): `extend` costs amortized O(1) per
token and `propose` costs O(draft), whatever the length of the context, so a 1M-token context
drafts as fast as a 1k one. Only accepted tokens ever enter the index, so it never rolls back.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import numpy as np

from lookup_decode.core import automaton as K
from lookup_decode.core.config import check_match
from lookup_decode.core.draft import Draft
from lookup_decode.core.tokens import as_token_array

# The kernels index tokens, states (2 per token) and edges (3 per token) with int32: past this many tokens
# an edge id would wrap silently, so extend refuses first.
MAX_TOKENS = (2**31 - 1 - 4) // 3


# The layout of an index with room for c tokens (SuffixIndex, and each slot of core.pool.IndexPool): c token ids,
# 4 x (2c + 2) state ints (length, suffix link, first end, first edge), 3 x (3c + 4) edge ints (token, target, next)
# and a hash table (int64 keys, int32 values) of the smallest power of two >= 2 (3c + 4) slots.
def layout(cap: int) -> tuple[int, int, int]:
    """(states, edges, hash slots) of an index with room for cap tokens."""
    edges = 3 * cap + 4
    return 2 * cap + 2, edges, 1 << int(np.ceil(np.log2(2 * edges)))


def room_bytes(cap) -> np.ndarray:
    """int64: bytes the buffers (and meta) of indexes with room for cap tokens hold (0 where cap is 0)."""
    cap = np.asarray(cap, np.int64)
    edges = 3 * cap + 4
    hashes = np.left_shift(1, np.ceil(np.log2(np.maximum(2 * edges, 1))).astype(np.int64))
    return np.where(cap > 0, 4 * cap + 16 * (2 * cap + 2) + 12 * edges + 12 * hashes + 8 * K.META_SIZE, 0)


@functools.lru_cache(maxsize=256)
def room_of(cap: int) -> int:
    """`room_bytes` of one room, an int. Cached (rooms are few: they double), because each numpy call on a scalar
    costs ~5-10 us after a model's forward has streamed through the caches, and a request's first and last calls
    price several rooms."""
    return int(room_bytes(cap))


def buffers(cap: int, fill: bool = True) -> tuple:
    """(tok, st, ed, hk, hv) of an index with room for cap tokens: int32 [cap], int32 [4, states], int32 [3, edges],
    int64 and int32 [hash slots]. fill=False: uninitialized (hk must be set to -1 before use; the automaton writes
    every other entry before it reads it), so that allocating costs no time: a freed block is reused from the heap,
    where zeroing it would be O(room)."""
    states, edges, hashes = layout(cap)
    new = np.zeros if fill else np.empty
    hk = np.full(hashes, -1, np.int64) if fill else np.empty(hashes, np.int64)
    return new(cap, np.int32), new((4, states), np.int32), new((3, edges), np.int32), hk, new(hashes, np.int32)


def room_for(cap: int, need: int) -> int:
    """The room (tokens) buffers of `cap` tokens grow to for `need`: doubled until it fits, at most
    max(MAX_TOKENS, need)."""
    while cap < need:
        cap *= 2
    return min(cap, max(MAX_TOKENS, int(need)))


def new_automaton(cap: int, meta: np.ndarray, fill: bool = True) -> tuple:
    """`buffers(cap, fill)` holding the automaton of the empty text (meta: its int64 [META_SIZE], set); with
    fill=False its hash keys are still to be set to -1."""
    bufs = buffers(cap, fill)
    st = bufs[1]
    K.init_automaton(st[0], st[1], st[2], st[3], meta)
    return bufs


def grown(old: tuple, meta: np.ndarray, cap: int, need: int) -> tuple[int, tuple]:
    """(room, buffers): the automaton described by meta copied from buffers `old` (room for cap tokens) into
    new ones with room for `need` (`room_for`), rehashed; `old` is left as it was."""
    cap = room_for(cap, need)
    new = buffers(cap)
    n_tok, n_st, n_ed = int(meta[K.N_TOKENS]), int(meta[K.N_STATES]), int(meta[K.N_EDGES])
    new[0][:n_tok] = old[0][:n_tok]
    new[1][:, :n_st] = old[1][:, :n_st]
    new[2][:, :n_ed] = old[2][:, :n_ed]
    K.rehash(new[1][3], new[2][0], new[2][2], n_st, new[3], new[4])
    return cap, new


class SuffixIndex:
    """Longest-suffix lookup over a growing sequence of token ids.

    After every appended token the index knows `match_len`, the length of the longest suffix of
    the text that also ends at an earlier position, and which earlier occurrence to copy from.
    `propose(k)` returns up to k tokens that followed that occurrence.

    Occurrence rule (stated, and tested against a brute-force reference in tests/reference.py):
    the match is always the longest suffix that occurred before; the rule chooses *which* of its
    occurrences to copy, after every appended token:
    1. follow the occurrence already being copied while it keeps matching, so a copied span stays
       aligned with one source region;
    2. when it stops matching (a correction token), re-sync locally: the source is assumed to go on
       one token past the mismatch (the anchor), and the occurrence whose continuation starts
       nearest to the anchor, within `resync_window` tokens, wins (ties: the earlier). A small
       insertion, deletion or substitution — the typical edit of a rewritten file — thus resumes
       copying from the same region instead of from a far-away repeat of a short suffix;
    3. otherwise (no occurrence near the anchor) the *earliest* occurrence.
    Offline replay on real outputs chose this rule over the alternatives tried (most recent instead of
    earliest, a majority vote, a substitution key): benchmarks/results/replay/SUMMARY.md.

    Args:
        tokens: initial token ids (e.g. the prompt), int [n].
        min_match: shortest suffix that may back a draft; below it `propose` returns nothing.
        max_match: a longer match is reported as `max_match` long (its occurrence is also one of
            the `max_match`-long suffix), which keeps `match_len` a bounded confidence signal.
        eos_token_ids: ids a draft never contains: drafts stop before the first of them.
        resync_window: how far (tokens) from the anchor rule 2 looks; 0 turns rule 2 off.

    Example:
        >>> index = SuffixIndex([1, 2, 3, 4, 1, 2, 3], min_match=2)
        >>> draft = index.propose(3)
        >>> draft.tokens.tolist(), draft.match_len
        ([4, 1, 2], 3)
    """

    def __init__(self, tokens: Iterable[int] = (), *, min_match: int = 1, max_match: int = 64,
                 eos_token_ids: Iterable[int] = (), resync_window: int = 64):
        self.min_match, self.max_match = check_match(min_match, max_match)
        if int(resync_window) < 0:
            raise ValueError(f"resync_window must be >= 0, got {resync_window}")
        self.resync_window = int(resync_window)
        self.eos = as_token_array(list(eos_token_ids), "eos_token_ids")
        meta = np.zeros(K.META_SIZE, np.int64)
        self._set(1024, new_automaton(1024, meta), meta)
        self.extend(tokens)

    def _set(self, cap_tokens: int, bufs: tuple, meta: np.ndarray) -> None:
        self._cap, self._buf, self._meta = cap_tokens, bufs, meta
        self._toks, st, ed, self._hkey, self._hval = bufs
        self._slen, self._slink, self._sfirst, self._shead = st
        self._etok, self._eto, self._enext = ed

    @classmethod
    def bytes_for(cls, n_tokens: int) -> int:
        """Bytes an index over n_tokens tokens holds (its buffers start at 1024 tokens and double), without
        building one: what a server bounding many indexes reserves before it indexes a request."""
        return room_of(room_for(1024, int(n_tokens)))

    def extend(self, tokens) -> None:
        """Append token ids (int [m]; list, numpy or torch) to the indexed text."""
        new = as_token_array(tokens)
        if new.size == 0:
            return
        if len(self) + new.size > MAX_TOKENS:
            raise ValueError(f"a SuffixIndex holds at most {MAX_TOKENS} tokens (int32 positions); it has "
                             f"{len(self)} and {new.size} more were given")
        if len(self) + new.size > self._cap:
            # Doubled until they fit (amortized O(1) per token). Exception safe: the new buffers are allocated,
            # filled and rehashed aside and swapped in only when complete, so a MemoryError (or Ctrl-C) half way
            # leaves the index as it was.
            self._set(*grown(self._buf, self._meta, self._cap, len(self) + new.size), self._meta)
        K.extend(self._toks, self._slen, self._slink, self._sfirst, self._shead, self._etok, self._eto,
                 self._enext, self._hkey, self._hval, self._meta, new, self.resync_window)

    def arrays(self) -> tuple:
        """What a kernel that reads this index takes (`core.pool`'s corpora): (toks, n, slen, slink, sfirst, eto,
        hkey, hval, shead, enext), one tuple type for every index."""
        return (self._toks, np.int64(len(self)), self._slen, self._slink, self._sfirst, self._eto, self._hkey,
                self._hval, self._shead, self._enext)

    def propose(self, max_tokens: int) -> Draft:
        """The tokens that followed the matched earlier occurrence (int32 [d], 0 <= d <= max_tokens), with
        the match length behind them.

        Empty when the current match is shorter than `min_match`. Never contains an EOS id.
        Overlap is allowed: in a repeated span the draft may end at the newest token.
        """
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        if self._meta[K.MATCH_LEN] < self.min_match or max_tokens == 0:
            return Draft(np.zeros(0, np.int32), self.match_len)
        branched = bool(K.match_branched(self._slink, self._shead, self._enext, self._meta))
        return Draft(self.continuation(self._meta[K.MATCH_END], max_tokens, self.eos), self.match_len,
                     branched=branched)

    # Matching another text against this one (session memory, reference documents): the index is
    # only read, so one index serves any number of cursors; `new_cursor` gives a fresh one.
    @staticmethod
    def new_cursor() -> np.ndarray:
        """A cursor at the empty match: int64 [5] (state, automaton match, occurrence end, occurrence match,
        anchor)."""
        return np.array([0, 0, -1, 0, -1], np.int64)

    def follow(self, cursor: np.ndarray, tokens, window: int = 0) -> None:
        """Advance `cursor` (from `new_cursor`) over tokens of another text, in place.

        Afterwards cursor[3] is the length of the suffix of that text matched here and cursor[2]
        the end position of that occurrence here (-1 when none); the occurrence rule is the one of
        `extend` (re-synchronising within `window` tokens; 0: none). A cursor is only valid until this
        index is next extended.
        """
        new = as_token_array(tokens)
        if new.size:
            K.follow(self._toks, len(self), self._slen, self._slink, self._sfirst, self._eto, self._hkey,
                     self._hval, cursor, new, window)

    def continuation(self, end: int, max_tokens: int, stop_ids: np.ndarray) -> np.ndarray:
        """The tokens after position `end`: int32 [d], d <= max_tokens, stopping before any id in
        `stop_ids` (int32 [s])."""
        start = int(end) + 1
        d = K.draft_length(self._toks, len(self), start, int(max_tokens), stop_ids)
        return self._toks[start:start + d].copy()

    @property
    def match_len(self) -> int:
        """Length of the current match, capped at max_match (0 when no earlier occurrence)."""
        return min(int(self._meta[K.MATCH_LEN]), self.max_match)

    @property
    def match_end(self) -> int:
        """Position of the last token of the matched earlier occurrence (-1 when none)."""
        return int(self._meta[K.MATCH_END])

    @property
    def tokens(self) -> np.ndarray:
        """The indexed text, int32 [n] (a read-only view)."""
        view = self._toks[: len(self)]
        view.flags.writeable = False
        return view

    def __len__(self) -> int:
        return int(self._meta[K.N_TOKENS])

    def nbytes(self) -> int:
        """Bytes held by the index buffers (capacity, not just the used part)."""
        return int(room_bytes(self._cap))
