"""What a verify forward costs: measured once per model, device, dtype and batch rows, then refined online.

Verifying n draft tokens costs one forward over n + 1 tokens per row, and that cost is measured, not
assumed: on a CPU the curve is far from flat and not even monotone; on a GPU it is nearly flat up to
tens of tokens. The draft policy only ever compares costs of one forward against another, so a curve
is all it needs. Two shapes of curve, one interface (`cost(w)`, `observe(rows, w, seconds)`):

* `CostCurve` (one sequence): seconds of a forward over w tokens, a calibrated shape times a live
  scale; every real step refines the shape at its size and rescales the whole curve, which follows
  context growth without re-measuring.
* `BatchCost` (a batch): a forward w tokens wide relative to one 1 token wide with the same rows. The
  absolute cost moves with the number of rows and the context, so ratios are refined only against
  width-1 steps with the same rows; ratios calibrated on more rows are conservative for fewer.

`CostModel` owns the calibrations (thread-safe, per model, forgotten with the model); every call of
lookup decoding uses `COSTS` unless given another, and `COSTS.reset()` forgets what was measured.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable

import numpy as np
import torch

EMA = 0.2
# Forward sizes (tokens per row) timed when calibrating; costs in between are interpolated.
SIZES = (1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 64)
MIN_CALIBRATED = 33     # calibrate at least this far, so a later call with a larger k reuses the curve


def sync(device) -> None:
    """Wait for queued GPU work so a wall-clock reading covers it (no-op on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device, run: Callable[[], object]) -> float:
    """Seconds of `run()`, device work included."""
    sync(device)
    t = time.perf_counter()
    run()
    sync(device)
    return time.perf_counter() - t


class CostCurve:
    """Seconds of one forward over n tokens, n = 1..max_n: a calibrated shape times a live scale."""

    def __init__(self, sizes, seconds, max_n: int):
        sizes = np.asarray(sizes, dtype=np.float64)
        seconds = np.asarray(seconds, dtype=np.float64)
        if np.any(seconds <= 0) or len(sizes) == 0:
            raise ValueError("cost measurements must be positive")
        self.max_n = int(max_n)
        self.shape = np.interp(np.arange(self.max_n + 1), sizes, seconds)  # [max_n + 1], index = n
        self.scale = 1.0
        self._lock = threading.Lock()     # one curve serves every call (and thread) on its model

    def __call__(self, n: int) -> float:
        if n > self.max_n:
            raise ValueError(f"cost of {n} tokens asked, but the curve was measured up to {self.max_n}")
        return self.shape[n] * self.scale

    def observe(self, rows: int, n: int, seconds: float) -> None:
        if n > self.max_n or seconds <= 0:
            return
        with self._lock:
            # The scale moves slowly (it shifts every size at once); the size just used moves faster.
            self.scale *= 1.0 + 0.25 * EMA * (seconds / self(n) - 1.0)
            self.shape[n] += EMA * (seconds / self.scale - self.shape[n])


class BatchCost:
    """Seconds of a forward w tokens wide relative to one 1 token wide, for the rows now in the batch."""

    def __init__(self, relative: np.ndarray):
        self.relative = np.array(relative, dtype=np.float64)     # [max_w + 1], index w; relative[1] = 1
        self.max_w = len(self.relative) - 1
        self.width1: dict[int, float] = {}                      # rows -> seconds of a width-1 step

    def __call__(self, w: int) -> float:
        return float(self.relative[w])

    def observe(self, rows: int, w: int, seconds: float) -> None:
        if seconds <= 0 or not 1 <= w <= self.max_w:
            return
        if w == 1:
            last = self.width1.get(rows)
            self.width1[rows] = seconds if last is None else last + EMA * (seconds - last)
        elif rows in self.width1:
            self.relative[w] += EMA * (seconds / self.width1[rows] - self.relative[w])


def measure_curve(seconds_of: Callable[[int], float], max_n: int, sizes=None) -> CostCurve:
    """Time `seconds_of(n)` at a few sizes up to max_n (sizes: the ones to time) and build the curve."""
    grid = sorted(sizes or {n for n in SIZES if n <= max_n} | {max_n})
    seconds_of(grid[-1])  # warm-up: first use of a shape allocates
    # Noise only ever adds time: the least of two runs for the small sizes the ratios hinge on.
    seconds = [min(seconds_of(n), seconds_of(n)) if n <= 2 else seconds_of(n) for n in grid]
    return CostCurve(grid, seconds, max_n)


