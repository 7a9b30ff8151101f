"""The worst `IndexPool.step` call while requests grow past their room: is there a stall when a room doubles?

    python -m benchmarks.replay.pool_growth                       # 4 rows from 40k to 70k tokens, 9 tokens a step
    python -m benchmarks.replay.pool_growth --rows 4 --start 40000 --end 140000

Every row starts with the same context (a 1,000-token block repeated with 5% substitutions, as
`benchmarks.vllm.bench cost`), then each step appends `--per-step` tokens to every row and steps the pool once
(draft length 8); every call is timed. Prints and writes benchmarks/results/replay/pool_growth.{json,md}: mean,
median, worst call, the calls over 5 ms, and the pool's own count of bytes copied by its worst call (the bound
tests/test_pool.py checks), with Python's garbage collector off while timing. Times come from a shared, busy
machine: read the worst against the mean of the same run.
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np

from benchmarks.harness.results import RESULTS, write_result
from lookup_decode.core.pool import IndexPool


def run(rows: int, start: int, end: int, per_step: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    block = rng.integers(0, 32000, size=1000)
    matrix = np.resize(block, (rows, end + per_step)).astype(np.int32)
    noise = rng.random(matrix.shape) < 0.05
    matrix[noise] = rng.integers(0, 32000, size=int(noise.sum()))
    pool = IndexPool(8)
    slots = np.array([pool.add(start) for _ in range(rows)], np.int64)
    r = np.arange(rows, dtype=np.int64)
    limits, learn = np.full(rows, 8, np.int64), np.ones(rows, np.bool_)
    pool.step(matrix, r, slots, np.zeros(rows, np.int64), np.full(rows, start, np.int64), limits, ~learn)
    times, copied = [], []
    n = start
    gc.collect()
    gc.disable()            # a full collection of the process's objects (numba's) is no work of the pool's
    while n + per_step <= end:
        before = getattr(pool, "copied", 0)
        t = time.perf_counter()
        pool.step(matrix, r, slots, np.full(rows, n, np.int64), np.full(rows, n + per_step, np.int64), limits, learn)
        times.append(time.perf_counter() - t)
        copied.append(getattr(pool, "copied", 0) - before)
        n += per_step
    gc.enable()
    ms = 1e3 * np.array(times)
    worst = int(np.argmax(ms))
    return {"rows": rows, "start": start, "end": end, "per_step": per_step, "calls": len(ms),
            "mean_ms": float(ms.mean()), "median_ms": float(np.median(ms)), "worst_ms": float(ms.max()),
            "worst_call": worst, "worst_context": start + per_step * (worst + 1),
            "calls_over_5ms": int((ms > 5).sum()), "max_bytes_copied_per_call": int(max(copied)),
            "bytes_copied_total": int(sum(copied)), "room": [int(c) for c in pool.cap[slots]]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--start", type=int, default=40_000)
    ap.add_argument("--end", type=int, default=70_000)
    ap.add_argument("--per-step", type=int, default=9)
    ap.add_argument("--name", default="pool_growth")
    args = ap.parse_args(argv)
    run(args.rows, 2000, 2100, args.per_step)          # compile first
    row = run(args.rows, args.start, args.end, args.per_step)
    md = ("# IndexPool.step while rows grow past their room\n\n"
          f"Command: `python -m benchmarks.replay.pool_growth --rows {args.rows} --start {args.start} "
          f"--end {args.end} --per-step {args.per_step}`  \nShared, busy 2-core machine: compare the worst call "
          "with the mean of the same run.\n\n"
          "| rows | context | calls | mean ms | median ms | worst ms (at context) | calls > 5 ms | "
          "most bytes copied in one call |\n|---:|---|---:|---:|---:|---:|---:|---:|\n"
          f"| {row['rows']} | {row['start']}-{row['end']} | {row['calls']} | {row['mean_ms']:.3f} | "
          f"{row['median_ms']:.3f} | {row['worst_ms']:.2f} ({row['worst_context']}) | {row['calls_over_5ms']} | "
          f"{row['max_bytes_copied_per_call']:,} |\n")
    write_result(RESULTS / "replay", args.name, row, md)


if __name__ == "__main__":
    main()
