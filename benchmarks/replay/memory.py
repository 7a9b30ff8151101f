"""Offline replay of session memory and reference documents on real outputs: acceptance without a model.

    python -m benchmarks.replay.memory                       # every workload of benchmarks/replay/sessions.py
    python -m benchmarks.replay.memory --limit 10 --out /tmp/mem_replay   # quick

Each workload (see `benchmarks/replay/sessions.py`) is a sequence of requests with real outputs,
replayed in order twice: without memory (each request drafts from its own prompt and output only,
lookup_decode's default) and with one `Memory` for the whole workload (plus its `References`),
where every request also drafts from earlier outputs and registered documents and then stores its
output. Steps are replayed with `lookup_decode.engines.replay.replay`: cap-32 drafts, all verified (mean
accepted length, bonus token included) and, with the forward-cost curve of a `benchmarks.e2e.generate` run,
with the adaptive policy choosing what to verify (modelled speed-up over plain decoding on that
machine; the ratio of the two variants is the modelled speed-up of memory over no memory).
--corpus-min-match / --alone-min-match replay other choices of how long a match in the memory or
the references must be (lookup_decode.sources.proposer: CORPUS_MIN_MATCH while the request has a draft of its
own, ALONE_MIN_MATCH when it has none); benchmarks/results/memory_replay/README.md has the comparison.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from benchmarks.harness.results import RESULTS, write_result
from benchmarks.harness.workloads import eos_of
from benchmarks.replay import sessions as memory_sessions
from benchmarks.replay.drafts import load_cost_curve
from lookup_decode.core.acceptance import new_counts
from lookup_decode.core.config import LookupConfig
from lookup_decode.core.cost import CostCurve
from lookup_decode.core.index import SuffixIndex
from lookup_decode.core.policy import DraftPolicy
from lookup_decode.core.stats import DecodeStats
from lookup_decode.engines.hf.models import chat_ids, load_tokenizer
from lookup_decode.engines.replay import estimated_speedup, replay
from lookup_decode.measure import environment
from lookup_decode.sources import proposer as sources
from lookup_decode.sources.memory import Memory
from lookup_decode.sources.proposer import SourcesProposer

DEFAULT_COST = Path("benchmarks/results/generate/results.json")   # relative: run from the repository root


def tokenize(workload, tokenizer):
    """Per session, per step: (prompt int32 [T], output int32 [n], step); a prompt built from the
    previous step's output gets its real output."""
    out = []
    for session in workload.sessions:
        steps, previous = [], ""
        for s in session:
            steps.append((chat_ids(tokenizer, s.prompt(previous))[0].numpy().astype(np.int32),
                          np.asarray(tokenizer(s.output, add_special_tokens=False)["input_ids"], np.int32), s))
            previous = s.output
        out.append(steps)
    return out


def run(workload, sessions, tokenizer, *, use_memory: bool, cap: int, cost: CostCurve | None,
        max_tokens: int, eos, corpus_kw=None) -> dict:
    """Replay every session; per group: DecodeStats (fixed) and DecodeStats (adaptive, if cost)."""
    cfg = LookupConfig()
    corpus_kw = corpus_kw or {}
    refs = memory_sessions.references(workload, tokenizer) if use_memory else None
    groups: dict[str, dict] = {}
    from_source: dict[str, int] = {}
    t0 = time.perf_counter()
    # One engine's pooled acceptance counts for every request, as `generate` keeps one per model across calls.
    pooled = new_counts()
    for session in sessions:
        memory = Memory(max_tokens=max_tokens) if use_memory else None
        corpora = [c for c in (("memory", memory), ("references", refs)) if c[1] is not None]
        for prompt, output, step in session:
            if not step.score:
                if memory is not None:
                    memory.remember(prompt, output)
                continue
            g = groups.setdefault(step.group, {"fixed": DecodeStats(), "adaptive": DecodeStats(), "requests": 0})
            g["requests"] += 1
            for mode in ("fixed", "adaptive") if cost is not None else ("fixed",):
                own = SuffixIndex(min_match=cfg.min_match, max_match=cfg.max_match, eos_token_ids=eos)
                proposer = own if not corpora else SourcesProposer(own, corpora, min_match=cfg.min_match,
                                                                   max_match=cfg.max_match, eos_token_ids=eos,
                                                                   **corpus_kw)
                proposer.extend(prompt)
                stats = replay(proposer, output, cap, DraftPolicy(cap, cost, counts=pooled)
                               if mode == "adaptive" else None)
                g[mode].merge(stats)
                if mode == "fixed" and corpora:
                    for k, v in proposer.accepted_from.items():
                        from_source[k] = from_source.get(k, 0) + v
            if memory is not None:
                memory.remember(prompt, output)
    out = {"seconds": time.perf_counter() - t0, "accepted_from_source": from_source, "groups": {}}
    for name, g in groups.items():
        row = {"requests": g["requests"], "emitted": g["fixed"].new_tokens,
               "mean_accepted_length": g["fixed"].mean_accepted_length, "steps": g["fixed"].steps}
        if cost is not None:
            row["adaptive_mean_accepted_length"] = g["adaptive"].mean_accepted_length
            row["estimated_speedup_vs_plain"] = estimated_speedup(g["adaptive"], cost)
        out["groups"][name] = row
    return out