def measure_relative(seconds_of: Callable[[int], float], max_w: int) -> np.ndarray:
    """Cost of widths 0..max_w relative to width 1, float [max_w + 1] (width 0: inf)."""
    widths = sorted({w for w in SIZES if w <= max_w} | {max_w})
    seconds_of(widths[-1])  # warm-up
    # The least of a few runs is the estimate (three for the denominator).
    measured = np.array([min(seconds_of(w) for _ in range(3 if w == 1 else 2 if w == 2 else 1)) for w in widths])
    relative = np.interp(np.arange(max_w + 1), widths, measured / measured[0])
    relative[0] = np.inf
    return relative


def measure_forward_cost(model, context_ids, sizes, repeats: int = 3) -> list[float]:
    """Median seconds of one forward over n new tokens after a prefilled context, for each n in sizes.

    context_ids: long [1, T] (real text: the cost of attention depends on T). The n tokens are the
    context's own last tokens; each measurement is cropped from the cache again.
    """
    from lookup_decode.cache import cache_argument, crop, new_cache
    cache, arg = new_cache(model), cache_argument(model)
    out = []
    with torch.inference_mode():
        model(input_ids=context_ids, **{arg: cache}, use_cache=True)
        for n in sizes:
            ids = context_ids[:, -n:] if n <= context_ids.shape[1] else context_ids[:, -1:].expand(1, n)
            times = []
            for _ in range(repeats):
                times.append(timed(context_ids.device, lambda: model(input_ids=ids, **{arg: cache}, use_cache=True)))
                crop(cache, n)
            out.append(float(np.median(times)))
    return out


class CostModel:
    """Measured forward costs per model, keyed by (device, dtype, batch rows, bucketed sizes).

    One sequence keeps one live `CostCurve` per key that every call refines; a batch gets a fresh
    `BatchCost` from the stored ratios. Entries go with their model (weak keys); `reset()` forgets.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._by_model: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()

    @staticmethod
    def key(model, rows: int, bucketed: bool = False) -> tuple:
        p = next(model.parameters())
        return str(p.device), str(p.dtype), int(rows), bool(bucketed)

    def curve(self, model, max_n: int, seconds_of: Callable[[int], float], *, bucketed: bool = False,
              sizes=None, fit: int | None = None) -> CostCurve:
        """The live curve of one sequence, measured now (up to max(max_n, 33) tokens) if not yet known.

        fit: the widest forward this call can run (its context and max_length); nothing wider is timed,
        since a forward past a model's positions is an index error (on CUDA one that poisons the process).
        """
        if fit is not None:
            max_n = min(max_n, fit)
            sizes = None if sizes is None else [n for n in sizes if n <= fit] or [max_n]
        key = self.key(model, 1, bucketed)
        with self._lock:
            known = self._by_model.setdefault(model, {})
            if key not in known or known[key].max_n < max_n:
                upto = max(max_n, MIN_CALIBRATED) if fit is None else min(max(max_n, MIN_CALIBRATED), fit)
                known[key] = measure_curve(seconds_of, upto, sizes)
            return known[key]

    def batch(self, model, rows: int, max_w: int, seconds_of: Callable[[int], float],
              fit: int | None = None) -> BatchCost:
        """Relative costs of widths 1..max_w for `rows` rows, measured now if not yet known (fit: as in curve)."""
        max_w = max_w if fit is None else min(max_w, fit)
        key = self.key(model, rows)
        with self._lock:
            known = self._by_model.setdefault(model, {})
            if key not in known or len(known[key]) < max_w + 1:
                known[key] = measure_relative(seconds_of, max_w)
            return BatchCost(known[key][: max_w + 1])

    def known(self, model) -> dict:
        """What was measured for `model`: key -> CostCurve or relative costs (a copy of the table)."""
        with self._lock:
            return dict(self._by_model.get(model, {}))

    def reset(self, model=None) -> None:
        """Forget every measurement (or those of one model); the next call calibrates again."""
        with self._lock:
            if model is None:
                self._by_model = weakref.WeakKeyDictionary()
            else:
                self._by_model.pop(model, None)


COSTS = CostModel()
