"""What trees of candidates could add, by offline replay: tokens per step with the best of w branches.

    python -m benchmarks.replay_tree                    # all sets, caps 10 and 32, widths 1 2 4

Branch 1 is lookup_decode's draft (SuffixIndex, default rules). Branches 2..w copy from other earlier
occurrences of the last token whose first draft token differs from every branch so far, ordered by
match length (longest first), then by how often that first token follows the match, then recency.
The "verifier" keeps the longest prefix of any branch that equals the true continuation, plus one
token (what tree verification with one target token per node keeps, greedy). Reports tokens per step
and tree nodes (draft tokens) per step: the forward size a tree costs. No model, no timing; the tree
verification itself is `lookup_decode/tree.py` (opt-in TreeProposer), whose `branches` builds these trees.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.replay import CAPS, RESULTS, SETS, load_pairs
from lookup_decode.bench import load_tokenizer
from lookup_decode.config import LookupConfig
from lookup_decode.index import SuffixIndex
from lookup_decode.tree import branches


def replay_tree(pairs, cap: int, width: int, eos) -> dict:
    steps = kept_total = nodes = emitted = 0
    for prompt, output in pairs:
        index = SuffixIndex(prompt, min_match=LookupConfig.min_match, max_match=LookupConfig.max_match,
                            eos_token_ids=eos)
        pos, n = 0, len(output)
        while pos < n:
            best = 0
            k = min(cap, n - pos - 1)
            tree = branches(index, index.propose(k), k, width)
            for b in tree:
                same = b == output[pos: pos + len(b)]
                best = max(best, len(b) if same.all() else int(np.argmin(same)))
            nodes += sum(len(b) for b in tree)
            index.extend(output[pos: pos + best + 1])
            pos += best + 1
            steps += 1
            kept_total += best
        emitted += n
    return {"steps": steps, "emitted": emitted, "mean_accepted_length": 1 + kept_total / max(steps, 1),
            "nodes_per_step": nodes / max(steps, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=None, help="at most this many pairs per set")
    ap.add_argument("--caps", type=int, nargs="+", default=CAPS)
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--out", default=str(RESULTS / "replay"))
    args = ap.parse_args(argv)
    tokenizer = load_tokenizer()
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    pairs = load_pairs(SETS, tokenizer, args.limit)
    rows = [{"set": s, "cap": cap, "width": w, **replay_tree(ps, cap, w, eos)}
            for cap in args.caps for w in args.widths for s, ps in pairs.items()]
    lines = ["# Trees of candidates: replay potential", "",
             f"Command: `python -m benchmarks.replay_tree{' --limit ' + str(args.limit) if args.limit else ''}`  ",
             f"Pairs per set: { {s: len(p) for s, p in pairs.items()} }. Cells: tokens per step "
             "(bonus included) / draft tokens in the tree per step. Width 1 = lookup_decode's chain.", ""]
    get = {(r["set"], r["cap"], r["width"]): r for r in rows}
    for cap in args.caps:
        lines += [f"## cap {cap}", "", "| set | " + " | ".join(f"width {w}" for w in args.widths) + " |",
                  "|---|" + "---|" * len(args.widths)]
        for s in pairs:
            lines.append(f"| {s} | " + " | ".join(
                f"{get[(s, cap, w)]['mean_accepted_length']:.2f} / {get[(s, cap, w)]['nodes_per_step']:.1f}"
                for w in args.widths) + " |")
        lines.append("")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tree_potential.json").write_text(json.dumps({"pairs": {s: len(p) for s, p in pairs.items()},
                                                         "results": rows}, indent=1))
    (out / "tree_potential.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
