"""IndexPool: many requests' suffix indexes and acceptance counts, stepped for a whole batch in one compiled call.

An engine that runs its own loop (vLLM) asks once per step for a draft for every row of its batch. Per row
that is an index extend, a draft and a policy update: microseconds of work, but tens of microseconds of
Python per row around it, on a path the engine runs serially. The pool keeps every request's automaton in
shared arenas (one array per buffer kind, each request a region of it), the acceptance model's pooled counts
(`core.acceptance`, one pool for all slots) and each slot's request state, so `step` is one numba call over all
rows:

    for each row: learn from the tokens emitted since its last draft (the kept prefix of that draft);
    then for each row: extend its index by them, follow them over the shared corpora,
                  draft the longest match's continuation (the rule of `sources.proposer.SourcesProposer`),
                  and give each draft token's probability of being kept (`acceptance.predict`).

Learning every row before drafting any is the order of `core.decode.step` (all rows observe, then all propose), so
drafts, match lengths and probabilities are those of `SuffixIndex`, `SourcesProposer` and one `DraftPolicy` for
the same token streams (tested against them); how many tokens of each draft to send is the caller's choice
(`policy.ragged_lengths`).

Arenas: a slot with room for c tokens owns c token ids, 4 x (2c + 2) state ints, 3 x (3c + 4) edge ints and a
hash table of the smallest power of two >= 2 (3c + 4) slots (the layout of `SuffixIndex`). Regions are carved
from the end of each arena; a slot that outgrows its room moves to a region twice as large; freed regions
are reclaimed by compacting once they are half of an arena.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from lookup_decode.core import acceptance as A
from lookup_decode.core import automaton as K
from lookup_decode.core.config import ALONE_MIN_MATCH, CORPUS_MIN_MATCH, check_match
from lookup_decode.core.index import MAX_TOKENS, SuffixIndex
from lookup_decode.core.tokens import CURSOR_TAIL, SEPARATOR, as_token_array

FIRST_CAP = 1024                   # tokens of room a new slot starts with (as SuffixIndex)


def _layout(cap: int) -> tuple[int, int, int]:
    """(states, edges, hash slots) of a slot with room for cap tokens."""
    edges = 3 * cap + 4
    return 2 * cap + 2, edges, 1 << int(np.ceil(np.log2(2 * edges)))


class IndexPool:
    """Suffix indexes (one per slot) and their acceptance counts; `step` serves a batch of rows at once.

    Args:
        k: the longest draft `step` returns.
        min_match, max_match, eos_token_ids, resync_window: as for `SuffixIndex`.
        corpus_min_match, alone_min_match: the corpus rule of `SourcesProposer` (a corpus draft needs this
            match while the request has a draft of its own / when it has none).
        shared_prior: ignored (kept while engines pass it): the acceptance counts are always pooled over every
            slot, and a new slot deviates from them by its own evidence (`core.acceptance`).
    """

    def __init__(self, k: int, *, min_match: int = 1, max_match: int = 64, eos_token_ids=(), resync_window: int = 64,
                 corpus_min_match: int = CORPUS_MIN_MATCH, alone_min_match: int = ALONE_MIN_MATCH,
                 shared_prior: bool | None = None):
        self.k = int(k)
        self.min_match, self.max_match = check_match(min_match, max_match)
        self.eos = as_token_array(list(eos_token_ids), "eos_token_ids")
        self.stops = np.append(self.eos, np.int32(SEPARATOR))
        self.window = int(resync_window)
        self.corpus_min_match = min(max(self.min_match, corpus_min_match), self.max_match)
        self.alone_min_match = min(max(self.min_match, alone_min_match), self.corpus_min_match)
        self.counts = A.new_counts()                        # the acceptance model's pool, every slot's evidence
        self.slots = 0                                      # slots ever allocated (arrays hold this many rows)
        self.free: list[int] = []
        self.meta = None
        self._arrays(64)
        self.tok = np.zeros(1 << 16, np.int32)
        self.st = np.zeros((4, 1 << 17), np.int32)
        self.ed = np.zeros((3, 1 << 17), np.int32)
        self.hk = np.full(1 << 18, -1, np.int64)
        self.hv = np.zeros(1 << 18, np.int32)
        self.used = np.zeros(4, np.int64)                   # bump pointer of each arena: tok, st, ed, hash
        self.garbage = np.zeros(4, np.int64)
        self.bytes = 0                                      # what the live slots hold (their nbytes, summed)
        self._out = _buffers(64, self.k)
        self.compact_at = 1 << 20                           # hash slots of garbage before compacting is worth it
        self.compactions = 0

    # -- slot arrays ----------------------------------------------------------------------------------
    def _arrays(self, n: int) -> None:
        """Per-slot arrays for n slots (the values of the slots so far kept)."""
        k = max(self.k, 1)
        spec = {"meta": ((K.META_SIZE,), np.int64, 0),
                "cap": ((), np.int64, 0), "off": ((4,), np.int64, 0),     # room in tokens; offsets in tok/st/ed/hash
                "request": ((A.REQUEST_SIZE,), np.float64, 0.0),          # its acceptance deviation, copy rate
                "prev": ((k,), np.int32, 0),                              # each slot's last full draft
                "prev_len": ((), np.int64, 0), "prev_match": ((), np.int64, 0),
                "prev_branched": ((), np.int64, 0),                       # its match had branched
                "prev_temp": ((), np.float64, 0.0),                       # the row's temperature then
                "prev_src": ((), np.int64, 0),                            # 0: the request; 1 + c: corpus c
                "prev_end": ((), np.int64, -1),                           # corpus position the draft copied after
                "prev_ver": ((), np.int64, -1),                           # that corpus's version then
                "cursor": ((2, 4), np.int64, 0),                          # per corpus: a `SuffixIndex` cursor
                "cursor_ver": ((2,), np.int64, -1)}
        for name, (tail, dtype, fill) in spec.items():
            new = np.full((n,) + tail, fill, dtype)
            old = getattr(self, name, None)
            if old is not None:
                new[: old.shape[0]] = old
            setattr(self, name, new)

    def add(self, n_tokens: int = 0) -> int:
        """A new slot with room for n_tokens (an index over nothing, no evidence of its own); returns its number."""
        if self.free:
            s = self.free.pop()
        else:
            if self.slots == self.meta.shape[0]:
                self._arrays(2 * self.slots)
            s, self.slots = self.slots, self.slots + 1
        cap = FIRST_CAP
        while cap < n_tokens:
            cap *= 2
        self._place(s, min(cap, max(MAX_TOKENS, int(n_tokens))), keep=False)
        self.request[s] = A.new_requests(1)[0]
        self.prev_len[s], self.prev_src[s], self.prev_end[s], self.prev_ver[s] = 0, 0, -1, -1
        self.cursor[s] = SuffixIndex.new_cursor()
        self.cursor_ver[s] = -1
        return s

    def remove(self, s: int) -> None:
        """Free slot s (its regions become garbage, reclaimed by the next compaction)."""
        states, edges, hashes = _layout(int(self.cap[s]))
        self.garbage += (int(self.cap[s]), states, edges, hashes)
        self.bytes -= int(self._bytes_of(self.cap[s: s + 1])[0])
        self.cap[s] = 0
        self.free.append(s)
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        if 2 * self.garbage[3] > self.used[3] and self.garbage[3] > self.compact_at:
            self._compact()

    def length(self, slots) -> np.ndarray:
        """int64 [r]: tokens indexed in each slot."""
        return self.meta[slots, K.N_TOKENS]

    def tokens(self, s: int) -> np.ndarray:
        """The text of slot s, int32 [n] (a copy)."""
        o = int(self.off[s, 0])
        return self.tok[o: o + int(self.meta[s, K.N_TOKENS])].copy()

    def nbytes(self, slots) -> np.ndarray:
        """int64 [r]: bytes each slot holds in the arenas (its room, as `SuffixIndex.nbytes` counts it)."""
        return self._bytes_of(self.cap[np.asarray(slots, np.int64)])

    # -- regions --------------------------------------------------------------------------------------
    def _region(self, arena: int, size: int) -> int:
        """Offset of `size` fresh elements at the end of arena `arena`, growing it (by doubling) if needed."""
        names = ("tok", "st", "ed", "hk")
        need = int(self.used[arena]) + size
        have = getattr(self, names[arena]).shape[-1]
        if need > have:
            new = max(2 * have, need)
            if arena == 3:
                self.hk = np.concatenate([self.hk, np.full(new - have, -1, np.int64)])
                self.hv = np.concatenate([self.hv, np.zeros(new - have, np.int32)])
            else:
                a = getattr(self, names[arena])
                b = np.zeros(a.shape[:-1] + (new,), a.dtype)
                b[..., :have] = a
                setattr(self, names[arena], b)
        at = int(self.used[arena])
        self.used[arena] = need
        return at

    def _place(self, s: int, cap: int, keep: bool) -> None:
        """Give slot s regions for cap tokens; keep=True moves its automaton there (rehashed), else starts empty."""
        states, edges, hashes = _layout(cap)
        off = [self._region(0, cap), self._region(1, states), self._region(2, edges), self._region(3, hashes)]
        self.hk[off[3]: off[3] + hashes] = -1
        if keep:
            old, n_st = self.off[s].copy(), int(self.meta[s, K.N_STATES])
            n_tok, n_ed = int(self.meta[s, K.N_TOKENS]), int(self.meta[s, K.N_EDGES])
            self.tok[off[0]: off[0] + n_tok] = self.tok[old[0]: old[0] + n_tok]
            self.st[:, off[1]: off[1] + n_st] = self.st[:, old[1]: old[1] + n_st]
            self.ed[:, off[2]: off[2] + n_ed] = self.ed[:, old[2]: old[2] + n_ed]
            o_states, o_edges, o_hashes = _layout(int(self.cap[s]))
            self.garbage += (int(self.cap[s]), o_states, o_edges, o_hashes)
            K.rehash(self.st[3, off[1]: off[1] + states], self.ed[0, off[2]: off[2] + edges],
                     self.ed[2, off[2]: off[2] + edges], n_st, self.hk[off[3]: off[3] + hashes],
                     self.hv[off[3]: off[3] + hashes])
        self.bytes += int(self._bytes_of(np.array([cap]))[0] - self._bytes_of(self.cap[s: s + 1])[0])
        self.off[s], self.cap[s] = off, cap
        if not keep:
            st = self.st[:, off[1]: off[1] + states]
            K.init_automaton(st[0], st[1], st[2], st[3], self.meta[s])

    def _bytes_of(self, cap: np.ndarray) -> np.ndarray:
        edges = 3 * cap + 4
        hashes = np.left_shift(1, np.ceil(np.log2(np.maximum(2 * edges, 1))).astype(np.int64))
        return np.where(cap > 0, 4 * cap + 16 * (2 * cap + 2) + 12 * edges + 12 * hashes + 8 * K.META_SIZE, 0)

    def growth(self, slots, more) -> np.ndarray:
        """int64 [r]: the bytes `reserve(slots, more)` would add to each slot (0 where its room suffices)."""
        slots = np.asarray(slots, np.int64)
        cap, need = self.cap[slots], self.meta[slots, K.N_TOKENS] + np.asarray(more, np.int64)
        out = np.zeros(len(slots), np.int64)
        grow = np.flatnonzero(need > cap)
        if len(grow):
            new = np.left_shift(1, np.ceil(np.log2(need[grow])).astype(np.int64))
            out[grow] = self._bytes_of(np.maximum(new, cap[grow])) - self._bytes_of(cap[grow])
        return out

    def reserve(self, slots: np.ndarray, more: np.ndarray) -> None:
        """Room for `more[i]` more tokens in slot slots[i] (amortized O(1) per token: rooms double)."""
        need = self.meta[slots, K.N_TOKENS] + more
        if not (need > self.cap[slots]).any():
            return
        if need.max(initial=0) > MAX_TOKENS:
            raise ValueError(f"a pool slot holds at most {MAX_TOKENS} tokens (int32 positions)")
        for i in np.flatnonzero(need > self.cap[slots]):
            cap = int(self.cap[slots[i]])
            while cap < need[i]:
                cap *= 2
            self._place(int(slots[i]), min(cap, max(MAX_TOKENS, int(need[i]))), keep=True)
        self._maybe_compact()

    def _compact(self) -> None:
        """Copy the live slots' regions to the front of fresh arenas (no rehash: hash regions move whole)."""
        self.compactions += 1
        live = [s for s in range(self.slots) if self.cap[s] > 0]
        old = (self.tok, self.st, self.ed, self.hk, self.hv, self.off.copy())
        self.tok, self.st = np.zeros_like(self.tok), np.zeros_like(self.st)
        self.ed, self.hk, self.hv = np.zeros_like(self.ed), np.full_like(self.hk, -1), np.zeros_like(self.hv)
        self.used[:], self.garbage[:] = 0, 0
        tok, st, ed, hk, hv, off = old
        for s in live:
            states, edges, hashes = _layout(int(self.cap[s]))
            new = [self._region(0, int(self.cap[s])), self._region(1, states), self._region(2, edges),
                   self._region(3, hashes)]
            self.tok[new[0]: new[0] + self.cap[s]] = tok[off[s, 0]: off[s, 0] + self.cap[s]]
            self.st[:, new[1]: new[1] + states] = st[:, off[s, 1]: off[s, 1] + states]
            self.ed[:, new[2]: new[2] + edges] = ed[:, off[s, 2]: off[s, 2] + edges]
            self.hk[new[3]: new[3] + hashes] = hk[off[s, 3]: off[s, 3] + hashes]
            self.hv[new[3]: new[3] + hashes] = hv[off[s, 3]: off[s, 3] + hashes]
            self.off[s] = new

    # -- the step -------------------------------------------------------------------------------------
    def step(self, matrix: np.ndarray, rows: np.ndarray, slots: np.ndarray, starts: np.ndarray, ends: np.ndarray,
             limits: np.ndarray, learn: np.ndarray, corpora=(), temperatures=None) -> "Step":
        """Learn, extend and draft for every row at once (the returned arrays are reused by the next call).

        matrix: int32 [R, L], row rows[i] holding its request's tokens; slot slots[i] has indexed
        matrix[rows[i], :starts[i]] and takes matrix[rows[i], starts[i]:ends[i]] now (its new tokens).
        limits: int [r], the longest draft each row may get (<= k). learn: bool [r], whether the new tokens
        are what the engine emitted after the slot's last draft (False after a step the caller did not see:
        nothing is learned from them). corpora: up to two (SuffixIndex, version) of shared read-only corpora
        (`Corpus.reading()`), in tie-break order. temperatures: float [r], each row's sampling temperature
        (None: all greedy), priced in cells of its own.
        """
        rows, slots = np.asarray(rows, np.int64), np.asarray(slots, np.int64)
        starts, ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
        self.reserve(slots, ends - starts)
        r = len(rows)
        if r > self._out.tokens.shape[0]:             # outputs live in buffers reused from call to call
            self._out = _buffers(max(r, 2 * self._out.tokens.shape[0]), self.k)
        b = self._out
        out = Step(b.tokens[:r], b.lengths[:r], b.match[:r], b.source[:r], b.p_kept[:r], b.kept[:r], b.credit[:r])
        out.kept[:] = -1
        out.credit[:] = -1
        empty_i, empty_l = np.zeros(1, np.int32), np.full(1, -1, np.int64)
        c_arrays, versions = [], np.full(2, -1, np.int64)
        for c, (index, version) in enumerate(list(corpora)[:2]):
            c_arrays.append((index._toks, len(index), index._slen, index._slink, index._sfirst, index._eto,
                             index._hkey, index._hval, index._shead, index._enext))
            versions[c] = version
        while len(c_arrays) < 2:
            c_arrays.append((empty_i, 0, empty_i, empty_i, empty_i, empty_i, empty_l, empty_i, empty_i, empty_i))
        temps = np.zeros(r) if temperatures is None else np.ascontiguousarray(temperatures, np.float64)
        _step(matrix, rows, slots, starts, ends, np.minimum(np.asarray(limits, np.int64), self.k),
              np.asarray(learn, np.bool_),
              (self.tok, self.st, self.ed, self.hk, self.hv, self.meta, self.cap, self.off),
              (self.counts, self.request, self.prev, self.prev_len, self.prev_match, self.prev_src, self.prev_end,
               self.prev_ver, self.prev_branched, self.prev_temp), (self.cursor, self.cursor_ver),
              c_arrays[0], c_arrays[1], versions, len(corpora), temps,
              self.min_match, self.max_match, self.corpus_min_match, self.alone_min_match, self.eos, self.stops,
              self.window, out.tokens, out.lengths, out.match, out.source, out.p_kept, out.kept, out.credit)
        return out


