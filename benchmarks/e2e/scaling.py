"""Scaling study: how lookup_decode's speed-up moves with output length, context length and copy share.

    python -m benchmarks.e2e.scaling --parts context copy --generate-results benchmarks/results/generate/results.json
    python -m benchmarks.e2e.scaling --parts output --cost-grid benchmarks/results/scaling/cost_grid.json

Every part separates what is *measured* end to end with the default model on this machine from what
is *projected*: a proposer replayed on a known output (no model; `lookup_decode.engines.replay.replay`), each
step priced as one forward over draft + 1 tokens with the forward cost *measured on this machine* at
that context length (`benchmarks.micro.cost_grid`; a synthetic KV cache stands in for contexts the model cannot
hold or would take hours to prefill). Projections leave out proposer time (µs per step, reported).

* output_length — measured: per prompt, plain and lookup_decode run --output-repeats times each
  (interleaved, after a warm-up) up to --output-max-new tokens while a stopping criterion stamps the
  time of every emitted token, so one run gives the time to the first L tokens for every L (medians
  over the repeats). Projected: replay on real large-model outputs (pld_outputs, NoFunEval,
  MT-Redundant), speed-up after the first L tokens.
* context_length — projected: Aider refactor tasks (the file re-emitted with one method moved, made
  mechanically by aider_after.py) with other Aider files put before it to reach 1k..128k tokens of
  context; ours vs transformers' prompt lookup vs the context-copy ceiling. Measured: the end-to-end
  aider_refactor prompts of an `e2e.generate` run (--generate-results), which fit the 8k-token model.
* copy_share — projected: (1) controlled outputs built from real text: spans copied from the prompt
  (a CNN/DM article) mixed with spans of unrelated real text (other articles' summaries) at a set
  share; (2) real large-model outputs bucketed by their measured copy share. Measured: end-to-end
  speed-up per prompt of an `e2e.generate` run against the copy share of the model's own output.

Writes DIR/{output_length,context_length,copy_share}.{json,md,png} (tables and plots: scaling_report.py)
and DIR/cost_grid.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from benchmarks.e2e.aider_after import move_method_to_top_level, parse_task
from benchmarks.e2e.scaling_report import LENGTHS, PROPOSERS, SHARES, K, markdown, plot
from benchmarks.harness import workloads
from benchmarks.harness.loop import side_by_side
from benchmarks.harness.metrics import Timeline, copy_share
from benchmarks.harness.model import add_model_arguments, device_of
from benchmarks.harness.model import load as load_model
from benchmarks.harness.results import RESULTS, write_result
from benchmarks.harness.workloads import eos_of, real_pairs
from benchmarks.micro.cost_grid import CostGrid, measure_cost_grid, plain_times, step_times, time_to
from benchmarks.replay.drafts import PROPOSERS as DRAFTERS
from lookup_decode.core.index import SuffixIndex
from lookup_decode.core.policy import DraftPolicy
from lookup_decode.engines.hf.models import chat_ids, load_tokenizer
from lookup_decode.engines.replay import replay
from lookup_decode.measure import LOOP_THRESHOLD, PLAIN, Variant, environment, loop_score, spread

SIZES = [1, 2, 4, 8, 16, K + 1]      # forward sizes timed per context (a 33-token forward at 100k is slow on a CPU)
CONTEXTS = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 100000]
LOOKUP = Variant("lookup_decode", lookup={"k": K})


# ------------------------------------------------------------------------------ pure helpers

def make_proposer(name: str, prompt, output, eos):
    """(proposer, cap, adaptive) for one replay: benchmarks.replay.drafts' proposer of that name; ours (the default
    LookupConfig) adaptive, transformers' prompt lookup at its default 10 tokens."""
    cap = {"lookup_decode": K, "transformers_pld": 10, "context_copy_ceiling": K}[name]
    return DRAFTERS[name](prompt, output, cap, eos), cap, name == "lookup_decode"


def projected(name: str, prompt, output, cost: CostGrid, eos, lengths=None) -> dict:
    """Replay one (prompt, output) pair with one proposer and price it with `cost` at the prompt's context.

    Returns speed-up over plain decoding of the whole output (and after the first L tokens per L in
    `lengths`), mean accepted length and proposer µs per step.
    """
    proposer, cap, adaptive = make_proposer(name, prompt, output, eos)
    context = len(prompt)
    policy = DraftPolicy(cap, cost.curve(context, cap + 1)) if adaptive else None
    stats = replay(proposer, output, cap, policy)
    emitted, seconds = step_times(stats.draft_lengths, stats.accepted_lengths, cost, context)
    plain = plain_times(len(output), cost, context)
    row = {"speedup": float(plain[-1] / seconds[-1]), "mean_accepted_length": stats.mean_accepted_length,
           "us_per_step": 1e6 * stats.proposer_s / max(stats.steps, 1), "output_tokens": len(output)}
    if lengths is not None:
        row["speedup_at"] = [None if t is None else float(plain[n - 1] / t)
                             for n, t in zip(lengths, time_to(emitted, seconds, lengths))]
    return row


