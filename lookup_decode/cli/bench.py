"""`lookup-decode bench`: measure lookup decoding on your own requests and recommend settings.

    lookup-decode bench --prompts my_requests.jsonl --max-new-tokens 256

The command runs each request with plain `model.generate` and with lookup decoding, interleaved
(request by request, order rotated) after an untimed warm-up, and reports the speed-up, the mean
accepted length, whether the outputs are identical and how well the acceptance model predicted what was kept
(its reliability table: per bin of predicted probability, the draft tokens sent, their mean prediction and the
share kept). It then replays a few settings (k, min_match,
adaptive) on the plain outputs it just generated (`engines/replay.py`: greedy lookup decoding emits exactly
those tokens, so the replay knows every step's acceptance), prices each step with this machine's
measured forward cost, and confirms the best setting end to end. The timing and comparison helpers are
`lookup_decode.measure`'s, which the repository's `benchmarks/` use too.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from lookup_decode.cli import check_at_least
from lookup_decode.core.config import LookupConfig
from lookup_decode.core.stats import CALIBRATION_MIN_TOKENS
from lookup_decode.core.tokens import eos_ids
from lookup_decode.engines.batch.records import RecordError, messages_of, read_rows
from lookup_decode.measure import PLAIN, Variant, compare, environment, measure, warm_up

DEFAULT = LookupConfig()
DEFAULT_KEY = (DEFAULT.k, DEFAULT.min_match, DEFAULT.adaptive)
# Widths whose forward cost prices the settings search (interpolated in between).
COST_GRID = (1, 2, 3, 4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 64)

PROG = "lookup-decode bench"


# ----------------------------------------------------------------------------------------- inputs

@dataclass
class BenchRequest:
    id: str                  # "file.jsonl:3" (line number) or the .txt file name
    messages: list[dict]     # chat messages, [{"role": "user", "content": ...}, ...]


def _fail(where: str, what: str):
    raise SystemExit(f"{PROG}: {where}: {what}")


def read_requests(path: str | Path) -> list[BenchRequest]:
    """Requests from a JSONL or Parquet file of records (`engines.batch.records`: one {"messages": [...]} or
    {"prompt": "..."} each) or from a folder of .txt files (each one user message).

    Anything malformed raises SystemExit naming the file and, for JSONL, the line (1-based).
    """
    path = Path(path)
    if not path.exists():
        _fail(str(path), "no such file or folder")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix == ".txt" and p.is_file())
        if not files:
            _fail(str(path), "folder holds no .txt files")
        out = []
        for f in files:
            try:
                with open(f, encoding="utf-8", newline="") as fh:     # newline="": keep \r and \u2028 as they are
                    text = fh.read()
            except (OSError, UnicodeDecodeError) as e:
                _fail(str(f), f"cannot read: {e}")
            if not text.strip():
                _fail(str(f), "empty file")
            out.append(BenchRequest(f.name, [{"role": "user", "content": text}]))
        return out
    out = []
    for lineno, row in read_rows(path):
        try:
            if isinstance(row, RecordError):        # a line that is not JSON
                raise row
            out.append(BenchRequest(f"{path.name}:{lineno}", messages_of(row)))
        except RecordError as e:
            _fail(f"{path}:{lineno}", str(e))
    if not out:
        _fail(str(path), "empty file: no requests")
    return out


# ------------------------------------------------------------------------------------ the command

def add_arguments(parser) -> None:
    """The command's own flags; --model, --dtype, --threads and --max-new-tokens come from commands.py."""
    parser.add_argument("--prompts", required=True, help='JSONL file (one {"messages": [...]} or {"prompt": "..."} '
                        'per line) or a folder of .txt files')
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per request and variant (default 1)")
    parser.add_argument("--no-confirm", action="store_true",
                        help="recommend from the replay only; skip the end-to-end run of the recommended setting")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text summary")
    parser.add_argument("--results", default=None, help="append one JSON line per timed run to this file as it is "
                        "measured (a run that fails half way keeps what it measured)")


def prompt_ids(tokenizer, requests: list[BenchRequest], device) -> list:
    """Each request's prompt ids through the chat template; an error names the request (file:line)."""
    from lookup_decode.engines.hf.models import chat_ids
    out = []
    for r in requests:
        try:
            out.append(chat_ids(tokenizer, r.messages).to(device))
        except Exception as e:      # noqa: BLE001  (any tokenizer/template error, reported with its request)
            _fail(r.id, f"cannot build the prompt: {type(e).__name__}: {e}")
    return out