def markdown(result: dict) -> str:
    lines = ["# Session memory and reference documents: offline replay", "",
             f"Command: `{result['environment']['command']}`  ",
             f"Cap {result['cap']}; memory bound {result['max_tokens']} tokens; tokenizer: default model's; "
             f"corpus matches of >= {result['corpus_min_match']} tokens beside a draft of the request's own, "
             f">= {result['alone_min_match']} when it has none.  ",
             "Mean accepted length = tokens per step, bonus included, every draft verified. The modelled speed-up "
             "prices each step of the adaptive policy with the forward-cost curve "
             f"({result['cost_curve'] or 'none'}); 'memory vs none' is the ratio of the modelled times.", "",
             "| workload | group | requests | mean acc. len: none | with memory | modelled speed-up vs plain: none "
             "| with memory | memory vs none |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for w in result["workloads"]:
        base, mem = w["without"]["groups"], w["with"]["groups"]
        for g in base:
            b, m = base[g], mem[g]
            cells = [w["name"], g, str(b["requests"]), f"{b['mean_accepted_length']:.2f}",
                     f"{m['mean_accepted_length']:.2f}"]
            if "estimated_speedup_vs_plain" in b:
                cells += [f"x{b['estimated_speedup_vs_plain']:.2f}", f"x{m['estimated_speedup_vs_plain']:.2f}",
                          f"x{m['estimated_speedup_vs_plain'] / b['estimated_speedup_vs_plain']:.2f}"]
            else:
                cells += ["", "", ""]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Draft tokens accepted per source (with memory, fixed drafts):", ""]
    for w in result["workloads"]:
        lines.append(f"* {w['name']}: {w['with']['accepted_from_source']}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", nargs="+", default=list(memory_sessions.WORKLOADS),
                    choices=list(memory_sessions.WORKLOADS))
    ap.add_argument("--limit", type=int, default=None, help="at most this many requests (files, chats) per source")
    ap.add_argument("--cap", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=200_000, help="memory bound in tokens (default 200k)")
    ap.add_argument("--cost-curve", default=str(DEFAULT_COST) if DEFAULT_COST.exists() else None,
                    help="benchmarks.e2e.generate results.json with forward_cost (default: the committed one); "
                    "'' for none")
    ap.add_argument("--corpus-min-match", type=int, default=sources.CORPUS_MIN_MATCH,
                    help="shortest memory/reference match that may beat a draft of the request's own "
                    f"(default {sources.CORPUS_MIN_MATCH}, the package's)")
    ap.add_argument("--alone-min-match", type=int, default=sources.ALONE_MIN_MATCH,
                    help="shortest memory/reference match when the request has no draft "
                    f"(default {sources.ALONE_MIN_MATCH}, the package's)")
    ap.add_argument("--out", default=str(RESULTS / "memory_replay"))
    args = ap.parse_args(argv)

    tokenizer = load_tokenizer()
    eos = eos_of(tokenizer)
    cost = load_cost_curve(args.cost_curve, args.cap + 1) if args.cost_curve else None
    corpus_kw = {"corpus_min_match": args.corpus_min_match, "alone_min_match": args.alone_min_match}
    rows = []
    for name in tqdm(args.workloads, desc="workloads"):
        w = memory_sessions.load(name, args.limit)
        sessions = tokenize(w, tokenizer)
        rows.append({"name": name, **{label: run(w, sessions, tokenizer, use_memory=flag, cap=args.cap, cost=cost,
                                                 max_tokens=args.max_tokens, eos=eos, corpus_kw=corpus_kw)
                                      for label, flag in (("without", False), ("with", True))}})
    result = {"environment": environment(), "cap": args.cap, "max_tokens": args.max_tokens,
              "cost_curve": args.cost_curve, **corpus_kw, "workloads": rows}
    path = write_result(args.out, "replay", result, markdown(result))
    print(f"wrote {path} and {path.with_suffix('.md')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
