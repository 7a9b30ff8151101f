"""The replay fingerprint: a refactor that prints the same hash drafts exactly as before it.

Every (prompt, output) pair of the six sets with real large-model outputs (SETS; ../shared/data, the default
model's tokenizer) is replayed through `lookup_decode.engines.replay.replay` with lookup_decode's SuffixIndex
(the default LookupConfig) at caps 10 and 32, in two modes: `fixed` (every draft verified, up to the cap) and
`adaptive` (`DraftPolicy` chooses how much to verify, priced with a fixed synthetic cost curve: no timing, the
same numbers on every machine). Every step's draft length and accepted length go into one SHA-256. Prints the
steps and hash of each (cap, mode) and of all.

    python -m benchmarks.replay.fingerprint                  # every pair
    python -m benchmarks.replay.fingerprint --limit 5        # quick: 5 pairs per set

It imports only lookup_decode's library modules and the pairs loader, which it finds in either layout of
benchmarks/ (before issue 26: `benchmarks.common`), so the same file checks an older checkout too: run it by
path with that checkout first on the path (and LOOKUP_DECODE_DATA=/path/to/shared/data when the checkout does
not sit beside ../shared):

    PYTHONPATH=/tmp/before python benchmarks/replay/fingerprint.py
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import numpy as np

from lookup_decode.core.config import LookupConfig
from lookup_decode.core.cost import CostCurve
from lookup_decode.core.index import SuffixIndex
from lookup_decode.core.policy import DraftPolicy
from lookup_decode.engines.hf.models import load_tokenizer
from lookup_decode.engines.replay import replay

try:
    from benchmarks.harness.workloads import eos_of, real_pairs
except ImportError:                 # a checkout from before benchmarks/ was sorted by topic
    from benchmarks.common import eos_of, real_pairs

SETS = ["cnn_dm", "hagrid", "code_edit", "mt_redundant", "editeval", "clapnq"]
CAPS = [10, 32]
# A fixed forward-cost curve (seconds by width): a step costs 10 ms plus a little per verified token.
COST_WIDTHS = [1, 2, 4, 8, 16, 33]
COST_SECONDS = [0.010, 0.0104, 0.0110, 0.0120, 0.0140, 0.0180]


def fingerprint(pairs: dict, caps=CAPS, eos=()) -> list[tuple[str, int, str]]:
    """[(part, steps, sha256 hex)] per (cap, mode), then "all"; pairs: {set: [(prompt int32 [T], output int32 [n])]}."""
    cfg = LookupConfig()
    total, rows = hashlib.sha256(), []
    for cap in caps:
        for mode in ("fixed", "adaptive"):
            part, steps = hashlib.sha256(), 0
            for name in SETS:
                for prompt, output in pairs.get(name, []):
                    index = SuffixIndex(prompt, min_match=cfg.min_match, max_match=cfg.max_match, eos_token_ids=eos)
                    policy = DraftPolicy(cap, CostCurve(COST_WIDTHS, COST_SECONDS, max(caps) + 1)) \
                        if mode == "adaptive" else None
                    stats = replay(index, output, cap, policy)
                    if len(stats.draft_lengths) != stats.steps:
                        raise RuntimeError("DecodeStats dropped per-step lengths (keep_steps): hash incomplete")
                    data = np.asarray([stats.draft_lengths, stats.accepted_lengths], dtype=np.int32).tobytes()
                    part.update(data)
                    total.update(data)
                    steps += stats.steps
            rows.append((f"cap {cap} {mode}", steps, part.hexdigest()))
    rows.append(("all", sum(s for _, s, _ in rows), total.hexdigest()))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=None, help="at most this many pairs per set (default: all)")
    args = ap.parse_args(argv)
    tokenizer = load_tokenizer()
    pairs = real_pairs(tokenizer, SETS, args.limit)
    print("pairs: " + ", ".join(f"{name} {len(ps)}" for name, ps in pairs.items()), flush=True)
    for part, steps, digest in fingerprint(pairs, CAPS, eos_of(tokenizer)):
        print(f"{part:<16} {steps:>9} steps  {digest}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
