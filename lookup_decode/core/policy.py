"""How many draft tokens to verify this step: expected emitted tokens per unit of forward cost.

Acceptance is estimated online from what the model actually emitted, per bucket of match length (a
40-token match is far better evidence than a 2-token one). Each step picks the draft width w (tokens
per row in the verify forward) that maximizes E[tokens emitted by all rows | w] / cost(w), with the
measured cost of `cost.py`; w = 1 is plain decoding, so drafting only happens where it is expected to
pay. One sequence is a batch of one. Then `fit` turns the chosen length into the draft to send: a
cut chain, a tree pruned to the tokens the cost curve gives for free, or (compiled forwards) a
chain rounded up to one of a few bucketed sizes.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from lookup_decode.core.config import check_k
from lookup_decode.core.draft import Draft, kept_prefix

_N_BUCKETS = 8          # match length buckets: 1, 2-3, 4-7, ..., >= 128 (powers of two)
_FORGET = 0.97          # per observation; recent behaviour matters more (output style drifts)
# Prior acceptance per match-length bucket: P(first draft token kept) and P(next kept | previous kept),
# from offline replay on real large-model outputs; the first-token prior is scaled by FIRST_PRIOR_FACTOR
# (a request's first decisions are fresh matches, wrong more often than copies being followed).
# How they were measured, and the replay behind the factor: benchmarks/results/replay/priors.md.
MEASURED_FIRST = np.array([0.29, 0.55, 0.68, 0.78, 0.88, 0.99, 0.99, 0.99])
PRIOR_LATER = np.array([0.83, 0.90, 0.91, 0.93, 0.97, 0.98, 0.99, 0.99])
FIRST_PRIOR_FACTOR = 0.6
# Worth a few observations only: each request's own acceptance takes over within a few steps.
_PRIOR_WEIGHT = 4.0
_ROWS_IN_TURN = 4       # observe_rows: up to this many rows, one observe per row
# Forward sizes (1 + draft length) of a compiled forward: log2(k) + 1 shapes instead of k + 1.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def prior_counts(first_prior_factor: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The acceptance counts a request starts from: [bucket, (kept, tried)] float64 [_N_BUCKETS, 2] for the first
    draft position and for later ones, the prior rates with the weight of _PRIOR_WEIGHT observations."""
    factor = FIRST_PRIOR_FACTOR if first_prior_factor is None else first_prior_factor
    first = np.stack([factor * MEASURED_FIRST * _PRIOR_WEIGHT, np.full(_N_BUCKETS, _PRIOR_WEIGHT)], axis=1)
    later = np.stack([PRIOR_LATER * _PRIOR_WEIGHT, np.full(_N_BUCKETS, _PRIOR_WEIGHT)], axis=1)
    return first, later


def ragged_lengths(p_kept: np.ndarray, available: np.ndarray, token_cost: float) -> np.ndarray:
    """How many tokens of each row's draft to verify when every row verifies its own number (an engine that
    packs rows back to back, like vLLM): the choice that maximizes the step's expected emitted tokens per
    unit of its cost.

    p_kept: float [r, k], row i's probability that draft token j is kept (non-increasing in j);
    available: int [r], the tokens row i has; token_cost: the cost of one more token in the step relative to
    the step's fixed cost (seconds = fixed (1 + token_cost x tokens); 0: tokens are free). Every row emits one
    token anyway, so the step's value is r + the kept drafts and its cost 1 + token_cost (r + drafted). Taking
    draft tokens from the most to the least probable, that ratio rises while a token's probability exceeds
    token_cost times the ratio so far, then falls: the best prefix of that order is the answer, and within a
    row it is a prefix of its draft. Returns int64 [r].

    Example: p_kept [[0.9, 0.8], [0.1, 0.05]], available [2, 2], token_cost 0.2 -> [2, 0].
    """
    out = np.zeros(p_kept.shape[0], np.int64)
    _ragged(np.ascontiguousarray(p_kept, np.float64), np.asarray(available, np.int64), float(token_cost), out)
    return out