def controlled_copy_output(prompt, novel, share: float, length: int, span: float, rng: np.random.Generator):
    """An output of `length` tokens: spans copied from `prompt` and spans of `novel` text, `share` of them copied.

    Span lengths are geometric with mean `span`; a copied span starts at a random prompt position; novel
    spans read `novel` from a random start onward. Each span is copied when that keeps the copied count
    closest to share x total. Returns (int32 [length], bool [length] copied mask).
    """
    prompt, novel = np.asarray(prompt, dtype=np.int32), np.asarray(novel, dtype=np.int32)
    out, mask, copied = [], [], 0
    q = int(rng.integers(0, max(len(novel), 1)))
    while len(out) < length:
        m = int(min(rng.geometric(1.0 / span), length - len(out), len(prompt)))
        is_copy = copied + m / 2 <= share * (len(out) + m)
        if is_copy:
            p = int(rng.integers(0, len(prompt) - m + 1))
            piece = prompt[p:p + m]
            copied += m
        else:
            piece = np.take(novel, np.arange(q, q + m), mode="wrap")
            q += m
        out.extend(piece.tolist())
        mask.extend([is_copy] * m)
    return np.asarray(out, dtype=np.int32), np.asarray(mask, dtype=bool)


def bucket_medians(xs, ys, edges) -> list[dict]:
    """Median of ys per bucket [edges[i], edges[i+1]) of xs (the last bucket includes its right edge)."""
    xs, ys = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    out = []
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        inside = (xs >= lo) & ((xs <= hi) if i == len(edges) - 2 else (xs < hi))
        out.append({"lo": lo, "hi": hi, **spread(ys[inside])})
    return out


# ------------------------------------------------------------------------------ (a) output length

def measure_output_length(model, tokenizer, args) -> list[dict]:
    """End-to-end: plain and lookup_decode once per prompt, timelines -> speed-up after the first L tokens."""
    from transformers import StoppingCriteriaList

    from lookup_decode.measure import run_variant, warm_up
    device = next(model.parameters()).device
    chosen, _ = workloads.select(args.output_categories, tokenizer, args.output_n, args.max_prompt_tokens,
                                 seed=args.seed)
    prompts = [(r, ids.to(device)) for r, ids in chosen]
    names = [PLAIN.name, LOOKUP.name]
    variants = {PLAIN.name: PLAIN, LOOKUP.name: LOOKUP}
    for v in variants.values():       # untimed warm-up: allocations, JIT, the policy's cost calibration
        warm_up(model, prompts[0][1], v, args.output_max_new)
    records = []
    for i, (req, ids) in enumerate(tqdm(prompts, desc="output length (timed)")):
        def timed_run(name):                    # (run, timeline) of one repeat
            timeline = Timeline(device)
            v = Variant(name, variants[name].lookup,
                        {"stopping_criteria": StoppingCriteriaList([timeline])})
            start = time.perf_counter()
            run = run_variant(model, ids, v, args.output_max_new)
            return run, timeline.cumulative(ids.shape[1], start)
        runs = side_by_side(names, timed_run, args.output_repeats, offset=i)
        plain, lookup = runs[PLAIN.name][0][0], runs[LOOKUP.name][0][0]
        n = min(len(plain.tokens), len(lookup.tokens))
        lengths = [L for L in LENGTHS if L <= n]
        # Median over repeats of the time by which L tokens were out (greedy: every repeat emits the same tokens).
        t_plain = np.median([time_to(*tl, lengths) for _, tl in runs[PLAIN.name]], axis=0).tolist()
        t_lookup = np.median([time_to(*tl, lengths) for _, tl in runs[LOOKUP.name]], axis=0).tolist()
        plain_s = float(np.median([r.seconds for r, _ in runs[PLAIN.name]]))
        lookup_s = float(np.median([r.seconds for r, _ in runs[LOOKUP.name]]))
        records.append({"category": req.category, "id": req.id, "prompt_tokens": int(ids.shape[1]),
                        "new_tokens": n, "identical": plain.tokens == lookup.tokens,
                        "loop_score": loop_score(plain.tokens),
                        "copy_share": copy_share(ids[0].tolist(), plain.tokens),
                        "mean_accepted_length": lookup.stats.mean_accepted_length,
                        "lengths": lengths, "speedup_at": [a / b for a, b in zip(t_plain, t_lookup)],
                        "repeats": args.output_repeats,
                        "speedup": (len(lookup.tokens) / lookup_s) / (len(plain.tokens) / plain_s)})
    return records


