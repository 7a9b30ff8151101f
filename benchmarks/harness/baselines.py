"""Reference proposers, re-implemented from the rules their projects document: one port of each peer's rule.

All but `VllmNgramProposer` and `ArcticSuffix` (behind vLLM's runner signature) are drafters
(`lookup_decode.core.draft.Drafter`), so `lookup_decode.engines.replay.replay` runs them through the decoding
step: built on the prompt, then `extend(tokens)` and `propose(max_tokens) -> Draft`, with the length of the match
behind the draft in `Draft.match_len` (0: none). Each step rescans the context (O(n) per step), as the originals
do (plain numpy, and vLLM's n-gram scan in numba as vLLM has it).

* `TransformersPromptLookup` — transformers' PromptLookupCandidateGenerator (greedy, no logits
  processors): for n = max_matching_ngram_size .. 1, the *first* (left-most) window equal to the
  last n tokens whose continuation is non-empty; the draft is the next num_output_tokens tokens,
  ending at the current end at most, then cut before the first EOS (an EOS at the start gives an
  empty draft; the search does not go on).
* `VllmNgram` — vLLM v1's NgramProposer rule: the longest n in [min_n, max_n] whose last-n-token
  suffix occurs earlier (the occurrence may overlap the suffix); among occurrences of that length the
  earliest; the draft is the k tokens after it, ending at the current end at most. No EOS cut.
  vLLM's default is min_n = max_n = 5. The rule is written once, `ngram_draft` (vLLM's scan, below);
  `VllmNgramProposer` drives the same function as vLLM's runner drives its `NgramProposer`.
* `SuffixDecoding` — ArcticInference's SuffixDecoding (Oliaro et al. 2024) as vLLM runs it for one
  request (`method="suffix"`, defaults max_tree_depth 24, max_spec_factor 1.0, min_token_prob 0.1,
  offset 0, path drafts): a suffix tree of depth D over prompt + output counts, for every string s
  of at most D tokens, its occurrences. For every match length m = 1 .. D - 1 whose last m tokens
  occur, it walks down from that node choosing the most frequent next token, multiplying
  prob *= count(child) / count(node), while prob >= min_token_prob, for at most
  min(k, floor(m * max_spec_factor + offset)) tokens and at most D - m (the tree's depth bounds
  match + draft); the draft with the highest score (sum of prob) wins, the longer match on ties.
  With no history of other requests, its global tree holds only this response, which the request's
  own tree already covers. The original's tie between equally frequent children is unspecified
  (hash-map order); here the one whose continuation occurs first wins.
* `ArcticSuffix` — not a port: ArcticInference's own `SuffixDecodingCache` (its C++ suffix tree) driven as vLLM's
  SuffixDecodingProposer drives it, behind the runner's `propose` signature like `VllmNgramProposer`.
* `SelectionOracle` — the bound of choosing occurrences: knows the true continuation and copies from
  the best occurrence of the current last token (so of any matching suffix).
* `ContextCopyOracle` — the ceiling of drafting by copying one span of the context: it knows the
  true continuation and drafts the longest prefix of it that occurs anywhere in prompt + output so far.
* `SubstitutionKey` — a variant of lookup_decode's own rule that lost (issue 8, item 3): after a
  miss, when the index's own match is shorter than `min_len`, assume the corrected token *replaced*
  the source token and keep copying from the source one past it. Full replay: fewer tokens per step
  on 5 of 6 sets (clapnq: +0.01 at cap 10, +0.04 at cap 32) and a lower modelled speed-up on every
  set (benchmarks/results/replay/, row `ablate_substitution_key`), so the package does not use it.
"""

from __future__ import annotations

import os

import numpy as np
from numba import get_num_threads, njit, prange, set_num_threads

from lookup_decode.core.draft import EMPTY, Draft
from lookup_decode.core.index import SuffixIndex

NO_LENGTH_LIMIT = 2**62       # max_model_len of a replay: none


