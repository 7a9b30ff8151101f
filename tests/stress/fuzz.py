"""Differential fuzzer: lookup decoding against plain `generate` on random tiny models, prompts and options.

Oracle (issue 16): where plain `generate` returns, lookup decoding returns the same tokens (greedy, and
sampling with top_k=1, which is deterministic); where plain raises, lookup decoding raises too. Lookup
decoding may also *refuse* what it does not support (a ValueError/TypeError from lookup_decode naming the
problem, e.g. trees on a cache it cannot roll back per branch): that is counted, never a crash. General
sampling (top_k=0) is compared by outcome only here; its distribution is tests/test_sampling.py's job.

A case is a JSON-able dict drawn from one seeded rng, so every failure is replayed by its seed and index:

    python -m tests.stress.fuzz --cases 5000 --seed 1 --out benchmarks/results/fuzz/fuzz_5000.json
    python -m tests.stress.fuzz --replay 1:1234          # one case, with its traceback

Outcomes: same, near_tie (first difference after a position where plain's two best scores are within
1e-5: a different reduction order may flip it), stopped_row (see `compare`), both_raise, refused (ours
only, a clear error), and the
failures: diff, crash (ours raised something else where plain returned), ours_only (plain raised, we returned).
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import sys
import time
import traceback

import numpy as np
import torch
import transformers as tf
from transformers import StoppingCriteriaList

import lookup_decode
from tests import tiny_models

VOCAB = 96
NEAR_TIE = 1e-5
FAILURES = ("diff", "crash", "ours_only")
SHORT_CONTEXT = 64     # the short-context GPT-2 (learned positions raise past it)


# family -> (tests/tiny_models.py family, config overrides); the cache families lookup_decode treats differently
# (full attention with RoPE or learned positions, sliding windows, conv layers). The names are the fuzzer's own:
# a case records its family, and a replayed seed must build the same model.
FAMILIES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "gpt2": ("gpt2", {}),
    "gpt2_short": ("gpt2", {"n_positions": SHORT_CONTEXT}),
    "gpt_neox": ("gpt_neox", {}),
    "mistral_window": ("mistral_sliding_window", {}),
    "gemma2": ("gemma2", {}),
    "lfm2": ("lfm2", {}),
}
_MODELS: dict = {}


def model_of(family: str, seed: int = 0):
    if (family, seed) not in _MODELS:
        name, overrides = FAMILIES[family]
        _MODELS[family, seed] = tiny_models.build(name, seed, **overrides)
    return _MODELS[family, seed]


class CharTokenizer:
    """Decodes id i as one letter: enough for StopStrings (a stop string is a run of letters)."""

    def decode(self, ids, **kwargs):
        return "".join(chr(97 + int(i) % 26) for i in ids)


def make_case(seed: int, i: int) -> dict:
    """Case i of run `seed`: everything drawn from one rng, so (seed, i) replays it."""
    rng = np.random.default_rng([seed, i])
    pick = lambda options: options[int(rng.integers(len(options)))]  # noqa: E731
    family = pick(list(FAMILIES))
    context = SHORT_CONTEXT if family == "gpt2_short" else 1024
    k = int(pick([1, 2, 4, 8, 32]))
    new = int(pick([1, 2, 4, 8, 16, 24, 40]))
    if family == "gpt2_short" or rng.random() < 0.1:     # near the context limit: within k + 33 of it
        length = int(np.clip(context - new - rng.integers(0, k + 34), 2, context - new))
    else:
        length = int(rng.integers(2, 80))
    case = dict(seed=seed, i=i, family=family, prompt_seed=int(rng.integers(1 << 30)), length=length,
                repeat=bool(rng.random() < 0.7), batch=int(pick([1, 1, 1, 2, 3])), max_new_tokens=new,
                k=k, adaptive=bool(rng.random() < 0.5), eos=pick([None, [2], [2, 5, 9], [int(rng.integers(3, VOCAB))]]),
                min_new_tokens=int(pick([0, 0, 0, 3])), repetition_penalty=float(pick([1.0, 1.0, 1.3, 0.8])),
                no_repeat_ngram_size=int(pick([0, 0, 0, 2, 3])), sample=pick(["greedy", "greedy", "top1", "free"]),
                stop=pick([None, None, None, "ab", "xyz", "q"]), static=bool(rng.random() < 0.12),
                drafter=pick(["index", "index", "index", "tree", "memory", "references", "draft_model"]))
    return case


def prompt_of(case) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, P] ids (left-padded for batches) and the attention mask (None for one unpadded row)."""
    rng = np.random.default_rng(case["prompt_seed"])
    rows = []
    for b in range(case["batch"]):
        n = case["length"] if b == 0 else int(rng.integers(1, case["length"] + 1))
        if case["repeat"]:
            span = rng.integers(3, VOCAB, size=max(1, n // 3))
            row = np.resize(span, n)
        else:
            row = rng.integers(3, VOCAB, size=n)
        rows.append(row)
    P = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), P), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, P - len(r):], mask[b, P - len(r):] = torch.from_numpy(r), 1
    return ids, (None if bool(mask.all()) and len(rows) == 1 else mask)


