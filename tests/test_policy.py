"""DraftPolicy: the chosen draft length against brute force on synthetic cost curves, and the acceptance model it
prices with (core.acceptance): learning, back-off, calibration."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookup_decode import Draft
from lookup_decode.core import acceptance as A
from lookup_decode.core.acceptance import bucket
from lookup_decode.core.cost import CostCurve
from lookup_decode.core.policy import DraftPolicy
from lookup_decode.core.stats import Calibration


def brute_expected_emitted(a1: float, a2: float, d: int) -> float:
    """E[tokens emitted | d drafted]: the target token, plus draft j kept with prob a1 * a2^(j-1)."""
    return 1.0 + sum(a1 * a2 ** (j - 1) for j in range(1, d + 1))


def draft_of(available: int, match_len: int) -> list[Draft]:
    """One row's proposal of `available` tokens backed by a match of match_len."""
    return [Draft(np.zeros(available, np.int32), match_len)]


def policy_with(k: int, cost: CostCurve, a1: float, a2: float, match_len: int) -> DraftPolicy:
    """A policy whose acceptance model says P(tokens 0..j kept) = a1 a2^j (the choice rule is what is tested)."""
    policy = DraftPolicy(k, cost)

    def p_kept(drafts, rows=None):
        width = max([min(len(d.chain), k) for d in drafts] + [0])
        out = np.zeros((len(drafts), width))
        for i, d in enumerate(drafts):
            n = min(len(d.chain), k)
            out[i, :n] = a1 * a2 ** np.arange(n)
        return out
    policy.p_kept = p_kept
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


def expected_table(policy, drafts, max_d):
    """E[tokens emitted | d] of each row, d = 0..max_d: float64 [r, max_d + 1] (flat past a row's draft)."""
    p = policy.p_kept(drafts)
    table = np.ones((len(drafts), max_d + 1))
    w = min(p.shape[1], max_d)
    np.cumsum(p[:, :w], axis=1, out=table[:, 1: w + 1])
    table[:, 1: w + 1] += 1.0
    table[:, w + 1:] = table[:, w: w + 1]
    return table


def test_expected_table_matches_brute_force():
    cost = CostCurve([1, 33], [1.0, 2.0], 33)
    for a1, a2 in [(0.3, 0.7), (1.0, 1.0), (0.0, 0.9), (0.6, 0.0)]:
        policy = policy_with(32, cost, a1, a2, match_len=5)
        got = expected_table(policy, draft_of(32, 5), 32)[0]
        assert np.allclose(got, [brute_expected_emitted(a1, a2, d) for d in range(33)])
    short = expected_table(policy, draft_of(3, 5), 6)[0]          # flat past the draft's 3 tokens
    assert np.allclose(short[3:], short[3])


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
                               st.lists(st.integers(0, 3), min_size=1, max_size=12), st.booleans(),
                               st.integers(0, 2)), min_size=1, max_size=20))
def test_observing_a_batch_at_once_equals_observing_rows_in_turn(rows):
    drafts = [Draft(np.array(chain, np.int32), match_len, branched=br, source=src)
              for match_len, chain, _, br, src in rows]
    emitted = [np.array(e, np.int64) for _, _, e, _, _ in rows]
    ids = [i % 5 for i in range(len(rows))]               # requests repeat: a row's state carries over
    one_by_one, at_once = DraftPolicy(16), DraftPolicy(16)
    for p in (one_by_one, at_once):
        p.observe_rows([Draft(np.zeros(0, np.int32))] * 5, [[0]] * 5)        # room for 5 requests, nothing learned
    for d, e, i in zip(drafts, emitted, ids):
        one_by_one.observe(d, e, i)
    at_once.observe_rows(drafts, emitted, ids)
    assert np.array_equal(at_once.counts, one_by_one.counts)
    assert np.array_equal(at_once.requests[:5], one_by_one.requests[:5])


def test_choosing_for_a_batch_equals_the_sum_of_each_rows_gain():
    cost = CostCurve([1, 8, 33], [1.0, 1.3, 2.5], 33)
    policy = DraftPolicy(32, cost)
    rng = np.random.default_rng(0)
    for _ in range(30):                                   # some evidence, so rows differ
        d = Draft(rng.integers(0, 3, 8).astype(np.int32), int(rng.integers(1, 80)))
        policy.observe(d, rng.integers(0, 3, 5), int(rng.integers(0, 24)))
    drafts = [Draft(np.zeros(int(rng.integers(0, 33)), np.int32), int(rng.integers(1, 80))) for _ in range(24)]
    max_d = max(len(d) for d in drafts)
    table = expected_table(policy, drafts, max_d)
    gain = table.sum(0)
    rate = gain / np.array([cost(w) for w in range(1, max_d + 2)])
    assert policy.choose(drafts) == int(np.argmax(rate)) + 1
    assert policy.last_p.shape == (24, max_d)


