"""Aggregate, tabulate and plot end-to-end results (`benchmarks.e2e.generate`); also re-renders a saved results.json.

    python -m benchmarks.harness.report benchmarks/results/generate/results.json   # rewrite results.md and plots
    python -m benchmarks.harness.report benchmarks/results/generate/results.json --page docs/benchmarks.md
                                                         # and the generated results block of that page

Per category (and over all prompts), each statistic is computed twice: over all prompts and
without loop-dominated ones (the plain output's loop score > threshold: a repetition loop is easy
to draft and must not carry a speed claim). Speed-ups are per-prompt ratios of tokens/s (median
and spread), plus the ratio of total throughput (sum of tokens over sum of seconds).
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

from benchmarks.harness.results import write_result
from lookup_decode.measure import spread, throughput_ratio

PLAIN, PROMPT_LOOKUP = "plain", "prompt_lookup"
SUBSETS = {"all_prompts": "all prompts", "without_loops": "without loop-dominated prompts"}


def _pair(record: dict, name: str) -> tuple[int, float]:
    v = record["variants"][name]
    return v["new_tokens"], v["seconds"]


def aggregate_group(records: list[dict], variants: list[str]) -> dict:
    """Statistics of one group of prompt records, per variant."""
    out = {"n": len(records)}
    for name in variants:
        row = {"tokens_per_second": spread(r["variants"][name]["tokens_per_second"] for r in records)}
        for base in (PLAIN, PROMPT_LOOKUP):
            if base == name or base not in variants:
                continue
            row[f"speedup_vs_{base}"] = spread(r[f"speedup_vs_{base}"][name] for r in records)
            row[f"after_first_vs_{base}"] = spread(r[f"after_first_vs_{base}"][name] for r in records
                                                   if name in r.get(f"after_first_vs_{base}", {}))
            row[f"throughput_ratio_vs_{base}"] = (throughput_ratio([_pair(r, base) for r in records],
                                                                   [_pair(r, name) for r in records])
                                                  if records else None)
        if name != PLAIN:
            row["identical"] = sum(bool(r["variants"][name]["identical"]) for r in records)
        pooled = [r["variants"][name]["stats"] for r in records if r["variants"][name].get("stats")]
        if pooled:
            steps = sum(s["steps"] for s in pooled)
            drafted = sum(s["drafted"] for s in pooled)
            accepted = sum(s["accepted"] for s in pooled)
            total_s = sum(s["total_s"] for s in pooled)
            row.update(mean_accepted_length=1.0 + accepted / max(steps, 1),
                       acceptance_rate=accepted / drafted if drafted else 0.0,
                       drafted_per_token=drafted / max(sum(s["new_tokens"] for s in pooled), 1),
                       proposer_share=sum(s["proposer_s"] for s in pooled) / total_s if total_s else 0.0,
                       model_share=sum(s["model_s"] for s in pooled) / total_s if total_s else 0.0,
                       prefill_share=sum(s["prefill_s"] for s in pooled) / total_s if total_s else 0.0)
        out[name] = row
    return out


def aggregate(records: list[dict], variants: list[str], loop_threshold: float) -> dict:
    """{subset: {category or "all": aggregate_group(...)}} for subsets all_prompts / without_loops."""
    categories = list(dict.fromkeys(r["category"] for r in records))
    result = {}
    for subset in SUBSETS:
        keep = records if subset == "all_prompts" else [r for r in records if r["loop_score"] <= loop_threshold]
        result[subset] = {c: aggregate_group([r for r in keep if r["category"] == c], variants) for c in categories}
        result[subset]["all"] = aggregate_group(keep, variants)
    return result


# ---------------------------------------------------------------------------------------- markdown

def _x(s: dict | None) -> str:
    if not s or not s.get("n"):
        return "–"
    return f"x{s['median']:.2f} [{s['q1']:.2f}–{s['q3']:.2f}] ({s['min']:.2f}–{s['max']:.2f})"


def _f(value, fmt: str) -> str:
    return "–" if value is None else fmt.format(value)


def markdown(result: dict) -> str:
    env, settings = result["environment"], result["settings"]
    variants = settings["variants"]
    t = settings.get("temperature") or 0.0
    decoding = f"sampled at temperature {t}" if t else "greedy"
    lines = [
        f"# End-to-end generation: lookup_decode vs plain {'sampling' if t else 'greedy'} and transformers' prompt "
        "lookup", "",
        f"Command: `{env['command']}`  ",
        f"Model: {env.get('model')} ({env.get('dtype')}) on {env['device']}"
        + (f" ({env['gpu']})" if env["device"].startswith("cuda") and env.get("gpu") else f" ({env['cpu']})")
        + f", torch threads {env['torch_threads']}; torch {env['torch']}, transformers {env['transformers']}, "
        f"numba {env['numba']}  ",
        f"Up to {settings['max_new_tokens']} new tokens, {decoding}; {settings['repeats']} timed repeat(s) per prompt "
        f"and variant (median), interleaved per prompt after an untimed warm-up; loop-dominated = loop score > "
        f"{settings['loop_threshold']} (share of the plain output covered by an 8-gram repeated from earlier in it).  ",
        f"Prompts of up to {settings.get('max_prompt_tokens', '?')} tokens"
        + (f"; long-context aider_refactor prompts of up to {settings['long_prompt_tokens']} tokens (the model's "
           "context bounds them; longer contexts: benchmarks/results/scaling/)"
           if settings.get("long_prompt_tokens") and "aider_refactor" in settings.get("workloads", []) else "")
        + ".  ",
        "Variants: " + "; ".join(f"`{d}`" for d in settings["variant_descriptions"]), "",
        "Speed-up cells: median [quartiles] (min–max) of per-prompt tokens/s ratios. "
        "Total: ratio of total throughput (all tokens / all seconds). After 1st token: the same ratio on the tokens "
        "after the first and the seconds less plain's time for one token (the prefill, which drafting cannot "
        "speed up).", ""]
    for subset, title in SUBSETS.items():
        agg = result["aggregate"][subset]
        cats = list(agg)
        lines += [f"## Tokens/s, median per prompt ({title})", "",
                  "| category | n | " + " | ".join(variants) + " |", "|---|---:|" + "---:|" * len(variants)]
        for c in cats:
            lines.append(f"| {c} | {agg[c]['n']} | "
                         + " | ".join(_f(agg[c][v]["tokens_per_second"]["median"], "{:.1f}") for v in variants) + " |")
        lines.append("")
        for v in variants:
            if v == PLAIN:
                continue
            vs_pld = PROMPT_LOOKUP in variants and v != PROMPT_LOOKUP
            lookup = any("mean_accepted_length" in agg[c][v] for c in cats)
            head = ["category", "n", "vs plain", "total vs plain", "after 1st token vs plain"] + (
                ["vs prompt_lookup", "total vs p.l.", "after 1st token vs p.l."] if vs_pld else []) + ["identical"]
            if lookup:
                head += ["mean acc. len", "acc. rate", "drafted/token", "proposer %"]
            lines += [f"### {v} ({title})", "", "| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
            for c in cats:
                a = agg[c][v]
                cells = [c, str(agg[c]["n"]), _x(a.get("speedup_vs_plain")),
                         _f(a.get("throughput_ratio_vs_plain"), "x{:.2f}"), _x(a.get("after_first_vs_plain"))]
                if vs_pld:
                    cells += [_x(a.get("speedup_vs_prompt_lookup")),
                              _f(a.get("throughput_ratio_vs_prompt_lookup"), "x{:.2f}"),
                              _x(a.get("after_first_vs_prompt_lookup"))]
                cells.append(f"{a.get('identical', 0)}/{agg[c]['n']}")
                if lookup:
                    cells += [_f(a.get("mean_accepted_length"), "{:.2f}"), _f(a.get("acceptance_rate"), "{:.0%}"),
                              _f(a.get("drafted_per_token"), "{:.2f}"), _f(a.get("proposer_share"), "{:.1%}")]
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
    lines += differences_section(result)
    fc = result.get("forward_cost")
    if fc:
        lines += [f"## Forward cost on this machine (context {fc['context_tokens']} tokens)", "",
                  "| tokens | " + " | ".join(str(n) for n in fc["sizes"]) + " |", "|---|" + "---:|" * len(fc["sizes"]),
                  "| ms | " + " | ".join(f"{1e3 * s:.1f}" for s in fc["seconds"]) + " |", ""]
    skipped = result.get("skipped")
    if skipped:
        listed = ", ".join(f"{k} {v}" for k, v in skipped.items() if v) or "none"
        lines += [f"Prompts skipped as too long (> --max-prompt-tokens or beyond the model's context): {listed}", ""]
    return "\n".join(lines)


def differences_section(result: dict) -> list[str]:
    """Markdown lines listing every greedy output that parts from plain's, classified (`generate`'s
    `classified_differences`); none where the run recorded no classification (sampling, older results)."""
    rows = [(r["id"], name, d) for r in result.get("prompts", []) for name, v in r["variants"].items()
            for d in v.get("differences", [])]
    if not rows:
        return []
    ties = sum(d["near_tie"] for _, _, d in rows)
    lines = ["## Outputs that part from plain's, classified", "",
             f"{len(rows)} distinct outputs differ from plain's; {ties} part at a bfloat16 near-tie (the two tokens' "
             "logits within `lookup_decode.engines.hf.ties.NEAR_TIE` in a 1-token and a 16-token forward). After the "
             "first difference a variant decodes a different text, so its time there is not a time for plain's "
             "text.", "",
             "| prompt | variant | repeats | first difference at | gap, 1-token forward | gap, 16-token forward | "
             "near-tie |", "|---|---|---|---:|---:|---:|---|"]
    lines += [f"| {pid} | {name} | {', '.join(map(str, d['repeats']))} | {d['position']} | {d['gap_1']:.3f} | "
              f"{d['gap_wide']:.3f} | {'yes' if d['near_tie'] else 'NO'} |" for pid, name, d in rows]
    return lines + [""]


# ------------------------------------------------------------------------------------------- plots

def plots(result: dict, out: Path) -> list[Path]:
    """speedup_by_category.png, accepted_length_hist.png, forward_cost.png; returns the paths written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    written = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        written.append(out / name)
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)

    records = [r for r in result["prompts"] if r["loop_score"] <= result["settings"]["loop_threshold"]]
    variants = [v for v in result["settings"]["variants"] if v != PLAIN]
    cats = list(dict.fromkeys(r["category"] for r in records))
    if records and variants:
        fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(cats) * len(variants) ** 0.5 + 3), 5))
        width = 0.8 / len(variants)
        rng = np.random.default_rng(0)
        for j, v in enumerate(variants):
            data = [[r["speedup_vs_plain"][v] for r in records if r["category"] == c] for c in cats]
            pos = np.arange(len(cats)) + (j - (len(variants) - 1) / 2) * width
            bp = ax.boxplot(data, positions=pos, widths=width * 0.9, patch_artist=True, showfliers=False,
                            medianprops={"color": "black"})
            for patch in bp["boxes"]:
                patch.set_facecolor(f"C{j}")
                patch.set_alpha(0.5)
            for x, ys in zip(pos, data):   # every prompt as a dot: categories hold few prompts
                ax.scatter(np.full(len(ys), x) + rng.uniform(-width / 4, width / 4, len(ys)), ys, s=10,
                           color=f"C{j}", zorder=3)
            ax.plot([], [], color=f"C{j}", lw=8, label=v)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(cats)))
        ax.set_xticklabels(cats, rotation=30, ha="right")
        ax.set_ylabel("speed-up vs plain greedy (tokens/s ratio per prompt)")
        ax.set_title("Speed-up by category (loop-dominated prompts excluded)")
        ax.legend()
        save(fig, "speedup_by_category.png")

    lookup = [v for v in variants if any(r["variants"][v].get("accepted_histogram") for r in result["prompts"])]
    if lookup:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        width = 0.8 / len(lookup)
        longest = 1
        for j, v in enumerate(lookup):
            hist = np.zeros(1)
            for r in records:
                h = np.asarray(r["variants"][v].get("accepted_histogram") or [0], dtype=float)
                if len(h) > len(hist):
                    hist = np.pad(hist, (0, len(h) - len(hist)))
                hist[: len(h)] += h
            emitted = np.arange(1, len(hist) + 1)   # accepted drafts + the bonus/recovered token
            share = hist / max(hist.sum(), 1)
            longest = max(longest, len(hist))
            ax.bar(emitted + (j - (len(lookup) - 1) / 2) * width, share, width=width, color=f"C{variants.index(v)}",
                   label=f"{v} (mean {(share * emitted).sum():.2f})")
        ax.set_xticks(range(1, longest + 1, max(1, longest // 16)))
        ax.set(xlabel="tokens emitted per verify step (accepted drafts + 1)", ylabel="share of steps", yscale="log",
               title="Accepted length per step (loop-dominated prompts excluded)")
        ax.legend()
        save(fig, "accepted_length_hist.png")

    fc = result.get("forward_cost")
    if fc:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ms = [1e3 * s for s in fc["seconds"]]
        ax.plot(fc["sizes"], ms, "o-")
        ax.plot(fc["sizes"], [ms[0] * n for n in fc["sizes"]], ":", color="gray", label="n x cost(1)")
        ax.set(ylim=(0, max(ms) * 1.3), xlabel="tokens in one forward (after a cached context)", ylabel="ms",
               title=f"Forward cost, {result['environment']['device']}, context {fc['context_tokens']} tokens")
        ax.legend()
        save(fig, "forward_cost.png")
    return written


# ------------------------------------------------------------------------- the page's results block

BLOCK_START = "<!-- results:generate -->"
BLOCK_END = "<!-- /results:generate -->"
BLOCK_VARIANT = "lookup_decode"
PAGE = "docs/benchmarks.md"            # the page that shows the block


def _block_table(agg: dict, variant: str, vs_pld: bool) -> list[str]:
    head = ["category", "n", "vs plain"] + (["vs prompt_lookup"] if vs_pld else []) + ["identical", "mean acc. len"]
    lines = ["| " + " | ".join(head) + " |", "| --- | ---: |" + " ---: |" * (len(head) - 2)]
    for c, group in agg.items():
        a = group[variant]
        cells = [c, str(group["n"]), _x(a.get("speedup_vs_plain"))]
        if vs_pld:
            cells.append(_x(a.get("speedup_vs_prompt_lookup")))
        cells += [f"{a.get('identical', 0)}/{group['n']}", _f(a.get("mean_accepted_length"), "{:.2f}")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def results_block(result: dict, variant: str = BLOCK_VARIANT, source: str = "benchmarks/results/generate/results.json",
                  page: str = PAGE) -> str:
    """The results block of `page` (between BLOCK_START and BLOCK_END), generated from `source`'s result."""
    env, settings, agg = result["environment"], result["settings"], result["aggregate"]
    vs_pld = PROMPT_LOOKUP in settings["variants"]
    every = agg["all_prompts"]["all"]
    long_cap = settings.get("long_prompt_tokens")
    long_note = (f"; aider_refactor prompts of up to {long_cap} tokens"
                 if long_cap and "aider_refactor" in settings["workloads"] else "")
    device = env.get("gpu") if env["device"].startswith("cuda") and env.get("gpu") else \
        f"{env.get('cpu_count') or '?'}-core {env['cpu']}"
    intro = (f"All numbers below come from `benchmarks/` on the reference machine ({device}, torch {env['torch']}, "
             f"`torch.set_num_threads({env['torch_threads']})`, {env.get('model')} in {env.get('dtype')}, greedy, "
             f"≤ {settings['max_new_tokens']} new tokens, {settings['n_per_workload']} prompts per category drawn "
             f"from `../shared/data`{long_note}), run side by side in one process: "
             + ", ".join(f"`{d}`" for d in settings["variant_descriptions"])
             + ", interleaved per prompt after a warm-up. Speed-ups are medians of per-prompt tokens/s ratios "
             f"[quartiles] (range). Outputs token-identical to plain `generate`: {every[variant].get('identical', 0)}"
             f"/{every['n']}. Full tables, totals, plots and the environment: `benchmarks/results/generate/`.")
    lines = [BLOCK_START,
             f"<!-- generated from {source} by `python -m benchmarks.harness.report {source} --page {page}`; "
             "do not edit by hand -->",
             textwrap.fill(intro, width=115, break_on_hyphens=False, break_long_words=False), "",
             "```bash", env["command"], "```", "",
             "Without loop-dominated outputs (the 135M model loops on some inputs; loops are trivially drafted and "
             "carry no claim):", ""]
    lines += _block_table(agg["without_loops"], variant, vs_pld)
    lines += ["", "With every prompt:", ""]
    lines += _block_table(agg["all_prompts"], variant, vs_pld)
    return "\n".join(lines + [BLOCK_END])


def update_page(page: Path, block: str) -> None:
    """Replace the text between BLOCK_START and BLOCK_END (markers included) with `block`."""
    text = page.read_text(encoding="utf-8")
    start, end = text.find(BLOCK_START), text.find(BLOCK_END)
    if start < 0 or end < start:
        raise ValueError(f"{page}: no {BLOCK_START} ... {BLOCK_END} section to replace")
    page.write_text(text[:start] + block + text[end + len(BLOCK_END):], encoding="utf-8")


def write(result: dict, out: Path, with_plots: bool = True) -> None:
    """results.json; with aggregates, results.md (and plots)."""
    write_result(out, "results", result, markdown(result) if result.get("aggregate") else None, echo=False)
    if result.get("aggregate") and with_plots:
        plots(result, out)


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description="Re-render results.md and plots from a benchmarks.e2e.generate "
                                 "results.json")
    ap.add_argument("results", help="results.json of benchmarks.e2e.generate")
    ap.add_argument("--page", default=None, help=f"also rewrite the generated results block (between the "
                    f"{BLOCK_START} markers) of this page, e.g. {PAGE}")
    args = ap.parse_args(argv)
    path = Path(args.results)
    result = json.loads(path.read_text())
    result["aggregate"] = aggregate(result["prompts"], result["settings"]["variants"],
                                    result["settings"]["loop_threshold"])
    write(result, path.parent)
    if args.page:
        update_page(Path(args.page), results_block(result, source=args.results, page=args.page))
        print(f"rewrote the results block of {args.page}", file=sys.stderr)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
