"""The drafter contract: one `Draft` value that every draft source returns, and the `Drafter` protocol.

A drafter is fed every committed token (`extend`) and asked for a guess of the next ones
(`propose(max_tokens) -> Draft`). The draft carries everything a decoding step needs to choose a
length and to verify it: the tokens, the match length that backs them, the distribution they were
sampled from (draft models) and, for trees, a parent per node (the way ArcticInference's
SuffixDecodingDraft carries chains and trees in one type). The step never asks a drafter anything
else, so any object with these two methods drafts: the suffix index, the multi-source proposer,
the tree proposer, the draft-model proposer, a user's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numba import njit


@dataclass(frozen=True, eq=False)
class Draft:
    """Proposed tokens and what backs them. Immutable; `cut` makes a shorter one.

    Example: Draft(np.array([4, 1, 2], np.int32), match_len=3) is a chain of three tokens copied after
    a 3-token match. A tree of branches [5, 6] and [9]: tokens [5, 6, 9], parents [-1, 0, -1].
    """
    tokens: np.ndarray                  # int32 [n]: a chain, or a tree's nodes (the first branch first)
    match_len: int = 0                  # length of the matched suffix behind the tokens (0: none)
    probs: "object | None" = None       # torch float [n, V]: q each token was sampled from (None: point masses)
    parents: np.ndarray | None = None   # int32 [n]: parent node, -1 = the last committed token (None: a chain)
    branched: bool = False              # the matched context went on differently before (its state has > 1 edge)
    source: int = 0                     # 0 the request's own text, 1 + c corpus c (memory, references)
    grow: object = None                 # () -> the tree this chain heads, built only where `cut` keeps more nodes

    def __post_init__(self):
        tokens = np.asarray(self.tokens)
        if tokens.ndim != 1 or not (tokens.dtype == np.int32 or tokens.size == 0
                                    or np.issubdtype(tokens.dtype, np.integer)):
            raise TypeError(f"Draft.tokens must be a 1-D integer array, got {tokens.dtype} {tokens.shape}")
        if tokens.size and tokens.dtype.itemsize > 4 and (int(tokens.min()) < -2**31 or int(tokens.max()) >= 2**31):
            raise ValueError(f"Draft.tokens hold ids outside int32 (min {int(tokens.min())}, max {int(tokens.max())})")
        # A copy: a drafter may reuse its buffer, and a Draft is immutable.
        object.__setattr__(self, "tokens", np.array(tokens, dtype=np.int32, copy=True))
        if self.parents is not None:
            parents = np.asarray(self.parents, dtype=np.int32)
            if parents.shape != tokens.shape or np.any(parents >= np.arange(len(parents))) or np.any(parents < -1):
                raise ValueError("Draft.parents must give each node an earlier node or -1")
            object.__setattr__(self, "parents", parents)
        if self.probs is not None and tuple(self.probs.shape[:1]) != (len(tokens),):
            raise ValueError(f"Draft.probs must be [n, V] with n = {len(tokens)} tokens, got {tuple(self.probs.shape)}")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def chain(self) -> np.ndarray:
        """The first branch, int32 [c] (the whole draft for a chain): what a chain verification would send."""
        if self.parents is None:
            return self.tokens
        breaks = np.flatnonzero(self.parents != np.arange(-1, len(self.parents) - 1))
        return self.tokens[: breaks[0] if len(breaks) else len(self.tokens)]

    @property
    def depth(self) -> np.ndarray:
        """int64 [n]: each node's depth, 1 for the children of the last committed token (1..n for a chain)."""
        if self.parents is None:
            return np.arange(1, len(self.tokens) + 1)
        depth = np.zeros(len(self.tokens), np.int64)
        for j, p in enumerate(self.parents):
            depth[j] = 1 if p < 0 else depth[p] + 1
        return depth

    def cut(self, n: int, tree_nodes: int | None = 0) -> "Draft":
        """The first n tokens of the chain; with tree_nodes != 0, a tree keeps its nodes of depth <= n,
        at most tree_nodes of them (None: no limit), in order — the chain first, so it is never cut
        shorter. A tree that keeps no node off the chain becomes a chain."""
        if self.grow is not None and n > 0 and tree_nodes != 0 and (tree_nodes is None or tree_nodes > n):
            return self.grow().cut(n, tree_nodes)
        if self.parents is None and n >= len(self.tokens):
            return self                 # nothing to cut (immutable: the same value serves)
        chain = self.chain[:n]
        if self.parents is None or tree_nodes == 0 or n == 0:
            return Draft(chain, self.match_len, None if self.probs is None else self.probs[:n],
                         branched=self.branched, source=self.source)
        keep = np.flatnonzero(self.depth <= n)[:tree_nodes]
        if len(keep) <= len(chain):
            return Draft(chain, self.match_len, branched=self.branched, source=self.source)
        new_index = np.full(len(self.tokens), -1, np.int64)
        new_index[keep] = np.arange(len(keep))
        parents = np.where(self.parents[keep] < 0, -1, new_index[np.maximum(self.parents[keep], 0)])
        return Draft(self.tokens[keep], self.match_len, parents=parents.astype(np.int32), branched=self.branched,
                     source=self.source)


