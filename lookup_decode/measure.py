"""Measurement: the ways of generating (variants), timed runs interleaved per prompt, the loop score, spreads and
ratios, and the environment and command line stored next to every number.

`lookup-decode bench` (`cli/bench.py`) measures with these, and so do the repository's `benchmarks/`.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import lookup_decode
from lookup_decode.core.config import LookupConfig
from lookup_decode.core.cost import calibrating_tokens, sync
from lookup_decode.core.stats import DecodeStats
from lookup_decode.engines.hf.hook import forget_acceptance

LOOP_THRESHOLD = 0.5      # loop score above which an output counts as loop-dominated


# ------------------------------------------------------------------------------ running variants

@dataclass
class Variant:
    """One way of generating: plain, transformers' prompt lookup, or lookup_decode with options."""
    name: str
    lookup: dict | None = None                               # lookup_decode options (k, min_match, tree_width, ...)
    generate_kwargs: dict = field(default_factory=dict)      # extra model.generate kwargs

    def describe(self) -> str:
        opts = self.lookup if self.lookup is not None else self.generate_kwargs
        return self.name + (" (" + ", ".join(f"{k}={v}" for k, v in opts.items()) + ")" if opts else "")


PLAIN = Variant("plain")
PROMPT_LOOKUP = Variant("prompt_lookup", generate_kwargs={"prompt_lookup_num_tokens": 10})


@dataclass
class Run:
    """One timed generation."""
    variant: str
    tokens: list[int]                 # new tokens only
    seconds: float
    stats: DecodeStats | None = None  # lookup_decode variants only

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


def timed_generate(model, input_ids, lookup: dict | None = None, **generate_kwargs):
    """(output, seconds, stats) of one model.generate call, timed with device syncs.

    lookup: None for plain generate, else lookup_decode options (a DecodeStats is filled and returned).
    """
    stats = DecodeStats() if lookup is not None else None
    if lookup is not None:
        generate_kwargs.update(custom_generate=lookup_decode.generate, stats=stats, **lookup)
    sync(input_ids.device)
    start = time.perf_counter()
    out = model.generate(input_ids, **generate_kwargs)
    sync(input_ids.device)
    return out, time.perf_counter() - start, stats


def run_variant(model, input_ids, variant: Variant, max_new_tokens: int) -> Run:
    """Generation of up to max_new_tokens after input_ids (long [1, T]), timed with device syncs.
    Greedy unless variant.generate_kwargs asks for sampling."""
    import torch
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(input_ids))
    kwargs.update(variant.generate_kwargs)      # may switch to sampling (do_sample, temperature, ...)
    out, seconds, stats = timed_generate(model, input_ids, variant.lookup, **kwargs)
    return Run(variant.name, out[0, input_ids.shape[1]:].tolist(), seconds, stats)


def warm_up(model, input_ids, variant: Variant, max_new_tokens: int) -> None:
    """An untimed run of `variant` that leaves nothing one-time to its timed runs of up to max_new_tokens:
    first-use allocations, numba's compilation and lookup decoding's forward-cost calibration of every width a
    timed run verifies (`cost.calibrating_tokens`). What it taught the acceptance model is forgotten: it decoded the
    start of a timed run's own answer, and a fresh process's first call knows nothing of it."""
    k = (variant.lookup or {}).get("k", LookupConfig.k)
    run_variant(model, input_ids, variant, min(max_new_tokens, 4 if variant.lookup is None else calibrating_tokens(k)))
    if variant.lookup is not None:
        forget_acceptance(model)


def interleaved_order(variants: list[str], repeats: int, offset: int = 0) -> list[tuple[int, str]]:
    """(repeat, variant) pairs for one prompt: every variant once per repeat, the order rotated by one
    each repeat (and by `offset`, e.g. the prompt index), so no variant always runs first or right
    after the same neighbour.

    Example: interleaved_order(["a", "b", "c"], 2) -> [(0, a), (0, b), (0, c), (1, b), (1, c), (1, a)]
    """
    shifts = [(r + offset) % max(len(variants), 1) for r in range(repeats)]
    return [(r, v) for r, shift in enumerate(shifts) for v in variants[shift:] + variants[:shift]]


# ---------------------------------------------------------------------------------------- metrics

def loop_score(tokens, n: int = 8) -> float:
    """Share of the tokens covered by an n-gram that already occurred earlier in the same sequence.

    A repetition loop scores near 1; ordinary text near 0. Loop-dominated outputs are easy to draft
    and must not carry a speed claim. Example (n=3): [1,2,3,1,2,3,1,2,3] -> the 3-grams starting at
    3..6 repeat earlier ones, covering positions 3..8 -> 6/9.
    """
    tokens = [int(t) for t in tokens]
    if len(tokens) < n or n < 1:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    covered = np.zeros(len(tokens), dtype=bool)
    for j in range(len(tokens) - n + 1):
        gram = tuple(tokens[j:j + n])
        if gram in seen:
            covered[j:j + n] = True
        else:
            seen.add(gram)
    return float(covered.mean())