@dataclass
class Step:
    """What `IndexPool.step` gave, per row i (arrays indexed like its rows)."""
    tokens: np.ndarray          # int32 [r, k]: row i's full draft in tokens[i, :lengths[i]]
    lengths: np.ndarray         # int64 [r]
    match: np.ndarray           # int64 [r]: match length behind it (capped at max_match)
    source: np.ndarray          # int64 [r]: 0 the request's own index, 1 + c corpus c
    p_kept: np.ndarray          # float64 [r, k]: probability that draft token j is kept (all before it kept), 0 past
                                # the row's length
    kept: np.ndarray            # int64 [r]: tokens of the slot's previous full draft the engine kept (-1: not learned)
    credit: np.ndarray          # int64 [r, 3]: (source, corpus version, position) of the draft `kept` refers to


def _buffers(r: int, k: int) -> Step:
    k = max(k, 1)
    return Step(np.zeros((r, k), np.int32), np.zeros(r, np.int64), np.zeros(r, np.int64), np.zeros(r, np.int64),
                np.zeros((r, k)), np.full(r, -1, np.int64), np.full((r, 3), -1, np.int64))


@njit(cache=True, nogil=True)
def _views(pool, s):
    tok, st, ed, hk, hv, meta, cap, off = pool
    c = cap[s]
    states = 2 * c + 2
    edges = 3 * c + 4
    hashes = 1
    while hashes < 2 * edges:
        hashes *= 2
    o = off[s]
    return (tok[o[0]: o[0] + c], st[0, o[1]: o[1] + states], st[1, o[1]: o[1] + states], st[2, o[1]: o[1] + states],
            st[3, o[1]: o[1] + states], ed[0, o[2]: o[2] + edges], ed[1, o[2]: o[2] + edges],
            ed[2, o[2]: o[2] + edges], hk[o[3]: o[3] + hashes], hv[o[3]: o[3] + hashes], meta[s])


