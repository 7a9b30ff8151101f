"""DecodeStats: what one generation did, with fixed conventions (vLLM's metrics vocabulary).

Every field is a sum, so one DecodeStats passed to several calls (or `merge`d) describes them all.
A *forward* is one verification forward of the model; a *step* is one row's verification in it (one
sequence: a step per forward; a batch of B rows: up to B steps per forward), what vLLM counts as one
draft. *Drafted* tokens were sent to the model, *accepted* ones were kept; every step also emits one
target token (the *recovered* token after a rejection, or the *bonus* token after a fully accepted
draft), so mean accepted length counts it too.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


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
        longest = max(drafted, default=0)
        if longest > len(self.accepted_at):
            self.accepted_at.extend([0] * (longest - len(self.accepted_at)))
        for a in accepted:
            for i in range(a):
                self.accepted_at[i] += 1

    def _bound(self) -> None:
        if len(self.draft_lengths) > self.keep_steps:   # drop the oldest half of the allowance at once: O(1) amortized
            drop = len(self.draft_lengths) - self.keep_steps // 2
            del self.draft_lengths[:drop], self.accepted_lengths[:drop]
        if len(self.row_steps) > self.keep_steps:
            del self.row_steps[: len(self.row_steps) - self.keep_steps // 2]

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
        for name in ("prompt_tokens", "new_tokens", "forwards", "steps", "drafted", "accepted", "tree_steps",
                     "off_chain", "prefill_s", "model_s", "proposer_s", "commit_s", "total_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.draft_lengths.extend(other.draft_lengths)
        self.accepted_lengths.extend(other.accepted_lengths)
        self.row_steps.extend(other.row_steps)
        self._bound()
        n = max(len(self.accepted_at), len(other.accepted_at))
        self.accepted_at = [(self.accepted_at[i] if i < len(self.accepted_at) else 0)
                            + (other.accepted_at[i] if i < len(other.accepted_at) else 0) for i in range(n)]

    def as_dict(self) -> dict:
        d = asdict(self)
        del d["draft_lengths"], d["accepted_lengths"], d["keep_steps"], d["row_steps"]
        d.update(mean_accepted_length=self.mean_accepted_length, acceptance_rate=self.acceptance_rate,
                 tokens_per_second=self.tokens_per_second)
        return d

    def summary(self) -> str:
        return (f"{self.new_tokens} tokens in {self.total_s:.2f}s ({self.tokens_per_second:.1f} tok/s); "
                f"{self.forwards} forwards, {self.steps} steps, mean accepted length {self.mean_accepted_length:.2f}, "
                f"drafted {self.drafted}, accepted {self.accepted} ({100 * self.acceptance_rate:.0f}%); "
                f"time in model {self.model_s:.2f}s, proposer {self.proposer_s * 1e3:.1f}ms")
