"""Classify every vLLM output that differs from no speculation's: a bfloat16 near-tie, or not (issue 32).

The engine study (`benchmarks/vllm/engine.py`) saves every request's token ids per method, cell and repeat. In
bfloat16, vLLM's verify forward (K + 1 tokens) and its decode forward (1 token) round differently, so greedy
outputs can part where the model's top two logits nearly tie, for every speculative method. This reads a saved
study, finds each request whose tokens differ from no speculation's (the cell's first cold `none` run), and runs
the package's classifier (`lookup_decode.engines.hf.ties.classify`) on the study's model in transformers, in the
study's dtype: the first difference is a near-tie when the two tokens' logits are within `ties.NEAR_TIE` of each
other in both a 1-token and a 16-token forward over the text before it.

Caveat: the logits are transformers' (same weights, same dtype), not vLLM's CPU kernels'; a gap within NEAR_TIE
there is a gap of the same order in vLLM, not the same number.

    python -m benchmarks.vllm.ties benchmarks/results/vllm/NAME.json       # writes NAME_ties.json and NAME_ties.md

Runs in the dev environment (transformers), not in vLLM's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.vllm.engine_report import REFERENCE, reference_outputs
from lookup_decode.engines.hf import ties
from lookup_decode.engines.hf.models import load_model


def classify_all(study: dict, model) -> list[dict]:
    """Every (method, cell, phase, repeat, request) whose tokens differ from the reference's (an again cell is
    compared with the cold reference: same requests), with its first difference classified; a (request, output)
    pair seen before is not recomputed."""
    refs, seen, rows = reference_outputs(study["runs"]), {}, []
    for run in study["runs"]:
        for c in run.get("cells", []):
            ref = refs.get((c["workload"], c["batch"]), {})
            for i, toks in c["tokens"].items():
                if i not in ref or toks == ref[i]:
                    continue
                key = (i, tuple(ref[i]), tuple(toks))
                if key not in seen:
                    seen[key] = ties.classify(model, study["prompts"][i], ref[i], toks)
                d = seen[key]
                rows.append({"method": run["method"], "repeat": run["repeat"], "cell": f"{c['workload']}:{c['batch']}",
                             "phase": c.get("phase", "cold"), "request": i, "position": d.position,
                             "plain_token": d.plain, "other_token": d.lookup, "gap_1": d.gaps[0],
                             "gap_wide": d.gaps[1], "near_tie": d.near_tie})
    return rows


def report(study: dict, rows: list[dict], source: str) -> str:
    n_outputs = sum(len(c["tokens"]) for r in study["runs"] if r["method"] != REFERENCE for c in r.get("cells", []))
    ties_n = sum(r["near_tie"] for r in rows)
    lines = [f"# bfloat16 differences from no speculation, classified: `{source}`", "",
             f"Command: `python -m benchmarks.vllm.ties {source}`  ",
             f"Model: {study['settings']['model']} ({study['settings']['dtype']}), logits from transformers; "
             f"near-tie: both gaps <= {ties.NEAR_TIE} (`lookup_decode.engines.hf.ties.NEAR_TIE`).", "",
             f"**{len(rows)} of {n_outputs} speculative outputs differ from no speculation's; {ties_n} of them part at "
             f"a near-tie.** Every output identical or a classified near-tie: "
             f"{'MET' if ties_n == len(rows) else 'NOT MET'}.", "",
             "| method | cell | phase | repeat | request | first difference at | none's token | its token | "
             "gap, 1-token forward | gap, 16-token forward | near-tie |", "|---" * 11 + "|"]
    for r in sorted(rows, key=lambda r: (r["cell"], r["method"], r["phase"], int(r["request"]), r["repeat"])):
        lines.append(f"| {r['method']} | {r['cell']} | {r['phase']} | {r['repeat']} | {r['request']} | {r['position']} "
                     f"| {r['plain_token']} | {r['other_token']} | {r['gap_1']:.3f} | {r['gap_wide']:.3f} | "
                     f"{'yes' if r['near_tie'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("study", type=Path, help="an engine study's JSON (benchmarks/results/vllm/NAME.json)")
    p.add_argument("--model", help="the study's model folder, where it moved (default: the study's)")
    args = p.parse_args(argv)
    study = json.loads(args.study.read_text())
    torch.set_grad_enabled(False)
    model, _ = load_model(args.model or study["settings"]["model"], dtype=study["settings"]["dtype"])
    rows = classify_all(study, model)
    stem = args.study.with_suffix("")
    Path(f"{stem}_ties.json").write_text(json.dumps({"source": str(args.study), "near_tie": ties.NEAR_TIE,
                                                     "differences": rows}, indent=1) + "\n")
    Path(f"{stem}_ties.md").write_text(report(study, rows, str(args.study)))
    print(Path(f"{stem}_ties.md").read_text())


if __name__ == "__main__":
    main()
