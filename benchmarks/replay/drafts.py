"""Offline replay of drafting proposers on real (prompt, output) pairs: acceptance without a model.

    python -m benchmarks.replay.drafts                      # all sets with real outputs, caps 10 and 32
    python -m benchmarks.replay.drafts --limit 20           # quick: 20 pairs per set
    python -m benchmarks.replay.drafts --tree-widths 1 2 4  # trees of candidates: best of w branches
    python -m benchmarks.replay.drafts --measure-priors --limit 60 --caps 32       # acceptance per match length

Each pair is tokenized with the default model's tokenizer (prompt through the chat template, the
output as plain text) and replayed with `lookup_decode.engines.replay.replay`: at every step the proposer
drafts up to `cap` tokens, the "verifier" accepts the longest prefix equal to the true output plus
one bonus/correction token, and the emitted tokens are fed back to the proposer. Conventions are
those of `DecodeStats`: mean accepted length counts the bonus token; per-position acceptance is
steps that kept draft position i over steps that drafted anything (vLLM's convention).

Proposers: lookup_decode's SuffixIndex (default LookupConfig), transformers' prompt lookup, vLLM's n-gram rule
(its default 5..5 and a 2..5 setting), SuffixDecoding (ArcticInference's rule, vLLM defaults), and the
context-copy ceiling (an oracle; see `benchmarks.harness.baselines`). Ablations of lookup_decode's rules:
`ablate_no_resync` (local re-sync after a miss off: earliest occurrence), `ablate_substitution_key` (a tolerant
key that lost; baselines.SubstitutionKey), and `selection_oracle`, the bound of any rule choosing among the
occurrences of the current suffix.
With --cost-curve (a `benchmarks.e2e.generate` results.json holding `forward_cost`), each step is also priced
as one forward over draft + 1 tokens on that machine, which adds an estimated speed-up column and
the adaptive (cost-aware) lookup_decode policy.

Studies on the same pairs, each instead of the proposer comparison:
* --tree-widths: what trees of candidates could add. Branch 1 is lookup_decode's draft; branches
  2..w copy from other earlier occurrences of the last token (`lookup_decode.sources.tree.branches`). The
  "verifier" keeps the longest prefix of any branch equal to the true continuation, plus one token
  (what tree verification keeps, greedy). Writes tree_potential.{json,md}: tokens per step and tree
  nodes (draft tokens) per step, the forward size a tree costs.
* --measure-priors: acceptance per match-length bucket of lookup_decode's drafts (a1 = P(first draft
  token kept), a2 = P(next kept | previous kept)), pooled over the sets. Printed. (The acceptance model has no
  priors since issue 27, `core.acceptance`; its calibration is `benchmarks.replay.calibration`'s study.)
No model and no timing in any of them (µs per step aside).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from benchmarks.harness import baselines
from benchmarks.harness.results import RESULTS, write_result
from benchmarks.harness.workloads import eos_of, real_pairs
from lookup_decode.core.acceptance import N_BUCKETS, bucket
from lookup_decode.core.config import LookupConfig
from lookup_decode.core.cost import CostCurve
from lookup_decode.core.draft import kept_prefix
from lookup_decode.core.index import SuffixIndex
from lookup_decode.core.policy import DraftPolicy
from lookup_decode.core.stats import DecodeStats
from lookup_decode.core.tokens import as_token_array
from lookup_decode.engines.hf.models import load_tokenizer
from lookup_decode.engines.replay import estimated_speedup, replay
from lookup_decode.measure import command_line, environment, spread
from lookup_decode.sources.tree import branches

SETS = ["cnn_dm", "hagrid", "code_edit", "mt_redundant", "editeval", "clapnq"]
CAPS = [10, 32]

MATCH = {"min_match": LookupConfig.min_match, "max_match": LookupConfig.max_match}     # the package's defaults
# name -> (prompt int32 [T], output int32 [n], cap, eos ids) -> proposer
PROPOSERS = {
    "lookup_decode": lambda p, o, cap, eos: SuffixIndex(p, eos_token_ids=eos, **MATCH),
    "transformers_pld": lambda p, o, cap, eos: baselines.TransformersPromptLookup(p, num_output_tokens=cap,
                                                                                  max_matching_ngram_size=2,
                                                                                  eos_token_ids=eos),
    "vllm_ngram_5_5": lambda p, o, cap, eos: baselines.VllmNgram(p, k=cap, min_n=5, max_n=5),
    "vllm_ngram_2_5": lambda p, o, cap, eos: baselines.VllmNgram(p, k=cap, min_n=2, max_n=5),
    "suffix_decoding": lambda p, o, cap, eos: baselines.SuffixDecoding(p, k=cap),
    "context_copy_ceiling": lambda p, o, cap, eos: baselines.ContextCopyOracle(p, o),
    # Ablations of lookup_decode's rules (issue 8): each mechanism off, or a variant that lost.
    "ablate_no_resync": lambda p, o, cap, eos: SuffixIndex(p, eos_token_ids=eos, resync_window=0, **MATCH),
    "ablate_substitution_key": lambda p, o, cap, eos: baselines.SubstitutionKey(p, min_len=2, eos_token_ids=eos,
                                                                                **MATCH),
    # Bound of any occurrence-choosing rule (knows the future; see baselines.SelectionOracle).
    "selection_oracle": lambda p, o, cap, eos: baselines.SelectionOracle(p, o),
}
ADAPTIVE = "lookup_decode_adaptive"


def replay_set(pairs, make, cap: int, eos, cost: CostCurve | None = None, adaptive: bool = False) -> dict:
    """Replay every pair of one set with one proposer and cap; merged counts plus per-pair spread.

    adaptive: let lookup_decode's DraftPolicy, priced with `cost`, choose how much of each draft to verify.
    """
    total = DecodeStats()
    per_pair, build_s, prompt_tokens = [], 0.0, 0
    for prompt, output in pairs:
        t = time.perf_counter()
        proposer = make(prompt, output, cap, eos)
        build_s += time.perf_counter() - t
        prompt_tokens += len(prompt)
        stats = replay(proposer, output, cap, DraftPolicy(cap, cost) if adaptive else None)
        per_pair.append(stats.mean_accepted_length)
        total.merge(stats)
    return summarize(total, per_pair, build_s, prompt_tokens, cost)


def counts_row(total: DecodeStats, drafted_steps: int, reaching: list[int]) -> dict:
    """The counts and rates of merged replay stats: a set's row and the pooled `all` row alike."""
    return {"steps": total.steps, "emitted": total.new_tokens, "drafted": total.drafted, "accepted": total.accepted,
            "mean_accepted_length": total.mean_accepted_length, "acceptance_rate": total.acceptance_rate,
            "drafted_per_emitted": total.drafted / max(total.new_tokens, 1),
            "us_per_step": 1e6 * total.proposer_s / max(total.steps, 1),
            "accepted_at": total.accepted_at, "steps_drafting": drafted_steps, "drafts_reaching": reaching,
            "per_position_acceptance": [a / max(drafted_steps, 1) for a in total.accepted_at]}


