"""Existing transformers code, plus one argument: `custom_generate=lookup_decode.generate`.

    python examples/existing_code.py
    python examples/existing_code.py --prompt "Rewrite this list as JSON: ..." --max-new-tokens 300

Runs the same greedy `model.generate` call twice, as written and with the extra argument, checks
that both return the same tokens, and prints both wall-clock times as measured on this machine
(they depend on the model, the hardware and how much of the output repeats the prompt). Exits
with status 1 if the outputs differ.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import lookup_decode

DEFAULT_PROMPT = """Fix the spelling mistakes in this paragraph and write out the whole corrected paragraph.

The comittee met on Tuesday to discus the new library budjet. Members agreed that the reading room
needs new lights, that the childrens section should open on Sunday afternons, and that the old
catalogue computers should be replaced before the end of the year. The treasurer said the town
grant will cover most of the cost, and that a book sale in the spring could pay for the rest."""


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message (default: a spelling-fix request)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--model", default=None, help="a .gguf file or local transformers model folder "
                   "(default: SmolLM2-135M-Instruct)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the untimed warm-up call of each variant (first calls pay one-time costs)")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    return args


def main(argv=None, *, model_and_tokenizer=None) -> dict:
    """Run the example; returns texts, "identical", the two timings in seconds and the DecodeStats."""
    args = parse_args(argv)
    model, tokenizer = model_and_tokenizer or lookup_decode.load_model(args.model)

    # Existing code: a chat prompt and a greedy model.generate call.
    messages = [{"role": "user", "content": args.prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)

    def plain(max_new_tokens=args.max_new_tokens):
        return model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)

    # The same call with one argument added. (stats= is optional: it only records what lookup decoding did.)
    stats = lookup_decode.DecodeStats()

    def with_lookup(max_new_tokens=args.max_new_tokens, stats=stats):
        return model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                              custom_generate=lookup_decode.generate, stats=stats)

    if not args.no_warmup:  # first calls pay one-time costs (allocations; lookup_decode's cost calibration)
        plain(8)
        with_lookup(8, lookup_decode.DecodeStats())
    plain_ids, plain_s = timed(plain)
    lookup_ids, lookup_s = timed(with_lookup)

    prompt_len = inputs["input_ids"].shape[1]
    plain_text = tokenizer.decode(plain_ids[0, prompt_len:], skip_special_tokens=True)
    lookup_text = tokenizer.decode(lookup_ids[0, prompt_len:], skip_special_tokens=True)
    identical = torch.equal(plain_ids, lookup_ids)
    n_plain, n_lookup = plain_ids.shape[1] - prompt_len, lookup_ids.shape[1] - prompt_len

    print(lookup_text)
    print(f"\n--- plain model.generate:          {n_plain} tokens in {plain_s:.2f}s ({n_plain / plain_s:.1f} tok/s)")
    print(f"--- with custom_generate=lookup:  {n_lookup} tokens in {lookup_s:.2f}s ({n_lookup / lookup_s:.1f} tok/s)")
    print(f"--- lookup_decode: {stats.summary()}")
    if identical:
        print("--- identical output: yes (same token ids)")
    else:
        a, b = plain_ids[0].tolist(), lookup_ids[0].tolist()
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"--- identical output: NO, first difference at new token {first - prompt_len}\n"
              f"--- plain output:\n{plain_text}", file=sys.stderr)
    return {"plain_text": plain_text, "lookup_text": lookup_text, "identical": identical,
            "plain_s": plain_s, "lookup_s": lookup_s, "stats": stats}


if __name__ == "__main__":
    sys.exit(0 if main()["identical"] else 1)
