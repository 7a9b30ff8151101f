"""Prefix-dependent logits processors in a batch: each row scored alone (row-local views) vs in a full batch.

    python -m benchmarks.e2e.processors --rows 16 --positions 9 --out benchmarks/results/architecture/processors.json

A verify step of a batch scores every row's verified positions with the prefix that row would have had.
Processors such as repetition penalty hold per-row state (transformers gives it each row's padding length),
so before `Processors.head_row` they ran on a [B, V] copy of the batch with the row in its slot: O(B V) per
row and position. This times one step's worth of those calls both ways on the same inputs (the full-batch
path is what a processor not known to be row-local still takes) and checks that both give the same scores.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

from benchmarks.harness.results import write_result
from lookup_decode.core.verify import Processors
from lookup_decode.measure import environment


def step_seconds(procs: Processors, ids, logits, positions: int, repeats: int) -> tuple[float, list]:
    """Least over repeats of the seconds to score `positions` rows of every batch row; and the scores."""
    best, scores = float("inf"), []
    for _ in range(repeats):
        scores = []
        t = time.perf_counter()
        for b in range(ids.shape[0]):
            for i in range(positions):
                scores.append(procs.head_row(ids, b, ids.shape[1] - positions + i + 1, logits[b, i: i + 1]))
        best = min(best, time.perf_counter() - t)
    return best, scores


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--positions", type=int, default=9, help="verified positions per row (draft + 1)")
    ap.add_argument("--context", type=int, default=800, help="tokens of each row's prefix")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the result JSON to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.rows, args.context), generator=g)
    logits = torch.randn(args.rows, args.positions, args.vocab, generator=g)
    pads = torch.randint(0, 64, (args.rows,), generator=g)
    result = {"environment": environment(threads=args.threads), "settings": vars(args), "cases": {}}
    for name, procs in [("repetition_penalty", [RepetitionPenaltyLogitsProcessor(1.2, prompt_ignore_length=pads)]),
                        ("repetition_penalty+no_repeat_ngram_4", [RepetitionPenaltyLogitsProcessor(
                            1.2, prompt_ignore_length=pads), NoRepeatNGramLogitsProcessor(4)])]:
        row_local = Processors(procs)
        whole_batch = Processors(procs)
        whole_batch.row_local = False           # the path every prefix-dependent processor took before
        alone, a = step_seconds(row_local, ids, logits, args.positions, args.repeats)
        batch, b = step_seconds(whole_batch, ids, logits, args.positions, args.repeats)
        same = all(torch.equal(x, y) for x, y in zip(a, b))
        result["cases"][name] = {"row_local_ms_per_step": 1e3 * alone, "whole_batch_ms_per_step": 1e3 * batch,
                                 "speedup": batch / alone, "identical_scores": same}
        print(f"{name}: one step ({args.rows} rows x {args.positions} positions) row-local {1e3 * alone:.1f} ms, "
              f"whole batch {1e3 * batch:.1f} ms (x{batch / alone:.1f}); identical scores: {same}")
    if args.out:
        write_result(Path(args.out).parent, Path(args.out).stem, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
