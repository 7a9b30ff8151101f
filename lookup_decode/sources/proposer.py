"""Drafting from several sources at once: the current request, session memory, reference documents.

`SourcesProposer` is a `Drafter` (`extend`, `propose -> Draft`) that wraps one drafter per source:
the request's own `SuffixIndex` and a `Cursor` per corpus.

Choice rule, per step: every source proposes; among the non-empty drafts the one backed by the
longest match wins (a longer matched suffix is stronger evidence, the same signal the draft policy
buckets acceptance by); ties go to the more recent text: the request itself, then the memory (the
model's own earlier outputs), then the reference documents. A corpus is large, so short matches
there are often chance: while the request has a draft of its own, a corpus draft must rest on at
least CORPUS_MIN_MATCH (4) tokens; when the request has none, ALONE_MIN_MATCH (2) suffice (chosen by
offline replay: benchmarks/results/memory_replay/). The draft length is then chosen by
the same `DraftPolicy` as without memory (from the winning match length and the measured forward
cost), so a source whose drafts get rejected gets short or no verification, as any weak match does.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

from lookup_decode.core.config import ALONE_MIN_MATCH, CORPUS_MIN_MATCH
from lookup_decode.core.draft import Draft, kept_prefix
from lookup_decode.core.tokens import as_token_array
from lookup_decode.sources.corpus import Corpus, Cursor

REQUEST, MEMORY, REFERENCES, PREDICTION = "request", "memory", "references", "prediction"


class SourcesProposer:
    """The request's index plus cursors over corpora; see the module docstring for the rule.

    Args:
        request: the request's own proposer (a SuffixIndex, fed the prompt and emitted tokens).
        corpora: (name, Corpus) pairs in tie-break order, e.g. [("memory", m), ("references", r)].
        min_match, max_match, eos_token_ids: as for SuffixIndex, applied to every corpus.
    Attributes:
        drafts_from: Counter of steps whose draft came from each source.
        accepted_from: Counter of draft tokens accepted per source.
    """

    def __init__(self, request, corpora: list[tuple[str, Corpus]], *, min_match: int = 1, max_match: int = 64,
                 eos_token_ids=(), corpus_min_match: int = CORPUS_MIN_MATCH, alone_min_match: int = ALONE_MIN_MATCH):
        self.names = [REQUEST] + [name for name, _ in corpora]
        self.corpus_min_match = min(max(min_match, corpus_min_match), max_match)
        alone = min(max(min_match, alone_min_match), self.corpus_min_match)
        self.sources = [request] + [c.cursor(min_match=alone, max_match=max_match, eos_token_ids=eos_token_ids)
                                    for _, c in corpora]
        self.drafts_from: Counter = Counter()
        self.accepted_from: Counter = Counter()
        self._last: tuple[int, np.ndarray] | None = None   # (source, tokens) of the last non-empty proposal

    def extend(self, tokens) -> None:
        if self._last is not None:
            # The tokens that follow a proposal are the ones the model emitted: the kept prefix of the
            # draft is what that source got right (same trick as DraftPolicy.observe).
            src, draft = self._last
            kept = kept_prefix(draft, as_token_array(tokens))
            if kept:
                self.accepted_from[self.names[src]] += kept
                if isinstance(self.sources[src], Cursor):
                    self.sources[src].credit(kept)
            self._last = None
        for source in self.sources:
            source.extend(tokens)

    def propose(self, max_tokens: int) -> Draft:
        """The draft of the source with the longest match (ties: earlier source)."""
        best, best_src = None, -1
        for i, source in enumerate(self.sources):
            draft = source.propose(max_tokens)
            if i == 0:
                request = draft
            if i > 0 and best_src == 0 and draft.match_len < self.corpus_min_match:
                continue                        # short corpus matches only count when the request has nothing
            if len(draft) and (best is None or draft.match_len > best.match_len):
                best, best_src = draft, i
        if best is None:
            return request
        self.drafts_from[self.names[best_src]] += 1
        self._last = (best_src, best.tokens)
        # The source is one of the acceptance model's cells: 0 the request, 1 + c corpus c (as IndexPool numbers it).
        return dataclasses.replace(best, source=best_src) if best_src else best


def check_sources(memory, references) -> list[tuple[str, Corpus]]:
    """(name, corpus) pairs for generate(memory=..., references=...), in tie-break order; TypeError if wrong."""
    from lookup_decode.sources.memory import Memory, References
    out = []
    for name, value, cls in ((MEMORY, memory, Memory), (REFERENCES, references, References)):
        if value is None:
            continue
        if not isinstance(value, cls):
            raise TypeError(f"{name}= takes a lookup_decode.{cls.__name__}, got {type(value).__name__}")
        out.append((name, value))
    return out


def with_sources(request, corpora: list[tuple[str, Corpus]], vocab_size: int, *, min_match: int, max_match: int,
                 eos_token_ids=()) -> SourcesProposer:
    """Wrap the request's index for one request, after checking every corpus against the model's vocabulary."""
    for name, corpus in corpora:
        corpus.check_vocab(vocab_size)
    return SourcesProposer(request, corpora, min_match=min_match, max_match=max_match, eos_token_ids=eos_token_ids)
