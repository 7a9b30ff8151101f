"""Batched lookup decoding: one suffix index and one draft per row, ragged acceptance, one forward per step.

Rows accept different numbers of draft tokens per step, and none is cut back to the batch minimum.
The cache keeps one column per verified position; after a step the columns past the longest kept
prefix are cropped, and a row that kept fewer tokens leaves *holes*: columns masked out of its
attention mask for good. Position ids count a row's own valid columns, so every row attends to
exactly the keys (at exactly the positions) it would have alone. Holes are compacted away once they
exceed a quarter of the cache, which bounds the memory rejected slots hold; rows that finish leave
the batch, so they cost no compute. The sequences come back left-padded like plain `generate`'s:
prompt, generated tokens, then `pad_token_id` after a row's end.

The draft width is one number per step (rows are padded to it): the width w maximizing the
expected tokens emitted by all rows over the measured cost of a forward w tokens wide relative to
one 1 token wide, with these rows (`BatchCost`). A batch already fills the hardware better than one
row, so the wider the batch, the less drafting pays, and the policy drafts less; w = 1 is plain
batched decoding.
"""

from __future__ import annotations

import os
import time
import weakref

import numpy as np
import torch

from lookup_decode.cache import compact, crop
from lookup_decode.decode import _sync, _verify
from lookup_decode.policy import _COST_EMA, DraftPolicy
from lookup_decode.stats import DecodeStats
from lookup_decode.stopping import first_stop
from lookup_decode.verify import accept_greedy

# Measured cost curves of batched forwards, per model and (device, dtype, batch size).
_BATCH_COSTS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
_HOLE_SHARE = 0.25      # compact once this share of the cache columns could be dropped
_MIN_HOLES = 32         # ... and at least this many (a compaction copies the whole cache)


class BatchForward:
    """model(ids [A, w], valid columns, positions, cache) -> float32 logits of all w positions, [A, w, V]."""

    def __init__(self, model, cache, cache_arg: str, supports_logits_to_keep: bool):
        self.model, self.cache, self.cache_arg = model, cache, cache_arg
        self.keep = supports_logits_to_keep

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, n_logits: int) -> torch.Tensor:
        kwargs = {self.cache_arg: self.cache, "use_cache": True}
        if self.keep:
            kwargs["logits_to_keep"] = n_logits
        out = self.model(input_ids=ids, attention_mask=mask.to(torch.long), position_ids=positions, **kwargs)
        return out.logits[:, -n_logits:].to(torch.float32)


def check_batch_memory(model, batch: int, max_length: int, k: int, available_bytes: int | None = None) -> None:
    """Raise a clear ValueError when the KV cache of this batch cannot fit in free memory."""
    cfg = model.config
    layers = getattr(cfg, "num_hidden_layers", None)
    heads = getattr(cfg, "num_attention_heads", None)
    if not layers or not heads:
        return                                    # cannot estimate: let it run
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    dtype_bytes = next(model.parameters()).element_size()
    # Columns: every position, the widest verification, and the holes allowed before compaction.
    columns = int((max_length + k + 1) * (1 + _HOLE_SHARE)) + _MIN_HOLES
    need = batch * columns * layers * 2 * kv_heads * head_dim * dtype_bytes
    if available_bytes is None:
        available_bytes = _free_memory(next(model.parameters()).device)
    if available_bytes is not None and need > available_bytes:
        raise ValueError(
            f"a batch of {batch} rows x {max_length} tokens needs about {need / 2**30:.1f} GiB of KV cache for "
            f"{type(model).__name__}, but only {available_bytes / 2**30:.1f} GiB is free; use a smaller batch "
            f"or fewer max_new_tokens")


def _free_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


class BatchCost:
    """Seconds of a verify forward `w` tokens wide relative to one 1 token wide, for the rows now in the batch.

    The choice of width needs only this ratio. It is calibrated once per batch size (and model, device,
    dtype); within a call each width's ratio is refined from steps timed against the latest width-1 step
    with the *same* rows: the absolute cost moves with the number of rows and the context, and a curve
    over total tokens (rows x w) mixes them up — as rows left the batch it priced drafts at less than
    no draft. Ratios calibrated on more rows are conservative for fewer: a smaller batch is less
    compute-bound, so drafting is relatively cheaper there.
    """

    def __init__(self, relative: np.ndarray):
        self.relative = np.array(relative, dtype=np.float64)     # [k + 2], index w; relative[1] = 1
        self.max_w = len(self.relative) - 1
        self.width1: dict[int, float] = {}                      # rows -> seconds of a width-1 step

    def __call__(self, w: int) -> float:
        return float(self.relative[w])

    def observe(self, rows: int, w: int, seconds: float) -> None:
        if seconds <= 0 or not 1 <= w <= self.max_w:
            return
        if w == 1:
            last = self.width1.get(rows)
            self.width1[rows] = seconds if last is None else last + _COST_EMA * (seconds - last)
        elif rows in self.width1:
            self.relative[w] += _COST_EMA * (seconds / self.width1[rows] - self.relative[w])


