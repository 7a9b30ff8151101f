"""End to end, two checkouts of lookup_decode side by side: is a change a slowdown?

    git worktree add /tmp/before <old commit>
    python -m benchmarks.e2e.compare_commits --before /tmp/before --after . --n 4 --repeats 3
    python -m benchmarks.e2e.compare_commits --before /tmp/before --batch 16 \\
        --generate-kwargs '{"repetition_penalty": 1.2}'

One worker process per checkout (each imports its own `lookup_decode`, loads --model in --dtype once
and warms up: JIT, first-use allocations, the cost calibration); the parent sends both the same
prompts (code edits and summaries from ../shared/data), interleaved request by request with the
order rotated, and times each `generate` call inside the worker. Reports per category the total
time of each checkout, their ratio, the median per-prompt ratio, and whether the outputs are
identical (greedy: they must be). `--batch B` sends B prompts of a category as one left-padded batch;
`--generate-kwargs` adds generate options (a logits processor, say) to every call. Writes JSON with the
environment next to the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from lookup_decode.core.config import LookupConfig
from lookup_decode.core.cost import calibrating_tokens

WORKER = r"""
import json, sys, time, torch
import lookup_decode
torch.set_num_threads(int(sys.argv[1]))
model, tok = lookup_decode.load_model(sys.argv[2] or None, dtype=getattr(torch, sys.argv[3]))
pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
def run(rows, n, kwargs):
    P = max(len(r) for r in rows)
    x = torch.full((len(rows), P), pad, dtype=torch.long)
    mask = torch.zeros_like(x)
    for b, r in enumerate(rows):
        x[b, P - len(r):], mask[b, P - len(r):] = torch.tensor(r), 1
    t = time.perf_counter()
    out = lookup_decode.generate(model, x, max_new_tokens=n, do_sample=False, attention_mask=mask, pad_token_id=pad,
                                 **kwargs)
    return time.perf_counter() - t, out[:, P:].tolist()
print(json.dumps({"ready": lookup_decode.__file__}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    seconds, tokens = run(job["rows"], job["n"], job["kwargs"])
    print(json.dumps({"seconds": seconds, "tokens": tokens}), flush=True)
"""


class Worker:
    def __init__(self, root: str, threads: int, model: str | None = None, dtype: str = "float32"):
        env = dict(os.environ, PYTHONPATH=str(Path(root).resolve()))
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, str(threads), model or "", dtype],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                     cwd=str(Path(root).resolve()))
        self.package = json.loads(self.proc.stdout.readline())["ready"]

    def run(self, rows: list[list[int]], n: int, kwargs: dict) -> dict:
        self.proc.stdin.write(json.dumps({"rows": rows, "n": n, "kwargs": kwargs}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main(argv=None) -> int:
    from benchmarks.harness import workloads
    from benchmarks.harness.loop import side_by_side
    from benchmarks.harness.model import add_model_arguments, model_path
    from benchmarks.harness.results import write_result
    from lookup_decode.engines.hf.models import load_tokenizer, resolve_dtype
    from lookup_decode.measure import environment

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="checkout (folder) of the old code")
    ap.add_argument("--after", default=".", help="checkout (folder) of the new code (default: here)")
    ap.add_argument("--categories", nargs="+", default=["code_edit", "summarization"])
    ap.add_argument("--n", type=int, default=4, help="prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1, help="prompts per generate call (left-padded; default 1)")
    ap.add_argument("--generate-kwargs", type=json.loads, default={}, help="JSON object of extra generate options")
    ap.add_argument("--out", default=None, help="JSON file to write")
    add_model_arguments(ap)
    args = ap.parse_args(argv)

    tok = load_tokenizer(args.model)
    prompts = []                           # (category, rows of one generate call)
    for cat in args.categories:
        fit = [ids[0].tolist() for _, ids in workloads.select([cat], tok, args.n * args.batch,
                                                               args.max_prompt_tokens)[0]]
        prompts += [(cat, fit[i: i + args.batch]) for i in range(0, len(fit) - args.batch + 1, args.batch)]
    model, dtype = model_path(args.model), str(resolve_dtype(args.dtype)).removeprefix("torch.")
    workers = {name: Worker(root, args.threads, model and str(model), dtype)
               for name, root in (("before", args.before), ("after", args.after))}
    warm = min(args.max_new_tokens, calibrating_tokens(args.generate_kwargs.get("k", LookupConfig.k)))
    for w in workers.values():             # untimed warm-up (of this batch size: its cost calibration, every width)
        w.run(prompts[0][1], warm, args.generate_kwargs)
    runs = []
    for i, (cat, rows) in enumerate(prompts):
        got = side_by_side(list(workers), lambda name: workers[name].run(rows, args.max_new_tokens,
                                                                         args.generate_kwargs), args.repeats, offset=i)
        tokens = {name: got[name][-1]["tokens"] for name in workers}
        runs.append({"category": cat, "prompt_tokens": sum(map(len, rows)), "rows": len(rows),
                     "new_tokens": sum(map(len, tokens["after"])), "identical": tokens["before"] == tokens["after"],
                     **{f"{name}_s": float(np.median([r["seconds"] for r in got[name]])) for name in workers}})
        print(f"{cat} {runs[-1]['prompt_tokens']} tokens in {len(rows)} rows: before {runs[-1]['before_s']:.2f}s "
              f"after {runs[-1]['after_s']:.2f}s identical={runs[-1]['identical']}", file=sys.stderr)
    packages = {name: w.package for name, w in workers.items()}
    for w in workers.values():
        w.close()
    summary = {}
    for cat in args.categories + ["all"]:
        rs = [r for r in runs if cat in ("all", r["category"])]
        before, after = sum(r["before_s"] for r in rs), sum(r["after_s"] for r in rs)
        summary[cat] = {"prompts": len(rs), "before_s": before, "after_s": after, "after_over_before": after / before,
                        "median_ratio": float(np.median([r["after_s"] / r["before_s"] for r in rs])),
                        "identical": sum(r["identical"] for r in rs)}
        print(f"{cat}: total time after/before x{after / before:.3f} (median per prompt "
              f"x{summary[cat]['median_ratio']:.3f}), identical {summary[cat]['identical']}/{len(rs)}")
    result = {"environment": environment(threads=args.threads), "packages": packages, "settings": vars(args),
              "summary": summary, "runs": runs}
    if args.out:
        write_result(Path(args.out).parent, Path(args.out).stem, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
