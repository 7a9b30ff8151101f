"""What one step of an engine that runs the forward itself costs (vLLM): seconds = fixed + per_token x tokens.

This module owns the cost the drafter learns when it cannot time the verify forward, only the time between two
of the engine's calls: `StepCost`, one line through (tokens verified, seconds) fitted online, and the ratio
the draft lengths are chosen by (`token_cost`, per_token / fixed; `policy.ragged_lengths`). The forward-cost
curves of a model lookup decoding runs itself (seconds per width, measured, the disk cache) are `core/cost.py`.

Every error here is a ValueError.
"""


class StepCost:
    """Seconds of one step of an engine that packs all rows' tokens into one forward (vLLM): fixed +
    per_token x tokens, fitted online from the steps it observes.

    The drafter cannot time the engine's forward, only the time between two of its calls (the step, its own
    work included), and it knows how many tokens that step verified (each row's one token plus the draft it
    sent). An exponentially weighted least-squares line through (tokens, seconds) gives both terms; until the
    observed steps vary enough in their tokens to pin the slope, `token_cost` leans on the prior. Example: steps
    of 10 and 30 tokens taking 0.12 s and 0.16 s: fixed 0.1 s, per token 2 ms, token_cost 0.02.
    """

    def __init__(self, prior_token_cost: float = 0.02, *, prior_weight: float = 64.0, forget: float = 0.98):
        if not prior_token_cost >= 0:
            raise ValueError(f"prior_token_cost must be >= 0, got {prior_token_cost}")
        self.prior, self.prior_weight, self.forget = float(prior_token_cost), float(prior_weight), float(forget)
        self.sums = [0.0] * 5           # weighted sums of 1, x, y, x^2, x y (x: tokens, y: seconds); plain floats:
        self.observed = 0               # this runs once per engine step, where numpy's call cost would dominate

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not seconds > 0:
            return
        f = self.forget
        w, x, y, xx, xy = self.sums
        self.sums = [w * f + 1.0, x * f + tokens, y * f + seconds, xx * f + tokens * tokens, xy * f + tokens * seconds]
        self.observed += 1

    @property
    def token_cost(self) -> float:
        """per_token / fixed: what one more token adds to a step, relative to the step's fixed part (>= 0)."""
        w, x, y, xx, xy = self.sums
        if w < 2 or y <= 0:
            return self.prior
        sxx = xx - x * x / w                            # spread of the observed token counts
        slope = (xy - x * y / w) / sxx if sxx > 1e-9 else 0.0
        fixed = (y - slope * x) / w
        if fixed <= 0 or slope < 0:                     # noise, or a line through a cloud: the prior stands
            return self.prior
        # The data's weight grows with the spread of tokens it saw: steps that all verified the same number of
        # tokens say nothing about the slope.
        trust = sxx / (sxx + self.prior_weight)
        return trust * slope / fixed + (1 - trust) * self.prior
