"""Forward-cost curves of published shapes: seconds of one forward over n new tokens after a context.

Dynamic cache (what lookup_decode uses by default) and static cache + torch.compile (one graph per
forward size, as a compiled deployment would run), random weights (a forward's cost does not depend
on them), nothing downloaded. Writes costs.json, costs.md and costs.png.

    python -m benchmarks.micro.gpu_costs --shapes llama-3.2-1b llama-3.1-8b --contexts 1024 8192 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.harness.results import RESULTS, write_result
from benchmarks.micro.cost_grid import median_seconds
from benchmarks.replay.forced import build
from lookup_decode.engines.hf.cache import crop

SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def dynamic_curve(model, context: int, sizes, repeats: int) -> list[float]:
    """Median seconds per size with a DynamicCache holding `context` tokens (each forward cropped again)."""
    from lookup_decode.engines.hf.forward import measure_forward_cost
    device = next(model.parameters()).device
    ids = torch.randint(1, model.config.vocab_size, (1, context), device=device)
    return measure_forward_cost(model, ids, list(sizes), repeats=repeats)


def static_curve(model, context: int, sizes, repeats: int, backend: str, budget_s: float) -> list[float | None]:
    """The same with a StaticCache and a compiled forward (dynamic=False); a size whose turn comes after
    budget_s seconds is skipped (None): each new size is a new graph to compile."""
    from transformers import StaticCache
    device = next(model.parameters()).device
    cache = StaticCache(config=model.config, max_cache_len=context + max(sizes))
    ids = torch.randint(1, model.config.vocab_size, (1, context), device=device)
    torch._dynamo.reset()
    forward = torch.compile(model.forward, backend=backend, dynamic=False)
    start = time.perf_counter()
    out = []
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(context, device=device), use_cache=True)
        for n in sizes:
            if time.perf_counter() - start > budget_s:
                out.append(None)
                continue
            x = ids[:, -n:] if n <= context else ids[:, -1:].expand(1, n)
            pos = torch.arange(context, context + n, device=device)

            def run():
                forward(input_ids=x, past_key_values=cache, cache_position=pos, use_cache=True, logits_to_keep=n)
            run()                                                        # compile this size (untimed)
            crop(cache, n)                                               # a static layer steps its write position back
            out.append(median_seconds(run, lambda: crop(cache, n), device, repeats))
    torch._dynamo.reset()
    return out


def markdown(result: dict) -> str:
    lines = [f"$ {result['command']}", "", f"{result['device_name']}, {result['dtype']}", ""]
    for shape, by in result["curves"].items():
        lines += [f"### {shape}", "", "| cache | context | " + " | ".join(f"n={n}" for n in result["sizes"]) + " |",
                  "|---|---|" + "---|" * len(result["sizes"])]
        for label, secs in by.items():
            kind, ctx = label.split("@")
            base = secs[0]
            cells = [("-" if s is None else f"{s * 1e3:.2f} ms ({s / base:.2f}x)") for s in secs]
            lines.append(f"| {kind} | {ctx} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append("Cells: median ms of one forward over n tokens (ratio to n=1). '-' = skipped by the time budget.")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shapes = list(result["curves"])
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 3.6), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for label, secs in result["curves"][shape].items():
            pts = [(n, s / secs[0]) for n, s in zip(result["sizes"], secs) if s is not None]
            ax.plot(*zip(*pts), marker="o", label=label)
        ax.set(title=shape, xlabel="tokens per forward (n)", ylabel="cost / cost(n=1)")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    from lookup_decode.measure import command_line
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--static", action=argparse.BooleanOptionalAction, default=True,
                    help="also static cache + torch.compile")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (eager: wiring only, for dry runs)")
    ap.add_argument("--static-budget-s", type=float, default=60.0, help="seconds per static curve (compiles included)")
    ap.add_argument("--out", default=str(RESULTS / "gpu_check"))
    args = ap.parse_args(argv)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    result = {"command": command_line(), "device_name": device_name, "dtype": args.dtype, "sizes": args.sizes,
              "torch": torch.__version__, "curves": {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for shape in args.shapes:
        model = build(shape, getattr(torch, args.dtype), args.device)
        by = {}
        for ctx in args.contexts:
            by[f"dynamic@{ctx}"] = dynamic_curve(model, ctx, args.sizes, args.repeats)
            print(shape, ctx, "dynamic", [round(s * 1e3, 2) for s in by[f"dynamic@{ctx}"]], flush=True)
            if args.static:
                by[f"static+compile@{ctx}"] = static_curve(model, ctx, args.sizes, args.repeats, args.backend,
                                                           args.static_budget_s)
                print(shape, ctx, "static", by[f"static+compile@{ctx}"], flush=True)
            result["curves"][shape] = by
            # Written after every curve: a run cut short by a time limit keeps what it finished.
            write_result(out, "costs", result, markdown(result) + "\n", echo=False)
            plot(result, out / "costs.png")
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
