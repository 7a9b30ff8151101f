"""Verifier unit tests on forced logits, and the lossless sampling rule checked statistically."""

import numpy as np
import pytest
import torch
from scipy import stats as sps

from lookup_decode.core.verify import (
    accept_greedy,
    accept_row_by_row,
    accept_sampled,
    accept_with_draft_probs,
    sample_rows,
)

V = 8


def forced(rows):
    """Scores [len(rows), V]: +100 at the given token of each row, -100 elsewhere (known argmax)."""
    scores = torch.full((len(rows), V), -100.0)
    for i, tok in enumerate(rows):
        scores[i, tok] = 100.0
    return scores


@pytest.mark.parametrize("draft, target, expected", [
    ([3, 4, 5], [3, 4, 5, 6], [3, 4, 5, 6]),     # all kept + bonus
    ([3, 4, 5], [3, 7, 5, 6], [3, 7]),           # rejected at position 1, recovered token 7
    ([3, 4, 5], [1, 4, 5, 6], [1]),              # rejected at once
    ([], [2], [2]),                              # empty draft: plain decoding step
    ([3], [3, 0], [3, 0]),                       # single token kept
])
def test_accept_greedy_forced(draft, target, expected):
    got = accept_greedy(torch.tensor(draft, dtype=torch.long), forced(target))
    assert got.tolist() == expected


def probs_from(rows):
    return torch.softmax(forced(rows), dim=-1)


def uniforms(n, generator):
    return torch.rand(n, generator=generator, dtype=torch.float64)


def test_accept_sampled_forced_paths():
    g = torch.Generator().manual_seed(0)
    draft = torch.tensor([3, 4, 5])
    assert accept_sampled(draft, probs_from([3, 4, 5, 6]), uniforms(4, g)).tolist() == [3, 4, 5, 6]  # p(d)=1, bonus
    assert accept_sampled(draft, probs_from([3, 7, 5, 6]), uniforms(4, g)).tolist() == [3, 7]        # p(d)=0
    assert accept_sampled(torch.tensor([], dtype=torch.long), probs_from([2]), uniforms(1, g)).tolist() == [2]
    q = torch.full((3, V), 1.0 / V)
    assert accept_with_draft_probs(draft, probs_from([3, 4, 5, 6]), q, g).tolist() == [3, 4, 5, 6]
    assert accept_with_draft_probs(draft, probs_from([3, 7, 5, 6]), q, g).tolist() == [3, 7]


def test_sample_rows_never_draws_probability_zero():
    p = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0]]).repeat(4, 1)
    u = torch.tensor([0.0, 0.4999999, 0.5, 1.0 - 1e-16], dtype=torch.float64)
    assert sample_rows(p, u).tolist() == [1, 1, 3, 3]


