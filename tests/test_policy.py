"""DraftPolicy's cost model: the chosen draft length against brute force on synthetic cost curves."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookup_decode import Draft
from lookup_decode.core.cost import CostCurve
from lookup_decode.core.policy import DraftPolicy, bucket


def brute_expected_emitted(a1: float, a2: float, d: int) -> float:
    """E[tokens emitted | d drafted]: the target token, plus draft j kept with prob a1 * a2^(j-1)."""
    return 1.0 + sum(a1 * a2 ** (j - 1) for j in range(1, d + 1))


def draft_of(available: int, match_len: int) -> list[Draft]:
    """One row's proposal of `available` tokens backed by a match of match_len."""
    return [Draft(np.zeros(available, np.int32), match_len)]


def policy_with(k: int, cost: CostCurve, a1: float, a2: float, match_len: int) -> DraftPolicy:
    policy = DraftPolicy(k, cost)
    b = bucket(match_len)
    policy.first[b] = (a1 * 100.0, 100.0)
    policy.later[b] = (a2 * 100.0, 100.0)
    return policy


@settings(max_examples=300, deadline=None)
@given(seconds=st.lists(st.floats(0.01, 1.0), min_size=3, max_size=12),
       a1=st.floats(0.0, 1.0), a2=st.floats(0.0, 1.0), match_len=st.integers(1, 200),
       k=st.integers(1, 40), available=st.integers(0, 40))
def test_never_picks_a_draft_whose_gain_is_below_its_cost(seconds, a1, a2, match_len, k, available):
    # A synthetic, non-monotone cost curve: random seconds at sizes 1, 4, 7, ... (linear in between).
    sizes = [1 + 3 * i for i in range(len(seconds))]
    cost = CostCurve(sizes, seconds, k + 1)
    policy = policy_with(k, cost, a1, a2, match_len)
    d = policy.choose(draft_of(available, match_len)) - 1
    max_d = min(k, available)
    assert 0 <= d <= max_d
    rate = [brute_expected_emitted(a1, a2, j) / cost(j + 1) for j in range(max_d + 1)]
    # Expected tokens per second of the choice: never below plain decoding (d = 0), i.e. the expected
    # extra tokens pay for the extra forward cost, and never below any other draft length.
    assert rate[d] >= rate[0] * (1 - 1e-9)
    assert rate[d] >= max(rate) * (1 - 1e-9)


@pytest.mark.parametrize("a1, a2, expect", [
    (0.9, 0.95, "long"),     # strong evidence: the dip of the curve at 9 tokens or beyond
    (0.05, 0.5, "none"),     # weak evidence: drafting costs more than it brings
])
def test_choices_on_a_non_monotone_curve(a1, a2, expect):
    # CPU-like curve: rises to 8 tokens, cheaper at 9 (a better kernel shape), then rises again.
    sizes = [1, 2, 4, 8, 9, 16, 33]
    seconds = [1.0, 1.1, 1.3, 1.8, 1.4, 2.6, 5.0]
    cost = CostCurve(sizes, seconds, 33)
    d = policy_with(32, cost, a1, a2, match_len=8).choose(draft_of(32, 8)) - 1
    rates = [brute_expected_emitted(a1, a2, j) / cost(j + 1) for j in range(33)]
    assert d == int(np.argmax(rates))
    if expect == "long":
        assert d >= 8
    else:
        assert d == 0


def test_without_cost_model_verifies_everything_available():
    assert DraftPolicy(16, None).choose(draft_of(40, 3)) == 16 + 1
    assert DraftPolicy(16, None).choose(draft_of(5, 3)) == 5 + 1


def test_expected_emitted_matches_brute_force():
    cost = CostCurve([1, 33], [1.0, 2.0], 33)
    for a1, a2 in [(0.3, 0.7), (1.0, 1.0), (0.0, 0.9), (0.6, 0.0)]:
        policy = policy_with(32, cost, a1, a2, match_len=5)
        got = policy.expected_emitted(5, 32)
        assert np.allclose(got, [brute_expected_emitted(a1, a2, d) for d in range(33)])


def test_tree_budget_uses_only_free_tokens():
    flat = DraftPolicy(32, CostCurve([1, 33], [1.0, 1.0], 33))
    steep = DraftPolicy(32, CostCurve([1, 33], [1.0, 3.0], 33))
    dip = DraftPolicy(32, CostCurve([1, 8, 9, 12, 33], [1.0, 1.8, 1.4, 1.9, 5.0], 33))
    assert flat.tree_budget(4) == 32                # cost does not grow: every extra node is free
    assert steep.tree_budget(4) == 4                # every extra node costs: chain only
    assert dip.tree_budget(6) == 9                  # 10 tokens cost no more than 7 on this curve
    assert DraftPolicy(32, None).tree_budget(4) is None
    for n in range(0, 32):
        m = dip.tree_budget(n)
        assert m >= n and dip.cost(m + 1) <= dip.cost(n + 1)


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 300), st.lists(st.integers(0, 3), max_size=12),
                               st.lists(st.integers(0, 3), max_size=12)), min_size=1, max_size=20))
def test_observing_a_batch_at_once_equals_observing_rows_in_turn(rows):
    drafts = [Draft(np.array(chain, np.int32), match_len) for match_len, chain, _ in rows]
    emitted = [np.array(e, np.int64) for _, _, e in rows]
    one_by_one, at_once = DraftPolicy(16), DraftPolicy(16)
    for d, e in zip(drafts, emitted):
        one_by_one.observe_rows([d], [e])
    at_once.observe_rows(drafts, emitted)
    assert np.allclose(at_once.first, one_by_one.first, rtol=1e-12)
    assert np.allclose(at_once.later, one_by_one.later, rtol=1e-12)


def test_buckets_of_many_equal_bucket_of_each():
    from lookup_decode.core.policy import buckets
    lens = np.array([0, 1, 2, 3, 4, 7, 8, 127, 128, 129, 2**20, 2**31 - 1])
    assert buckets(lens).tolist() == [bucket(int(m)) for m in lens]


def test_choosing_for_a_batch_equals_the_sum_of_each_rows_gain():
    cost = CostCurve([1, 8, 33], [1.0, 1.3, 2.5], 33)
    policy = DraftPolicy(32, cost)
    rng = np.random.default_rng(0)
    drafts = [Draft(np.zeros(int(rng.integers(0, 33)), np.int32), int(rng.integers(0, 80))) for _ in range(24)]
    max_d = max(len(d) for d in drafts)
    gain = sum(policy.expected_emitted(d.match_len, max_d)[np.minimum(np.arange(max_d + 1), len(d))] for d in drafts)
    rate = gain / np.array([cost(w) for w in range(1, max_d + 2)])
    assert policy.choose(drafts) == int(np.argmax(rate)) + 1
