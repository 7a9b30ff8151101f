"""Forward cost by context length, and the projected time of a replayed generation priced with it.

One timing rule for every forward-cost measurement of the benchmarks (`median_seconds`; the GPU check's
curves use it too). Used by the scaling study for contexts the default model cannot hold (its context is 8k tokens) or
that would take hours to prefill on a CPU: the cost of one forward over n new tokens after T cached
tokens is *measured on this machine* with a synthetic KV cache of T random keys/values. A forward's
cost does not depend on the cached values, only on their shape (attention reads all T of them, and
DynamicCache concatenates every step), so this is the real cost at context T; only the tokens the
model would produce there are not measured. RoPE has no length limit, so positions past the model's
trained context run at the same cost.

A replay (lookup_decode.engines.replay.replay) knows per step how many tokens were drafted and accepted;
pricing step j as one forward over d_j + 1 tokens at the context reached by then gives the projected
time, and plain decoding is one forward over 1 token per emitted token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from lookup_decode.core.cost import CostCurve, sync


def synthetic_cache(model, context_tokens: int, seed: int = 0):
    """A DynamicCache holding `context_tokens` random keys/values in every layer (shapes from a 1-token probe)."""
    import torch

    from lookup_decode.engines.hf.cache import cache_argument, new_cache
    device = next(model.parameters()).device
    probe = new_cache(model)
    with torch.inference_mode():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), **{cache_argument(model): probe},
              use_cache=True)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    cache = new_cache(model)
    for i, layer in enumerate(probe.layers):
        b, h, _, d = layer.keys.shape             # [batch, kv heads, 1, head dim]
        k = torch.randn(b, h, context_tokens, d, generator=gen, dtype=layer.keys.dtype).to(device)
        v = torch.randn(b, h, context_tokens, d, generator=gen, dtype=layer.values.dtype).to(device)
        cache.update(k, v, i)
    return cache


def median_seconds(run: Callable[[], object], after: Callable[[], object], device, repeats: int) -> float:
    """Median seconds of run() (device work included); after() runs untimed after each (the rollback)."""
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - t)
        after()
    return float(np.median(times))


def time_forwards(model, cache, sizes: Sequence[int], repeats: int = 3) -> list[float]:
    """Median seconds of one forward over n new tokens on top of `cache` (cropped back after each), per n."""
    import torch

    from lookup_decode.engines.hf.cache import cache_argument, crop
    device = next(model.parameters()).device
    arg = cache_argument(model)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, max(sizes)), generator=torch.Generator().manual_seed(0)).to(device)
    out = []
    with torch.inference_mode():
        model(input_ids=ids[:, :1], **{arg: cache}, use_cache=True)   # untimed: first use of the shapes
        crop(cache, 1)
        for n in sizes:
            out.append(median_seconds(lambda: model(input_ids=ids[:, :n], **{arg: cache}, use_cache=True),
                                      lambda: crop(cache, n), device, repeats))
    return out


def measure_cost_grid(model, contexts: Sequence[int], sizes: Sequence[int], repeats: int = 3,
                      progress=lambda context: None) -> list[list[float]]:
    """seconds[i][j]: one forward over sizes[j] tokens after contexts[i] cached tokens (synthetic cache)."""
    grid = []
    for context in contexts:
        progress(context)
        cache = synthetic_cache(model, context)
        grid.append(time_forwards(model, cache, sizes, repeats))
        del cache
    return grid


class CostGrid:
    """cost(context, n): seconds of one forward over n tokens after `context` cached tokens.

    Linear interpolation between measured sizes and between measured contexts; clamped outside
    the measured contexts (measure up to the longest context priced).
    """

    def __init__(self, contexts: Sequence[int], sizes: Sequence[int], seconds):
        self.contexts = np.asarray(contexts, dtype=np.float64)   # [C], increasing
        self.sizes = np.asarray(sizes, dtype=np.float64)         # [S], increasing
        self.seconds = np.asarray(seconds, dtype=np.float64)     # [C, S]
        if self.seconds.shape != (len(self.contexts), len(self.sizes)):
            raise ValueError(f"seconds must be [contexts, sizes] = {(len(self.contexts), len(self.sizes))}, "
                             f"got {self.seconds.shape}")
        if np.any(np.diff(self.contexts) <= 0) or np.any(np.diff(self.sizes) <= 0):
            raise ValueError("contexts and sizes must be strictly increasing")

    def at_context(self, context: float) -> np.ndarray:
        """Seconds per measured size at one context, float64 [S]."""
        return np.array([np.interp(context, self.contexts, self.seconds[:, j]) for j in range(len(self.sizes))])

    def __call__(self, context: float, n: int) -> float:
        return float(np.interp(n, self.sizes, self.at_context(context)))

    def curve(self, context: float, max_n: int) -> CostCurve:
        """The 1-D cost curve at one context, as lookup_decode's draft policy uses it."""
        return CostCurve(self.sizes, self.at_context(context), max_n)


def step_times(draft_lengths: Sequence[int], accepted_lengths: Sequence[int], cost: CostGrid,
               context: int) -> tuple[np.ndarray, np.ndarray]:
    """Per replayed step: (tokens emitted by the end of it [steps], projected seconds by the end of it [steps]).

    Step j verifies d_j drafts in one forward over d_j + 1 tokens at the context reached so far and
    emits a_j + 1 tokens.
    """
    emitted, seconds, done, t = [], [], 0, 0.0
    for d, a in zip(draft_lengths, accepted_lengths):
        t += cost(context + done, d + 1)
        done += a + 1
        emitted.append(done)
        seconds.append(t)
    return np.asarray(emitted, dtype=np.int64), np.asarray(seconds, dtype=np.float64)


def plain_times(n_tokens: int, cost: CostGrid, context: int) -> np.ndarray:
    """Projected seconds by the end of each token of plain decoding (one 1-token forward each), [n_tokens]."""
    return np.cumsum([cost(context + i, 1) for i in range(n_tokens)])


def time_to(emitted: np.ndarray, seconds: np.ndarray, lengths: Sequence[int]) -> list[float | None]:
    """Seconds by which the first L tokens were out, per L in lengths (None past the last token).

    emitted, seconds: cumulative, per step (as from step_times, or a timeline of a real run).
    """
    out = []
    for n in lengths:
        j = int(np.searchsorted(emitted, n))      # first step whose cumulative count reaches n
        out.append(float(seconds[j]) if j < len(emitted) else None)
    return out