def summarize_by_length(rows: list[dict], key: str) -> dict:
    """{group: {L: spread of speed-up after L tokens}} over rows with `lengths`/`speedup_at`."""
    out = {}
    for group in dict.fromkeys(r[key] for r in rows):
        mine = [r for r in rows if r[key] == group]
        out[group] = {str(L): spread(r["speedup_at"][r["lengths"].index(L)] for r in mine
                                     if L in r["lengths"] and r["speedup_at"][r["lengths"].index(L)] is not None)
                      for L in LENGTHS}
    return out


def part_output(args, model, tokenizer, cost, eos) -> dict:
    measured = measure_output_length(model, tokenizer, args) if model is not None and args.output_n > 0 else []
    clean = [r for r in measured if r["loop_score"] <= LOOP_THRESHOLD]
    rows = []
    for name, ps in real_pairs(tokenizer, args.replay_sets, args.replay_limit, min_tokens=LENGTHS[0]).items():
        for prompt, output in tqdm(ps, desc=f"replay {name}", leave=False):
            row = projected("lookup_decode", prompt, output, cost, eos, LENGTHS)
            rows.append({"set": name, "lengths": LENGTHS, **row})
    return {"measured": measured, "measured_summary": summarize_by_length(measured, "category"),
            "measured_summary_without_loops": summarize_by_length(clean, "category"),
            "projected": rows, "projected_summary": summarize_by_length(rows, "set")}


# ------------------------------------------------------------------------ measured vs projected

def measured_points(path: str, tokenizer, cost: CostGrid, eos, categories=None) -> list[dict]:
    """Per prompt of a `benchmarks.e2e.generate` run: measured speed-ups beside the projection for the *same* output.

    speedup: tokens/s ratio of the whole request (prefill included), as measured. decode_speedup: the
    same with lookup_decode's measured prefill time taken off both (plain prefills the same prompt).
    projected_same_output: the model's own greedy output replayed through lookup_decode and priced with
    `cost` (decode only) — where it agrees with decode_speedup, the projections elsewhere are credible.
    """
    result = json.loads(Path(path).read_text())
    requests, out = {}, []
    for r in result["prompts"]:
        v = r["variants"]
        if "lookup_decode" not in v or (categories and r["category"] not in categories):
            continue
        if r["category"] not in requests:
            requests[r["category"]] = {q.id: q for q in workloads.load(r["category"])}
        req = requests[r["category"]].get(r["id"])
        output = np.asarray(r["plain_tokens"], dtype=np.int32)
        proj = None
        if req is not None and len(output):
            prompt = chat_ids(tokenizer, req.messages)[0].numpy().astype(np.int32)
            proj = projected("lookup_decode", prompt, output, cost, eos)["speedup"]
        f = (v["lookup_decode"].get("stats") or {}).get("prefill_s", 0.0)
        (n_p, s_p), (n_l, s_l) = ((v[n]["new_tokens"], v[n]["seconds"]) for n in ("plain", "lookup_decode"))
        decode = (n_l / (s_l - f)) / (n_p / (s_p - f)) if min(s_l, s_p) > f else None
        out.append({"category": r["category"], "id": r["id"], "context_tokens": r["prompt_tokens"],
                    "new_tokens": n_l, "loop_score": r["loop_score"], "copy_share": r.get("copy_share"),
                    "speedup": r["speedup_vs_plain"]["lookup_decode"], "decode_speedup": decode,
                    "projected_same_output": proj})
    return out


# ----------------------------------------------------------------------------- (b) context length

def aider_rows() -> list[dict]:
    path = workloads.data_dir() / "aider_refactor" / "refactor_benchmark.jsonl"
    return list(workloads.read_jsonl(path))


