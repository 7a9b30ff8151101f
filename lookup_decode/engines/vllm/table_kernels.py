"""The compiled loops of `requests.RequestTable`: fingerprints of rows, the steady-state check (and, where it can,
the pool's step and the step's end in the same call: `steady_call`), and the bookkeeping of what each row was sent.
They take the table's arrays as arguments, or one `TableKernel` holding them; the table (`requests.py`) keeps the
state and decides when each runs."""

import numpy as np
from numba import njit, typeof, types
from numba.experimental import structref
from numba.extending import typeof_impl

from lookup_decode.core.automaton import N_TOKENS
from lookup_decode.core.pool import FIRST_CAP, drop_stale_cache, room_action, step_rows
from lookup_decode.core.stats import calibrate
from lookup_decode.core.step_cost import choose_step, observe_step

# `steady_call` compiles in the pool's step and what that compiles in: numba's cache of this file alone would keep
# running the old step after an edit of those.
drop_stale_cache(__file__, ("core/pool.py", "core/automaton.py", "core/acceptance.py", "core/draft.py",
                            "core/step_cost.py", "core/policy.py", "core/stats.py"))

# Fingerprint positions: the first and last tokens tell most requests apart; evenly spaced ones catch
# requests that share a long template at both ends (same system prompt, same closing question).
_HEAD, _TAIL, _SPREAD = 8, 16, 8
_MULT = np.random.default_rng(20250514).integers(1, 2**63, size=_HEAD + _TAIL + _SPREAD + 1, dtype=np.uint64) | 1


@njit(cache=True, nogil=True)
def _fingerprints(matrix, rows, lengths, mult, out):
    for j in range(rows.shape[0]):
        n, row = lengths[j], rows[j]
        h = np.uint64(0)
        for i in range(_HEAD + _TAIL + _SPREAD):
            if i < _HEAD:
                pos = i
            elif i < _HEAD + _TAIL:
                pos = n - _TAIL + (i - _HEAD)
            else:
                pos = (n * (i - _HEAD - _TAIL + 1)) // (_SPREAD + 1)
            if 0 <= pos < n:
                h += (np.uint64(matrix[row, pos]) + np.uint64(1)) * mult[i]
        out[j] = h + np.uint64(n) * mult[-1]


@njit(cache=True, nogil=True)
def steady_rows(matrix, counts, emitted, row_slots, meta, cap, temperature, per_slot, rules, eos, out, learn, temps):
    """The kernel of `RequestTable.steady`: the rows' step arrays in `out` (rows, slots, starts, ends, limits), learn
    and temps; rules: (k, max_len, check_end, call, migrate_from). Returns (rows, verified, prefill, continued, most
    new tokens, any slot `IndexPool.reserve` has work for, rows ended); rows -1: not the steady state, nothing
    written."""
    limit, end, sent, last_seen = per_slot
    k, max_len, check_end, call, migrate_from = rules[0], rules[1], rules[2], rules[3], rules[4]
    r = verified = prefill = continued = most = near = ended = 0
    if row_slots.shape[0] != counts.shape[0]:
        return -1, 0, 0, 0, 0, 0, 0
    for i in range(counts.shape[0]):
        n = counts[i]
        if emitted[i] == 0:
            prefill += n                    # a row still prefilling
            continue
        s = row_slots[i]
        if s < 0 or n >= max_len:
            return -1, 0, 0, 0, 0, 0, 0
        before, have = n - emitted[i], meta[s, N_TOKENS]
        if have > before:                   # not the slot's text continued
            return -1, 0, 0, 0, 0, 0, 0
        if check_end:                       # a finished request (its output is stored once the call has drafted)
            if n >= end[s]:
                ended += 1
            else:
                for e in eos:
                    if matrix[i, n - 1] == e:
                        ended += 1
                        break
        out[0, r], out[1, r], out[2, r], out[3, r] = i, s, have, n
        out[4, r] = max(min(limit[s], k, end[s] - n - 1, max_len - n - 1), 0)
        learn[r] = have == before
        if have < before:
            continued += 1
        temps[r] = temperature[s]
        verified += 1 + sent[s]
        if have == 0:
            prefill += n - 1
        most = max(most, n - have)
        if room_action(n, cap[s], migrate_from):   # `reserve` has work (else it is skipped: a third of a call)
            near = 1
        r += 1
    if r == 0:
        return -1, 0, 0, 0, 0, 0, 0
    for j in range(r):
        last_seen[out[1, j]] = call
    return r, verified, prefill, continued, most, near, ended


@structref.register
class _TableKernelType(types.StructRef):
    def preprocess_fields(self, fields):
        return tuple((name, types.unliteral(t)) for name, t in fields)


class TableKernel(structref.StructRefProxy):
    """What `steady_call` reads besides the call's rows, as one object: the table's per-slot arrays and scratch, the
    step cost's sums and constants, the calibration table and the pool's `kernel` (`RequestTable.kernel`). After a
    model's forward each object numba's dispatch types in Python costs ~8 us (a call itself ~6 us), so the call
    takes one."""


TABLE_FIELDS = ("limit", "end", "sent", "last_seen", "temperature", "eos", "out", "learn", "temps", "lengths", "p_sent",
                "learned", "p_learned", "cost", "cost_params", "bucket", "sizes", "calibration", "no_flags", "pool")
structref.define_proxy(TableKernel, _TableKernelType, list(TABLE_FIELDS))
typeof_impl.register(TableKernel)(lambda value, context: value._type)    # (as the pool's kernel: core/pool.py)