def test_accept_sampled_is_deterministic_per_position():
    probs = torch.softmax(torch.randn(5, V, generator=torch.Generator().manual_seed(1)), -1)
    u = uniforms(5, torch.Generator().manual_seed(2))
    target = sample_rows(probs, u)
    for draft in ([], target[:1].tolist(), target[:4].tolist(), [int(target[0]), (int(target[1]) + 1) % V]):
        out = accept_sampled(torch.tensor(draft, dtype=torch.long), probs[: len(draft) + 1], u[: len(draft) + 1])
        assert out.tolist() == target[: out.numel()].tolist()    # same tokens whatever was drafted


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Goodness of fit of observed counts to exact cell probabilities; cells with a small expectation
    are pooled into one. A cell with probability 0 that was observed gives p-value 0."""
    n = counts.sum()
    if np.any(counts[probs == 0] > 0):
        return 0.0
    expected = probs * n
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    if keep.sum() < 2:  # a point mass, and nothing was observed outside it
        return 1.0
    return float(sps.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)


ALPHA = 1e-3   # significance; every test below is seeded, so its outcome is fixed run to run
N = 20_000


def first_token_counts(rule, draft, probs, draft_probs=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = np.zeros(V, dtype=np.int64)
    for _ in range(N):
        d = draft() if callable(draft) else draft
        if draft_probs is None:
            out = rule(d, probs, uniforms(len(d) + 1, g))
        else:
            out = rule(d, probs, draft_probs, g)
        counts[int(out[0])] += 1
    return counts


def keep_always(draft, probs, u):
    """Wrong rule: keeps every draft token."""
    return torch.cat([draft, sample_rows(probs[len(draft):], u[len(draft):])])


def resample_with_draft(draft, probs, u):
    """Wrong rule: on rejection draws from p without removing the rejected token."""
    if u[0] < probs[0, draft[0]]:
        return draft[:1]
    return sample_rows(probs[:1], (u[:1] * 7919.0) % 1.0)


P_CASES = {
    "spread": torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.02]),
    "draft_has_p0": torch.tensor([0.4, 0.3, 0.3, 0.0, 0.0, 0.0, 0.0, 0.0]),   # draft token 5 below: p = 0
    "top_k_excludes_draft": torch.tensor([0.5, 0.5, 0, 0, 0, 0, 0, 0.0]),
}


@pytest.mark.parametrize("case", sorted(P_CASES))
def test_point_mass_rule_matches_target(case):
    p = P_CASES[case]
    probs = torch.stack([p, p])                       # rows for d_1 and the bonus
    counts = first_token_counts(accept_sampled, torch.tensor([5]), probs)
    assert chi_square_pvalue(counts, p.numpy()) > ALPHA


@pytest.mark.parametrize("wrong", [keep_always, resample_with_draft])
def test_negative_controls_are_rejected(wrong):
    p = P_CASES["spread"]
    probs = torch.stack([p, p])
    counts = first_token_counts(wrong, torch.tensor([2]), probs)
    assert chi_square_pvalue(counts, p.numpy()) < ALPHA


def test_draft_distribution_rule_matches_target_when_q_has_mass_where_p_has_none():
    p = torch.tensor([0.5, 0.3, 0.2, 0, 0, 0, 0, 0.0])
    q = torch.tensor([0.1, 0.1, 0.1, 0.3, 0.3, 0.1, 0, 0.0])   # mass on tokens p never produces
    probs = torch.stack([p, p])
    rng = torch.Generator().manual_seed(7)
    counts = first_token_counts(accept_with_draft_probs, lambda: torch.multinomial(q, 1, generator=rng), probs,
                                draft_probs=q[None])
    assert chi_square_pvalue(counts, p.numpy()) > ALPHA
    # Negative control: accept with min(1, p/q) but redraw from p itself on rejection (no residual).
    def no_residual(draft, probs, draft_probs, generator=None):
        x = int(draft[0])
        if torch.rand((), generator=generator, dtype=torch.float64) * draft_probs[0, x] < probs[0, x]:
            return draft[:1]
        return torch.multinomial(probs[0], 1, generator=generator)

    rng = torch.Generator().manual_seed(7)
    wrong = first_token_counts(no_residual, lambda: torch.multinomial(q, 1, generator=rng), probs, draft_probs=q[None])
    assert chi_square_pvalue(wrong, p.numpy()) < ALPHA


def test_point_mass_rule_is_lossless_for_any_draft_source():
    # Keeping d with probability p(d) and otherwise drawing from p without d is exact for every fixed d,
    # so it stays exact when the drafts themselves are random (what an index-derived q would change is
    # only the acceptance rate).
    p = P_CASES["spread"]
    probs = torch.stack([p, p])
    q = torch.tensor([0.0, 0.0, 0.1, 0.1, 0.2, 0.2, 0.2, 0.2])
    rng = torch.Generator().manual_seed(3)
    counts = first_token_counts(accept_sampled, lambda: torch.multinomial(q, 1, generator=rng), probs)
    assert chi_square_pvalue(counts, p.numpy()) > ALPHA


@pytest.mark.parametrize("seed", range(20))
def test_row_by_row_equals_vectorized_rules(seed):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(6, V, generator=g) * 3
    target = scores.argmax(-1)
    for n_match in range(6):                                 # drafts agreeing with the argmax for n_match tokens
        draft = torch.cat([target[:n_match], (target[n_match:5] + 1) % V])
        u = uniforms(6, g)
        rows_fn = lambda i: scores[i: i + 1]  # noqa: E731
        greedy, rows = accept_row_by_row(draft, rows_fn, None)
        assert greedy.tolist() == accept_greedy(draft, scores).tolist() and len(rows) == greedy.numel()
        sampled, rows = accept_row_by_row(draft, rows_fn, u)
        assert sampled.tolist() == accept_sampled(draft, torch.softmax(scores, -1), u).tolist()
        assert len(rows) == sampled.numel()
