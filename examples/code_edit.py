"""Code-editing assistant: rewrite a whole source file, streamed as it is generated.

    python examples/code_edit.py                                  # examples/data/inventory.py, add hints
    python examples/code_edit.py my_module.py --instruction "Rename `load_csv` to `read_inventory`" --out new.py

An edit request re-emits most of the file unchanged, so most tokens can be drafted from the prompt
and checked several at a time: this is where lookup decoding helps most. The reply is started with
"```python" so the model writes the file right away, and generation stops at the closing "```".
The rewritten file is streamed with transformers' TextStreamer; statistics (steps, drafted and
accepted tokens, timing) go to stderr at the end. Greedy decoding: the output is what plain
`model.generate` would write. The default 135M model shows the speed-up, not good edits: pass
--model with a stronger instruct model for real use.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from transformers import StoppingCriteriaList, TextStreamer

import lookup_decode

DEFAULT_FILE = Path(__file__).parent / "data" / "inventory.py"
DEFAULT_INSTRUCTION = "Add type hints and docstrings to every function and method."
FENCE = "```"


def build_prompt(tokenizer, source: str, filename: str, instruction: str) -> str:
    """Chat prompt asking for the whole rewritten file, with the assistant's reply opened by ```python."""
    user = (f"Here is the file `{filename}`:\n{FENCE}python\n{source.rstrip()}\n{FENCE}\n\n"
            f"{instruction} Reply with the whole updated file.")
    chat = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                         tokenize=False)
    return chat + f"{FENCE}python\n"


def strip_fence(reply: str) -> str:
    """The code of the reply: everything before the closing ``` (all of it if generation stopped early)."""
    return reply.split(FENCE, 1)[0].rstrip() + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("file", nargs="?", default=str(DEFAULT_FILE), help="source file to edit "
                   "(default: examples/data/inventory.py)")
    p.add_argument("--instruction", default=DEFAULT_INSTRUCTION, help=f"the edit (default: {DEFAULT_INSTRUCTION!r})")
    p.add_argument("--out", default=None, help="also write the rewritten file here")
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--model", default=None, help="a .gguf file or local transformers model folder "
                   "(default: SmolLM2-135M-Instruct)")
    p.add_argument("--k", type=int, default=32, help="most draft tokens verified per step")
    args = p.parse_args(argv)
    if not Path(args.file).is_file():
        p.error(f"no such file: {args.file}")
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    return args


def main(argv=None, *, model_and_tokenizer=None) -> dict:
    """Run the example; returns {"reply", "code", "stats"} (model_and_tokenizer skips loading)."""
    args = parse_args(argv)
    source = Path(args.file).read_text(encoding="utf-8")
    model, tokenizer = model_and_tokenizer or lookup_decode.load_model(args.model)

    prompt = build_prompt(tokenizer, source, Path(args.file).name, args.instruction)
    input_ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    stats = lookup_decode.DecodeStats()
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    print(f"{FENCE}python", flush=True)  # the reply's opening fence is part of the prompt
    # Called directly rather than via model.generate(custom_generate=...): transformers 5.x hands
    # neither generate(streamer=...) nor generate(tokenizer=..., stop_strings=...) to a callable
    # custom_generate, so the stop string is a stopping criterion here.
    stop = StoppingCriteriaList([lookup_decode.StopStrings(tokenizer, FENCE)])
    out = lookup_decode.generate(model, input_ids, streamer=streamer, stats=stats, k=args.k, stopping_criteria=stop,
                                 max_new_tokens=args.max_new_tokens, do_sample=False)
    reply = tokenizer.decode(out[0, input_ids.shape[1]:], skip_special_tokens=True)
    code = strip_fence(reply)
    if args.out:
        Path(args.out).write_text(code, encoding="utf-8")
        print(f"--- wrote {args.out}", file=sys.stderr)
    print(f"--- {stats.prompt_tokens} prompt tokens; {stats.summary()}", file=sys.stderr)
    return {"reply": reply, "code": code, "stats": stats}


if __name__ == "__main__":
    main()
