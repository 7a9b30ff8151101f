"""Micro-benchmark of the suffix index: µs per decode step (extend by 1 token + propose 32) vs context length.

    python -m benchmarks.bench_index                 # 1k, 10k, 100k, 1M tokens; also times one model forward
    python -m benchmarks.bench_index --no-model      # index only

Two texts over a vocabulary of 49,152 ids (SmolLM2's): uniform random tokens (matches are short,
drafts mostly empty) and a copy-heavy text (spans copied from earlier in the text with a few new
tokens between, like code edits or summaries: long matches, full 32-token drafts). The index is
built over the first n tokens (timed separately, per token), then each measured step appends the
next token and proposes 32. JIT compilation is excluded by a warm-up on a small index. The model
forward (one token after a 1k-token context) is measured in the same process, so the ratio says
how much of a decode step the index costs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lookup_decode.bench import environment, measure_forward_cost
from lookup_decode.index import SuffixIndex

VOCAB = 49152
CONTEXTS = [1_000, 10_000, 100_000, 1_000_000]
RESULTS = Path(__file__).resolve().parent / "results"


def random_text(n: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, VOCAB, size=n, dtype=np.int32)


def copy_heavy_text(n: int, rng: np.random.Generator) -> np.ndarray:
    """Mostly spans of 20-200 tokens copied from earlier positions, with 1-10 new tokens in between."""
    out = np.empty(n + 200, dtype=np.int32)
    m = min(500, n)
    out[:m] = rng.integers(0, VOCAB, size=m)
    while m < n:
        if rng.random() < 0.9:
            length = int(rng.integers(20, 201))
            src = int(rng.integers(0, m))
            length = min(length, m - src)
            out[m: m + length] = out[src: src + length]
        else:
            length = int(rng.integers(1, 11))
            out[m: m + length] = rng.integers(0, VOCAB, size=length)
        m += length
    return out[:n]


TEXTS = {"random": random_text, "copy_heavy": copy_heavy_text}


def warm_up() -> None:
    """Compile every index kernel (including buffer growth) on a tiny index."""
    index = SuffixIndex(np.arange(8, dtype=np.int32) % 3, min_match=1, eos_token_ids=[0])
    index.extend(np.arange(3000, dtype=np.int32) % 7)
    index.propose(32)


def bench_context(tokens: np.ndarray, n: int, steps: int, k: int = 32) -> dict:
    """Build over tokens[:n], then time `steps` steps of extend(next token) + propose(k)."""
    t = time.perf_counter()
    index = SuffixIndex(tokens[:n], min_match=2, max_match=64)
    build_s = time.perf_counter() - t
    ext = np.empty(steps, dtype=np.int64)
    prop = np.empty(steps, dtype=np.int64)
    drafted = 0
    for i in range(steps):
        one = tokens[n + i: n + i + 1]
        t0 = time.perf_counter_ns()
        index.extend(one)
        t1 = time.perf_counter_ns()
        drafted += len(index.propose(k))
        t2 = time.perf_counter_ns()
        ext[i], prop[i] = t1 - t0, t2 - t1
    step_us = (ext + prop) / 1e3
    return {"context": n, "steps": steps, "build_us_per_token": 1e6 * build_s / n,
            "step_us": {"median": float(np.median(step_us)), "p99": float(np.percentile(step_us, 99)),
                        "mean": float(step_us.mean()), "max": float(step_us.max())},
            "extend_us_median": float(np.median(ext) / 1e3), "propose_us_median": float(np.median(prop) / 1e3),
            "mean_draft_tokens": drafted / steps, "index_mbytes": index.nbytes() / 2**20}


def model_forward_ms(threads: int, context: int = 1024, repeats: int = 20) -> tuple[float, dict]:
    """Median ms of one default-model forward over 1 token after a `context`-token cache (CPU)."""
    import torch

    from lookup_decode.models import load_model
    torch.set_num_threads(threads)
    model, _ = load_model()
    ids = torch.from_numpy(random_text(context, np.random.default_rng(1)).astype(np.int64))[None]
    measure_forward_cost(model, ids, [1], repeats=3)  # warm-up
    seconds = measure_forward_cost(model, ids, [1], repeats=repeats)[0]
    return 1e3 * seconds, environment(model, "cpu", threads)


def markdown(result: dict) -> str:
    fwd = result.get("model_forward_ms")
    lines = ["# Suffix index: µs per decode step (extend 1 token + propose 32)", "",
             f"Command: `{result['environment']['command']}`  ",
             f"CPU: {result['environment']['cpu']}; numba {result['environment']['numba']}"
             + (f"; one model forward (1 token after {result['forward_context']} tokens): {fwd:.1f} ms" if fwd else ""),
             "", "| text | context | median µs | p99 µs | max µs | extend µs | propose µs | mean draft | build µs/token "
             "| index MiB |" + (" forward / step |" if fwd else ""),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if fwd else "")]
    for r in result["results"]:
        s = r["step_us"]
        row = (f"| {r['text']} | {r['context']:,} | {s['median']:.2f} | {s['p99']:.2f} | {s['max']:.0f} "
               f"| {r['extend_us_median']:.2f} | {r['propose_us_median']:.2f} | {r['mean_draft_tokens']:.1f} "
               f"| {r['build_us_per_token']:.2f} | {r['index_mbytes']:.1f} |")
        if fwd:
            row += f" {1e3 * fwd / s['median']:,.0f}x |"
        lines.append(row)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS)
    ap.add_argument("--texts", nargs="+", default=list(TEXTS), choices=list(TEXTS))
    ap.add_argument("--steps", type=int, default=5000, help="measured steps per context (default 5000)")
    ap.add_argument("--no-model", action="store_true", help="skip the model-forward comparison")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for the model forward (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "index"), help="output folder (index.json, index.md)")
    args = ap.parse_args(argv)

    warm_up()
    rows = []
    for text in args.texts:
        for n in args.contexts:
            tokens = TEXTS[text](n + args.steps, np.random.default_rng(args.seed))
            row = {"text": text, **bench_context(tokens, n, args.steps)}
            rows.append(row)
            print(f"{text:>10} {n:>9,}: median {row['step_us']['median']:.2f} µs, p99 {row['step_us']['p99']:.2f} µs, "
                  f"mean draft {row['mean_draft_tokens']:.1f}", file=sys.stderr)
    result = {"results": rows, "k": 32, "vocab": VOCAB}
    if args.no_model:
        result["environment"] = environment(threads=args.threads)
    else:
        result["forward_context"] = 1024
        result["model_forward_ms"], result["environment"] = model_forward_ms(args.threads)
        for r in rows:
            r["forward_over_step"] = 1e3 * result["model_forward_ms"] / r["step_us"]["median"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "index.json").write_text(json.dumps(result, indent=1))
    (out / "index.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
