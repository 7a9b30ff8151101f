"""Token ids at the edges: validated int32 arrays, EOS ids from whatever an engine's config holds, and an
output cut after its first EOS. No transformers or vLLM here: every engine asks these."""

from __future__ import annotations

import numpy as np

MAX_TOKEN_ID = 2**31 - 1
SEPARATOR = MAX_TOKEN_ID       # between a corpus's entries (`sources.corpus`): never a model token, drafts stop there
CURSOR_TAIL = 256              # most tokens a corpus cursor re-walks after its corpus changed


def as_token_array(tokens, what: str = "token ids") -> np.ndarray:
    """Validate and convert token ids (list, numpy array or 1-D torch tensor) to contiguous int32 [m]."""
    if hasattr(tokens, "detach"):  # torch.Tensor, without importing torch here
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int32)
    if not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{what} must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > MAX_TOKEN_ID:
        raise ValueError(f"{what} must lie in [0, 2**31 - 1], got values in [{lo}, {hi}]")
    return np.ascontiguousarray(arr, dtype=np.int32)


def eos_ids(eos) -> list[int]:
    """EOS ids as a list of ints, from a config that has an `eos_token_id` attribute (a generation config,
    a model config) or from a plain value: None, an int, a list or tuple, a numpy array or a tensor.

    A config without the attribute has no EOS: []. Example: eos_ids(7) -> [7]; eos_ids([1, 2]) -> [1, 2].
    """
    if eos is not None and not isinstance(eos, (int, np.integer, list, tuple)) and not hasattr(eos, "tolist"):
        eos = getattr(eos, "eos_token_id", None)    # a config object; one without the attribute names no EOS
    if eos is None:
        return []
    if hasattr(eos, "tolist"):                      # numpy array or torch tensor, any shape
        eos = np.asarray(eos.tolist()).reshape(-1).tolist()
    values = eos if isinstance(eos, (list, tuple)) else [eos]
    if any(isinstance(e, bool) or not isinstance(e, (int, np.integer)) for e in values):
        raise TypeError(f"eos_token_id must be an int or a list of ints, got {eos!r}")
    return [int(e) for e in values]


def trim_at_eos(tokens, eos) -> np.ndarray:
    """The tokens up to and including the first EOS id (all of them when none): what a row's output is.

    Example: trim_at_eos([5, 6, 2, 0, 0], [2]) -> [5, 6, 2].
    """
    arr = as_token_array(tokens, "output tokens")
    hits = np.flatnonzero(np.isin(arr, np.asarray(list(eos), np.int64))) if len(eos) else []
    return arr[: int(hits[0]) + 1] if len(hits) else arr