def _stream(policy, rng, steps, keep, k=8, rows=1, match_len=8, cal=None):
    """Rows whose full drafts of k tokens keep each token (all before it kept) with probability keep(j)."""
    for _ in range(steps):
        drafts = [Draft(np.arange(1, k + 1, dtype=np.int32), match_len) for _ in range(rows)]
        p = policy.p_kept(drafts, list(range(rows)))
        emitted = []
        for i in range(rows):
            kept = 0
            while kept < k and rng.random() < keep(kept):
                kept += 1
            emitted.append(np.concatenate([np.arange(1, kept + 1), [0]]))        # the kept prefix, then another
            if cal is not None:
                cal.observe_rows(p[i: i + 1], [k], [kept])
        policy.observe_rows(drafts, emitted, list(range(rows)))
    return policy.p_kept([Draft(np.arange(1, k + 1, dtype=np.int32), match_len)], [0])[0]


def test_a_stream_that_always_copies_is_priced_near_one_everywhere():
    p = _stream(DraftPolicy(8), np.random.default_rng(0), 40, lambda j: 1.0)
    assert p[-1] > 0.9 and np.all(np.diff(p) <= 0)


def test_a_stream_that_never_copies_is_priced_near_zero():
    p = _stream(DraftPolicy(8), np.random.default_rng(0), 40, lambda j: 0.0)
    assert p[0] < 0.1


def test_a_short_request_outgrows_the_pool():
    # The pool learned requests that copy everything; a request that keeps nothing is priced low within 20 steps.
    policy = DraftPolicy(8)
    _stream(policy, np.random.default_rng(0), 100, lambda j: 1.0, rows=8)
    policy.requests[0] = A.new_requests(1)[0]             # row 0 is now a new request
    before = policy.p_kept([Draft(np.arange(1, 9, dtype=np.int32), 8)], [0])[0][0]
    after = _stream(policy, np.random.default_rng(1), 20, lambda j: 0.0)[0]
    assert before > 0.9 and after < 0.3


def test_a_sparse_cell_backs_off_to_its_parent():
    # Evidence for source 0 only: a draft of source 2 (no cell of its own at the finest level) is priced by the
    # parent level, i.e. as source 0 would be without its finest cells.
    policy = DraftPolicy(8)
    _stream(policy, np.random.default_rng(0), 30, lambda j: 0.8 if j < 3 else 0.3)
    draft = Draft(np.arange(1, 9, dtype=np.int32), 8)
    other = policy.p_kept([Draft(draft.tokens, 8, source=2)], [0])[0]
    coarse = DraftPolicy(8)
    coarse.counts, coarse.requests = policy.counts.copy(), policy.requests.copy()
    coarse.counts[A.OFFSETS[3]:] = 0.0                   # the finest level knows nothing
    assert np.allclose(other, coarse.p_kept([draft], [0])[0])
    assert not np.allclose(other, policy.p_kept([draft], [0])[0])


@pytest.mark.parametrize("keep", [lambda j: 0.9, lambda j: 0.6 if j == 0 else 0.85, lambda j: 0.4 - 0.04 * j])
def test_calibrated_on_a_stream_with_known_keep_rates(keep):
    policy, cal = DraftPolicy(8), Calibration()
    rng = np.random.default_rng(3)
    _stream(policy, rng, 50, keep, rows=8)                # burn-in
    _stream(policy, rng, 800, keep, rows=8, cal=cal)
    # Bins of >= 500 tokens: at 50 the share kept alone has a standard error of ~0.07, and a step's rows share
    # one prediction, so small bins test the dice, not the model.
    assert cal.error(500) <= 0.05, cal.summary(500)


