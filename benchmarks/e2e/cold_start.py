"""Cold start: what the first lookup_decode call on a model costs, against plain generate's first call.

A fresh model (no curve in memory), a forced-replay code-edit request (drafts are accepted as on the
large model that wrote it), max_new_tokens 64. Variants, each on its own fresh copy of the model:
plain generate; transformers' prompt lookup; lookup_decode with a cold cost model (shape prior + a few
forwards: the default), with the old full grid calibration (`CostModel(full=True)`), and with the
curve already on disk (a second process). Then a session: four requests in a row, total seconds.

    python -m benchmarks.e2e.cold_start --shape llama-3.2-1b/8 --new 64

`--model default` (or a .gguf file / model folder): a real model on real copy-heavy requests (the code-edit
prompts of tests/data), each variant in a fresh Python process as a new user's script would run it — imports,
numba's kernels (from its on-disk cache, or compiled if there is none), the cost calibration all land in the
first call or before it — and every output checked against plain's.

    python -m benchmarks.e2e.cold_start --model default --new 64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import lookup_decode
from benchmarks.harness.results import RESULTS, write_result
from benchmarks.replay.forced import PAIRS, Forced, build, load_pairs
from lookup_decode.core.cost import CostModel

REPO = Path(__file__).resolve().parents[2]


def session(shape: str, variant: str, pairs, new: int, cache_dir: str) -> list[float]:
    """Seconds of each request of a session on a freshly built model (first call first)."""
    model = build(shape)
    forced = Forced(model)
    costs = {"lookup_decode": CostModel(cache_dir), "lookup_decode_full": CostModel(cache_dir, full=True),
             "lookup_decode_disk": CostModel(cache_dir)}.get(variant)
    times = []
    try:
        for prompt, output in pairs:
            forced.set(np.concatenate([prompt, output]), "cpu")
            ids = torch.as_tensor(prompt[None].astype(np.int64))
            kw = dict(max_new_tokens=new, do_sample=False, attention_mask=torch.ones_like(ids))
            t = time.perf_counter()
            with torch.inference_mode():
                if variant == "plain":
                    out = model.generate(ids, **kw)
                elif variant == "prompt_lookup":
                    out = model.generate(ids, prompt_lookup_num_tokens=10, **kw)
                else:
                    out = model.generate(ids, custom_generate=lookup_decode.lookup_decoding(costs=costs), **kw)
            times.append(time.perf_counter() - t)
            assert out[0, len(prompt):].tolist() == output[:new].tolist()
    finally:
        forced.handle.remove()
    return times


REAL_VARIANTS = ("plain", "prompt_lookup", "lookup_decode", "lookup_decode_first_run")
TEST_PROMPTS = REPO / "tests" / "data" / "real_prompts.jsonl"


def real_session(model_path: str, variant: str, requests: int, new: int) -> dict:
    """One fresh process's session on a real model (run by `--child`): seconds and tokens of each request."""
    started = time.perf_counter()
    from lookup_decode.engines.hf.models import chat_ids, load_model
    from lookup_decode.measure import PLAIN, PROMPT_LOOKUP, Variant, run_variant
    model, tokenizer = load_model(None if model_path == "default" else model_path)
    loaded = time.perf_counter()
    rows = [json.loads(line) for line in TEST_PROMPTS.read_text().splitlines()]
    rows = [r for r in rows if r["category"] in ("code_edit", "editeval")][:requests]
    # lookup_decode_first_run: lookup_decode in a process whose numba cache folder is empty (NUMBA_CACHE_DIR, set
    # by the parent): the first run after installing, when the kernels are compiled, not loaded.
    how = {"plain": PLAIN, "prompt_lookup": PROMPT_LOOKUP}.get(variant, Variant(variant, lookup={}))
    runs = [run_variant(model, chat_ids(tokenizer, r["messages"]), how, new) for r in rows]
    return {"seconds": [r.seconds for r in runs], "outputs": [r.tokens for r in runs], "ids": [r["id"] for r in rows],
            "load_s": loaded - started, "vocab": int(model.config.vocab_size)}


