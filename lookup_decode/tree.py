"""Trees of candidates: verify several drafts in one forward, keep the longest accepted branch.

When the current suffix occurred before with different continuations, the index's draft is one guess
among several. A tree holds up to `width` drafts whose first tokens differ (branches), verified in one
forward over [last token, every node] with a tree attention mask: a node sees the context, the last
token and its own ancestors only, at position (last position + depth), so each node's logits equal
those of a chain holding just its branch. Acceptance descends from the root: one target token per
visited node (argmax, or an inverse-CDF sample with that output position's uniform, as in
`verify.accept_row_by_row`); if a child carries that token, descend, else stop. The emitted tokens
are exactly those of chain verification of the branch that was followed, so greedy output stays
token-identical and sampling stays exact (each emitted token is one draw from the target row of its
own prefix). Afterwards the cache keeps the context, the last token and the accepted path only.

Status: opt-in (`TreeProposer(width > 1)`). Each branch is cut to the draft length the cost model chose
for the chain, and with the cost model on (adaptive) the extra branches only fill the tokens the measured
cost curve gives for free (`DraftPolicy.tree_budget`): wide trees where a forward's cost is flat in its
length (GPU), few or none on a steep CPU curve. The acceptance model does not price the branches yet.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from lookup_decode.index import SuffixIndex
from lookup_decode.verify import sample_rows


@dataclass
class Tree:
    tokens: torch.Tensor    # long [N]: draft tokens, one per node, branches laid out one after another
    parents: torch.Tensor   # long [N]: parent node, -1 = the root (the last committed token)
    depth: torch.Tensor     # long [N]: 1 for the root's children

    @property
    def size(self) -> int:
        return int(self.tokens.numel())


def build_tree(branches, budget: int | None = None) -> Tree:
    """A tree from drafts (int [d_i] each; shared prefixes are merged). Empty branches are skipped.

    budget: most nodes in all (None: no limit); a branch that would exceed it is cut, so earlier
    branches (the chain first) keep their length.
    Example: [[5, 6, 7], [5, 8], [9]] -> tokens [5, 6, 7, 8, 9], parents [-1, 0, 1, 0, -1].
    """
    tokens, parents, depth, child = [], [], [], {}
    for branch in branches:
        node = -1
        for tok in (int(t) for t in branch):
            key = (node, tok)
            if key not in child:
                if budget is not None and len(tokens) >= budget:
                    break
                child[key] = len(tokens)
                tokens.append(tok)
                parents.append(node)
                depth.append(1 if node < 0 else depth[node] + 1)
            node = child[key]
    as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return Tree(as_long(tokens), as_long(parents), as_long(depth))


def tree_mask(tree: Tree, past: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive attention mask float [1, 1, N + 1, past + N + 1] for the forward over [root, nodes].

    Row 0 (the root) sees the past and itself; row j + 1 (node j) sees the past, the root, its
    ancestors and itself. 0 = attend, the dtype's minimum = masked.
    """
    n = tree.size
    allowed = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    allowed[:, 0] = True
    for j in range(n):
        a = j
        while a >= 0:
            allowed[j + 1, a + 1] = True
            a = int(tree.parents[a])
    mask = torch.zeros(n + 1, past + n + 1, dtype=dtype)
    mask[:, past:] = torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)
    return mask.view(1, 1, n + 1, past + n + 1).to(device)


def accept_tree(tree: Tree, row_scores, uniforms: torch.Tensor | None):
    """Descend the tree from the root, one target token per visited node.

    row_scores(row, path) -> float [1, V]: processed scores of forward row `row` (0 = root, j + 1 =
    node j), whose prefix is the committed text + tree.tokens[path]. uniforms: None (greedy) or
    float64 [>= depth + 1], one per output position. Returns (emitted long [m + 1], path: the m
    accepted node indices, rows: the m + 1 score rows used).
    """
    children: dict[int, dict[int, int]] = {}
    for j in range(tree.size):
        children.setdefault(int(tree.parents[j]), {})[int(tree.tokens[j])] = j
    node, path, rows = -1, [], []
    while True:
        rows.append(row_scores(node + 1, path))
        if uniforms is None:
            x = int(rows[-1].argmax(-1))
        else:
            x = int(sample_rows(torch.softmax(rows[-1], dim=-1), uniforms[len(path): len(path) + 1]))
        nxt = children.get(node, {}).get(x)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    emitted = torch.cat([tree.tokens[path], torch.tensor([x], dtype=torch.long)])
    return emitted, path, rows


