"""`lookup-decode chat`: a minimal multi-turn chat on stdin that keeps one session Memory across turns.

The history goes into every prompt as usual; the memory additionally offers every earlier reply
(and, with --memory-file, the replies of earlier runs) as a draft source. Lines starting with "/"
are commands: /exit ends the chat, /reset starts a new conversation (the memory stays).
"""

from __future__ import annotations

import sys
from pathlib import Path

from lookup_decode.cli import exits_on


def chat_loop(model, tokenizer, lines, memory, *, max_new_tokens: int = 256, system: str | None = None,
              streamer_factory=None, out=sys.stdout, err=sys.stderr, **lookup_options) -> list[dict]:
    """Answer each line of `lines` (an iterable of str) in one conversation; returns the messages."""
    import lookup_decode
    from lookup_decode.engines.hf.models import chat_ids
    messages = [{"role": "system", "content": system}] if system else []
    start = len(messages)
    context = getattr(model.config, "max_position_embeddings", None)
    for line in lines:
        text = line.strip()
        if not text:
            continue
        if text == "/exit":
            break
        if text == "/reset":
            del messages[start:]
            continue
        messages.append({"role": "user", "content": text})
        ids = chat_ids(tokenizer, messages)
        # The history grows every turn: drop the oldest turns (never the system message) until the prompt and
        # the reply fit the model's context, instead of ending a long chat in a context-length error.
        while context is not None and ids.shape[1] + max_new_tokens > context and len(messages) - start > 1:
            del messages[start: start + 2]
            ids = chat_ids(tokenizer, messages)
        if context is not None and ids.shape[1] + max_new_tokens > context:
            print(f"--- this message ({ids.shape[1]} tokens) and a {max_new_tokens}-token reply do not fit the "
                  f"model's context of {context} tokens; send a shorter one", file=err)
            messages.pop()
            continue
        stats = lookup_decode.DecodeStats()
        streamer = streamer_factory() if streamer_factory is not None else None
        result = lookup_decode.generate(model, ids, max_new_tokens=max_new_tokens, do_sample=False, memory=memory,
                                        stats=stats, streamer=streamer, **lookup_options)
        reply = tokenizer.decode(result[0, ids.shape[1]:], skip_special_tokens=True)
        if streamer is None:
            print(reply, file=out)
        messages.append({"role": "assistant", "content": reply})
        print(f"--- {stats.summary()}; memory {memory.n_tokens} tokens in {len(memory)} entries", file=err)
    return messages


def cmd_chat(args) -> int:
    from transformers import TextStreamer

    from lookup_decode.engines.hf.models import load_quietly
    from lookup_decode.sources.memory import load_memory
    path = Path(args.memory_file) if args.memory_file else None
    with exits_on(TypeError, ValueError):
        files = [path] if path is not None else []
        memory = load_memory(files, max_tokens=args.memory_tokens, missing_ok=files)
    model, tokenizer = load_quietly(args.model, args.threads, args.dtype)
    interactive = sys.stdin.isatty()

    def read_line() -> str:             # "" at the end of input
        if interactive:
            print("you> ", end="", flush=True)
        return sys.stdin.readline()

    run_chat(model, tokenizer, iter(read_line, ""), memory, path, max_new_tokens=args.max_new_tokens,
             system=args.system, k=args.k,
             streamer_factory=lambda: TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True))
    return 0


def run_chat(model, tokenizer, lines, memory, path: Path | None, **options) -> None:
    """chat_loop, then save the memory to `path` on every way out: /exit, end of input, an error, or
    Ctrl-C (the usual way out of a chat), which ends the chat quietly."""
    try:
        chat_loop(model, tokenizer, lines, memory, **options)
    except KeyboardInterrupt:
        print(file=sys.stderr)
    finally:
        if path is not None:
            memory.save(path)
            print(f"--- memory saved to {path}", file=sys.stderr)


def add_arguments(p) -> None:
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--memory-tokens", type=int, default=200_000, help="session memory bound in tokens")
    p.add_argument("--memory-file", default=None,
                   help="load the memory from this file if it exists; save it at the end")
