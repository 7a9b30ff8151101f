"""Is the acceptance model calibrated? Replay recorded real outputs through the drafters and compare each sent draft
token's predicted probability of being kept with whether the target (the known continuation) kept it.

    python -m benchmarks.replay.calibration                       # code edits, summaries, chat; batch 1 and 8
    python -m benchmarks.replay.calibration --limit 8 --name quick
    python -m benchmarks.replay.calibration --ablate --drivers pool --name ablation   # what each part earns

Two drivers, no engine and no model:
* `pool`: `core.pool.IndexPool` stepped as vLLM's runner steps the drafter (rows join a persistent batch of B as
  others finish), each row's length chosen by `policy.ragged_lengths` with the step cost's token_cost; the target
  keeps the longest prefix equal to the record and emits one more recorded token.
* `policy`: the transformers path, `core.decode.step` through `engines.replay.RecordedForward` (a `SuffixIndex` per
  row, one `DraftPolicy` for a batch of B rows that start together, its width chosen on a linear cost curve).
Per workload, batch and step cost: the reliability table over the tokens sent (bins of predicted probability:
tokens, mean predicted, share kept), the worst gap over bins of >= 50 tokens (the bar: <= 0.05), the same over every
position of every full draft, and for the pool the modelled tokens/s against the oracle cut (every full draft cut to
exactly what the target keeps) at a CPU-like (103 ms + 11.6 ms per verified token) and a GPU-like (7 ms + 0.032 ms)
step cost. `--ablate` runs each cell with every model of ABLATIONS (the acceptance model without its deepest level of
cells, without the copy-rate class, without both). Writes benchmarks/results/calibration/NAME.{json,md}.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from benchmarks.harness.results import RESULTS, write_result
from benchmarks.harness.workloads import eos_of, real_pairs
from lookup_decode.core.acceptance import new_counts, params
from lookup_decode.core.cost import CostCurve
from lookup_decode.core.decode import Rows, step
from lookup_decode.core.draft import kept_prefix
from lookup_decode.core.index import SuffixIndex
from lookup_decode.core.policy import DraftPolicy, ragged_lengths
from lookup_decode.core.pool import IndexPool
from lookup_decode.core.stats import Calibration, DecodeStats
from lookup_decode.engines.replay import RecordedForward

WORKLOADS = {"code_edit": "code edits", "cnn_dm": "summaries", "mt_bench_pld": "chat"}
COSTS = {"cpu": (0.103, 0.0116), "gpu": (0.007, 0.000032)}   # seconds: fixed per step, per verified token
K = 8
# The acceptance model and its ablations: acceptance.params overrides.
ABLATIONS = {"full": {}, "no L3": {"levels": 3}, "no rate": {"rate_classes": 0},
             "no L3, no rate": {"levels": 3, "rate_classes": 0}}


def run_pool(pairs, batch: int, cost: tuple[float, float], eos, oracle: bool = False, model=None) -> dict:
    """Replay `pairs` through one IndexPool, `batch` rows at a time (a finished row's place goes to the next);
    model: acceptance.params overrides."""
    fixed, per_token = cost
    pool = IndexPool(K, min_match=1, max_match=64, eos_token_ids=eos, params=params(**(model or {})))
    width = max(len(p) + len(o) for p, o in pairs) + K + 2
    matrix = np.zeros((batch, width), np.int32)
    sent_cal, full_cal = Calibration(), Calibration()
    waiting, active = list(range(len(pairs))), {}      # row -> [request, slot, indexed, length, emitted]
    seconds = emitted_total = steps = drafted = kept_total = 0
    while waiting or active:
        for row in range(batch):
            if row not in active and waiting:
                i = waiting.pop(0)
                p, o = pairs[i]
                matrix[row, : len(p)] = p
                matrix[row, len(p)] = o[0]              # the prefill's token
                active[row] = [i, pool.add(len(p) + len(o)), 0, len(p) + 1, 1]
        rows = np.array(sorted(active), np.int64)
        st = [active[r] for r in rows]
        slots = np.array([a[1] for a in st], np.int64)
        starts = np.array([a[2] for a in st], np.int64)
        ends = np.array([a[3] for a in st], np.int64)
        limits = np.array([max(min(K, len(pairs[a[0]][1]) - a[4] - 1), 0) for a in st], np.int64)
        got = pool.step(matrix, rows, slots, starts, ends, limits, starts > 0)
        truths = [pairs[a[0]][1][a[4]:] for a in st]
        full_kept = np.array([kept_prefix(got.tokens[j, : got.lengths[j]], t) for j, t in enumerate(truths)])
        if oracle:
            sent = full_kept
        else:
            sent = ragged_lengths(got.p_kept, got.lengths, per_token / fixed)
        kept = np.array([min(kept_prefix(got.tokens[j, : sent[j]], t), sent[j]) for j, t in enumerate(truths)])
        sent_cal.observe_rows(got.p_kept, sent, kept)
        full_cal.observe_rows(got.p_kept, got.lengths, full_kept)
        seconds += fixed + per_token * (len(rows) + int(sent.sum()))
        steps += 1
        drafted += int(sent.sum())
        kept_total += int(kept.sum())
        for j, r in enumerate(rows):
            a = active[r]
            out = truths[j][: kept[j] + 1]
            matrix[r, a[3]: a[3] + len(out)] = out
            a[2], a[3], a[4] = a[3], a[3] + len(out), a[4] + len(out)
            emitted_total += len(out)
            if a[4] >= len(pairs[a[0]][1]):
                pool.remove(a[1])
                del active[r]
    return {"steps": steps, "emitted": emitted_total, "drafted": drafted, "kept": kept_total,
            "tokens_per_step": emitted_total / steps, "tok_s": emitted_total / seconds,
            "calibration": table(sent_cal), "full_calibration": table(full_cal)}


def run_policy(pairs, batch: int, cost: tuple[float, float], eos, k: int = 32, model=None) -> dict:
    """Replay through `decode.step` (the transformers path): groups of `batch` rows start together; a row stops at
    the end of its record."""
    fixed, per_token = cost
    stats, cal = DecodeStats(), Calibration()
    counts = new_counts()       # one pool for every call, as the transformers hook keeps one per model
    for g in range(0, len(pairs), batch):
        group = pairs[g: g + batch]
        r = len(group)
        curve = CostCurve([1, k + 1], [fixed + per_token * r, fixed + per_token * r * (k + 1)], k + 1, rows=r)
        policy = DraftPolicy(k, curve, counts=counts, params=params(**(model or {})))
        outputs = [np.asarray(o, np.int32) for _, o in group]
        n = max(len(o) for o in outputs)
        drafters = []
        for (p, _), o in zip(group, outputs):
            d = SuffixIndex(p, min_match=1, max_match=64, eos_token_ids=eos)
            d.extend(o[:1])
            drafters.append(d)
        ids = torch.zeros((r, 1 + n), dtype=torch.long)
        for b, o in enumerate(outputs):
            ids[b, 1] = int(o[0])
        rows = Rows(ids, cur=[2] * r, active=[b for b in range(r) if len(outputs[b]) > 1], prompt_len=1)
        ends = [len(o) for o in outputs]        # the column of each row's last token

        def stops(ids, active, starts, emitted):
            return [ends[b] if s + len(e) - 1 >= ends[b] else None for b, s, e in zip(active, starts, emitted)]
        forward = _Truth(outputs, policy, cal)
        while rows.active:
            step(rows, forward, drafters, policy, stops, stats)
    return {"steps": stats.steps, "drafted": stats.drafted, "kept": stats.accepted, "calibration": table(cal),
            "decode_stats_calibration": stats.reliability.error(50)}


class _Truth(RecordedForward):
    """RecordedForward that also scores the policy's predictions of the tokens it verifies (the chain)."""

    def __init__(self, outputs, policy, cal: Calibration):
        super().__init__(outputs)
        self.policy, self.cal = policy, cal

    def verify(self, rows, drafts):
        out = super().verify(rows, drafts)
        p = _priced(self.policy, drafts, rows.active)
        sent = np.array([len(d.chain) for d in drafts])
        kept = np.array([v.kept for v in out])
        self.cal.observe_rows(p, sent, kept)
        return out


def _priced(policy, drafts, active) -> np.ndarray:
    """The probabilities the policy priced this step's drafts with: float [r, max sent]."""
    width = max([len(d.chain) for d in drafts] + [1])
    out = np.zeros((len(drafts), width))
    w = min(width, policy.last_p.shape[1])
    out[:, :w] = policy.last_p[:, :w]
    return out


def table(cal: Calibration) -> dict:
    return {"rows": [r._asdict() for r in cal.rows()], "worst_gap": cal.error(50),
            "tokens": sum(cal.tokens)}


def markdown(result: dict) -> str:
    lines = ["# Calibration of the acceptance model on recorded real outputs", "",
             f"Command: `{result['command']}`  ",
             "Worst gap = max |mean predicted - share kept| over bins of >= 50 tokens sent (the bar: <= 0.05). "
             "`sent`: the tokens the length rule sent; `full`: every position of every full draft. "
             "tok/s: modelled (fixed + per token x verified tokens per step); ceiling: every full draft cut to "
             "what the target keeps.", "",
             "| workload | driver | model | batch | cost | worst gap sent | worst gap full | tokens sent | tok/step | "
             "tok/s | ceiling tok/s | share of ceiling |",
             "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in result["cells"]:
        share = c["tok_s"] / c["ceiling_tok_s"] if c.get("ceiling_tok_s") else None
        lines.append(f"| {c['workload']} | {c['driver']} | {c.get('model', 'full')} | {c['batch']} | {c['cost']} | "
                     f"{c['calibration']['worst_gap']:.3f} | {c.get('full_calibration', {}).get('worst_gap', 0):.3f} | "
                     f"{c['calibration']['tokens']} | {c.get('tokens_per_step', 0):.2f} | {c.get('tok_s', 0):.2f} | "
                     f"{c.get('ceiling_tok_s', 0):.2f} | " + (f"{share:.3f} |" if share else "- |"))
    lines += ["", "## Reliability tables (tokens sent): bin, tokens, predicted, kept", ""]
    for c in result["cells"]:
        rows = "; ".join(f"[{r['bin_low']:.1f},{r['bin_high']:.1f}) {r['tokens']} {r['predicted']:.2f}->{r['kept']:.2f}"
                         for r in c["calibration"]["rows"])
        lines.append(f"* {c['workload']} {c['driver']} {c.get('model', 'full')} b{c['batch']} {c['cost']}: {rows}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=24, help="requests per workload")
    ap.add_argument("--sets", nargs="+", default=list(WORKLOADS))
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--drivers", nargs="+", default=["pool", "policy"])
    ap.add_argument("--name", default="calibration")
    ap.add_argument("--ablate", nargs="*", choices=list(ABLATIONS), default=None,
                    help="the models of ABLATIONS to run (none named: all), not only the full one")
    args = ap.parse_args(argv)
    models = {"full": {}} if args.ablate is None else {m: ABLATIONS[m] for m in args.ablate or ABLATIONS}
    from lookup_decode.engines.hf.models import load_tokenizer
    tokenizer = load_tokenizer()
    eos = eos_of(tokenizer)
    pairs = real_pairs(tokenizer, args.sets, limit=args.limit, min_tokens=2)
    from lookup_decode.measure import command_line
    result = {"command": command_line(), "limit": args.limit, "k_pool": K, "cells": []}
    for name in args.sets:
        for batch in args.batches:
            for cost_name, cost in COSTS.items():
                # The oracle's drafts and cuts do not depend on the acceptance model: one ceiling per cell.
                ceiling = run_pool(pairs[name], batch, cost, eos, oracle=True) if "pool" in args.drivers else None
                for model_name, model in models.items():
                    if "pool" in args.drivers:
                        cell = run_pool(pairs[name], batch, cost, eos, model=model)
                        cell.update(workload=name, driver="pool", model=model_name, batch=batch, cost=cost_name,
                                    ceiling_tok_s=ceiling["tok_s"], ceiling_steps=ceiling["steps"])
                        result["cells"].append(cell)
                        print(name, "pool", model_name, batch, cost_name, f"gap {cell['calibration']['worst_gap']:.3f}",
                              f"full {cell['full_calibration']['worst_gap']:.3f}",
                              f"share {cell['tok_s'] / ceiling['tok_s']:.3f}", flush=True)
                    if "policy" in args.drivers:
                        cell = run_policy(pairs[name], batch, cost, eos, model=model)
                        cell.update(workload=name, driver="policy", model=model_name, batch=batch, cost=cost_name)
                        result["cells"].append(cell)
                        print(name, "policy", model_name, batch, cost_name,
                              f"gap {cell['calibration']['worst_gap']:.3f}", flush=True)
            write_result(RESULTS / "calibration", args.name, result, None)
    write_result(RESULTS / "calibration", args.name, result, markdown(result))


if __name__ == "__main__":
    main()
