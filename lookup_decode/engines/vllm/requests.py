"""Following vLLM's requests across its persistent batch: which pool slot holds each row's request.

By id (`RequestTable.claim_ids`), where the drafter can read the model runner's request ids (vLLM 0.32 and 0.33:
`runner.input_batch.req_ids`, `runner.requests`): a row's request is its id's slot; a slot that indexed fewer
tokens than the row held before this step missed steps (a whole-batch skip, a preemption) and takes the missing
tokens without learning from them; an id never seen gets a fresh slot, its prompt length the runner's.

By content (`RequestTable.claim`), the fallback where it cannot: vLLM hands the drafter a token matrix, not request
ids, and rows move (a finished request's row is filled with the last one; preempted and unscheduled requests leave
and come back elsewhere). A live request is recognised by a fingerprint of its row (`fingerprints`: O(1) tokens
per row) before this step's tokens, which must equal the fingerprint its slot was filed under after the previous
call. What the fast path cannot place:

* a step the drafter did not see (vLLM skips the drafter for the whole batch when any row is within k tokens
  of max_model_len, and preemption can hide a request): a live slot whose text is a prefix of the row, a few
  steps' tokens short of it (at most `max_gap`), takes the row and is extended by the missing tokens, learning
  nothing from them (it never saw what it had drafted for them). A slot whose text ends with EOS is finished
  and never continued (a chat's next turn starts with the whole previous one);
* a request whose slot was dropped (retired while preempted or unscheduled, evicted): a record of each dropped
  request gives its prompt length back if the row continues it by this step's sampled tokens, as a recomputed
  request does;
* a new request: a fresh slot, indexed from the whole row. Its prompt is the row minus the one sampled token,
  unless this call saw a skipped step (then the prompt length is unknown and its output is never stored).

A mistaken recognition (two requests agreeing on every sampled position) can only cost draft quality: vLLM
verifies every draft, so the output never depends on the drafter.

The steady state (`RequestTable.steady`): by id, every row that emitted tokens holds a known request, continued by
them. One compiled call checks that and gives the step's per-row arrays; anything else (a request new, refused or
not its slot's text continued, a row at max_model_len) takes the general path.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from lookup_decode.core.pool import IndexPool
from lookup_decode.core.stats import NO_FLAGS
from lookup_decode.engines.vllm.stats import RequestStats
from lookup_decode.engines.vllm.table_kernels import (
    TABLE_FIELDS,
    TableKernel,
    book_rows,
    entry_of,
    fingerprints,
    new_table_kernel,
    steady_call,
    steady_rows,
)
from lookup_decode.sources.memory import Memory, References

DROPPED_KEPT = 4096                # dropped requests remembered for their prompt lengths
NO_LIMIT = 2**31                   # a request that set no draft length of its own
# The per-slot arrays of a RequestTable: (dtype, the value a slot's entry starts from).
_SLOT_ARRAYS = {
    "fp": (np.uint64, 0),              # the fingerprint each slot is filed under
    "last_seen": (np.int64, 0),        # the call that last saw it
    "prompt_len": (np.int64, -1),      # its request's prompt length (-1: unknown)
    "sent": (np.int64, 0),             # draft tokens sent to the slot's row at its last call
    "stored": (np.int64, -1),          # the slot's length when its output was last stored (-1: never)
    "limit": (np.int64, NO_LIMIT),     # its request's own most draft tokens per step
    "temperature": (np.float64, 0.0),  # its request's sampling temperature (0: greedy or unknown)
    "end": (np.int64, NO_LIMIT),       # the row length at which its request ends (max_tokens)
}


@dataclass(frozen=True)
class RequestInfo:
    """What the engine tells of a request when it starts (None: not told)."""
    prompt_len: int = -1               # its prompt's tokens (-1: unknown)
    temperature: float = 0.0           # its sampling temperature (0: greedy)
    max_tokens: int | None = None      # its most output tokens
    extra_args: dict | None = None     # its per-request settings (`request_args`)


@dataclass
class EngineRequests:
    """The engine's requests, for a call whose rows it names: `ids[i]` is row i's request id (None: unknown),
    `held` holds the ids of the requests the engine still has (a finished one is absent, a preempted one not),
    `info(id)` tells a new request's `RequestInfo`."""
    ids: list
    held: Container
    info: Callable[[str], RequestInfo]


