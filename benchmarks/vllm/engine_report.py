"""The engine study's report (`benchmarks/vllm/engine.py` runs it): per cell the medians with spread over repeats,
lookup_decode's paired ratios, the drafter's counters and calibration, the issue's goals, and the Markdown.

Everything here works on the saved result (`engine.json`): `python -m benchmarks.vllm.bench engine --from-json
FILE` re-renders it. Spreads are `lookup_decode.measure.spread`; calibration tables are the package's
`core.stats.Calibration` (cells store its three per-bin lists).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lookup_decode.core.stats import CALIBRATION_BINS, CALIBRATION_FIELDS, CALIBRATION_MIN_TOKENS, Calibration
from lookup_decode.measure import spread

# The method names the results use, in table order; MEMORY_METHODS remember outputs across requests (the run gives
# them a fresh engine per cell, so a cold cell is cold).
METHOD_ORDER = ("none", "ngram", "ngram_tuned", "suffix", "lookup_decode")
MEMORY_METHODS = {"suffix", "lookup_decode"}
OURS = "lookup_decode"
REFERENCE = "none"
NGRAMS = ("ngram", "ngram_tuned")
PHASES = ("cold", "again")
CODE_WORKLOADS = {"code_edit", "editeval", "aider_refactor"}     # "code edits" in the goals
CHAT_WORKLOADS = {"mt_bench"}                                    # "chat" in the goals


# ------------------------------------------------------------------------------------------- calibration

def calibration(value) -> Calibration | None:
    """A cell's stored calibration as a Calibration: its per-bin lists ({"tokens", "predicted", "kept"}), or the
    rows of results written before them ([{"bin_low", "bin_high", "tokens", "predicted" (mean), "kept"
    (share)}]); None stays None.
    Note for the lead: this is `Calibration.from_rows`, not in core.stats yet."""
    if value is None or isinstance(value, Calibration):
        return value
    if isinstance(value, dict):
        return Calibration(np.array([value.get(k, [0.0] * CALIBRATION_BINS) for k in CALIBRATION_FIELDS], np.float64))
    cal = Calibration()
    for r in value:
        i = min(int(round(r["bin_low"] * CALIBRATION_BINS)), CALIBRATION_BINS - 1)
        cal.table[:3, i] += (int(r["tokens"]), r["predicted"] * r["tokens"], round(r["kept"] * r["tokens"]))
    return cal


def _rows(cal: Calibration | None) -> list[dict] | None:
    """A calibration's non-empty bins as dicts (bin_low, bin_high, tokens, predicted (mean), kept (share))."""
    return None if cal is None else [r._asdict() for r in cal.rows()]


def calibration_total(values) -> Calibration | None:
    """The cells' calibrations merged (None if every one is None)."""
    cals = [calibration(v) for v in values if v is not None]
    if not cals:
        return None
    total = Calibration()
    for c in cals:
        total.merge(c)
    return total


# ------------------------------------------------------------------------------------------- summaries and goals

def spread_of(values) -> dict | None:
    """`lookup_decode.measure.spread` of the values that are not None; None when none is.

    Example: spread_of([3.0, None, 1.0, 2.0]) -> {"n": 3, "median": 2.0, "q1": 1.5, "q3": 2.5, "min": 1.0, "max": 3.0}
    """
    xs = [v for v in values if v is not None]
    return spread(xs) if xs else None


def _median(values):
    s = spread_of(values)
    return None if s is None else s["median"]


def _tok_s(c: dict) -> float | None:
    return c["output_tokens"] / c["wall_s"] if c["wall_s"] > 0 else None


def by_cell(runs: list[dict]) -> dict:
    """{(workload, batch, phase): {method: [cell, ...]}} over every engine's cells; each cell gets its run's
    "repeat". Cells without a phase (results before the cold/again split) count as cold."""
    out: dict = {}
    for run in runs:
        for c in run.get("cells", []):
            key = (c["workload"], c["batch"], c.get("phase", "cold"))
            out.setdefault(key, {}).setdefault(run["method"], []).append({**c, "repeat": run.get("repeat", 0)})
    return out


