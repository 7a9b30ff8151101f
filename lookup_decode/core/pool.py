"""IndexPool: many requests' suffix indexes and acceptance counts, stepped for a whole batch in one compiled call.

An engine that runs its own loop (vLLM) asks once per step for a draft for every row of its batch. Per row
that is an index extend, a draft and a policy update: microseconds of work, but tens of microseconds of
Python per row around it, on a path the engine runs serially. The pool keeps every request's automaton in
arrays of its own (a numba typed list, one tuple of buffers per slot), the acceptance model's pooled counts
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

Storage: a slot with room for c tokens owns c token ids, 4 x (2c + 2) state ints, 3 x (3c + 4) edge ints and a
hash table of the smallest power of two >= 2 (3c + 4) slots (the layout of `SuffixIndex`). Growth never stalls a
step: once a slot holds 3/4 of its room (and its room is at least `migrate_from`), the pool starts building a copy
of its automaton with twice the room beside it, by re-extending it with the slot's own tokens a bounded amount of
work per `step` (MIGRATE_WORK + MIGRATE_PER_TOKEN per token the call appends: hash slots filled, then tokens
re-extended, over all slots of the call), and swaps it in once it has caught up; the automaton is a function of
its tokens, so the copy is the same automaton.
Only a slot that outgrows its whole room within one call (a prompt, a big burst) grows there, by copying: work in
proportion to the tokens that call brings anyway. `copied` counts the bytes every growth wrote.
"""

from __future__ import annotations

import hashlib
import pathlib
from dataclasses import dataclass

import numpy as np
from numba import njit, types
from numba.experimental import structref
from numba.extending import typeof_impl
from numba.typed import List

from lookup_decode.core import acceptance as A
from lookup_decode.core import automaton as K
from lookup_decode.core.config import ALONE_MIN_MATCH, CORPUS_MIN_MATCH, check_match, corpus_thresholds
from lookup_decode.core.draft import choose_source
from lookup_decode.core.index import (
    MAX_TOKENS,
    SuffixIndex,
    buffers,
    grown,
    new_automaton,
    room_bytes,
    room_for,
    room_of,
)
from lookup_decode.core.tokens import CURSOR_TAIL, SEPARATOR, as_token_array

ROLES = 3                          # corpora a row may read, in tie-break order (memory, references, prediction)
LEAD = 2                           # the role of the request's prediction: its drafts lead (core.draft.choose_source)
FIRST_CAP = 1024                   # tokens of room a new slot starts with (as SuffixIndex)
MIGRATE_WORK = 512                 # per step: tokens re-extended into growing copies (or 32 hash slots filled each)
MIGRATE_PER_TOKEN = 8              # and this much more per token the step appends: a copy outpaces its slot's growth
_HASH_PER_WORK = 32


def drop_stale_cache(module: str, deps: tuple[str, ...]) -> None:
    """numba keys its disk cache of a module's kernels on that module's file alone, but a kernel that calls kernels
    of other files compiles them in: after an edit of one of those it would load the old code. Drop the module's
    cached kernels (module: its __file__) when those files (deps: paths under lookup_decode/) changed, a digest kept
    beside the cache. Here `step_rows` compiles in the kernels of automaton.py, acceptance.py and draft.py."""
    path, root = pathlib.Path(module), pathlib.Path(__file__).parents[1]
    digest = hashlib.sha256(b"".join((root / f).read_bytes() for f in deps))
    stamp = path.parent / "__pycache__" / f"{path.stem}.deps"
    try:
        stamp.parent.mkdir(exist_ok=True)
        if not stamp.exists() or stamp.read_text() != digest.hexdigest():
            for f in stamp.parent.glob(f"{path.stem}.*.nb[ic]"):
                f.unlink(missing_ok=True)
            stamp.write_text(digest.hexdigest())
    except OSError:                         # a read-only install: numba caches elsewhere, or not at all
        pass


drop_stale_cache(__file__, ("core/automaton.py", "core/acceptance.py", "core/draft.py"))


GROW, COPY = 1, 2                  # what `room_action` asks of a slot


