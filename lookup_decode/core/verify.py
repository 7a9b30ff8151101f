"""Acceptance rules: pure functions of (draft, target scores). No model, cache or index in here.

Chains, trees, drafts with a distribution q, and the logits processors run per row with the prefix
that row would have seen in plain decoding all live here; `verify_row` and `verify_tree` are what a
decoding step calls, with the rules of a `Rules` value (tests swap in a wrong rule as a negative
control).

A step verifies draft d_1..d_n with one forward over [last, d_1..d_n], giving n + 1 rows of target
scores (row i = the distribution after d_1..d_i). Each rule returns the *emitted* tokens: the
accepted drafts followed by one target token, which is the *recovered* token after a rejection
or the *bonus* token when every draft was kept (vocabulary of vLLM's rejection sampler).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

from lookup_decode.core.draft import kept_prefix


def accept_greedy(draft, scores: torch.Tensor) -> torch.Tensor:
    """draft: int [n] (numpy or a CPU tensor); scores: float [n + 1, V]. Returns long [m + 1], m = drafts kept.

    Keeps the longest prefix of the draft equal to the target argmax, then the argmax after it,
    so the emitted tokens are exactly what one-token-at-a-time greedy decoding produces. The n + 1
    target tokens cross to the host in one transfer and are compared there: the result is on the CPU.
    """
    target = scores.argmax(-1).cpu()                             # [n + 1]
    return target[: kept_prefix(np.asarray(draft), target.numpy()) + 1]


def accept_greedy_rows(drafts: np.ndarray, lengths: np.ndarray, logits: torch.Tensor) -> list[torch.Tensor]:
    """accept_greedy for a padded batch: drafts int [A, w - 1] (row i's chain in its first lengths[i] columns),
    logits float [A, w, V]. Every row's targets cross to the host in one transfer and all rows are compared
    at once. Returns the emitted tokens of each row, long [m_i + 1] on the CPU."""
    targets = logits.argmax(-1).cpu()                                           # long [A, w]
    cols = np.arange(drafts.shape[1])
    agree = (targets[:, :-1].numpy() == drafts) & (cols[None, :] < lengths[:, None])
    kept = np.cumprod(agree, axis=1).sum(1)                                     # the first disagreement ends a row
    return [targets[i, : int(m) + 1] for i, m in enumerate(kept)]


def sample_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token per row of probs float [r, V], driven by uniforms u float64 [r] in [0, 1).

    A token of probability 0 has an empty interval, so it is never drawn.
    """
    cdf = probs.to(torch.float64).cumsum(-1)                         # [r, V]
    total = cdf[:, -1]
    if not bool((torch.isfinite(total) & (total > 0)).all()):
        # searchsorted would silently give token V - 1; plain sampling (torch.multinomial) raises.
        raise ValueError("the sampling probabilities hold nan or inf (or are all 0): check the logits processors "
                         "and the model's dtype")
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
    x = sample_rows(probs, u).cpu()                                  # one transfer; compared on the host
    n_kept = int((x[:n] == draft.cpu()).to(torch.int64).cumprod(0).sum())
    return x[: n_kept + 1]


def _target(scores: torch.Tensor, uniforms: torch.Tensor | None, i: int) -> torch.Tensor:
    """The target token (long [1]) of one score row [1, V] at output position i: its argmax (uniforms None) or
    sampled with uniforms[i]."""
    return scores.argmax(-1) if uniforms is None else sample_rows(torch.softmax(scores, dim=-1), uniforms[i: i + 1])


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
        x = _target(rows[-1], uniforms, i)
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


def accept_tree(tokens: np.ndarray, parents: np.ndarray, row_scores, uniforms: torch.Tensor | None):
    """Descend a tree of draft nodes from the root, one target token per visited node.

    tokens, parents: int [N] (parent -1 = the root, the last committed token). row_scores(row, path) ->
    float [1, V]: processed scores of forward row `row` (0 = root, j + 1 = node j), whose prefix is the
    committed text + tokens[path]. uniforms: None (greedy) or float64 [>= depth + 1], one per output
    position. The emitted tokens are those chain verification of the followed branch would give.
    Returns (emitted long [m + 1], path: the m accepted node indices, rows: the m + 1 score rows used).
    """
    children: dict[int, dict[int, int]] = {}
    for j in range(len(tokens)):
        children.setdefault(int(parents[j]), {})[int(tokens[j])] = j
    node, path, rows = -1, [], []
    while True:
        rows.append(row_scores(node + 1, path))
        x = int(_target(rows[-1], uniforms, len(path)))
        nxt = children.get(node, {}).get(x)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    emitted = torch.tensor([int(tokens[j]) for j in path] + [x], dtype=torch.long)
    return emitted, path, rows


@dataclass(frozen=True)
class Rules:
    """The acceptance rules a decoding step applies (one field per kind of draft)."""
    row_by_row: object = accept_row_by_row
    draft_probs: object = accept_with_draft_probs
    tree: object = accept_tree


# transformers' processors that read only the scores, never the prefix: one call can serve every row.
PREFIX_FREE = frozenset({"TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
                         "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper"})
# Prefix-dependent processors that treat each row of a batch on its own, with the names of their batch-shaped
# state (a tensor with one entry per row: repetition penalty's prompt_ignore_length, an encoder's input ids): a
# view holding row b's entries, given row b alone, scores row b exactly as the batch call would. Any other
# processor (one that reads a row's index, such as prefix_allowed_tokens_fn, or counts hypotheses per batch)
# runs on the whole batch.
ROW_LOCAL = {"RepetitionPenaltyLogitsProcessor": ("prompt_ignore_length",),
             "EncoderRepetitionPenaltyLogitsProcessor": ("encoder_input_ids",),
             **{name: () for name in ("NoRepeatNGramLogitsProcessor", "NoBadWordsLogitsProcessor",
                                      "SequenceBiasLogitsProcessor", "MinLengthLogitsProcessor",
                                      "MinNewTokensLengthLogitsProcessor", "SuppressTokensLogitsProcessor",
                                      "SuppressTokensAtBeginLogitsProcessor", "ForcedBOSTokenLogitsProcessor",
                                      "ForcedEOSTokenLogitsProcessor", "InfNanRemoveLogitsProcessor",
                                      "ExponentialDecayLengthPenalty", "LogitNormalization")}}


class Processors:
    """Logits processors split in two: a head that depends on each row's prefix (repetition penalty,
    no-repeat n-gram, ...) and run row by row, and a tail of prefix-free ones (temperature, top-k, top-p,
    min-p) that run on every verified row of every sequence in one call. Only a *tail* is split off,
    so the order of application is the caller's (transformers puts its warpers last).
    Called like a LogitsProcessorList: processors(ids, scores) applies all, in order.
    """

    def __init__(self, processors=None):
        procs = list(processors or [])
        cut = len(procs)
        while cut > 0 and type(procs[cut - 1]).__name__ in PREFIX_FREE:
            cut -= 1
        self.per_row, self.at_once = procs[:cut], procs[cut:]
        self.row_local = all(type(p).__name__ in ROW_LOCAL for p in self.per_row)
        self._views: dict[int, list] = {}          # row -> its views of the per-row processors

    def __bool__(self) -> bool:
        return bool(self.per_row or self.at_once)

    def head(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for p in self.per_row:
            scores = p(ids, scores)
        return scores

    def head_row(self, ids: torch.Tensor, b: int, length: int, scores: torch.Tensor) -> torch.Tensor:
        """The prefix-dependent processors on row b's scores float [1, V], with exactly the prefix ids[b, :length].

        Rows advance raggedly, so row b is scored alone: by views of the processors holding its own entries
        (ROW_LOCAL), else in a [B, length] batch with row b in slot b and stand-ins (whatever the other rows hold
        up to `length`) whose results are dropped. The first costs O(V) per row, the second O(B V).
        """
        B = ids.shape[0]
        if not self.row_local:
            return self.head(ids[:, :length], scores.expand(B, -1).clone())[b: b + 1]
        if b not in self._views:
            self._views[b] = [_row_view(p, b, B) for p in self.per_row]
        scores, row = scores.clone(), ids[b: b + 1, :length]     # a copy: processors may write in place
        for p in self._views[b]:
            scores = p(row, scores)
        return scores

    def tail(self, scores: torch.Tensor) -> torch.Tensor:
        """The prefix-free processors on rows float [r, V], all at once (they never read the ids)."""
        ids = torch.zeros((scores.shape[0], 1), dtype=torch.long, device=scores.device)
        for p in self.at_once:
            scores = p(ids, scores)
        return scores

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return self.tail(self.head(ids, scores)) if self.at_once else self.head(ids, scores)


def _row_view(processor, b: int, rows: int):
    """A shallow copy of a ROW_LOCAL processor whose batch-shaped tensors hold row b's entry only; the
    processor itself when it has none."""
    per_row = {name: getattr(processor, name, None) for name in ROW_LOCAL[type(processor).__name__]}
    per_row = {name: v for name, v in per_row.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if rows == 1 or not per_row:
        return processor
    view = copy.copy(processor)
    for name, value in per_row.items():
        if value.shape[0] != rows:
            raise ValueError(f"{type(processor).__name__}.{name} has {value.shape[0]} rows for a batch of {rows}")
        setattr(view, name, value[b: b + 1])
    return view


def verify_row(draft, logits: torch.Tensor, logits_processor, ids: torch.Tensor, b: int, cur: int,
               uniforms: torch.Tensor | None, generator=None, rules: Rules = Rules(), scored: bool = False):
    """Emitted tokens (long [m + 1]) of row b and the processed score rows they came from ([>= m + 1, V]).

    draft: a chain `Draft` of n tokens, already written at ids[b, cur: cur + n]; logits: float [n + 1, V],
    row i scoring the token after ids[b, :cur + i]. logits_processor: `Processors` (or a list of
    processors); scored: its prefix-free tail was already applied to `logits` (a batch does all rows at
    once; only when it has no per-row head). uniforms: None for greedy, else float64 [>= n + 1], one per
    output position (see accept_sampled).
    """
    procs = logits_processor if isinstance(logits_processor, Processors) else Processors(logits_processor)
    n = len(draft)
    # Drafts sampled from q (a draft model) under sampling: the rejection rule needs p on every row.
    q_rule = uniforms is not None and draft.probs is not None and n > 0
    if not procs and not q_rule:            # nothing to run per row: decide all rows at once, on the host
        if uniforms is None:
            return accept_greedy(draft.tokens, logits), logits
        return accept_sampled(torch.from_numpy(draft.tokens).to(torch.long), torch.softmax(logits, dim=-1),
                              uniforms[: n + 1]), logits
    tokens = torch.from_numpy(draft.tokens).to(device=logits.device, dtype=torch.long)

    if procs.per_row:       # prefix-dependent: each row with its own prefix, only as far as needed
        def row(i):
            scores = procs.head_row(ids, b, cur + i, logits[i: i + 1])
            return procs.tail(scores) if procs.at_once else scores
    else:                   # prefix-free (or none): every row in one call
        all_rows = logits if scored or not procs.at_once else procs.tail(logits)

        def row(i):
            return all_rows[i: i + 1]

    if q_rule:
        scores = torch.cat([row(i) for i in range(n + 1)])
        probs = torch.softmax(scores, dim=-1)
        return rules.draft_probs(tokens, probs, draft.probs[:n].to(probs.device), generator), scores
    emitted, rows = rules.row_by_row(tokens, row, uniforms)
    return emitted, torch.cat(rows)


def verify_tree(draft, logits: torch.Tensor, logits_processor, ids: torch.Tensor, cur: int,
                uniforms: torch.Tensor | None, rules: Rules = Rules()):
    """Tree verification of one sequence: logits float [N + 1, V] of the forward over [last token, nodes].

    Returns (emitted long [m + 1], path (accepted node indices), score rows [m + 1, V], logits rows [m + 1, V]).
    """
    raw = []

    def row(r, path):
        raw.append(logits[r: r + 1])
        if not logits_processor:
            return logits[r: r + 1]
        nodes = torch.as_tensor(draft.tokens[path], dtype=torch.long, device=ids.device).view(1, -1)
        return logits_processor(torch.cat([ids[:, :cur], nodes], dim=1), logits[r: r + 1].clone())

    emitted, path, rows = rules.tree(draft.tokens, draft.parents, row, uniforms)
    return emitted.to(ids.device), path, torch.cat(rows), torch.cat(raw)
