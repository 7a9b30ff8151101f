"""Offline replay: run the decoding step on a known continuation, with the forward replaced by the record.

Greedy lookup decoding emits exactly the tokens of plain greedy decoding, so once those are known
(a recorded output) every step's acceptance is known too: the longest prefix of the draft equal to
the record, then one more recorded token. `replay` runs the very `decode.step` of generation — the
same drafter, the same policy choosing draft lengths, the same commit — with `RecordedForward` in
place of the model, so measuring drafts on large models' real outputs needs no model at all.
`search_settings` ranks settings by the time such a replay models with a measured cost curve.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import torch

from lookup_decode.core.decode import Rows, step
from lookup_decode.core.draft import kept_prefix
from lookup_decode.core.forward import Verified
from lookup_decode.core.index import SuffixIndex
from lookup_decode.core.policy import DraftPolicy
from lookup_decode.core.stats import DecodeStats

SEARCH_K = (8, 16, 32, 64)
SEARCH_MIN_MATCH = (1, 2, 3)


class RecordedForward:
    """The forward of a replay (`core.forward.Forward`): 'verifies' each draft against the recorded
    continuation of its row. There is no model: nothing to roll back, and no cost to measure."""

    draft_kind = "chain"
    learns_cost = False             # its time is not a model's: the policy's cost curve stays as given
    vocab = None                    # drafts are checked against the record, not a vocabulary
    model = None

    def __init__(self, outputs: list[np.ndarray]):
        self.outputs = outputs          # int [n_b] per row: the true continuation after the row's prompt

    def prefill(self, rows: Rows) -> list[Verified]:
        """Each row's first recorded token (what a prefill emits)."""
        return [Verified(torch.from_numpy(self.outputs[b][:1].astype(np.int64))) for b in rows.active]

    def verify(self, rows: Rows, drafts) -> list[Verified]:
        truths = [self.outputs[b][rows.cur[b] - rows.prompt_len:] for b in rows.active]
        return [Verified(torch.from_numpy(truth[: kept_prefix(draft.tokens, truth) + 1].astype(np.int64)))
                for truth, draft in zip(truths, drafts)]

    def rollback(self, kept) -> None:
        """No cache: nothing to roll back."""

    def keep_rows(self, keep) -> None:
        """No batch to shrink: rows.active alone says which rows go on."""

    def calibrate(self, rows, costs, k: int):
        return None


def replay(drafter, output, cap: int, policy: DraftPolicy | None = None) -> DecodeStats:
    """Replay a known continuation through a drafter that already holds the prompt.

    output: int [n], the true continuation. Each step drafts up to min(cap, tokens still to emit - 1),
    the policy picks how many to verify (None: all of them), the recorded forward keeps the longest
    prefix equal to the truth plus one bonus/correction token, and every emitted token goes back to
    the drafter — `decode.step`, unchanged. Returns DecodeStats (steps, drafted, accepted, accepted_at,
    draft_lengths, proposer_s; new_tokens = n).
    """
    output = np.asarray(output, dtype=np.int32)
    n = len(output)
    policy = policy if policy is not None else DraftPolicy(cap)
    stats = DecodeStats()
    # Row 0 holds one placeholder prompt token (the drafter has the real prompt), then the n tokens.
    rows = Rows(torch.zeros((1, 1 + n), dtype=torch.long), cur=[1], active=[0] if n else [], prompt_len=1)
    forward = RecordedForward([output])
    while rows.active:
        step(rows, forward, [drafter], policy, None, stats)
    stats.new_tokens = n
    return stats


def estimated_seconds(stats: DecodeStats, cost: Callable[[int], float]) -> float:
    """Modelled generation time of a replay: one forward over d + 1 tokens per step, plus proposer time."""
    return sum(cost(d + 1) for d in stats.draft_lengths) + stats.proposer_s


def estimated_speedup(stats: DecodeStats, cost: Callable[[int], float]) -> float:
    """Plain decoding (one forward of one token per emitted token) over the replay's modelled time."""
    return stats.new_tokens * cost(1) / estimated_seconds(stats, cost)


def search_settings(prompts, outputs, cost, eos_token_ids=(), ks=SEARCH_K, min_matches=SEARCH_MIN_MATCH) -> list[dict]:
    """Replay (k, min_match, adaptive) settings on known outputs and rank them by modelled total time.

    prompts, outputs: int token lists per request; cost: `CostCurve` (seconds per forward over n
    tokens, n up to max(ks) + 1). Returns one dict per setting, fastest first.
    """
    rows = []
    for k, min_match, adaptive in itertools.product(ks, min_matches, (True, False)):
        total = DecodeStats()
        for prompt, out in zip(prompts, outputs):
            index = SuffixIndex(prompt, min_match=min_match, eos_token_ids=eos_token_ids)
            total.merge(replay(index, out, k, DraftPolicy(k, cost if adaptive else None)))
        rows.append({"k": k, "min_match": min_match, "adaptive": adaptive,
                     "estimated_speedup": estimated_speedup(total, cost),
                     "mean_accepted_length": total.mean_accepted_length,
                     "acceptance_rate": total.acceptance_rate})
    return sorted(rows, key=lambda r: -r["estimated_speedup"])
