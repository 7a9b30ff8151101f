"""lookup_decode's vLLM drafter against vLLM's own proposers, driven as vLLM's runner drives them (no GPU).

    python -m benchmarks.vllm.bench cost       # drafter CPU time per engine step vs vLLM's n-gram proposer
    python -m benchmarks.vllm.bench replay     # tokens per step on the shared sets, K = 4, 8, 16
    python -m benchmarks.vllm.bench replicas   # 4 replicas sharing memory files vs 4 isolated ones
    python -m benchmarks.vllm.bench engine     # the real vLLM engine: lookup_decode vs none/ngram/suffix
                                               # (benchmarks/vllm/engine.py; `engine --help` for its flags)

Every proposer runs behind the runner's `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)`:
* cost: a persistent batch of B rows of T tokens; after one untimed step (lookup_decode indexes each
  row once) every step appends 2 tokens per row, then each proposer drafts for the whole batch;
  median seconds per step. vLLM's n-gram proposer is `benchmarks.harness.baselines.VllmNgramProposer` (its
  algorithm and defaults, prange over rows with vLLM's thread count).
* replay: `tests.sim_runner.SimRunner` (a persistent batch of 16 rows, requests joining as rows
  free up) with each set's real (prompt, output) pairs as the target: every step emits the accepted
  prefix of the draft plus the true next token. Tokens per step = tokens emitted per decode step, the
  bonus token included. SuffixDecoding is ArcticInference's own package (`arctic_inference`, its C++
  suffix tree) driven as vLLM's SuffixDecodingProposer drives it: start_request with the prompt,
  add_active_response, speculate on the last max_tree_depth tokens, stop_request when the request
  leaves the batch, one global cache of responses across the set; vLLM's defaults (depth 24,
  max_spec_factor 1, min_token_prob 0.1, 10,000 cached requests).
* replicas: the multi-turn memory workloads (benchmarks/replay/sessions.py) with each request routed to
  one of 4 replicas at random; "shared": each replica saves its memory to its own file after every
  turn and loads the others' (LOOKUP_DECODE_MEMORY lists all four files, reload between turns);
  "isolated": each replica keeps its own memory. Tokens per step of the scored turns.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness.baselines import ArcticSuffix, VllmNgramProposer
from benchmarks.harness.results import RESULTS, write_result
from lookup_decode.engines.vllm.drafter import LookupDrafter, Settings
from lookup_decode.measure import environment
from lookup_decode.sources.memory import Memory
from tests.sim_runner import SimRequest, SimRunner

MACHINE_NOTE = ("Taken on a shared, busy 2-core machine (3 other engineers' jobs running): absolute times are "
                "noisy; the two proposers were timed alternately on the same batches.")


# -- cost ---------------------------------------------------------------------------------------------
def _rows(rng, B: int, T: int, extra: int) -> np.ndarray:
    """B rows of T + extra tokens: a 1,000-token random block repeated with 5% substitutions (code-like
    repetition, so both proposers find matches)."""
    block = rng.integers(0, 32000, size=1000)
    rows = np.resize(block, (B, T + extra)).astype(np.int32)
    noise = rng.random(rows.shape) < 0.05
    rows[noise] = rng.integers(0, 32000, size=int(noise.sum()))
    return rows


def bench_cost(batches, contexts, k: int, steps: int, draft_cost: float = 0.0, seed: int = 0) -> list[dict]:
    out = []
    for T in contexts:
        for B in batches:
            rng = np.random.default_rng(seed)
            max_len = T + 2 * (steps + 2) + k + 1
            tokens = _rows(rng, B, T, max_len - T)
            counts = np.full(B, T, np.int64)
            ours = LookupDrafter.from_settings(Settings(draft_cost=draft_cost, max_index_bytes=16 * 2**30), k,
                                              max_model_len=max_len)   # every row indexed, as vLLM's scans every row
            ngram = VllmNgramProposer(k, max_len, max_num_seqs=B)
            sampled = [[int(tokens[i, T - 1])] for i in range(B)]
            t = time.perf_counter()
            ours.propose(sampled, counts, tokens)               # untimed for the steps: indexes each row once
            build_s = time.perf_counter() - t
            ngram.propose(sampled, counts, tokens)
            times = {"lookup_decode": [], "vllm_ngram": []}
            drafted = {"lookup_decode": 0, "vllm_ngram": 0}
            for _ in range(steps):
                sampled = [[int(tokens[i, counts[i]]), int(tokens[i, counts[i] + 1])] for i in range(B)]
                counts += 2
                for name, proposer in (("vllm_ngram", ngram), ("lookup_decode", ours)):
                    t = time.perf_counter()
                    drafts = proposer.propose(sampled, counts, tokens)
                    times[name].append(time.perf_counter() - t)
                    drafted[name] += sum(map(len, drafts))
            row = {"context": T, "batch": B, "k": k, "steps": steps, "draft_cost": draft_cost,
                   "lookup_decode_build_s": build_s,
                   "index_bytes": ours.index_bytes}
            for name, ts in times.items():
                row[f"{name}_ms_per_step"] = 1e3 * float(np.median(ts))
                row[f"{name}_us_per_row"] = 1e6 * float(np.median(ts)) / B
                row[f"{name}_drafted_per_row_step"] = drafted[name] / (B * steps)
            row["ratio"] = row["vllm_ngram_ms_per_step"] / row["lookup_decode_ms_per_step"]
            print(json.dumps(row), flush=True)
            out.append(row)
            del ours
    return out


def cost_markdown(rows, command) -> str:
    lines = ["# Drafter CPU time per engine step: lookup_decode vs vLLM's n-gram proposer", "",
             f"Command: `{command}`  ", MACHINE_NOTE + "  ",
             "Median over the timed steps; each step appends 2 tokens to every row, then each proposer drafts "
             "for the whole batch (k = {}). lookup_decode indexed each row once before (build column, not in "
             "the per-step time); its draft_cost: {} (0: every proposed token drafted, as vLLM's n-gram does, and "
             "the policy has nothing to price or learn).".format(rows[0]["k"], rows[0]["draft_cost"]), "",
             "| context | batch | vLLM n-gram ms/step | lookup_decode ms/step | n-gram / lookup_decode | "
             "lookup_decode µs/row | one-time index build s | index MB |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['context']} | {r['batch']} | {r['vllm_ngram_ms_per_step']:.3f} | "
                     f"{r['lookup_decode_ms_per_step']:.3f} | x{r['ratio']:.1f} | "
                     f"{r['lookup_decode_us_per_row']:.1f} | {r['lookup_decode_build_s']:.2f} | "
                     f"{r['index_bytes'] / 2**20:.0f} |")
    return "\n".join(lines) + "\n"


# -- replay -------------------------------------------------------------------------------------------
def _run(make, pairs, max_num_reqs: int = 16) -> dict:
    requests = [SimRequest(p, o) for p, o in pairs if len(o) >= 2]
    max_len = max(len(r.prompt) + len(r.truth) for r in requests) + 64
    proposer = make(max_len)
    runner = SimRunner(proposer, max_num_reqs=max_num_reqs, max_model_len=max_len)
    if isinstance(proposer, ArcticSuffix):
        proposer.runner = runner
    t = time.perf_counter()
    runner.run(requests)
    seconds = time.perf_counter() - t
    steps = sum(len(r.emitted) for r in requests)
    emitted = sum(sum(r.emitted) for r in requests)
    drafted = sum(sum(map(len, r.drafts[: len(r.emitted)])) for r in requests)
    return {"requests": len(requests), "steps": steps, "tokens_per_step": emitted / steps,
            "drafted_per_step": drafted / steps, "seconds": seconds}


def replay_methods(k: int, eos, with_arctic: bool) -> dict:
    methods = {
        "lookup_decode": lambda L: LookupDrafter.from_settings(Settings(draft_cost=0.0), k, max_model_len=L,
                                                              eos_token_ids=eos),
        "lookup_decode_adaptive": lambda L: LookupDrafter.from_settings(Settings(), k, max_model_len=L,
                                                                       eos_token_ids=eos),
        "lookup_decode_memory": lambda L: LookupDrafter.from_settings(Settings(draft_cost=0.0, idle_steps=1), k,
                                                                     max_model_len=L, eos_token_ids=eos,
                                                                     memory=Memory(1_000_000)),
        "vllm_ngram": lambda L: VllmNgramProposer(k, L, max_num_seqs=16),
    }
    if with_arctic:
        methods["suffix_decoding"] = lambda L: ArcticSuffix(k, L)
    return methods


def bench_replay(sets, ks, limit: int) -> dict:
    from benchmarks.harness.workloads import eos_of, real_pairs
    from lookup_decode.engines.hf.models import load_tokenizer
    tokenizer = load_tokenizer()
    eos = eos_of(tokenizer)
    pairs = real_pairs(tokenizer, sets, limit=limit, min_tokens=2)
    try:
        import arctic_inference.suffix_decoding  # noqa: F401
        with_arctic = True
    except ImportError:
        with_arctic = False
        print("arctic_inference is not importable: SuffixDecoding left out", flush=True)
    out = {}
    for k in ks:
        for name in sets:
            for method, make in replay_methods(k, eos, with_arctic).items():
                row = _run(make, pairs[name])
                out.setdefault(str(k), {}).setdefault(name, {})[method] = row
                print(k, name, method, json.dumps(row), flush=True)
    return out


def replay_markdown(result, command) -> str:
    methods = ["lookup_decode", "lookup_decode_memory", "vllm_ngram", "suffix_decoding", "lookup_decode_adaptive"]
    lines = ["# Tokens per step on the shared sets, proposers driven as vLLM's runner drives them", "",
             f"Command: `{command}`  ",
             "Tokens per step = tokens emitted per decode step (accepted drafts + the bonus/recovered token); "
             "in brackets: draft tokens sent per step. `lookup_decode`: every proposed token verified "
             "(draft_cost 0, like the others); `lookup_decode_memory`: the same plus one session memory over the "
             "set (earlier requests' outputs, the counterpart of SuffixDecoding's global response cache); "
             "`lookup_decode_adaptive`: the default draft_cost 0.02, which drafts fewer tokens. "
             "`suffix_decoding`: ArcticInference's own package.", ""]
    for k, sets in result.items():
        present = [m for m in methods if m in next(iter(sets.values()))]
        lines += [f"## K = {k}", "", "| set | requests | " + " | ".join(present) + " |",
                  "|---|---:|" + "---:|" * len(present)]
        for name, rows in sets.items():
            cells = [f"{rows[m]['tokens_per_step']:.2f} ({rows[m]['drafted_per_step']:.1f})" for m in present]
            lines.append(f"| {name} | {rows[present[0]]['requests']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


# -- replicas -----------------------------------------------------------------------------------------
def bench_replicas(workloads, limit: int, k: int, replicas: int = 4, seed: int = 0) -> dict:
    from benchmarks.harness.workloads import eos_of
    from benchmarks.replay import sessions as memory_sessions
    from benchmarks.replay.memory import tokenize
    from lookup_decode.engines.hf.models import load_tokenizer
    tokenizer = load_tokenizer()
    eos = eos_of(tokenizer)
    out = {}
    for name in workloads:
        sessions = tokenize(memory_sessions.load(name, limit), tokenizer)
        rng = np.random.default_rng(seed)
        # turn t of every session, in session order; each request routed to a random replica
        turns = max(len(s) for s in sessions)
        route = [[int(rng.integers(replicas)) for _ in s] for s in sessions]
        max_len = max(len(p) + len(o) for s in sessions for p, o, _ in s) + 64
        result = {}
        for mode in ("isolated", "shared"):
            with tempfile.TemporaryDirectory() as tmp:
                files = [str(Path(tmp) / f"replica{r}.mem") for r in range(replicas)]
                for f in files:
                    Memory(1_000_000).save(f)
                drafters = []
                for r in range(replicas):
                    settings = Settings(draft_cost=0.0, idle_steps=1,
                                        memory=os.pathsep.join(files) if mode == "shared" else None,
                                        memory_save=files[r] if mode == "shared" else None)
                    memory = None if mode == "shared" else Memory(1_000_000)
                    drafters.append(LookupDrafter.from_settings(settings, k, max_model_len=max_len, eos_token_ids=eos,
                                                                memory=memory))
                scored: dict[str, list] = {}
                for t in range(turns):
                    for r, drafter in enumerate(drafters):
                        batch = []
                        for s, session in enumerate(sessions):
                            if t < len(session) and route[s][t] == r:
                                prompt, output, step = session[t]
                                req = SimRequest(prompt, output)
                                batch.append(req)
                                if step.score and len(output) >= 2:
                                    scored.setdefault(step.group, []).append(req)
                        if batch:
                            SimRunner(drafter, max_num_reqs=16, max_model_len=max_len).run(batch)
                        drafter.flush()            # outputs into the memory (and its file, when shared)
                    if mode == "shared":
                        for drafter in drafters:
                            drafter.keeper.reload()
                result[mode] = {g: {"requests": len(reqs),
                                    "tokens_per_step": (sum(sum(r.emitted) for r in reqs)
                                                        / sum(len(r.emitted) for r in reqs))}
                                for g, reqs in scored.items()}
        out[name] = result
        print(name, json.dumps(result), flush=True)
    return out


def replicas_markdown(result, command, k: int) -> str:
    lines = ["# Four replicas sharing memory files vs four isolated replicas (offline replay)", "",
             f"Command: `{command}`  K = {k}.  ",
             "Each request goes to one of 4 replicas at random. Shared: every replica loads all four replicas' "
             "memory files and writes its own (LOOKUP_DECODE_MEMORY / LOOKUP_DECODE_MEMORY_SAVE), reloading between "
             "turns. Isolated: one in-process memory per replica. Tokens per step of the scored steps (bonus "
             "included), every proposed token verified.", "",
             "| workload | group | requests | isolated | shared | gain |", "|---|---|---:|---:|---:|---:|"]
    for name, modes in result.items():
        for g, iso in modes["isolated"].items():
            sh = modes["shared"][g]
            lines.append(f"| {name} | {g} | {iso['requests']} | {iso['tokens_per_step']:.2f} | "
                         f"{sh['tokens_per_step']:.2f} | x{sh['tokens_per_step'] / iso['tokens_per_step']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    import sys
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["engine"]:          # its own flags and defaults (engine.py), no simulation
        from benchmarks.vllm import engine
        return engine.main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["cost", "replay", "replicas", "engine"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 16384, 65536])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--k", type=int, nargs="+", default=None)
    ap.add_argument("--sets", nargs="+", default=None)
    ap.add_argument("--workloads", nargs="+", default=["mt_redundant_history", "mt_redundant_stateless", "rerun"])
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--draft-cost", type=float, default=0.0, help="cost: lookup_decode's LOOKUP_DECODE_DRAFT_COST")
    ap.add_argument("--out", type=Path, default=RESULTS / "vllm")
    args = ap.parse_args(argv)
    command = "python -m benchmarks.vllm.bench " + " ".join(argv)
    env = environment()
    if args.what == "cost":
        rows = bench_cost(args.batches, args.contexts, (args.k or [8])[0], args.steps, args.draft_cost)
        name = "cost" if args.draft_cost == 0 else f"cost_draft_cost_{args.draft_cost:g}"
        write_result(args.out, name, {"command": command, "environment": env, "rows": rows},
                     cost_markdown(rows, command), echo=False)
    elif args.what == "replay":
        from benchmarks.replay.drafts import SETS
        result = bench_replay(args.sets or SETS, args.k or [4, 8, 16], args.limit)
        write_result(args.out, "replay", {"command": command, "environment": env, "result": result},
                     replay_markdown(result, command), echo=False)
    else:
        k = (args.k or [16])[0]
        result = bench_replicas(args.workloads, args.limit, k)
        write_result(args.out, "replicas", {"command": command, "environment": env, "result": result},
                     replicas_markdown(result, command, k), echo=False)


if __name__ == "__main__":
    main()