def summarize(total: DecodeStats, per_pair: list[float], build_s: float, prompt_tokens: int,
              cost: CostCurve | None) -> dict:
    drafted_steps = sum(1 for d in total.draft_lengths if d > 0)
    reaching = [sum(1 for d in total.draft_lengths if d > i) for i in range(len(total.accepted_at))]
    row = {"pairs": len(per_pair), **counts_row(total, drafted_steps, reaching),
           "build_us_per_prompt_token": 1e6 * build_s / max(prompt_tokens, 1),
           "mean_accepted_length_per_pair": spread(per_pair)}
    if cost is not None:
        row["estimated_speedup"] = estimated_speedup(total, cost)
    return row


def load_cost_curve(path: str, max_n: int) -> CostCurve:
    fc = json.loads(Path(path).read_text())["forward_cost"]
    return CostCurve(fc["sizes"], fc["seconds"], max_n)


def markdown(result: dict) -> str:
    rows = result["results"]
    names = list(dict.fromkeys(r["proposer"] for r in rows))
    sets = list(dict.fromkeys(r["set"] for r in rows))
    get = {(r["set"], r["proposer"], r["cap"]): r for r in rows}
    lines = ["# Offline replay of drafting proposers", "",
             f"Command: `{result['environment']['command']}`  ",
             f"Tokenizer: {result['tokenizer']}; pairs per set: {result['pairs']}.  ",
             "Mean accepted length includes the bonus token. Row `all` pools every step of every set, so the "
             "largest sets (code_edit) weigh most. µs per step depend on the machine's load; acceptance does not.", ""]
    metrics = [("mean accepted length (tokens per step)", "mean_accepted_length", "{:.2f}"),
               ("drafted tokens per emitted token", "drafted_per_emitted", "{:.2f}"),
               ("proposer µs per step (propose + extend)", "us_per_step", "{:.1f}")]
    if any("estimated_speedup" in r for r in rows):
        metrics.insert(1, ("estimated speed-up (forward cost of the given machine)", "estimated_speedup", "x{:.2f}"))
    for cap in result["caps"]:
        for title, key, fmt in metrics:
            lines += [f"## cap {cap}: {title}", "", "| set | " + " | ".join(names) + " |",
                      "|---|" + "---|" * len(names)]
            for s in sets:
                cells = [fmt.format(get[(s, n, cap)][key]) if (s, n, cap) in get and key in get[(s, n, cap)]
                         else "" for n in names]
                lines.append(f"| {s} | " + " | ".join(cells) + " |")
            lines.append("")
        positions = [i for i in (1, 2, 4, 8, 16, 32) if i <= cap]
        lines += [f"## cap {cap}: per-position acceptance, all sets pooled (kept at position i / steps that drafted)",
                  "", "| proposer | " + " | ".join(f"pos {i}" for i in positions) + " |",
                  "|---|" + "---|" * len(positions)]
        for n in names:
            if ("all", n, cap) not in get:
                continue
            acc = get[("all", n, cap)]["per_position_acceptance"]
            cells = [f"{acc[i - 1]:.2f}" if i - 1 < len(acc) else "0.00" for i in positions]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------- --tree-widths

