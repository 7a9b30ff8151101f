"""Slow, obviously-correct references the fast code is compared against."""

import torch


def match_trace(tokens):
    """Brute-force twin of the SuffixIndex match rule: after each token i, (match_len, match_end).

    Follow the occurrence being copied while it continues with the new token; otherwise take the
    earliest earlier occurrence of the longest suffix that has one (match_end = its last position).
    """
    text = "".join(chr(t + 0x100) for t in tokens)  # str.find does the scanning; one char per token
    out = []
    mlen, mend = 0, -1
    for i, c in enumerate(text):
        if mlen > 0 and mend + 1 < i and text[mend + 1] == c:
            mlen, mend = mlen + 1, mend + 1
        else:
            mlen, mend = 0, -1
            length = 1
            while length <= i:
                # earliest occurrence that ends at or before i - 1, i.e. lies inside text[:i]
                start = text.find(text[i - length + 1: i + 1], 0, i)
                if start < 0:
                    break
                mlen, mend = length, start + length - 1
                length += 1
        out.append((mlen, mend))
    return out


def draft(tokens, max_tokens, min_match=1, eos=()):
    """The draft the index should propose after `tokens`."""
    if not tokens:
        return []
    mlen, mend = match_trace(tokens)[-1]
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