def generate_kwargs(case) -> dict:
    kw = dict(max_new_tokens=case["max_new_tokens"], pad_token_id=0, eos_token_id=case["eos"],
              return_dict_in_generate=True, output_scores=True)
    if case["min_new_tokens"]:
        kw["min_new_tokens"] = case["min_new_tokens"]
    if case["repetition_penalty"] != 1.0:
        kw["repetition_penalty"] = case["repetition_penalty"]
    if case["no_repeat_ngram_size"]:
        kw["no_repeat_ngram_size"] = case["no_repeat_ngram_size"]
    if case["sample"] == "greedy":
        kw["do_sample"] = False
    else:
        kw.update(do_sample=True, top_k=1 if case["sample"] == "top1" else 0, temperature=1.0, top_p=1.0)
    if case["static"]:
        kw["cache_implementation"] = "static"
    if case["stop"] is not None:
        kw["stopping_criteria"] = StoppingCriteriaList([lookup_decode.StopStrings(CharTokenizer(), [case["stop"]])])
    return kw


def lookup_kwargs(case, model, ids) -> dict:
    kw = dict(k=case["k"], adaptive=case["adaptive"], stats=lookup_decode.DecodeStats())
    rows = ids.shape[0]
    drafter = case["drafter"]
    if drafter == "tree":
        kw["proposer"] = [lookup_decode.TreeProposer(width=3) for _ in range(rows)]
    elif drafter == "draft_model":
        kw["proposer"] = [lookup_decode.DraftModelProposer(model_of("llama", seed=1), do_sample=False)
                          for _ in range(rows)]
    elif drafter == "memory":
        memory = lookup_decode.Memory(max_tokens=2000)
        memory.remember(ids[0], ids[0].flip(0))        # something to copy that is not the prompt itself
        kw["memory"] = memory
    elif drafter == "references":
        refs = lookup_decode.References()
        refs.register("doc", tokens=torch.randint(3, VOCAB, (60,), generator=torch.Generator().manual_seed(1)))
        refs.register("prompt", tokens=ids[0, -20:])
        kw["references"] = refs
    if rows == 1 and drafter in ("tree", "draft_model"):
        kw["proposer"] = kw["proposer"][0]
    return kw


def _run(fn):
    try:
        return fn(), None
    except Exception as e:          # noqa: BLE001  (the oracle compares exceptions)
        return None, e


def _clear_refusal(e: Exception) -> bool:
    """A refusal lookup_decode raised on purpose: ValueError/TypeError raised from inside lookup_decode."""
    if not isinstance(e, (ValueError, TypeError)):
        return False
    tb = traceback.extract_tb(e.__traceback__)
    return bool(tb) and "lookup_decode" in tb[-1].filename and "site-packages" not in tb[-1].filename


def run_case(case) -> dict:
    """The outcome of one case (see the module docstring)."""
    model = model_of(case["family"])
    ids, mask = prompt_of(case)
    kw = generate_kwargs(case)
    if mask is not None:
        kw["attention_mask"] = mask
    seed = case["prompt_seed"]

    def plain():
        torch.manual_seed(seed)
        return model.generate(ids, **kw)

    def ours():
        extra = lookup_kwargs(case, model, ids)
        stats = extra["stats"]
        mine = dict(kw)
        if ids.shape[0] > 1:         # scores are single-sequence only (a documented refusal); plain's are the oracle's
            mine.pop("output_scores")
        out = model.generate(ids, custom_generate=lookup_decode.generate,
                             generator=torch.Generator().manual_seed(seed), **mine, **extra)
        return out, stats
    theirs, their_error = _run(plain)
    mine, my_error = _run(ours)
    outcome = dict(kind=kind_of(case), accepted=0)
    if their_error is not None:
        if my_error is not None:
            outcome["result"] = "both_raise"
        else:
            outcome.update(result="ours_only", error=f"plain raised {type(their_error).__name__}: {their_error}")
        return outcome
    if my_error is not None:
        refused = _clear_refusal(my_error)
        outcome.update(result="refused" if refused else "crash", error=f"{type(my_error).__name__}: {my_error}")
        if not refused:
            outcome["traceback"] = "".join(traceback.format_exception(my_error))[-3000:]
        return outcome
    out, stats = mine
    outcome["accepted"] = stats.accepted
    if case["sample"] == "free":       # a different random stream: outcome and shape only
        same_shape = out.sequences.shape[0] == theirs.sequences.shape[0]
        in_vocab = bool(((out.sequences >= 0) & (out.sequences < VOCAB)).all())
        outcome["result"] = "same" if same_shape and in_vocab else "diff"
        return outcome
    stops = kw.get("stopping_criteria")
    outcome["result"] = compare(out.sequences, theirs.sequences, torch.stack(theirs.scores, 1), ids.shape[1], stops)
    return outcome


