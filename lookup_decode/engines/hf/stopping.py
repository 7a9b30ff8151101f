"""Stopping: apply transformers' StoppingCriteria per emitted token, and stop strings via Aho-Corasick.

One verification step can emit many tokens; plain `generate` would have checked its stopping
criteria after each of them. `first_stop` does the same, so lookup decoding stops on exactly the
token where plain decoding stops (EOS, max length, stop strings, any user criterion).

`StopStrings` is a StoppingCriteria for many stop strings at once over the decoded text: one
Aho-Corasick automaton (pyahocorasick) finds every stop string ending inside the newest token in
one pass, however many strings there are. The CLI's --stop uses it; any generate call takes it as
`stopping_criteria=StoppingCriteriaList([StopStrings(tokenizer, strings)])`. transformers' own
`generate(stop_strings=..., tokenizer=...)` keeps working too (its StopStringCriteria is used as is).
"""

from __future__ import annotations

import ahocorasick
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria


def first_stop(stopping_criteria, ids: torch.Tensor, start: int, end: int, scores=None) -> int | None:
    """Index j in [start, end) of the first token after which a criterion says stop, else None.

    ids: long [1, >= end]; the criteria see ids[:, : j + 1], as plain decoding would. None: no criteria.
    """
    if not stopping_criteria:
        return None
    return next((j for j in range(start, end) if bool(stopping_criteria(ids[:, : j + 1], scores).any())), None)


def first_stops(stopping_criteria, ids: torch.Tensor, rows: list[int], starts: list[int],
                emitted: list[torch.Tensor]) -> list[int | None]:
    """`first_stop` of several rows: row rows[i] emitted tokens `emitted[i]` at columns starts[i].. of ids.

    The two criteria generate builds from its config — max length and EOS — are answered for every row
    and token at once (exactly what each would say of ids[row, : j + 1]: a length, or the token at j);
    any other criterion is asked row by row and token by token, up to the first stop found so far."""
    if not stopping_criteria:
        return [None] * len(rows)
    longest = max(s + len(e) for s, e in zip(starts, emitted))
    max_length, eos, other = None, [], []
    for c in stopping_criteria:
        # Past the model's context MaxLengthCriteria also logs plain's warning: then it is asked like any other.
        if type(c) is MaxLengthCriteria and (c.max_position_embeddings is None or longest <= c.max_position_embeddings):
            max_length = c.max_length if max_length is None else min(max_length, c.max_length)
        elif type(c) is EosTokenCriteria:
            eos.append(c.eos_token_id.reshape(-1).cpu())
        else:
            other.append(c)
    hits = torch.isin(torch.cat(emitted).cpu(), torch.cat(eos)).tolist() if eos else None
    found: list[int | None] = []
    at = 0
    for s, e in zip(starts, emitted):
        n, stop = len(e), None
        if max_length is not None and s + n >= max_length:
            stop = max(s, max_length - 1)                   # ids[:, : j + 1] is max_length long at j
        if hits is not None and True in hits[at: at + n]:
            j = s + hits[at: at + n].index(True)
            stop = j if stop is None else min(stop, j)
        at += n
        found.append(stop)
    if other:
        other = StoppingCriteriaList(other)
        for i, (b, s, e) in enumerate(zip(rows, starts, emitted)):
            # Up to and including the token where max length or EOS stops: plain asks every criterion there too
            # (a criterion may count or time tokens).
            j = first_stop(other, ids[b: b + 1], s, s + len(e) if found[i] is None else found[i] + 1)
            found[i] = found[i] if j is None else j
    return found


class StopStrings(StoppingCriteria):
    """Stop when the decoded text has a stop string that ends inside the newest token.

    Like transformers' StopStringCriteria, a string counts only if it overlaps the final token, so a
    stop string already present in the prompt never stops generation.
    """

    def __init__(self, tokenizer, stop_strings):
        strings = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)
        if not strings or any(not isinstance(s, str) or s == "" for s in strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {stop_strings!r}")
        self.tokenizer = tokenizer
        self.automaton = ahocorasick.Automaton()
        for s in strings:
            self.automaton.add_word(s, s)
        self.automaton.make_automaton()
        # A stop string spans at most one token per UTF-8 byte (byte-level BPE may split every character),
        # plus one token before it that may hold the first bytes of a split character.
        self.window = max(len(s.encode("utf-8")) for s in strings) + 2

    def _found(self, row: torch.Tensor) -> bool:
        tail = row[-self.window:].tolist()
        # A character split across tokens decodes as U+FFFD until its last byte arrives: that
        # placeholder is not text yet, so a stop string completed by the last byte counts as new.
        before = len(self.tokenizer.decode(tail[:-1]).rstrip("\ufffd"))
        text = self.tokenizer.decode(tail)
        return any(end + 1 > before for end, _ in self.automaton.iter(text))

    def __call__(self, input_ids: torch.LongTensor, scores=None, **kwargs) -> torch.BoolTensor:
        return torch.tensor([self._found(row) for row in input_ids], dtype=torch.bool, device=input_ids.device)