def entry_of(dispatcher, args):
    """The compiled function numba's `dispatcher` runs for arguments of these types, to be called without its
    dispatch; None where it has none. Dispatch types every argument at every call, a structref in Python: after a
    model's forward that is ~15 us of the drafter's ~0.1 ms. Only for arguments whose types cannot change: the
    caller's check (an array of another type would be read as the first one's)."""
    try:
        return dispatcher.get_overload(tuple(typeof(a) for a in args))
    except KeyError:
        return None


@njit(cache=True)
def new_table_kernel(limit, end, sent, last_seen, temperature, eos, out, learn, temps, lengths, p_sent, learned,
                     p_learned, cost, cost_params, bucket, sizes, calibration, no_flags, pool):
    """A `TableKernel` of these fields, in `TABLE_FIELDS`' order (compiled once and cached, as the pool's; each
    named, as the pool's)."""
    return TableKernel(limit, end, sent, last_seen, temperature, eos, out, learn, temps, lengths, p_sent, learned,
                       p_learned, cost, cost_params, bucket, sizes, calibration, no_flags, pool)


@njit(cache=True, nogil=True)
def steady_call(matrix, counts, emitted, row_slots, rules, seconds, t):
    """`steady_rows` and, where nothing between the parts needs Python, the rest of the call in the same compiled
    call (each crossing into compiled code costs ~6 us after a model's forward, and ~8 more for each object numba
    types in Python): the pool's step over the rows (`step_rows`), then the last step's time into the step cost
    (`StepCost.observe`), this step's lengths (`StepCost.choose`) and their booking (`book_rows`, the
    calibration). It steps where no slot grows, the engine holds no request beyond these rows and every row's new
    tokens fit a first room (the caller checked the byte bound for that); rows that ended are drafted too (their
    outputs are stored after it). rules: (k, max_len, check_end, call, migrate_from, known requests, adaptive: 1
    the lengths chosen, 0 as drafted; the engine's token budget, -1 none); seconds: since the last call (<= 0: not
    observed); t: the table's `TableKernel` (t.pool: the pool's `kernel`). Returns `steady_rows`'s, whether it
    stepped, and `book_rows`'s (0s unless it stepped; the lengths in t.lengths)."""
    k, max_len, check_end, call, migrate_from, known, adaptive, budget = rules
    st = t.pool
    r, verified, prefill, continued, most, near, ended = steady_rows(
        matrix, counts, emitted, row_slots, st.meta, st.cap, t.temperature, (t.limit, t.end, t.sent, t.last_seen),
        (k, max_len, check_end, call, migrate_from), t.eos, t.out, t.learn, t.temps)
    stepped = r > 0 and near == 0 and known <= r and most <= FIRST_CAP
    learned = total = drafted = 0
    if stepped:
        out = t.out
        step_rows(matrix, out[0, :r], out[1, :r], out[2, :r], out[3, :r], out[4, :r], t.learn[:r], t.temps[:r],
                  st.roles[:r], st)
        p_kept, lengths = st.out_p[:r], t.lengths[:r]
        prior, weight, forget, bucket_weight = t.cost_params[0], t.cost_params[1], t.cost_params[2], t.cost_params[3]
        if continued == 0:                      # the step since the last call, none of whose rows missed steps
            observe_step(t.cost, t.bucket, t.sizes, verified, prefill, 1.0 if verified > r else 0.0, seconds, budget,
                         forget, prior, weight)
        if adaptive:
            lengths[:] = 0
            choose_step(t.cost, prior, weight, t.bucket, bucket_weight, t.sizes, p_kept, st.out_lengths[:r], r, 0,
                        np.empty(r * p_kept.shape[1] + 1), lengths)
        else:
            lengths[:] = st.out_lengths[:r]
        learned, total, drafted = book_rows(t.out[1, :r], lengths, st.out_kept[:r], st.out_credit[:r], p_kept, t.sent,
                                            t.p_sent, t.learned, t.p_learned)
        if learned:                             # of the tokens sent last call, priced at p_sent: the prefix kept
            calibrate(t.calibration, t.p_learned[:learned], t.learned[2, :learned], t.no_flags,
                      t.learned[6, :learned])
    return r, verified, prefill, continued, most, near, ended, stepped, learned, total, drafted


@njit(cache=True, nogil=True)
def book_rows(slots, lengths, kept, credit, p_kept, sent, p_sent, out, p_out):
    """The kernel of `RequestTable.book`: out int64 [7, >= r], p_out float [>= r, k] (scratch): out[:, j] = (slot,
    kept, sent, the credit's source, version, position, kept of sent) of the j-th row that learned."""
    learned, total, drafted = 0, 0, 0
    for i in range(slots.shape[0]):
        s = slots[i]
        if kept[i] >= 0:
            out[0, learned], out[1, learned], out[2, learned] = s, kept[i], sent[s]
            out[3, learned], out[4, learned], out[5, learned] = credit[i, 0], credit[i, 1], credit[i, 2]
            out[6, learned] = min(kept[i], sent[s])
            p_out[learned, :] = p_sent[s]
            learned += 1
            total += kept[i]
        drafted += lengths[i]
        sent[s] = lengths[i]
        p_sent[s, :] = p_kept[i]
    return learned, total, drafted


def fingerprints(token_ids: np.ndarray, rows, lengths) -> np.ndarray:
    """uint64 [r]: a fingerprint of token_ids[rows[j], :lengths[j]] for each j, from O(1) tokens per row.

    It hashes the length, the first 8 and last 16 tokens and 8 tokens at evenly spaced positions, so
    rows that differ in length or at any of those positions get different fingerprints (with
    probability ~1 - 2**-64). Example: the rows [5, 6, 7] and [5, 6, 7, 8] at length 3 are equal.
    """
    rows, lengths = np.asarray(rows, np.int64), np.asarray(lengths, np.int64)
    out = np.zeros(len(rows), np.uint64)
    _fingerprints(token_ids, rows, lengths, _MULT, out)
    return out