def compare(ours, theirs, scores, P, stops=None) -> str:
    """same / near_tie / stopped_row / diff over every row's generated tokens (scores: plain's processed
    [B, new, V]).

    stopped_row: with no EOS id, plain batched generate keeps generating a row whose stopping criterion
    fired (it pads finished rows only when an EOS id exists: `has_eos_stopping_criteria` in transformers'
    `_sample`); lookup decoding pads it from there, as plain does whenever an EOS id is set. Counted apart.
    """
    result = "same"
    for b in range(theirs.shape[0]):
        a, t = ours[b, P:].tolist() if b < ours.shape[0] else [], theirs[b, P:].tolist()
        n = min(len(a), len(t))
        diff = [j for j in range(n) if a[j] != t[j]]
        if diff and stops is not None and all(x == 0 for x in a[diff[0]:]) and diff[0] > 0 \
                and bool(stops(theirs[b: b + 1, : P + diff[0]], None).any()):
            result = "stopped_row"
            continue
        if not diff:
            if len(a) != len(t) and not _pad_tail(a, t):
                return "diff"
            continue
        row = scores[b, diff[0]].float()
        row = row[torch.isfinite(row)]
        top2 = torch.topk(row, 2).values if row.numel() >= 2 else None
        if top2 is None or float(top2[0] - top2[1]) >= NEAR_TIE:
            return "diff"
        result = "near_tie" if result == "same" else result
    return result


def _pad_tail(a, t) -> bool:
    """Batch outputs may differ in width only by padding after every row's end."""
    longer = a if len(a) > len(t) else t
    return all(x == 0 for x in longer[min(len(a), len(t)):])


def kind_of(case) -> str:
    """The case's kind for the per-kind counts."""
    return "/".join([case["family"], "batch" if case["batch"] > 1 else "single", case["sample"], case["drafter"],
                     "static" if case["static"] else "dynamic"])


def quiet() -> None:
    """One thread (tiny models), and none of transformers' per-call warnings about the options drawn."""
    import warnings
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    tf.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the result JSON here (written again every 10 cases)")
    parser.add_argument("--replay", default=None, help="SEED:I: run one case and print it")
    args = parser.parse_args(argv)
    quiet()
    if args.replay:
        seed, i = map(int, args.replay.split(":"))
        case = make_case(seed, i)
        print(json.dumps(case), json.dumps(run_case(case), indent=1), sep="\n")
        return 0
    counts = collections.Counter()
    by_axis = {axis: collections.Counter() for axis in ("family", "sample", "drafter", "batch", "static", "stop",
                                                        "adaptive", "k")}
    failures, accepted, t0 = [], 0, time.time()
    refusals, kinds = collections.Counter(), collections.Counter()

    def write(done):
        if args.out:
            os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
            result = dict(command=f"python -m tests.stress.fuzz --cases {args.cases} --seed {args.seed}",
                          cases_done=done, cases_asked=args.cases, seconds=round(time.time() - t0, 1),
                          outcomes=dict(counts), failures=failures, accepted_tokens=accepted,
                          refusals=dict(refusals.most_common()), cases_per_kind=dict(kinds.most_common()),
                          cases_per_axis={a: {str(k): v for k, v in c.items()} for a, c in by_axis.items()},
                          torch=torch.__version__, transformers=tf.__version__)
            tmp = f"{args.out}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(result, f, indent=1)
            os.replace(tmp, args.out)

    for i in range(args.cases):
        case = make_case(args.seed, i)
        outcome = run_case(case)
        counts[outcome["result"]] += 1
        accepted += outcome["accepted"]
        kinds[outcome["kind"]] += 1
        if outcome["result"] == "refused":
            refusals[outcome["error"].split(";")[0][:120]] += 1
        for axis, c in by_axis.items():
            c[case[axis] if axis != "stop" else case[axis] is not None] += 1
        if outcome["result"] in FAILURES:
            failures.append(dict(case=case, **outcome))
            print(f"case {args.seed}:{i} {outcome['result']}: {outcome.get('error', '')}", file=sys.stderr)
        if (i + 1) % 10 == 0:
            write(i + 1)
            print(f"{i + 1} cases, {dict(counts)}", file=sys.stderr)
    write(args.cases)
    print(json.dumps(dict(counts)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
