"""The acceptance model: the probability that draft token j of a row is kept (it and every token before it), the one
home of its constants, its cell layout and its rule, for every engine.

p_j = q_0 q_1 ... q_j, where q_j = P(token j kept | tokens before it kept) is estimated in cells of what the replays
show matters: the temperature of the row (greedy / sampled), the position j, the request's recent copy rate (the
share of its full proposed draft's decided positions the target went on to emit, over its last few steps, each step
weighing the same; learned on every step, even one that sent nothing), the
match length behind the draft (bucket), whether j lies past the matched length, whether the matched context has
branched before (its automaton state has more than one outgoing edge: the text went on differently after it), and
the draft's source (0 the request, 1 + c corpus c of the caller's tie-break order: memory, references).

The cells form a hierarchy, each level adding features to its parent's:

    level 0: temperature class x (first position or not) x copy-rate class
    level 1: + position class
    level 2: + match bucket + past the match
    level 3: + branched + source

Counts (kept, tried) are pooled over every row and request of the engine (one `DraftPolicy`, one `IndexPool`), a
cell forgetting FORGET per observation of it, and a cell's estimate is shrunk to its parent's:
q_l = (kept_l + BACKOFF q_(l-1)) / (tried_l + BACKOFF), q_(-1) the measured root (ROOT_FIRST, ROOT_LATER).
A sparse cell thus says what its parent
says, a full one what it saw.

The copy rate is the one per-request feature, and it sits at the top: it tells the phases of one output apart. A code
edit copies 30 tokens a step for a while, then writes code of its own, where a 1-token match is kept a few times in a
hundred. With a top cell pooled over both phases (the layout before 2026-12-05) the copy phase's later-position rate
(~0.98) priced the writing phase's short matches, and drafts of 32 tokens went on for dozens of steps of misses
(benchmarks/results/readme_job). A step's share, not its token count, feeds the rate for the same reason: one 32-token
copy held a token-weighted rate high for ~10 steps after it. A second per-request term, each request's kept-vs-
predicted odds over its last ~50 tokens, was removed then: it counted the same recent evidence as the rate class a
second time, which miscalibrated a stationary stream (tests/test_policy.py), and it earned nothing measurable.

Learning compares a row's *full* proposed draft with the tokens the step then emitted (`observe`): positions
0..kept were decided (the first `kept` kept, the next one missed if the draft went on), the rest not.

Everything is module-level `@njit` functions over plain arrays: `DraftPolicy` (core/policy.py) calls them from
Python, `IndexPool`'s kernel (core/pool.py) from inside its compiled step, so both give the same probabilities for
the same stream. The hand-set constants are one float64 array, `PARAMS` (`params(**overrides)` for another set),
passed to every kernel: an edited constant is never a stale one compiled into numba's on-disk cache. (That cache
does not notice an edit of the *code* of a function here that a kernel of another module calls, e.g. pool._step:
after editing one, delete lookup_decode/core/__pycache__/*.nbi.) How calibrated it is on recorded real outputs, and
what its levels earn: `python -m benchmarks.replay.calibration` (benchmarks/results/calibration/).
"""

from __future__ import annotations

import numpy as np
from numba import njit

N_BUCKETS = 8            # match length buckets: 1, 2-3, 4-7, ..., >= 128 (powers of two)
N_POS = 6                # position classes of draft token j: 0, 1, 2-3, 4-7, 8-15, >= 16
N_RATE = 4               # copy-rate classes: no evidence yet, < 1/3, < 2/3, >= 2/3
N_SOURCE = 3             # 0 the request, 1 + c corpus c (c < 2)
N_TEMP = 3               # temperature classes: greedy (0), 0 < T < 1, T >= 1
LEVELS = 4
# The constants, by name (PARAMS holds them in this order, then ROOT_FIRST and ROOT_LATER):
#   forget          per observation of a cell: the last ~1000 (a batch of 8 decides ~30 tokens a step)
#   backoff         a parent's estimate weighs as this many observations in its child cell
#   rate_forget     per observed step: the copy rate follows the last ~7 steps
#   rate_low, rate_high   the copy-rate class boundaries
#   levels          levels of cells used (4: all; fewer drops the deepest), the ablation's knob
#   rate_classes    1: cells per copy-rate class; 0: one class (the ablation's knob)
# ROOT_FIRST, ROOT_LATER: the estimate above level 0, per match bucket, for the first draft position and for later
# ones (q, conditional on the tokens before kept): what an engine that has seen nothing assumes. Measured by offline
# replay of the suffix index on real large-model outputs (six sets; `python -m benchmarks.replay.drafts
# --measure-priors`, benchmarks/results/replay/priors.md). Every level shrinks toward it, so a fresh engine (or a
# replay that starts each request afresh) drafts as a copy-aware engine would, and its own evidence takes over cell
# by cell.
DEFAULTS = dict(forget=0.999, backoff=16.0, rate_forget=0.85,
                rate_low=1.0 / 3.0, rate_high=2.0 / 3.0, levels=4, rate_classes=1,
                root_first=[0.29, 0.55, 0.68, 0.78, 0.88, 0.99, 0.99, 0.99],
                root_later=[0.83, 0.90, 0.91, 0.93, 0.97, 0.98, 0.99, 0.99])