def reference_outputs(runs: list[dict]) -> dict:
    """{(workload, batch): {request index: token ids}}: no speculation's outputs (its first cold run per cell),
    else the first method's that ran the cell."""
    out: dict = {}
    for prefer in (True, False):
        for run in sorted(runs, key=lambda r: r.get("repeat", 0)):
            if prefer != (run["method"] == REFERENCE):
                continue
            for c in run.get("cells", []):
                if c.get("phase", "cold") == "cold":
                    out.setdefault((c["workload"], c["batch"]), c["tokens"])
    return out


def summarize(runs: list[dict]) -> dict:
    """{workload: {str(batch): {phase: {method: row}}}} from child results (each {"method", "repeat", "cells"} or
    {"method", "repeat", "error"}).

    row: repeats, requests, output_tokens (median), tok_s (`spread` over repeats of output tokens / wall
    seconds), tok_s_by_repeat, tpot_ms, steps, row_steps, tokens_per_step (tokens each request gained per engine
    step it emitted in: 1.0 without speculation), drafted / kept / wasted (vLLM's draft tokens, accepted, and their
    difference), acceptance_length (1 + accepted / drafts) -- medians over repeats; accepted_per_pos and
    preemptions summed; drafter_ms_mean, drafter_ms_p99 (the largest of the repeats') and drafter_ms_worst (per
    propose call), drafter_ms_per_step and drafter_share (propose seconds per engine step and over the steps' seconds);
    calibration (the drafter's table summed over repeats, None without one); identical (requests whose tokens equal
    the reference's in every repeat); for lookup_decode, vs: {method: `spread` of the paired ratios ours / it, one
    per repeat both ran}.
    """
    refs = reference_outputs(runs)
    out: dict = {}
    for (workload, batch, phase), methods in by_cell(runs).items():
        ref = refs.get((workload, batch))
        rows = {}
        for method, cells in sorted(methods.items(), key=lambda kv: METHOD_ORDER.index(kv[0])
                                    if kv[0] in METHOD_ORDER else len(METHOD_ORDER)):
            cells = sorted(cells, key=lambda c: c["repeat"])
            k = [c["counters"] for c in cells]
            proposes = sum(c["proposes"] for c in cells)
            propose_s = sum(c["propose_s"] for c in cells)
            steps = sum(c["steps"] for c in cells)
            step_s = sum(c["step_s"] for c in cells)
            worst = [c["propose_max_s"] for c in cells if c.get("propose_max_s") is not None]
            p99s = [c["propose_p99_s"] for c in cells if c.get("propose_p99_s") is not None]
            per_pos = [sum(x) for x in zip(*[c["accepted_per_pos"] for c in k if c["accepted_per_pos"]])]
            row = {"repeats": len(cells), "requests": len(cells[0]["tokens"]),
                   "output_tokens": _median([c["output_tokens"] for c in cells]),
                   "tok_s": spread_of([_tok_s(c) for c in cells]),
                   "tok_s_by_repeat": {str(c["repeat"]): _tok_s(c) for c in cells},
                   "tpot_ms": _median([None if c["tpot_s"] is None else 1e3 * c["tpot_s"] for c in cells]),
                   "steps": _median([c["steps"] for c in cells]),
                   "row_steps": _median([c["row_steps"] for c in cells]),
                   "tokens_per_step": _median([c["emitted"] / c["row_steps"] if c["row_steps"] else None
                                               for c in cells]),
                   "drafts": _median([x["drafts"] for x in k]),
                   "drafted": _median([x["draft_tokens"] for x in k]),
                   "kept": _median([x["accepted"] for x in k]),
                   "wasted": _median([x["draft_tokens"] - x["accepted"] for x in k]),
                   "acceptance_length": _median([1 + x["accepted"] / x["drafts"] if x["drafts"] else None
                                                 for x in k]),
                   "accepted_per_pos": per_pos, "preemptions": sum(x["preemptions"] for x in k),
                   "proposes": proposes,
                   "drafter_ms_mean": 1e3 * propose_s / proposes if proposes else None,
                   "drafter_ms_worst": 1e3 * max(worst) if worst and proposes else None,
                   "drafter_ms_p99": 1e3 * max(p99s) if p99s and proposes else None,
                   "drafter_ms_per_step": 1e3 * propose_s / steps if steps and proposes else None,
                   "drafter_share": propose_s / step_s if step_s and proposes else None,
                   "calibration": _rows(calibration_total(c.get("calibration") for c in cells)),
                   "identical": None}
            if ref is not None:
                row["identical"] = sum(all(c["tokens"].get(i) == ids for c in cells) for i, ids in ref.items())
            rows[method] = row
        if OURS in rows:
            ours = rows[OURS]["tok_s_by_repeat"]
            rows[OURS]["vs"] = {}
            for m, r in rows.items():
                pairs = [ours[rep] / x for rep, x in r["tok_s_by_repeat"].items() if m != OURS and x
                         and ours.get(rep)]
                if pairs:
                    rows[OURS]["vs"][m] = spread_of(pairs)
        out.setdefault(workload, {}).setdefault(str(batch), {})[phase] = rows
    return {w: {b: dict(sorted(ph.items(), key=lambda kv: PHASES.index(kv[0])))
                for b, ph in sorted(bs.items(), key=lambda kv: int(kv[0]))} for w, bs in out.items()}