@njit(cache=True, nogil=True)
def _ragged(p_kept, available, token_cost, out):
    r, k = p_kept.shape
    p = np.full(r * k, -1.0)
    for i in range(r):
        for j in range(min(available[i], k)):
            p[i * k + j] = p_kept[i, j]
    order = np.argsort(-p, kind="mergesort")     # stable: a row's equal probabilities stay in draft order
    value, cost = float(r), 1.0 + token_cost * r
    best, best_m = value / cost, 0
    for m in range(r * k):
        x = p[order[m]]
        if x <= 0.0:
            break                                # only tokens that can be kept
        value += x
        cost += token_cost
        if value / cost > best:
            best, best_m = value / cost, m + 1
    for m in range(best_m):
        out[order[m] // k] += 1


def bucket(match_len: int) -> int:
    """Match-length bucket 0.._N_BUCKETS - 1: 1, 2-3, 4-7, ... (powers of two)."""
    return min(max(int(match_len), 1).bit_length() - 1, _N_BUCKETS - 1)


def buckets(match_lens: np.ndarray) -> np.ndarray:
    """`bucket` of every match length at once, int64 [r]."""
    m = np.maximum(np.asarray(match_lens, dtype=np.int64), 1)
    # bit_length(m) - 1 == floor(log2(m)); frexp is exact for every int64 a match length can be.
    return np.minimum(np.frexp(m.astype(np.float64))[1] - 1, _N_BUCKETS - 1)


class DraftPolicy:
    """Chooses the draft width per step and learns acceptance from the tokens emitted.

    Acceptance model per match-length bucket: a1 = P(first draft token kept), a2 = P(next kept |
    previous kept), so E[emitted | d] = 1 + a1 (1 + a2 + ... + a2^(d-1)). Counts decay with
    `_FORGET`. Learning never needs a verification: every step compares the *whole* proposed
    draft with the tokens that were then emitted, so even when nothing is verified (d = 0) the
    policy keeps learning whether drafting would have paid.

    Args:
        k: the most draft tokens ever verified in one step.
        cost: measured forward cost (a `CostCurve`); None disables adaptation (always
            verify min(k, draft) tokens).
        first_prior_factor: scales the prior of the first draft token (replay studies vary it).
    """

    def __init__(self, k: int, cost=None, *, first_prior_factor: float = FIRST_PRIOR_FACTOR):
        self.k = check_k(k)
        self.cost = cost
        self.first, self.later = prior_counts(first_prior_factor)
        self._powers = np.arange(self.k + 1, dtype=np.float64)

    def expected_emitted(self, match_len: int, max_d: int) -> np.ndarray:
        """E[tokens emitted | d] for d = 0..max_d, float64 [max_d + 1]."""
        return self.expected_table(np.array([match_len]), max_d)[0]

    def expected_table(self, match_lens: np.ndarray, max_d: int) -> np.ndarray:
        """E[tokens emitted | d] of rows backed by match_lens (int [r]), d = 0..max_d: float64 [r, max_d + 1]."""
        b = buckets(match_lens)
        a1 = self.first[b, 0] / self.first[b, 1]
        a2 = self.later[b, 0] / self.later[b, 1]
        kept_after_first = np.zeros((len(b), max_d + 1))
        np.cumsum(a2[:, None] ** self._powers[:max_d], axis=1, out=kept_after_first[:, 1:])
        return 1.0 + a1[:, None] * kept_after_first

    def choose(self, drafts: list[Draft]) -> int:
        """Draft width w (tokens per row in the verify forward, 1 = no draft) maximizing E[emitted] / cost(w).

        Each row drafts min(len(its chain), w - 1) tokens: within one padded forward a row's extra
        draft tokens cost nothing more, so only the common width is a choice. All rows at once (one
        table of E[emitted | d] per row): a batch of 64 rows costs a few array operations, not 64 loops.
        """
        lengths = np.array([min(len(d.chain), self.k) for d in drafts], dtype=np.int64)
        max_d = int(lengths.max(initial=0))
        if max_d == 0 or self.cost is None:
            return max_d + 1
        table = self.expected_table(np.array([d.match_len for d in drafts]), max_d)     # [r, max_d + 1]
        # Row i drafts min(d, n_i) tokens at width d + 1.
        gain = np.take_along_axis(table, np.minimum(np.arange(max_d + 1)[None, :], lengths[:, None]), 1).sum(0)
        return int(np.argmax(gain / self.cost.prices(max_d + 1))) + 1

    def tree_budget(self, n: int) -> int | None:
        """Most tree nodes worth verifying when the chain verifies n: extra branches only where the measured
        curve says they are free, i.e. the largest m >= n with cost(m + 1) <= cost(n + 1). None = no cost
        model (no limit). A flat (GPU-like) curve allows wide trees; a steep CPU curve allows few or none."""
        if self.cost is None:
            return None
        base = self.cost(n + 1)
        return max([m for m in range(n, self.cost.max_w) if self.cost(m + 1) <= base])

    def fit(self, full: Draft, n: int, limit: int, draft_kind: str) -> Draft:
        """The draft to verify when the policy chose n tokens of `full`.

        draft_kind: "chain" (the first n tokens), "tree" (a tree keeps the branches the cost curve gives
        for free), or "buckets" (a compiled forward: 1 + length rounded up to a size in BUCKETS that fits
        limit + 1, padded with more of the proposal, then with token 0 — a filler is almost always
        rejected, and verification keeps only what the model itself emits).
        Example (buckets): chain [5, 6, 7], n=2, limit=31 -> [5, 6, 7]; chain [5], n=1 -> [5]; n=0 -> [].
        """
        if draft_kind == "tree":
            return full.cut(n, self.tree_budget(n) if n > 0 else 0)
        if draft_kind == "chain":
            return full.cut(n)
        fitting = [b for b in BUCKETS if b - 1 <= limit]
        d = next((b for b in fitting if b >= n + 1), fitting[-1]) - 1
        chain = full.chain
        tokens = chain[:d] if d <= len(chain) else np.concatenate([chain, np.zeros(d - len(chain), chain.dtype)])
        return Draft(tokens, full.match_len)

    def observe(self, draft: Draft, emitted) -> None:
        """Learn from the full proposed draft and the tokens this step emitted (int [e])."""
        chain = draft.chain
        n = min(len(chain), len(emitted))
        if n == 0:
            return
        b = bucket(draft.match_len)
        kept = kept_prefix(chain, emitted)
        self.first[b] *= _FORGET
        self.later[b] *= _FORGET
        self.first[b] += (1.0 if kept > 0 else 0.0, 1.0)
        self.later[b] += (max(kept - 1, 0), min(kept, n - 1))    # later positions actually decided

    def observe_rows(self, drafts: list[Draft], emitted: list) -> None:
        """`observe` for every row of a step; the same result as observing them one by one, in order.

        Observing m rows of one bucket in turn gives counts F^m * old + sum_i F^(m-1-i) x_i (F = _FORGET):
        computed with one weight per row instead of m sequential updates. A few rows are observed in turn
        (the array set-up costs more than it saves there)."""
        if len(drafts) <= _ROWS_IN_TURN:
            for d, e in zip(drafts, emitted):
                self.observe(d, e)
            return
        chains = [d.chain for d in drafts]
        n = np.array([min(len(c), len(e)) for c, e in zip(chains, emitted)], dtype=np.int64)
        seen = np.flatnonzero(n > 0)
        if len(seen) == 0:
            return
        kept = np.array([kept_prefix(chains[i], emitted[i]) for i in seen], dtype=np.float64)
        b = buckets(np.array([drafts[i].match_len for i in seen]))
        count = np.bincount(b, minlength=_N_BUCKETS)
        # Rank of each row among the rows of its bucket (0 = first observed) -> weight F^(m - 1 - rank).
        order = np.argsort(b, kind="stable")
        starts = np.cumsum(count) - count
        rank = np.empty(len(b), np.int64)
        rank[order] = np.arange(len(b)) - starts[b[order]]
        weight = _FORGET ** (count[b] - 1 - rank)
        decay = (_FORGET ** count)[:, None]
        # kept > 0 on the first position; later positions: kept - 1 of min(kept, n - 1) decided.
        first = np.stack([(kept > 0) * weight, weight], 1)
        later = np.stack([np.maximum(kept - 1, 0) * weight, np.minimum(kept, n[seen] - 1) * weight], 1)
        self.first = self.first * decay
        self.later = self.later * decay
        np.add.at(self.first, b, first)
        np.add.at(self.later, b, later)
