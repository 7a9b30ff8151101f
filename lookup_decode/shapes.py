"""Verify-forward shapes for compiled models: draft lengths rounded to a few buckets.

A `torch.compile`d forward (usually with a static cache, whose tensors never change shape)
specializes on the number of input tokens; lookup decoding would otherwise send every size from 1
to k + 1 and recompile for each. Rounding each step's forward size (last token + draft) to a power
of two keeps it to log2(k) + 1 shapes. Rounding up pads the draft with extra tokens: more of the
proposer's own draft where it has them, else a filler token. Any draft keeps decoding exact
(verification accepts a draft token only if the model itself would emit it); a filler just
costs its share of the forward and is almost always rejected and rolled back (DecodeStats counts
padded tokens as drafted).
"""

from __future__ import annotations

import numpy as np

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)   # forward sizes: 1 + draft length


def bucketed_draft(full: np.ndarray, n: int, limit: int, filler: int) -> np.ndarray:
    """The draft to verify when forward sizes must lie in BUCKETS.

    full: int32 [p], everything the proposer offered; n: draft tokens the policy chose (n <= p);
    limit: most draft tokens allowed this step (k, and room left before max_length).
    Returns int32 [b - 1] where b is the smallest bucket >= n + 1, or the largest bucket
    <= limit + 1 if that one is too long. Example: full=[5, 6, 7], n=2, limit=31 -> [5, 6, 7];
    full=[5], n=1, limit=31, filler=9 -> [5]; n=0 -> [].
    """
    fitting = [b for b in BUCKETS if b - 1 <= limit]
    size = next((b for b in fitting if b >= n + 1), fitting[-1])
    d = size - 1
    if d <= len(full):
        return full[:d]
    return np.concatenate([full, np.full(d - len(full), filler, dtype=full.dtype)])
