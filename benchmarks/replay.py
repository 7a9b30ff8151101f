"""Offline replay of drafting proposers on real (prompt, output) pairs: acceptance without a model.

    python -m benchmarks.replay                      # all sets with real outputs, caps 10 and 32
    python -m benchmarks.replay --limit 20           # quick: 20 pairs per set

Each pair is tokenized with the default model's tokenizer (prompt through the chat template, the
output as plain text) and replayed with `lookup_decode.bench.replay`: at every step the proposer
drafts up to `cap` tokens, the "verifier" accepts the longest prefix equal to the true output plus
one bonus/correction token, and the emitted tokens are fed back to the proposer. Conventions are
those of `DecodeStats`: mean accepted length counts the bonus token; per-position acceptance is
steps that kept draft position i over steps that drafted anything (vLLM's convention).

Proposers: lookup_decode's SuffixIndex (default LookupConfig), transformers' prompt lookup, vLLM's n-gram rule
(its default 5..5 and a 2..5 setting), SuffixDecoding (ArcticInference's rule, vLLM defaults), and the
context-copy ceiling (an oracle; see baselines.py). Ablations of lookup_decode's rules: `ablate_no_resync`
(local re-sync after a miss off: earliest occurrence), `ablate_substitution_key` (a tolerant key that
lost; benchmarks/ablations.py), and `selection_oracle`, the bound of any rule choosing among the
occurrences of the current suffix.
With --cost-curve (a bench_generate results.json holding `forward_cost`), each step is also priced
as one forward over draft + 1 tokens on that machine, which adds an estimated speed-up column and
the adaptive (cost-aware) lookup_decode policy.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import workloads
from benchmarks.ablations import SubstitutionKey
from benchmarks.baselines import (ContextCopyOracle, SelectionOracle, SuffixDecoding, TransformersPromptLookup,
                                  VllmNgram)
from lookup_decode.bench import (chat_ids, environment, estimated_speedup, load_tokenizer, replay,
                                 spread)
from lookup_decode.config import LookupConfig
from lookup_decode.index import SuffixIndex
from lookup_decode.policy import CostCurve, DraftPolicy
from lookup_decode.stats import DecodeStats

SETS = ["cnn_dm", "hagrid", "code_edit", "mt_redundant", "editeval", "clapnq"]
CAPS = [10, 32]
RESULTS = Path(__file__).resolve().parent / "results"

# name -> (prompt int32 [T], output int32 [n], cap, eos ids) -> proposer
PROPOSERS = {
    "lookup_decode": lambda p, o, cap, eos: SuffixIndex(p, min_match=LookupConfig.min_match,
                                                        max_match=LookupConfig.max_match, eos_token_ids=eos),
    "transformers_pld": lambda p, o, cap, eos: TransformersPromptLookup(p, num_output_tokens=cap,
                                                                        max_matching_ngram_size=2, eos_token_ids=eos),
    "vllm_ngram_5_5": lambda p, o, cap, eos: VllmNgram(p, k=cap, min_n=5, max_n=5),
    "vllm_ngram_2_5": lambda p, o, cap, eos: VllmNgram(p, k=cap, min_n=2, max_n=5),
    "suffix_decoding": lambda p, o, cap, eos: SuffixDecoding(p, k=cap),
    "context_copy_ceiling": lambda p, o, cap, eos: ContextCopyOracle(p, o),
    # Ablations of lookup_decode's rules (issue 8): each mechanism off, or a variant that lost.
    "ablate_no_resync": lambda p, o, cap, eos: SuffixIndex(p, min_match=LookupConfig.min_match,
                                                           max_match=LookupConfig.max_match, eos_token_ids=eos,
                                                           resync_window=0),
    "ablate_substitution_key": lambda p, o, cap, eos: SubstitutionKey(p, min_len=2, eos_token_ids=eos,
                                                                      min_match=LookupConfig.min_match,
                                                                      max_match=LookupConfig.max_match),
    # Bound of any occurrence-choosing rule (knows the future; see baselines.SelectionOracle).
    "selection_oracle": lambda p, o, cap, eos: SelectionOracle(p, o),
}
ADAPTIVE = "lookup_decode_adaptive"


def load_pairs(names: list[str], tokenizer, limit: int | None) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    """Per set: (prompt ids, output ids) for requests with a real reference output."""
    pairs = {}
    for name in names:
        reqs = [r for r in workloads.load(name) if r.reference and r.reference.strip()]
        if limit is not None:
            reqs = reqs[:limit]
        pairs[name] = [(chat_ids(tokenizer, r.messages)[0].numpy().astype(np.int32),
                        np.asarray(tokenizer(r.reference, add_special_tokens=False)["input_ids"], dtype=np.int32))
                       for r in tqdm(reqs, desc=f"tokenize {name}", leave=False)]
    return pairs


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


def summarize(total: DecodeStats, per_pair: list[float], build_s: float, prompt_tokens: int,
              cost: CostCurve | None) -> dict:
    drafted_steps = sum(1 for d in total.draft_lengths if d > 0)
    reaching = [sum(1 for d in total.draft_lengths if d > i) for i in range(len(total.accepted_at))]
    row = {"pairs": len(per_pair), "steps": total.steps, "emitted": total.new_tokens, "drafted": total.drafted,
           "accepted": total.accepted, "mean_accepted_length": total.mean_accepted_length,
           "acceptance_rate": total.acceptance_rate,
           "drafted_per_emitted": total.drafted / max(total.new_tokens, 1),
           "us_per_step": 1e6 * total.proposer_s / max(total.steps, 1),
           "build_us_per_prompt_token": 1e6 * build_s / max(prompt_tokens, 1),
           "accepted_at": total.accepted_at, "steps_drafting": drafted_steps, "drafts_reaching": reaching,
           "per_position_acceptance": [a / max(drafted_steps, 1) for a in total.accepted_at],
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
        lines += [f"## cap {cap}: per-position acceptance, all sets pooled (kept at position i / steps that drafted)",
                  "", "| proposer | " + " | ".join(f"pos {i}" for i in (1, 2, 4, 8, 16, 32) if i <= cap) + " |",
                  "|---|" + "---|" * len([i for i in (1, 2, 4, 8, 16, 32) if i <= cap])]
        for n in names:
            if ("all", n, cap) not in get:
                continue
            acc = get[("all", n, cap)]["per_position_acceptance"]
            lines.append(f"| {n} | " + " | ".join(f"{acc[i - 1]:.2f}" if i - 1 < len(acc) else "0.00"
                                                  for i in (1, 2, 4, 8, 16, 32) if i <= cap) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sets", nargs="+", default=SETS, help=f"workloads with real outputs (default: {' '.join(SETS)})")
    ap.add_argument("--limit", type=int, default=None, help="at most this many pairs per set")
    ap.add_argument("--caps", type=int, nargs="+", default=CAPS, help="draft caps (default 10 32)")
    ap.add_argument("--proposers", nargs="+", default=list(PROPOSERS), choices=list(PROPOSERS))
    ap.add_argument("--model", default=None, help="tokenizer source: .gguf file or model folder (default model)")
    ap.add_argument("--cost-curve", default=None,
                    help="results.json of bench_generate: price steps with its forward cost; adds the adaptive policy")
    ap.add_argument("--out", default=str(RESULTS / "replay"), help="output folder (replay.json, replay.md)")
    args = ap.parse_args(argv)

    tokenizer = load_tokenizer(args.model)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    pairs = load_pairs(args.sets, tokenizer, args.limit)
    SuffixIndex([1, 2, 1, 2], min_match=1).propose(2)  # compile the index kernels before timing
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
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "replay.json").write_text(json.dumps(result, indent=1))
    (out / "replay.md").write_text(markdown(result))
    print(markdown(result))
    print(f"\nwrote {out / 'replay.json'} and {out / 'replay.md'}", file=sys.stderr)
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
    out = {"pairs": sum(r["pairs"] for r in rows), "steps": total.steps, "emitted": total.new_tokens,
           "drafted": total.drafted, "accepted": total.accepted, "mean_accepted_length": total.mean_accepted_length,
           "acceptance_rate": total.acceptance_rate, "drafted_per_emitted": total.drafted / max(total.new_tokens, 1),
           "us_per_step": 1e6 * total.proposer_s / max(total.steps, 1),
           "accepted_at": total.accepted_at, "steps_drafting": drafted_steps, "drafts_reaching": reaching,
           "per_position_acceptance": [a / max(drafted_steps, 1) for a in total.accepted_at]}
    if cost is not None:
        # modelled times add up across sets: speed-up of the pooled work
        plain = sum(r["emitted"] for r in rows) * cost(1)
        est = sum(r["emitted"] * cost(1) / r["estimated_speedup"] for r in rows)
        out["estimated_speedup"] = plain / est
    return out


if __name__ == "__main__":
    sys.exit(main())
