"""Slow, obviously-correct references the fast code is compared against."""

import numpy as np
import torch


def match_trace(tokens, min_match=1):
    """Brute-force twin of the SuffixIndex match rule: after each token, (match_len, match_end).

    Follow the occurrence being copied while it continues with the new token; otherwise take the
    earliest earlier occurrence of the longest suffix that has one.
    """
    t = list(tokens)
    out = []
    mlen, mend = 0, -1
    for i, c in enumerate(t):
        if mlen > 0 and mend + 1 < i and t[mend + 1] == c:
            mlen, mend = mlen + 1, mend + 1
        else:
            mlen, mend = 0, -1
            for length in range(i, 0, -1):  # longest first
                suffix = t[i - length + 1: i + 1]
                ends = [j for j in range(length - 1, i) if t[j - length + 1: j + 1] == suffix]
                if ends:
                    mlen, mend = length, ends[0]
                    break
        out.append((mlen, mend))
    return out


def draft(tokens, max_tokens, min_match=1, eos=()):
    """The draft the index should propose after `tokens`."""
    if not tokens:
        return []
    mlen, mend = match_trace(tokens)[-1]
    if mlen < min_match:
        return []
    d = []
    for tok in tokens[mend + 1: mend + 1 + max_tokens]:
        if tok in eos:
            break
        d.append(tok)
    return d


@torch.inference_mode()
def greedy_one_by_one(model, input_ids, max_new_tokens, eos_token_id=None):
    """Plain greedy decoding, one forward per token, no cache tricks: the exactness reference."""
    ids = input_ids
    for _ in range(max_new_tokens):
        nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
        if eos_token_id is not None and int(nxt) == eos_token_id:
            break
    return ids
