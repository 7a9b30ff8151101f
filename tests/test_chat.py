"""`lookup-decode chat`: the memory file is saved on every way out; the history is trimmed to the context.

Both tests were written before their fixes and failed then (issue 16).
"""

import torch
from conftest import VOCAB
from test_failure_paths import short_gpt2

from lookup_decode.cli.chat import chat_loop, run_chat
from lookup_decode.sources.memory import Memory


class WordTokenizer:
    """Each character is one token (id 3 + ord % 90); a chat template of role markers."""

    def encode(self, text):
        return [3 + ord(c) % (VOCAB - 6) for c in text]

    def apply_chat_template(self, messages, add_generation_prompt=True, return_tensors="pt", return_dict=True):
        ids = []
        for m in messages:
            ids += [1] + self.encode(m["content"])
        return {"input_ids": torch.tensor([ids + [2 * 0 + 1]], dtype=torch.long)}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + int(i) % 26) for i in ids)


def test_memory_is_saved_when_the_chat_is_interrupted(tmp_path, capsys):
    path = tmp_path / "memory.npz"
    model = short_gpt2(1024)

    def lines():
        yield "hello there"
        raise KeyboardInterrupt                 # Ctrl-C, the usual way out
    run_chat(model, WordTokenizer(), lines(), Memory(10_000), path, max_new_tokens=6)
    assert path.exists() and len(Memory.load(path)) == 1


def test_history_is_trimmed_to_the_context():
    """A 64-position model: after a few turns the whole history no longer fits, the oldest turns go."""
    model = short_gpt2(64)
    tokenizer = WordTokenizer()
    turns = ["the first question", "a second one here", "third question now", "and a fourth"]
    messages = chat_loop(model, tokenizer, turns, Memory(10_000), max_new_tokens=8, system="sys",
                         out=open("/dev/null", "w"), err=open("/dev/null", "w"))
    assert messages[0] == {"role": "system", "content": "sys"}
    assert messages[-2]["content"] == "and a fourth"
