"""Summarize every .txt document in a folder with lookup decoding, then print per-document and total statistics.

    python examples/summarize_folder.py                         # examples/data/articles/
    python examples/summarize_folder.py my_docs/ --out-dir summaries/ --max-new-tokens 200

Summaries reuse names, dates and whole phrases of their document, so many tokens can be drafted
from the prompt and verified several at a time. The only change to an ordinary transformers
pipeline is `custom_generate=lookup_decode.generate` in `model.generate`; a `DecodeStats` per
document shows what lookup decoding did, and `DecodeStats.merge` adds them up for the folder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lookup_decode

DEFAULT_FOLDER = Path(__file__).parent / "data" / "articles"
DEFAULT_INSTRUCTION = "Summarize the following article in three sentences."


def summarize(model, tokenizer, text: str, instruction: str, max_new_tokens: int, k: int):
    """Return (summary, DecodeStats) for one document."""
    messages = [{"role": "user", "content": f"{instruction}\n\n{text.strip()}"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    stats = lookup_decode.DecodeStats()
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                         custom_generate=lookup_decode.generate, stats=stats, k=k)
    summary = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    return summary, stats


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", nargs="?", default=str(DEFAULT_FOLDER),
                   help="folder of .txt documents (default: examples/data/articles)")
    p.add_argument("--instruction", default=DEFAULT_INSTRUCTION, help=f"default: {DEFAULT_INSTRUCTION!r}")
    p.add_argument("--out-dir", default=None, help="also write NAME.summary.txt files here")
    p.add_argument("--max-new-tokens", type=int, default=160, help="per document")
    p.add_argument("--model", default=None, help="a .gguf file or local transformers model folder "
                   "(default: SmolLM2-135M-Instruct)")
    p.add_argument("--k", type=int, default=32, help="most draft tokens verified per step")
    args = p.parse_args(argv)
    if not Path(args.folder).is_dir():
        p.error(f"no such folder: {args.folder}")
    if not sorted(Path(args.folder).glob("*.txt")):
        p.error(f"no .txt files in {args.folder}")
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    return args


def main(argv=None, *, model_and_tokenizer=None) -> dict:
    """Run the example; returns {"summaries": {path: text}, "stats": {path: DecodeStats}, "total": DecodeStats}."""
    args = parse_args(argv)
    model, tokenizer = model_and_tokenizer or lookup_decode.load_model(args.model)
    out_dir = Path(args.out_dir) if args.out_dir else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)

    summaries, per_doc, total = {}, {}, lookup_decode.DecodeStats()
    for path in sorted(Path(args.folder).glob("*.txt")):
        summary, stats = summarize(model, tokenizer, path.read_text(encoding="utf-8"), args.instruction,
                                   args.max_new_tokens, args.k)
        summaries[str(path)], per_doc[str(path)] = summary, stats
        total.merge(stats)
        print(f"=== {path.name}\n{summary}\n--- {stats.prompt_tokens} prompt tokens; {stats.summary()}\n", flush=True)
        if out_dir is not None:
            (out_dir / f"{path.stem}.summary.txt").write_text(summary + "\n", encoding="utf-8")

    print(f"=== total over {len(per_doc)} documents: {total.summary()}")
    if out_dir is not None:
        print(f"--- wrote {len(per_doc)} summaries to {out_dir}", file=sys.stderr)
    return {"summaries": summaries, "stats": per_doc, "total": total}


if __name__ == "__main__":
    main()