@dataclass
class Request:
    """One request's own settings, made from its `RequestInfo` by `BatchDrafter._start`."""
    id: str
    stats: RequestStats                # its counters (in DrafterStats.requests)
    k: int = NO_LIMIT                  # its most draft tokens per step (lookup_decode_k)
    temperature: float = 0.0           # its sampling temperature (acceptance cells per temperature)
    end: int = NO_LIMIT                # the row length at which it ends (prompt + max_tokens): no draft past it
    memory: Memory | None = None       # the memory it drafts from and stores into (its scope's)
    prediction: References | None = None   # its own corpus (lookup_decode_prediction)


@dataclass
class Drafts:
    """One call's drafts: row rows[j] is sent tokens[j, :lengths[j]]."""
    rows: np.ndarray                   # int64 [r]
    lengths: np.ndarray                # int64 [r]
    tokens: np.ndarray                 # int32 [r, k]


@dataclass
class Claim:
    """Where each row's request lives (arrays indexed like the rows of the call)."""
    slots: np.ndarray          # int64 [r]: its pool slot (-1: none, the byte bound refused one)
    starts: np.ndarray         # int64 [r]: tokens its slot already indexed (the row's new tokens start there)
    learn: np.ndarray          # bool [r]: the new tokens are what the engine emitted after the slot's last draft
    built: int = 0             # rows given a fresh slot
    continued: int = 0         # rows whose slot had missed steps (prefix match)
    resumed: int = 0           # fresh slots whose prompt length came from a dropped request
    rebuilt: int = 0           # fresh slots for a request id whose slot was dropped before (by id only)
    fresh: list[int] = field(default_factory=list)     # positions j of the rows given a fresh slot


