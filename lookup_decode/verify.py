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


def accept_sampled(draft: torch.Tensor, probs: torch.Tensor, generator: torch.Generator | None = None,
                   draft_probs: torch.Tensor | None = None) -> torch.Tensor:
    """Lossless speculative sampling. draft: long [n]; probs: p_target float [n + 1, V] (rows sum to 1).

    Point-mass draft (draft_probs None, what the suffix index proposes): keep d_i with
    probability p_target[i, d_i]; at the first rejection draw from p_target[i] with d_i removed
    (renormalized); after a fully kept draft draw the bonus token from row n.
    Draft with a distribution (draft_probs = q [n, V]): keep d_i with probability
    min(1, p(d_i) / q(d_i)); on rejection draw from normalize(max(0, p - q)) (Leviathan et al. 2023,
    Chen et al. 2023). The point-mass rule is the special case q = onehot(d_i).
    Uniforms are float64: a float32 draw of exactly 0 would keep a token of probability 0.
    """
    n = draft.numel()
    rows = torch.arange(n, device=probs.device)
    p_draft = probs[rows, draft].to(torch.float64)                       # [n]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs[rows, draft].to(torch.float64)
    u = torch.rand(n, generator=generator, device=probs.device, dtype=torch.float64)
    keep = (u * q_draft < p_draft).to(torch.int64).cumprod(0)            # u < p/q without dividing by 0
    n_kept = int(keep.sum())
    row = probs[n_kept].to(torch.float64)
    if n_kept < n:
        if draft_probs is None:
            row = row.clone()
            row[draft[n_kept]] = 0.0
        else:
            row = (row - draft_probs[n_kept].to(torch.float64)).clamp_min(0.0)
        total = row.sum()
        if total <= 0:  # p == q on this row: rejection has probability 0, only reachable by rounding
            row = probs[n_kept].to(torch.float64)
            total = row.sum()
        row = row / total
    last = torch.multinomial(row, 1, generator=generator)
    return torch.cat([draft[:n_kept], last.to(draft.dtype)])
