"""What a verify forward costs: seconds of one forward over `rows` rows of w tokens each, w = 1..max_w.

The model it fits: a forward's time is a smooth function of its width, the curve's seconds per width
(`per_width`), times a *scale* that drifts as the context grows. One `CostCurve` holds both for one number
of rows. The seconds per width come from measurements, never from an assumption: on a CPU they rise
steeply and not even monotonically, on a GPU they are nearly flat up to tens of tokens. Every real step of
the same rows refines the curve: the scale moves slowly (it shifts every width at once), the width just
used faster. The draft policy only compares the costs of widths against each other, so the scale matters
for modelled times (replays), not for choices.

Two ways to build a curve besides its points (`CostCurve(widths, seconds, max_w)`):
* `CostCurve.from_timings(seconds_of, max_w)`: time a grid of widths (SIZES);
* `CostCurve.from_prior(prior, seconds_of, max_w)`: a prior curve (`prior_seconds` of the model's size,
  `model_size`: parameters, layers and device) corrected by a few timed widths (QUICK_SIZES): a cold start
  costs six forwards, not a grid.

`CostModel` owns the calibrations (thread-safe, per model, device, dtype and rows, forgotten with the
model); every call of lookup decoding uses `COSTS` unless given another, and `COSTS.reset()` forgets. One
sequence shares one live curve across calls; a batch gets its own copy (its scale is its own rows' and
context's). Curves can persist on disk (`DiskCache`, opt-in: `$LOOKUP_DECODE_COST_CACHE`), off by default:
a curve measured on a busy machine would persist, and one that prices drafts out is never corrected (a
step that does not draft only re-times width 1; benchmarks/results/forced_replay/README.md).
`sync` and `timed` are the device-aware clock that such timings (and the benchmarks') read.

The cost of an engine step that lookup decoding does not run itself (vLLM's) is `core/step_cost.py`.

Every error here is a ValueError.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

EMA = 0.2
# Widths (tokens per row) timed by `from_timings`; costs in between are interpolated.
SIZES = (1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 64)
MIN_CALIBRATED = 33     # one sequence is calibrated at least this far, so a later call with a larger k reuses it
# Widths a cold start times (twice each: 6 forwards after the prefill): the prior is corrected at these.
QUICK_SIZES = (1, 8, MIN_CALIBRATED)
CACHE_ENV = "LOOKUP_DECODE_COST_CACHE"
SAVE_EVERY = 64         # steps a live curve observes between two writes of it to the disk cache
# Rough device figures for the prior (only how it grows with width matters: measured forwards set its scale).
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
    """Seconds of one forward over `rows` rows of w tokens each, w = 1..max_w: `per_width` times a live scale.

    widths, seconds: measured points (int [m], float [m] > 0); widths in between are interpolated.
    Example: CostCurve([1, 9], [0.010, 0.018], 9)(5) -> 0.014.
    """

    def __init__(self, widths, seconds, max_w: int, *, rows: int = 1):
        widths = np.asarray(widths, dtype=np.float64)
        seconds = np.asarray(seconds, dtype=np.float64)
        if len(widths) == 0 or len(widths) != len(seconds) or not np.all(seconds > 0):
            raise ValueError("a cost curve needs one positive number of seconds per measured width")
        self.max_w, self.rows = int(max_w), int(rows)
        self.per_width = np.interp(np.arange(self.max_w + 1), widths, seconds)  # [max_w + 1], index = width
        self.per_width[0] = np.inf          # a forward of no tokens is never a choice
        self.scale = 1.0
        self.observed = self.saved_at = 0  # steps observed; the count when last written to disk
        self._lock = threading.Lock()     # one curve serves every call (and thread) on its model

    @classmethod
    def from_timings(cls, seconds_of: Callable[[int], float], max_w: int, sizes=None, *, rows: int = 1) -> "CostCurve":
        """Time `seconds_of(w)` at every width of `sizes` up to max_w (default SIZES, and max_w itself)."""
        grid = sorted(set(sizes or [w for w in SIZES if w <= max_w]) | {max_w})
        seconds_of(grid[-1])  # warm-up: first use of a width allocates
        # Noise only ever adds time: the least of a few runs for the small widths the ratios hinge on.
        seconds = [min(seconds_of(w) for _ in range(3 if w == 1 else 2 if w == 2 else 1)) for w in grid]
        return cls(grid, seconds, max_w, rows=rows)

    @classmethod
    def from_prior(cls, prior: np.ndarray, seconds_of: Callable[[int], float], max_w: int, sizes=None, *,
                   rows: int = 1) -> "CostCurve":
        """The prior (seconds float [max_w + 1], index = width) corrected by a few timed widths.

        sizes: the widths that may be timed (default all); the smallest, the largest and one near 8 are.
        Between them the measured/prior ratio is interpolated, so the curve keeps the prior's form.
        """
        allowed = sorted(s for s in (sizes or range(1, max_w + 1)) if s <= max_w)
        grid = sorted({allowed[0], allowed[-1], min(allowed, key=lambda s: abs(s - QUICK_SIZES[1]))})
        # Widest first (its allocations serve the others); each twice, the least kept: noise only ever adds
        # time, and one slow reading would price a whole range of drafts out for good (the policy only
        # re-measures the widths it uses).
        measured = {w: seconds_of(w) for w in reversed(grid)}
        measured = {w: min(measured[w], seconds_of(w)) for w in reversed(grid)}
        prior = np.asarray(prior, dtype=np.float64)
        ratio = np.interp(np.arange(max_w + 1), grid, np.array([measured[w] for w in grid]) / prior[grid])
        return cls(np.arange(1, max_w + 1), (prior * ratio)[1:], max_w, rows=rows)

    def __call__(self, w: int) -> float:
        if not 1 <= w <= self.max_w:
            raise ValueError(f"cost of width {w} asked, but the curve covers widths 1..{self.max_w}")
        return float(self.per_width[w] * self.scale)

    def prices(self, max_w: int) -> np.ndarray:
        """float64 [max_w]: the cost of widths 1..max_w, as __call__ gives them one by one."""
        if max_w > self.max_w:
            raise ValueError(f"cost of width {max_w} asked, but the curve covers widths 1..{self.max_w}")
        return self.per_width[1: max_w + 1] * self.scale

    def seconds(self) -> np.ndarray:
        """float64 [max_w + 1]: the curve as it stands (index = width; index 0 is inf)."""
        return self.per_width * self.scale

    def observe(self, rows: int, w: int, seconds: float) -> None:
        """Learn from a real forward of `rows` rows of width w. Another number of rows is another curve:
        ignored (a batch whose rows finish keeps the curve of more rows, which prices drafts conservatively)."""
        if rows != self.rows or not 1 <= w <= self.max_w or seconds <= 0:
            return
        with self._lock:
            self.observed += 1
            self.scale *= 1.0 + 0.25 * EMA * (seconds / self(w) - 1.0)
            self.per_width[w] += EMA * (seconds / self.scale - self.per_width[w])

    def copy(self) -> "CostCurve":
        curve = CostCurve([1], [1.0], self.max_w, rows=self.rows)
        curve.per_width, curve.scale = self.per_width.copy(), self.scale
        return curve


def model_size(model) -> dict:
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


def prior_seconds(size: dict, n: np.ndarray) -> np.ndarray:
    """A forward's cost over n tokens (all rows together) from the model's size alone (`model_size`): max(weight
    reads, flops) + launches.

    On a GPU the weights' read time dominates up to hundreds of tokens (a flat curve); on a CPU the flops
    overtake it within a few tokens (a steep one). Example: 1.2e9 bf16 parameters on "cuda": reads
    1.2 ms, flops 8 us per token -> flat up to ~150 tokens.
    """
    bandwidth, flops, per_layer = DEVICE_PRIOR.get(size["device"], DEVICE_PRIOR["cpu"])
    n = np.asarray(n, dtype=np.float64)
    reads = size["params"] * size["bytes_per_param"] / bandwidth
    return np.maximum(reads, 2.0 * size["params"] * n / flops) + per_layer * size["layers"]


class CostModel:
    """Measured forward costs per model, keyed by (device, dtype, rows, bucketed sizes).

    One sequence keeps one live `CostCurve` per key that every call refines; a batch gets a copy of its
    rows' curve. Entries go with their model (weak keys); `reset()` forgets.
    """

    def __init__(self, cache_dir: str | os.PathLike | None = None, *, full: bool = False):
        """cache_dir: where curves persist (default: $LOOKUP_DECODE_COST_CACHE if set, else nowhere; "off" =
        nowhere); full: time the whole grid (`from_timings`) on a cold start instead of `from_prior`."""
        self._lock = threading.Lock()
        self._by_model: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
        self.disk = DiskCache(cache_dir)
        self.full = full

    @staticmethod
    def key(model, rows: int, bucketed: bool = False) -> tuple:
        p = next(model.parameters())
        return str(p.device), str(p.dtype), int(rows), bool(bucketed)

    def curve(self, model, max_w: int, seconds_of: Callable[[int], float], *, rows: int = 1, bucketed: bool = False,
              sizes=None, fit: int | None = None) -> CostCurve:
        """The cost curve of `rows` rows up to width max_w: known, cached on disk, or built now (`from_prior`,
        or `from_timings` when full=True) with `seconds_of(w)` timing one forward of width w.

        One sequence (rows=1) is calibrated to at least MIN_CALIBRATED and its curve is the live one every
        call refines; a batch gets a copy. fit: the widest forward this call can run (its context and
        max_length); nothing wider is timed, since a forward past a model's positions is an index error (on
        CUDA one that poisons the process).
        """
        live = rows == 1
        if fit is not None:
            max_w = min(max_w, fit)
            sizes = None if sizes is None else [w for w in sizes if w <= fit] or [max_w]
        top = max(max_w, MIN_CALIBRATED) if live else max_w
        top = top if fit is None else min(top, fit)
        key = self.key(model, rows, bucketed)
        with self._lock:
            known = self._by_model.setdefault(model, {})
            if key not in known or known[key].max_w < max_w:
                stored = self.disk.load(model, key)
                if stored is not None and len(stored) >= top + 1:
                    curve = CostCurve(np.arange(1, len(stored)), stored[1:], len(stored) - 1, rows=rows)
                elif self.full:
                    curve = CostCurve.from_timings(seconds_of, top, sizes, rows=rows)
                else:
                    prior = prior_seconds(model_size(model), rows * np.arange(top + 1))
                    curve = CostCurve.from_prior(prior, seconds_of, top, sizes, rows=rows)
                self.disk.store(model, key, curve.seconds())
                known[key] = curve
            return known[key] if live else known[key].copy()

    def save(self, model, cost) -> None:
        """Store a live curve's current (online-refined) seconds for the next process, once it has seen
        SAVE_EVERY more steps since it was last stored (a file write per call would be waste); a copy (a
        batch's) or None is ignored."""
        if not isinstance(cost, CostCurve) or cost.observed - cost.saved_at < SAVE_EVERY:
            return
        cost.saved_at = cost.observed
        with self._lock:
            for key, known in self._by_model.get(model, {}).items():
                if known is cost:
                    self.disk.store(model, key, cost.seconds())

    def known(self, model) -> dict:
        """What was measured for `model`: key -> CostCurve (a copy of the table)."""
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
    """Cost curves in files, one per (model config, device, dtype, rows, bucketed, torch version).

    The model is identified by its config (architecture and sizes; weights do not change a forward's
    cost) and the device by name (a GPU's model, or the CPU's thread count). The folder is read at each
    use: `$LOOKUP_DECODE_COST_CACHE` may change between calls (tests point it at tmp_path).
    """

    FORMAT = 2              # in every file name: files of another format (relative batch costs) are not read

    def __init__(self, folder: str | os.PathLike | None = None):
        self.folder = folder

    def path(self) -> Path | None:
        folder = self.folder if self.folder is not None else os.environ.get(CACHE_ENV)
        return None if folder is None or str(folder).lower() in ("off", "") else Path(folder)

    @classmethod
    def name(cls, model, key: tuple) -> str:
        cfg = getattr(model, "config", None)
        config = cfg.to_json_string(use_diff=False) if hasattr(cfg, "to_json_string") else type(model).__name__
        device = torch.device(key[0])
        where = (torch.cuda.get_device_name(device) if device.type == "cuda"
                 else f"{device.type}-{torch.get_num_threads()}threads")
        text = json.dumps([config, where, key[1:], torch.__version__, cls.FORMAT])
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