def before_eos(draft: np.ndarray, eos: np.ndarray) -> np.ndarray:
    """The draft up to, not including, its first EOS token (the transformers rule both baselines follow)."""
    at_eos = np.flatnonzero(np.isin(draft, eos))
    return draft[: at_eos[0]] if len(at_eos) else draft


class _Context:
    """Growing int32 token buffer (doubling), shared by the baselines."""

    def __init__(self, tokens):
        tokens = np.asarray(tokens, dtype=np.int32)
        self._buf = np.zeros(max(1024, 2 * len(tokens)), dtype=np.int32)
        self._buf[: len(tokens)] = tokens
        self.n = len(tokens)

    def extend(self, tokens) -> None:
        tokens = np.asarray(tokens, dtype=np.int32)
        if self.n + len(tokens) > len(self._buf):
            grown = np.zeros(2 * (self.n + len(tokens)), dtype=np.int32)
            grown[: self.n] = self._buf[: self.n]
            self._buf = grown
        self._buf[self.n: self.n + len(tokens)] = tokens
        self.n += len(tokens)

    @property
    def tokens(self) -> np.ndarray:
        return self._buf[: self.n]


class TransformersPromptLookup(_Context):
    """transformers' prompt lookup: first (left-most) match of the last n-gram, n = max..1.

    Example: tokens [2,3,8,1,2,3,9,1,2,3], max_matching_ngram_size=2 -> the 2-gram [2,3] first
    occurs at 0 -> draft [8,1,2,3,9,1,2,3] (up to the end of the context).
    """

    def __init__(self, tokens, num_output_tokens: int = 10, max_matching_ngram_size: int = 2, eos_token_ids=()):
        super().__init__(tokens)
        self.num_output_tokens = num_output_tokens
        self.max_ngram = max_matching_ngram_size
        self.eos = np.asarray(list(eos_token_ids), dtype=np.int32)

    def propose(self, max_tokens: int) -> Draft:
        t, L = self.tokens, self.n
        size = min(self.num_output_tokens, max_tokens)
        if size <= 0:
            return EMPTY
        for n in range(min(self.max_ngram, L - 1), 0, -1):
            # windows t[i:i+n] == t[L-n:] for i = 0..L-n (the suffix itself is one of them)
            ok = t[: L - n + 1] == t[L - n]
            for j in range(1, n):
                ok &= t[j: L - n + 1 + j] == t[L - n + j]
            starts = np.flatnonzero(ok)
            starts = starts[starts + n < L]          # continuation must be non-empty
            if len(starts) == 0:
                continue
            begin = int(starts[0]) + n
            return Draft(before_eos(t[begin: min(begin + size, L)].copy(), self.eos), n)
        return EMPTY


class VllmNgram(_Context):
    """vLLM's n-gram rule (`ngram_draft`): longest suffix match with min_n <= n <= max_n, earliest occurrence,
    k tokens.

    Examples: [1,2,3,4,2,3] with min_n=2, max_n=3, k=4 -> [4,2,3];
    [1,2,3,4,1,2,3] with min_n=max_n=2, k=2 -> [4,1].
    """

    def __init__(self, tokens, k: int = 10, min_n: int = 5, max_n: int = 5):
        super().__init__(tokens)
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, max_tokens: int) -> Draft:
        k = min(self.k, max_tokens)
        if k <= 0:
            return EMPTY
        out = np.empty(k, np.int32)
        d, matched = ngram_draft(self.tokens, self.min_n, self.max_n, NO_LENGTH_LIMIT, k, out)
        return Draft(out[:d], matched) if d else EMPTY