@njit(cache=True, nogil=True)
def room_action(need, cap, migrate_from):
    """The room rule, for a slot of `cap` tokens' room about to hold `need`: GROW (a bigger room now), COPY (past 3/4
    of its room, start its bigger copy, if its room is one that grows by copying) or 0. `reserve` and `growth` apply
    it, and the vLLM drafter's steady check asks it whether `reserve` has anything to do (its numpy calls are a
    third of a small call)."""
    if need > cap:
        return GROW
    if 4 * need > 3 * cap and migrate_from <= cap < MAX_TOKENS:
        return COPY
    return 0


@njit(cache=True, nogil=True)
def _room_actions(need, cap, migrate_from, out):
    for i in range(need.shape[0]):
        out[i] = room_action(need[i], cap[i], migrate_from)
    return out


def _warm_up(window: int) -> None:
    """Compile (or load) now the kernels that growth calls: the room rule, `automaton.extend` for the argument types
    `migrate` passes it, and the rehash of `index.grown` (a slot's or a corpus's room doubling). The first growth must
    not wait for numba inside an engine step: a memory of outputs outgrowing its room at batch 16 stalled one vLLM
    step for 121 ms (benchmarks/results/vllm/engine_propose_b16.md)."""
    meta = np.zeros(K.META_SIZE, np.int64)
    tok, st, ed, hk, hv = new_automaton(4, meta, fill=False)
    hk[:] = -1
    src = np.array([1, 2, 1, 2], np.int32)
    K.extend(tok, st[0], st[1], st[2], st[3], ed[0], ed[1], ed[2], hk, hv, meta, src[0:4], window)
    grown((tok, st, ed, hk, hv), meta, 4, 8)
    _room_actions(np.zeros(1, np.int64), np.zeros(1, np.int64), 0, np.zeros(1, np.int64))


@structref.register
class _KernelType(types.StructRef):
    def preprocess_fields(self, fields):
        return tuple((name, types.unliteral(t)) for name, t in fields)


class _Kernel(structref.StructRefProxy):
    """What `step_rows` reads besides the call's rows, as one object: after a model's forward (cold caches) numba's
    dispatch takes ~10 us to unbox it, against ~45 us for its 14 per-slot arrays, rules and outputs one by one and its
    two typed lists (~20 us each: they are typed in Python)."""


_KERNEL_FIELDS = ("buffers", "meta", "cap", "counts", "request", "prev", "prev_len", "prev_match", "prev_src",
                  "prev_end", "prev_ver", "prev_branched", "prev_temp", "cursor", "cursor_ver", "ints", "eos", "stops",
                  "params", "corpora", "versions", "roles", "out_tokens", "out_lengths", "out_match", "out_source",
                  "out_p", "out_kept", "out_credit")
structref.define_proxy(_Kernel, _KernelType, list(_KERNEL_FIELDS))
# numba types an argument it has no fast path for in Python, and its generic rule first tries the buffer protocol
# (an exception raised and caught) before `_numba_type_`: ~20 us a structref after a model's forward, ~8 us this way.
typeof_impl.register(_Kernel)(lambda value, context: value._type)


@njit(cache=True, nogil=True)
def _new_kernel(buffers, meta, cap, counts, request, prev, prev_len, prev_match, prev_src, prev_end, prev_ver,
                prev_branched, prev_temp, cursor, cursor_ver, ints, eos, stops, params, corpora, versions, roles,
                out_tokens, out_lengths, out_match, out_source, out_p, out_kept, out_credit):
    """A `_Kernel` of these fields, in `_KERNEL_FIELDS`' order (compiled and cached here: the proxy's own constructor
    compiles in every process). Each named: numba types a function's star-args in Python (~0.2 ms a call)."""
    return _Kernel(buffers, meta, cap, counts, request, prev, prev_len, prev_match, prev_src, prev_end, prev_ver,
                   prev_branched, prev_temp, cursor, cursor_ver, ints, eos, stops, params, corpora, versions, roles,
                   out_tokens, out_lengths, out_match, out_source, out_p, out_kept, out_credit)


@dataclass
class _Copy:
    """A slot's automaton being rebuilt with twice the room (see the module docstring)."""
    cap: int
    buffers: tuple              # (tok, st, ed, hk, hv) for cap tokens
    meta: np.ndarray            # int64 [META_SIZE]
    hashed: int = 0             # hash slots set to -1 so far
    done: int = 0               # tokens re-extended so far


class IndexPool:
    """Suffix indexes (one per slot) and their acceptance counts; `step` serves a batch of rows at once.

    Args:
        k: the longest draft `step` returns.
        min_match, max_match, eos_token_ids, resync_window: as for `SuffixIndex`.
        corpus_min_match, alone_min_match: the corpus rule of `SourcesProposer` (a corpus draft needs this
            match while the request has a draft of its own / when it has none).
        params: the acceptance model's constants (`acceptance.params(...)`; None: `acceptance.PARAMS`).
    The acceptance counts are pooled over every slot; a new slot deviates from them by its own evidence
    (`core.acceptance`).
    """

    def __init__(self, k: int, *, min_match: int = 1, max_match: int = 64, eos_token_ids=(), resync_window: int = 64,
                 corpus_min_match: int = CORPUS_MIN_MATCH, alone_min_match: int = ALONE_MIN_MATCH,
                 params: np.ndarray | None = None):
        self.k = int(k)
        self.params = A.PARAMS if params is None else np.asarray(params, np.float64)
        self.min_match, self.max_match = check_match(min_match, max_match)
        self.eos = as_token_array(list(eos_token_ids), "eos_token_ids")
        self.stops = np.append(self.eos, np.int32(SEPARATOR))
        self.window = int(resync_window)
        self.corpus_min_match, self.alone_min_match = corpus_thresholds(self.min_match, self.max_match,
                                                                        corpus_min_match, alone_min_match)
        self._rules = np.array([self.min_match, self.max_match, self.corpus_min_match, self.alone_min_match,
                                self.window, LEAD], np.int64)   # the kernel's (see _step)
        self.counts = A.new_counts()                        # the acceptance model's pool, every slot's evidence
        self.slots = 0                                      # slots ever allocated (arrays hold this many rows)
        self.free: list[int] = []
        self.meta = None
        self._none = buffers(1)                        # the buffers of a free slot
        self.buffers = List()                               # per slot: (tok, st, ed, hk, hv)
        self.copies: dict[int, _Copy] = {}                  # slots being rebuilt with twice the room
        self._arrays(64)
        self.bytes = 0                                      # what the live slots hold (their nbytes, summed)
        self.copied = 0                                     # bytes written by growth, ever (tests bound it per call)
        self.migrate_from = 1 << 14                         # smaller rooms grow by copying (a few microseconds)
        self.migrate_work = MIGRATE_WORK
        self.swaps = 0                                      # copies swapped in, ever
        _warm_up(self.window)
        self.buffers[0] = self.buffers[0]                  # numba compiles typed-list access on first use: now
        self._out = _out_buffers(0, self.k)
        self._views: dict = {}                              # r -> the first r rows of _out
        self.outputs(64)
        self._no_corpus = SuffixIndex().arrays()
        self._corpus_list = (None, None)                    # (key, numba List) of the corpora last stepped over

    # -- slot arrays ----------------------------------------------------------------------------------
    def _arrays(self, n: int) -> None:
        """Per-slot arrays for n slots (the values of the slots so far kept)."""
        k = max(self.k, 1)
        spec = {"meta": ((K.META_SIZE,), np.int64, 0),
                "cap": ((), np.int64, 0),                                 # room in tokens
                "request": ((A.REQUEST_SIZE,), np.float64, 0.0),          # its copy rate (acceptance model)
                "prev": ((k,), np.int32, 0),                              # each slot's last full draft
                "prev_len": ((), np.int64, 0), "prev_match": ((), np.int64, 0),
                "prev_branched": ((), np.int64, 0),                       # its match had branched
                "prev_temp": ((), np.float64, 0.0),                       # the row's temperature then
                "prev_src": ((), np.int64, 0),                            # 0: the request; 1 + c: corpus c
                "prev_end": ((), np.int64, -1),                           # corpus position the draft copied after
                "prev_ver": ((), np.int64, -1),                           # that corpus's version then
                "cursor": ((ROLES, 5), np.int64, 0),                      # per corpus role: a `SuffixIndex` cursor
                "cursor_ver": ((ROLES,), np.int64, -1)}
        for name, (tail, dtype, fill) in spec.items():
            new = np.full((n,) + tail, fill, dtype)
            old = getattr(self, name, None)
            if old is not None:
                new[: old.shape[0]] = old
            setattr(self, name, new)
        while len(self.buffers) < n:
            self.buffers.append(self._none)
        self._kernel = None                                 # (it holds the arrays replaced)

    def add(self, n_tokens: int = 0) -> int:
        """A new slot with room for n_tokens (an index over nothing, no evidence of its own); returns its number."""
        if self.free:
            s = self.free.pop()
        else:
            if self.slots == self.meta.shape[0]:
                self._arrays(2 * self.slots)
            s, self.slots = self.slots, self.slots + 1
        cap = room_for(FIRST_CAP, n_tokens)
        self.buffers[s], self.cap[s] = new_automaton(cap, self.meta[s]), cap
        self.bytes += room_of(cap)
        self.request[s] = A.new_requests(1)[0]
        self.prev_len[s], self.prev_src[s], self.prev_end[s], self.prev_ver[s] = 0, 0, -1, -1
        self.cursor[s] = SuffixIndex.new_cursor()
        self.cursor_ver[s] = -1
        return s

    def remove(self, s: int) -> None:
        """Free slot s (its buffers are dropped)."""
        self.bytes -= self._held(s)
        self.copies.pop(s, None)
        self.buffers[s], self.cap[s] = self._none, 0
        self.free.append(s)

    def length(self, slots) -> np.ndarray:
        """int64 [r]: tokens indexed in each slot."""
        return self.meta[slots, K.N_TOKENS]

    def tokens(self, s: int) -> np.ndarray:
        """The text of slot s, int32 [n] (a copy)."""
        return self.buffers[s][0][: int(self.meta[s, K.N_TOKENS])].copy()

    def _held(self, s: int) -> int:
        """`nbytes([s])[0]`, without numpy calls (a slot's removal and growth)."""
        return room_of(int(self.cap[s])) + (room_of(self.copies[s].cap) if s in self.copies else 0)

    def nbytes(self, slots) -> np.ndarray:
        """int64 [r]: bytes each slot holds (its room, as `SuffixIndex.nbytes` counts it, and a growing copy's)."""
        slots = np.asarray(slots, np.int64)
        extra = np.array([self.copies[s].cap if s in self.copies else 0 for s in slots.tolist()], np.int64)
        return room_bytes(self.cap[slots]) + room_bytes(extra)

    # -- growth -------------------------------------------------------------------------------------
    def growth(self, slots, more) -> np.ndarray:
        """int64 [r]: the bytes `reserve(slots, more)` would add to each slot (0 where its room suffices): a bigger
        room now, or the copy with twice the room that starts once a slot holds 3/4 of its room."""
        slots = np.asarray(slots, np.int64)
        cap, need = self.cap[slots], self.meta[slots, K.N_TOKENS] + np.asarray(more, np.int64)
        have = np.zeros(len(slots), np.int64)
        if self.copies:
            have[:] = [self.copies[s].cap if s in self.copies else 0 for s in slots.tolist()]
        out = np.zeros(len(slots), np.int64)
        action = _room_actions(need, cap, self.migrate_from, np.zeros(len(slots), np.int64))
        grow = np.flatnonzero(action == GROW)             # reserve grows these now (a copy is dropped)
        if len(grow):
            new = np.maximum(np.left_shift(1, np.ceil(np.log2(need[grow])).astype(np.int64)), cap[grow])
            out[grow] = room_bytes(new) - room_bytes(cap[grow]) - room_bytes(have[grow])
        start = (action == COPY) & (have == 0)
        out[start] = room_bytes(2 * cap[start])
        return out

    def reserve(self, slots: np.ndarray, more: np.ndarray) -> None:
        """Room for `more[i]` more tokens in slot slots[i]: a slot past 3/4 of its room gets its bigger copy
        started (built by `migrate`), one that outgrows its room now grows now (amortized O(1) per token)."""
        need = self.meta[slots, K.N_TOKENS] + more
        cap = self.cap[slots]
        action = _room_actions(need, cap, self.migrate_from, np.zeros(len(slots), np.int64))
        if not action.any():
            return
        if need.max(initial=0) > MAX_TOKENS:
            raise ValueError(f"a pool slot holds at most {MAX_TOKENS} tokens (int32 positions)")
        for i in np.flatnonzero(action):
            s, n, c = int(slots[i]), int(need[i]), int(cap[i])
            if action[i] == GROW:
                self._grow_now(s, n)
            elif s not in self.copies:
                meta = np.zeros(K.META_SIZE, np.int64)
                self.copies[s] = _Copy(2 * c, new_automaton(2 * c, meta, fill=False), meta)
                self.bytes += room_of(2 * c)

    def _grow_now(self, s: int, need: int) -> None:
        """Move slot s to buffers with room for `need` tokens (or its finished copy's, if that suffices)."""
        self.bytes -= self._held(s)
        self.copies.pop(s, None)
        cap, new = grown(self.buffers[s], self.meta[s], int(self.cap[s]), need)
        self.copied += room_of(cap)
        self.buffers[s], self.cap[s] = new, cap
        self.bytes += room_of(cap)

    def migrate(self, slots, work: int | None = None) -> None:
        """Advance the growing copies of `slots` by about `work` units in all (a token re-extended, or
        _HASH_PER_WORK hash slots set; default `migrate_work`); a copy that has caught up with its slot replaces it."""
        work = self.migrate_work if work is None else work
        for s in [int(s) for s in slots if int(s) in self.copies]:
            if work <= 0:
                return
            c = self.copies[s]
            hk, hv = c.buffers[3], c.buffers[4]
            if c.hashed < len(hk):
                # The table is empty (-1) before any insertion; writing hv too takes its page faults here, in
                # order, instead of one per random insertion later.
                m = min(len(hk) - c.hashed, work * _HASH_PER_WORK)
                hk[c.hashed: c.hashed + m] = -1
                hv[c.hashed: c.hashed + m] = 0
                c.hashed += m
                work -= -(-m // _HASH_PER_WORK)
                self.copied += 12 * m
                continue
            n = int(self.meta[s, K.N_TOKENS])
            m = min(n - c.done, work)
            if m > 0:
                tok, st, ed, hk, hv = c.buffers
                K.extend(tok, st[0], st[1], st[2], st[3], ed[0], ed[1], ed[2], hk, hv, c.meta,
                         self.buffers[s][0][c.done: c.done + m], self.window)
                c.done += m
                work -= m
                self.copied += room_of(c.cap) // c.cap * m
            if c.done == n:                     # the same tokens, so the same automaton: swap it in
                self.bytes -= room_of(int(self.cap[s]))
                self.buffers[s], self.cap[s] = c.buffers, c.cap
                self.meta[s] = c.meta
                del self.copies[s]
                self.swaps += 1

    # -- the step -------------------------------------------------------------------------------------
    def step(self, matrix: np.ndarray, rows: np.ndarray, slots: np.ndarray, starts: np.ndarray, ends: np.ndarray,
             limits: np.ndarray, learn: np.ndarray, corpora=(), temperatures=None, row_corpora=None,
             fits: bool = False) -> "Step":
        """Learn, extend and draft for every row at once (the returned arrays are reused by the next call).

        matrix: int32 [R, L], row rows[i] holding its request's tokens; slot slots[i] has indexed
        matrix[rows[i], :starts[i]] and takes matrix[rows[i], starts[i]:ends[i]] now (its new tokens).
        limits: int [r], the longest draft each row may get (<= k; 0: none). learn: bool [r], whether the new tokens
        are what the engine emitted after the slot's last draft (False after a step the caller did not see:
        nothing is learned from them). corpora: (SuffixIndex, version) of shared read-only corpora
        (`Corpus.reading()`), any number. row_corpora: int [r, ROLES], the corpora (indices into `corpora`, -1: none)
        row i reads, by role in tie-break order; a draft from role c has source 1 + c; role LEAD is the request's
        prediction, whose draft goes first while it rests on corpus_min_match tokens. A slot's role must name the
        same corpus at every call (its cursor follows that corpus; a new version is re-walked). None: every row
        reads corpora[c] as role c. temperatures: float [r], each row's sampling temperature (None: all greedy),
        priced in cells of its own. fits: the caller knows that no slot holds 3/4 of its room after the call (no
        growth to start: `reserve` is skipped).
        """
        # Every array the kernel takes is the caller's or one kept from call to call: a numpy call here costs about
        # a microsecond, the kernel's work for one row a few.
        rows, slots = np.asarray(rows, np.int64), np.asarray(slots, np.int64)
        starts, ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
        if not fits:
            self.reserve(slots, ends - starts)
        if self.copies:
            self.migrate(slots, self.migrate_work + MIGRATE_PER_TOKEN * int((ends - starts).sum()))
        r = len(rows)
        out = self.outputs(r)
        if row_corpora is None:
            if len(corpora) > ROLES:
                raise ValueError(f"at most {ROLES} corpora without row_corpora, got {len(corpora)}")
            row_corpora = self._roles[len(corpora)][:r]
        else:
            row_corpora = np.ascontiguousarray(row_corpora, np.int64)
            if row_corpora.shape != (r, ROLES) or row_corpora.max(initial=-1) >= len(corpora):
                raise ValueError(f"row_corpora must be int [{r}, {ROLES}] of indices into the {len(corpora)} corpora")
        temps = self._greedy[:r] if temperatures is None else np.ascontiguousarray(temperatures, np.float64)
        step_rows(matrix, rows, slots, starts, ends, np.asarray(limits, np.int64), np.asarray(learn, np.bool_), temps,
                  row_corpora, self.kernel(corpora))
        return out

    def outputs(self, r: int) -> "Step":
        """The first r rows of the output buffers (reused from call to call: a caller of `step_rows` sizes them
        before building the `kernel`)."""
        out = self._views.get(r)
        if out is None:
            if r > self._out.tokens.shape[0]:
                n = max(r, 2 * self._out.tokens.shape[0])
                self._out, self._views, self._kernel = _out_buffers(n, self.k), {}, None
                self._greedy = np.zeros(n)
                self._roles = [np.full((n, ROLES), -1, np.int64) for _ in range(ROLES + 1)]
                for c in range(ROLES + 1):
                    self._roles[c][:, :c] = np.arange(c)
            b = self._out
            out = self._views[r] = Step(b.tokens[:r], b.lengths[:r], b.match[:r], b.source[:r], b.p_kept[:r],
                                        b.kept[:r], b.credit[:r])
        return out

    def kernel(self, corpora, rows: int = 0) -> "_Kernel":
        """What `step_rows` reads besides the call's rows, over these corpora ((SuffixIndex, version) pairs, held
        unchanged while it runs: `Corpus.reading()`; each row reads corpus c as role c unless told otherwise), its
        outputs sized for at least `rows` rows. Kept from call to call while the pool's arrays and the corpora (the
        same indexes at the same versions: a corpus bumps its version at every change) are."""
        if rows > self._out.tokens.shape[0]:
            self.outputs(rows)
        key = corpora if type(corpora) is list else list(corpora)   # (compared in C: no Python frame per corpus)
        last, held = self._corpus_list
        if key != last and last is not None and len(key) == len(last) > 0:
            # As many corpora as before (a request's output stored in the memory, say): the same List and kernel,
            # the changed entries set in place. Building a numba List from Python costs ~0.5 ms after a model's
            # forward, setting an entry ~0.07 ms.
            arrays, versions = held
            for i, (now, was) in enumerate(zip(key, last)):
                if now != was:
                    arrays[i], versions[i] = now[0].arrays(), now[1]
            self._corpus_list = (list(key), held)
        elif key != last:
            tuples = [index.arrays() for index, _ in corpora] or [self._no_corpus]
            versions = np.array([version for _, version in corpora] or [-1], np.int64)
            self._corpus_list, self._kernel = (list(key), (List(tuples), versions)), None
        if self._kernel is None:                 # (the others are the pool's attributes of the same names)
            b, (arrays, versions) = self._out, self._corpus_list[1]
            parts = {"ints": self._rules, "corpora": arrays, "versions": versions,
                     "roles": self._roles[min(len(key), ROLES)], "out_tokens": b.tokens, "out_lengths": b.lengths,
                     "out_match": b.match, "out_source": b.source, "out_p": b.p_kept, "out_kept": b.kept,
                     "out_credit": b.credit}
            self._kernel = _new_kernel(*(parts[f] if f in parts else getattr(self, f) for f in _KERNEL_FIELDS))
        return self._kernel


@dataclass
class Step:
    """What `IndexPool.step` gave, per row i (arrays indexed like its rows)."""
    tokens: np.ndarray          # int32 [r, k]: row i's full draft in tokens[i, :lengths[i]]
    lengths: np.ndarray         # int64 [r]
    match: np.ndarray           # int64 [r]: match length behind it (capped at max_match)
    source: np.ndarray          # int64 [r]: 0 the request's own index, 1 + c the corpus of role c
    p_kept: np.ndarray          # float64 [r, k]: probability that draft token j is kept (all before it kept), 0 past
                                # the row's length
    kept: np.ndarray            # int64 [r]: tokens of the slot's previous full draft the engine kept (-1: not learned)
    credit: np.ndarray          # int64 [r, 3]: (source, corpus version, position) of the draft `kept` refers to


def _out_buffers(r: int, k: int) -> Step:
    k = max(k, 1)
    return Step(np.zeros((r, k), np.int32), np.zeros(r, np.int64), np.zeros(r, np.int64), np.zeros(r, np.int64),
                np.zeros((r, k)), np.full(r, -1, np.int64), np.full((r, 3), -1, np.int64))


@njit(cache=True, nogil=True)
def _views(buffers, meta, cap, s):
    tok, st, ed, hk, hv = buffers[s]
    c = cap[s]
    states = 2 * c + 2
    edges = 3 * c + 4
    return (tok[:c], st[0, :states], st[1, :states], st[2, :states], st[3, :states], ed[0, :edges], ed[1, :edges],
            ed[2, :edges], hk, hv, meta[s])


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
def step_rows(matrix, rows, slots, starts, ends, limits, learn, temps, row_corpora, st):
    """The kernel of `IndexPool.step` (its arguments; st: the pool's `kernel`: the slots' automata and per-slot
    arrays; rules: (min_match, max_match, corpus_min_match, alone_min_match, window, lead role (-1: none)), eos,
    stops, the acceptance model's params; the corpora and their versions; `Step`'s arrays). Callable from other
    kernels (`engines.vllm.requests`' steady step)."""
    buffers, corpora, versions = st.buffers, st.corpora, st.versions
    meta, cap, counts, request, prev, prev_len = st.meta, st.cap, st.counts, st.request, st.prev, st.prev_len
    prev_match, prev_src, prev_end, prev_ver = st.prev_match, st.prev_src, st.prev_end, st.prev_ver
    prev_branched, prev_temp, cursor, cursor_ver = st.prev_branched, st.prev_temp, st.cursor, st.cursor_ver
    ints, eos, stops, params = st.ints, st.eos, st.stops, st.params
    min_match, max_match, corpus_min_match, alone_min_match, window, lead = (ints[0], ints[1], ints[2], ints[3],
                                                                             ints[4], ints[5])
    out_tokens, out_lengths, out_match, out_source = st.out_tokens, st.out_lengths, st.out_match, st.out_source
    out_p, out_kept, out_credit = st.out_p, st.out_kept, st.out_credit
    k = out_tokens.shape[1]
    roles = row_corpora.shape[1]
    scratch = np.zeros((roles, k), np.int32)
    lengths = np.zeros(1 + roles, np.int64)
    matches = np.zeros(1 + roles, np.int64)
    # 1. Learn from the kept prefix of every row's previous full draft (DraftPolicy.observe_rows; SourcesProposer
    # credit), all rows before any drafts, as decode.step does.
    for i in range(rows.shape[0]):
        s = slots[i]
        out_kept[i] = -1
        out_credit[i, :] = -1
        new = matrix[rows[i], starts[i]: ends[i]]
        n = min(prev_len[s], new.shape[0])
        if learn[i] and n > 0:
            kept = 0
            while kept < n and prev[s, kept] == new[kept]:
                kept += 1
            A.observe(counts, request[s], prev_match[s], prev_branched[s], prev_src[s], prev_temp[s], n, kept, params)
            out_kept[i] = kept
            out_credit[i, 0] = prev_src[s]
            if prev_src[s] > 0:
                out_credit[i, 1], out_credit[i, 2] = prev_ver[s], prev_end[s] + 1
        prev_len[s] = 0
    for i in range(rows.shape[0]):
        s = slots[i]
        new = matrix[rows[i], starts[i]: ends[i]]
        # 2. Extend the request's index, and follow the new tokens over each corpus (re-walk after a change).
        v = _views(buffers, meta, cap, s)
        if new.shape[0] > 0:
            K.extend(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10], new, window)
        m_s = v[10]
        limit = min(limits[i], k)
        for c in range(roles):
            lengths[1 + c], matches[1 + c] = 0, 0
            ci = row_corpora[i, c]
            if ci < 0:
                continue
            corpus = corpora[ci]
            cur = cursor[s, c]
            if cursor_ver[s, c] != versions[ci]:
                cur[0], cur[1], cur[2], cur[3], cur[4] = 0, 0, -1, 0, -1
                tail = min(max_match, CURSOR_TAIL)
                walk = matrix[rows[i], max(ends[i] - tail, 0): ends[i]]
                cursor_ver[s, c] = versions[ci]
            else:
                walk = new
            if walk.shape[0] > 0 and corpus[1] > 0:
                K.follow(corpus[0], corpus[1], corpus[2], corpus[3], corpus[4], corpus[5], corpus[6], corpus[7],
                         cur, walk, window if c == lead else 0)
            lengths[1 + c] = _corpus_draft(corpus, cur, alone_min_match, limit, stops, scratch[c])
            matches[1 + c] = min(cur[3], max_match)
        # 3. Draft: every source's continuation, then the rule of `core.draft.choose_source`.
        d, m, br = 0, min(m_s[K.MATCH_LEN], max_match), 0
        if m_s[K.MATCH_LEN] >= min_match and limit > 0:
            start = m_s[K.MATCH_END] + 1
            d = K.draft_length(v[0], m_s[K.N_TOKENS], start, limit, eos)
            for j in range(d):
                out_tokens[i, j] = v[0][start + j]
            br = K.match_branched(v[2], v[4], v[7], m_s)
        lengths[0], matches[0] = d, m
        src = max(choose_source(lengths, matches, corpus_min_match, -1 if lead < 0 else 1 + lead), 0)
        best_d, best_m = lengths[src], matches[src]
        if src > 0:
            c = src - 1
            for j in range(best_d):
                out_tokens[i, j] = scratch[c, j]
            ci, cur = row_corpora[i, c], cursor[s, c]
            prev_end[s], prev_ver[s] = cur[2], versions[ci]
            br = K.branched(corpora[ci][8], corpora[ci][9], cur[0])
        out_lengths[i], out_match[i], out_source[i] = best_d, best_m, src
        prev_len[s], prev_match[s], prev_src[s] = best_d, best_m, src
        prev_branched[s], prev_temp[s] = br, temps[i]
        for j in range(best_d):
            prev[s, j] = out_tokens[i, j]
        # 4. The probability of each draft token being kept (the acceptance model, as DraftPolicy prices it).
        out_p[i, :] = 0.0
        A.predict(counts, request[s], best_m, br, src, temps[i], best_d, out_p[i], params)
