"""End-to-end tokens/s: plain greedy, transformers' prompt lookup and lookup_decode, side by side in one process.

    python -m benchmarks.e2e.generate --n-per-workload 1 --max-new-tokens 32      # smoke test
    python -m benchmarks.e2e.generate --n-per-workload 10 --max-new-tokens 256 --repeats 2
    python -m benchmarks.e2e.generate --model qwen2.5-coder-0.5b --dtype auto --workloads code_edit   # the code model
    python -m benchmarks.e2e.generate --temperature 0.7 --workloads code_edit summarization    # sampling

Per prompt, every variant runs `--repeats` times, interleaved (order rotated per repeat and per
prompt) after one untimed warm-up request per variant; the median time counts. Greedy decoding by default, so
every variant must give plain's tokens: identity is recorded per prompt. `--temperature T` samples instead
(top_p 0.95, torch seeded per prompt; identity is then not expected: sampling is exact in distribution, not per
seed). The plain output's loop score (share of it covered by an 8-gram repeated from earlier in it) marks
loop-dominated prompts, which every table also shows excluded. The forward cost over 1..64 tokens is measured
in the same process. Writes DIR/results.json (environment, command, per-prompt records, aggregates),
DIR/results.md and PNG plots; results.json is rewritten after every prompt, so an interrupted run keeps what it
measured.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tqdm import tqdm

from benchmarks.harness import report, workloads
from benchmarks.harness.loop import side_by_side
from benchmarks.harness.metrics import accepted_histogram, copy_share
from benchmarks.harness.model import add_model_arguments, device_of
from benchmarks.harness.model import load as load_model
from benchmarks.harness.results import RESULTS
from lookup_decode import measure
from lookup_decode.core.stats import DecodeStats
from lookup_decode.engines.hf.forward import measure_forward_cost
from lookup_decode.engines.hf.ties import classify, first_difference
from lookup_decode.measure import LOOP_THRESHOLD, PLAIN, PROMPT_LOOKUP, Variant, environment, run_variant, warm_up

VARIANTS = {
    "plain": PLAIN,
    "prompt_lookup": PROMPT_LOOKUP,                                                      # transformers, 10 tokens
    "lookup_decode": Variant("lookup_decode", lookup={"k": 32}),                         # defaults: adaptive
    "lookup_decode_fixed10": Variant("lookup_decode_fixed10", lookup={"k": 10, "adaptive": False}),
    "lookup_decode_fixed32": Variant("lookup_decode_fixed32", lookup={"k": 32, "adaptive": False}),
    "lookup_decode_chain": Variant("lookup_decode_chain", lookup={"k": 32, "tree_width": 1}),     # no trees
    "lookup_decode_tree2": Variant("lookup_decode_tree2", lookup={"k": 32, "tree_width": 2}),
}
DEFAULT_VARIANTS = ["plain", "prompt_lookup", "lookup_decode", "lookup_decode_fixed10"]
CATEGORIES = ["code_edit", "editeval", "summarization", "rag", "qa", "translation", "math_reasoning", "mt_bench",
              "clapnq", "mt_redundant", "humaneval", "qmsum"]
LONG = list(workloads.LONG)
LONG_PROMPT_TOKENS = 6144
COST_SIZES = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 28, 33, 40, 48, 56, 65]
TOP_P = 0.95                       # with --temperature > 0
select_prompts = workloads.select  # the name tests/test_scaling.py calls


def sampling(temperature: float) -> dict:
    """generate() kwargs of a temperature: {} for greedy (0)."""
    return {} if temperature == 0 else {"do_sample": True, "temperature": temperature, "top_p": TOP_P}


def classified_differences(model, ids, plain: list[int], runs: list) -> list[dict]:
    """Each distinct greedy output of a variant's repeats that parts from plain's, its first difference classified
    (`ties.classify`: a bfloat16 near-tie or not) with the repeats that gave it. In bf16 a verify forward over
    several tokens rounds differently from plain's 1-token forwards, so an output may part at a near-tie and
    then decode a different text: its time is not a time for plain's text."""
    found: dict[tuple, dict] = {}
    for i, r in enumerate(runs):
        if r.tokens == plain:
            continue
        key = tuple(r.tokens)
        if key not in found:
            d = classify(model, ids[0], plain, r.tokens)
            found[key] = {"repeats": [], "position": d.position, "plain_token": d.plain, "other_token": d.lookup,
                          "gap_1": d.gaps[0], "gap_wide": d.gaps[1], "near_tie": d.near_tie}
        found[key]["repeats"].append(i)
    return list(found.values())


