"""The lookup decoding loop: prefill, then propose -> verify in one forward -> roll back -> commit.

Follows speculative decoding (Leviathan et al. 2023; Chen et al. 2023) with drafts from string
matching instead of a draft model (prompt lookup decoding, Saxena 2023). The whole algorithm is
`lookup_generate`; transformers-specific preparation lives in `hf.py`.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

import torch

from lookup_decode.cache import crop, start_rollback
from lookup_decode.policy import CostCurve, DraftPolicy, measure_cost_curve
from lookup_decode.shapes import BUCKETS, bucketed_draft
from lookup_decode.stats import DecodeStats
from lookup_decode.stopping import first_stop
from lookup_decode.tree import build_tree, tree_step
from lookup_decode.verify import accept_greedy, accept_row_by_row, accept_sampled, accept_with_draft_probs

# Measured forward-cost curves per model, kept for the model's lifetime: calibration costs a few
# forwards, and the curve keeps learning across calls.
_COST_CURVES: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


@dataclass
class Recorded:
    """Per emitted token, when the caller asked generate() for them."""
    scores: list = field(default_factory=list)   # processed scores, float [1, V] each
    logits: list = field(default_factory=list)   # raw logits, float [1, V] each


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Forward:
    """model(ids, cache) -> float32 logits of the last `n_logits` positions, [n_logits, V]."""

    def __init__(self, model, cache, cache_arg: str, supports_logits_to_keep: bool, input_name: str = "input_ids",
                 extra: dict | None = None):
        self.model, self.cache, self.cache_arg = model, cache, cache_arg
        self.keep = supports_logits_to_keep
        # Encoder-decoder models (encdec.py): ids go in as decoder_input_ids, with the encoder output.
        self.input_name, self.extra = input_name, extra or {}
        # A static cache is there to be compiled: keep forward sizes to a few buckets (shapes.py).
        self.buckets = bool(getattr(cache, "is_compileable", False))

    def __call__(self, ids: torch.Tensor, n_logits: int, **extra) -> torch.Tensor:
        kwargs = {self.cache_arg: self.cache, "use_cache": True, **self.extra, **extra}
        if self.keep:
            kwargs["logits_to_keep"] = n_logits
        logits = self.model(**{self.input_name: ids}, **kwargs).logits
        return logits[0, -n_logits:].to(torch.float32)

    def seconds(self, ids: torch.Tensor) -> float:
        """Time one forward over `ids` [1, n], then drop those n tokens again (cost calibration)."""
        _sync(ids.device)
        t = time.perf_counter()
        self(ids, 1)
        _sync(ids.device)
        elapsed = time.perf_counter() - t
        crop(self.cache, ids.shape[1])
        return elapsed


def _cost_curve(model, forward: _Forward, last: torch.Tensor, k: int) -> CostCurve:
    """The model's measured cost curve, measured once per (device, dtype) up to at least 33 tokens."""
    key = (str(last.device), str(next(model.parameters()).dtype), forward.buckets)
    curves = _COST_CURVES.setdefault(model, {})
    if key not in curves or curves[key].max_n < k + 1:
        grid = None
        if forward.buckets:  # static cache: time bucket sizes only, and only those that fit the cache
            room = int(forward.cache.get_max_length()) - int(forward.cache.get_seq_length())
            grid = [b for b in BUCKETS if b <= min(max(k + 1, 33), room)]
        curves[key] = measure_cost_curve(lambda n: forward.seconds(last.expand(1, n)), max(k + 1, 33), grid)
    return curves[key]


def _verify(logits_processor, ids: torch.Tensor, cur: int, draft: torch.Tensor, logits: torch.Tensor,
            uniforms: torch.Tensor | None, draft_probs: torch.Tensor | None = None, generator=None):
    """Emitted tokens (long [m + 1]) and the processed score rows they came from ([>= m + 1, V]).

    ids: long [1, >= cur + n] holds the sequence then the draft; logits: float [n + 1, V]. Row i gets
    the logits processors with exactly the prefix it would have seen in plain decoding: ids[:, :cur + i].
    uniforms: None for greedy, else float64 uniforms of these positions (see verify.accept_sampled).
    """
    n = draft.numel()

    def row(i):
        if not logits_processor:
            return logits[i: i + 1]
        return logits_processor(ids[:, : cur + i], logits[i: i + 1].clone())

    if uniforms is not None and draft_probs is not None and n > 0:
        # Drafts sampled from q (a draft model): the rejection rule needs p on every row.
        scores = torch.cat([row(i) for i in range(n + 1)])
        probs = torch.softmax(scores, dim=-1)
        return accept_with_draft_probs(draft, probs, draft_probs[:n].to(probs.device), generator), scores
    if not logits_processor:                             # nothing to run per row: decide all rows at once
        if uniforms is None:
            return accept_greedy(draft, logits), logits
        return accept_sampled(draft, torch.softmax(logits, dim=-1), uniforms[: n + 1]), logits
    emitted, rows = accept_row_by_row(draft, row, uniforms)
    return emitted, torch.cat(rows)


