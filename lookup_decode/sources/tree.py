"""Trees of drafts: several continuations of the current suffix, verified in one forward.

When the current suffix occurred before with different continuations, the index's draft is one guess
among several. `TreeProposer` drafts a tree (a `Draft` with parents) of up to `width` branches whose
first tokens differ; the decoding step verifies it like any draft (`forward.SequenceForward` builds the
tree attention mask, `verify.accept_tree` descends it, `cache.keep_tree_path` keeps the accepted path),
and the emitted tokens are exactly those of chain verification of the branch that was followed.

Status: the default where one row's forward verifies trees (`LookupConfig.tree_width`, 4; a full-attention
dynamic cache). Each branch is cut to the draft length the policy chose for the chain, and the extra branches
only fill the tokens the measured cost curve gives for free (`DraftPolicy.tree_budget`): wide trees where a
forward's cost is flat in its length (GPU, bf16 here), few or none on a steep CPU curve, where the tree is then
never built. The acceptance model prices the chain; the branches are what the curve gives beside it. Measured:
on a 2-core CPU in bf16 (Qwen2.5-Coder-0.5B, whose curve rises past 8 tokens) trees were sent in at most 12 of
~300 steps and the default runs at x1.00 (x0.96-x1.15) of chains, prompt by prompt
(benchmarks/results/generate/code_model_bf16_avx512/README.md); on an H200's flat curve, forced replay of code
edits on a 1B and an 8B shape ran x9.13 and x9.76 plain against chains' x6.86 and x4.84 (one pair each,
benchmarks/results/gpu_check/README.md).
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np

from lookup_decode.core.config import check_int
from lookup_decode.core.draft import Draft
from lookup_decode.core.index import SuffixIndex


def build_tree(branches, match_len: int = 0) -> Draft:
    """A tree draft from branches (int [d_i] each; shared prefixes are merged; empty ones skipped).

    Example: [[5, 6, 7], [5, 8], [9]] -> tokens [5, 6, 7, 8, 9], parents [-1, 0, 1, 0, -1].
    """
    tokens, parents, child = [], [], {}
    for branch in branches:
        node = -1
        for tok in (int(t) for t in branch):
            if (node, tok) not in child:
                child[(node, tok)] = len(tokens)
                tokens.append(tok)
                parents.append(node)
            node = child[(node, tok)]
    return Draft(np.asarray(tokens, np.int32), match_len, parents=np.asarray(parents, np.int32))


def branches(index: SuffixIndex, main: np.ndarray, k: int, width: int) -> list[np.ndarray]:
    """Up to `width` drafts (int32 [<= k] each) with pairwise different first tokens; [0] is `main`.

    Branches 2..width copy from other earlier occurrences of the last token whose next token differs
    from every branch so far, ordered by match length (longest first), then by how often that next
    token follows the match, then recency. Scans the context (numpy, O(context) per step).
    """
    out = [main] if len(main) else []
    t, L = index.tokens, len(index)
    if width <= 1 or k <= 0 or L < 2:
        return out
    ends = np.flatnonzero(t[: L - 1] == t[L - 1])
    ends = ends[ends + 1 < L]
    if len(ends) == 0:
        return out
    lens = np.ones(len(ends), dtype=np.int64)                # match length of each occurrence
    alive = np.ones(len(ends), dtype=bool)
    for m in range(1, index.max_match):
        alive &= ends - m >= 0
        alive[alive] = t[ends[alive] - m] == t[L - 1 - m]
        lens += alive
        if not alive.any():
            break
    firsts = t[ends + 1]
    freq = Counter(firsts.tolist())
    used = set(index.eos.tolist()) | ({int(main[0])} if len(main) else set())     # no branch starts with these
    for j in sorted(range(len(ends)), key=lambda j: (-lens[j], -freq[int(firsts[j])], -ends[j])):
        if len(out) >= width:
            break
        first = int(firsts[j])
        if first in used:
            continue
        used.add(first)
        out.append(index.continuation(ends[j], k, index.eos))
    return out


class TreeProposer(SuffixIndex):
    """SuffixIndex whose drafts are trees: the chain first, then up to width - 1 other branches.

    width: most branches per tree (1 = chain only). Pass it as `proposer=` to lookup decoding.
    """

    def __init__(self, tokens=(), *, width: int = 2, **index_kw):
        self.width = check_int("width (branches per tree)", width, 1)
        super().__init__(tokens, **index_kw)

    def propose(self, max_tokens: int) -> Draft:
        """The chain, whose tree (`grow`) is built only if the step verifies more nodes than the chain's: built every
        step, trees raised the README job's proposer time by ~0.3 ms a step, paid for nothing where the cost curve
        allows no extra node."""
        chain = super().propose(max_tokens)
        if self.width <= 1 or len(chain) == 0:
            return chain
        return dataclasses.replace(chain, grow=lambda: build_tree(branches(self, chain.tokens, max_tokens, self.width),
                                                                  chain.match_len))
