"""Fast apply on transformers: plain greedy, transformers' prompt lookup and lookup_decode without and with
generate(prediction=<the file>), side by side in one process (`python -m benchmarks.e2e.fast_apply`).

    nice -n 10 python -m benchmarks.e2e.fast_apply --requests 1 --sets editeval --max-new-tokens 32 \\
        --out /tmp/fast_apply_smoke                                                       # a smoke run
    python -m benchmarks.e2e.fast_apply --model qwen2.5-coder-0.5b --dtype bfloat16 --repeats 3   # the code model

The workload is benchmarks/vllm/fast_apply.py's, from the same functions (one copy): the first --requests edits of
each set of ../shared/data (LOOKUP_DECODE_DATA) whose file has at most --max-file-tokens tokens, the instruction
and the original file in one user message through the model's chat template (what vLLM's server does with the
client's message), each edit allowed the file's tokens plus a quarter, plus 32, at most --max-new-tokens. The
prediction is the original file, tokenized as `generate(prediction=text, tokenizer=...)` and PredictedOutputs
tokenize it (no special tokens), passed as token ids: `model.generate(..., custom_generate=lookup_decode.generate,
prediction=ids)`.

Per edit, every variant runs --repeats times, interleaved (benchmarks.harness.loop.side_by_side), after one untimed
warm-up run per variant; the median time counts. Greedy: every variant must give plain's tokens, and identity is
recorded per edit; an output that parts from plain's is classified after the timing (a bfloat16 near-tie or not:
generate.classified_differences) and listed in results.md. Per (group, variant), groups being each set, `rewrites`
(edits whose plain output keeps under half of the file's tokens, or of the edit's token budget when that is smaller:
accepted prediction tokens as PredictedOutputs counts them, OpenAI's definition) and `all`: tokens/s, the per-edit
ratios against plain, prompt_lookup and lookup_decode (median, min-max) and the ratio of total throughputs, outputs
identical to plain's, lookup_decode's mean accepted length, and every variant's model forwards (a forward hook; the
prefill included). Writes DIR/results.json (environment, command, per-edit records; rewritten after every edit, so a
run cut short keeps what it measured) and DIR/results.md. The pure parts are tested on a tiny model
(tests/test_bench_e2e_fast_apply.py)."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks.e2e.generate import classified_differences, prompt_record
from benchmarks.harness import report
from benchmarks.harness.loop import side_by_side
from benchmarks.harness.model import add_model_arguments, device_of
from benchmarks.harness.model import load as load_model
from benchmarks.harness.results import RESULTS, write_result
from benchmarks.vllm.fast_apply import REWRITE_SHARE, SETS, load_edits, max_tokens, median_range, messages, number
from lookup_decode import measure
from lookup_decode.engines.vllm.predicted_outputs import prediction_counts
from lookup_decode.measure import PLAIN, PROMPT_LOOKUP, Variant, environment, run_variant, spread, warm_up

OUT = RESULTS / "fast_apply" / "transformers"
PREDICTION = "lookup_decode+prediction"
NAMES = ["plain", "prompt_lookup", "lookup_decode", PREDICTION]
BASES = ("plain", "prompt_lookup", "lookup_decode")     # each later variant's ratios against these


def variants(prediction: list[int], options: dict) -> dict[str, Variant]:
    """The four ways of generating one edit; prediction: the file's token ids, options: lookup_decode's (both
    lookup_decode variants take the same). Example: variants([5, 6], {})[PREDICTION].lookup == {"prediction":
    [5, 6]}."""
    return {"plain": PLAIN, "prompt_lookup": PROMPT_LOOKUP,
            "lookup_decode": Variant("lookup_decode", lookup=dict(options)),
            PREDICTION: Variant(PREDICTION, lookup={**options, "prediction": prediction})}


def describe(options: dict) -> list[str]:
    shown = ", ".join(f"{k}={v}" for k, v in options.items())
    return [PLAIN.describe(), PROMPT_LOOKUP.describe(), f"lookup_decode ({shown or 'defaults'})",
            f"{PREDICTION} ({shown + ', ' if shown else ''}prediction=the file)"]


@contextlib.contextmanager
def forwards(model):
    """Counts the model's forwards while in the block (a forward hook, the same for every variant): yields a list
    whose one item is the count."""
    n = [0]
    handle = model.register_forward_hook(lambda *_: n.__setitem__(0, n[0] + 1))
    try:
        yield n
    finally:
        handle.remove()


def encode(tokenizer, edit: dict):
    """(prompt ids long [1, T], the file's ids as a prediction) of one edit."""
    from lookup_decode.engines.hf.models import chat_ids
    return chat_ids(tokenizer, messages(edit)), tokenizer(edit["file"], add_special_tokens=False)["input_ids"]


def fits(edits: list[dict], tokenizer, context: int | None, cap: int) -> tuple[list[tuple], list[str]]:
    """([(edit, prompt ids, prediction ids)] whose prompt and output budget fit the context, [ids left out])."""
    kept, skipped = [], []
    for e in edits:
        ids, pred = encode(tokenizer, e)
        if context and ids.shape[1] + max_tokens(e, cap) > context:
            skipped.append(e["id"])
        else:
            kept.append((e, ids, pred))
    return kept, skipped


def measure_edit(model, tokenizer, edit: dict, ids, prediction: list[int], options: dict, cap: int, repeats: int,
                 offset: int = 0, progress=None) -> dict:
    """One edit's record: generate.prompt_record's (per variant median seconds, tokens/s, identity with plain,
    lookup_decode's stats, ratios against plain and prompt_lookup), plus the ratios against lookup_decode, each
    variant's model forwards, the edit's file tokens and the prediction counts of plain's output."""
    by_name = variants(prediction, options)
    counts: dict[str, list[int]] = {}

    def run(name):
        with forwards(model) as n:
            got = run_variant(model, ids, by_name[name], max_tokens(edit, cap))
        counts.setdefault(name, []).append(n[0])
        return got

    runs = side_by_side(NAMES, run, repeats, offset=offset, progress=progress)
    plain = runs["plain"][0].tokens          # outputs that part from it are classified after the timing
    rec = prompt_record(SimpleNamespace(category=edit["set"], id=edit["id"]), ids, runs, NAMES, tokenizer,
                        differences={n: classified_differences(model, ids, plain, runs[n]) for n in NAMES[1:]})
    for name in NAMES:
        rec["variants"][name]["forwards"] = counts[name][0]
    pairs = {n: (v["new_tokens"], v["seconds"]) for n, v in rec["variants"].items()}    # (tokens, seconds)
    rec["speedup_vs_lookup_decode"] = {PREDICTION: measure.speedup(pairs["lookup_decode"], pairs[PREDICTION])}
    rec.update(set=edit["set"], file_tokens=len(prediction), max_new_tokens=max_tokens(edit, cap),
               **prediction_counts(prediction, plain))
    return rec


def groups(records: list[dict]) -> dict[str, list[dict]]:
    """Each set's records, `rewrites` (plain's output keeps under REWRITE_SHARE of the file's tokens, or of as many
    as its token budget holds when that is fewer: a short smoke run cuts outputs, not edits) and `all`."""
    out = {name: [r for r in records if r["set"] == name] for name in dict.fromkeys(r["set"] for r in records)}
    out["rewrites"] = [r for r in records if r["accepted_prediction_tokens"]
                       < REWRITE_SHARE * min(r["file_tokens"], r["max_new_tokens"])]
    out["all"] = list(records)
    return {k: v for k, v in out.items() if v}


def summarize(records: list[dict]) -> dict:
    """{group: {"n", variant: harness.report.aggregate_group's row + forwards, speedup_vs_lookup_decode,
    throughput_ratio_vs_lookup_decode (the prediction variant)}}."""
    table = {}
    for group, rs in groups(records).items():
        agg = report.aggregate_group(rs, NAMES)
        for name in NAMES:
            agg[name]["forwards"] = sum(r["variants"][name]["forwards"] for r in rs)
        tokens_seconds = [[(r["variants"][n]["new_tokens"], r["variants"][n]["seconds"]) for r in rs]
                          for n in ("lookup_decode", PREDICTION)]
        agg[PREDICTION]["speedup_vs_lookup_decode"] = spread(r["speedup_vs_lookup_decode"][PREDICTION] for r in rs)
        agg[PREDICTION]["throughput_ratio_vs_lookup_decode"] = measure.throughput_ratio(*tokens_seconds)
        agg["accepted_prediction_tokens"] = sum(r["accepted_prediction_tokens"] for r in rs)
        agg["rejected_prediction_tokens"] = sum(r["rejected_prediction_tokens"] for r in rs)
        table[group] = agg
    return table


def markdown(result: dict) -> str:
    env, a = result["environment"], result["settings"]
    lines = [f"# Fast apply on transformers ({env.get('model')}, {env.get('dtype')}, {env.get('device')})", "",
             f"`{env['command']}`", "",
             f"torch {env.get('torch')}, transformers {env.get('transformers')}, {env.get('cpu')}, torch threads "
             f"{env.get('torch_threads')}; {a['repeats']} timed repeat(s) per edit and variant (median), interleaved "
             "after an untimed warm-up; greedy. Ratios: median (min–max) of the per-edit tokens/s ratios; total: "
             "all tokens / all seconds. Forwards: the model's forward calls, prefill included (a hook), summed "
             "over the group's edits (first repeat). Prediction tokens: the file's tokens that plain's output keeps "
             "(OpenAI's accepted / rejected).", "",
             "Variants: " + "; ".join(f"`{d}`" for d in a["variant_descriptions"]), ""]
    for group, g in result["summary"].items():
        lines += [f"## {group} ({g['n']} edits; prediction tokens {g['accepted_prediction_tokens']} / "
                  f"{g['rejected_prediction_tokens']})", "",
                  "| variant | tok/s | × plain | total × plain | × prompt_lookup | × lookup_decode | total × "
                  "lookup_decode | identical | mean acc. len | forwards |", "|---|---:|---:|---:|---:|---:|---:|---:|"
                  "---:|---:|"]
        for name in NAMES:
            c = g[name]
            x = [median_range(c.get(f"speedup_vs_{b}"), prefix="×") for b in BASES]
            total = [number(c.get(f"throughput_ratio_vs_{b}"), "×{:.2f}") for b in ("plain", "lookup_decode")]
            lines.append(f"| {name} | {number(c['tokens_per_second']['median'], '{:.1f}')} | {x[0]} | {total[0]} | "
                         f"{x[1]} | {x[2]} | {total[1]} | {c.get('identical', g['n'])}/{g['n']} | "
                         f"{number(c.get('mean_accepted_length'))} | {c['forwards']} |")
        lines.append("")
    lines += ["## Per edit", "", "| set | id | prompt tokens | file tokens | new tokens | prediction kept | "
              + " | ".join(f"{n} × plain" for n in NAMES[1:]) + " | identical |", "|---|---|" + "---:|" * 7 + "---|"]
    for r in result["prompts"]:
        same = ", ".join(n for n in NAMES[1:] if not r["variants"][n]["identical"])
        lines.append(f"| {r['set']} | {r['id']} | {r['prompt_tokens']} | {r['file_tokens']} | "
                     f"{r['variants']['plain']['new_tokens']} | {r['accepted_prediction_tokens']} | "
                     + " | ".join(f"×{r['speedup_vs_plain'][n]:.2f}" for n in NAMES[1:])
                     + f" | {'all' if not same else 'differs: ' + same} |")
    lines += [""] + report.differences_section(result)
    if result.get("skipped"):
        lines += ["", "Edits left out (prompt + output budget beyond the model's context): "
                  + ", ".join(result["skipped"])]
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e.fast_apply", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(ap, device=True)
    ap.add_argument("--sets", nargs="+", choices=SETS, default=list(SETS))
    ap.add_argument("--requests", type=int, default=8, help="edits per set")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per edit and variant (median)")
    ap.add_argument("--max-file-tokens", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=1536, help="the most output tokens of an edit")
    ap.add_argument("--k", type=int, default=None, help="lookup_decode's k, both variants (default: its own)")
    ap.add_argument("--out", type=Path, default=OUT, help="output folder (results.json, results.md)")
    args = ap.parse_args(argv)
    if min(args.requests, args.repeats, args.max_new_tokens, args.max_file_tokens,
           1 if args.k is None else args.k) < 1:
        ap.error("--requests, --repeats, --max-new-tokens, --max-file-tokens and --k must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = device_of(args)
    options = {} if args.k is None else {"k": args.k}
    t = time.perf_counter()
    model, tokenizer = load_model(args, device)
    print(f"model loaded in {time.perf_counter() - t:.0f}s", file=sys.stderr)
    edits = load_edits(args.sets, args.requests, args.max_file_tokens,
                       lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    chosen, skipped = fits(edits, tokenizer, getattr(model.config, "max_position_embeddings", None),
                           args.max_new_tokens)
    if not chosen:
        raise SystemExit("no edit fits --max-file-tokens and the model's context")
    chosen = [(e, ids.to(device), pred) for e, ids, pred in chosen]

    _, ids, pred = chosen[0]      # untimed warm-up: allocations, numba JIT, lookup_decode's cost calibration
    for v in variants(pred, options).values():
        warm_up(model, ids, v, args.max_new_tokens)
    result = {"environment": environment(model, device, args.threads, args.model),
              "settings": {**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                           "variants": NAMES, "variant_descriptions": describe(options)},
              "skipped": skipped, "prompts": [], "partial": True}
    for i, (edit, ids, pred) in enumerate(chosen):
        print(f"[{i + 1}/{len(chosen)}] {edit['set']} {edit['id']} ({ids.shape[1]} prompt tokens)", file=sys.stderr)
        result["prompts"].append(measure_edit(model, tokenizer, edit, ids, pred, options, args.max_new_tokens,
                                              args.repeats, offset=i))
        write_result(args.out, "results", result, echo=False)
    result["partial"] = False
    result["summary"] = summarize(result["prompts"])
    write_result(args.out, "results", result, markdown(result))
    print(f"\nwrote {args.out}/results.json and results.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