def run(args) -> int:
    import torch

    from lookup_decode.core.cost import CostCurve
    from lookup_decode.engines.hf.forward import measure_forward_cost
    from lookup_decode.engines.hf.models import load_quietly
    from lookup_decode.engines.replay import SEARCH_K, search_settings

    check_at_least(PROG, args, max_new_tokens=1, threads=1, repeats=1)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"{PROG}: --device {args.device} but CUDA is not available")
    requests = read_requests(args.prompts)
    model, tokenizer = load_quietly(args.model, args.threads, args.dtype, device=args.device, prog=PROG)
    prompts = prompt_ids(tokenizer, requests, args.device)
    ids = [r.id for r in requests]
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr))

    default = Variant("lookup_decode", lookup={"k": DEFAULT.k, "min_match": DEFAULT.min_match, "adaptive": True})
    variants = [PLAIN, default]
    say(f"{PROG}: {len(requests)} requests, up to {args.max_new_tokens} new tokens, "
        f"{torch.get_num_threads()} threads, {args.device}; warming up")
    for v in variants:  # untimed: first-use allocations, JIT and the one-time cost calibration
        warm_up(model, prompts[0], v, args.max_new_tokens)
    done = [0]
    total_runs = len(prompts) * len(variants) * args.repeats

    def progress():
        done[0] += 1
        say(f"  run {done[0]}/{total_runs}")
    measured = measure(model, prompts, variants, args.max_new_tokens, args.repeats, progress, results=args.results,
                       ids=ids)
    summary = compare(measured, default.name)

    # Settings search: replay on the plain outputs, priced with this machine's forward cost.
    sizes = sorted({n for n in COST_GRID if n <= max(SEARCH_K) + 1} | {max(SEARCH_K) + 1})
    median_prompt = sorted(prompts, key=lambda p: p.shape[1])[len(prompts) // 2]
    seconds = measure_forward_cost(model, median_prompt, sizes)
    cost = CostCurve(sizes, seconds, max(SEARCH_K) + 1)
    ranking = search_settings([p[0].tolist() for p in prompts], [m["plain"].tokens for m in measured], cost,
                              eos_ids(model.generation_config))
    best = ranking[0]
    default_row = next(r for r in ranking if (r["k"], r["min_match"], r["adaptive"]) == DEFAULT_KEY)
    result = {"requests": len(requests), "environment": environment(model, args.device, args.threads, args.model),
              "max_new_tokens": args.max_new_tokens, "default": {"setting": default.lookup, **summary},
              "forward_cost": {"sizes": sizes, "seconds": seconds}, "search": ranking[:8],
              "recommended": {"k": best["k"], "min_match": best["min_match"], "adaptive": best["adaptive"]}}
    is_default = (best["k"], best["min_match"], best["adaptive"]) == DEFAULT_KEY
    if not args.no_confirm and not is_default:
        tuned = Variant("tuned", lookup=dict(result["recommended"]))
        say(f"{PROG}: confirming {tuned.describe()} end to end")
        warm_up(model, prompts[0], tuned, args.max_new_tokens)     # cost calibration for this k
        done[0], total_runs = 0, len(prompts) * 2 * args.repeats
        confirmed = measure(model, prompts, [PLAIN, tuned], args.max_new_tokens, args.repeats, progress,
                            results=args.results, ids=ids)
        result["confirmed"] = compare(confirmed, "tuned")

    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_summary(result, best, default_row, is_default)
    return 0


def _fmt_spread(s: dict) -> str:
    return "n/a" if not s["n"] else f"x{s['median']:.2f} median (x{s['min']:.2f}-x{s['max']:.2f})"


def calibration_lines(name: str, summary: dict) -> list[str]:
    """A variant's reliability table (`compare`'s "calibration" rows) as indented text lines."""
    rows = summary.get("calibration") or []
    if not rows:
        return [f"  calibration of {name}: no draft token sent carried a prediction"]
    out = [f"  calibration of {name} (draft tokens sent, by predicted probability of being kept):",
           f"    {'predicted':>9}  {'tokens':>7}  {'mean predicted':>14}  {'share kept':>10}  {'by chance':>9}"]
    out += [f"    {r['bin_low']:.1f}-{r['bin_high']:.1f}  {r['tokens']:>7}  {r['predicted']:>14.2f}  {r['kept']:>10.2f}"
            f"  {'+-' + format(r['chance'], '.2f'):>9}" for r in rows]
    if any(r["tokens"] >= CALIBRATION_MIN_TOKENS for r in rows):
        out.append(f"    largest |mean predicted - share kept| over bins of >= {CALIBRATION_MIN_TOKENS} tokens: "
                   f"{summary['calibration_error']:.2f}")
    else:
        out.append(f"    no bin holds {CALIBRATION_MIN_TOKENS} tokens yet: too few to judge")
    return out


def _print_summary(result: dict, best: dict, default_row: dict, is_default: bool) -> None:
    d = result["default"]
    print(f"{result['requests']} requests, up to {result['max_new_tokens']} new tokens "
          f"({result['environment']['torch_threads']} threads, {result['environment']['device']})")
    print(f"  lookup_decode (k={DEFAULT.k}, min_match={DEFAULT.min_match}, adaptive): speed-up "
          f"{_fmt_spread(d['speedup'])}, x{d['throughput_ratio']:.2f} total throughput; mean accepted length "
          f"{d['mean_accepted_length']:.2f}; identical outputs {d['identical']}/{d['n']}")
    if d["loop_dominated"]:
        print(f"  {d['loop_dominated']} output(s) are dominated by a repetition loop (easy to draft); "
              f"without them: {_fmt_spread(d['speedup_without_loops'])}")
    print("\n".join(calibration_lines("lookup_decode", d)))
    rec = result["recommended"]
    use = f"k={rec['k']}, min_match={rec['min_match']}" + ("" if rec["adaptive"] else ", adaptive=False")
    if is_default:
        print(f"Recommended: keep the defaults (replay estimate x{best['estimated_speedup']:.2f})")
        return
    line = (f"Recommended: {use} (replay of your outputs priced with this machine's forward cost: "
            f"x{best['estimated_speedup']:.2f} vs x{default_row['estimated_speedup']:.2f} for the defaults")
    if "confirmed" in result:
        c = result["confirmed"]
        line += f"; measured end to end: {_fmt_spread(c['speedup'])}, identical {c['identical']}/{c['n']}"
    print(line + ")")
    print(f"  model.generate(..., custom_generate=lookup_decode.generate, {use})")
    if "confirmed" in result:
        print("\n".join(calibration_lines("tuned", result["confirmed"])))
