"""Which index serves reference documents: the suffix index (a corpus + cursor) or pyahocorasick? No model.

    python -m benchmarks.bench_reference_index                          # 10k, 100k, 1M tokens
    python -m benchmarks.bench_reference_index --sizes 10000 --steps 500 --out /tmp/refidx   # smoke

The job: documents registered once; per decoding step, append the emitted token to the request and
ask for a draft from the earliest place in the documents where the request's recent tokens occur.
* suffix index: `References` (one SuffixIndex over all documents) and a `Cursor`; the longest match
  of any length, O(1) amortized per token.
* Aho-Corasick (pyahocorasick, C): every n-gram of the documents (n = --ngram) is a key whose
  value is its first end position; each step looks up the request's last n tokens (`Automaton.get`).
  Only one match length; several lengths would multiply keys and memory by their number. Its
  `iter` scan would find matches in a text, but the request grows by one token per step and the
  documents are the big side, so the patterns would have to be the documents' n-grams anyway.
Reports build seconds, bytes per document token and µs per step (median). Timing on a shared
machine is indicative only; the memory numbers are exact.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ahocorasick

from lookup_decode.bench import environment
from lookup_decode.memory import References

RESULTS = Path(__file__).resolve().parent / "results"


def _chars(tokens) -> str:
    return "".join(chr(0x100 + int(t)) for t in tokens)     # one BMP character per token id (< 55k)


def documents(n_tokens: int, seed: int = 0) -> list[np.ndarray]:
    """Documents of 500-5,000 tokens with a Zipf-like id distribution (49k vocabulary)."""
    rng = np.random.default_rng(seed)
    docs, total = [], 0
    while total < n_tokens:
        size = min(int(rng.integers(500, 5000)), n_tokens - total)
        docs.append(np.minimum(rng.zipf(1.3, size), 49151).astype(np.int32))
        total += size
    return docs


def request_stream(docs, steps: int, seed: int = 1) -> np.ndarray:
    """A request that copies spans of the documents with random tokens in between."""
    rng = np.random.default_rng(seed)
    out = []
    while sum(len(x) for x in out) < steps:
        d = docs[int(rng.integers(len(docs)))]
        start = int(rng.integers(0, max(len(d) - 40, 1)))
        out += [d[start:start + int(rng.integers(5, 40))], rng.integers(0, 49152, 3).astype(np.int32)]
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
    t = time.perf_counter()
    auto = ahocorasick.Automaton()
    text = np.concatenate(docs)
    chars = _chars(text)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--ngram", type=int, default=4)
    ap.add_argument("--out", default=str(RESULTS / "reference_index"))
    args = ap.parse_args(argv)
    References().register("warm", tokens=[1, 2, 1, 2])          # compile the kernels before timing
    warm = References()
    warm.register("w", tokens=[1, 2, 3])
    c = warm.cursor()
    c.extend([1, 2])
    c.propose(2)
    rows = []
    for size in args.sizes:
        docs = documents(size)
        stream = request_stream(docs, args.steps)
        for name, fn in (("suffix_index", lambda: bench_suffix(docs, stream)),
                         (f"aho_corasick_{args.ngram}gram", lambda: bench_aho(docs, stream, args.ngram))):
            r = fn()
            rows.append({"tokens": size, "index": name, **r, "bytes_per_token": r["bytes"] / size})
            print(f"{size:>9} {name:<20} build {r['build_s']:.2f} s  {r['bytes'] / size:6.0f} B/token  "
                  f"{r['us_per_step']:.1f} µs/step", file=sys.stderr)
    result = {"environment": environment(), "settings": vars(args), "results": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "reference_index.json").write_text(json.dumps(result, indent=1))
    lines = ["# Reference documents: suffix index vs pyahocorasick", "",
             f"Command: `{result['environment']['command']}`", "",
             "Indicative timings (shared machine); memory is exact. Aho-Corasick matches one n-gram length only.", "",
             "| document tokens | index | build s | bytes/token | µs per step (median) |", "|---:|---|---:|---:|---:|"]
    lines += [f"| {r['tokens']} | {r['index']} | {r['build_s']:.2f} | {r['bytes_per_token']:.0f} | "
              f"{r['us_per_step']:.1f} |" for r in rows]
    (out / "reference_index.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