class SuffixDecoding(_Context):
    """SuffixDecoding's path rule over one request's prompt + output (see the module docstring).

    Example: tokens [1,2,3,1,2,3,1,2], D = 24, factor 1. The suffix itself is one of the counted
    occurrences (as in the original tree), so "1 2" (m = 2; 3 occurrences, 2 continue with 3) drafts
    [3, 1] with prob 2/3 each (score 1.33); m = 3, 4, 5 occur twice: [3, 1, 2] with prob 1/2 each
    (score 1.5); the longest of the best wins -> [3, 1, 2] with match_len 5.
    """

    def __init__(self, tokens, k: int = 32, max_tree_depth: int = 24, max_spec_factor: float = 1.0,
                 max_spec_offset: float = 0.0, min_token_prob: float = 0.1):
        super().__init__(tokens)
        self.k, self.depth, self.factor = k, max_tree_depth, max_spec_factor
        self.offset, self.min_prob = max_spec_offset, min_token_prob

    def _path(self, starts: np.ndarray, m: int, max_tokens: int) -> tuple[list[int], float]:
        """Most-frequent path below the string t[starts[0]:starts[0]+m] (starts: all its occurrences)."""
        t, L = self.tokens, self.n
        draft, prob, score = [], 1.0, 0.0
        depth = m
        while len(draft) < max_tokens and depth < self.depth:
            alive = starts[starts + depth < L]          # occurrences with a next token
            if len(alive) == 0:
                break
            nxt = t[alive + depth]
            vals, first, counts = np.unique(nxt, return_index=True, return_counts=True)
            best = np.flatnonzero(counts == counts.max())
            pick = best[np.argmin(first[best])]      # tie: the continuation seen first
            prob *= counts[pick] / len(starts)
            if prob < self.min_prob:
                break
            draft.append(int(vals[pick]))
            score += prob
            starts = alive[nxt == vals[pick]]
            depth += 1
        return draft, score

    def propose(self, max_tokens: int) -> Draft:
        t, L = self.tokens, self.n
        k = min(self.k, max_tokens)
        best, best_score, best_m = [], 0.0, 0
        if L == 0 or k <= 0:
            return EMPTY
        starts = np.flatnonzero(t[:L] == t[L - 1])    # occurrences of the last m tokens (m = 1)
        for m in range(1, min(self.depth, L)):        # pattern = last D tokens; match_len < len(pattern)
            if m > 1:
                starts = starts[starts >= 1] - 1
                starts = starts[t[starts] == t[L - m]]
            if len(starts) == 0:
                break
            max_m = max(min(k, int(m * self.factor + self.offset + 1e-6)), 0)
            draft, score = self._path(starts, m, max_m)
            if score >= best_score:
                best, best_score, best_m = draft, score, m
        return Draft(np.asarray(best, dtype=np.int32), best_m)


class _KnowsOutput(_Context):
    """A context that also knows the true continuation (int [n]); `pos` advances with extend()."""

    def __init__(self, tokens, output):
        super().__init__(tokens)
        self.output = np.asarray(output, dtype=np.int32)
        self.pos = 0

    def extend(self, tokens) -> None:
        super().extend(tokens)
        self.pos += len(tokens)


class SelectionOracle(_KnowsOutput):
    """Bound of every occurrence-choosing rule: knows the true continuation and copies from the
    earlier occurrence of the last token (any match length >= 1) whose continuation keeps the most.

    The context-copy ceiling may start a copy anywhere; a suffix-matching proposer must start right
    after an occurrence of the current suffix, so this bound is what choosing the occurrence can
    reach at best. output: the whole true continuation (int [n]).
    """

    def propose(self, max_tokens: int) -> Draft:
        t, L = self.tokens, self.n
        future = self.output[self.pos: self.pos + max_tokens]
        if len(future) == 0 or L < 2:
            return EMPTY
        starts = np.flatnonzero(t[: L - 1] == t[L - 1]) + 1    # continuation starts, all < L
        kept = np.zeros(len(starts), dtype=np.int64)
        alive = np.ones(len(starts), dtype=bool)
        for j in range(len(future)):                          # kept[i]: prefix of future copied from starts[i]
            ok = alive & (starts + j < L)
            ok[ok] = t[starts[ok] + j] == future[j]
            kept += ok
            alive = ok
            if not alive.any():
                break
        if len(starts) == 0 or kept.max() == 0:
            return EMPTY                                       # nothing would be kept: draft nothing
        best = int(starts[np.argmax(kept)])
        return Draft(t[best: min(best + max_tokens, L)].copy(), 1)