def context_prompts(tokenizer, contexts: list[int], n_targets: int, max_target_chars: int, seed: int) -> list[dict]:
    """Aider tasks padded to each context length with other Aider files put first (files in the chat).

    Returns per (target, context): prompt int32 [T], output int32 [n] (the mechanical after-file).
    """
    rows = aider_rows()
    rng = random.Random(seed)
    targets = [r for r in rows if len(r["before_code"]) <= max_target_chars]
    rng.shuffle(targets)
    targets = targets[:n_targets]
    fillers = {r["filename"]: r for r in rows}            # one copy per file
    order = sorted(fillers)
    rng.shuffle(order)
    out = []
    for target in targets:
        pool = "".join(f"{name}\n```python\n{fillers[name]['before_code']}\n```\n\n"
                       for name in order if name != target["filename"])
        pool = pool[: 5 * max(contexts)]
        pool_ids = tokenizer(pool, add_special_tokens=False)["input_ids"]
        task = f"{target['instruction']}\n\n```python\n{target['before_code']}\n```"
        base = chat_ids(tokenizer, [{"role": "user", "content": task}]).shape[1]
        cls, method = parse_task(target["instruction"])
        after = move_method_to_top_level(target["before_code"], cls, method)
        output = np.asarray(tokenizer(f"```python\n{after}\n```", add_special_tokens=False)["input_ids"],
                            dtype=np.int32)
        for context in [base] + [c for c in contexts if c > base]:
            filler = tokenizer.decode(pool_ids[: context - base]) if context > base else ""
            text = (f"Files in the chat:\n\n{filler}\n\n" if filler else "") + task
            ids = chat_ids(tokenizer, [{"role": "user", "content": text}])[0].numpy().astype(np.int32)
            out.append({"target": target["id"], "context_tokens": int(len(ids)), "prompt": ids, "output": output})
    return out


def part_context(args, tokenizer, cost, eos) -> dict:
    rows = []
    cases = context_prompts(tokenizer, args.contexts, args.context_targets, args.max_target_chars, args.seed)
    for case in tqdm(cases, desc="context replay"):
        for name in PROPOSERS:
            row = projected(name, case["prompt"], case["output"], cost, eos)
            rows.append({"target": case["target"], "context_tokens": case["context_tokens"], "proposer": name, **row})
    measured = (measured_points(args.generate_results, tokenizer, cost, eos, ["aider_refactor"])
                if args.generate_results else [])
    grid = {"contexts": cost.contexts.tolist(), "cost_1_ms": [1e3 * cost(c, 1) for c in cost.contexts],
            "cost_16_over_1": [cost(c, 16) / cost(c, 1) for c in cost.contexts],
            "cost_33_over_1": [cost(c, K + 1) / cost(c, 1) for c in cost.contexts]}
    return {"projected": rows, "measured": measured, "cost": grid}


# --------------------------------------------------------------------------------- (c) copy share

def part_copy(args, tokenizer, cost, eos) -> dict:
    rng = np.random.default_rng(args.seed)
    pairs = real_pairs(tokenizer, ["cnn_dm"], args.copy_prompts + 40)["cnn_dm"]
    base, others = pairs[: args.copy_prompts], pairs[args.copy_prompts:]
    novel = np.concatenate([o for _, o in others])        # real summaries of *other* articles
    controlled = []
    for i, (prompt, _) in enumerate(tqdm(base, desc="controlled copy")):
        for share in SHARES:
            output, mask = controlled_copy_output(prompt, novel, share, args.copy_length, args.copy_span, rng)
            for name in PROPOSERS:
                row = projected(name, prompt, output, cost, eos)
                controlled.append({"prompt": i, "share": share, "built_share": float(mask.mean()),
                                   "measured_share": copy_share(prompt, output), "proposer": name, **row})
    real = []
    for name, ps in real_pairs(tokenizer, args.replay_sets, args.replay_limit).items():
        for prompt, output in tqdm(ps, desc=f"real {name}", leave=False):
            row = projected("lookup_decode", prompt, output, cost, eos)
            real.append({"set": name, "copy_share": copy_share(prompt, output), **row})
    edges = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    measured = [m for m in (measured_points(args.generate_results, tokenizer, cost, eos)
                            if args.generate_results else []) if m["copy_share"] is not None]
    clean = [m for m in measured if m["loop_score"] <= LOOP_THRESHOLD]
    return {"controlled": controlled, "real": real, "measured": measured,
            "real_buckets": bucket_medians([r["copy_share"] for r in real], [r["speedup"] for r in real], edges),
            "measured_buckets_without_loops": bucket_medians([m["copy_share"] for m in clean],
                                                             [m["speedup"] for m in clean], edges)}