@torch.inference_mode()
def lookup_generate(model, input_ids: torch.Tensor, *, forward: _Forward, proposer, policy: DraftPolicy,
                    logits_processor, stopping_criteria, max_length: int, do_sample: bool = False,
                    generator: torch.Generator | None = None, streamer=None, stats: DecodeStats | None = None,
                    record: Recorded | None = None, adaptive: bool = True) -> torch.Tensor:
    """Generate after a [1, T] prompt; same tokens as plain decoding (greedy) or same distribution (sampling).

    forward: runs the model on the (empty) cache it owns; proposer: `extend(tokens)`,
    `propose(max_tokens) -> int32 [d]`, `match_len`, and optionally `draft_probs` (float [d, V], the
    distribution the draft was sampled from; sampling then uses the general rejection rule);
    stopping_criteria: transformers-style, checked after every emitted token. Returns long [1, T + new].
    """
    stats = stats if stats is not None else DecodeStats()
    t_start = time.perf_counter()
    T = input_ids.shape[1]
    ids = torch.empty((1, max_length), dtype=torch.long, device=input_ids.device)  # prompt + emitted + draft
    ids[:, :T] = input_ids
    # Sampling: one float64 uniform per output position, drawn up front (see verify.accept_sampled).
    uniforms = None
    if do_sample:
        where = generator.device if generator is not None else ids.device
        uniforms = torch.rand(max_length - T, generator=generator, dtype=torch.float64, device=where).to(ids.device)

    # 1. Prefill: the prompt enters the cache; its last row gives the first token.
    logits = forward(input_ids, 1)
    start_rollback(forward.cache, model)     # from here on every forward can be rolled back
    if adaptive and policy.k > 0 and policy.cost is None:
        policy.cost = _cost_curve(model, forward, input_ids[:, -1:], policy.k)
    emitted, scores = _verify(logits_processor, ids, T, ids[0, :0], logits, uniforms)
    stats.prefill_s += time.perf_counter() - t_start
    cur, stopped = T, False
    proposer.extend(input_ids[0])

    # Invariant: ids[:, :cur] = prompt + committed tokens; the cache holds all of them but the last.
    while True:
        # 2. Commit the emitted tokens, stopping exactly where plain decoding would.
        n_emit = emitted.numel()
        ids[0, cur: cur + n_emit] = emitted
        stop_at = first_stop(stopping_criteria, ids, cur, cur + n_emit)
        if stop_at is not None:
            n_emit, stopped = stop_at - cur + 1, True
        if record is not None:
            record.scores.extend(scores[i: i + 1] for i in range(n_emit))
            record.logits.extend(logits[i: i + 1] for i in range(n_emit))
        if streamer is not None:
            streamer.put(ids[0, cur: cur + n_emit].cpu())
        t = time.perf_counter()
        proposer.extend(ids[0, cur: cur + n_emit])
        cur += n_emit
        if stopped or cur >= max_length:
            stats.proposer_s += time.perf_counter() - t
            break

        # 3. Propose: never more than we may still emit (the step also emits one target token).
        full = proposer.propose(min(policy.k, max_length - cur - 1))
        match_len = proposer.match_len
        n = policy.choose(len(full), match_len)
        chosen = full[:n]
        if forward.buckets:
            chosen = bucketed_draft(full, n, min(policy.k, max_length - cur - 1), filler=0)
            n = len(chosen)
        draft = torch.from_numpy(chosen).to(device=ids.device, dtype=torch.long)
        # 3b. Opt-in trees (tree.py): other continuations of the suffix as extra branches of n tokens.
        # Not with bucketed (compiled) shapes or an encoder-decoder's decoder: their forwards take no tree mask.
        tree = None
        if n > 0 and hasattr(proposer, "propose_tree") and not forward.buckets and forward.input_name == "input_ids":
            tree = build_tree(proposer.propose_tree(full[:n], n), policy.tree_budget(n))
        stats.proposer_s += time.perf_counter() - t

        # 4. Verify: one forward over [last token, d_1..d_n] gives n + 1 rows of target scores.
        t = time.perf_counter()
        if tree is not None and tree.size > n:
            # 4b/5b. A tree: one forward over [last token, nodes], descend, cache rolled to the path.
            emitted, scores, logits = tree_step(forward, ids, cur, tree, logits_processor,
                                                None if uniforms is None else uniforms[cur - T:])
            n, n_kept = tree.size, emitted.numel() - 1
        else:
            ids[0, cur: cur + n] = draft
            logits = forward(ids[:, cur - 1: cur + n], n + 1)
            emitted, scores = _verify(logits_processor, ids, cur, draft, logits,
                                      None if uniforms is None else uniforms[cur - T:],
                                      getattr(proposer, "draft_probs", None), generator)
            n_kept = emitted.numel() - 1
            # 5. Roll back: the cache keeps the last token and the accepted drafts only.
            crop(forward.cache, n - n_kept)
        elapsed = time.perf_counter() - t
        stats.model_s += elapsed
        stats.observe(n, n_kept)

        t = time.perf_counter()
        policy.observe(full, emitted.cpu().numpy(), match_len)
        if policy.cost is not None:
            policy.cost.observe(n + 1, elapsed)
        stats.proposer_s += time.perf_counter() - t

    # Every field adds up, so one DecodeStats can collect several calls.
    stats.prompt_tokens += T
    stats.new_tokens += cur - T
    stats.total_s += time.perf_counter() - t_start
    return ids[:, :cur].clone()
