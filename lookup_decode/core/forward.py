"""The model side of a decoding step, as `decode.step` sees it: the `Forward` protocol and its result.

`decode.step` runs unchanged for one sequence, a batch, trees and the offline replay because all it
asks of the model is this protocol; engines implement it (`engines.hf.forward.SequenceForward` and
`BatchForward` run a transformers model, `engines.replay.RecordedForward` reads a recorded output).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Verified:
    """What one row's verification gave: the emitted tokens and, for callers that record them, their scores.

    emitted: long [m + 1] on the host: the m accepted draft tokens, then the recovered or bonus token.
    scores: float [>= m + 1, V], the processed scores the tokens were chosen from (None: not kept).
    logits: float [>= m + 1, V], the raw logits of the same rows (None: not kept).
    """
    emitted: object
    scores: object = None
    logits: object = None

    @property
    def kept(self) -> int:
        """Draft tokens accepted."""
        return len(self.emitted) - 1


class Forward(Protocol):
    """One model (or recording) verifying drafts for the rows of a `decode.Rows`.

    Attributes: `draft_kind` ("chain", "tree", or "buckets" for compiled forwards: which drafts `policy.fit`
    may send), `learns_cost` (its verify time is a real forward's, so the cost curve may learn from it),
    `vocab` (ids a draft may hold are below it; None: not checked), `model` (when learns_cost: the model
    whose cost curve `core.cost.CostModel` keeps).
    """

    draft_kind: str
    learns_cost: bool
    vocab: int | None
    model: object

    def prefill(self, rows) -> list[Verified]:
        """Run the prompts; one Verified per active row holding its first token (nothing was drafted)."""

    def verify(self, rows, drafts: list) -> list[Verified]:
        """One forward over [last token, draft] of every active row (drafts[i] for rows.active[i])."""

    def rollback(self, kept: list[int]) -> None:
        """After verify: keep in the cache each row's last token and its kept[i] accepted draft tokens."""

    def keep_rows(self, keep: list[int]) -> None:
        """Only the active rows at indices `keep` go on (finished rows stop costing compute)."""

    def calibrate(self, rows, costs, k: int):
        """The cost curve of this forward for drafts up to k tokens (`core.cost`), or None when none applies."""
