"""Markdown tables and PNG plots of the scaling study (`benchmarks.e2e.scaling`), one of each per part."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lookup_decode.core.config import LookupConfig
from lookup_decode.measure import LOOP_THRESHOLD

# The study's grid: `benchmarks.e2e.scaling` runs it, this module renders what it measured.
K = LookupConfig.k
LENGTHS = [8, 16, 32, 64, 128, 256, 512, 1024]
SHARES = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
PROPOSERS = ["lookup_decode", "transformers_pld", "context_copy_ceiling"]


def _cell(s: dict | None) -> str:
    return "–" if not s or not s.get("n") else f"x{s['median']:.2f} [{s['q1']:.2f}–{s['q3']:.2f}] n={s['n']}"


def _length_table(summary: dict, title: str) -> list[str]:
    lines = [f"### {title}", "", "| | " + " | ".join(f"L={L}" for L in LENGTHS) + " |",
             "|---|" + "---:|" * len(LENGTHS)]
    for group, by_l in summary.items():
        lines.append(f"| {group} | " + " | ".join(_cell(by_l[str(L)]) for L in LENGTHS) + " |")
    return lines + [""]


def _measured_table(measured: list[dict]) -> list[str]:
    def x(v):
        return "–" if v is None else f"x{v:.2f}"
    lines = ["Speed-up: measured tokens/s ratio of the whole request; decode only: the same without the prefill "
             "(lookup_decode's measured prefill time taken off both); projected: this output replayed, priced with "
             "the cost grid (decode only).", "",
             "| category | id | context tokens | new tokens | loop score | copy share | speed-up | decode only | "
             "projected, same output |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for m in measured:
        share = "–" if m["copy_share"] is None else f"{m['copy_share']:.2f}"
        lines.append(f"| {m['category']} | {m['id']} | {m['context_tokens']} | {m['new_tokens']} | "
                     f"{m['loop_score']:.2f} | {share} | {x(m['speedup'])} | {x(m['decode_speedup'])} | "
                     f"{x(m['projected_same_output'])} |")
    return lines + [""]


def markdown(part: str, result: dict, header: list[str]) -> str:
    lines = list(header)
    if part == "output_length":
        lines += ["# Speed-up vs output length (speed-up after the first L new tokens)", "",
                  "Cells: median [quartiles] over the prompts whose output reached L tokens (fewer as L grows). "
                  "Measured times include the prompt's prefill (what a user waits for); projected ones do not.", ""]
        lines += _length_table(result["measured_summary"], "Measured end to end, default model, this machine "
                                                          "(all prompts)")
        lines += _length_table(result["measured_summary_without_loops"], "Measured, without loop-dominated prompts")
        lines += _length_table(result["projected_summary"], "Projected: replay on real large-model outputs, "
                                                           "this machine's forward cost")
    elif part == "context_length":
        lines += ["# Speed-up vs context length (Aider refactors, whole file re-emitted)", "",
                  "Projected: replay of the mechanical after-file with other Aider files before the task; each "
                  "step priced with the forward cost measured on this machine at that context (synthetic KV "
                  "cache). Measured: end-to-end aider_refactor prompts of the e2e.generate run (the model's own "
                  "output, up to its max new tokens).", "",
                  "| target | context tokens | " + " | ".join(PROPOSERS) + " | ours: mean acc. len | ours: µs/step |",
                  "|---|---:|" + "---:|" * (len(PROPOSERS) + 2)]
        rows = result["projected"]
        for key in dict.fromkeys((r["target"], r["context_tokens"]) for r in rows):
            got = {r["proposer"]: r for r in rows if (r["target"], r["context_tokens"]) == key}
            ours = got["lookup_decode"]
            lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(f"x{got[p]['speedup']:.2f}" for p in PROPOSERS)
                         + f" | {ours['mean_accepted_length']:.2f} | {ours['us_per_step']:.0f} |")
        c = result["cost"]
        lines += ["", "Forward cost measured on this machine (synthetic cache):", "",
                  "| context | " + " | ".join(str(int(x)) for x in c["contexts"]) + " |",
                  "|---|" + "---:|" * len(c["contexts"]),
                  "| 1 token, ms | " + " | ".join(f"{x:.0f}" for x in c["cost_1_ms"]) + " |",
                  "| 16 tokens / 1 token | " + " | ".join(f"{x:.2f}" for x in c["cost_16_over_1"]) + " |",
                  f"| {K + 1} tokens / 1 token | " + " | ".join(f"{x:.2f}" for x in c["cost_33_over_1"]) + " |", ""]
        check = result["cost_grid"].get("check")
        if check:
            lines += [f"Check at context {check['context']}: the synthetic cache against a real prefill of real "
                      "text (ms per forward):", "", "| tokens | " + " | ".join(map(str, check["sizes"])) + " |",
                      "|---|" + "---:|" * len(check["sizes"]),
                      "| real prefill | " + " | ".join(f"{1e3 * x:.0f}" for x in check["real_prefill"]) + " |",
                      "| synthetic | " + " | ".join(f"{1e3 * x:.0f}" for x in check["synthetic"]) + " |", ""]
        if result["measured"]:
            lines += ["Measured end to end (e2e.generate, aider_refactor: the default model's own output), beside "
                      "the projection for that same output:", ""] + _measured_table(result["measured"])
    else:
        lines += ["# Speed-up vs share of copied text", "",
                  "Copy share: share of output tokens covered by an 8-token sequence found in the prompt.", "",
                  "### Projected, controlled outputs (CNN/DM articles; copied spans + unrelated real text)", "",
                  "| built share | measured share | " + " | ".join(PROPOSERS) + " |",
                  "|---:|---:|" + "---:|" * len(PROPOSERS)]
        rows = result["controlled"]
        for share in SHARES:
            got = [r for r in rows if r["share"] == share]
            if not got:
                continue
            med = {p: np.median([r["speedup"] for r in got if r["proposer"] == p]) for p in PROPOSERS}
            lines.append(f"| {share:.1f} | {np.median([r['measured_share'] for r in got]):.2f} | "
                         + " | ".join(f"x{med[p]:.2f}" for p in PROPOSERS) + " |")
        lines += ["", "### Projected, real large-model outputs bucketed by copy share (lookup_decode)", "",
                  "| copy share | pairs | speed-up median [quartiles] |", "|---|---:|---:|"]
        lines += [f"| {b['lo']:.1f}–{b['hi']:.1f} | {b['n']} | {_cell(b)} |" for b in result["real_buckets"]]
        if result["measured"]:
            lines += ["", "### Measured end to end (e2e.generate prompts, without loop-dominated ones)", "",
                      "| copy share of the model's output | prompts | speed-up (whole request) |", "|---|---:|---:|"]
            lines += [f"| {b['lo']:.1f}–{b['hi']:.1f} | {b['n']} | {_cell(b)} |"
                      for b in result["measured_buckets_without_loops"]]
            lines += ["", "### Check of the projection: every measured prompt beside the projection for its own "
                      "output", ""] + _measured_table(result["measured"])
    return "\n".join(lines) + "\n"


def plot(part: str, result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    if part == "output_length":
        for ax, key, title in ((axes[0], "measured_summary_without_loops",
                                "measured end to end (default model; loops excluded)"),
                               (axes[1], "projected_summary", "projected: replay of real large-model outputs")):
            for j, (group, by_l) in enumerate(result[key].items()):
                pts = [(L, by_l[str(L)]) for L in LENGTHS if by_l[str(L)]["n"]]
                if not pts:
                    continue
                xs = [L for L, _ in pts]
                ax.plot(xs, [s["median"] for _, s in pts], "o-", color=f"C{j}", label=group)
                ax.fill_between(xs, [s["q1"] for _, s in pts], [s["q3"] for _, s in pts], color=f"C{j}", alpha=0.15)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("first L new tokens")
            ax.set_title(title, fontsize=10)
        axes[0].set_ylabel("speed-up vs plain greedy (median, quartile band)")
    elif part == "context_length":
        rows = result["projected"]
        for j, name in enumerate(PROPOSERS):
            mine = [r for r in rows if r["proposer"] == name]
            axes[0].scatter([r["context_tokens"] for r in mine], [r["speedup"] for r in mine], s=12, color=f"C{j}",
                            alpha=0.5)
            by_t = {}        # targets share the context grid: median per grid step (nearest grid point)
            grid = result["cost"]["contexts"]
            for r in mine:
                by_t.setdefault(min(grid, key=lambda c: abs(c - r["context_tokens"])), []).append(r)
            steps = [by_t[g] for g in sorted(by_t)]
            axes[0].plot([np.median([r["context_tokens"] for r in rs]) for rs in steps],
                         [np.median([r["speedup"] for r in rs]) for rs in steps], "-", color=f"C{j}",
                         label=f"{name} (projected, median over tasks)")
        measured = [m for m in result["measured"] if m["decode_speedup"] is not None]
        if measured:
            ctx = [m["context_tokens"] for m in measured]
            axes[0].scatter(ctx, [m["decode_speedup"] for m in measured], marker="x", color="k",
                            label="measured end to end, decode only (model's own output)")
            axes[0].scatter(ctx, [m["projected_same_output"] for m in measured], marker="+", s=60, color="gray",
                            label="projected for that same output")
        axes[0].set_xscale("log", base=2)
        axes[0].set(xlabel="context tokens", ylabel="speed-up vs plain greedy")
        axes[0].set_title("Aider refactors, whole file re-emitted", fontsize=10)
        c = result["cost"]
        axes[1].plot(c["contexts"], c["cost_16_over_1"], "o-", label="cost(16 tokens) / cost(1 token)")
        axes[1].plot(c["contexts"], c["cost_33_over_1"], "o-", label=f"cost({K + 1} tokens) / cost(1 token)")
        ax2 = axes[1].twinx()
        ax2.plot(c["contexts"], c["cost_1_ms"], "s:", color="gray", label="cost(1 token), ms (right)")
        ax2.set_ylabel("ms per 1-token forward")
        axes[1].set_xscale("log", base=2)
        axes[1].set_xlabel("context tokens")
        axes[1].set_title("forward cost measured on this machine (synthetic KV cache)", fontsize=10)
        ax2.legend(loc="lower right", fontsize=8)
    else:
        rows = result["controlled"]
        for j, name in enumerate(PROPOSERS):
            xs = [s for s in SHARES if any(r["share"] == s for r in rows)]
            axes[0].plot(xs, [np.median([r["speedup"] for r in rows if r["share"] == s and r["proposer"] == name])
                              for s in xs], "o-", color=f"C{j}", label=name)
        axes[0].set_xlabel("share of output copied from the prompt (controlled)")
        axes[0].set_ylabel("projected speed-up vs plain greedy")
        axes[0].set_title("projected: controlled copy share (CNN/DM + unrelated real text)", fontsize=10)
        sets = list(dict.fromkeys(r["set"] for r in result["real"]))
        for j, s in enumerate(sets):
            mine = [r for r in result["real"] if r["set"] == s]
            axes[1].scatter([r["copy_share"] for r in mine], [r["speedup"] for r in mine], s=10, color=f"C{j}",
                            alpha=0.6, label=f"{s} (projected)")
        clean = [m for m in result["measured"] if m["loop_score"] <= LOOP_THRESHOLD and m["decode_speedup"]]
        if clean:
            axes[1].scatter([m["copy_share"] for m in clean], [m["decode_speedup"] for m in clean], marker="x",
                            color="k", label="measured end to end, decode only (default model's own output)")
        axes[1].set_xlabel("copy share of the output")
        axes[1].set_title("real outputs: projected (large models) and measured (default model)", fontsize=10)
    for ax in axes:
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
