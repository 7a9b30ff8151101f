"""What the studies measure beside `lookup_decode.measure` (variants, timed runs, loop score, spread): per-token
timelines, copy share, acceptance histograms and output comparison.
"""

from __future__ import annotations

import time

import numpy as np

from lookup_decode.core.cost import sync
from lookup_decode.core.stats import DecodeStats


class Timeline:
    """A stopping criterion that never stops: it stamps (sequence length, time) at every call.

    Plain generate calls it once per token, lookup decoding after every emitted token, so the time by
    which the first L new tokens were out is known for every L from one run.
    """

    def __init__(self, device):
        self.device = device
        self.points: list[tuple[int, float]] = []

    def __call__(self, input_ids, scores=None, **kwargs):
        import torch
        sync(self.device)
        self.points.append((int(input_ids.shape[1]), time.perf_counter()))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def cumulative(self, prompt_len: int, start: float) -> tuple[np.ndarray, np.ndarray]:
        """(new tokens out [m], seconds since start [m]), one entry per distinct length."""
        best: dict[int, float] = {}
        for n, t in self.points:
            best.setdefault(n - prompt_len, t)
        lengths = sorted(best)
        return np.asarray(lengths, dtype=np.int64), np.asarray([best[n] - start for n in lengths])


def copy_share(prompt, output, n: int = 8) -> float:
    """Share of the output's tokens covered by an n-gram that also occurs in the prompt.

    How much of the output copies its input: the quantity lookup decoding lives on. Example (n=2):
    prompt [1,2,3], output [1,2,9,2,3] -> the 2-grams [1,2] and [2,3] cover positions 0,1,3,4 -> 4/5.
    """
    prompt = [int(t) for t in prompt]
    output = [int(t) for t in output]
    if len(output) < n or len(prompt) < n or n < 1:
        return 0.0
    grams = {tuple(prompt[i:i + n]) for i in range(len(prompt) - n + 1)}
    covered = np.zeros(len(output), dtype=bool)
    for j in range(len(output) - n + 1):
        if tuple(output[j:j + n]) in grams:
            covered[j:j + n] = True
    return float(covered.mean())


def accepted_histogram(stats: DecodeStats) -> list[int]:
    """Steps by number of accepted draft tokens: hist[a] = steps that kept exactly a drafts.

    From stats.accepted_at (steps that kept draft position i, i.e. kept more than i tokens).
    """
    kept_more_than = [stats.steps] + list(stats.accepted_at)     # kept_more_than[a] = steps with accepted >= a
    hist = [kept_more_than[a] - (kept_more_than[a + 1] if a + 1 < len(kept_more_than) else 0)
            for a in range(len(kept_more_than))]
    while len(hist) > 1 and hist[-1] == 0:
        hist.pop()
    return hist