def replay_tree(pairs, cap: int, width: int, eos) -> dict:
    """Replay with trees of up to `width` branches; the verifier keeps the best branch's accepted prefix."""
    steps = kept_total = nodes = emitted = 0
    for prompt, output in pairs:
        index = PROPOSERS["lookup_decode"](prompt, output, cap, eos)
        pos, n = 0, len(output)
        while pos < n:
            k = min(cap, n - pos - 1)
            tree = branches(index, index.propose(k).tokens, k, width)
            best = max((kept_prefix(b, output[pos:]) for b in tree), default=0)
            nodes += sum(len(b) for b in tree)
            index.extend(output[pos: pos + best + 1])
            pos += best + 1
            steps += 1
            kept_total += best
        emitted += n
    return {"steps": steps, "emitted": emitted, "mean_accepted_length": 1 + kept_total / max(steps, 1),
            "nodes_per_step": nodes / max(steps, 1)}


def tree_markdown(result: dict) -> str:
    caps, widths, pairs = result["caps"], result["widths"], result["pairs"]
    lines = ["# Trees of candidates: replay potential", "",
             f"Command: `{result['environment']['command']}`  ",
             f"Pairs per set: {pairs}. Cells: tokens per step "
             "(bonus included) / draft tokens in the tree per step. Width 1 = lookup_decode's chain.", ""]
    get = {(r["set"], r["cap"], r["width"]): r for r in result["results"]}
    for cap in caps:
        lines += [f"## cap {cap}", "", "| set | " + " | ".join(f"width {w}" for w in widths) + " |",
                  "|---|" + "---|" * len(widths)]
        for s in pairs:
            lines.append(f"| {s} | " + " | ".join(
                f"{get[(s, cap, w)]['mean_accepted_length']:.2f} / {get[(s, cap, w)]['nodes_per_step']:.1f}"
                for w in widths) + " |")
        lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- --measure-priors

class Recorder:
    """A drafter that passes everything on to `drafter` and keeps each step's (draft, emitted tokens)."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.steps: list[list] = []         # [draft, emitted int32 [e] (None until the step's tokens come)]

    def propose(self, max_tokens: int):
        draft = self.drafter.propose(max_tokens)
        self.steps.append([draft, None])
        return draft

    def extend(self, tokens) -> None:
        if self.steps and self.steps[-1][1] is None:
            self.steps[-1][1] = as_token_array(tokens)
        self.drafter.extend(tokens)


def prior_counts(pairs, cap: int, eos) -> np.ndarray:
    """[bucket, (first kept, first tried, later kept, later tried)] over every drafting step of the replay of
    lookup_decode's SuffixIndex (default rules, every draft verified) on each pair."""
    counts = np.zeros((N_BUCKETS, 4))
    for prompt, output in pairs:
        drafter = Recorder(PROPOSERS["lookup_decode"](prompt, output, cap, eos))
        replay(drafter, output, cap)
        for draft, emitted in drafter.steps:
            if len(draft):
                kept = kept_prefix(draft.tokens, emitted)
                counts[bucket(draft.match_len)] += (kept > 0, 1, max(kept - 1, 0), min(kept, len(draft) - 1))
    return counts