def _ratio_text(s: dict) -> str:
    """x1.05 (x0.98-x1.10, 5 pairs)."""
    if s["n"] < 2:
        return f"x{s['median']:.2f} (1 pair)"
    return f"x{s['median']:.2f} (x{s['min']:.2f}-x{s['max']:.2f}, {s['n']} pairs)"


def goals(summary: dict, replay: dict | None = None) -> list[dict]:
    """The issue's goals on this machine, each {"goal", "met" (True / False / None: not measured), "clear" (every
    paired ratio on the same side of the bar as the median: the spread tells them apart; None where no ratio
    decides), "detail"}. Ratios are lookup_decode's tok/s over the baseline's, paired by repeat; a goal is met when
    the median of the pairs reaches the bar.

    Engine, cold cells: code edits >= 1.2x ngram (the faster ngram variant present) and >= 1.05x suffix at batch 1,
    >= both at batch 8; chat >= 0.97x no speculation at batch 1 and 8. Again cells (repeated requests): >= suffix.
    Every output identical to no speculation, with drafts accepted. lookup_decode's drafter <= 5% of the step at
    batch 8. Calibration |mean predicted - share kept| <= 0.05 in every bin of >= 50 tokens (cold cells). Replay
    (both step costs, batch 1 and 8, cold): lookup_decode's modelled time >= 97% of its oracle-cut ceiling.
    """
    out = []

    def versus(goal, cells, baselines, need, phase="cold", best_of=False):
        parts, ok, clear = [], [], []
        for w, b in cells:
            rows = summary.get(w, {}).get(str(b), {}).get(phase, {})
            if OURS not in rows:
                continue
            present = [m for m in baselines if m in rows and m in rows[OURS].get("vs", {})]
            if best_of and present:                  # against the strongest of these baselines (median tok/s)
                present = [max(present, key=lambda m: rows[m]["tok_s"]["median"])]
            for m in present:
                s = rows[OURS]["vs"][m]
                ok.append(s["median"] >= need)
                clear.append(s["min"] >= need if s["median"] >= need else s["max"] < need)
                parts.append(f"{w} b{b} {phase}: {OURS} {rows[OURS]['tok_s']['median']:.1f} vs {m} "
                             f"{rows[m]['tok_s']['median']:.1f} tok/s, paired {_ratio_text(s)} (need x{need:g})")
        out.append(_goal(goal, ok, parts, all(clear) if clear else None))

    code = [(w, b) for w in summary if w in CODE_WORKLOADS for b in summary[w]]
    chat = [(w, b) for w in summary if w in CHAT_WORKLOADS for b in summary[w]]
    versus("code edits >= 1.2x ngram at batch 1 (cold)", [c for c in code if c[1] == "1"], NGRAMS, 1.2,
           best_of=True)
    versus("code edits >= 1.05x suffix at batch 1 (cold)", [c for c in code if c[1] == "1"], ["suffix"], 1.05)
    versus("code edits >= ngram and suffix at batch 8 (cold)", [c for c in code if c[1] == "8"],
           [*NGRAMS, "suffix"], 1.0)
    versus("repeated requests >= suffix (again)", [(w, b) for w in summary for b in summary[w]], ["suffix"], 1.0,
           phase="again")
    versus("chat >= 0.97x no speculation at batch 1 and 8 (cold)", [c for c in chat if c[1] in ("1", "8")],
           [REFERENCE], 0.97)

    parts, ok, kept = [], [], {}
    for w, bs in summary.items():
        for b, phases in bs.items():
            for phase, rows in phases.items():
                for m, r in rows.items():
                    if m == REFERENCE or r["identical"] is None:
                        continue
                    ok.append(r["identical"] == r["requests"])
                    kept[m] = kept.get(m, 0) + (r["kept"] or 0)
                    if not ok[-1]:
                        parts.append(f"{w} b{b} {phase} {m}: {r['identical']}/{r['requests']} identical")
    for m, n in kept.items():          # a drafter that never had a token kept would pass the identity vacuously
        ok.append(n > 0)
        if not n:
            parts.append(f"{m}: no draft token kept in any cell")
    if ok and not parts:
        parts = [f"{len(ok) - len(kept)} method cells, all identical; every drafter had drafts kept"]
    out.append(_goal("every output identical to no speculation, with drafts accepted", ok, parts))

    parts, ok = [], []
    for w, bs in summary.items():
        row = bs.get("8", {}).get("cold", {}).get(OURS)
        if row and row["drafter_share"] is not None:
            ok.append(row["drafter_share"] <= 0.05)
            parts.append(f"{w} b8: {100 * row['drafter_share']:.2f}% ({row['drafter_ms_per_step']:.2f} ms per step, "
                         f"worst call {_f(row['drafter_ms_worst'], '.1f')} ms)")
    out.append(_goal("drafter <= 5% of the step at batch 8", ok, parts))

    parts, ok = [], []
    for w, bs in summary.items():
        for b, phases in bs.items():
            row = phases.get("cold", {}).get(OURS)
            cal = calibration(row.get("calibration")) if row else None
            if cal is not None and any(r.tokens >= CALIBRATION_MIN_TOKENS for r in cal.rows()):
                gap = cal.error(CALIBRATION_MIN_TOKENS)
                ok.append(gap <= 0.05)
                parts.append(f"{w} b{b}: worst gap {gap:.3f}")
    out.append(_goal("calibration: |mean predicted - share kept| <= 0.05 in every bin of >= 50 tokens (cold)", ok,
                     parts or ["not measured (no drafter calibration table, or no bin of 50 tokens)"]))

    parts, ok = [], []
    for clock, ws in (replay or {}).items():
        for w, bs in ws.items():
            for b, phases in bs.items():
                row = phases.get("cold", {}).get(OURS)
                if b in ("1", "8") and row and row["share"] is not None:
                    ok.append(row["share"] >= 0.97)
                    parts.append(f"{clock} {w} b{b}: {100 * row['share']:.1f}%")
    out.append(_goal("replay: modelled >= 97% of the oracle-cut ceiling, both step costs, batch 1 and 8 (cold)",
                     ok, parts))
    return out