def test_calibration_knows_how_far_a_calibrated_model_strays_by_chance():
    """The chance spread `Calibration` reports per bin is the standard deviation of the share kept were every
    prediction exact, a kept prefix per row (token j kept only if every earlier one was): drawn 4,000 times from
    those predictions, the shares kept spread by it. Tokens counted as independent would spread less."""
    rng = np.random.default_rng(5)
    q = rng.uniform(0.75, 1.0, (12, 8))                  # per row: P(token j kept | the ones before kept)
    p = np.cumprod(q, axis=1)                             # what the model predicts: the prefix kept through j
    sent = rng.integers(3, 9, 12)
    exact = Calibration()
    exact.observe_rows(p, sent, np.zeros(12, np.int64))
    shares = []
    for _ in range(4000):
        miss = rng.random((12, 8)) >= q
        kept = np.minimum(np.where(miss.any(axis=1), miss.argmax(axis=1), 8), sent)     # up to the first miss
        drawn = Calibration()
        drawn.observe_rows(p, sent, kept)
        shares.append([r.kept for r in drawn.rows()])
    rows = exact.rows()
    assert [r.chance for r in rows] == pytest.approx(np.std(shares, axis=0), rel=0.1)
    assert [r.predicted for r in rows] == pytest.approx(np.mean(shares, axis=0), abs=0.02)
    independent = Calibration()
    independent.observe(p[np.arange(8) < sent[:, None]], np.zeros(int(sent.sum()), bool))
    assert max(r.chance / i.chance for r, i in zip(rows, independent.rows())) > 1.3


def test_sampled_rows_have_cells_of_their_own():
    greedy, sampled = DraftPolicy(8), DraftPolicy(8, temperature=0.7)
    sampled.counts = greedy.counts                      # one pool: greedy evidence does not price sampled rows
    _stream(greedy, np.random.default_rng(0), 40, lambda j: 1.0)
    draft = Draft(np.arange(1, 9, dtype=np.int32), 8)
    assert greedy.p_kept([draft], [0])[0][0] > 0.9
    # no sampled evidence: the measured root of the first position after an 8-token match, untouched by greedy's
    assert sampled.p_kept([draft], [0])[0][0] == pytest.approx(A.DEFAULTS["root_first"][bucket(8)])


def test_constants_are_passed_to_the_kernels():
    """The acceptance model's constants are an argument (`acceptance.params`), never compiled in: another set of
    them prices the same draft by them at once, and a wrong name is refused."""
    draft = Draft(np.arange(1, 9, dtype=np.int32), 8)
    root = [0.5] * A.N_BUCKETS
    p = DraftPolicy(8, params=A.params(root_first=root, root_later=root)).p_kept([draft], [0])[0]
    assert p[:3] == pytest.approx([0.5, 0.25, 0.125])
    shallow = DraftPolicy(8, params=A.params(levels=1, rate_classes=0))
    _stream(shallow, np.random.default_rng(0), 40, lambda j: 1.0)
    assert shallow.p_kept([draft], [0])[0][0] > 0.9
    with pytest.raises(ValueError, match="unknown acceptance parameters"):
        A.params(forgett=0.5)


def test_a_batch_widens_its_forward_only_for_the_rows_furthest_from_their_end():
    """A static batch runs until its last row ends: a row that is ahead gains nothing from a wider forward."""
    cost = CostCurve([1, 8, 33], [1.0, 1.3, 2.5], 33)
    policy = DraftPolicy(32, cost)
    drafts = [Draft(np.arange(16, dtype=np.int32), 60), Draft(np.zeros(0, np.int32), 1)]   # a long match; nothing
    wide = policy.choose(drafts)
    assert wide > 1
    assert policy.choose(drafts, room=[100, 60]) > 1            # the copying row is the one behind
    assert policy.choose(drafts, room=[60, 100]) == 1           # it is ahead: the row behind has nothing to draft
    assert policy.last_p.shape == (2, 16)                       # calibration still sees every row's prices
    # Level rows: the batch gains a token only where both keep one, so a match in one of them buys nothing...
    assert policy.choose(drafts, room=[40, 40]) == 1
    # ...and two rows that both copy are priced as their least: the product of their probabilities.
    both = [drafts[0], Draft(np.arange(16, dtype=np.int32), 60)]
    p = policy.p_kept(both)
    assert policy.choose(both, room=[40, 40]) == _best_width(cost, p.prod(0))
    assert policy.choose(both, room=[40, 40]) <= policy.choose(both)


def _best_width(cost, p):
    """Brute force: the width w maximizing (1 + sum of p's first w - 1) / cost(w)."""
    return max(range(1, len(p) + 2), key=lambda w: (1 + p[: w - 1].sum()) / cost(w))
