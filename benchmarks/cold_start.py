"""Cold start: what the first lookup_decode call on a model costs, against plain generate's first call.

A fresh model (no curve in memory), a forced-replay code-edit request (drafts are accepted as on the
large model that wrote it), max_new_tokens 64. Variants, each on its own fresh copy of the model:
plain generate; transformers' prompt lookup; lookup_decode with a cold cost model (shape prior + a few
forwards: the default), with the old full grid calibration (`CostModel(full=True)`), and with the
curve already on disk (a second process). Then a session: four requests in a row, total seconds.

    python -m benchmarks.cold_start --shape llama-3.2-1b/8 --new 64
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import lookup_decode
from benchmarks.forced_replay import Forced, build, load_pairs, PAIRS
from lookup_decode.cost import CostModel

RESULTS = Path(__file__).resolve().parent / "results" / "cold_start"


def session(shape: str, variant: str, pairs, new: int, cache_dir: str) -> list[float]:
    """Seconds of each request of a session on a freshly built model (first call first)."""
    model = build(shape)
    forced = Forced(model)
    costs = {"lookup_decode": CostModel(cache_dir), "lookup_decode_full": CostModel(cache_dir, full=True),
             "lookup_decode_disk": CostModel(cache_dir)}.get(variant)
    times = []
    try:
        for prompt, output in pairs:
            forced.set(np.concatenate([prompt, output]), "cpu")
            ids = torch.as_tensor(prompt[None].astype(np.int64))
            kw = dict(max_new_tokens=new, do_sample=False, attention_mask=torch.ones_like(ids))
            t = time.perf_counter()
            with torch.inference_mode():
                if variant == "plain":
                    out = model.generate(ids, **kw)
                elif variant == "prompt_lookup":
                    out = model.generate(ids, prompt_lookup_num_tokens=10, **kw)
                else:
                    out = model.generate(ids, custom_generate=lookup_decode.lookup_decoding(costs=costs), **kw)
            times.append(time.perf_counter() - t)
            assert out[0, len(prompt):].tolist() == output[:new].tolist()
    finally:
        forced.handle.remove()
    return times


def main(argv=None) -> int:
    from lookup_decode.bench import command_line, environment
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="llama-3.2-1b/8")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    pairs = load_pairs(PAIRS, ["code_edit"], args.requests)["code_edit"]
    lookup_decode.SuffixIndex([1, 2, 1, 2], min_match=1).propose(2)     # numba compile outside every timing
    rows = {}
    with tempfile.TemporaryDirectory() as cache_dir:
        for variant in ("plain", "prompt_lookup", "lookup_decode_full", "lookup_decode"):
            rows[variant] = session(args.shape, variant, pairs, args.new, cache_dir if variant == "lookup_decode"
                                    else tempfile.mkdtemp())
            print(variant, [round(t, 2) for t in rows[variant]], flush=True)
        # A second process: same shape, the curve the cold run stored is on disk.
        rows["lookup_decode_disk"] = session(args.shape, "lookup_decode_disk", pairs, args.new, cache_dir)
        print("lookup_decode_disk", [round(t, 2) for t in rows["lookup_decode_disk"]], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cold_start.json").write_text(json.dumps({"environment": environment(), "args": vars(args),
                                                     "seconds": rows}, indent=1))
    plain = rows["plain"]
    lines = [f"$ {command_line()}", "", "| variant | first call s | x plain's first | session of "
             f"{args.requests} s | x plain's session | x prompt lookup's session |", "|---|---|---|---|---|---|"]
    for v, t in rows.items():
        lines.append(f"| {v} | {t[0]:.2f} | {t[0] / plain[0]:.2f} | {sum(t):.2f} | {sum(t) / sum(plain):.2f} | "
                     f"{sum(t) / sum(rows['prompt_lookup']):.2f} |")
    (out / "cold_start.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
