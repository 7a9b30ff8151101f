"""Host time per decoding step: the wall time of a generate call minus the time inside the model's forwards.

A 1-layer model (so forwards are short and the host part is visible) with a real vocabulary; every
forward is timed by a wrapper and taken out. lookup_decode: host microseconds per step (and per row and
step for batches); plain `generate`: per token (and per row and token), measured the same way.
One row: the forced-replay hook makes the model emit a recorded code-edit output (drafts get
accepted as they would on the large model that wrote it); batches: random-weight outputs.

    python -m benchmarks.e2e.host_overhead --contexts 1024 16384 --batches 16 64 --new 64
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import lookup_decode
from benchmarks.harness.results import RESULTS, write_result
from benchmarks.replay.forced import PAIRS, Forced, build, load_pairs
from lookup_decode.core.stats import DecodeStats


class ForwardTimer:
    """Records when each forward of `model` started and ended. Hooks, not a wrapper of model.forward: forward
    hooks registered before this one (the forced-replay hook that rewrites the logits, standing in for the
    lm_head's work) count as forward time."""

    def __init__(self, model):
        self.spans, self.widths, self._start = [], [], 0.0

        def start(module, args):
            self._start = time.perf_counter()

        def end(module, args, out):
            if out.logits.is_cuda:
                torch.cuda.synchronize()
            self.spans.append((self._start, time.perf_counter()))
            self.widths.append(out.logits.shape[1])        # positions whose logits the step then reads
        self.handles = [model.register_forward_pre_hook(start, prepend=True), model.register_forward_hook(end)]

    @property
    def seconds(self) -> float:
        return sum(end - start for start, end in self.spans)

    @property
    def calls(self) -> int:
        return len(self.spans)

    def step_gaps(self) -> list[float]:
        """Host seconds between one decoding forward's end and the next one's start. The gap after the
        prefill is left out: it holds once-per-call work (lookup_decode indexes the prompt there)."""
        return [self.spans[i + 1][0] - self.spans[i][1] for i in range(1, len(self.spans) - 1)]

    def remove(self):
        for h in self.handles:
            h.remove()


def host_us(model, ids, mask, new: int, method: str, sampling: dict, lookup: dict | None = None) -> dict:
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
                out = lookup_decode.generate(model, ids, stats=stats, **(lookup or {}), **kw)
        total = time.perf_counter() - t
    finally:
        timer.remove()
    B = ids.shape[0]
    # One forward per step (the prefill counts as one in both); the cost calibration ran in a warm-up call.
    # Per step: the host gaps between decoding forwards (plain: per token), i.e. the work every step
    # repeats; once per call: the rest (set-up, indexing the prompt, the result), reported apart.
    gaps = timer.step_gaps()
    host = total - timer.seconds
    per_step = sum(gaps) / len(gaps) if gaps else float("nan")
    widths = timer.widths[1:-1]                # the forwards whose logits each gap reads
    return {"mean_width": sum(widths) / len(widths) if widths else float("nan"), "total_s": total,
            "forward_s": timer.seconds, "host_s": host, "steps": timer.calls - 1, "forwards": timer.calls,
            "new_tokens": int(out.shape[1] - ids.shape[1]),
            "host_per_call_ms": 1e3 * (host - sum(gaps)), "host_us_per_step": 1e6 * per_step,
            "host_us_per_row_step": 1e6 * per_step / B}


def argmax_us_per_position(vocab: int, rows: int = 64, repeats: int = 20) -> float:
    """Microseconds of an argmax over one position's logits (float32 [V]) on this machine. Each extra position a
    step verifies costs this much outside the forward here; on a GPU it is a device kernel, not host work."""
    x = torch.randn(rows, vocab)
    x.argmax(-1)
    t = time.perf_counter()
    for _ in range(repeats):
        x.argmax(-1)
    return 1e6 * (time.perf_counter() - t) / repeats / rows


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
    from lookup_decode.measure import command_line, environment
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="*", default=[1024, 16384])
    ap.add_argument("--batches", type=int, nargs="*", default=[16, 64])
    ap.add_argument("--batch-context", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="interleaved repeats; the least host time is kept")
    ap.add_argument("--samplings", nargs="+", default=["greedy", "t0.7_p0.95"])
    ap.add_argument("--fixed-k", type=int, default=None,
                    help="lookup_decode with adaptive=False and this k: every step as wide as the drafts allow, the "
                         "same widths in every run (the adaptive policy's widths follow timings and differ between "
                         "runs)")
    ap.add_argument("--outputs", nargs="+", default=["code edit", "random"], choices=["code edit", "random"],
                    help="single-row cases: a recorded code edit forced through the logits, the model's own output")
    ap.add_argument("--out", default=str(RESULTS / "host_overhead"))
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    # One layer, the Llama-3 vocabulary: forwards are short, the host part is what is left.
    model = build("llama-3.2-1b/16")
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    samplings = {"greedy": dict(do_sample=False), "t0.7_p0.95": dict(do_sample=True, temperature=0.7, top_p=0.95)}
    samplings = {name: samplings[name] for name in args.samplings}
    # One row: a recorded code edit forced through the logits (drafts copy it, steps are wide) and the
    # random-weight model's own output (few drafts: the step's fixed work); batches: random-weight outputs.
    lookup = None if args.fixed_k is None else dict(adaptive=False, k=args.fixed_k)
    cases = ([(1, c, out) for out in args.outputs for c in args.contexts]
             + [(b, args.batch_context, "random") for b in args.batches])
    argmax_us = argmax_us_per_position(model.config.vocab_size)
    rows = []
    for batch, context, output in cases:
        ids = prompts(context, batch, model.config.vocab_size)
        mask = torch.ones_like(ids)
        forced = Forced(model) if output == "code edit" else None
        if forced is not None:
            pairs = load_pairs(PAIRS, ["code_edit"], 1)["code_edit"]
            forced.set(np.concatenate([ids[0].numpy(), pairs[0][1]]), "cpu")
        try:
            for name, sampling in samplings.items():
                best = {}
                # Untimed warm-up of both, as long as the timed calls (allocations; lookup_decode's cost calibration
                # for this batch size and widths up to the ones the timed calls may verify).
                for method in ("plain", "lookup_decode"):
                    host_us(model, ids, mask, args.new, method, sampling, lookup)
                for _ in range(args.repeats):
                    for method in ("plain", "lookup_decode"):
                        r = host_us(model, ids, mask, args.new, method, sampling, lookup)
                        if method not in best or r["host_us_per_step"] < best[method]["host_us_per_step"]:
                            best[method] = r
                row = {"batch": batch, "context": context, "output": output, "sampling": name, **{
                    f"{m}_{k}": v for m, r in best.items() for k, v in r.items()}}
                row["extra_us_per_row_step"] = (row["lookup_decode_host_us_per_row_step"]
                                                - row["plain_host_us_per_row_step"])
                # What is left once the argmax over the step's extra verified positions is taken out (greedy).
                row["argmax_us_per_position"] = argmax_us
                row["extra_beyond_argmax_us"] = row["extra_us_per_row_step"] - (
                    (row["lookup_decode_mean_width"] - 1) * argmax_us if name == "greedy" else 0.0)
                rows.append(row)
                print(f"batch {batch} context {context} {output} {name}: plain {row['plain_host_us_per_row_step']:.0f} "
                      f"us/row/token, lookup {row['lookup_decode_host_us_per_row_step']:.0f} us/row/step "
                      f"({row['lookup_decode_steps']} steps for {row['lookup_decode_new_tokens']} tokens)", flush=True)
        finally:
            if forced is not None:
                forced.handle.remove()
    lines = [f"$ {command_line()}", "", f"argmax over one position's logits: {argmax_us:.0f} us", "",
             "| batch | context | output | sampling | plain host us/row/token | lookup host us/row/step | "
             "extra us/row/step | positions verified per row-step | extra beyond their argmax | "
             "plain / lookup host ms per call | lookup steps | tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['context']} | {r['output']} | {r['sampling']} | "
                     f"{r['plain_host_us_per_row_step']:.0f} | {r['lookup_decode_host_us_per_row_step']:.0f} | "
                     f"{r['extra_us_per_row_step']:.0f} | "
                     f"{r['lookup_decode_mean_width']:.1f} | {r['extra_beyond_argmax_us']:.0f} | "
                     f"{r['plain_host_per_call_ms']:.1f} / {r['lookup_decode_host_per_call_ms']:.1f} | "
                     f"{r['lookup_decode_steps']} | {r['lookup_decode_new_tokens']} |")
    write_result(args.out, "host_overhead", {"environment": environment(), "rows": rows}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
