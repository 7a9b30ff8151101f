"""LookupConfig: the per-call options of lookup decoding, validated once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LookupConfig:
    """Options of one lookup-decoding call.

    k: the most draft tokens verified in one step (the cost model usually picks fewer).
    min_match: shortest matched suffix that may back a draft. 1 by default: offline replay on real
        outputs keeps more tokens per step with 1-token matches allowed, and the adaptive policy
        learns (per match length) when such weak evidence is not worth a longer forward.
    max_match: longer matches count as this long when judging how far to trust a draft.
    adaptive: choose each draft length from measured forward cost and observed acceptance;
        False always verifies min(k, available) draft tokens.
    """
    k: int = 32
    min_match: int = 1
    max_match: int = 64
    adaptive: bool = True

    def __post_init__(self):
        for name in ("k", "min_match", "max_match"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if self.k < 0:
            raise ValueError(f"k (max draft tokens per step) must be >= 0, got {self.k}")
        if self.min_match < 1:
            raise ValueError(f"min_match must be >= 1, got {self.min_match}")
        if self.max_match < self.min_match:
            raise ValueError(f"max_match ({self.max_match}) must be >= min_match ({self.min_match})")
        if not isinstance(self.adaptive, bool):
            raise TypeError(f"adaptive must be True or False, got {self.adaptive!r}")
