"""The steady call in one compiled call: `call` runs what `BatchDrafter._steady` would run as five kernels and their
Python glue (find the rows' slots, learn the step's cost, learn and draft, choose the lengths, book them) in one.

Why one: in an engine the drafter runs right after a model's forward, which leaves nothing of the drafter's code or
data in the caches. Such a call pays for every compiled call and numpy call it makes rather than for their work
(after a 64 MB sweep a kernel of 31 array arguments took 68 us to call, of one array 22 us, np.zeros 16 us, against
3, 0.4 and 0.5 us warm), and batch 1 is where that is most of the call.

It serves the common case only and hands anything else back before changing a thing beyond the steady check (the
general path then does the rest, as it would have): a call where a row ended (its output is stored first), a known
request is absent (retired), a slot nears its room's end, the byte bound nears, a request reads corpora of its own,
a slot is being copied to more room, or the engine runs graph sizes (their means are kept in Python).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from lookup_decode.core.pool import drop_stale_cache, step_kernel
from lookup_decode.core.step_cost import choose_kernel, observe_kernel
from lookup_decode.engines.vllm.requests import book_rows, steady_rows

drop_stale_cache(__file__, ("core/pool.py", "core/automaton.py", "core/acceptance.py", "core/draft.py",
                            "core/step_cost.py", "core/policy.py", "engines/vllm/requests.py"))

NOT_STEADY, HANDED_BACK, DONE = -1, 0, 1


@njit(cache=True, nogil=True)
def _call(matrix, counts, emitted, steady_args, rules, steady_out, bound, cost, buffers, pool_args, corpora, roles,
          lengths, booked):
    row_slots, meta, cap, temperature, per_slot = steady_args
    eos, out, learn, temps = steady_out
    r, verified, prefill, continued, most, near, ended = steady_rows(matrix, counts, emitted, row_slots, meta, cap,
                                                                     temperature, per_slot, rules, eos, out, learn,
                                                                     temps)
    known, pool_bytes, max_bytes, room, budget, adaptive = bound
    if r < 0:
        return NOT_STEADY, r, verified, prefill, continued, most, near, ended, 0, 0, 0
    if most > 1024 or near or ended or known > r or 4 * (pool_bytes + r * room) > max_bytes:
        return HANDED_BACK, r, verified, prefill, continued, most, near, ended, 0, 0, 0
    # The step since the last call, none of whose rows missed steps: its time is its cost (StepCost.observe).
    state, (prior, prior_weight, forget), curve, seconds = cost
    if continued == 0 and seconds > 0:
        p = prefill if budget < 0 else max(0, min(prefill, budget - verified))  # chunked: at most the budget
        if verified + p > 0:
            observe_kernel(state, float(verified + p), float(p), 1.0 if verified > r else 0.0, seconds, forget,
                           prior, prior_weight)
    p_state, versions, p_rules, p_out = pool_args
    slots = out[1, :r]
    step_kernel(matrix, (out[0, :r], slots, out[2, :r], out[3, :r], out[4, :r], learn[:r], temps[:r], roles[:r],
                         versions), buffers, p_state, corpora, p_rules, p_out)
    _, full, _, _, p_kept, kept, credit = p_out
    lengths[:r] = 0
    if adaptive:                            # StepCost.choose on its line
        choose_kernel(state, prior, prior_weight, p_kept[:r], full[:r], r, 0, curve[:r * p_kept.shape[1] + 1],
                      lengths[:r])
    else:
        lengths[:r] = full[:r]
    sent, p_sent, listed, p_listed = booked
    learned, total, drafted = book_rows(slots, lengths[:r], kept[:r], credit[:r], p_kept[:r], sent, p_sent, listed,
                                        p_listed)
    return DONE, r, verified, prefill, continued, most, near, ended, learned, total, drafted


def call(table, cost, matrix, counts, emitted, ids: list, rules: tuple, *, corpora: list, roles, seconds: float,
         budget: int | None, max_bytes: int, room: int, adaptive: bool, lengths: np.ndarray):
    """The steady call of a `BatchDrafter` on the rows of these ids: table, its `RequestTable` (and through it the
    `IndexPool`); cost, its `StepCost`; rules, `RequestTable.steady`'s (k, max_len, check_end, call); corpora, the
    shared corpora read (`reading()`'s pairs) and roles, their roles per row (None: the pool's default); seconds
    since the last call (-1: none); budget, the engine's tokens per step (None: none); max_bytes, the byte bound;
    room, a new 1024-token index's bytes; lengths, int64 [>= rows] for the lengths chosen. Returns (status: DONE,
    HANDED_BACK or NOT_STEADY; `RequestTable.steady`'s tuple, None when not steady; the lengths chosen, on DONE;
    rows learned, tokens kept, tokens drafted: `RequestTable.book`'s)."""
    pool, n = table.pool, len(counts)
    args, steady_out = table.steady_args(ids, n)
    buffers, p_state, arrays, versions, p_rules, p_out, default = pool.kernel_args(corpora, n)
    status, r, *sums, learned, total, drafted = _call(
        matrix, counts, emitted, args, rules, steady_out,
        (len(table.id_of), pool.bytes, max_bytes, room, -1 if budget is None else int(budget), int(adaptive)),
        (*cost.line_args(n * pool.k), float(seconds)), buffers, (p_state, versions, p_rules, p_out), arrays,
        default if roles is None else roles, lengths, (table.sent, table.p_sent, table.learned, table.p_learned))
    got = None if status == NOT_STEADY else (*table.steady_views(r), sums)
    return status, got, lengths[:max(r, 0)], learned, total, drafted
