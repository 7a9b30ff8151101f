"""End to end: lookup_decode with session memory / reference documents vs without, on the default model.

    python -m benchmarks.bench_memory --n 1 --max-new-tokens 16 --out /tmp/mem_smoke       # smoke test
    python -m benchmarks.bench_memory --n 3 --max-new-tokens 96 --threads 2      # full: ~6-8 min on a quiet 2-core CPU

Sessions whose outputs are this model's own (greedy), run step by step; every step runs each variant
(`none`: lookup_decode defaults; `memory`: the same with one Memory for the workload and its
References; optionally `plain`: model.generate) in rotated order after an untimed warm-up, and
checks that all outputs are identical. Later steps are built from the earlier outputs, as a client
would. Workloads (data from ../shared/data):
* mt_redundant: MT-Redundant chats; turn 1 = [t1], turn 2 = [t1, a1, t2] with this model's a1
  (history in the prompt, the usual chat API).
* edits: successive edits of one NoFunEval Python file: the data set's instruction, then two more of
  its real instructions (speed, energy), each applied to the file as the previous step left it.
* rag: ClapNQ with every passage of the first 300 rows registered once as a reference document;
  each request carries its passage and question.
* rerun: the same first turns asked again in a later run (a pipeline re-run; with greedy decoding
  the answers repeat, so the memory supplies them whole).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import lookup_decode
from benchmarks import workloads
from benchmarks.workloads import _jsonl, _maybe_list, data_dir
from lookup_decode.bench import chat_ids, environment
from lookup_decode.stats import DecodeStats

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ["none", "memory"]
EDIT_INSTRUCTIONS = [
    "Rewrite the given python program to optimize and improve the speed of execution. Write the entire code and no "
    "other text in the response.",
    "Rewrite the given python program to optimize and improve the energy usage. Write the entire code and no other "
    "text in the response.",
]


def _user(text):
    return [{"role": "user", "content": text}]


def _code(text: str) -> str:
    """The first fenced code block of a reply, or the reply itself."""
    m = re.search(r"```[a-zA-Z]*\n(.*?)(```|$)", text, re.S)
    return m.group(1) if m else text


def sessions(name: str, n: int):
    """Per session, a list of (group, make_messages(previous output text) -> messages, scored)."""
    if name in ("mt_redundant", "rerun"):
        reqs = workloads.mt_redundant()[:n]
        if name == "rerun":
            first = [("run1", lambda prev, r=r: r.messages[:1], False) for r in reqs]
            return [first + [("run2", lambda prev, r=r: r.messages[:1], True) for r in reqs]]
        out = []
        for r in reqs:
            out.append([("turn1", lambda prev, r=r: r.messages[:1], True),
                        ("turn2", lambda prev, r=r: [r.messages[0], {"role": "assistant", "content": prev},
                                                     r.messages[2]], True)])
        return [sum(out, [])]                   # one session: the memory spans the chats
    if name == "edits":
        rows = [r for r in _jsonl(data_dir() / "nofuneval_edit" / "nofuneval_edit.jsonl")
                if r["pl"].lower() == "python" and 200 <= len(r["source_code"]) <= 600][:n]
        out = []
        for row in rows:
            steps, file = [], row["source_code"]
            for i, instr in enumerate([row["instruction"], *EDIT_INSTRUCTIONS]):
                steps.append((f"edit{i + 1}", lambda prev, instr=instr, i=i, file=file: _user(
                    f"{instr}\n\n```python\n{file if i == 0 else _code(prev)}\n```"), True))
            out.append(steps)
        return [sum(out, [])]
    if name == "rag":
        return [[("answer", lambda prev, r=r: r.messages, True) for r in workloads.clapnq()[:n]]]
    raise KeyError(name)


def references_for(name: str, tokenizer):
    if name != "rag":
        return None
    refs = lookup_decode.References()
    for row in list(_jsonl(data_dir() / "clapnq" / "clapnq_dev_answerable.jsonl"))[:300]:
        passages = _maybe_list(row["passages"])
        refs.register(str(row["id"]), "\n\n".join(p["text"] if isinstance(p, dict) else str(p) for p in passages),
                      tokenizer=tokenizer)
    return refs


def run_once(model, ids, variant, max_new_tokens, memory, refs):
    stats = DecodeStats()
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False)
    t = time.perf_counter()
    if variant == "plain":
        out = model.generate(ids, **kw)
    elif variant == "none":
        out = lookup_decode.generate(model, ids, stats=stats, **kw)
    else:
        out = lookup_decode.generate(model, ids, stats=stats, memory=memory, references=refs, **kw)
    return out, time.perf_counter() - t, stats


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", nargs="+", default=["mt_redundant", "edits", "rag", "rerun"])
    ap.add_argument("--n", type=int, default=4, help="chats / files / questions per workload")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-prompt-tokens", type=int, default=1800)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--plain", action="store_true", help="also time plain model.generate")
    ap.add_argument("--memory-tokens", type=int, default=200_000)
    ap.add_argument("--out", default=str(RESULTS / "memory_generate"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = lookup_decode.load_model()
    variants = (["plain"] if args.plain else []) + VARIANTS
    warm = chat_ids(tokenizer, _user("Say hello."))
    for v in variants:                            # first calls allocate; lookup measures the forward cost once
        run_once(model, warm, v, 8, lookup_decode.Memory(100), None)
    records, k = [], 0
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in args.workloads:
        memory, refs = lookup_decode.Memory(args.memory_tokens), references_for(name, tokenizer)
        for session in sessions(name, args.n):
            prev = ""
            for group, make, scored in session:
                ids = chat_ids(tokenizer, make(prev))
                if ids.shape[1] > args.max_prompt_tokens:
                    print(f"skip {name}/{group}: {ids.shape[1]} prompt tokens", file=sys.stderr)
                    prev = ""
                    continue
                order = variants[k % len(variants):] + variants[:k % len(variants)]
                k += 1
                if not scored:                    # only fills the memory
                    order = ["memory"]
                runs = {v: run_once(model, ids, v, args.max_new_tokens, memory, refs) for v in order}
                outs = [r[0] for r in runs.values()]
                identical = all(torch.equal(outs[0], o) for o in outs[1:])
                prev = tokenizer.decode(outs[0][0, ids.shape[1]:], skip_special_tokens=True)
                new = outs[0].shape[1] - ids.shape[1]
                rec = {"workload": name, "group": group, "scored": scored, "prompt_tokens": int(ids.shape[1]),
                       "new_tokens": int(new), "identical": identical,
                       "seconds": {v: r[1] for v, r in runs.items()},
                       "mean_accepted_length": {v: r[2].mean_accepted_length for v, r in runs.items() if v != "plain"}}
                records.append(rec)
                print(json.dumps({k2: rec[k2] for k2 in ("workload", "group", "new_tokens", "identical")}
                                 | {"seconds": {v: round(s, 2) for v, s in rec["seconds"].items()}}), file=sys.stderr)
                (out_dir / "results.json").write_text(json.dumps(
                    {"environment": environment(model, threads=args.threads), "records": records}, indent=1))
    summary = summarize(records, variants)
    result = {"environment": environment(model, threads=args.threads), "settings": vars(args), "records": records,
              "summary": summary}
    (out_dir / "results.json").write_text(json.dumps(result, indent=1))
    (out_dir / "results.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def summarize(records, variants):
    """Per (workload, group): speed-up of memory over none (median of per-request ratios and total-time
    ratio), mean accepted lengths, identity."""
    out = {}
    for rec in records:
        if not rec["scored"]:
            continue
        out.setdefault(f"{rec['workload']}/{rec['group']}", []).append(rec)
    rows = {}
    for key, recs in out.items():
        ratio = [r["seconds"]["none"] / r["seconds"]["memory"] for r in recs]
        row = {"requests": len(recs), "identical": sum(r["identical"] for r in recs),
               "speedup_memory_vs_none_median": statistics.median(ratio),
               "speedup_memory_vs_none_range": [min(ratio), max(ratio)],
               "speedup_memory_vs_none_total": sum(r["seconds"]["none"] for r in recs)
               / sum(r["seconds"]["memory"] for r in recs),
               "mean_accepted_length_none": statistics.mean(r["mean_accepted_length"]["none"] for r in recs),
               "mean_accepted_length_memory": statistics.mean(r["mean_accepted_length"]["memory"] for r in recs)}
        if "plain" in variants:
            row["speedup_memory_vs_plain_total"] = sum(r["seconds"]["plain"] for r in recs) / \
                sum(r["seconds"]["memory"] for r in recs)
            row["speedup_none_vs_plain_total"] = sum(r["seconds"]["plain"] for r in recs) / \
                sum(r["seconds"]["none"] for r in recs)
        rows[key] = row
    return rows


def markdown(result) -> str:
    lines = ["# Session memory end to end", "", f"Command: `{result['environment']['command']}`", "",
             "| workload/group | requests | identical | memory vs none: median [min-max] | total | "
             "mean acc. len none | memory |", "|---|---:|---:|---|---:|---:|---:|"]
    for key, r in result["summary"].items():
        lo, hi = r["speedup_memory_vs_none_range"]
        lines.append(f"| {key} | {r['requests']} | {r['identical']}/{r['requests']} | "
                     f"x{r['speedup_memory_vs_none_median']:.2f} [{lo:.2f}-{hi:.2f}] | "
                     f"x{r['speedup_memory_vs_none_total']:.2f} | {r['mean_accepted_length_none']:.2f} | "
                     f"{r['mean_accepted_length_memory']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
