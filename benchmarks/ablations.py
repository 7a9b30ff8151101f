"""Drafting rules measured in the offline replay only: the variants of lookup_decode's rules that lost.

* `SubstitutionKey` — a tolerant key (issue 8, item 3): after a miss, when the index's own match is
  shorter than `min_len`, assume the corrected token *replaced* the source token and keep copying
  from the source one past it (match ignoring the just-corrected token). Full replay: fewer tokens per
  step on 5 of 6 sets (clapnq: +0.01 at cap 10, +0.04 at cap 32) and a lower modelled speed-up on every
  set (benchmarks/results/replay/), so the package does not use it.

Same replay protocol as `baselines.py`: `propose(max_tokens) -> int32 [d]`, `extend(tokens)`, `match_len`.
"""

from __future__ import annotations

import numpy as np

from lookup_decode.index import SuffixIndex


class SubstitutionKey:
    """SuffixIndex plus the substitution re-sync: copy from one past the mismatched source token.

    Example: source [5, 6, 7, 8, 9] copied as [5, 6, X]: the index matches nothing ending in X, this
    rule drafts [8, 9] (X took 7's place).
    """

    def __init__(self, tokens, min_len: int = 2, eos_token_ids=(), **index_kw):
        self.index = SuffixIndex(tokens, eos_token_ids=eos_token_ids, **index_kw)
        self.min_len = min_len
        self.eos = np.asarray(list(eos_token_ids), dtype=np.int32)
        self._src = -1        # where the last draft was copied from (-1: no draft)
        self._skip = -1       # source position after a miss: one past the replaced token
        self.match_len = 0

    def extend(self, tokens) -> None:
        tokens = np.asarray(tokens, dtype=np.int32)
        t = self.index.tokens
        self._skip = -1
        if self._src >= 0 and len(tokens):
            src = t[self._src: self._src + len(tokens)]
            same = src == tokens[: len(src)]
            if len(src) < len(tokens) or not same.all():
                j = int(np.argmin(same)) if not same.all() else len(src)
                self._skip = self._src + j + 1
        self.index.extend(tokens)

    def propose(self, max_tokens: int) -> np.ndarray:
        n = len(self.index)
        if self._skip >= 0 and self.index.match_len < self.min_len and self._skip < n and max_tokens > 0:
            draft = self.index.tokens[self._skip: min(self._skip + max_tokens, n)].copy()
            at_eos = np.flatnonzero(np.isin(draft, self.eos))
            if len(at_eos):
                draft = draft[: at_eos[0]]
            self._src = self._skip if len(draft) else -1
            self.match_len = 1
            return draft
        draft = self.index.propose(max_tokens)
        self._src = self.index.match_end + 1 if len(draft) else -1
        self.match_len = self.index.match_len
        return draft