def prompt_record(req, ids, runs: dict[str, list], names: list[str], tokenizer, first_token_s: float = 0.0,
                  differences: dict[str, list] | None = None) -> dict:
    """Everything measured for one prompt: per variant median time, tokens/s, identity, stats, the classified
    differences from plain's output (greedy); and the same ratios on the time after the first token (each
    variant's seconds less plain's for one token: the prefill, which drafting cannot speed up)."""
    plain = runs["plain"][0]
    rec = {"category": req.category, "id": req.id, "prompt_tokens": int(ids.shape[1]), "first_token_s": first_token_s,
           "loop_score": measure.loop_score(plain.tokens), "copy_share": copy_share(ids[0].tolist(), plain.tokens),
           "plain_tokens": plain.tokens,
           "plain_text": tokenizer.decode(plain.tokens, skip_special_tokens=True), "variants": {}}
    for name in names:
        rs = runs[name]
        seconds = sorted(r.seconds for r in rs)[len(rs) // 2]
        v = {"seconds": seconds, "seconds_all": [r.seconds for r in rs], "new_tokens": len(rs[0].tokens),
             "tokens_per_second": len(rs[0].tokens) / seconds,
             "identical": all(r.tokens == plain.tokens for r in rs),
             "first_mismatch": first_difference(rs[0].tokens, plain.tokens)}
        if differences and differences.get(name):
            v["differences"] = differences[name]
        if rs[0].stats is not None:
            merged = DecodeStats()
            for r in rs:
                merged.merge(r.stats)
            v["stats"] = merged.as_dict()
            v["accepted_histogram"] = accepted_histogram(merged)
        rec["variants"][name] = v
    pairs = {n: (v["new_tokens"], v["seconds"]) for n, v in rec["variants"].items()}    # (tokens, seconds)
    after = {n: (t - 1, s - first_token_s) for n, (t, s) in pairs.items()}
    for base in ("plain", "prompt_lookup"):
        if base in names:
            others = [n for n in names if n != base]
            rec[f"speedup_vs_{base}"] = {n: measure.speedup(pairs[base], pairs[n]) for n in others}
            rec[f"after_first_vs_{base}"] = {n: measure.speedup(after[base], after[n]) for n in others
                                             if min(after[base]) > 0 and after[n][1] > 0}
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(ap, device=True)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); else sampling with top_p "
                    f"{TOP_P}, the same settings for every variant")
    ap.add_argument("--workloads", nargs="+", default=CATEGORIES + LONG, choices=list(workloads.WORKLOADS),
                    help="default: every category, the long-context aider_refactor included")
    ap.add_argument("--include-long", action="store_true", help="add aider_refactor to --workloads")
    ap.add_argument("--n-per-workload", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-prompt-tokens", type=int, default=4096, help="skip longer prompts (default 4096)")
    ap.add_argument("--long-prompt-tokens", type=int, default=LONG_PROMPT_TOKENS,
                    help=f"prompt cap of the long-context workloads (aider_refactor; default {LONG_PROMPT_TOKENS}: "
                    "the default model's context is 8,192 tokens, and shorter prompts keep a CPU run's prefill "
                    "short; longer contexts: benchmarks/e2e/scaling.py)")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per prompt and variant (median; default 1)")
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS),
                    help="plain always runs (the reference)")
    ap.add_argument("--loop-threshold", type=float, default=LOOP_THRESHOLD)
    ap.add_argument("--seed", type=int, default=0, help="prompt selection order")
    ap.add_argument("--out", default=str(RESULTS / "generate"), help="output folder")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)

    import torch

    device = device_of(args)
    names = ["plain"] + [v for v in dict.fromkeys(args.variants) if v != "plain"]
    variants = [Variant(v.name, v.lookup, {**v.generate_kwargs, **sampling(args.temperature)})
                for v in (VARIANTS[n] for n in names)]
    by_name = {v.name: v for v in variants}
    names_workloads = list(dict.fromkeys(args.workloads + (LONG if args.include_long else [])))

    t = time.perf_counter()
    model, tokenizer = load_model(args, device)
    print(f"model loaded in {time.perf_counter() - t:.0f}s", file=sys.stderr)
    context = getattr(model.config, "max_position_embeddings", None)
    chosen, skipped = workloads.select(names_workloads, tokenizer, args.n_per_workload, args.max_prompt_tokens,
                                       context=context, max_new_tokens=args.max_new_tokens, seed=args.seed,
                                       long_prompt_tokens=args.long_prompt_tokens)
    if not chosen:
        raise SystemExit("no prompt fits --max-prompt-tokens")
    chosen = [(req, ids.to(device)) for req, ids in chosen]

    # Untimed warm-up: allocations, numba JIT, lookup_decode's one-time forward-cost calibration per k.
    for v in tqdm(variants, desc="warm-up", leave=False):
        warm_up(model, chosen[0][1], v, args.max_new_tokens)
    lengths = sorted(ids.shape[1] for _, ids in chosen)
    median_prompt = next(ids for _, ids in chosen if ids.shape[1] == lengths[len(lengths) // 2])
    forward_cost = {"context_tokens": int(median_prompt.shape[1]), "sizes": COST_SIZES,
                    "seconds": measure_forward_cost(model, median_prompt, COST_SIZES)}

    result = {"environment": environment(model, device, args.threads, args.model),
              "settings": {"max_new_tokens": args.max_new_tokens, "max_prompt_tokens": args.max_prompt_tokens,
                           "long_prompt_tokens": args.long_prompt_tokens,
                           "n_per_workload": args.n_per_workload, "temperature": args.temperature,
                           "repeats": args.repeats, "seed": args.seed,
                           "workloads": names_workloads, "variants": names, "loop_threshold": args.loop_threshold,
                           "variant_descriptions": [v.describe() for v in variants]},
              "forward_cost": forward_cost, "skipped": skipped, "prompts": [], "partial": True}
    out = Path(args.out)
    bar = tqdm(total=len(chosen) * len(variants) * args.repeats, desc="generate", unit="run")
    for i, (req, ids) in enumerate(chosen):
        bar.set_postfix_str(f"{req.category} ({ids.shape[1]} prompt tokens)")
        if args.temperature:
            torch.manual_seed(args.seed + i)
        runs = side_by_side(names, lambda name: run_variant(model, ids, by_name[name], args.max_new_tokens),
                            args.repeats, offset=i, progress=bar.update)
        first = sorted(run_variant(model, ids, by_name["plain"], 1).seconds for _ in range(args.repeats))
        differences = {} if args.temperature else {   # sampled outputs are not expected to be plain's
            n: classified_differences(model, ids, runs["plain"][0].tokens, runs[n]) for n in names if n != "plain"}
        result["prompts"].append(prompt_record(req, ids, runs, names, tokenizer, first[len(first) // 2], differences))
        report.write(result, out, with_plots=False)
    bar.close()

    result["partial"] = False
    result["aggregate"] = report.aggregate(result["prompts"], names, args.loop_threshold)
    report.write(result, out, with_plots=not args.no_plots)
    print(report.markdown(result))
    print(f"\nwrote {out}/results.json, results.md" + ("" if args.no_plots else " and plots"), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