FORGET, BACKOFF, RATE_FORGET, RATE_LOW, RATE_HIGH, USE_LEVELS, USE_RATE = range(7)     # indexes into a params array
ROOT_FIRST, ROOT_LATER = 7, 7 + N_BUCKETS          # where each bucket's root starts


def params(**overrides) -> np.ndarray:
    """The model's constants as the kernels take them: float64 [ROOT_FIRST + 2 N_BUCKETS], DEFAULTS with `overrides`.
    Example: params(levels=3) drops the deepest level of cells."""
    unknown = set(overrides) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown acceptance parameters {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    v = {**DEFAULTS, **overrides}
    if not 1 <= v["levels"] <= LEVELS:
        raise ValueError(f"levels must be in [1, {LEVELS}], got {v['levels']}")
    scalars = [v[name] for name in list(DEFAULTS)[:ROOT_FIRST]]
    return np.array(scalars + list(v["root_first"]) + list(v["root_later"]), np.float64)


# Cells per level and where each level starts in the one counts array.
_L0 = N_TEMP * 2 * N_RATE
_L1 = N_TEMP * N_POS * N_RATE
_L2 = _L1 * N_BUCKETS * 2
_L3 = _L2 * 2 * N_SOURCE
OFFSETS = np.array([0, _L0, _L0 + _L1, _L0 + _L1 + _L2], np.int64)
N_CELLS = _L0 + _L1 + _L2 + _L3
PARAMS = params()

# A request's state, float64 [REQUEST_SIZE]: its copy rate, decayed (sum of its steps' shares, steps).
RATE_SHARES, RATE_STEPS = range(2)
REQUEST_SIZE = 2


def new_counts() -> np.ndarray:
    """The pooled counts of an engine that has seen nothing: float64 [N_CELLS, 2] (kept, tried)."""
    return np.zeros((N_CELLS, 2))


def new_requests(n: int) -> np.ndarray:
    """The state of n requests that have seen nothing: float64 [n, REQUEST_SIZE]."""
    return np.zeros((n, REQUEST_SIZE))


@njit(cache=True, nogil=True)
def bucket(match_len):
    """Match-length bucket 0..N_BUCKETS - 1: 1, 2-3, 4-7, ... (powers of two)."""
    b = 0
    m = max(match_len, 1)
    while m > 1:
        m >>= 1
        b += 1
    return min(b, N_BUCKETS - 1)


@njit(cache=True, nogil=True)
def position_class(j):
    """Class of draft position j (0-based): 0, 1, 2-3, 4-7, 8-15, >= 16."""
    return min(bucket(j) + 1, N_POS - 1) if j > 0 else 0


@njit(cache=True, nogil=True)
def temperature_class(t):
    """0 greedy (t <= 0), 1 for 0 < t < 1, 2 for t >= 1."""
    if t <= 0.0:
        return 0
    return 1 if t < 1.0 else 2


@njit(cache=True, nogil=True)
def rate_class(request, params):
    """The request's copy-rate class from its state (float64 [REQUEST_SIZE])."""
    if request[RATE_STEPS] < 1.0 or params[USE_RATE] == 0.0:
        return 0
    r = request[RATE_SHARES] / request[RATE_STEPS]
    if r < params[RATE_LOW]:
        return 1
    return 2 if r < params[RATE_HIGH] else 3


@njit(cache=True, nogil=True)
def _cells(temp, j, rate, b, past, branched, source, out):
    """The cell of draft position j at every level (rows of the counts array), into out int64 [LEVELS]."""
    c0 = (temp * 2 + min(j, 1)) * N_RATE + rate
    c1 = (temp * N_POS + position_class(j)) * N_RATE + rate
    c2 = (c1 * N_BUCKETS + b) * 2 + past
    c3 = (c2 * 2 + branched) * N_SOURCE + min(source, N_SOURCE - 1)
    out[0] = OFFSETS[0] + c0
    out[1] = OFFSETS[1] + c1
    out[2] = OFFSETS[2] + c2
    out[3] = OFFSETS[3] + c3


@njit(cache=True, nogil=True)
def _pooled(counts, cells, j, b, params):
    """q of draft position j (match bucket b) from its cells, each level shrunk to its parent's estimate."""
    q = params[ROOT_FIRST + b] if j == 0 else params[ROOT_LATER + b]
    backoff = params[BACKOFF]
    for level in range(int(params[USE_LEVELS])):
        c = cells[level]
        q = (counts[c, 0] + backoff * q) / (counts[c, 1] + backoff)
    return q


@njit(cache=True, nogil=True)
def predict(counts, request, match_len, branched, source, temperature, d, out, params):
    """out[j] = P(draft tokens 0..j kept), j < d, for a draft of d tokens backed by a match of match_len tokens.

    counts: float64 [N_CELLS, 2], the pool; request: float64 [REQUEST_SIZE], the row's request; branched: 0/1;
    source: 0 the request, 1 + c corpus c; temperature: the row's sampling temperature (0: greedy); params: `PARAMS`
    or another `params(...)`.
    """
    cells = np.empty(LEVELS, np.int64)
    temp, rate, b = temperature_class(temperature), rate_class(request, params), bucket(match_len)
    p = 1.0
    for j in range(d):
        _cells(temp, j, rate, b, 1 if j >= match_len else 0, branched, source, cells)
        p *= _pooled(counts, cells, j, b, params)
        out[j] = p


@njit(cache=True, nogil=True)
def observe(counts, request, match_len, branched, source, temperature, decided, kept, params):
    """Learn from one step of one row: its full proposed draft (backed by match_len, branched, source, at the row's
    temperature) had `decided` = min(draft length, tokens emitted) positions comparable with what was emitted, of
    which the first `kept` matched. Positions 0..min(kept, decided - 1) were decided; updates the pool's cells and
    the request's copy rate."""
    if decided <= 0:
        return
    cells = np.empty(LEVELS, np.int64)
    temp, rate, b = temperature_class(temperature), rate_class(request, params), bucket(match_len)
    forget, rate_forget = params[FORGET], params[RATE_FORGET]
    for j in range(min(kept + 1, decided)):
        _cells(temp, j, rate, b, 1 if j >= match_len else 0, branched, source, cells)
        hit = 1.0 if j < kept else 0.0
        for level in range(int(params[USE_LEVELS])):
            c = cells[level]
            counts[c, 0] = counts[c, 0] * forget + hit
            counts[c, 1] = counts[c, 1] * forget + 1.0
    request[RATE_SHARES] = request[RATE_SHARES] * rate_forget + kept / decided
    request[RATE_STEPS] = request[RATE_STEPS] * rate_forget + 1.0


@njit(cache=True, nogil=True)
def predict_rows(counts, requests, rows, match_len, branched, source, temperature, lengths, out, params):
    """`predict` for every row i of a step: request requests[rows[i]], its draft of lengths[i] tokens; out float64
    [r, >= max(lengths)] (zeros past each row's length)."""
    for i in range(rows.shape[0]):
        out[i, :] = 0.0
        predict(counts, requests[rows[i]], match_len[i], branched[i], source[i], temperature[i], lengths[i], out[i],
                params)


@njit(cache=True, nogil=True)
def observe_rows(counts, requests, rows, match_len, branched, source, temperature, decided, kept, params):
    """`observe` for every row of a step, in order."""
    for i in range(rows.shape[0]):
        observe(counts, requests[rows[i]], match_len[i], branched[i], source[i], temperature[i], decided[i], kept[i],
                params)

