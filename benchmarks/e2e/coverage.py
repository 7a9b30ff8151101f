"""Benchmark rows for two model-coverage configurations: a static cache, and an encoder-decoder model.

    python -m benchmarks.e2e.coverage static --n-per-workload 4 --max-new-tokens 128
    python -m benchmarks.e2e.coverage encdec --n-per-workload 4 --max-new-tokens 128
    python -m benchmarks.e2e.coverage static --n-per-workload 1 --max-new-tokens 16 --out /tmp/x   # smoke test

static: the default model (SmolLM2-135M-Instruct) with `cache_implementation="static"`, plain generate
vs lookup_decode on the same static cache (plus the dynamic-cache pair for reference), greedy, on the
code_edit and summarization workloads. `--compile` wraps the forward in torch.compile (on a GPU, with
mode="reduce-overhead"; lookup_decode then sends forward sizes from a few buckets only).

encdec: NO real seq2seq weights exist offline here, so this is a randomly initialised BART at the size
of facebook/bart-base (6+6 layers, d_model 768, vocabulary 50,265), source = the summarization
articles (default tokenizer, <= 1,000 tokens). Random weights do not summarize: their outputs loop, so
the end-to-end ratio says how the mechanics perform (encoder source in the index, decoder verify with
cross-attention, self-attention rollback), not what a trained summarizer gains. The transferable
number is the decoder's forward cost over n tokens relative to 1 (cross-attention included), also
written; combine it with `benchmarks.replay.drafts`'s acceptance on real summaries.

Per prompt the variants run interleaved (order rotated per prompt) after one untimed warm-up each.
Writes DIR/<config>.json and DIR/<config>.md (default DIR: benchmarks/results/coverage).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness import workloads
from benchmarks.harness.loop import side_by_side
from benchmarks.harness.metrics import first_mismatch
from benchmarks.harness.model import add_model_arguments, load_tokenizer
from benchmarks.harness.model import load as load_model
from benchmarks.harness.results import RESULTS, write_result
from lookup_decode.core.cost import sync
from lookup_decode.core.stats import DecodeStats
from lookup_decode.measure import command_line, environment, loop_score, timed_generate

STATIC_VARIANTS = {
    "plain_static": dict(cache_implementation="static"),
    "lookup_static": dict(cache_implementation="static", lookup=True),
    "plain": dict(),
    "lookup_decode": dict(lookup=True),
}
ENCDEC_VARIANTS = {"plain": dict(), "lookup_decode": dict(lookup=True)}
BART_BASE = dict(vocab_size=50265, d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                 decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072, max_position_embeddings=1024,
                 pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2)


def timed(model, input_ids, max_new_tokens: int, variant: dict) -> tuple[list[int], float, DecodeStats | None]:
    """(new tokens, seconds, stats) of one greedy generation; new tokens exclude prompt / decoder start."""
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(input_ids))
    kwargs.update({k: v for k, v in variant.items() if k != "lookup"})
    out, seconds, stats = timed_generate(model, input_ids, {} if variant.get("lookup") else None, **kwargs)
    skip = 1 if model.config.is_encoder_decoder else input_ids.shape[1]
    return out[0, skip:].tolist(), seconds, stats


def decoder_cost_ratios(model, source, sizes=(1, 2, 4, 8, 16, 32), repeats: int = 5) -> dict:
    """Median seconds of a decoder forward over n tokens (after a 32-token decoder prefix) over that of 1 token."""
    from transformers import DynamicCache, EncoderDecoderCache
    with torch.inference_mode():
        enc = model.get_encoder()(input_ids=source)
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        prefix = torch.full((1, 32), 2, dtype=torch.long, device=source.device)
        model(decoder_input_ids=prefix, encoder_outputs=enc, cache=cache, use_cache=True)
        out = {}
        for n in sizes:
            times = []
            for _ in range(repeats):
                sync(source.device)
                t = time.perf_counter()
                model(decoder_input_ids=prefix[:, :n], encoder_outputs=enc, cache=cache, use_cache=True)
                sync(source.device)
                times.append(time.perf_counter() - t)
                cache.self_attention_cache.crop(-n)
            out[n] = statistics.median(times)
    return {str(n): out[n] / out[1] for n in sizes}


def prompts(tokenizer, names, n: int, max_tokens: int, encoder_source: bool):
    """Up to n (request, ids [1, T]) per workload whose ids fit max_tokens; summarization sources for encdec."""
    def source(req):                # the article text itself, no chat template
        return tokenizer(req.messages[-1]["content"], return_tensors="pt")["input_ids"]
    return workloads.select(names, tokenizer, n, max_tokens, encode=source if encoder_source else None)[0]


def markdown(result: dict) -> str:
    names = result["variants"]
    lines = [f"# coverage {result['config']}", "", f"`{result['command']}`", "", result["note"], "",
             "| variant | prompts | identical to plain | total tokens/s | median speed-up vs plain "
             "| mean accepted length |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name in names:
        rows = [r["variants"][name] for r in result["prompts"]]
        tps = sum(r["new_tokens"] for r in rows) / sum(r["seconds"] for r in rows)
        base = result["baseline_of"][name]
        ratios = [r["variants"][name]["tokens_per_second"] / r["variants"][base]["tokens_per_second"]
                  for r in result["prompts"]]
        acc = [r["stats"]["mean_accepted_length"] for r in rows if r.get("stats")]
        acc_text = f"{statistics.mean(acc):.2f}" if acc else ""
        lines.append(f"| {name} (vs {base}) | {len(rows)} | {sum(r['identical'] for r in rows)}/{len(rows)} | "
                     f"{tps:.1f} | x{statistics.median(ratios):.2f} | {acc_text} |")
    if "decoder_cost_ratio" in result:
        lines += ["", "Decoder forward cost over n tokens / 1 token: " +
                  ", ".join(f"n={n}: {r:.2f}" for n, r in result["decoder_cost_ratio"].items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", choices=["static", "encdec"])
    parser.add_argument("--n-per-workload", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=2)
    add_model_arguments(parser)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", action="store_true", help="static: torch.compile the forward")
    parser.add_argument("--out", type=Path, default=RESULTS / "coverage")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    if args.config == "static":
        model, tokenizer = load_model(args, args.device)
        variants = STATIC_VARIANTS
        baseline_of = {"plain_static": "plain_static", "lookup_static": "plain_static", "plain": "plain",
                       "lookup_decode": "plain"}
        names = ["code_edit", "summarization"]
        note = "Default model, greedy; lookup_static runs on the same static cache as plain_static."
        if args.compile:
            mode = "reduce-overhead" if args.device == "cuda" else "default"
            model.forward = torch.compile(model.forward, mode=mode)
            note += f" Forward compiled (torch.compile mode={mode})."
    else:
        from transformers import BartConfig, BartForConditionalGeneration
        torch.manual_seed(0)
        model = BartForConditionalGeneration(BartConfig(**BART_BASE)).to(args.device).eval()
        tokenizer = load_tokenizer(args)
        variants, baseline_of, names = ENCDEC_VARIANTS, {"plain": "plain", "lookup_decode": "plain"}, ["summarization"]
        note = ("RANDOMLY INITIALISED BART at bart-base size (no seq2seq weights offline): outputs loop, so this "
                "measures the encoder-decoder mechanics, not a trained summarizer's gain.")

    chosen = prompts(tokenizer, names, args.n_per_workload, args.max_prompt_tokens, args.config == "encdec")
    warm = chosen[0][1].to(args.device)
    for v in variants.values():                          # untimed warm-up per variant
        timed(model, warm, min(8, args.max_new_tokens), v)
    result = {"config": args.config, "command": command_line(), "note": note, "variants": list(variants),
              "baseline_of": baseline_of, "environment": environment(model, args.device, args.threads, args.model),
              "prompts": []}
    if args.config == "encdec":
        result["decoder_cost_ratio"] = decoder_cost_ratios(model, warm)
    for i, (req, ids) in enumerate(chosen):
        ids = ids.to(args.device)
        runs = {name: rs[0] for name, rs in side_by_side(
            list(variants), lambda name: timed(model, ids, args.max_new_tokens, variants[name]), offset=i).items()}
        rec = {"category": req.category, "id": req.id, "prompt_tokens": int(ids.shape[1]), "variants": {}}
        for name, (tokens, seconds, stats) in runs.items():
            base_tokens = runs[baseline_of[name]][0]
            rec["variants"][name] = {
                "new_tokens": len(tokens), "seconds": seconds, "tokens_per_second": len(tokens) / seconds,
                "identical": tokens == base_tokens, "first_mismatch": first_mismatch(tokens, base_tokens),
                "loop_score": loop_score(tokens), "stats": stats.as_dict() if stats else None}
        result["prompts"].append(rec)
        print(f"{i + 1}/{len(chosen)} {req.category} {req.id}: " + ", ".join(
            f"{n} {v['tokens_per_second']:.1f} tok/s{'' if v['identical'] else ' DIFFERENT'}"
            for n, v in rec["variants"].items()), flush=True)
        write_result(args.out, args.config, result)
    write_result(args.out, args.config, result, markdown(result))
    return 0 if all(v["identical"] for r in result["prompts"] for v in r["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