def compact_cache(cache, past: int, path: list[int], n_nodes: int) -> None:
    """Keep the past, the root and the accepted nodes' keys/values; drop the rest of the tree.

    The cache holds past + 1 + n_nodes positions (the forward over [root, nodes]) on entry.
    """
    for layer in cache.layers:
        device = layer.keys.device
        keep = torch.cat([torch.arange(past + 1), past + 1 + torch.tensor(path, dtype=torch.long)]).to(device)
        assert layer.keys.shape[-2] == past + 1 + n_nodes
        layer.keys = layer.keys.index_select(-2, keep)
        layer.values = layer.values.index_select(-2, keep)


def tree_step(forward, ids: torch.Tensor, cur: int, tree: Tree, logits_processor, uniforms):
    """Verify `tree` after ids[:, :cur] (the cache holds cur - 1 tokens); roll the cache to the path.

    Returns (emitted long [m + 1], score rows float [m + 1, V], raw logits rows float [m + 1, V]).
    """
    device = ids.device
    past = cur - 1
    inputs = torch.cat([ids[0, cur - 1: cur], tree.tokens.to(device)]).view(1, -1)
    depth = torch.cat([torch.zeros(1, dtype=torch.long), tree.depth]).to(device)
    dtype = next(forward.model.parameters()).dtype
    logits = forward(inputs, tree.size + 1, position_ids=(past + depth).view(1, -1),
                     attention_mask=tree_mask(tree, past, dtype, device))
    raw = []

    def row(r, path):
        raw.append(logits[r: r + 1])
        if not logits_processor:
            return logits[r: r + 1]
        prefix = torch.cat([ids[:, :cur], tree.tokens[path].to(device).view(1, -1)], dim=1)
        return logits_processor(prefix, logits[r: r + 1].clone())

    emitted, path, rows = accept_tree(tree, row, uniforms)
    compact_cache(forward.cache, past, path, tree.size)
    return emitted.to(device), torch.cat(rows), torch.cat(raw)


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
        ok = alive & (ends - m >= 0)
        ok[ok] = t[ends[ok] - m] == t[L - 1 - m]
        lens += ok
        alive = ok
        if not alive.any():
            break
    firsts = t[ends + 1]
    freq = Counter(firsts.tolist())
    eos = set(index.eos.tolist())
    used = {int(main[0])} if len(main) else set()
    for j in sorted(range(len(ends)), key=lambda j: (-lens[j], -freq[int(firsts[j])], -ends[j])):
        if len(out) >= width:
            break
        first = int(firsts[j])
        if first in used or first in eos:
            continue
        used.add(first)
        b = t[ends[j] + 1: min(ends[j] + 1 + k, L)]
        at_eos = np.flatnonzero(np.isin(b, index.eos))
        out.append(b[: at_eos[0]].copy() if len(at_eos) else b.copy())
    return out


class TreeProposer(SuffixIndex):
    """SuffixIndex that also offers trees: `propose_tree(main, k)` -> branches for `build_tree`.

    width: most branches per tree (1 = chain only). Pass it as `proposer=` to lookup decoding.
    """

    def __init__(self, tokens=(), *, width: int = 2, **index_kw):
        if int(width) < 1:
            raise ValueError(f"width (branches per tree) must be >= 1, got {width}")
        super().__init__(tokens, **index_kw)
        self.width = int(width)

    def propose_tree(self, main: np.ndarray, k: int) -> list[np.ndarray]:
        return branches(self, main, k, self.width)