def _calibrate(model, forward: BatchForward, mask, positions, last, k: int) -> BatchCost:
    """Relative cost of widths 1..k+1 on this batch, measured once per (device, dtype, rows)."""
    rows = last.shape[0]
    key = (str(last.device), str(next(model.parameters()).dtype), rows)
    calibrated = _BATCH_COSTS.setdefault(model, {})
    if key not in calibrated or len(calibrated[key]) < k + 2:
        widths = sorted({w for w in _WIDTHS if w <= k + 1} | {k + 1})

        def seconds(w):
            cols = torch.ones((rows, w), dtype=torch.bool, device=last.device)
            pos = positions[:, None] + torch.arange(w, device=last.device)
            _sync(last.device)
            t = time.perf_counter()
            forward(last.expand(rows, w), torch.cat([mask, cols], 1), pos, w)
            _sync(last.device)
            elapsed = time.perf_counter() - t
            crop(forward.cache, w)
            return elapsed

        seconds(widths[-1])  # warm-up: the first use of a shape allocates
        # Noise only ever adds time: the least of a few runs is the estimate (three for the denominator).
        measured = np.array([min(seconds(w) for _ in range(3 if w == 1 else 2 if w == 2 else 1)) for w in widths])
        relative = np.interp(np.arange(k + 2), widths, measured / measured[0])
        relative[0] = np.inf                                    # width 0 does not exist
        calibrated[key] = relative
    return BatchCost(calibrated[key][: k + 2])


def choose_width(policy: DraftPolicy, fulls, match_lens, cost: BatchCost | None, k: int) -> int:
    """Draft width w (tokens per row in the verify forward, 1 = no draft) maximizing E[emitted] / cost.

    Every row drafts min(len(its proposal), w - 1) tokens: within one padded forward a row's
    extra draft tokens cost nothing more, so only the common width is a choice.
    """
    lengths = np.array([min(len(f), k) for f in fulls])
    max_d = int(lengths.max(initial=0))
    if max_d == 0 or cost is None:
        return max_d + 1
    d = np.arange(max_d + 1)
    gain = np.zeros(max_d + 1)
    for n, match_len in zip(lengths, match_lens):
        gain += policy.expected_emitted(match_len, max_d)[np.minimum(d, n)]
    price = np.array([cost(w + 1) for w in d])
    return int(np.argmax(gain / price)) + 1


def _verify_rows(logits_processor, ids, rows, cur, drafts, logits, uniforms, P):
    """Emitted tokens (long [m_i + 1]) for each active row i."""
    if not logits_processor and uniforms is None:       # greedy without processors: nothing per row to run
        return [accept_greedy(d, logits[i, : d.numel() + 1]) for i, d in enumerate(drafts)]
    return [_verify(_for_row(logits_processor, ids, b), ids[b: b + 1], cur[b], drafts[i],
                    logits[i, : drafts[i].numel() + 1], None if uniforms is None else uniforms[b, cur[b] - P:])[0]
            for i, b in enumerate(rows)]


def _for_row(logits_processor, ids, b):
    """Logits processors run for row b alone, with exactly the prefix it has at that point.

    Processors may hold per-row state shaped like the batch (repetition penalty keeps each row's
    padding length), so they must see a [B, L] batch with row b in slot b. Rows advance raggedly,
    so the other slots hold stand-ins (whatever those rows have up to L) whose results are dropped.
    """
    if not logits_processor:
        return logits_processor

    def run(prefix, scores):                       # prefix: ids[b: b + 1, :L]; scores: [1, V]
        batch_scores = scores.expand(ids.shape[0], -1).clone()
        return logits_processor(ids[:, : prefix.shape[1]], batch_scores)[b: b + 1]
    return run