EMPTY = Draft(np.zeros(0, np.int32))


def kept_prefix(draft, emitted) -> int:
    """How many leading tokens of `draft` (int [d]) equal those of `emitted` (int [e]): the drafts a step kept."""
    # Python lists: a draft is at most a few dozen tokens, where numpy's per-call cost is several times the loop's.
    d, e = np.asarray(draft).tolist(), np.asarray(emitted).tolist()
    n = min(len(d), len(e))
    return next((i for i in range(n) if d[i] != e[i]), n)


def checked_rows(drafts: list, drafters: list, max_tokens: list[int], vocab: int | None = None) -> list[Draft]:
    """`drafts` (one per row) if each is a Draft no deeper than its max_tokens with ids in [0, vocab), else a
    TypeError/ValueError naming the drafter (a bad id would otherwise fail deep inside an embedding, on CUDA as
    a device assert that poisons the process). The ids of all rows are range-checked at once."""
    for draft, drafter, limit in zip(drafts, drafters, max_tokens):
        if not isinstance(draft, Draft):
            raise TypeError(f"{type(drafter).__name__}.propose() must return a lookup_decode.Draft, "
                            f"got {type(draft).__name__}")
        if len(draft.chain) > limit or draft.parents is not None and int(draft.depth.max()) > limit:
            raise ValueError(f"{type(drafter).__name__}.propose({limit}) returned a draft deeper than {limit}")
    tokens = np.concatenate([d.tokens for d in drafts]) if len(drafts) > 1 else drafts[0].tokens
    if vocab is not None and len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
        for draft, drafter in zip(drafts, drafters):
            if len(draft) and (int(draft.tokens.min()) < 0 or int(draft.tokens.max()) >= vocab):
                raise ValueError(f"{type(drafter).__name__}.propose() returned token ids outside the vocabulary "
                                 f"[0, {vocab}): min {int(draft.tokens.min())}, max {int(draft.tokens.max())}")
    return drafts


@njit(cache=True, nogil=True)
def choose_source(lengths, matches, corpus_min_match, lead):
    """Which source's draft a step takes (the one rule of `SourcesProposer` and `IndexPool`), -1 when none drafts.

    lengths, matches: int64 [sources], each source's draft length and the match behind it (capped at max_match);
    source 0 is the request, 1 + c corpus c in tie-break order. lead: a source whose draft goes first whenever it
    rests on at least corpus_min_match tokens (a request's prediction; -1: none). Otherwise the longest match among
    the non-empty drafts wins, ties to the earlier source, and while the request has a draft of its own a corpus
    draft needs corpus_min_match (a corpus is large: short matches there are often chance).
    Example: lengths [3, 5], matches [2, 3], corpus_min_match 4, lead -1 -> 0 (the corpus match is too short).
    """
    if lead >= 0 and lengths[lead] > 0 and matches[lead] >= corpus_min_match:
        return lead
    best = -1
    for i in range(lengths.shape[0]):
        if lengths[i] == 0 or i > 0 and best == 0 and matches[i] < corpus_min_match:
            continue
        if best < 0 or matches[i] > matches[best]:
            best = i
    return best


class Drafter(Protocol):
    """What the decoding step calls: `extend` with every committed token, `propose` before each step."""

    def extend(self, tokens) -> None:
        """Append committed token ids (int [m]; list, numpy or torch)."""

    def propose(self, max_tokens: int) -> Draft:
        """A guess of the next tokens, at most max_tokens deep (a chain's length, a tree's depth)."""
