"""How many draft tokens to verify this step: expected emitted tokens per unit of forward cost.

Acceptance is estimated online from what the model actually emitted (the model of `core.acceptance`: match
length, position, copy rate, branching, source, temperature; pooled over the rows, a copy rate per request).
Each step picks the draft width w (tokens per row in the verify forward) that maximizes E[tokens emitted by all
rows | w] / cost(w), with the measured cost of `cost.py`; w = 1 is plain decoding, so drafting only happens where
it is expected to pay. One sequence is a batch of one. Then `fit` turns the chosen length into the draft to send:
a cut chain, a tree pruned to the tokens the cost curve gives for free, or (compiled forwards) a chain rounded up
to one of a few bucketed sizes.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from lookup_decode.core import acceptance as A
from lookup_decode.core.config import check_k
from lookup_decode.core.draft import Draft, kept_prefix

# Forward sizes (1 + draft length) of a compiled forward: log2(k) + 1 shapes instead of k + 1.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


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
    p_kept = np.ascontiguousarray(p_kept, np.float64)
    r, k = p_kept.shape
    # The step's cost with m tokens drafted, m = 0..r k: 1 + token_cost (r + m), summed in order.
    cost = np.cumsum(np.concatenate([[1.0 + float(token_cost) * r], np.full(r * k, float(token_cost))]))
    out = np.zeros(r, np.int64)
    best_prefix(p_kept, np.asarray(available, np.int64), cost, out)
    return out


@njit(cache=True, nogil=True)
def best_prefix(p_kept, available, cost, out):
    """The rule of `ragged_lengths` for any step cost: out[i] += the tokens of row i among the best prefix of all
    rows' draft tokens taken from the most to the least probable, cost[m] being the step's cost with m of them.
    Every prefix is tried (a padded cost can make the ratio rise again). The kernel of `ragged_lengths` and of
    `StepCost.choose`."""
    r, k = p_kept.shape
    p = np.full(r * k, -1.0)
    for i in range(r):
        for j in range(min(available[i], k)):
            p[i * k + j] = p_kept[i, j]
    order = np.argsort(-p, kind="mergesort")     # stable: a row's equal probabilities stay in draft order
    value = float(r)
    best, best_m = value / cost[0], 0
    for m in range(r * k):
        x = p[order[m]]
        if x <= 0.0:
            break                                # only tokens that can be kept
        value += x
        if value / cost[m + 1] > best:
            best, best_m = value / cost[m + 1], m + 1
    for m in range(best_m):
        out[order[m] // k] += 1


class DraftPolicy:
    """Chooses the draft width per step and learns acceptance from the tokens emitted.

    The probability that draft token j of a row is kept is `core.acceptance`'s model: pooled over every row this
    policy serves (one generate call: a sequence or a batch), each row a request with its own copy
    rate, so E[emitted | d] = 1 + p_0 + ... + p_(d-1). Learning never needs a verification: every step compares the
    *whole* proposed draft with the tokens that were then emitted, so even when nothing is verified (d = 0) the
    policy keeps learning whether drafting would have paid.

    Args:
        k: the most draft tokens ever verified in one step.
        cost: measured forward cost (a `CostCurve`); None disables adaptation (always
            verify min(k, draft) tokens).
        temperature: the sampling temperature of the rows (0: greedy); a sampled row keeps a draft token with the
            target's probability of it, so it has cells of its own.
        counts: the pooled counts to learn into (`acceptance.new_counts()`), shared by every policy given the same
            array: an engine's evidence across calls (the transformers hook keeps one per model); None: a new pool.
        params: the acceptance model's constants (`acceptance.params(...)`; None: `acceptance.PARAMS`).
    Attributes:
        last_p: float64 [r, max draft length] the probabilities the last `choose` priced its rows' drafts with.
    """

    def __init__(self, k: int, cost=None, *, temperature: float = 0.0, counts: np.ndarray | None = None,
                 params: np.ndarray | None = None):
        self.k = check_k(k)
        self.params = A.PARAMS if params is None else params
        self.cost = cost
        self.temperature = float(temperature)
        self.counts = A.new_counts() if counts is None else counts
        self.requests = A.new_requests(1)
        self.last_p = np.zeros((0, 0))

    def _rows(self, n: int, rows) -> np.ndarray:
        """Row ids (int64 [n]) of the drafts of a step: their requests' states (grown as rows appear)."""
        rows = np.arange(n, dtype=np.int64) if rows is None else np.asarray(rows, np.int64)
        top = int(rows.max(initial=0)) + 1
        if top > len(self.requests):
            self.requests = np.concatenate([self.requests, A.new_requests(max(top, 2 * len(self.requests))
                                                                          - len(self.requests))])
        return rows

    def _features(self, drafts: list[Draft]):
        n = len(drafts)
        return (np.array([d.match_len for d in drafts], np.int64), np.array([d.branched for d in drafts], np.int64),
                np.array([d.source for d in drafts], np.int64), np.full(n, self.temperature))

    def p_kept(self, drafts: list[Draft], rows=None) -> np.ndarray:
        """float64 [r, max chain length]: P(tokens 0..j of row i's chain kept), zeros past its length.

        rows: each draft's row (its request) in this policy, default 0..r-1."""
        rows = self._rows(len(drafts), rows)
        lengths = np.array([min(len(d.chain), self.k) for d in drafts], np.int64)
        out = np.zeros((len(drafts), int(lengths.max(initial=0))))
        A.predict_rows(self.counts, self.requests, rows, *self._features(drafts), lengths, out, self.params)
        return out

    def choose(self, drafts: list[Draft], p: np.ndarray | None = None, room=None) -> int:
        """Draft width w (tokens per row in the verify forward, 1 = no draft) maximizing E[emitted] / cost(w).

        Each row drafts min(len(its chain), w - 1) tokens: within one padded forward a row's extra
        draft tokens cost nothing more, so only the common width is a choice. p: `p_kept(drafts, rows)`
        (default: rows 0..r-1). room: each row's tokens left before its length limit (a batch that runs until
        its last row ends): only the rows furthest from the end count, see below. Sets `last_p`.
        """
        p = self.p_kept(drafts) if p is None else p
        self.last_p = p
        max_d = p.shape[1]
        if max_d == 0 or self.cost is None:
            return max_d + 1
        if room is not None and len(drafts) > 1:
            # A batch's forwards last until its last row ends, and a forward of fewer rows costs about the same
            # (decoding is memory-bound): a token gained by a row that is ahead ends nothing sooner. Only the
            # rows with the most tokens left set how many forwards the batch still takes, so only their drafts
            # are worth a wider forward. (transformers, code edits at batch 4 in bf16: rows that copied finished
            # early while the others paid wide forwards for ~0.3 kept tokens; x0.84 plain after the first token.)
            # When several rows are level, the batch is one token further only where every one of them is:
            # E[the least they emit] = 1 + sum_j prod_i P(row i keeps tokens 0..j), rows taken as independent.
            # (Their mean, used before, priced 3 level rows at p ~0.25 each as a gain of ~0.25 a position, not
            # ~0.02: about a quarter of that batch's forwards were width 8 or more, each 1.5-2.4x a width-1 one.)
            room = np.asarray(room)
            p = p[room == room.max()].prod(0, keepdims=True)
        # Row i's E[emitted] at width d + 1: 1 + its first min(d, n_i) probabilities (p is zero past n_i).
        gain = len(p) + np.concatenate([[0.0], np.cumsum(p.sum(0))])
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
        return Draft(tokens, full.match_len, branched=full.branched, source=full.source)

    def observe(self, draft: Draft, emitted, row: int = 0) -> None:
        """Learn from row `row`'s full proposed draft and the tokens this step emitted (int [e])."""
        self.observe_rows([draft], [emitted], [row])

    def observe_rows(self, drafts: list[Draft], emitted: list, rows=None) -> None:
        """`observe` for every row of a step (rows: as for `p_kept`), in order."""
        rows = self._rows(len(drafts), rows)
        chains = [d.chain for d in drafts]
        decided = np.array([min(len(c), len(e)) for c, e in zip(chains, emitted)], np.int64)
        kept = np.array([kept_prefix(c, e) for c, e in zip(chains, emitted)], np.int64)
        A.observe_rows(self.counts, self.requests, rows, *self._features(drafts), decided, kept, self.params)
