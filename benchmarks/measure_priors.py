"""Re-measure DraftPolicy's priors by offline replay: acceptance per match-length bucket.

    python -m benchmarks.measure_priors                 # 60 pairs per set, cap 32 (how policy.py's priors were set)

For every step of the replay of lookup_decode's SuffixIndex (default rules) on the shared real outputs,
the draft is compared with the true continuation: a1 = P(first draft token kept), a2 = P(next kept |
previous kept), per match-length bucket (1, 2-3, 4-7, ..., >= 128), pooled over the sets. Prints them
beside the priors in lookup_decode/policy.py. No model, no timing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.replay import SETS, load_pairs
from lookup_decode import policy as P
from lookup_decode.bench import load_tokenizer
from lookup_decode.config import LookupConfig
from lookup_decode.index import SuffixIndex


def measure(pairs, cap: int, eos, **index_kw) -> np.ndarray:
    """[bucket, (first kept, first tried, later kept, later tried)] summed over every step of every pair."""
    counts = np.zeros((P._N_BUCKETS, 4))
    for prompt, output in pairs:
        index = SuffixIndex(prompt, min_match=LookupConfig.min_match, max_match=LookupConfig.max_match,
                            eos_token_ids=eos, **index_kw)
        pos, n = 0, len(output)
        while pos < n:
            draft = index.propose(min(cap, n - pos - 1))
            b = P._bucket(index.match_len)
            same = draft == output[pos: pos + len(draft)]
            kept = len(draft) if same.all() else int(np.argmin(same))
            if len(draft):
                counts[b] += (kept > 0, 1, max(kept - 1, 0), min(kept, len(draft) - 1))
            index.extend(output[pos: pos + kept + 1])
            pos += kept + 1
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=60, help="pairs per set (default 60)")
    ap.add_argument("--cap", type=int, default=32)
    args = ap.parse_args(argv)
    tokenizer = load_tokenizer()
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    counts = sum(measure(ps, args.cap, eos) for ps in load_pairs(SETS, tokenizer, args.limit).values())
    a1 = counts[:, 0] / np.maximum(counts[:, 1], 1)
    a2 = counts[:, 2] / np.maximum(counts[:, 3], 1)
    print("bucket (match len)   steps   a1 measured (prior)   a2 measured (prior)")
    for b in range(P._N_BUCKETS):
        lo = 1 << b
        label = f">= {lo}" if b == P._N_BUCKETS - 1 else (f"{lo}" if lo == 1 else f"{lo}-{2 * lo - 1}")
        print(f"{label:>18} {int(counts[b, 1]):>7}   {a1[b]:.2f} ({P._MEASURED_FIRST[b]:.2f})"
              f"           {a2[b]:.2f} ({P._PRIOR_LATER[b]:.2f})")
    print("_MEASURED_FIRST = np.array([" + ", ".join(f"{x:.2f}" for x in a1) + "])")
    print("_PRIOR_LATER = np.array([" + ", ".join(f"{x:.2f}" for x in a2) + "])")
    return 0


if __name__ == "__main__":
    sys.exit(main())