@njit(cache=True, nogil=True)
def _corpus_draft(corpus, cursor, min_match, limit, stops, out):
    """Cursor.propose: the continuation after the cursor's occurrence, or nothing below min_match."""
    toks, n = corpus[0], corpus[1]
    if cursor[3] < min_match or limit == 0:
        return 0
    start = cursor[2] + 1
    d = K.draft_length(toks, n, start, limit, stops)
    for j in range(d):
        out[j] = toks[start + j]
    return d


@njit(cache=True, nogil=True)
def _step(matrix, rows, slots, starts, ends, limits, learn, pool, policy, cursors, corpus0, corpus1, versions,
          n_corpora, temps, min_match, max_match, corpus_min_match, alone_min_match, eos, stops, window,
          out_tokens, out_lengths, out_match, out_source, out_p, out_kept, out_credit):
    counts, request, prev, prev_len, prev_match, prev_src, prev_end, prev_ver, prev_branched, prev_temp = policy
    cursor, cursor_ver = cursors
    k = out_tokens.shape[1]
    scratch = np.zeros(k, np.int32)
    # 1. Learn from the kept prefix of every row's previous full draft (DraftPolicy.observe_rows; SourcesProposer
    # credit), all rows before any drafts, as decode.step does.
    for i in range(rows.shape[0]):
        s = slots[i]
        new = matrix[rows[i], starts[i]: ends[i]]
        n = min(prev_len[s], new.shape[0])
        if learn[i] and n > 0:
            kept = 0
            while kept < n and prev[s, kept] == new[kept]:
                kept += 1
            A.observe(counts, request[s], prev_match[s], prev_branched[s], prev_src[s], prev_temp[s], n, kept)
            out_kept[i] = kept
            out_credit[i, 0] = prev_src[s]
            if prev_src[s] > 0:
                out_credit[i, 1], out_credit[i, 2] = prev_ver[s], prev_end[s] + 1
        prev_len[s] = 0
    for i in range(rows.shape[0]):
        s = slots[i]
        new = matrix[rows[i], starts[i]: ends[i]]
        # 2. Extend the request's index, and follow the new tokens over each corpus (re-walk after a change).
        v = _views(pool, s)
        if new.shape[0] > 0:
            K.extend(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10], new, window)
        meta = v[10]
        for c in range(n_corpora):
            corpus = corpus0 if c == 0 else corpus1
            cur = cursor[s, c]
            if cursor_ver[s, c] != versions[c]:
                cur[0], cur[1], cur[2], cur[3] = 0, 0, -1, 0
                tail = min(max_match, CURSOR_TAIL)
                walk = matrix[rows[i], max(ends[i] - tail, 0): ends[i]]
                cursor_ver[s, c] = versions[c]
            else:
                walk = new
            if walk.shape[0] > 0 and corpus[1] > 0:
                K.follow(corpus[0], corpus[1], corpus[2], corpus[3], corpus[4], corpus[5], corpus[6], corpus[7],
                         cur, walk)
        # 3. Draft: the request's own continuation, unless a corpus has a longer match (SourcesProposer's rule).
        limit = limits[i]
        d, m, src = 0, min(meta[K.MATCH_LEN], max_match), 0
        br = 0
        if meta[K.MATCH_LEN] >= min_match and limit > 0:
            start = meta[K.MATCH_END] + 1
            d = K.draft_length(v[0], meta[K.N_TOKENS], start, limit, eos)
            for j in range(d):
                out_tokens[i, j] = v[0][start + j]
            br = K.match_branched(v[2], v[4], v[7], meta)
        best_d, best_m = d, m
        for c in range(n_corpora):
            corpus = corpus0 if c == 0 else corpus1
            cur = cursor[s, c]
            cd = _corpus_draft(corpus, cur, alone_min_match, limit, stops, scratch)
            cm = min(cur[3], max_match)
            if src == 0 and best_d > 0 and cm < corpus_min_match:
                continue                            # short corpus matches count only when the request has nothing
            if cd > 0 and (best_d == 0 or cm > best_m):
                best_d, best_m, src = cd, cm, 1 + c
                for j in range(cd):
                    out_tokens[i, j] = scratch[j]
                prev_end[s], prev_ver[s] = cur[2], versions[c]
                br = K.branched(corpus[8], corpus[9], cur[0])
        if best_d == 0:
            best_m = m                              # nothing to draft: the request's match, as SourcesProposer
        out_lengths[i], out_match[i], out_source[i] = best_d, best_m, src
        prev_len[s], prev_match[s], prev_src[s] = best_d, best_m, src
        prev_branched[s], prev_temp[s] = br, temps[i]
        for j in range(best_d):
            prev[s, j] = out_tokens[i, j]
        # 4. The probability of each draft token being kept (the acceptance model, as DraftPolicy prices it).
        out_p[i, :] = 0.0
        A.predict(counts, request[s], best_m, br, src, temps[i], best_d, out_p[i])