def spread(values: Iterable[float]) -> dict:
    """n, median, quartiles (linear interpolation) and range; None for all but n when empty."""
    v = np.asarray([float(x) for x in values], dtype=np.float64)
    if v.size == 0:
        return {"n": 0, "median": None, "q1": None, "q3": None, "min": None, "max": None}
    q1, med, q3 = np.percentile(v, [25, 50, 75])
    return {"n": int(v.size), "median": float(med), "q1": float(q1), "q3": float(q3),
            "min": float(v.min()), "max": float(v.max())}


def speedup(base: tuple[int, float], other: tuple[int, float]) -> float:
    """Tokens/s of `other` over tokens/s of `base`, each given as (tokens, seconds)."""
    (bt, bs), (ot, os_) = base, other
    return (ot / os_) / (bt / bs)


def throughput_ratio(base: list[tuple[int, float]], other: list[tuple[int, float]]) -> float:
    """Ratio of total throughputs (sum of tokens / sum of seconds) over several prompts; long prompts weigh more."""
    return speedup((sum(t for t, _ in base), sum(s for _, s in base)),
                   (sum(t for t, _ in other), sum(s for _, s in other)))


def command_line() -> str:
    """The command that is running, re-runnable from the current folder (`python -m pkg.mod ...` or the script)."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        head = ["python", "-m", spec.name]
    else:
        script = Path(sys.argv[0])
        with contextlib.suppress(ValueError):
            script = Path(os.path.relpath(script))
        head = [script.name] if script.suffix != ".py" else ["python", str(script)]
    return shlex.join(head + sys.argv[1:])


def environment(model=None, device: str = "cpu", threads: int | None = None, model_path=None) -> dict:
    """Versions, hardware and settings to store next to every published number.

    model_path: what was loaded (None = the default model; its GGUF file name is recorded).
    """
    import numba
    import torch
    import transformers

    from lookup_decode.engines.hf.models import bf16_native, default_gguf
    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "numba": numba.__version__, "numpy": np.__version__, "lookup_decode": lookup_decode.__version__,
           "platform": platform.platform(), "cpu": _cpu_name(), "cpu_count": _cpu_count(),
           "torch_threads": torch.get_num_threads(), "threads_flag": threads, "device": device,
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
           "bf16_native": bf16_native(device), "command": command_line()}
    if model is not None:
        env.update(dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
                   model=str(model_path if model_path is not None else default_gguf().name),
                   model_class=type(model).__name__)
    return env


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _cpu_count() -> int | None:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


# ------------------------------------------------------------------------ measuring prompts

def measure(model, prompts, variants: list[Variant], max_new_tokens: int, repeats: int, progress, *,
            results: str | Path | None = None, ids: list[str] | None = None) -> list[dict[str, Run]]:
    """Per prompt: the run of each variant with the median time over repeats, interleaved.

    results: a JSONL file that gets one line per run as soon as it is measured (flushed), so a run that
    fails half way (out of memory, Ctrl-C) keeps everything measured before; ids name the requests."""
    out = []
    with open(results, "a", encoding="utf-8") if results is not None else contextlib.nullcontext() as sink:
        for i, ids_i in enumerate(prompts):
            runs: dict[str, list[Run]] = {v.name: [] for v in variants}
            by_name = {v.name: v for v in variants}
            for _, name in interleaved_order(list(by_name), repeats, offset=i):
                run = run_variant(model, ids_i, by_name[name], max_new_tokens)
                runs[name].append(run)
                if sink is not None:
                    row = {"request": ids[i] if ids else i, "variant": name, "new_tokens": len(run.tokens),
                           "seconds": run.seconds, "tokens": run.tokens,
                           "stats": run.stats.as_dict() if run.stats is not None else None}
                    sink.write(json.dumps(row) + "\n")
                    sink.flush()
                progress()
            out.append({name: sorted(rs, key=lambda r: r.seconds)[len(rs) // 2] for name, rs in runs.items()})
    return out


def compare(measured: list[dict[str, Run]], name: str) -> dict:
    """Variant `name` against plain over the measured prompts: speed-ups, identical outputs, acceptance and the
    acceptance model's calibration (stats of every prompt's run merged)."""
    pairs = [((len(m["plain"].tokens), m["plain"].seconds), (len(m[name].tokens), m[name].seconds)) for m in measured]
    ratios = [speedup(b, o) for b, o in pairs]
    loops = [loop_score(m["plain"].tokens) > LOOP_THRESHOLD for m in measured]
    stats = DecodeStats()
    for m in measured:
        stats.merge(m[name].stats)
    clean = [r for r, loop in zip(ratios, loops) if not loop]
    return {"speedup": spread(ratios),
            "throughput_ratio": throughput_ratio([b for b, _ in pairs], [o for _, o in pairs]),
            "speedup_without_loops": spread(clean), "loop_dominated": sum(loops),
            "identical": sum(m[name].tokens == m["plain"].tokens for m in measured), "n": len(measured),
            "tokens_per_second": spread(m[name].tokens_per_second for m in measured),
            "mean_accepted_length": stats.mean_accepted_length, "acceptance_rate": stats.acceptance_rate,
            # the acceptance model's reliability table over all prompts: per bin of predicted probability, the
            # draft tokens sent, their mean prediction and the share kept (`DecodeStats.calibration`)
            "calibration": [r._asdict() for r in stats.calibration()],
            "calibration_error": stats.reliability.error()}
