"""Host time per decoding step: the wall time of a generate call minus the time inside the model's forwards.

A 1-layer model (so forwards are short and the host part is visible) with a real vocabulary; every
forward is timed by a wrapper and taken out. lookup_decode: host microseconds per step (and per row and
step for batches); plain `generate`: per token (and per row and token), measured the same way.
One row: the forced-replay hook makes the model emit a recorded code-edit output (drafts get
accepted as they would on the large model that wrote it); batches: random-weight outputs.

    python -m benchmarks.host_overhead --contexts 1024 16384 --batches 16 64 --new 64
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import numpy as np
import torch

import lookup_decode
from benchmarks.forced_replay import Forced, build, load_pairs, PAIRS
from lookup_decode.stats import DecodeStats

RESULTS = Path(__file__).resolve().parent / "results" / "host_overhead"


class ForwardTimer:
    """Wraps model.forward (instance attribute) and adds up the seconds spent inside it."""

    def __init__(self, model):
        self.model, self.seconds, self.calls = model, 0.0, 0
        inner = model.forward

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            t = time.perf_counter()
            out = inner(*args, **kwargs)
            if out.logits.is_cuda:
                torch.cuda.synchronize()
            self.seconds += time.perf_counter() - t
            self.calls += 1
            return out
        model.forward = timed

    def remove(self):
        del self.model.forward


def host_us(model, ids, mask, new: int, method: str, sampling: dict) -> dict:
    """Host microseconds per step (lookup) or per token (plain), per row too, for one generate call."""
    timer = ForwardTimer(model)
    stats = DecodeStats()
    kw = dict(max_new_tokens=new, attention_mask=mask, **sampling)
    try:
        t = time.perf_counter()
        with torch.inference_mode():
            if method == "plain":
                out = model.generate(ids, **kw)
            else:
                out = lookup_decode.generate(model, ids, stats=stats, **kw)
        total = time.perf_counter() - t
    finally:
        timer.remove()
    B = ids.shape[0]
    # One forward per step (the prefill counts as one in both); the cost calibration ran in a warm-up call.
    steps = timer.calls
    host = total - timer.seconds
    return {"total_s": total, "forward_s": timer.seconds, "host_s": host, "steps": steps, "forwards": timer.calls,
            "new_tokens": int(out.shape[1] - ids.shape[1]), "host_us_per_step": 1e6 * host / steps,
            "host_us_per_row_step": 1e6 * host / steps / B}


def prompts(context: int, batch: int, vocab: int):
    """long [batch, context]: recorded code-edit prompts tiled to the context length."""
    pairs = load_pairs(PAIRS, ["code_edit"], 20)["code_edit"]
    rows = []
    for b in range(batch):
        p, o = pairs[b % len(pairs)]
        seq = np.concatenate([p, o])
        rows.append(np.resize(seq, context))
    return torch.as_tensor(np.stack(rows).astype(np.int64) % vocab)


def main(argv=None) -> int:
    from lookup_decode.bench import command_line, environment
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 16384])
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--batch-context", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="interleaved repeats; the least host time is kept")
    ap.add_argument("--samplings", nargs="+", default=["greedy", "t0.7_p0.95"])
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    # One layer, the Llama-3 vocabulary: forwards are short, the host part is what is left.
    model = build("llama-3.2-1b/16")
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    samplings = {"greedy": dict(do_sample=False), "t0.7_p0.95": dict(do_sample=True, temperature=0.7, top_p=0.95)}
    samplings = {name: samplings[name] for name in args.samplings}
    cases = [(1, c) for c in args.contexts] + [(b, args.batch_context) for b in args.batches]
    forced = Forced(model)
    rows = []
    try:
        for batch, context in cases:
            ids = prompts(context, batch, model.config.vocab_size)
            mask = torch.ones_like(ids)
            if batch == 1:
                pairs = load_pairs(PAIRS, ["code_edit"], 1)["code_edit"]
                forced.set(np.concatenate([ids[0].numpy(), pairs[0][1]]), "cpu")
            else:
                forced.handle.remove()
            for name, sampling in samplings.items():
                best = {}
                # Untimed warm-up of both (allocations; lookup_decode's cost calibration for this batch size).
                for method in ("plain", "lookup_decode"):
                    host_us(model, ids, mask, 4, method, sampling)
                for _ in range(args.repeats):
                    for method in ("plain", "lookup_decode"):
                        r = host_us(model, ids, mask, args.new, method, sampling)
                        if method not in best or r["host_s"] < best[method]["host_s"]:
                            best[method] = r
                row = {"batch": batch, "context": context, "sampling": name, **{
                    f"{m}_{k}": v for m, r in best.items() for k, v in r.items()}}
                row["extra_us_per_row_step"] = row["lookup_decode_host_us_per_row_step"] - row["plain_host_us_per_row_step"]
                rows.append(row)
                print(f"batch {batch} context {context} {name}: plain {row['plain_host_us_per_row_step']:.0f} us/row/token, "
                      f"lookup {row['lookup_decode_host_us_per_row_step']:.0f} us/row/step "
                      f"({row['lookup_decode_steps']} steps for {row['lookup_decode_new_tokens']} tokens)", flush=True)
            if batch != 1:
                forced = Forced(model)
    finally:
        forced.handle.remove()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "host_overhead.json").write_text(json.dumps({"environment": environment(), "rows": rows}, indent=1))
    lines = [f"$ {command_line()}", "", "| batch | context | sampling | plain host us/row/token | lookup host us/row/step | "
             "extra us/row/step | lookup steps | tokens |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['context']} | {r['sampling']} | {r['plain_host_us_per_row_step']:.0f} | "
                     f"{r['lookup_decode_host_us_per_row_step']:.0f} | {r['extra_us_per_row_step']:.0f} | "
                     f"{r['lookup_decode_steps']} | {r['lookup_decode_new_tokens']} |")
    (out / "host_overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