class ContextCopyOracle(_KnowsOutput):
    """Drafts the longest prefix of the true continuation that occurs in the context (capped).

    output: the whole true continuation (int [n]); the oracle's position in it advances with extend().
    """

    def propose(self, max_tokens: int) -> Draft:
        t, L = self.tokens, self.n
        future = self.output[self.pos: self.pos + max_tokens]
        if len(future) == 0:
            return EMPTY
        starts = np.flatnonzero(t == future[0])
        m = 0
        while len(starts):                              # every start matches future[:m + 1]
            m += 1
            if m == len(future):
                break
            starts = starts[starts + m < L]
            starts = starts[t[starts + m] == future[m]]
        return Draft(future[:m].copy(), m)


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

    def propose(self, max_tokens: int) -> Draft:
        n = len(self.index)
        if self._skip >= 0 and self.index.match_len < self.min_len and self._skip < n and max_tokens > 0:
            draft = before_eos(self.index.tokens[self._skip: min(self._skip + max_tokens, n)].copy(), self.eos)
            self._src = self._skip if len(draft) else -1
            return Draft(draft, 1)
        draft = self.index.propose(max_tokens)
        self._src = self.index.match_end + 1 if len(draft) else -1
        return draft


# ------------------------------------------------------------------------------- vLLM's n-gram scan
# vllm/v1/spec_decode/ngram_proposer.py, written here from its source: the same algorithm, defaults and driving.
# * per row with sampled tokens (and fewer than max_model_len tokens), the context
#   token_ids_cpu[i, :num_tokens_no_spec[i]] is scanned *whole*, every step: one KMP longest-prefix-suffix pass
#   over the reversed tokens finds the longest n-gram, min_n <= n <= max_n, that ends the context and occurs
#   earlier (the earliest such occurrence wins), and the k tokens after it (fewer at the end of the context,
#   never past max_model_len) are the draft;
# * rows are scanned in parallel (numba prange) with max(1, cpu_count // 2 // tensor_parallel_size) threads, set
#   around the call and restored, as vLLM does;
# * defaults: prompt_lookup_min = prompt_lookup_max = 5 (vllm/config/speculative.py), k = num_speculative_tokens.
# `VllmNgramProposer.propose` has the runner's signature, so `tests.sim_runner.SimRunner` drives it like
# lookup_decode's drafter.

@njit(cache=True, nogil=True)
def ngram_draft(tokens, min_n, max_n, max_model_len, k, out):
    """Write the draft for context `tokens` (int32 [n]) into out (int32 [>= k]); returns (its length, the length
    of the match behind it).

    Example: tokens [1,2,3,4,2,3], min_n=2, max_n=3, k=4 -> [4,2,3], (3, 2) (the 2-gram [2,3] first occurs at
    0; three tokens follow it).
    """
    n = tokens.shape[0]
    if n < min_n:
        return 0, 0
    k = min(k, max_model_len - n)
    if k <= 0:
        return 0, 0
    # In reversed order r = tokens[::-1] the context's suffixes are prefixes of r; lps[j] is the longest
    # proper prefix of r[:j+1] that is also its suffix, kept for the first max_n positions only.
    lps = np.zeros(max_n, np.int32)
    best_len, best_at = 0, 0
    matched, i = 0, 1
    while i < n:
        if tokens[n - 1 - matched] == tokens[n - 1 - i]:
            matched += 1
            if matched >= best_len:          # ">=": a later i in r is an earlier occurrence in tokens
                best_len, best_at = matched, i
            if i < max_n:
                lps[i] = matched
            if matched == max_n:
                matched = lps[max_n - 1]
            i += 1
        elif matched:
            matched = lps[matched - 1]
        else:
            i += 1
    if best_len < min_n:
        return 0, 0
    start = n - 1 - best_at + best_len
    d = min(k, n - start)
    out[:d] = tokens[start:start + d]
    return d, best_len


