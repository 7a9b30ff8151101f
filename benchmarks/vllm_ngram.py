"""vLLM's n-gram proposer (vllm/v1/spec_decode/ngram_proposer.py), re-implemented for the benchmarks.

The same algorithm, defaults and driving as vLLM v1's `NgramProposer`, written here from its source:
* per row with sampled tokens (and fewer than max_model_len tokens), the context
  token_ids_cpu[i, :num_tokens_no_spec[i]] is scanned *whole*, every step: one KMP
  longest-prefix-suffix pass over the reversed tokens finds the longest n-gram, min_n <= n <= max_n,
  that ends the context and occurs earlier (the earliest such occurrence wins), and the k tokens after
  it (fewer at the end of the context, never past max_model_len) are the draft;
* rows are scanned in parallel (numba prange) with max(1, cpu_count // 2 // tensor_parallel_size)
  threads, set around the call and restored, as vLLM does;
* defaults: prompt_lookup_min = prompt_lookup_max = 5 (vllm/config/speculative.py), k =
  num_speculative_tokens.
`VllmNgramProposer.propose` has the runner's signature, so `vllm_runner.SimRunner` drives it like
lookup_decode's drafter.
"""

from __future__ import annotations

import os

import numpy as np
from numba import get_num_threads, njit, prange, set_num_threads


@njit(cache=True, nogil=True)
def ngram_draft(tokens, min_n, max_n, max_model_len, k, out):
    """Write the draft for context `tokens` (int32 [n]) into out (int32 [>= k]); returns its length.

    Example: tokens [1,2,3,4,2,3], min_n=2, max_n=3, k=4 -> [4,2,3] (the 2-gram [2,3] first occurs at
    0; three tokens follow it).
    """
    n = tokens.shape[0]
    if n < min_n:
        return 0
    k = min(k, max_model_len - n)
    if k <= 0:
        return 0
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
        return 0
    start = n - 1 - best_at + best_len
    d = min(k, n - start)
    out[:d] = tokens[start:start + d]
    return d


@njit(parallel=True, cache=True)
def _batch(rows, counts, token_ids, min_n, max_n, max_model_len, k, drafts, lengths):
    for j in prange(rows.shape[0]):
        i = rows[j]
        lengths[j] = ngram_draft(token_ids[i, :counts[i]], min_n, max_n, max_model_len, k, drafts[j])


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