def real_model(args) -> dict:
    """Every variant in its own fresh process, `--repeats` rounds interleaved; outputs checked against plain's."""
    env = {k: v for k, v in os.environ.items() if k != "LOOKUP_DECODE_COST_CACHE"}   # nothing cached on disk
    runs: dict[str, list[dict]] = {v: [] for v in REAL_VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.repeats):
            for variant in REAL_VARIANTS:
                path = Path(tmp) / f"{variant}_{round_}.json"
                fresh = {"NUMBA_CACHE_DIR": tempfile.mkdtemp(dir=tmp)} if variant.endswith("first_run") else {}
                subprocess.run([sys.executable, "-m", "benchmarks.e2e.cold_start", "--child", variant, "--model",
                                args.model, "--new", str(args.new), "--requests", str(args.requests),
                                "--json", str(path)],
                               check=True, env={**env, **fresh}, cwd=REPO)
                runs[variant].append(json.loads(path.read_text()))
                print(variant, [round(t, 2) for t in runs[variant][-1]["seconds"]], flush=True)
    for variant, rs in runs.items():
        for r in rs:
            if r["outputs"] != runs["plain"][0]["outputs"]:
                raise AssertionError(f"{variant}'s outputs differ from plain generate's")
    return runs


def main(argv=None) -> int:
    from lookup_decode.measure import command_line, environment
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.2-1b/8")
    ap.add_argument("--model", help="'default' or a .gguf file / model folder: a real model in fresh processes")
    ap.add_argument("--repeats", type=int, default=2, help="--model: interleaved rounds of fresh processes")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--out", default=str(RESULTS / "cold_start"))
    ap.add_argument("--child", choices=REAL_VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    if args.child:
        Path(args.json).write_text(json.dumps(real_session(args.model, args.child, args.requests, args.new)))
        return 0
    if args.model:
        runs = real_model(args)
        # Per variant the round with the shortest session (the least disturbed one).
        best = {v: min(rs, key=lambda r: sum(r["seconds"])) for v, rs in runs.items()}
        plain, pl = best["plain"]["seconds"], best["prompt_lookup"]["seconds"]
        lines = [f"$ {command_line()}", "", f"{len(plain)} requests ({', '.join(best['plain']['ids'])}), "
                 f"{args.new} new tokens, vocabulary {best['plain']['vocab']}; "
                 "outputs identical to plain's in every run.",
                 "", "| variant | first call s | x plain's first | session s | x plain's session | "
                 "x prompt lookup's session | model load s |", "|---|---|---|---|---|---|---|"]
        for v, r in best.items():
            t = r["seconds"]
            lines.append(f"| {v} | {t[0]:.2f} | {t[0] / plain[0]:.2f} | {sum(t):.2f} | {sum(t) / sum(plain):.2f} | "
                         f"{sum(t) / sum(pl):.2f} | {r['load_s']:.2f} |")
        write_result(args.out, "cold_start", {"environment": environment(), "args": vars(args), "runs": runs},
                     "\n".join(lines) + "\n")
        return 0
    pairs = load_pairs(PAIRS, ["code_edit"], args.requests)["code_edit"]
    lookup_decode.SuffixIndex([1, 2, 1, 2], min_match=1).propose(2)     # numba compile outside every timing
    rows = {}
    with tempfile.TemporaryDirectory() as cache_dir:
        for variant in ("plain", "prompt_lookup", "lookup_decode_full", "lookup_decode"):
            rows[variant] = session(args.shape, variant, pairs, args.new, cache_dir if variant == "lookup_decode"
                                    else tempfile.mkdtemp())
            print(variant, [round(t, 2) for t in rows[variant]], flush=True)
        # A second process: same shape, the curve the cold run stored is on disk.
        rows["lookup_decode_disk"] = session(args.shape, "lookup_decode_disk", pairs, args.new, cache_dir)
        print("lookup_decode_disk", [round(t, 2) for t in rows["lookup_decode_disk"]], flush=True)
    plain = rows["plain"]
    lines = [f"$ {command_line()}", "", "| variant | first call s | x plain's first | session of "
             f"{args.requests} s | x plain's session | x prompt lookup's session |", "|---|---|---|---|---|---|"]
    for v, t in rows.items():
        lines.append(f"| {v} | {t[0]:.2f} | {t[0] / plain[0]:.2f} | {sum(t):.2f} | {sum(t) / sum(plain):.2f} | "
                     f"{sum(t) / sum(rows['prompt_lookup']):.2f} |")
    write_result(args.out, "cold_start", {"environment": environment(), "args": vars(args), "seconds": rows},
                 "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
