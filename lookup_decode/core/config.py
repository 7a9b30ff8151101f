"""LookupConfig: the per-call options of lookup decoding, and the one place options are validated."""

from __future__ import annotations

from dataclasses import dataclass

# The corpus rule of `core.draft.choose_source` (for `sources.proposer.SourcesProposer` and `core.pool.IndexPool`):
# while the request has a draft of its own, a corpus draft must rest on at least CORPUS_MIN_MATCH tokens; when it has
# none, ALONE_MIN_MATCH suffice (chosen by offline replay: benchmarks/results/memory_replay/).
CORPUS_MIN_MATCH = 4
ALONE_MIN_MATCH = 2


def check_int(name: str, value, low: int | None = None) -> int:
    """value as an int (>= low when given), else a TypeError/ValueError naming it: the one integer check of every
    option. Example: check_int("k", 8, 0) -> 8; check_int("k", True) raises TypeError."""
    if isinstance(value, bool) or not isinstance(value, int) and not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


def check_k(k) -> int:
    """k (most draft tokens per step) as an int >= 0, else a TypeError/ValueError naming it."""
    return check_int("k", k, 0)


def check_match(min_match, max_match) -> tuple[int, int]:
    """(min_match, max_match) as ints with 1 <= min_match <= max_match, else an error naming them."""
    min_match, max_match = check_int("min_match", min_match, 1), check_int("max_match", max_match)
    if max_match < min_match:
        raise ValueError(f"max_match ({max_match}) must be >= min_match ({min_match})")
    return min_match, max_match


def corpus_thresholds(min_match: int, max_match: int, corpus_min_match: int = CORPUS_MIN_MATCH,
                      alone_min_match: int = ALONE_MIN_MATCH) -> tuple[int, int]:
    """(corpus, alone): the matches a corpus draft needs beside a draft of the request's own / without one, clamped
    into [min_match, max_match] (alone <= corpus)."""
    corpus = min(max(min_match, corpus_min_match), max_match)
    return corpus, min(max(min_match, alone_min_match), corpus)


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
    hole_share, min_holes: batches compact their KV cache once the columns some row rejected (holes)
        exceed this share of the cache and at least this many (a compaction copies the whole cache).
    tree_width: most branches of a draft where the forward verifies trees (one row, full-attention cache): other
        continuations of the matched suffix, as many nodes as the measured cost curve verifies for free beside the
        chain (`DraftPolicy.tree_budget`: none on a steep CPU curve). 1: chains only.
    """
    k: int = 32
    min_match: int = 1
    max_match: int = 64
    adaptive: bool = True
    hole_share: float = 0.25
    min_holes: int = 32
    tree_width: int = 4

    def __post_init__(self):
        check_k(self.k)
        check_match(self.min_match, self.max_match)
        if not isinstance(self.adaptive, bool):
            raise TypeError(f"adaptive must be True or False, got {self.adaptive!r}")
        if not 0 <= self.hole_share <= 1:
            raise ValueError(f"hole_share must be in [0, 1], got {self.hole_share}")
        check_int("min_holes", self.min_holes, 0)
        check_int("tree_width (branches per draft)", self.tree_width, 1)
