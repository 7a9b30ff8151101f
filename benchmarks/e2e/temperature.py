"""How much speed survives sampling: lookup_decode vs plain sampling generate at several temperatures.

    python -m benchmarks.e2e.temperature --n-per-workload 3 --max-new-tokens 128

For each prompt and temperature (0 = greedy), plain `model.generate` and lookup_decode run side by side
in one process, interleaved (order alternating per prompt), after an untimed warm-up, with the same
sampling settings (top_p 0.95 when sampling). Reports per (workload, temperature) the median speed-up
(per-prompt ratio of tokens/s), the ratio of total throughput and lookup_decode's mean accepted length,
also without loop-dominated prompts. Writes DIR/temperature.json, .md and .png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.harness import workloads
from benchmarks.harness.loop import side_by_side
from benchmarks.harness.results import RESULTS, write_result
from lookup_decode.core.stats import DecodeStats
from lookup_decode.engines.hf.models import chat_ids, load_model
from lookup_decode.measure import LOOP_THRESHOLD, Variant, environment, loop_score, run_variant


def variants_at(temperature: float) -> list[Variant]:
    sampling = {} if temperature == 0 else {"do_sample": True, "temperature": temperature, "top_p": 0.95}
    return [Variant("plain", generate_kwargs=dict(sampling)),
            Variant("lookup_decode", lookup={}, generate_kwargs=dict(sampling))]


def summarize(rows: list[dict], loop_threshold: float) -> list[dict]:
    """Per (workload, temperature): median per-prompt speed-up, total-throughput ratio, accepted length."""
    out = []
    keys = sorted({(r["workload"], r["temperature"]) for r in rows})
    for workload, temperature in keys:
        for scope in ("all", "no_loops"):
            sel = [r for r in rows if (r["workload"], r["temperature"]) == (workload, temperature)
                   and (scope == "all" or r["loop_score"] <= loop_threshold)]
            if not sel:
                continue
            stats = DecodeStats()
            for r in sel:
                stats.steps += r["steps"]
                stats.accepted += r["accepted"]
            out.append({
                "workload": workload, "temperature": temperature, "scope": scope, "prompts": len(sel),
                "median_speedup": statistics.median(r["speedup"] for r in sel),
                "min_speedup": min(r["speedup"] for r in sel), "max_speedup": max(r["speedup"] for r in sel),
                "throughput_ratio": (sum(r["lookup_tokens"] for r in sel) / sum(r["lookup_s"] for r in sel))
                / (sum(r["plain_tokens"] for r in sel) / sum(r["plain_s"] for r in sel)),
                "mean_accepted_length": stats.mean_accepted_length})
    return out


def to_markdown(summary: list[dict], command: str) -> str:
    lines = [f"Command: `{command}`", "",
             "| workload | temperature | prompts | speed-up median (min-max) | total throughput ratio "
             "| mean accepted length |",
             "|---|---|---|---|---|---|"]
    for scope, title in (("all", "all prompts"), ("no_loops", "without loop-dominated prompts")):
        lines.append(f"| **{title}** | | | | | |")
        for s in (s for s in summary if s["scope"] == scope):
            lines.append(f"| {s['workload']} | {s['temperature']} | {s['prompts']} | {s['median_speedup']:.2f}x "
                         f"({s['min_speedup']:.2f}-{s['max_speedup']:.2f}) | {s['throughput_ratio']:.2f}x | "
                         f"{s['mean_accepted_length']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for workload in sorted({s["workload"] for s in summary}):
        pts = sorted((s["temperature"], s["median_speedup"], s["mean_accepted_length"]) for s in summary
                     if s["workload"] == workload and s["scope"] == "all")
        axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=workload)
        axes[1].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=workload)
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set(xlabel="temperature (0 = greedy)", ylabel="speed-up vs plain generate (median)")
    axes[1].set(xlabel="temperature (0 = greedy)", ylabel="mean accepted length (bonus incl.)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["code_edit", "summarization"], choices=list(workloads.WORKLOADS))
    ap.add_argument("--n-per-workload", type=int, default=3)
    ap.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 0.3, 0.7, 1.0])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "temperature"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model()
    prompts = []
    for name in args.workloads:
        picked = [r for r in workloads.load(name)
                  if chat_ids(tokenizer, r.messages).shape[1] <= args.max_prompt_tokens][: args.n_per_workload]
        prompts.extend((name, r) for r in picked)
    warm = chat_ids(tokenizer, prompts[0][1].messages)
    for t in args.temperatures:            # untimed: allocations and the one-time cost calibration
        for v in variants_at(t):
            run_variant(model, warm, v, 8)
    rows = []
    jobs = [(t, i, name, req) for i, (name, req) in enumerate(prompts) for t in args.temperatures]
    for t, i, name, req in tqdm(jobs, desc="prompt x temperature"):
        ids = chat_ids(tokenizer, req.messages)
        variants = {v.name: v for v in variants_at(t)}      # plain first for even prompts, lookup_decode for odd
        torch.manual_seed(args.seed + i)
        runs = side_by_side(list(variants), lambda name: run_variant(model, ids, variants[name], args.max_new_tokens),
                            offset=i)
        plain, lookup = runs["plain"][0], runs["lookup_decode"][0]
        rows.append({"workload": name, "id": req.id, "temperature": t, "prompt_tokens": ids.shape[1],
                     "plain_tokens": len(plain.tokens), "plain_s": plain.seconds,
                     "lookup_tokens": len(lookup.tokens), "lookup_s": lookup.seconds,
                     "speedup": lookup.tokens_per_second / plain.tokens_per_second,
                     "steps": lookup.stats.steps, "accepted": lookup.stats.accepted,
                     "drafted": lookup.stats.drafted, "loop_score": loop_score(plain.tokens)})
    summary = summarize(rows, LOOP_THRESHOLD)
    env = environment(model, "cpu", args.threads)
    write_result(args.out, "temperature", {"environment": env, "rows": rows, "summary": summary},
                 to_markdown(summary, env.get("command", "")))
    plot(summary, Path(args.out) / "temperature.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