@torch.inference_mode()
def lookup_generate_batch(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, forward: BatchForward,
                          proposers, k: int, logits_processor, stopping_criteria, max_length: int, pad_token_id: int,
                          do_sample: bool = False, generator: torch.Generator | None = None,
                          stats: DecodeStats | None = None, adaptive: bool = True) -> torch.Tensor:
    """Generate after a left-padded [B, P] prompt; each row as plain batched decoding would produce it.

    attention_mask: [B, P], 0 on the left padding; proposers: one per row (extend/propose/match_len).
    Returns long [B, P + longest row's new tokens], rows padded with pad_token_id after their end.
    """
    stats = stats if stats is not None else DecodeStats()
    t_start = time.perf_counter()
    B, P = input_ids.shape
    device = input_ids.device
    ids = torch.full((B, max_length), pad_token_id, dtype=torch.long, device=device)  # prompt, emitted, draft
    ids[:, :P] = input_ids
    cur = [P] * B
    mask = attention_mask.to(torch.bool)                  # [A, S]: valid cache columns of the active rows
    positions = attention_mask.to(torch.long).sum(1)      # [A]: position id of each row's next token
    # Sampling: one float64 uniform per row and output position: each row its own stream.
    uniforms = None
    if do_sample:
        where = generator.device if generator is not None else device
        uniforms = torch.rand((B, max_length - P), generator=generator, dtype=torch.float64, device=where).to(device)
    # One acceptance model for the batch: it learns from every row at every step, so a batch of 16 replaces
    # the optimistic priors with its own evidence 16x sooner (rows of one batch are usually one workload).
    policy = DraftPolicy(k)

    # 1. Prefill: the padded prompts enter the cache; their last rows give each row's first token.
    prefill_pos = (attention_mask.to(torch.long).cumsum(-1) - 1).clamp_min(0)
    logits = forward(input_ids, mask, prefill_pos, 1)
    cost = None
    if adaptive and k > 0:
        cost = _calibrate(model, forward, mask, positions, input_ids[:, -1:], k)
    rows = list(range(B))                                 # original row of each active cache row
    emitted = _verify_rows(logits_processor, ids, rows, cur, [ids[0, :0]] * B, logits, uniforms, P)
    for b in rows:
        proposers[b].extend(input_ids[b][mask[b]])
    stats.prefill_s += time.perf_counter() - t_start

    # Invariant: ids[b, :cur[b]] = padded prompt + committed tokens; the cache holds all but the last.
    while True:
        # 2. Commit each row's emitted tokens, stopping exactly where plain decoding would.
        t = time.perf_counter()
        alive = []
        for i, b in enumerate(rows):
            n_emit, c = emitted[i].numel(), cur[b]
            ids[b, c: c + n_emit] = emitted[i]
            stop_at = first_stop(stopping_criteria, ids[b: b + 1], c, c + n_emit)
            if stop_at is not None:
                n_emit = stop_at - c + 1
            proposers[b].extend(ids[b, c: c + n_emit])
            cur[b] = c + n_emit
            if stop_at is None and cur[b] < max_length:
                alive.append(i)

        # 3. Finished rows leave the batch: they stop costing compute.
        if not alive:
            stats.proposer_s += time.perf_counter() - t
            break
        if len(alive) < len(rows):
            keep = torch.tensor(alive, device=device)
            forward.cache.batch_select_indices(keep)
            mask, positions = mask[keep], positions[keep]
            rows = [rows[i] for i in alive]

        # 4. Propose per row; one width for the batch.
        fulls = [proposers[b].propose(min(k, max_length - cur[b] - 1)) for b in rows]
        match_lens = [proposers[b].match_len for b in rows]
        w = choose_width(policy, fulls, match_lens, cost, k)
        drafts = [torch.from_numpy(f[: w - 1]).to(device=device, dtype=torch.long) for f in fulls]
        w = 1 + max(d.numel() for d in drafts)
        x = torch.full((len(rows), w), pad_token_id, dtype=torch.long, device=device)
        n_draft = torch.tensor([d.numel() for d in drafts], device=device)
        for i, (b, d) in enumerate(zip(rows, drafts)):
            x[i, 0] = ids[b, cur[b] - 1]
            x[i, 1: 1 + d.numel()] = d
            ids[b, cur[b]: cur[b] + d.numel()] = d
        stats.proposer_s += time.perf_counter() - t

        # 5. Verify: one forward over [last, drafts, padding] for all rows; padding columns are masked.
        t = time.perf_counter()
        cols = torch.arange(w, device=device)
        new_valid = cols[None, :] <= n_draft[:, None]                      # [A, w]
        logits = forward(x, torch.cat([mask, new_valid], 1), positions[:, None] + cols, w)
        emitted = _verify_rows(logits_processor, ids, rows, cur, drafts, logits, uniforms, P)
        n_kept = torch.tensor([e.numel() - 1 for e in emitted], device=device)
        verify_s = time.perf_counter() - t      # what the width chose; a compaction below is not its cost

        # 6. Roll back: crop the columns no row kept; columns some rows kept and others not become holes.
        width_kept = int(n_kept.max()) + 1
        crop(forward.cache, w - width_kept)
        mask = torch.cat([mask, cols[None, :width_kept] <= n_kept[:, None]], 1)
        positions = positions + n_kept + 1
        if mask.shape[1] - int(mask.sum(1).max()) > max(_MIN_HOLES, _HOLE_SHARE * mask.shape[1]):
            mask = compact(forward.cache, mask)
        stats.model_s += time.perf_counter() - t

        t = time.perf_counter()
        for i, b in enumerate(rows):
            stats.observe(drafts[i].numel(), int(n_kept[i]))
            policy.observe(fulls[i], emitted[i].cpu().numpy(), match_lens[i])
        if cost is not None:
            cost.observe(len(rows), w, verify_s)
        stats.proposer_s += time.perf_counter() - t

    stats.prompt_tokens += int(attention_mask.sum())
    stats.new_tokens += sum(c - P for c in cur)
    stats.total_s += time.perf_counter() - t_start
    for b in range(B):
        ids[b, cur[b]:] = pad_token_id        # rejected drafts and tokens after a stop were written there
    return ids[:, : max(cur)].clone()
