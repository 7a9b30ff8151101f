"""DecodeStats: what one generation did, with fixed conventions (vLLM's metrics vocabulary).

Every field is a sum, so one DecodeStats passed to several calls (or `merge`d) describes them all.
A *forward* is one verification forward of the model; a *step* is one row's verification in it (one
sequence: a step per forward; a batch of B rows: up to B steps per forward), what vLLM counts as one
draft. *Drafted* tokens were sent to the model, *accepted* ones were kept; every step also emits one
target token (the *recovered* token after a rejection, or the *bonus* token after a fully accepted
draft), so mean accepted length counts it too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from itertools import zip_longest
from typing import NamedTuple

import numpy as np
from numba import njit

CALIBRATION_BINS = 10                   # equal-width bins of predicted probability over [0, 1]
CALIBRATION_MIN_TOKENS = 50             # a bin with fewer tokens is too noisy to judge (`Calibration.error`)
CALIBRATION_FIELDS = ("tokens", "predicted", "kept", "variance")    # the rows of `Calibration.table`


class CalibrationRow(NamedTuple):
    """One bin of a reliability table: the draft tokens sent whose predicted probability of being kept lay in
    [bin_low, bin_high), their mean predicted probability, the share of them the target kept, and how far that share
    would stray by chance alone (its standard deviation were the predictions exact)."""
    bin_low: float
    bin_high: float
    tokens: int
    predicted: float
    kept: float
    chance: float


@dataclass
class Calibration:
    """How well the acceptance model knows what will be kept: per bin of predicted probability, the tokens sent,
    the sum of their predicted probabilities, how many were kept, and the variance of that count were the predictions
    exact. A calibrated model's mean prediction equals the share kept in every bin, up to chance; `error` is the
    largest gap over bins holding enough tokens to tell.

    Each prediction is the probability that the token *and every draft token before it* are kept (what a row
    keeps is a prefix), so `observe_rows` marks the first `kept` tokens of each row's sent draft as kept. The same
    nesting makes a draft's tokens count as one outcome more than as many: token j kept implies every earlier token
    i kept (Cov = p_j (1 - p_i)), so a bin of a few hundred tokens from a few dozen drafts strays by ~0.1 by chance
    (benchmarks/results/readme_job/README.md).
    """
    table: np.ndarray = field(default_factory=lambda: np.zeros((len(CALIBRATION_FIELDS), CALIBRATION_BINS)))

    @property
    def tokens(self) -> list[int]:
        return [int(x) for x in self.table[0]]

    @property
    def predicted(self) -> list[float]:
        return self.table[1].tolist()

    @property
    def kept(self) -> list[int]:
        return [int(x) for x in self.table[2]]

    def observe(self, predicted, kept) -> None:
        """predicted: float [n], each sent token's probability of being kept; kept: bool [n], whether it was."""
        p = np.ascontiguousarray(predicted, np.float64).reshape(1, -1)
        calibrate(self.table, p, np.array([p.shape[1]], np.int64), np.ascontiguousarray(kept, np.bool_).reshape(1, -1),
                 np.zeros(1, np.int64))

    def observe_rows(self, p_kept, sent, kept) -> None:
        """One step of several rows: p_kept float [r, >= max(sent)] (row i's predictions for its draft tokens),
        sent int [r] (tokens of it sent), kept int [r] (of those, the prefix the target kept). A compiled loop: an
        engine calls this every step (numpy's masks and bincounts cost ~20 us a call)."""
        p = np.asarray(p_kept, np.float64)
        calibrate(self.table, p if p.ndim == 2 else p.reshape(1, -1), np.asarray(sent, np.int64), NO_FLAGS,
                 np.asarray(kept, np.int64))

    def merge(self, other: "Calibration") -> None:
        self.table += other.table

    def rows(self) -> list[CalibrationRow]:
        """The bins that hold tokens, lowest first."""
        tokens, predicted, kept, variance = self.table.tolist()
        return [CalibrationRow(i / CALIBRATION_BINS, (i + 1) / CALIBRATION_BINS, int(n), predicted[i] / n,
                               kept[i] / n, max(variance[i], 0.0) ** 0.5 / n) for i, n in enumerate(tokens) if n]

    def worst(self, min_tokens: int = CALIBRATION_MIN_TOKENS) -> CalibrationRow | None:
        """The bin with the largest |mean predicted - share kept| of those holding at least min_tokens (None: none)."""
        return max((r for r in self.rows() if r.tokens >= min_tokens), key=lambda r: abs(r.predicted - r.kept),
                   default=None)

    def error(self, min_tokens: int = CALIBRATION_MIN_TOKENS) -> float:
        """The largest |mean predicted - share kept| over the bins holding at least min_tokens (0 when none)."""
        worst = self.worst(min_tokens)
        return abs(worst.predicted - worst.kept) if worst else 0.0

    def summary(self, min_tokens: int = CALIBRATION_MIN_TOKENS) -> str:
        """One line: predicted -> kept per bin, and the largest gap over bins of >= min_tokens tokens beside what
        chance alone would give that bin (a standard deviation)."""
        bins = ", ".join(f"{r.predicted:.2f}->{r.kept:.2f} ({r.tokens})" for r in self.rows())
        worst = self.worst(min_tokens)
        worst = (f"worst gap {abs(worst.predicted - worst.kept):.2f} (by chance alone: +-{worst.chance:.2f})"
                 if worst else f"no bin holds {min_tokens} tokens yet")
        return f"calibration (predicted->kept, tokens): {bins or 'nothing sent'}; {worst}"


