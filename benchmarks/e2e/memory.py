"""End to end: lookup_decode with session memory / reference documents vs without, on the default model.

    python -m benchmarks.e2e.memory --n 1 --max-new-tokens 16 --out /tmp/mem_smoke       # smoke test
    python -m benchmarks.e2e.memory --n 3 --max-new-tokens 96 --threads 2      # full: ~6-8 min on a quiet 2-core CPU

Sessions whose outputs are this model's own (greedy), run step by step; every step runs each variant
(`none`: lookup_decode defaults; `memory`: the same with one Memory for the workload and its
References; optionally `plain`: model.generate) in rotated order after an untimed warm-up, and
checks that all outputs are identical. Later steps are built from the earlier outputs, as a client
would. Workloads (data from ../shared/data): `benchmarks.replay.sessions.END_TO_END` — mt_redundant (turn 2
carries this model's turn 1), edits (three successive edits of a small Python file), rag (ClapNQ with
300 rows' passages registered) and rerun (the same first turns asked again); the offline replay
(`benchmarks.replay.memory`) runs the same builders on real outputs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import lookup_decode
from benchmarks.harness.loop import side_by_side
from benchmarks.harness.model import add_model_arguments
from benchmarks.harness.model import load as load_model
from benchmarks.harness.results import RESULTS, write_result
from benchmarks.replay import sessions as memory_sessions
from lookup_decode.core.config import LookupConfig
from lookup_decode.core.cost import calibrating_tokens
from lookup_decode.core.stats import DecodeStats
from lookup_decode.engines.hf.models import chat_ids
from lookup_decode.measure import environment

VARIANTS = ["none", "memory"]


def run_once(model, ids, variant, max_new_tokens, memory, refs):
    stats = DecodeStats()
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False)
    t = time.perf_counter()
    if variant == "plain":
        out = model.generate(ids, **kw)
    elif variant == "none":
        out = lookup_decode.generate(model, ids, stats=stats, **kw)
    else:
        out = lookup_decode.generate(model, ids, stats=stats, memory=memory, references=refs, **kw)
    return out, time.perf_counter() - t, stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", nargs="+", default=list(memory_sessions.END_TO_END),
                    choices=list(memory_sessions.END_TO_END))
    ap.add_argument("--n", type=int, default=4, help="chats / files / questions per workload")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=1800)
    ap.add_argument("--threads", type=int, default=None)
    add_model_arguments(ap)
    ap.add_argument("--plain", action="store_true", help="also time plain model.generate")
    ap.add_argument("--memory-tokens", type=int, default=200_000)
    ap.add_argument("--out", default=str(RESULTS / "memory_generate"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args)
    env = environment(model, threads=args.threads, model_path=args.model)
    variants = (["plain"] if args.plain else []) + VARIANTS
    warm = chat_ids(tokenizer, [{"role": "user", "content": "Say hello."}])
    for v in variants:                            # first calls allocate; lookup measures the forward cost once
        run_once(model, warm, v, calibrating_tokens(LookupConfig.k), lookup_decode.Memory(100), None)
    records, k = [], 0
    for name in args.workloads:
        workload = memory_sessions.load(name, args.n, memory_sessions.END_TO_END)
        memory, refs = lookup_decode.Memory(args.memory_tokens), memory_sessions.references(workload, tokenizer)
        for session in workload.sessions:
            prev = ""                             # the model's own output of the session's previous step
            for step in session:
                group, scored = step.group, step.score
                ids = chat_ids(tokenizer, step.prompt(prev))
                if ids.shape[1] > args.max_prompt_tokens:
                    print(f"skip {name}/{group}: {ids.shape[1]} prompt tokens", file=sys.stderr)
                    prev = ""
                    continue
                names = variants if scored else ["memory"]     # not scored: only fills the memory
                runs = {v: rs[0] for v, rs in side_by_side(
                    names, lambda v: run_once(model, ids, v, args.max_new_tokens, memory, refs), offset=k).items()}
                k += 1
                outs = [r[0] for r in runs.values()]
                identical = all(torch.equal(outs[0], o) for o in outs[1:])
                prev = tokenizer.decode(outs[0][0, ids.shape[1]:], skip_special_tokens=True)
                new = outs[0].shape[1] - ids.shape[1]
                rec = {"workload": name, "group": group, "scored": scored, "prompt_tokens": int(ids.shape[1]),
                       "new_tokens": int(new), "identical": identical,
                       "seconds": {v: r[1] for v, r in runs.items()},
                       "mean_accepted_length": {v: r[2].mean_accepted_length for v, r in runs.items() if v != "plain"}}
                records.append(rec)
                print(json.dumps({k2: rec[k2] for k2 in ("workload", "group", "new_tokens", "identical")}
                                 | {"seconds": {v: round(s, 2) for v, s in rec["seconds"].items()}}), file=sys.stderr)
                write_result(args.out, "results", {"environment": env, "records": records})
    result = {"environment": env, "settings": vars(args), "records": records, "summary": summarize(records, variants)}
    write_result(args.out, "results", result, markdown(result))
    return 0


def summarize(records, variants):
    """Per (workload, group): speed-up of memory over none (median of per-request ratios and total-time
    ratio), mean accepted lengths, identity."""
    out = {}
    for rec in (r for r in records if r["scored"]):
        out.setdefault(f"{rec['workload']}/{rec['group']}", []).append(rec)
    rows = {}
    for key, recs in out.items():
        ratio = [r["seconds"]["none"] / r["seconds"]["memory"] for r in recs]
        total = {v: sum(r["seconds"][v] for r in recs) for v in variants}
        row = {"requests": len(recs), "identical": sum(r["identical"] for r in recs),
               "speedup_memory_vs_none_median": statistics.median(ratio),
               "speedup_memory_vs_none_range": [min(ratio), max(ratio)],
               "speedup_memory_vs_none_total": total["none"] / total["memory"],
               "mean_accepted_length_none": statistics.mean(r["mean_accepted_length"]["none"] for r in recs),
               "mean_accepted_length_memory": statistics.mean(r["mean_accepted_length"]["memory"] for r in recs)}
        if "plain" in variants:
            row["speedup_memory_vs_plain_total"] = total["plain"] / total["memory"]
            row["speedup_none_vs_plain_total"] = total["plain"] / total["none"]
        rows[key] = row
    return rows


def markdown(result) -> str:
    lines = ["# Session memory end to end", "", f"Command: `{result['environment']['command']}`", "",
             "| workload/group | requests | identical | memory vs none: median [min-max] | total | "
             "mean acc. len none | memory |", "|---|---:|---:|---|---:|---:|---:|"]
    for key, r in result["summary"].items():
        lo, hi = r["speedup_memory_vs_none_range"]
        lines.append(f"| {key} | {r['requests']} | {r['identical']}/{r['requests']} | "
                     f"x{r['speedup_memory_vs_none_median']:.2f} [{lo:.2f}-{hi:.2f}] | "
                     f"x{r['speedup_memory_vs_none_total']:.2f} | {r['mean_accepted_length_none']:.2f} | "
                     f"{r['mean_accepted_length_memory']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
