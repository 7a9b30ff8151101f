"""Replay check of policy.py's first-draft-token prior: the measured rate scaled by a factor.

    python -m benchmarks.prior_factor --factors 1.0 0.6        # held-out pairs 60-200 of each set

Replays lookup_decode (default settings, adaptive) on real large-model outputs that the priors were
*not* measured on (measure_priors.py uses the first 60 pairs per set), prices every step with this
machine's forward cost (scaling/cost_grid.json) and prints, per factor and set, the median projected
speed-up after the first 8/16/32/64 tokens, the median over whole outputs and their geometric mean.
No model, no timing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import scaling
from benchmarks.cost_grid import CostGrid
from lookup_decode import policy
from lookup_decode.bench import load_tokenizer

SETS = ["code_edit", "cnn_dm", "hagrid", "mt_redundant", "clapnq", "editeval"]
LENGTHS = [8, 16, 32, 64]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--factors", nargs="+", type=float, default=[1.0, 0.6])
    ap.add_argument("--skip", type=int, default=60, help="pairs per set left out (the ones the priors came from)")
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--cost-grid", default=str(scaling.RESULTS / "cost_grid.json"))
    args = ap.parse_args(argv)
    tokenizer = load_tokenizer(None)
    eos = [tokenizer.eos_token_id]
    grid = json.loads(Path(args.cost_grid).read_text())
    cost = CostGrid(grid["contexts"], grid["sizes"], grid["seconds"])
    pairs = {name: ps[args.skip:] for name, ps in
             scaling.replay_pairs(tokenizer, SETS, args.limit, min_tokens=LENGTHS[0]).items()}
    saved = policy._PRIOR_FIRST.copy()
    print("factor  set            n   " + "  ".join(f"L={n:<4}" for n in LENGTHS) + "  whole  geo-mean")
    try:
        for factor in args.factors:
            policy._PRIOR_FIRST[:] = factor * policy._MEASURED_FIRST
            for name, ps in pairs.items():
                rows = [scaling.projected("lookup_decode", p, o, cost, eos, LENGTHS) for p, o in ps]
                at = np.array([[np.nan if x is None else x for x in r["speedup_at"]] for r in rows], dtype=float)
                whole = np.array([r["speedup"] for r in rows])
                cells = "  ".join(f"x{np.nanmedian(at[:, i]):<5.2f}" for i in range(len(LENGTHS)))
                print(f"{factor:<6}  {name:<12} {len(ps):>4}   {cells}  x{np.median(whole):.2f}  "
                      f"x{np.exp(np.log(whole).mean()):.2f}", flush=True)
    finally:
        policy._PRIOR_FIRST[:] = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
