"""Slow, obviously-correct references the fast code is compared against."""

import torch


def match_trace(tokens, window=64, local_max=64):
    """Brute-force twin of the SuffixIndex match rule: after each token i, (match_len, match_end).

    1. Follow the occurrence being copied while it continues with the new token.
    2. Otherwise find the longest suffix that occurred before (length m) and an anchor: one past the
       source token that failed to match (or, with no match before, the old anchor plus one). If
       0 < m <= local_max and window > 0, take the occurrence whose continuation start (end + 1) is
       nearest to the anchor within `window` (ties: the earlier).
    3. Otherwise its earliest occurrence (match_end = its last position).
    """
    text = "".join(chr(t + 0x100) for t in tokens)  # str.find does the scanning; one char per token
    out = []
    mlen, mend, anchor = 0, -1, -1
    for i, c in enumerate(text):
        if mlen > 0 and mend + 1 < i and text[mend + 1] == c:
            mlen, mend = mlen + 1, mend + 1
        else:
            if mlen > 0:
                anchor = mend + 2
            elif anchor >= 0:
                anchor += 1
            mlen, mend = 0, -1
            length = 1
            while length <= i:
                # earliest occurrence that ends at or before i - 1, i.e. lies inside text[:i]
                start = text.find(text[i - length + 1: i + 1], 0, i)
                if start < 0:
                    break
                mlen, mend = length, start + length - 1
                length += 1
            if window > 0 and 0 < mlen <= local_max and anchor >= 0:
                suffix = text[i - mlen + 1: i + 1]
                near = [e for e in range(mlen - 1, i) if text[e - mlen + 1: e + 1] == suffix
                        and abs(e + 1 - anchor) <= window]
                if near:
                    mend = min(near, key=lambda e: (abs(e + 1 - anchor), e))
        out.append((mlen, mend))
    return out


def draft(tokens, max_tokens, min_match=1, eos=(), window=64):
    """The draft the index should propose after `tokens`."""
    if not tokens:
        return []
    mlen, mend = match_trace(tokens, window)[-1]
    if mlen < min_match:
        return []
    out = []
    for tok in tokens[mend + 1: mend + 1 + max_tokens]:
        if tok in eos:
            break
        out.append(tok)
    return out


@torch.inference_mode()
def greedy_one_by_one(model, input_ids, max_new_tokens):
    """Plain greedy decoding, one full forward per token, no cache: the exactness reference."""
    ids = input_ids
    for _ in range(max_new_tokens):
        nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids
