"""Acceptance rules: pure functions of (draft, target scores). No model, cache or index in here.

A step verifies draft d_1..d_n with one forward over [last, d_1..d_n], giving n + 1 rows of target
scores (row i = the distribution after d_1..d_i). Each rule returns the *emitted* tokens: the
accepted drafts followed by one target token, which is the *recovered* token after a rejection
or the *bonus* token when every draft was kept (vocabulary of vLLM's rejection sampler).
"""

from __future__ import annotations

import torch


def accept_greedy(draft: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """draft: long [n]; scores: float [n + 1, V]. Returns long [m + 1], m = drafts kept.

    Keeps the longest prefix of the draft equal to the target argmax, then the argmax after it,
    so the emitted tokens are exactly what one-token-at-a-time greedy decoding produces.
    """
    target = scores.argmax(-1)                                   # [n + 1]
    agree = (target[:-1] == draft).to(torch.int64).cumprod(0)     # 1 until the first disagreement
    n_kept = int(agree.sum())
    return target[: n_kept + 1]


def sample_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token per row of probs float [r, V], driven by uniforms u float64 [r] in [0, 1).

    A token of probability 0 has an empty interval, so it is never drawn.
    """
    cdf = probs.to(torch.float64).cumsum(-1)                         # [r, V]
    x = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    return x.clamp_max(probs.shape[-1] - 1)


def accept_sampled(draft: torch.Tensor, probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Lossless sampling for a point-mass draft. draft: long [n]; probs: p_target [n + 1, V];
    u: float64 [n + 1], the uniforms of these n + 1 output positions.

    Each row samples its target token x_i from p_target[i]; drafts are kept while x_i == d_i and the
    first x_i that differs (recovered) or x_n (bonus) ends the step. This is the point-mass case of
    speculative sampling: d_i is kept with probability p(d_i), and after a rejection x_i follows p
    with d_i removed and renormalized. Because x_i depends only on (p_target[i], u[i]), a fixed
    stream of per-position uniforms gives the same tokens whatever the draft lengths were, so a
    seed reproduces the output even though draft lengths follow measured timings.
    Uniforms are float64: a float32 draw has visible steps and can be exactly 0.
    """
    n = draft.numel()
    x = sample_rows(probs, u)
    n_kept = int((x[:n] == draft).to(torch.int64).cumprod(0).sum())
    return x[: n_kept + 1]


def accept_row_by_row(draft: torch.Tensor, row_scores, uniforms: torch.Tensor | None) -> tuple[torch.Tensor, list]:
    """The same acceptance as accept_greedy / accept_sampled, computing target rows only as needed.

    row_scores(i) -> float [1, V]: the processed scores of row i (the logits processors run on demand).
    uniforms: None for greedy, else float64 [n + 1] as in accept_sampled. Stops at the first row whose
    token differs from the draft: later rows would be thrown away, and one processor call (a top-p sort
    over the vocabulary, say) can cost as much as a small forward. Returns (emitted long [m + 1],
    the m + 1 rows computed).
    """
    n = draft.numel()
    rows = []
    for i in range(n + 1):
        rows.append(row_scores(i))
        if uniforms is None:
            x = rows[-1].argmax(-1)
        else:
            x = sample_rows(torch.softmax(rows[-1], dim=-1), uniforms[i: i + 1])
        if i == n or int(x) != int(draft[i]):
            break
    return torch.cat([draft[:i], x.to(draft.dtype)]), rows


def accept_with_draft_probs(draft: torch.Tensor, probs: torch.Tensor, draft_probs: torch.Tensor,
                            generator: torch.Generator | None = None) -> torch.Tensor:
    """Speculative sampling for drafts drawn from a distribution (e.g. a draft model).

    draft: long [n], d_i ~ q_i; probs: p_target [n + 1, V]; draft_probs: q [n, V]. Keeps d_i with
    probability min(1, p(d_i) / q(d_i)); at the first rejection draws from normalize(max(0, p - q));
    after a fully kept draft draws the bonus token from p_target[n] (Leviathan et al. 2023,
    Chen et al. 2023). Uniforms are float64.
    """
    n = draft.numel()
    rows = torch.arange(n, device=probs.device)
    p_draft = probs[rows, draft].to(torch.float64)
    q_draft = draft_probs[rows, draft].to(torch.float64)
    u = torch.rand(n, generator=generator, device=probs.device, dtype=torch.float64)
    n_kept = int((u * q_draft < p_draft).to(torch.int64).cumprod(0).sum())   # u < p/q, no division by 0
    row = probs[n_kept].to(torch.float64)
    if n_kept < n:
        residual = (row - draft_probs[n_kept].to(torch.float64)).clamp_min(0.0)
        # p <= q everywhere on this row means rejection had probability 0: only rounding gets here.
        row = residual if residual.sum() > 0 else row
    last = torch.multinomial(row / row.sum(), 1, generator=generator)
    return torch.cat([draft[:n_kept], last.to(draft.dtype)])