# ------------------------------------------------------------------------------------------ main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", nargs="+", default=["output", "context", "copy"], choices=["output", "context", "copy"])
    add_model_arguments(ap, device=True)
    ap.add_argument("--cost-grid", default=None, help="cost_grid.json of an earlier run: reuse, do not measure")
    ap.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS, help="context lengths to measure and pad to")
    ap.add_argument("--cost-repeats", type=int, default=2, help="timed forwards per (context, size); median")
    ap.add_argument("--output-categories", nargs="+", default=["code_edit", "summarization", "mt_redundant"])
    ap.add_argument("--output-n", type=int, default=2, help="timed prompts per category for the output-length part")
    ap.add_argument("--output-max-new", type=int, default=512)
    ap.add_argument("--output-repeats", type=int, default=3,
                    help="interleaved runs per prompt and variant; times to L are medians over them")
    ap.add_argument("--max-prompt-tokens", type=int, default=2048)
    ap.add_argument("--replay-sets", nargs="+", default=["code_edit", "cnn_dm", "hagrid", "mt_redundant", "clapnq"])
    ap.add_argument("--replay-limit", type=int, default=60, help="real pairs per set for the projections")
    ap.add_argument("--context-targets", type=int, default=4, help="Aider tasks padded to every context length")
    ap.add_argument("--max-target-chars", type=int, default=8000)
    ap.add_argument("--copy-prompts", type=int, default=10)
    ap.add_argument("--copy-length", type=int, default=256, help="tokens per controlled output")
    ap.add_argument("--copy-span", type=float, default=16.0, help="mean span length of the controlled outputs")
    ap.add_argument("--generate-results", default=None, help="benchmarks.e2e.generate results.json: measured points")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "scaling"))
    args = ap.parse_args(argv)

    device = device_of(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = None
    need_model = "output" in args.parts or args.cost_grid is None
    if need_model:
        model, tokenizer = load_model(args, device)
    else:
        tokenizer = load_tokenizer(args.model)
    eos = eos_of(tokenizer)
    SuffixIndex([1, 2, 1, 2], min_match=1).propose(2)   # compile the index kernels first

    if args.cost_grid:
        grid = json.loads(Path(args.cost_grid).read_text())
    else:
        bar = tqdm(total=len(args.contexts), desc="forward cost by context (timed)")
        seconds = measure_cost_grid(model, args.contexts, SIZES, args.cost_repeats, progress=lambda c: bar.update())
        bar.close()
        grid = {"environment": environment(model, device, args.threads, args.model),
                "method": "median of --cost-repeats forwards over n tokens after a synthetic KV cache of T tokens",
                "contexts": list(args.contexts), "sizes": SIZES, "seconds": seconds,
                "check": synthetic_vs_real(model, tokenizer, args.cost_repeats)}
        write_result(out, "cost_grid", grid)
    cost = CostGrid(grid["contexts"], grid["sizes"], grid["seconds"])

    env = environment(model, device, args.threads, args.model) if model is not None else environment()
    header = [f"Command: `{env['command']}`  ", f"Machine: {env['cpu']} ({env['device']}), torch threads "
              f"{env['torch_threads']}; forward cost grid: {grid['environment']['command']}  ",
              f"Projections price each replayed step with that grid (contexts {grid['contexts']}); proposer "
              "time is left out of projections (µs per step, reported where relevant).", ""]
    parts = {"output": ("output_length", lambda: part_output(args, model, tokenizer, cost, eos)),
             "context": ("context_length", lambda: part_context(args, tokenizer, cost, eos)),
             "copy": ("copy_share", lambda: part_copy(args, tokenizer, cost, eos))}
    for key in args.parts:
        name, run = parts[key]
        result = {"environment": env, "settings": vars(args), "cost_grid": grid, **run()}
        write_result(out, name, result, markdown(name, result, header), echo=False, default=_json_default)
        plot(name, result, out / f"{name}.png")
        print(f"wrote {out / name}.json, .md, .png", file=sys.stderr)
    return 0


def synthetic_vs_real(model, tokenizer, repeats: int, context: int = 2048) -> dict:
    """The synthetic-cache cost beside the cost after a real prefill of real text (an Aider file), same length."""
    import torch

    from benchmarks.micro.cost_grid import synthetic_cache, time_forwards
    from lookup_decode.engines.hf.forward import measure_forward_cost
    text = "".join(r["before_code"] for r in aider_rows()[:5])
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"][:context]])
    ids = ids.to(next(model.parameters()).device)
    return {"context": int(ids.shape[1]), "sizes": SIZES,
            "real_prefill": measure_forward_cost(model, ids, SIZES, repeats),
            "synthetic": time_forwards(model, synthetic_cache(model, int(ids.shape[1])), SIZES, repeats)}


def _json_default(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(type(x))


if __name__ == "__main__":
    sys.exit(main())
