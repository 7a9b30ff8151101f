"""Forced replay on real forwards: large models' recorded outputs, decoded on random-weight models of their shape.

Every forward runs for real (a model built from a published config, random weights, nothing
downloaded); a forward hook then overwrites its logits with a one-hot on the *recorded* next token of
a real large model's output, at each position's absolute index. Greedy decoding of any kind (plain
`generate`, transformers' prompt lookup, lookup_decode with chains or trees) therefore emits exactly
the recorded output, taking exactly the steps it would take on the model that wrote it, and each step
costs what a forward of that shape costs on this hardware.

What stays honest: all methods decode the same model object through the same hook, so plain decoding
pays the same forward (and the same logits overwrite, which grows with the logits a forward returns,
as the real lm_head does); each output is checked token for token against the record. What is not
real: attention over random weights costs what real attention costs, but the *token ids* are the
SmolLM2 tokenizer's (the shared sets are tokenized with the default model's tokenizer; ids are
remapped densely when a shape's vocabulary is smaller), so only the copy structure of the outputs
carries over, not the real tokenizer's segmentation.

    python -m benchmarks.replay.forced --shapes llama-3.2-1b/8 --sets cnn_dm code_edit --limit 3

With --from-generate RESULTS_JSON --model M: plain's outputs of a `benchmarks.e2e.generate` run, on the run's real
model. In bfloat16 a variant may part from plain's text at a near-tie and time another text; forced, every method
decodes plain's text with real forwards (the prompts rebuilt from the run's settings).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from benchmarks.harness.results import RESULTS, write_result

SETS = ["cnn_dm", "hagrid", "code_edit", "mt_redundant", "editeval", "clapnq"]
PAIRS = RESULTS / "forced_replay" / "pairs.npz"

# Published configs (config.json of each model), written out so nothing is downloaded.
SHAPES = {
    "llama-3.2-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                                   rope_theta=500000.0, tie_word_embeddings=True, max_position_embeddings=131072,
                                   rms_norm_eps=1e-5)),
    "llama-3.1-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                                   rope_theta=500000.0, tie_word_embeddings=False, max_position_embeddings=131072,
                                   rms_norm_eps=1e-5)),
    # Mistral-7B-Instruct-v0.2 (v0.1 had a 4096-token sliding window; the replayed outputs are shorter).
    "mistral-7b": ("mistral", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32000,
                                   rope_theta=1000000.0, sliding_window=None, max_position_embeddings=32768,
                                   tie_word_embeddings=False, rms_norm_eps=1e-5)),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                 rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=False,
                                 use_sliding_window=False, rms_norm_eps=1e-6)),
    # A small model with a 262k vocabulary (google/gemma-3-270m): the logits dominate its step.
    "gemma-3-270m": ("gemma3_text", dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                                         num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                         vocab_size=262144, sliding_window=512, max_position_embeddings=32768,
                                         rope_theta=1000000.0, query_pre_attn_scalar=256, tie_word_embeddings=True,
                                         rms_norm_eps=1e-6)),
    # Seconds-long shapes for tests and dry runs.
    "tiny": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, vocab_size=49152, max_position_embeddings=8192,
                           tie_word_embeddings=True)),
}


def config_of(shape: str):
    """A transformers config for `name` or `name/f` (f: width, depth and heads divided by f; vocabulary kept,
    since the logits are part of what a step costs)."""
    from transformers import AutoConfig
    name, _, factor = shape.partition("/")
    family, kw = SHAPES[name]
    kw = dict(kw)
    f = int(factor or 1)
    if f > 1:
        heads = max(kw["num_attention_heads"] // f, 1)
        kv = max(kw["num_key_value_heads"] // f, 1)
        while heads % kv:
            kv -= 1
        head_dim = kw.get("head_dim") or kw["hidden_size"] // kw["num_attention_heads"]
        kw.update(num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                  hidden_size=heads * head_dim, intermediate_size=kw["intermediate_size"] // f,
                  num_hidden_layers=max(kw["num_hidden_layers"] // f, 1))
    return AutoConfig.for_model(family, **kw)


def build(shape: str, dtype=torch.float32, device: str = "cpu", seed: int = 0):
    """Random-weight model of a published shape, in eval mode."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config_of(shape), dtype=dtype)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model.eval()


class Forced:
    """Forward hook: the logits at absolute position p become a one-hot on target[p + 1] (one sequence).

    Positions come from position_ids (trees), cache_position (transformers' loops) or the cache length
    (lookup_decode's chain forwards), in that order. Past the record the target is token 0.
    """

    def __init__(self, model):
        self.target = torch.zeros(1, dtype=torch.long)
        self.handle = model.register_forward_hook(self, with_kwargs=True)

    def set(self, tokens: np.ndarray, device) -> None:
        self.target = torch.as_tensor(np.asarray(tokens, dtype=np.int64), device=device)

    def __call__(self, module, args, kwargs, output):
        ids = kwargs.get("input_ids", args[0] if args else None)
        T = ids.shape[1]
        if kwargs.get("position_ids") is not None:
            pos = kwargs["position_ids"][0].to(torch.long)
        elif kwargs.get("cache_position") is not None:
            pos = kwargs["cache_position"].to(torch.long)
        else:
            cache = kwargs.get("past_key_values", kwargs.get("cache"))
            end = int(cache.get_seq_length()) if cache is not None else T
            pos = torch.arange(end - T, end, device=ids.device)
        logits = output.logits
        pos = pos[-logits.shape[1]:] + 1
        tgt = torch.where(pos < len(self.target), self.target[pos.clamp_max(len(self.target) - 1)], 0)
        logits.zero_()
        logits[0].scatter_(-1, tgt[:, None], 1.0)
        return output


def remap(pairs: dict, vocab: int) -> dict:
    """Dense ids (first appearance order) when the recorded ids do not fit a shape's vocabulary."""
    top = max(int(max(p.max(), o.max())) for ps in pairs.values() for p, o in ps)
    if top < vocab:
        return pairs
    table: dict[int, int] = {}
    def dense(a):
        return np.array([table.setdefault(int(t), len(table)) for t in a], dtype=np.int32)
    out = {name: [(dense(p), dense(o)) for p, o in ps] for name, ps in pairs.items()}
    if len(table) > vocab:
        raise ValueError(f"{len(table)} distinct tokens do not fit a vocabulary of {vocab}")
    return out


def load_pairs(path: Path, sets, limit: int | None) -> dict:
    """(prompt, output) int32 pairs per set from an npz written by --write-pairs."""
    data = np.load(path)
    pairs = {}
    for name in sets:
        n = int(data[f"{name}/n"])
        n = n if limit is None else min(n, limit)
        pairs[name] = [(data[f"{name}/{i}/prompt"], data[f"{name}/{i}/output"]) for i in range(n)]
    return pairs


def write_pairs(path: Path, sets, limit: int, max_prompt: int) -> None:
    """Tokenize the shared sets once (default model's tokenizer) so GPU machines need no tokenizer."""
    from benchmarks.harness.workloads import real_pairs
    from lookup_decode.engines.hf.models import load_tokenizer
    pairs = real_pairs(load_tokenizer(), sets, None, min_tokens=16)
    arrays = {}
    for name, ps in pairs.items():
        ps = [(p, o) for p, o in ps if len(p) <= max_prompt][:limit]
        arrays[f"{name}/n"] = np.array(len(ps))
        for i, (p, o) in enumerate(ps):
            arrays[f"{name}/{i}/prompt"], arrays[f"{name}/{i}/output"] = p, o
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays)


def generate_pairs(run: dict, model, tokenizer, sets=None, load=None) -> dict:
    """(prompt, plain's output) int32 pairs per category of a benchmarks.e2e.generate run (its results.json) on
    `model`, the prompts chosen as that run chose them (workloads.select with its settings and seed; load: its
    workload loader)."""
    from benchmarks.harness import workloads
    s, plain, pairs = run["settings"], {p["id"]: p["plain_tokens"] for p in run["prompts"]}, {}
    chosen, _ = workloads.select(s["workloads"], tokenizer, s["n_per_workload"], s["max_prompt_tokens"],
                                 context=getattr(model.config, "max_position_embeddings", None),
                                 max_new_tokens=s["max_new_tokens"], seed=s["seed"],
                                 long_prompt_tokens=s["long_prompt_tokens"], load=load or workloads.load)
    for req, ids in chosen:
        if req.id in plain and (not sets or req.category in sets):
            pairs.setdefault(req.category, []).append((ids[0].int().numpy(), np.array(plain[req.id], np.int32)))
    return pairs


METHODS = ("plain", "prompt_lookup", "lookup_decode", "lookup_decode_chain")


def run_one(model, forced: Forced, method: str, prompt: np.ndarray, output: np.ndarray, k: int, tree_width: int):
    """`measure.Run` (seconds, emitted tokens, DecodeStats or None) of one method on one recorded pair."""
    from lookup_decode.measure import PLAIN, PROMPT_LOOKUP, Variant, run_variant
    lookup = {"k": k, "tree_width": tree_width if method == "lookup_decode" else 1}    # trees where free (default)
    variant = {"plain": PLAIN, "prompt_lookup": PROMPT_LOOKUP}.get(method, Variant(method, lookup=lookup))
    device = next(model.parameters()).device
    forced.set(np.concatenate([prompt, output]), device)
    ids = torch.as_tensor(prompt[None].astype(np.int64), device=device)
    return run_variant(model, ids, variant, len(output))