NO_FLAGS = np.zeros((1, 0), np.bool_)


@njit(cache=True, nogil=True)
def calibrate(table, p_kept, sent, flags, kept):
    """Add the first sent[i] predictions of each row i to their bins: kept where flags[i, j] (when flags has
    columns: independent tokens), else where j < kept[i] (a kept prefix: `Calibration`'s variance)."""
    earlier = np.zeros(CALIBRATION_BINS)       # per bin: sum of (1 - p) over the row's earlier tokens in it
    for i in range(sent.shape[0]):
        earlier[:] = 0.0
        for j in range(min(sent[i], p_kept.shape[1])):
            p = min(max(p_kept[i, j], 0.0), 1.0)
            b = min(int(p * CALIBRATION_BINS), CALIBRATION_BINS - 1)
            table[0, b] += 1.0
            table[1, b] += p
            if flags[i, j] if flags.shape[1] else j < kept[i]:
                table[2, b] += 1.0
            table[3, b] += p * (1.0 - p) + 2.0 * p * earlier[b]
            if not flags.shape[1]:
                earlier[b] += 1.0 - p


@dataclass
class DecodeStats:
    prompt_tokens: int = 0
    new_tokens: int = 0                 # tokens returned after the prompt
    forwards: int = 0                   # verification forwards (prefill not counted)
    steps: int = 0                      # row-steps: each row's verification in each forward
    row_steps: list[int] = field(default_factory=list)  # [rows] steps of each row of each call, in order
    drafted: int = 0                    # draft tokens sent to the model
    accepted: int = 0                   # draft tokens kept
    accepted_at: list[int] = field(default_factory=list)  # [k] steps that kept draft position i
    draft_lengths: list[int] = field(default_factory=list)  # [steps] tokens drafted per step
    accepted_lengths: list[int] = field(default_factory=list)  # [steps] draft tokens kept per step
    tree_steps: int = 0                 # steps that verified a tree (several branches in one forward)
    off_chain: int = 0                  # tree steps that kept tokens of a branch other than the first
    prefill_s: float = 0.0              # prompt forward (+ one-time cost calibration)
    model_s: float = 0.0                # verification forwards, acceptance and cache rollback
    proposer_s: float = 0.0             # drafters (extend + propose), draft-length choice and learning
    commit_s: float = 0.0               # writing emitted tokens, stopping criteria, streamer
    total_s: float = 0.0                # wall time of the whole call
    reliability: Calibration = field(default_factory=Calibration)   # predicted vs kept, per bin (calibration())
    keep_steps: int = 100_000           # per-step lists keep the latest this many steps (one DecodeStats may
                                        # serve a server for days; every count above stays exact)

    def observe(self, drafted: int, accepted: int, *, tree: bool = False, off_chain: bool = False) -> None:
        self.observe_rows([drafted], [accepted], trees=int(tree), off_chain=int(off_chain))

    def observe_rows(self, drafted: list[int], accepted: list[int], *, trees: int = 0, off_chain: int = 0) -> None:
        """One forward: a step of each row verified in it (trees/off_chain: how many of the rows)."""
        self.forwards += 1
        self.steps += len(drafted)
        self.tree_steps += int(trees)
        self.off_chain += int(off_chain)
        self.drafted += sum(drafted)
        self.accepted += sum(accepted)
        self.draft_lengths.extend(drafted)
        self.accepted_lengths.extend(accepted)
        self._bound()
        self.accepted_at.extend([0] * (max(drafted, default=0) - len(self.accepted_at)))   # none when long enough
        for a in accepted:
            for i in range(a):
                self.accepted_at[i] += 1

    def _bound(self) -> None:
        if len(self.draft_lengths) > self.keep_steps:   # drop the oldest half of the allowance at once: O(1) amortized
            drop = len(self.draft_lengths) - self.keep_steps // 2
            del self.draft_lengths[:drop], self.accepted_lengths[:drop]
        if len(self.row_steps) > self.keep_steps:
            del self.row_steps[: len(self.row_steps) - self.keep_steps // 2]

    def calibration(self) -> list[CalibrationRow]:
        """The reliability table of the acceptance model: rows (bin_low, bin_high, tokens, predicted, kept, chance)."""
        return self.reliability.rows()

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per step, the bonus/recovered token included (vLLM convention)."""
        return 1.0 + self.accepted / max(self.steps, 1)

    @property
    def acceptance_rate(self) -> float:
        """Share of drafted tokens that were kept (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def merge(self, other: "DecodeStats") -> None:
        """Add another call's counts (e.g. across the prompts of a benchmark)."""
        for f in fields(self):          # every count and time (the annotations are strings here)
            if f.type in ("int", "float") and f.name != "keep_steps":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        self.draft_lengths.extend(other.draft_lengths)
        self.accepted_lengths.extend(other.accepted_lengths)
        self.reliability.merge(other.reliability)
        self.row_steps.extend(other.row_steps)
        self._bound()
        self.accepted_at = [a + b for a, b in zip_longest(self.accepted_at, other.accepted_at, fillvalue=0)]

    def as_dict(self) -> dict:
        d = asdict(self)
        del d["draft_lengths"], d["accepted_lengths"], d["keep_steps"], d["row_steps"], d["reliability"]
        d.update(calibration=[r._asdict() for r in self.calibration()],
                 mean_accepted_length=self.mean_accepted_length, acceptance_rate=self.acceptance_rate,
                 tokens_per_second=self.tokens_per_second)
        return d

    def summary(self) -> str:
        return (f"{self.new_tokens} tokens in {self.total_s:.2f}s ({self.tokens_per_second:.1f} tok/s); "
                f"{self.forwards} forwards, {self.steps} steps, mean accepted length {self.mean_accepted_length:.2f}, "
                f"drafted {self.drafted}, accepted {self.accepted} ({100 * self.acceptance_rate:.0f}%); "
                f"time in model {self.model_s:.2f}s, proposer {self.proposer_s * 1e3:.1f}ms"
                + (f"\n{self.reliability.summary()}" if self.drafted else ""))
