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

Cold start: a first call does not time a whole grid of sizes. A one-sequence curve starts from a *prior*
built from the model's shape (`prior_seconds`: weights read once per forward, 2 flops per parameter and
token, a fixed launch cost per layer, on a memory-bound or compute-bound device), corrected by a few
forwards (`QUICK_SIZES`), then refined online by every step. Curves can be cached on disk per model
shape, device, dtype and batch rows (`DiskCache`, opt-in: set `$LOOKUP_DECODE_COST_CACHE` to a folder), so a
later process starts from what was measured. Off by default: a curve measured while the machine was busy
would persist, and a curve that prices drafts out is never corrected (a step that does not draft only
re-times width 1) — a forced replay on a quiet machine drafted nothing with such a cached curve and 7 tokens
per step without it (benchmarks/results/forced_replay/README.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import weakref
from pathlib import Path
from collections.abc import Callable

import numpy as np
import torch

EMA = 0.2
# Forward sizes (tokens per row) timed when calibrating; costs in between are interpolated.
SIZES = (1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 64)
MIN_CALIBRATED = 33     # calibrate at least this far, so a later call with a larger k reuses the curve
# Sizes a cold start times (twice each: 6 forwards after the prefill): the prior's shape is corrected at these and in between.
QUICK_SIZES = (1, 8, MIN_CALIBRATED)
CACHE_ENV = "LOOKUP_DECODE_COST_CACHE"
SAVE_EVERY = 64         # steps a live curve observes between two writes of it to the disk cache
# Rough device figures for the prior (only the curve's shape matters: measured forwards set its scale).
# bytes/s of weight reads, flop/s, seconds of fixed cost per layer and forward.
DEVICE_PRIOR = {"cuda": (2.0e12, 3.0e14, 1.5e-5), "cpu": (1.5e10, 5.0e10, 3.0e-5)}


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
        self.observed = self.saved_at = 0  # steps observed; the count when last written to disk
        self._lock = threading.Lock()     # one curve serves every call (and thread) on its model

    def __call__(self, n: int) -> float:
        if n > self.max_n:
            raise ValueError(f"cost of {n} tokens asked, but the curve was measured up to {self.max_n}")
        return self.shape[n] * self.scale

    def prices(self, max_n: int) -> np.ndarray:
        """float64 [max_n]: the cost of n = 1..max_n tokens, as __call__ gives them one by one."""
        if max_n > self.max_n:
            raise ValueError(f"cost of {max_n} tokens asked, but the curve was measured up to {self.max_n}")
        return self.shape[1: max_n + 1] * self.scale

    def observe(self, rows: int, n: int, seconds: float) -> None:
        if n > self.max_n or seconds <= 0:
            return
        with self._lock:
            self.observed += 1
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

    def prices(self, max_w: int) -> np.ndarray:
        """float64 [max_w]: the relative cost of widths 1..max_w."""
        if max_w > self.max_w:
            raise IndexError(f"cost of width {max_w} asked, but it was measured up to {self.max_w}")
        return self.relative[1: max_w + 1].copy()

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


def shape_of(model) -> dict:
    """What a forward's cost depends on: parameters, bytes per parameter, layers, vocabulary, device kind."""
    params = list(model.parameters())
    cfg = getattr(model, "config", None)
    get = (lambda name: getattr(cfg, name, None)) if cfg is not None else (lambda name: None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        text = cfg.get_text_config()
        get = lambda name: getattr(text, name, None)  # noqa: E731
    return {"params": int(sum(p.numel() for p in params)), "bytes_per_param": params[0].element_size(),
            "layers": int(get("num_hidden_layers") or get("n_layer") or 1),
            "vocab": int(get("vocab_size") or 0), "device": params[0].device.type}


def prior_seconds(shape: dict, n: np.ndarray) -> np.ndarray:
    """A forward's cost over n tokens from the model's shape alone: max(weight reads, flops) + launches.

    On a GPU the weights' read time dominates up to hundreds of tokens (a flat curve); on a CPU the flops
    overtake it within a few tokens (a steep one). Example: 1.2e9 bf16 parameters on "cuda": reads
    1.2 ms, flops 8 us per token -> flat up to ~150 tokens.
    """
    bandwidth, flops, per_layer = DEVICE_PRIOR.get(shape["device"], DEVICE_PRIOR["cpu"])
    n = np.asarray(n, dtype=np.float64)
    reads = shape["params"] * shape["bytes_per_param"] / bandwidth
    return np.maximum(reads, 2.0 * shape["params"] * n / flops) + per_layer * shape["layers"]


def quick_curve(seconds_of: Callable[[int], float], max_n: int, prior: np.ndarray, sizes=None) -> CostCurve:
    """The prior (seconds float [max_n + 1], index = n) corrected by a few timed forwards.

    sizes: the sizes that may be timed (default all); the smallest, the largest and one near 8 are.
    Between them the measured/prior ratio is interpolated, so the curve keeps the prior's shape.
    """
    allowed = sorted(s for s in (sizes or range(1, max_n + 1)) if s <= max_n)
    grid = sorted({allowed[0], allowed[-1], min(allowed, key=lambda s: abs(s - QUICK_SIZES[1]))})
    # Largest first (its allocations serve the smaller ones); each size twice, the least kept: noise only
    # ever adds time, and one slow reading would price a whole range of drafts out for good (the policy
    # only re-measures the sizes it uses).
    measured = {n: seconds_of(n) for n in reversed(grid)}
    measured = {n: min(measured[n], seconds_of(n)) for n in reversed(grid)}
    ratio = np.interp(np.arange(max_n + 1), grid, np.array([measured[n] for n in grid]) / prior[grid])
    return CostCurve(np.arange(1, max_n + 1), (prior * ratio)[1:], max_n)


def measure_relative(seconds_of: Callable[[int], float], max_w: int) -> np.ndarray:
    """Cost of widths 0..max_w relative to width 1, float [max_w + 1] (width 0: inf)."""
    widths = sorted({w for w in SIZES if w <= max_w} | {max_w})
    seconds_of(widths[-1])  # warm-up
    # The least of a few runs is the estimate (three for the denominator).
    measured = np.array([min(seconds_of(w) for _ in range(3 if w == 1 else 2 if w == 2 else 1)) for w in widths])
    relative = np.interp(np.arange(max_w + 1), widths, measured / measured[0])
    relative[0] = np.inf
    return relative


def quick_relative(seconds_of: Callable[[int], float], max_w: int, prior: np.ndarray) -> np.ndarray:
    """`measure_relative` from a prior (seconds of a batch's forward at widths 0..max_w, e.g. the shape prior of
    rows x w tokens) corrected by a few timed widths (`quick_curve`)."""
    seconds = quick_curve(seconds_of, max_w, prior).shape
    return np.concatenate([[np.inf], seconds[1:] / seconds[1]])


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

    def __init__(self, cache_dir: str | os.PathLike | None = None, *, full: bool = False):
        """cache_dir: where curves persist (default: $LOOKUP_DECODE_COST_CACHE if set, else nowhere; "off" =
        nowhere); full: time every size in SIZES on a cold start instead of the prior + QUICK_SIZES."""
        self._lock = threading.Lock()
        self._by_model: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
        self.disk = DiskCache(cache_dir)
        self.full = full

    @staticmethod
    def key(model, rows: int, bucketed: bool = False) -> tuple:
        p = next(model.parameters())
        return str(p.device), str(p.dtype), int(rows), bool(bucketed)

    def curve(self, model, max_n: int, seconds_of: Callable[[int], float], *, bucketed: bool = False,
              sizes=None, fit: int | None = None) -> CostCurve:
        """The live curve of one sequence (up to max(max_n, 33) tokens): known, cached on disk, or the
        shape prior corrected by a few forwards (`quick_curve`; `full=True` models time the whole grid).

        fit: the widest forward this call can run (its context and max_length); nothing wider is timed,
        since a forward past a model's positions is an index error (on CUDA one that poisons the process).
        """
        if fit is not None:
            max_n = min(max_n, fit)
            sizes = None if sizes is None else [n for n in sizes if n <= fit] or [max_n]
        key = self.key(model, 1, bucketed)
        with self._lock:
            known = self._by_model.setdefault(model, {})
            if key in known and known[key].max_n >= max_n:
                return known[key]
            top = max(max_n, MIN_CALIBRATED) if fit is None else min(max(max_n, MIN_CALIBRATED), fit)
            stored = self.disk.load(model, key)
            if stored is not None and len(stored) >= top + 1:
                curve = CostCurve(np.arange(1, len(stored)), stored[1:], len(stored) - 1)
            elif self.full:
                curve = measure_curve(seconds_of, top, sizes)
            else:
                curve = quick_curve(seconds_of, top, prior_seconds(shape_of(model), np.arange(top + 1)), sizes)
            self.disk.store(model, key, curve.shape)
            known[key] = curve
            return curve

    def batch(self, model, rows: int, max_w: int, seconds_of: Callable[[int], float],
              fit: int | None = None) -> BatchCost:
        """Relative costs of widths 1..max_w for `rows` rows: known, cached on disk, or the shape prior corrected
        by a few forwards of this batch (`full=True`: the whole grid timed). fit: as in curve."""
        max_w = max_w if fit is None else min(max_w, fit)
        key = self.key(model, rows)
        with self._lock:
            known = self._by_model.setdefault(model, {})
            if key not in known or len(known[key]) < max_w + 1:
                stored = self.disk.load(model, key)
                if stored is not None and len(stored) >= max_w + 1:
                    known[key] = stored
                else:
                    known[key] = (measure_relative(seconds_of, max_w) if self.full else quick_relative(
                        seconds_of, max_w, prior_seconds(shape_of(model), rows * np.arange(max_w + 1))))
                    self.disk.store(model, key, known[key])
            return BatchCost(known[key][: max_w + 1])

    def save(self, model, cost) -> None:
        """Store a live curve's current (online-refined) shape for the next process, once it has seen
        SAVE_EVERY more steps since it was last stored (a file write per call would be waste); others are ignored."""
        if not isinstance(cost, CostCurve) or cost.observed - cost.saved_at < SAVE_EVERY:
            return
        cost.saved_at = cost.observed
        with self._lock:
            for key, known in self._by_model.get(model, {}).items():
                if known is cost:
                    self.disk.store(model, key, cost.shape * cost.scale)

    def known(self, model) -> dict:
        """What was measured for `model`: key -> CostCurve or relative costs (a copy of the table)."""
        with self._lock:
            return dict(self._by_model.get(model, {}))

    def reset(self, model=None, *, disk: bool = False) -> None:
        """Forget every measurement (or those of one model); disk=True also deletes the cached curves
        (all of them, whatever the model). The next call calibrates again."""
        with self._lock:
            if model is None:
                self._by_model = weakref.WeakKeyDictionary()
            else:
                self._by_model.pop(model, None)
            if disk:
                self.disk.clear()


class DiskCache:
    """Cost curves in files, one per (model shape, device, dtype, rows, bucketed, torch version).

    The model is identified by its config (architecture and sizes; weights do not change a forward's
    cost) and the device by name (a GPU's model, or the CPU's thread count). The folder is read at each
    use: `$LOOKUP_DECODE_COST_CACHE` may change between calls (tests point it at tmp_path).
    """

    def __init__(self, folder: str | os.PathLike | None = None):
        self.folder = folder

    def path(self) -> Path | None:
        folder = self.folder if self.folder is not None else os.environ.get(CACHE_ENV)
        return None if folder is None or str(folder).lower() in ("off", "") else Path(folder)

    @staticmethod
    def name(model, key: tuple) -> str:
        cfg = getattr(model, "config", None)
        config = cfg.to_json_string(use_diff=False) if hasattr(cfg, "to_json_string") else type(model).__name__
        device = torch.device(key[0])
        where = (torch.cuda.get_device_name(device) if device.type == "cuda"
                 else f"{device.type}-{torch.get_num_threads()}threads")
        text = json.dumps([config, where, key[1:], torch.__version__])
        return hashlib.sha256(text.encode()).hexdigest()[:24] + ".json"

    def load(self, model, key: tuple) -> np.ndarray | None:
        folder = self.path()
        if folder is None:
            return None
        try:
            values = json.loads((folder / self.name(model, key)).read_text())["seconds"]
            return np.array([np.inf if v is None else v for v in values], dtype=np.float64)
        except (OSError, ValueError, KeyError, TypeError):
            return None       # absent or unreadable: measure again

    def store(self, model, key: tuple, seconds: np.ndarray) -> None:
        folder = self.path()
        if folder is None:
            return
        try:
            folder.mkdir(parents=True, exist_ok=True)
            values = [None if not np.isfinite(v) else float(v) for v in seconds]
            tmp = folder / f".{os.getpid()}.{threading.get_ident()}.tmp"
            tmp.write_text(json.dumps({"key": [str(k) for k in key], "seconds": values}))
            os.replace(tmp, folder / self.name(model, key))     # atomic: readers never see half a file
        except OSError:
            pass              # a read-only home must not break decoding

    def clear(self) -> None:
        folder = self.path()
        if folder is not None and folder.is_dir():
            for f in folder.glob("*.json"):
                f.unlink(missing_ok=True)


COSTS = CostModel()
