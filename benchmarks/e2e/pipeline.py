"""Records/s of the batch job (`lookup-decode run`): lookup_decode vs plain batched generate, locally and on a
local Ray cluster with 1 and 2 actors (1 torch thread each), side by side in one process.

    python -m benchmarks.e2e.pipeline --n-per-workload 4 --max-new-tokens 64 --out benchmarks/results/pipeline

Input: the first n prompts of the summarization and code-edit workloads (../shared/data), greedy, --model
(`Job.model`; the default model unless told) in --dtype (`Job.dtype`). Every configuration runs the same JSONL
through `lookup_decode.engines.batch.job.run` into a fresh output file; records/s is over the whole run (model load
and actor start included: that is what a user waits for), and `load_s` (one model load in this process) is reported
so it can be set aside; "generate only" divides by the seconds the busiest worker spent inside generate calls (no
model load, no Ray overhead; lookup's one-time cost calibration per process is inside its first call). Ray is
started once before the Ray configurations (its start-up is not in their times). Outputs of every configuration are
compared record by record with the plain local run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.harness.model import add_model_arguments

CONFIGS = {  # name -> (use_ray, actors, plain)
    "local_plain": (False, 1, True),
    "local_lookup": (False, 1, False),
    "ray1_plain": (True, 1, True),
    "ray1_lookup": (True, 1, False),
    "ray2_plain": (True, 2, True),
    "ray2_lookup": (True, 2, False),
}


def write_input(path: Path, workloads: list[str], n: int, max_new_tokens: int) -> int:
    from benchmarks.harness.workloads import load
    rows = []
    for name in workloads:
        for req in load(name)[:n]:
            rows.append({"id": f"{name}/{req.id}", "messages": req.messages, "max_new_tokens": max_new_tokens})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", nargs="+", default=["summarization", "code_edit"])
    p.add_argument("--n-per-workload", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--ray-cpus", type=int, default=2)
    p.add_argument("--note", default="", help="stored with the results (e.g. 'machine shared with 3 other jobs')")
    p.add_argument("--out", default="benchmarks/results/pipeline")
    add_model_arguments(p)
    args = p.parse_args(argv)

    import torch

    from benchmarks.harness.model import load, model_path
    from benchmarks.harness.results import write_result
    from lookup_decode.engines.batch.job import Job, run
    from lookup_decode.measure import environment

    torch.set_num_threads(1)
    t = time.perf_counter()
    model, _ = load(args)
    load_s = time.perf_counter() - t
    path = model_path(args.model)
    env = environment(model, threads=1, model_path=path)
    del model
    work = Path(tempfile.mkdtemp(prefix="bench_pipeline_"))
    n = write_input(work / "in.jsonl", args.workloads, args.n_per_workload, args.max_new_tokens)
    results, texts = {}, {}
    ray_started = False
    for name in args.configs:
        use_ray, actors, plain = CONFIGS[name]
        if use_ray and not ray_started:
            import ray
            ray.init(num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False)
            ray_started = True
        job = Job(model=path and str(path), dtype=args.dtype, max_new_tokens=args.max_new_tokens,
                  batch_size=args.batch_size, threads=1, plain=plain)
        out = work / f"{name}.jsonl"
        t = time.perf_counter()
        summary = run(job, work / "in.jsonl", out, use_ray=use_ray, actors=actors, progress=False)
        wall = time.perf_counter() - t
        records = [json.loads(line) for line in out.read_text().splitlines()]
        texts[name] = {r["id"]: r.get("text") for r in records}
        # Generation alone (no model load, no Ray overhead): the busiest worker's seconds in generate calls.
        per_worker: dict[str, dict[int, float]] = {}
        for r in records:
            if "batch_s" in r:
                per_worker.setdefault(r["worker"], {})[r["batch"]] = r["batch_s"]
        gen_s = max((sum(b.values()) for b in per_worker.values()), default=0.0)
        results[name] = {"records": summary.done, "errors": summary.errors, "wall_s": round(wall, 2),
                         "records_per_s": round(summary.done / wall, 4), "generate_s": round(gen_s, 2),
                         "records_per_generate_s": round(summary.done / gen_s, 4) if gen_s else None,
                         "workers": len(per_worker), "new_tokens": summary.new_tokens,
                         "tokens_per_s": round(summary.new_tokens / wall, 2),
                         "mean_accepted_length": round(summary.mean_accepted_length, 3) if not plain else None}
        print(name, results[name], flush=True)
    base = texts.get("local_plain")
    for name in results:
        if base is not None:
            results[name]["identical_to_local_plain"] = sum(texts[name].get(i) == t for i, t in base.items())
    if ray_started:
        import ray
        ray.shutdown()
    report = {"records_in": n, "load_s": round(load_s, 2), "note": args.note, "results": results,
              "settings": vars(args), "environment": env}
    lines = [f"# Batch job: records/s ({n} records: {', '.join(args.workloads)}; greedy, <= {args.max_new_tokens} "
             f"new tokens, batch {args.batch_size}, 1 torch thread per worker)", "",
             f"Command: `{env['command']}`", "", f"Note: {args.note}" if args.note else "", "",
             "| configuration | records/s (wall) | records/s (generate only) | tokens/s (wall) | wall s | generate s "
             "(busiest worker) | mean acc. len | identical to local_plain |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in results.items():
        acc = "" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        gen = "" if r["records_per_generate_s"] is None else f"{r['records_per_generate_s']:.3f}"
        lines.append(f"| {name} | {r['records_per_s']:.3f} | {gen} | {r['tokens_per_s']:.1f} | {r['wall_s']:.1f} | "
                     f"{r['generate_s']:.1f} | {acc} | {r.get('identical_to_local_plain', '')}/{n} |")
    lines += ["", f"Model load in this process: {load_s:.1f} s (included in every wall time; Ray start-up is not)."]
    write_result(args.out, "results", report, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