class RequestTable:
    """The slots of an `IndexPool` keyed by their rows' fingerprints, with each request's bookkeeping."""

    def __init__(self, pool: IndexPool, *, max_gap: int, eos_token_ids=()):
        self.pool = pool
        self.max_gap = int(max_gap)
        self.eos = np.asarray(list(eos_token_ids), np.int64)
        self.table: dict[int, int] = {}         # fingerprint -> slot
        self.twins: dict[int, list[int]] = {}   # more slots under one fingerprint (requests with equal rows)
        self.live: set[int] = set()
        for name, (dtype, fill) in _SLOT_ARRAYS.items():
            setattr(self, name, np.full(64, fill, dtype))
        k = max(pool.k, 1)                      # per slot: the prices of its last sent draft; `book`'s rows
        self.p_sent, self.learned, self._p_learned = np.zeros((64, k)), np.zeros((7, 64), np.int64), np.zeros((64, k))
        self.keys: dict[int, str] = {}          # slot -> memory key of that stored output (a later, longer one
                                                # replaces it: `Memory.store`)
        # Dropped requests: (length, fingerprint at it, prompt length), a ring; the memory key of each one's output.
        self.dropped = np.zeros((DROPPED_KEPT, 3), np.int64)
        self.dropped_fp = np.zeros(DROPPED_KEPT, np.uint64)
        self.dropped_key: list[str | None] = [None] * DROPPED_KEPT
        self.dropped_n = 0
        # By id: vLLM's request id of each slot, and the ids of dropped requests with their output's memory key.
        self.ids: dict[str, int] = {}
        self.id_of: dict[int, str] = {}
        self.dropped_ids: OrderedDict[str, str | None] = OrderedDict()
        # The steady state: the rows' ids at the last call by id, and their slots (-1: none); None: unknown.
        self.row_ids: list | None = None
        self.row_slots = np.zeros(0, np.int64)
        self.row_unknown = True                     # some row's id has no slot
        self._steady_out = (np.zeros((5, 0), np.int64), np.zeros(0, np.bool_), np.zeros(0), np.zeros(0, np.int64))
        self._steady_views: dict = {}          # r -> views of the first r rows of _steady_out
        self._kernel: tuple = (None, None)     # (TableKernel, (the pool kernel, cost state, calibration it holds))
        self._direct: dict = {}                # arrays' ids -> (steady_call's entry, kernel type, the arrays, weakly)
        none = np.zeros(0, np.int64)            # the kernels compiled (or loaded) now, not inside an engine step
        stand_in = SimpleNamespace(state=np.zeros(1), prior=0.0, prior_weight=0.0, forget=1.0, bucket_weight=0.0,
                                   bucket=np.zeros((4, 0)), graph_sizes=np.zeros(0), table=np.zeros((1, 1)))
        for counts in (none, none.astype(np.int32)):  # (vLLM's counts are int32; tests' and the general path's int64)
            self._steady_kernel(np.zeros((1, 1), np.int32), counts, none, (0, 0, 0, 0, 0))
            steady_call(np.zeros((1, 1), np.int32), counts, none, self.row_slots, (0,) * 8, -1.0,
                        self.kernel(pool.kernel([]), stand_in, stand_in))
        book_rows(none, none, none, np.zeros((0, 3), np.int64), np.zeros((0, k)), self.sent, self.p_sent, self.learned,
              self._p_learned)

    def _room(self, s: int) -> None:
        if s >= len(self.fp):
            n = 2 * max(s + 1, len(self.fp))
            for name, (dtype, fill) in _SLOT_ARRAYS.items():
                a = getattr(self, name)
                setattr(self, name, np.concatenate([a, np.full(n - len(a), fill, dtype)]))
            k = self.p_sent.shape[1]
            self.p_sent = np.concatenate([self.p_sent, np.zeros((n - len(self.p_sent), k))])
            self.learned, self._p_learned = np.zeros((7, n), np.int64), np.zeros((n, k))     # (scratch)
            self._kernel = (None, None)     # (it holds the arrays replaced)

    # -- the fingerprint table ------------------------------------------------------------------------
    def _pop(self, fp: int) -> int:
        s = self.table.pop(fp, -1)
        if s >= 0 and fp in self.twins:
            self.table[fp] = self.twins[fp].pop()
            if not self.twins[fp]:
                del self.twins[fp]
        return s

    def _unfile(self, s: int) -> None:
        fp = int(self.fp[s])
        if self.table.get(fp) == s:
            self._pop(fp)
        elif s in self.twins.get(fp, ()):
            self.twins[fp].remove(s)
            if not self.twins[fp]:
                del self.twins[fp]

    def file(self, matrix: np.ndarray, rows: np.ndarray, slots: np.ndarray, counts: np.ndarray, call: int) -> None:
        """File each slot under its row's fingerprint after this call's tokens (slot -1: skipped)."""
        keep = slots >= 0
        rows, slots, counts = rows[keep], slots[keep], counts[keep]
        fps = fingerprints(matrix, rows, counts)
        self.fp[slots] = fps
        self.last_seen[slots] = call
        table = self.table
        for fp, s in zip(fps.tolist(), slots.tolist()):
            other = table.setdefault(fp, s)
            if other != s:
                self.twins.setdefault(fp, []).append(s)

    # -- placing rows ---------------------------------------------------------------------------------
    def claim(self, matrix: np.ndarray, rows: np.ndarray, counts: np.ndarray, emitted: np.ndarray, call: int,
              admit) -> Claim:
        """The slot of each row's request (`rows`: rows with sampled tokens; counts, emitted: their token counts
        and this step's sampled tokens; call: this call's number). admit(n_tokens) -> bool says whether a fresh
        slot for a row of n_tokens fits the byte bound (it may evict slots not seen in this call); a row refused
        gets slot -1."""
        before = fingerprints(matrix, rows, counts - emitted)
        slots = np.array([self._pop(fp) for fp in before.tolist()], np.int64)
        self.last_seen[slots[slots >= 0]] = call        # seen now: never evicted to make room in this call
        starts = np.where(slots >= 0, counts - emitted, 0)
        claim = Claim(slots, starts, slots >= 0)
        missing = np.flatnonzero(slots < 0)
        if len(missing) == 0:
            return claim
        claimed = set(slots[slots >= 0].tolist())
        # Live slots that missed steps: a prefix of the row, at most max_gap tokens short of it, not ended by EOS.
        lengths = {s: int(self.pool.length([s])[0]) for s in self.live - claimed}
        fresh = []
        for j in missing.tolist():
            s = self._prefix_of(matrix, int(rows[j]), int(counts[j]), lengths)
            if s < 0:
                fresh.append(j)
                continue
            self._unfile(s)
            slots[j], starts[j] = s, lengths.pop(s)
            self.last_seen[s] = call
            claim.continued += 1
        for j in fresh:
            n = int(counts[j])
            if not admit(n):
                continue
            prompt = n - 1 if emitted[j] == 1 and claim.continued == 0 else -1
            resumed, ring = self._dropped_prompt(matrix, int(rows[j]), n - int(emitted[j]))
            if resumed >= 0:
                prompt, claim.resumed = resumed, claim.resumed + 1
            self._new_slot(claim, j, n, prompt, call, self.dropped_key[ring] if resumed >= 0 else None)
        return claim

    def claim_ids(self, rows: np.ndarray, counts: np.ndarray, emitted: np.ndarray, ids: list[str],
                  prompt_lens: np.ndarray, call: int, admit) -> Claim:
        """The slot of each row's request by vLLM's request id (ids[j], prompt_lens[j]: row j's request id and prompt
        length, -1 unknown); counts, emitted, admit as for `claim`. A slot holds what its row held after the
        request's last call: fewer tokens than the row before this step means steps were missed (the tokens are
        taken without learning), more means the row is not that text any more (it is rebuilt)."""
        r = len(rows)
        slots = np.fromiter((self.ids.get(i, -1) for i in ids), np.int64, count=r)
        known = slots >= 0
        before = counts - emitted
        have = np.where(known, self.pool.length(np.maximum(slots, 0)), 0)
        for j in np.flatnonzero(known & (have > before)).tolist():
            self.drop(int(slots[j]))                # the row is not the slot's text continued: index it afresh
            slots[j], known[j] = -1, False
        self.last_seen[slots[known]] = call
        claim = Claim(slots, np.where(known, have, 0), known & (have == before))
        claim.continued = int((known & (have < before)).sum())
        for j in np.flatnonzero(~known).tolist():
            if ids[j] is None or not admit(int(counts[j])):     # (vLLM's rows hold None only mid-update)
                continue
            rid = ids[j]
            claim.rebuilt += rid in self.dropped_ids    # known before: its next store replaces what it stored then
            s = self._new_slot(claim, j, int(counts[j]), int(prompt_lens[j]), call, self.dropped_ids.pop(rid, None))
            self.ids[rid], self.id_of[s] = s, rid
        return claim

    def steady(self, matrix, counts, emitted, ids: list, call: int, *, k: int, max_len: int, check_end: bool,
               kernel=None, cost=None, calibration=None, adaptive: bool = True, seconds: float = -1.0,
               budget: int = -1):
        """The step's arrays for a call in the steady state: every row that emitted tokens (ids: the rows' request
        ids, as vLLM's runner gives them) holds a known request, its slot's text continued by them (or by a few
        missed steps: not learned), none at max_len. Returns (rows, slots, starts, ends, limits, learn, temps,
        lengths, sums: verified, prefill, continued, most new tokens, near, ended: rows whose last token is EOS or
        that reached their end, counted if check_end; stepped, learned, total, drafted), the rows' slots marked
        seen at `call`; None: not the steady state (no slot changed). kernel: the pool's `kernel`, its outputs sized
        for every row of the call: the pool steps the rows in the same compiled call where it can (`steady_call`;
        stepped: it did, into its outputs), then with the step cost (`StepCost`, the seconds since the last call, the
        engine's token budget, -1 none) observes the last step, chooses the lengths (`adaptive`; else the drafts'
        own) and books them (`book` into `calibration`: its learned, total, drafted; the lengths in `lengths`)."""
        n = len(counts)
        if not self.rows_known(ids, emitted):
            return None
        if self._steady_out[0].shape[1] < n:
            self._steady_out = (np.zeros((5, 2 * n), np.int64), np.zeros(2 * n, np.bool_), np.zeros(2 * n),
                                np.zeros(2 * n, np.int64))
            self._steady_views, self._kernel = {}, (None, None)
        rules = (k, max_len, int(check_end), call, self.pool.migrate_from)
        if kernel is None:
            r, *sums = self._steady_kernel(matrix, counts, emitted, rules)
            sums += [False, 0, 0, 0]
        else:
            tk, held = self._kernel                 # kept while what it holds is
            if tk is None or held[0] is not kernel or held[1] is not cost.state or held[2] is not calibration.table:
                self._kernel = self.kernel(kernel, cost, calibration), (kernel, cost.state, calibration.table)
            args = (matrix, counts, emitted, self.row_slots, (*rules, len(self.id_of), int(adaptive), budget),
                    float(seconds), self._kernel[0])
            # The caller's arrays the same objects as at the call that found the entry (vLLM's persistent arrays,
            # the adapter's per batch size; weak references tell an id reused by another object) and the kernel of
            # the same numba type: then every type is (row_slots is always the table's int64 array, the scalars are
            # made so here). Else numba's dispatch. An entry is found (~0.15 ms) for arrays seen a second time:
            # arrays new at every call never pay for it.
            key, kernel_type = (id(matrix), id(counts), id(emitted)), args[6]._type
            found = self._direct.get(key)
            same = found is not None and found[2][0]() is matrix and found[2][1]() is counts \
                and found[2][2]() is emitted
            if same and found[1] is kernel_type:
                r, *sums = found[0](*args)
            else:
                r, *sums = steady_call(*args)
                if len(self._direct) >= 64:
                    self._direct.clear()
                self._direct[key] = (entry_of(steady_call, args) or steady_call, kernel_type, found[2]) if same \
                    else (None, None, (weakref.ref(matrix), weakref.ref(counts), weakref.ref(emitted)))
        if r < 0:
            return None
        views = self._steady_views.get(r)
        if views is None:
            out, learn, temps, lengths = self._steady_out
            views = self._steady_views[r] = (*out[:, :r], learn[:r], temps[:r], lengths[:r])
        return (*views, sums)

    def rows_known(self, ids: list, emitted: np.ndarray) -> bool:
        """Whether every row that emitted tokens holds a request with a slot (ids: the rows' request ids; their slots
        found by id where rows moved, joined or left since the last call). False: not the steady state, told before
        anything is built for the steady call (a new request's first call)."""
        n = len(emitted)
        if self.row_ids is None or ids[:n] != self.row_ids:
            self.row_ids = ids[:n]
            self.row_slots = np.fromiter((self.ids.get(i, -1) for i in self.row_ids), np.int64)  # (short: refused)
            self.row_unknown = len(self.row_slots) < n or bool((self.row_slots < 0).any())
        if not self.row_unknown:
            return True
        return len(self.row_slots) == n and not ((self.row_slots < 0) & (emitted > 0)).any()

    def kernel(self, pool_kernel, cost, calibration) -> TableKernel:
        """What `steady_call` reads, as one object: the pool's `kernel`, the table's arrays, the step cost's
        (`StepCost`) and the calibration's (`Calibration`)."""
        out, learn, temps, lengths = self._steady_out
        params = np.array([cost.prior, cost.prior_weight, cost.forget, cost.bucket_weight])
        parts = {"out": out, "learn": learn, "temps": temps, "lengths": lengths, "p_learned": self._p_learned,
                 "cost": cost.state, "cost_params": params, "bucket": cost.bucket, "sizes": cost.graph_sizes,
                 "calibration": calibration.table, "no_flags": NO_FLAGS, "pool": pool_kernel}
        return new_table_kernel(*(parts[f] if f in parts else getattr(self, f) for f in TABLE_FIELDS))

    def _steady_kernel(self, matrix, counts, emitted, rules) -> tuple:
        out, learn, temps, _ = self._steady_out
        return steady_rows(matrix, counts, emitted, self.row_slots, self.pool.meta, self.pool.cap, self.temperature,
                       (self.limit, self.end, self.sent, self.last_seen), rules, self.eos, out, learn, temps)

    def book(self, slots: np.ndarray, lengths: np.ndarray, step, calibration) -> tuple[int, int, int]:
        """What the engine kept of each row's last sent draft into the calibration (`Calibration`), then this call's
        lengths and prices (`step`: `IndexPool.step`'s) recorded as each slot's sent draft, in one compiled call (a
        call after a model's forward pays for every numpy call it makes). Returns (rows that learned, listed in
        the columns of `learned`: slot, kept, sent, credit's source, version, position; their kept tokens summed;
        tokens sent)."""
        learned, total, drafted = book_rows(slots, lengths, step.kept, step.credit, step.p_kept, self.sent, self.p_sent,
                                        self.learned, self._p_learned)
        if learned:                             # of the tokens sent last call, priced at p_sent: the prefix kept
            calibration.observe_rows(self._p_learned[:learned], self.learned[2, :learned], self.learned[6, :learned])
        return learned, total, drafted

    def _new_slot(self, claim: Claim, j: int, n_tokens: int, prompt: int, call: int, key: str | None) -> int:
        """A fresh slot for row j of the claim; key: the memory key of what its request stored before (None: none)."""
        s = self.pool.add(n_tokens)
        self._room(s)
        self.live.add(s)
        for name, (_, fill) in _SLOT_ARRAYS.items():    # nothing of the slot's last holder stays
            getattr(self, name)[s] = fill
        self.keys.pop(s, None)
        if key is not None:
            self.keys[s] = key
        self.prompt_len[s], self.last_seen[s] = prompt, call
        claim.slots[j], claim.starts[j] = s, 0
        claim.built += 1
        claim.fresh.append(j)
        return s

    def _prefix_of(self, matrix, row: int, count: int, lengths: dict[int, int]) -> int:
        cands = [s for s, n in lengths.items() if count - self.max_gap <= n < count]
        if not cands:
            return -1
        cands = np.array(cands, np.int64)
        n = np.array([lengths[s] for s in cands.tolist()], np.int64)
        same = fingerprints(matrix, np.full(len(cands), row), n) == self.fp[cands]
        for s, m in zip(cands[same].tolist(), n[same].tolist()):
            if not (len(self.eos) and int(matrix[row, m - 1]) in self.eos):
                return s
        return -1

    def _dropped_prompt(self, matrix, row: int, before: int) -> tuple[int, int]:
        """(prompt length, ring index) of a dropped request whose text is this row's first `before` tokens (the row
        continues it by this step's sampled tokens); (-1, -1): none."""
        d = self.dropped[: min(self.dropped_n, DROPPED_KEPT)]
        hit = np.flatnonzero(d[:, 0] == before)
        if len(hit) == 0:
            return -1, -1
        same = fingerprints(matrix, np.full(len(hit), row), d[hit, 0]) == self.dropped_fp[hit]
        if not same.any():
            return -1, -1
        i = int(hit[same][-1])
        return int(d[i, 2]), i

    # -- leaving --------------------------------------------------------------------------------------
    def drop(self, s: int) -> None:
        """Free slot s, remembering its length and prompt length (a recomputed request gets them back)."""
        self.row_ids = None                             # the next call finds its rows' slots by id again
        n, prompt = int(self.pool.length([s])[0]), int(self.prompt_len[s])
        self._unfile(s)
        key = self.keys.pop(s, None)
        if prompt >= 0:
            i = self.dropped_n % DROPPED_KEPT
            self.dropped[i], self.dropped_fp[i], self.dropped_key[i] = (n, 0, prompt), self.fp[s], key
            self.dropped_n += 1
        rid = self.id_of.pop(s, None)
        if rid is not None:
            del self.ids[rid]
            self.dropped_ids[rid] = key
            if len(self.dropped_ids) > DROPPED_KEPT:
                self.dropped_ids.popitem(last=False)
        self.live.discard(s)
        self.pool.remove(s)

    def ended(self, matrix, rows, slots, counts) -> np.ndarray:
        """bool [r]: the rows whose request finished (their last token is EOS, or they reached the request's end)."""
        ended = counts >= self.end[slots]
        last = matrix[rows, counts - 1]
        for e in self.eos.tolist():
            ended |= last == e
        return ended

    def unstored(self, seen_before: int | None = None) -> np.ndarray:
        """Live slots whose text grew past what was stored of it (seen_before: only those last seen before that
        call)."""
        live = np.fromiter(self.live, np.int64, count=len(self.live))
        if seen_before is not None:
            live = live[self.last_seen[live] < seen_before]
        return live[self.pool.length(live) > self.stored[live]]

    def idle(self, before: int) -> list[int]:
        """Live slots last seen at a call <= `before`, least recently seen first."""
        live = np.fromiter(self.live, np.int64, count=len(self.live))
        old = live[self.last_seen[live] <= before]
        return old[np.argsort(self.last_seen[old], kind="stable")].tolist()
