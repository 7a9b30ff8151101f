"""What a verify forward costs: seconds of one forward over `rows` rows of w tokens each, w = 1..max_w.

The model it fits: a forward's time is a smooth function of its width, the curve's seconds per width
(`per_width`), times a *scale* that drifts as the context grows. One `CostCurve` holds both for one number
of rows. The seconds per width come from measurements, never from an assumption: on a CPU they rise
steeply and not even monotonically, on a GPU they are nearly flat up to tens of tokens. Every real step of
the same rows refines the curve: the scale moves slowly (it shifts every width at once), the width just
used faster. The draft policy only compares the costs of widths against each other, so the scale matters
for modelled times (replays), not for choices.

A cold start times the curve (`CostCurve.from_timings`): widths 1, 2, 4, 8, ... up to the widest needed
(GRID), each twice (the least kept: noise only ever adds time), interpolated in between. No assumption about
the device or dtype enters: the same code finds a 16-token forward at 1.9x a 1-token one for a 135M model in
float32 on a 2-core CPU and at 1.1x for a 0.5B model in bfloat16 on the same CPU (native bf16), and a nearly
flat curve on a GPU (expected there, not measured by us), and the draft policy drafts long exactly where the
curve says it is nearly free.

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

import contextlib
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
MIN_CALIBRATED = 33     # one sequence is calibrated at least this far, so a later call with a larger k reuses it
# Widths (tokens per row) a cold start times, below the widest (which is always timed): a 1-token forward and the
# powers of two, where CPU curves bend (bf16 kernels can make 4 tokens cheaper than 1). In between: interpolated.
GRID = (1, 2, 4, 8, 16, 32, 64, 128)
CACHE_ENV = "LOOKUP_DECODE_COST_CACHE"
SAVE_EVERY = 64         # steps a live curve observes between two writes of it to the disk cache


def calibrating_tokens(k: int) -> int:
    """max_new_tokens of a warm-up call after which a call of up to k draft tokens finds every width it verifies
    already timed. A call times only the widths it can run (up to max_new_tokens - 1: `curve`'s fit), so a 4-token
    warm-up left the calibration (~0.7 s for a 135M model on 2 CPU cores) to the first call that was timed."""
    return max(k + 1, MIN_CALIBRATED) + 1


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


def calibration_widths(max_w: int, sizes=None) -> list[int]:
    """The widths a cold start times: max_w and GRID up to 3/4 of it (one closer to max_w adds a forward and
    little shape: 33 times 1, 2, 4, 8, 16, 33); or, where only some widths may run (sizes: a compiled forward's
    buckets), those up to max_w (wider ones cost what the widest timed does)."""
    if sizes:
        return sorted({int(w) for w in sizes if 1 <= w <= max_w}) or [1]
    return sorted({w for w in GRID if 4 * w <= 3 * max_w} | {int(max_w)})


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
        """Time `seconds_of(w)` at the widths `calibration_widths(max_w, sizes)` and interpolate between them.

        Widest first (its allocations serve the others), each width twice and the least kept: noise only ever
        adds time, and one slow reading would price a whole range of drafts out for good (the policy only
        re-measures the widths it uses). Example: max_w 33 times 1, 2, 4, 8, 16, 33: 12 forwards.
        """
        grid = calibration_widths(max_w, sizes)
        measured = {w: seconds_of(w) for w in reversed(grid)}
        measured = {w: min(measured[w], seconds_of(w)) for w in reversed(grid)}
        return cls(grid, [measured[w] for w in grid], max_w, rows=rows)

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


class CostModel:
    """Measured forward costs per model, keyed by (device, dtype, rows, bucketed sizes).

    One sequence keeps one live `CostCurve` per key that every call refines; a batch gets a copy of its
    rows' curve. Entries go with their model (weak keys); `reset()` forgets.
    """

    def __init__(self, cache_dir: str | os.PathLike | None = None):
        """cache_dir: where curves persist (default: $LOOKUP_DECODE_COST_CACHE if set, else nowhere; "off" =
        nowhere)."""
        self._lock = threading.Lock()
        self._by_model: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
        self.disk = DiskCache(cache_dir)

    @staticmethod
    def key(model, rows: int, bucketed: bool = False) -> tuple:
        p = next(model.parameters())
        return str(p.device), str(p.dtype), int(rows), bool(bucketed)

    def curve(self, model, max_w: int, seconds_of: Callable[[int], float], *, rows: int = 1, bucketed: bool = False,
              sizes=None, fit: int | None = None) -> CostCurve:
        """The cost curve of `rows` rows up to width max_w: known, cached on disk, or timed now (`from_timings`)
        with `seconds_of(w)` timing one forward of width w (sizes: the widths that may be timed).

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
                else:
                    curve = CostCurve.from_timings(seconds_of, top, sizes, rows=rows)
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

    FORMAT = 3              # in every file name: files of another format are not read (2: the shape prior's curves)

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
        with contextlib.suppress(OSError):          # a read-only home must not break decoding
            folder.mkdir(parents=True, exist_ok=True)
            values = [None if not np.isfinite(v) else float(v) for v in seconds]
            tmp = folder / f".{os.getpid()}.{threading.get_ident()}.tmp"
            tmp.write_text(json.dumps({"key": [str(k) for k in key], "seconds": values}))
            os.replace(tmp, folder / self.name(model, key))     # atomic: readers never see half a file

    def clear(self) -> None:
        folder = self.path()
        if folder is not None and folder.is_dir():
            for f in folder.glob("*.json"):
                f.unlink(missing_ok=True)


COSTS = CostModel()