@njit(parallel=True, cache=True)
def _batch(rows, counts, token_ids, min_n, max_n, max_model_len, k, drafts, lengths):
    for j in prange(rows.shape[0]):
        i = rows[j]
        lengths[j] = ngram_draft(token_ids[i, :counts[i]], min_n, max_n, max_model_len, k, drafts[j])[0]


class VllmNgramProposer:
    """vLLM's NgramProposer behind the runner's `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
    slot_mappings=None)`."""

    def __init__(self, k: int, max_model_len: int, *, min_n: int = 5, max_n: int = 5, max_num_seqs: int = 256,
                 tensor_parallel_size: int = 1):
        self.k, self.max_model_len, self.min_n, self.max_n = k, max_model_len, min_n, max_n
        self.drafts = np.zeros((max_num_seqs, k), np.int32)
        self.lengths = np.zeros(max_num_seqs, np.int32)
        self.threads = max(1, (os.cpu_count() or 2) // 2 // tensor_parallel_size)
        self.propose([[1]], np.array([8]), np.zeros((1, 16), np.int32))       # JIT warm-up, as vLLM does

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]:
        counts = np.asarray(num_tokens_no_spec)
        rows = np.array([i for i, s in enumerate(sampled_token_ids) if len(s) and counts[i] < self.max_model_len],
                        np.int64)
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        if len(rows) == 0:
            return out
        if len(rows) > len(self.drafts):
            self.drafts = np.zeros((len(rows), self.k), np.int32)
            self.lengths = np.zeros(len(rows), np.int32)
        before = get_num_threads()
        set_num_threads(min(self.threads, len(rows)))
        try:
            _batch(rows, counts, np.asarray(token_ids_cpu), self.min_n, self.max_n, self.max_model_len, self.k,
                   self.drafts, self.lengths)
        finally:
            set_num_threads(before)
        for j, i in enumerate(rows.tolist()):
            out[i] = self.drafts[j, : self.lengths[j]].tolist()
        return out

    def load_model(self, *args, **kwargs) -> None:
        pass


class ArcticSuffix:
    """ArcticInference's SuffixDecodingCache driven as vLLM's SuffixDecodingProposer drives it, behind the runner's
    `propose(...)`: start_request with the prompt, add_active_response, speculate on the last max_tree_depth tokens,
    stop_request when the request leaves the batch, one global cache of responses; vLLM's defaults. Request ids
    and prompt lengths (which vLLM's proposer reads from its input batch) come from `runner.rows` (the simulated
    runner's; set `runner` before the first call). ImportError without arctic_inference."""

    def __init__(self, k: int, max_model_len: int, max_tree_depth: int = 24, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1, max_cached_requests: int = 10_000):
        from arctic_inference.suffix_decoding import SuffixDecodingCache
        self.cache = SuffixDecodingCache(max_tree_depth=max_tree_depth, max_cached_requests=max_cached_requests)
        self.k, self.max_model_len, self.depth = k, max_model_len, max_tree_depth
        self.factor, self.min_prob = max_spec_factor, min_token_prob
        self.runner = None

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        out = []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            if not sampled or n >= self.max_model_len:
                out.append([])
                continue
            req = self.runner.rows[i]
            rid = id(req)
            if rid not in self.cache.active_requests:
                if rid in self.cache.cached_requests:
                    self.cache.evict_cached_response(rid)
                self.cache.start_request(rid, token_ids_cpu[i, : len(req.prompt)])
            self.cache.add_active_response(rid, sampled)
            pattern = token_ids_cpu[i, max(0, n - self.depth): n]
            draft = self.cache.speculate(rid, pattern, max_spec_tokens=min(self.k, self.max_model_len - n - 1),
                                         max_spec_factor=self.factor, min_token_prob=self.min_prob)
            out.append(list(draft.token_ids))
        in_batch = {id(r) for r in self.runner.rows if r is not None}
        for rid in list(self.cache.active_requests - in_batch):
            self.cache.stop_request(rid)
        return out
