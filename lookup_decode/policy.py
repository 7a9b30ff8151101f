"""How many draft tokens to verify this step: expected kept tokens per second of forward.

Verifying n draft tokens costs one forward over n + 1 tokens, and that cost is measured, not
assumed: on a CPU the curve is far from flat (a 135M model: x2 from 1 to 16 tokens) and not even
monotone. Acceptance is estimated online from what the model actually emitted, per bucket of match
length (a 40-token match is far better evidence than a 2-token one). Each step picks the draft
length d that maximizes E[tokens emitted | d] / cost(d + 1); d = 0 is plain decoding, so drafting
only happens where it is expected to pay.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

_N_BUCKETS = 8          # match length buckets: 1, 2-3, 4-7, ..., >= 128 (powers of two)
_FORGET = 0.97          # per observation; recent behaviour matters more (output style drifts)
_COST_EMA = 0.2

# Acceptance per match-length bucket, measured by offline replay of the suffix index (with its re-sync
# rule) on the shared real large-model outputs (cnn_dm, hagrid, code_edit, mt_redundant, editeval, clapnq;
# 60 pairs each, cap 32; `python -m benchmarks.measure_priors`): P(first draft token kept) rises with the
# match length; once one token is kept the next ones usually are too (a copy continues). The last bucket
# is never reached with the default max_match (64) and copies its neighbour.
_MEASURED_FIRST = np.array([0.29, 0.55, 0.68, 0.78, 0.88, 0.99, 0.99, 0.99])
_PRIOR_LATER = np.array([0.83, 0.90, 0.91, 0.93, 0.97, 0.98, 0.99, 0.99])
# The prior for the first draft token is 0.6 x the measured rate. The measured rate pools steps that
# continue a copy already being followed with fresh matches, but a request's first decisions are all
# fresh matches, and those are wrong more often (outputs open with text of their own). Replayed on
# held-out pairs (60-200 of each set) and priced with this machine's forward cost, the skeptical prior
# wins on every set: projected speed-up after 8 tokens x0.76-1.65 -> x0.85-2.33, over whole outputs
# +1-7% (geometric mean); factors 0.5-0.85 were tried, 0.5-0.6 best (`python -m benchmarks.prior_factor`,
# benchmarks/results/replay/prior_factor.txt).
_PRIOR_FIRST = 0.6 * _MEASURED_FIRST
# Worth a few observations only: each request's own acceptance takes over within a few steps.
_PRIOR_WEIGHT = 4.0


def _bucket(match_len: int) -> int:
    return min(max(int(match_len), 1).bit_length() - 1, _N_BUCKETS - 1)


class CostCurve:
    """Seconds of one forward over n tokens, n = 1..max_n, kept as a calibrated shape times a live scale.

    The shape comes from a start-up measurement at a few sizes (linear in between); every real step
    then refines the shape at the size it used and rescales the whole curve, which follows context
    growth (attention gets dearer as the cache grows) without re-measuring.
    """

    def __init__(self, sizes, seconds, max_n: int):
        sizes = np.asarray(sizes, dtype=np.float64)
        seconds = np.asarray(seconds, dtype=np.float64)
        if np.any(seconds <= 0) or len(sizes) == 0:
            raise ValueError("cost measurements must be positive")
        self.max_n = int(max_n)
        self.shape = np.interp(np.arange(self.max_n + 1), sizes, seconds)  # [max_n + 1], index = n
        self.scale = 1.0

    def __call__(self, n: int) -> float:
        if n > self.max_n:
            raise ValueError(f"cost of {n} tokens asked, but the curve was measured up to {self.max_n}")
        return self.shape[n] * self.scale

    def observe(self, n: int, seconds: float) -> None:
        if n > self.max_n or seconds <= 0:
            return
        # The scale moves slowly (it shifts every size at once); the size just used moves faster.
        self.scale *= 1.0 + 0.25 * _COST_EMA * (seconds / self(n) - 1.0)
        self.shape[n] += _COST_EMA * (seconds / self.scale - self.shape[n])


def measure_cost_curve(forward_n: Callable[[int], float], max_n: int, grid=None) -> CostCurve:
    """Time `forward_n(n)` (which returns seconds) at a few sizes up to max_n and build the curve.

    grid: the sizes to time (a compiled forward is timed only at the sizes it will run).
    """
    grid = sorted(grid or {n for n in (1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 64, max_n)
                           if n <= max_n})
    forward_n(grid[-1])  # warm-up: first use of a shape allocates
    seconds = [min(forward_n(n), forward_n(n)) if n <= 2 else forward_n(n) for n in grid]
    return CostCurve(grid, seconds, max_n)


class DraftPolicy:
    """Chooses the draft length per step and learns acceptance from the tokens emitted.

    Acceptance model per match-length bucket: a1 = P(first draft token kept), a2 = P(next kept |
    previous kept), so E[emitted | d] = 1 + a1 (1 + a2 + ... + a2^(d-1)). Counts decay with
    `_FORGET`. Learning never needs a verification: every step compares the *whole* proposed
    draft with the tokens that were then emitted, so even when nothing is verified (d = 0) the
    policy keeps learning whether drafting would have paid.

    Args:
        k: the most draft tokens ever verified in one step.
        cost: measured forward cost; None disables adaptation (always verify min(k, draft) tokens).
    """

    def __init__(self, k: int, cost: CostCurve | None = None):
        if int(k) < 0:
            raise ValueError(f"k (max draft tokens) must be >= 0, got {k}")
        self.k = int(k)
        self.cost = cost
        # [bucket, (kept, tried)] for the first position and for later positions, starting from the
        # prior rates below with the weight of _PRIOR_WEIGHT observations.
        self.first = np.stack([_PRIOR_FIRST * _PRIOR_WEIGHT, np.full(_N_BUCKETS, _PRIOR_WEIGHT)], axis=1)
        self.later = np.stack([_PRIOR_LATER * _PRIOR_WEIGHT, np.full(_N_BUCKETS, _PRIOR_WEIGHT)], axis=1)
        self._powers = np.arange(self.k + 1, dtype=np.float64)

    def expected_emitted(self, match_len: int, max_d: int) -> np.ndarray:
        """E[tokens emitted | d] for d = 0..max_d, float64 [max_d + 1]."""
        b = _bucket(match_len)
        a1 = self.first[b, 0] / self.first[b, 1]
        a2 = self.later[b, 0] / self.later[b, 1]
        kept_after_first = np.concatenate([[0.0], np.cumsum(a2 ** self._powers[:max_d])])
        return 1.0 + a1 * kept_after_first

    def choose(self, available: int, match_len: int) -> int:
        """Draft tokens to verify now, 0 <= d <= min(k, available)."""
        max_d = min(self.k, available)
        if max_d == 0 or self.cost is None:
            return max_d
        gain = self.expected_emitted(match_len, max_d)
        cost = np.array([self.cost(d + 1) for d in range(max_d + 1)])
        return int(np.argmax(gain / cost))

    def tree_budget(self, n: int) -> int | None:
        """Most tree nodes worth verifying when the chain verifies n: extra branches only where the measured
        curve says they are free, i.e. the largest m >= n with cost(m + 1) <= cost(n + 1). None = no cost
        model (no limit). A flat (GPU-like) curve allows wide trees; a steep CPU curve allows few or none."""
        if self.cost is None:
            return None
        base = self.cost(n + 1)
        return max([m for m in range(n, self.cost.max_n) if self.cost(m + 1) <= base])

    def observe(self, draft: np.ndarray, emitted: np.ndarray, match_len: int) -> None:
        """Learn from the full proposed draft (int [p]) and the tokens this step emitted (int [e])."""
        n = min(len(draft), len(emitted))
        if n == 0:
            return
        b = _bucket(match_len)
        same = np.asarray(draft[:n]) == np.asarray(emitted[:n])
        kept = int(np.argmin(same)) if not same.all() else n  # kept prefix length
        tried_later = min(kept, n - 1)                          # later positions actually decided
        self.first[b] *= _FORGET
        self.later[b] *= _FORGET
        self.first[b] += (1.0 if kept > 0 else 0.0, 1.0)
        self.later[b] += (max(kept - 1, 0), tried_later)
