"""Where greedy lookup decoding parts from plain decoding in bfloat16, and whether that is a near-tie.

In float32 the two are token-for-token identical. In bfloat16 a verify forward over 16 tokens and 16 forwards over
one token round differently, so at a step where the model's top two logits nearly tie, the two can pick different
tokens; every later token then follows a different text. The contract (docs/limits.md): identical, except where
the first difference is a near-tie. `classify` checks it: it recomputes the logits at the first difference in a
forward over 1 token and one over WIDE tokens, each on a cache of the text before, and calls the difference a
near-tie when, in both, the logits of the two tokens (plain's and lookup's) are within NEAR_TIE of each other.

NEAR_TIE comes from `rounding_spread`: how far the gap between a position's top two logits moves between the two
forward shapes. A flip needs the gap to change sign, so the gap at a real flip is at most that spread in either
forward; a recomputed forward is a third rounding of the same sums, hence the factor 2 below.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lookup_decode.engines.hf.cache import cache_argument, new_cache

WIDE = 16
# Measured with `rounding_spread` on Qwen2.5-Coder-0.5B-Instruct in bfloat16 on a CPU (AVX512-BF16; docs/limits.md,
# "Exactness in bfloat16"): over 800 output positions of four code edits (tests/data latency/0-2, examples/data
# edit_request) the top-2 gap moved by at most 0.3125 logits (2.5 bf16 steps at logits of 16-32) between 1-token
# and 16-token forwards (99th percentile 0.25, median 0.0). Twice that: a recomputation is one more rounding. A
# small sample (the machine was too loaded for more): widen it when more is measured.
NEAR_TIE = 0.625


@dataclass(frozen=True)
class Difference:
    position: int       # index into the new tokens where the outputs first differ
    plain: int          # plain decoding's token there (-1: its output ended)
    lookup: int         # lookup decoding's token there (-1: its output ended)
    gaps: tuple         # |logit[plain] - logit[lookup]| in a 1-token and a WIDE-token forward
    near_tie: bool


def first_difference(a, b) -> int | None:
    """Index of the first position where the 1-D sequences a and b differ (a shorter one differs where it ends);
    None when they are equal."""
    a, b = torch.as_tensor(a).flatten(), torch.as_tensor(b).flatten()
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    if len(differ):
        return int(differ[0])
    return None if len(a) == len(b) else n


@torch.no_grad()
def next_logits(model, ids: torch.Tensor, width: int) -> torch.Tensor:
    """float32 [vocab]: the logits of the token after `ids` (long [T]) from a forward over its last `width` tokens
    on a cache of the ones before (width is clipped to T - 1, so a cache always exists)."""
    width = max(1, min(width, len(ids) - 1))
    ids, cache = ids.to(model.device)[None], {cache_argument(model): new_cache(model)}
    if ids.shape[1] > width:
        model(ids[:, :-width], use_cache=True, **cache)
    return model(ids[:, -width:], use_cache=True, **cache).logits[0, -1].float()


def classify(model, prompt, plain, lookup, *, threshold: float = NEAR_TIE, wide: int = WIDE) -> Difference | None:
    """The first difference between two greedy outputs of a decoder-only model, classified; None when equal.

    prompt: long [T] (or [1, T]); plain, lookup: the new tokens of each output (long [n], [m]). Where one output
    ended before the other, the missing token is -1 and the difference is never a near-tie (an output that stops
    early is no rounding).
    """
    prompt, plain, lookup = (torch.as_tensor(x).flatten().long().cpu() for x in (prompt, plain, lookup))
    at = first_difference(plain, lookup)
    if at is None:
        return None
    a = int(plain[at]) if at < len(plain) else -1
    b = int(lookup[at]) if at < len(lookup) else -1
    if a < 0 or b < 0:
        return Difference(at, a, b, (float("inf"), float("inf")), False)
    ids = torch.cat([prompt, plain[:at]])
    gaps = tuple(float((logits[a] - logits[b]).abs()) for logits in (next_logits(model, ids, w) for w in (1, wide)))
    return Difference(at, a, b, gaps, max(gaps) <= threshold)


@torch.no_grad()
def rounding_spread(model, ids: torch.Tensor, start: int, wide: int = WIDE) -> torch.Tensor:
    """float32 [len(ids) - start]: per position p >= start, how much the gap between the top two logits of the
    token after ids[:p + 1] differs between one-token forwards (plain decoding's shape: the prompt's cache from
    one forward, then one token per forward) and WIDE-token forwards (a verify step's shape) over the same text.
    The largest value over real outputs is what NEAR_TIE is set from."""
    ids, arg = ids.flatten().to(model.device)[None], cache_argument(model)
    cache = {arg: new_cache(model)}
    one = [model(ids[:, :start], use_cache=True, **cache).logits[0, -1].float()]
    one += [model(ids[:, p: p + 1], use_cache=True, **cache).logits[0, -1].float()
            for p in range(start, ids.shape[1] - 1)]
    one = torch.stack(one)                                   # [n, vocab]: next-token logits after ids[:start + i]
    cache = {arg: new_cache(model)}
    model(ids[:, :start - 1], use_cache=True, **cache)
    blocks = [model(ids[:, s: s + wide], use_cache=True, **cache).logits[0].float()
              for s in range(start - 1, ids.shape[1] - 1, wide)]
    many = torch.cat(blocks)[: len(one)]                     # the same positions, WIDE tokens per forward
    top2 = one.topk(2, dim=-1).indices
    gap_one, gap_many = (x.gather(1, top2[:, :1]) - x.gather(1, top2[:, 1:]) for x in (one, many))
    return (gap_one - gap_many).abs().flatten()