def forced_replay(model, pairs: dict, methods=METHODS, k: int = 32, tree_width: int = 4, progress=None) -> dict:
    """Per set and method: total seconds, tokens, steps; outputs checked against the record.

    Methods run interleaved per pair (noise on a shared machine hits all of them alike); one untimed
    warm-up of every method on the first pair first (allocations, numba, the cost calibration).
    """
    forced = Forced(model)
    try:
        first = next(ps[0] for ps in pairs.values() if ps)
        for m in methods:
            run_one(model, forced, m, first[0], first[1][:32], k, tree_width)
        result = {}
        for name, ps in pairs.items():
            per = {m: {"seconds": 0.0, "tokens": 0, "steps": 0, "identical": 0} for m in methods}
            for prompt, output in ps:
                for m in methods:
                    run = run_one(model, forced, m, prompt, output, k, tree_width)
                    if run.tokens != output.tolist():
                        raise AssertionError(f"{m} on {name}: output differs from the record")
                    r = per[m]
                    r["seconds"] += run.seconds
                    r["tokens"] += len(output)
                    r["identical"] += 1
                    r["steps"] += run.stats.steps if run.stats is not None else 0
                if progress:
                    progress(name, per)
            for m in methods:
                r = per[m]
                r["tokens_per_s"] = r["tokens"] / r["seconds"]
                r["speedup_vs_plain"] = per["plain"]["seconds"] / r["seconds"] if "plain" in per else None
                if "prompt_lookup" in per:
                    r["speedup_vs_prompt_lookup"] = per["prompt_lookup"]["seconds"] / r["seconds"]
                if r["steps"]:
                    r["tokens_per_step"] = r["tokens"] / r["steps"]
            result[name] = {"pairs": len(ps), "methods": per}
        return result
    finally:
        forced.handle.remove()


def markdown(results: dict, header: str) -> str:
    lines = [header, ""]
    for shape, by_set in results.items():
        lines += [f"### {shape}", "",
                  "| set | pairs | tokens | method | tokens/s | x plain | x prompt lookup | tokens/step |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, r in by_set.items():
            for m, v in r["methods"].items():
                lines.append(f"| {name} | {r['pairs']} | {v['tokens']} | {m} | {v['tokens_per_s']:.1f} | "
                             f"{v['speedup_vs_plain']:.2f} | {v.get('speedup_vs_prompt_lookup', float('nan')):.2f} | "
                             f"{v.get('tokens_per_step', float('nan')):.2f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    from lookup_decode.measure import command_line, environment
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["llama-3.2-1b/8"],
                    help=f"shape names ({', '.join(SHAPES)}), optionally /f to divide width and depth by f")
    ap.add_argument("--sets", nargs="+", default=None, help=f"default: {' '.join(SETS)}; --from-generate: all")
    ap.add_argument("--limit", type=int, default=3, help="pairs per set")
    ap.add_argument("--max-new", type=int, default=None, help="cut recorded outputs to this many tokens")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--tree-width", type=int, default=4)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--pairs", default=str(PAIRS), help="npz of tokenized pairs (see --write-pairs)")
    ap.add_argument("--write-pairs", action="store_true", help="tokenize the shared sets into --pairs and exit")
    ap.add_argument("--out", default=str(RESULTS / "forced_replay"))
    ap.add_argument("--from-generate", metavar="RESULTS_JSON", help="plain's outputs of that run, on --model")
    ap.add_argument("--model", help="with --from-generate: the run's model (a name or folder)")
    args = ap.parse_args(argv)
    if args.write_pairs:
        write_pairs(Path(args.pairs), args.sets or SETS, limit=20, max_prompt=4096)
        return 0
    if args.from_generate:
        from benchmarks.harness.model import load
        run = json.loads(Path(args.from_generate).read_text())
        if (ran := "{model} in {dtype}".format(**run["environment"])) != f"{args.model} in {args.dtype}":
            ap.error(f"--from-generate: that run decoded {ran}; pass the same --model and --dtype")  # not another's
        loaded, tok = load(args, args.device)
        args.shapes, pairs = [args.model], generate_pairs(run, loaded, tok, args.sets)
    else:
        pairs = load_pairs(Path(args.pairs), args.sets or SETS, args.limit)
    if args.max_new:
        pairs = {n: [(p, o[: args.max_new]) for p, o in ps] for n, ps in pairs.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(device=args.device)
    tag = "_".join(s.replace("/", "-") for s in args.shapes) + f"_{args.device}"
    results = {}
    for shape in args.shapes:
        model = loaded if args.from_generate else build(shape, getattr(torch, args.dtype), args.device)
        shape_pairs = remap(pairs, model.config.vocab_size)
        results[shape] = forced_replay(model, shape_pairs, args.methods, args.k, args.tree_width,
                                       progress=lambda n, per: print(
                                           n, {m: round(v["seconds"], 2) for m, v in per.items()}, flush=True))
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
        # Written after every shape: a run cut short by a time limit keeps what it finished.
        md = markdown(results, f"$ {command_line()}\n\n{args.device}, {args.dtype}; k={args.k}, "
                               f"tree width {args.tree_width}")
        write_result(out, tag, {"environment": env, "args": vars(args), "results": results}, md + "\n", echo=False)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
