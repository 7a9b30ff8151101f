"""Micro-benchmark of the suffix index: µs per decode step (extend by 1 token + propose 32) vs context length.

    python -m benchmarks.micro.index                 # 1k, 10k, 100k, 1M tokens; also times one model forward
    python -m benchmarks.micro.index --no-model      # index only
    python -m benchmarks.micro.index --references    # reference documents: suffix index vs pyahocorasick
    python -m benchmarks.micro.index --references --contexts 10000 --steps 500 --out /tmp/refidx   # smoke

Two texts over a vocabulary of 49,152 ids (SmolLM2's): uniform random tokens (matches are short,
drafts mostly empty) and a copy-heavy text (spans copied from earlier in the text with a few new
tokens between, like code edits or summaries: long matches, full 32-token drafts). The index is
built over the first n tokens (timed separately, per token), then each measured step appends the
next token and proposes 32. JIT compilation is excluded by a warm-up on a small index. The model
forward (one token after a 1k-token context) is measured in the same process, so the ratio says
how much of a decode step the index costs.

--references: which index serves reference documents, the suffix index (a corpus + cursor) or
pyahocorasick? No model. The job: documents registered once; per decoding step, append the emitted
token to the request and ask for a draft from the earliest place in the documents where the
request's recent tokens occur.
* suffix index: `References` (one SuffixIndex over all documents) and a `Cursor`; the longest match
  of any length, O(1) amortized per token.
* Aho-Corasick (pyahocorasick, C): every n-gram of the documents (n = --ngram) is a key whose
  value is its first end position; each step looks up the request's last n tokens (`Automaton.get`).
  Only one match length; several lengths would multiply keys and memory by their number. Its
  `iter` scan would find matches in a text, but the request grows by one token per step and the
  documents are the big side, so the patterns would have to be the documents' n-grams anyway.
Reports build seconds, bytes per document token and µs per step (median) for documents of --contexts
tokens in all (default 10k, 100k, 1M). Timing on a shared machine is indicative only; the memory
numbers are exact. Writes reference_index.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from benchmarks.harness.results import RESULTS, write_result
from lookup_decode.core.index import SuffixIndex
from lookup_decode.engines.hf.forward import measure_forward_cost
from lookup_decode.measure import environment
from lookup_decode.sources.memory import References

VOCAB = 49152
CONTEXTS = [1_000, 10_000, 100_000, 1_000_000]
REFERENCE_SIZES = [10_000, 100_000, 1_000_000]


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

    from lookup_decode.engines.hf.models import load_model
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
             "", "| text | context | median µs | p99 µs | max µs | extend µs | propose µs | mean draft "
             "| build µs/token | index MiB |" + (" forward / step |" if fwd else ""),
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


# ---------------------------------------------------------------- --references: documents

def documents(n_tokens: int, seed: int = 0) -> list[np.ndarray]:
    """Documents of 500-5,000 tokens with a Zipf-like id distribution (49k vocabulary)."""
    rng = np.random.default_rng(seed)
    docs, total = [], 0
    while total < n_tokens:
        size = min(int(rng.integers(500, 5000)), n_tokens - total)
        docs.append(np.minimum(rng.zipf(1.3, size), VOCAB - 1).astype(np.int32))
        total += size
    return docs


def request_stream(docs, steps: int, seed: int = 1) -> np.ndarray:
    """A request that copies spans of the documents with random tokens in between."""
    rng = np.random.default_rng(seed)
    out = []
    while sum(len(x) for x in out) < steps:
        d = docs[int(rng.integers(len(docs)))]
        start = int(rng.integers(0, max(len(d) - 40, 1)))
        out += [d[start:start + int(rng.integers(5, 40))], rng.integers(0, VOCAB, 3).astype(np.int32)]
    return np.concatenate(out)[:steps]


def bench_suffix(docs, stream) -> dict:
    t = time.perf_counter()
    refs = References()
    for i, d in enumerate(docs):
        refs.register(f"d{i}", tokens=d)
    build = time.perf_counter() - t
    cursor, times = refs.cursor(), []
    for tok in stream:
        t = time.perf_counter()
        cursor.extend([tok])
        cursor.propose(8)
        times.append(time.perf_counter() - t)
    return {"build_s": build, "bytes": refs.nbytes(), "us_per_step": 1e6 * statistics.median(times)}


def bench_aho(docs, stream, n: int) -> dict:
    import ahocorasick
    t = time.perf_counter()
    auto = ahocorasick.Automaton()
    text = np.concatenate(docs)
    chars = "".join(chr(0x100 + int(tok)) for tok in text)     # one BMP character per token id (< 55k)
    for end in range(n - 1, len(chars)):
        key = chars[end - n + 1: end + 1]
        if key not in auto:                       # keep the first occurrence, like the suffix index
            auto.add_word(key, end)
    auto.make_automaton()
    build = time.perf_counter() - t
    times, recent = [], ""
    for tok in stream:
        t = time.perf_counter()
        recent = (recent + chr(0x100 + int(tok)))[-n:]
        end = auto.get(recent, -1) if len(recent) == n else -1
        if end >= 0:
            text[end + 1: end + 9].copy()
        times.append(time.perf_counter() - t)
    return {"build_s": build, "bytes": auto.get_stats()["total_size"] + text.nbytes,
            "us_per_step": 1e6 * statistics.median(times)}


def reference_main(args) -> int:
    """--references: suffix index vs pyahocorasick over documents of each size in args.contexts."""
    warm = References()                           # compile the kernels before timing
    warm.register("w", tokens=[1, 2, 3])
    c = warm.cursor()
    c.extend([1, 2])
    c.propose(2)
    rows = []
    for size in args.contexts or REFERENCE_SIZES:
        docs = documents(size)
        stream = request_stream(docs, args.steps)
        for name, fn in (("suffix_index", lambda: bench_suffix(docs, stream)),
                         (f"aho_corasick_{args.ngram}gram", lambda: bench_aho(docs, stream, args.ngram))):
            r = fn()
            rows.append({"tokens": size, "index": name, **r, "bytes_per_token": r["bytes"] / size})
            print(f"{size:>9} {name:<20} build {r['build_s']:.2f} s  {r['bytes'] / size:6.0f} B/token  "
                  f"{r['us_per_step']:.1f} µs/step", file=sys.stderr)
    result = {"environment": environment(), "settings": vars(args), "results": rows}
    lines = ["# Reference documents: suffix index vs pyahocorasick", "",
             f"Command: `{result['environment']['command']}`", "",
             "Indicative timings (shared machine); memory is exact. Aho-Corasick matches one n-gram length only.", "",
             "| document tokens | index | build s | bytes/token | µs per step (median) |", "|---:|---|---:|---:|---:|"]
    lines += [f"| {r['tokens']} | {r['index']} | {r['build_s']:.2f} | {r['bytes_per_token']:.0f} | "
              f"{r['us_per_step']:.1f} |" for r in rows]
    write_result(args.out or RESULTS / "reference_index", "reference_index", result, "\n".join(lines) + "\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=None,
                    help=f"context lengths (default {CONTEXTS}); with --references, document tokens in all "
                    f"(default {REFERENCE_SIZES})")
    ap.add_argument("--texts", nargs="+", default=list(TEXTS), choices=list(TEXTS))
    ap.add_argument("--steps", type=int, default=5000, help="measured steps per context (default 5000)")
    ap.add_argument("--no-model", action="store_true", help="skip the model-forward comparison")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for the model forward (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--references", action="store_true",
                    help="instead: reference documents, suffix index vs pyahocorasick (no model)")
    ap.add_argument("--ngram", type=int, default=4, help="--references: Aho-Corasick key length (default 4)")
    ap.add_argument("--out", default=None, help="output folder (default: results/index, index.json and index.md; "
                    "with --references results/reference_index)")
    args = ap.parse_args(argv)
    if args.references:
        return reference_main(args)

    warm_up()
    rows = []
    for text in args.texts:
        for n in args.contexts or CONTEXTS:
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
    write_result(args.out or RESULTS / "index", "index", result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