def priors_text(counts: np.ndarray) -> str:
    a1 = counts[:, 0] / np.maximum(counts[:, 1], 1)
    a2 = counts[:, 2] / np.maximum(counts[:, 3], 1)
    lines = ["bucket (match len)   steps   a1 measured   a2 measured"]
    for b in range(len(counts)):
        lo = 1 << b
        label = f">= {lo}" if b == len(counts) - 1 else (f"{lo}" if lo == 1 else f"{lo}-{2 * lo - 1}")
        lines.append(f"{label:>18} {int(counts[b, 1]):>7}   {a1[b]:.2f}          {a2[b]:.2f}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sets", nargs="+", default=SETS, help=f"workloads with real outputs (default: {' '.join(SETS)})")
    ap.add_argument("--limit", type=int, default=None, help="at most this many pairs per set")
    ap.add_argument("--skip", type=int, default=0,
                    help="leave out the first pairs of each set (of those --limit keeps), e.g. the priors' own")
    ap.add_argument("--caps", type=int, nargs="+", default=CAPS, help="draft caps (default 10 32)")
    ap.add_argument("--proposers", nargs="+", default=list(PROPOSERS), choices=list(PROPOSERS))
    ap.add_argument("--model", default=None, help="tokenizer source: .gguf file or model folder (default model)")
    ap.add_argument("--cost-curve", default=None,
                    help="results.json of benchmarks.e2e.generate: price steps with its forward cost; adds the "
                    "adaptive policy")
    study = ap.add_mutually_exclusive_group()
    study.add_argument("--tree-widths", type=int, nargs="+", default=None,
                       help="instead: trees of up to w branches per step (writes tree_potential.json/.md)")
    study.add_argument("--measure-priors", action="store_true",
                       help="instead: print acceptance per match-length bucket")
    ap.add_argument("--out", default=str(RESULTS / "replay"),
                    help="output folder (replay.json, replay.md; tree_potential.json/.md with --tree-widths)")
    args = ap.parse_args(argv)

    tokenizer = load_tokenizer(args.model)
    eos = eos_of(tokenizer)
    pairs = {name: ps[args.skip:] for name, ps in
             real_pairs(tokenizer, args.sets, args.limit, 1, progress=True).items()}
    SuffixIndex([1, 2, 1, 2], min_match=1).propose(2)  # compile the index kernels before timing
    if args.measure_priors:
        print(f"$ {command_line()}")
        for cap in args.caps:
            print(f"cap {cap}:\n" + priors_text(sum(prior_counts(ps, cap, eos) for ps in pairs.values())))
        return 0
    if args.tree_widths:
        rows = [{"set": s, "cap": cap, "width": w, **replay_tree(ps, cap, w, eos)}
                for cap in args.caps for w in args.tree_widths for s, ps in pairs.items()]
        result = {"environment": environment(), "pairs": {s: len(p) for s, p in pairs.items()}, "caps": args.caps,
                  "widths": args.tree_widths, "results": rows}
        write_result(args.out, "tree_potential", result, tree_markdown(result))
        return 0

    proposers = {n: PROPOSERS[n] for n in args.proposers}
    cost = None
    if args.cost_curve:
        cost = load_cost_curve(args.cost_curve, max(args.caps) + 1)
        proposers[ADAPTIVE] = PROPOSERS["lookup_decode"]
    rows = []
    jobs = [(c, n) for c in args.caps for n in proposers]
    for cap, name in tqdm(jobs, desc="replay"):
        pooled_stats = []
        for s, ps in pairs.items():
            row = replay_set(ps, proposers[name], cap, eos, cost, adaptive=name == ADAPTIVE)
            rows.append({"set": s, "proposer": name, "cap": cap, **row})
            pooled_stats.append(row)
        rows.append({"set": "all", "proposer": name, "cap": cap, **pool(pooled_stats, cost)})
    result = {"environment": environment(), "tokenizer": args.model or "default (SmolLM2-135M-Instruct)",
              "pairs": {s: len(p) for s, p in pairs.items()}, "caps": args.caps, "results": rows}
    path = write_result(args.out, "replay", result, markdown(result))
    print(f"\nwrote {path} and {path.with_suffix('.md')}", file=sys.stderr)
    return 0


def pool(rows: list[dict], cost) -> dict:
    """Pool per-set rows (counts add up; rates recomputed from the pooled counts)."""
    total = DecodeStats()
    for r in rows:
        part = DecodeStats(new_tokens=r["emitted"], steps=r["steps"], drafted=r["drafted"], accepted=r["accepted"],
                           accepted_at=list(r["accepted_at"]), proposer_s=r["us_per_step"] * r["steps"] / 1e6)
        total.merge(part)
    drafted_steps = sum(r["steps_drafting"] for r in rows)
    n = max((len(r["drafts_reaching"]) for r in rows), default=0)
    reaching = [sum(r["drafts_reaching"][i] for r in rows if i < len(r["drafts_reaching"])) for i in range(n)]
    out = {"pairs": sum(r["pairs"] for r in rows), **counts_row(total, drafted_steps, reaching)}
    if cost is not None:
        # modelled times add up across sets: speed-up of the pooled work
        plain = sum(r["emitted"] for r in rows) * cost(1)
        est = sum(r["emitted"] * cost(1) / r["estimated_speedup"] for r in rows)
        out["estimated_speedup"] = plain / est
    return out


if __name__ == "__main__":
    sys.exit(main())