def _goal(goal: str, ok: list[bool], parts: list[str], clear: bool | None = None) -> dict:
    """One goal's entry: met when every check passed (None: none ran), its details joined."""
    return {"goal": goal, "met": all(ok) if ok else None, "clear": clear, "detail": "; ".join(parts) or "not measured"}


def goal_lines(gs: list[dict]) -> list[str]:
    word = {True: "met", False: "NOT MET", None: "not measured"}
    lines = []
    for g in gs:
        note = " (within the spread: not told apart)" if g.get("clear") is False and g["met"] is not None else ""
        lines.append(f"{word[g['met']]}{note}: {g['goal']} -- {g['detail']}")
    return lines


# ------------------------------------------------------------------------------------------- tables

def _f(x, fmt):
    return "–" if x is None else format(x, fmt)


def _tok_s_cells(s: dict | None) -> str:
    """median | min–max | IQR columns of a tok/s spread."""
    if s is None:
        return "– | – | –"
    if s["n"] < 2:
        return f"{s['median']:.2f} | – | –"
    return f"{s['median']:.2f} | {s['min']:.2f}–{s['max']:.2f} | {s['q1']:.2f}–{s['q3']:.2f}"


def cell_table(rows: dict) -> list[str]:
    """One (workload, batch, phase)'s rows, a line per method."""
    lines = [f"| method | tok/s median | min–max | IQR | {OURS} / this, paired | ms/tok | steps | tok/row-step | "
             "drafted / kept / wasted | kept by position | drafter ms/call mean / p99 / worst | drafter share | same |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for m, r in rows.items():
        vs = rows.get(OURS, {}).get("vs", {}).get(m)
        counts = "–" if not r["proposes"] and not r["drafted"] else \
            f"{r['drafted']:,.0f} / {r['kept']:,.0f} / {r['wasted']:,.0f}"
        drafter = "–" if r["drafter_ms_mean"] is None else \
            f"{r['drafter_ms_mean']:.2f} / {_f(r.get('drafter_ms_p99'), '.2f')} / {_f(r['drafter_ms_worst'], '.1f')}"
        share = "–" if r["drafter_share"] is None else f"{100 * r['drafter_share']:.2f}%"
        same = "–" if r["identical"] is None else f"{r['identical']}/{r['requests']}"
        pre = f" ({r['preemptions']} preempted)" if r["preemptions"] else ""
        lines.append(f"| {m}{pre} | {_tok_s_cells(r['tok_s'])} | {'' if vs is None else _ratio_text(vs)} | "
                     f"{_f(r['tpot_ms'], '.1f')} | {_f(r['steps'], '.0f')} | {_f(r['tokens_per_step'], '.2f')} | "
                     f"{counts} | {'/'.join(map(str, r['accepted_per_pos'])) or '–'} | {drafter} | {share} | "
                     f"{same} |")
    return lines


def calibration_table(rows: list[dict]) -> list[str]:
    lines = ["| bin | tokens | mean predicted | share kept | gap | chance sd |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:                                # (results stored before the chance spread show –)
        lines.append(f"| {r['bin_low']:.1f}–{r['bin_high']:.1f} | {r['tokens']:,} | {r['predicted']:.3f} | "
                     f"{r['kept']:.3f} | {r['kept'] - r['predicted']:+.3f} | "
                     f"{'±%.3f' % r['chance'] if r.get('chance') else '–'} |")
    return lines


def replay_table(replay: dict) -> list[str]:
    lines = ["| step cost | cell | phase | method | steps | tok/row-step | drafted / kept | modelled tok/s | "
             "ceiling tok/s | modelled / ceiling |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for clock, ws in replay.items():
        for w, bs in ws.items():
            for b, phases in bs.items():
                for phase, methods in phases.items():
                    for m, x in methods.items():
                        r, c = x["modelled"], x["ceiling"]
                        tps = r["tokens"] / r["row_steps"] if r["row_steps"] else None
                        lines.append(f"| {clock} | {w} b{b} | {phase} | {m} | {r['steps']} | {_f(tps, '.2f')} | "
                                     f"{r['drafted']:,} / {r['kept']:,} | {_f(r['tok_s'], '.2f')} | "
                                     f"{'–' if c is None else _f(c['tok_s'], '.2f')} | "
                                     f"{'–' if x['share'] is None else format(100 * x['share'], '.1f') + '%'} |")
    return lines


def _load_text(load: dict) -> str:
    if load.get("min") is None:
        return "load average not recorded"
    return (f"load average (1 min) {_f(load.get('start'), '.2f')} at the start, {load['min']:.2f}–{load['max']:.2f} "
            "at the engines' starts and ends")


def markdown(result: dict) -> str:
    s, summary = result["settings"], result["summary"]
    env = result.get("engine_info") or {}
    load = result.get("load") or {}
    reduced = f"**{s['label']}**  \n" if s.get("label") else ""
    lines = [f"# lookup_decode vs vLLM's drafters in the real vLLM engine ({env.get('vllm_distribution') or 'vLLM'})",
             "", reduced + f"Command: `{result['command']}`  ",
             f"Model `{s['model']}` ({s['dtype']}), K = {s['k']}, greedy, at most {s['max_tokens']} new tokens"
             f"{' (EOS ignored)' if s['ignore_eos'] else ''}, {s['requests']} requests per cell (rounded up to whole "
             f"batches), prompts <= {s['max_prompt_tokens']} tokens; {s['repeats']} repeat(s), each a block of every "
             f"(method, cell) in seeded random order (seed {s.get('seed', 0)}); a fresh engine per cell for "
             f"{'every method' if s.get('fresh') == 'always' else ', '.join(sorted(MEMORY_METHODS))}"
             f"{'' if s.get('fresh') == 'always' else ', one engine for all cells otherwise'}.  ",
             f"Machine: {result['environment'].get('cpu')} ({result['environment'].get('cpu_count')} CPUs), "
             f"GPU {env.get('cuda')}; threads {s['threads']}; {_load_text(load)}; the run took "
             f"{result.get('run_s', 0) / 60:.1f} min.", "",
             "cold: requests this engine had not served; again: the same requests served once more by the same "
             "engine, right after (what memory across requests gains; vLLM's prefix cache serves their prompts for "
             "every method). tok/s: output tokens / wall seconds of the cell's `llm.generate` calls, median over "
             "repeats with min–max and IQR. paired: lookup_decode's tok/s over this method's in the same repeat, "
             "median (min–max). ms/tok: per request, (last - first token time) / (tokens - 1), mean over "
             "requests. steps: engine steps that ran the model. tok/row-step: tokens a request gained per step it "
             "emitted in (1 without speculation). drafted / kept / wasted: vLLM's spec-decode counters (draft "
             "tokens, accepted, their difference); kept by position: accepted draft tokens at positions 1..K, "
             "summed over repeats. drafter ms/call: `drafter.propose` seconds per call, mean, 99th percentile "
             "(the largest of the repeats') and worst over every repeat; share: over the steps' seconds. Every "
             "count is a median over repeats. "
             "same: requests whose tokens equal no speculation's in every repeat.", ""]
    for workload, batches in summary.items():
        for b, phases in batches.items():
            for phase, rows in phases.items():
                n = max(r["repeats"] for r in rows.values())
                lines += [f"## {workload}, batch {b}, {phase} ({n} repeat{'s' if n > 1 else ''})", ""]
                lines += cell_table(rows) + [""]
    cal = [(w, b, ph, r[OURS]["calibration"]) for w, bs in summary.items() for b, phs in bs.items()
           for ph, r in phs.items() if OURS in r and r[OURS].get("calibration")]
    lines += ["## Calibration of lookup_decode's acceptance model", ""]
    if cal:
        lines += ["Draft tokens sent, by the probability the drafter gave them of being kept (`drafter.stats."
                  "calibration()`, differences around each cell, summed over repeats).", ""]
        for w, b, ph, rows in cal:
            lines += [f"### {w}, batch {b}, {ph}", ""] + calibration_table(rows) + [""]
    else:
        lines += ["Not measured: the drafter keeps no reliability table (`stats.calibration()`).", ""]
    replay = result.get("replay")
    lines += ["## Modelled on the recorded outputs", ""]
    if replay:
        from benchmarks.vllm.modelled import CLOCKS
        costs = "; ".join(f"{name} {1e3 * f:g} ms + {1e3 * s_:g} ms per verified token"
                          for name, (f, s_) in CLOCKS.items())
        lines += [f"The run's greedy outputs (no speculation's) as the target of the CPU simulation of vLLM's runner "
                  f"(`benchmarks/vllm/modelled.py`), cells served as the engines served them (a fresh drafter per "
                  f"cell, the warm-up first, then cold and again). Step costs: {costs}; decode steps only. "
                  "modelled: the method as configured; ceiling: its every proposed token, each draft cut to what "
                  "the target keeps. No wall clock: the numbers do not depend on the machine's load.", ""]
        lines += replay_table(replay) + [""]
    else:
        lines += ["Not run (`--no-replay`, or no reference outputs).", ""]
    lines += ["## Goals (this machine)", ""] + [f"* {line}" for line in goal_lines(result["goals"])]
    errors = [r for r in result["runs"] if "error" in r]
    if errors:
        lines += ["", "## Failed engines", ""] + [
            f"* {r['method']} (repeat {r['repeat']}): "
            f"{r['error'].strip().splitlines()[-1] if r['error'].strip() else '?'}"
            for r in errors]
    return "\n".join(lines) + "\n"


def finish(result: dict, out: Path, name: str) -> None:
    """Summary, goals, files, printout."""
    out = Path(out)
    from benchmarks.harness.results import write_result
    result["summary"] = summarize(result["runs"])
    result["goals"] = goals(result["summary"], result.get("replay"))
    loads = [x for r in result["runs"] for x in (r.get("load_start"), r.get("load_end")) if x is not None]
    result["load"] = {**(result.get("load") or {}), "min": min(loads, default=None), "max": max(loads, default=None)}
    info = next((r["info"] for r in result["runs"] if "info" in r), None)
    result["engine_info"] = info
    text = markdown(result)
    write_result(out, name, result, text, echo=False)
    print("\n".join(goal_lines(result["goals"])))
    print(f"--- wrote {out / (name + '.json')} and {out / (name + '.md')}")

