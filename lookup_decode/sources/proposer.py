"""Drafting from several sources at once: the current request, session memory, reference documents.

`SourcesProposer` is a `Drafter` (`extend`, `propose -> Draft`) that wraps one drafter per source:
the request's own `SuffixIndex` and a `Cursor` per corpus.

Choice rule, per step: every source proposes, and `core.draft.choose_source` picks one (the rule every engine
uses): among the non-empty drafts the one backed by the longest match wins; ties go to the more recent text: the
request itself, then the memory (the model's own earlier outputs), then the reference documents; a corpus draft
needs CORPUS_MIN_MATCH (4) tokens while the request has a draft of its own, ALONE_MIN_MATCH (2) when it has none.
A request's prediction (a corpus named PREDICTION: the text its output is expected to repeat) leads: its draft goes
first whenever it rests on CORPUS_MIN_MATCH tokens, ahead of any source that merely matches more of the recent
tokens; where it stops matching, the other sources draft as before.
The draft length is then chosen by the same `DraftPolicy` as without memory (from the winning match length and
the measured forward cost), so a source whose drafts get rejected gets short or no verification, as any weak
match does.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

from lookup_decode.core.config import corpus_thresholds
from lookup_decode.core.draft import Draft, choose_source, kept_prefix
from lookup_decode.core.tokens import as_token_array
from lookup_decode.sources.corpus import Corpus, Cursor

REQUEST, MEMORY, REFERENCES, PREDICTION = "request", "memory", "references", "prediction"


class SourcesProposer:
    """The request's index plus cursors over corpora; see the module docstring for the rule.

    Args:
        request: the request's own proposer (a SuffixIndex, fed the prompt and emitted tokens).
        corpora: (name, Corpus) pairs in tie-break order, e.g. [("memory", m), ("references", r)].
        min_match, max_match, eos_token_ids: as for SuffixIndex, applied to every corpus; resync_window: as for
            SuffixIndex, applied to the prediction (a corpus named PREDICTION).
    Attributes:
        drafts_from: Counter of steps whose draft came from each source.
        accepted_from: Counter of draft tokens accepted per source.
    """

    def __init__(self, request, corpora: list[tuple[str, Corpus]], *, min_match: int = 1, max_match: int = 64,
                 eos_token_ids=(), resync_window: int = 64):
        self.names = [REQUEST] + [name for name, _ in corpora]
        self.corpus_min_match, alone = corpus_thresholds(min_match, max_match)
        # The prediction's cursor re-synchronises after an edit, as the request's own index does (resync_window).
        self.sources = [request] + [c.cursor(min_match=alone, max_match=max_match, eos_token_ids=eos_token_ids,
                                             window=resync_window if name == PREDICTION else 0) for name, c in corpora]
        self.drafts_from: Counter = Counter()
        self.accepted_from: Counter = Counter()
        self._last: tuple[int, np.ndarray] | None = None   # (source, tokens) of the last non-empty proposal
        # The request's prediction leads: its draft goes first while it rests on corpus_min_match tokens.
        self.lead = self.names.index(PREDICTION) if PREDICTION in self.names else -1

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
        """The draft of the source `choose_source` picks (the request's empty draft when none drafts)."""
        drafts = [source.propose(max_tokens) for source in self.sources]
        best = choose_source(np.array([len(d) for d in drafts], np.int64),
                             np.array([d.match_len for d in drafts], np.int64), self.corpus_min_match, self.lead)
        if best < 0:
            return drafts[0]
        self.drafts_from[self.names[best]] += 1
        self._last = (best, drafts[best].tokens)
        # The source is one of the acceptance model's cells: 0 the request, 1 + c corpus c (as IndexPool numbers it).
        return dataclasses.replace(drafts[best], source=best) if best else drafts[best]


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
