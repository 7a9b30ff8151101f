"""The model side of a decoding step: one verify forward over [last token, draft] per row, and its rollback.

The decode loop (`core.decode`) is the same for one sequence, a batch and the offline replay; only the
forward differs. These are the transformers forwards; each implements `core.forward.Forward` in full:
`prefill(rows)`, `verify(rows, drafts) -> [Verified]`, `rollback(kept)`, `keep_rows(keep)` and
`calibrate(rows, costs, k)`; `draft_kind` says which drafts it verifies ("tree", "chain", or "buckets" for
compiled forwards), `learns_cost` that its time is a real forward's.

* `SequenceForward`: one row, any cache `cache.py` can roll back (sliding windows, static caches with
  bucketed sizes, encoder-decoder decoders); trees verified in one forward with a tree attention mask
  (a node sees the context, the last token and its own ancestors, at position last + depth, so its
  logits equal those of a chain holding just its branch).
* `BatchForward`: left-padded rows in one padded forward. Rows keep different numbers of draft tokens
  and none is cut back to the batch minimum: columns past the longest kept prefix are cropped, and a
  row that kept fewer leaves *holes*, columns masked out of its attention for good. Position ids count
  a row's own valid columns, so every row attends to exactly the keys (at exactly the positions) it
  would have alone. Holes are compacted once they exceed a share of the cache; finished rows leave.
"""

from __future__ import annotations

import copy
import inspect

import numpy as np
import torch

from lookup_decode.core.cost import MIN_CALIBRATED, timed
from lookup_decode.core.draft import EMPTY
from lookup_decode.core.forward import Verified
from lookup_decode.core.policy import BUCKETS
from lookup_decode.core.verify import Processors, Rules, accept_greedy_rows, verify_row, verify_tree
from lookup_decode.engines.hf.cache import (
    cache_argument,
    compact,
    crop,
    full_attention,
    has_recurrent_state,
    keep_tree_path,
    new_cache,
    start_rollback,
)


class _Model:
    """model(ids, cache) -> float32 logits of the last `n_logits` positions of every row, [B, n_logits, V]."""

    learns_cost = True              # the step's timing of verify() is a real forward's cost

    def __init__(self, model, cache, logits_processor, *, do_sample: bool, generator=None, rules: Rules = Rules()):
        self.model, self.cache = model, cache
        self.cache_arg = cache_argument(model)
        self.keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.processors, self.do_sample, self.generator, self.rules = (Processors(logits_processor), do_sample,
                                                                       generator, rules)
        self.vocab = vocab_size(model)

    def logits(self, n_logits: int, **inputs) -> torch.Tensor:
        kwargs = {self.cache_arg: self.cache, "use_cache": True, **inputs}
        if self.keep:
            kwargs["logits_to_keep"] = n_logits
        return self.model(**kwargs).logits[:, -n_logits:].to(torch.float32)

    def accept(self, rows, b: int, draft, logits, scored: torch.Tensor | None = None) -> Verified:
        """Verification of row b: emitted long [m + 1], its score rows and raw logits rows.
        scored: the logits after the prefix-free processors, when the caller ran them for all rows at once."""
        cur = rows.cur[b]
        u = None if rows.uniforms is None else rows.uniforms[b, cur - rows.prompt_len:]
        emitted, scores = verify_row(draft, logits if scored is None else scored, self.processors, rows.ids, b, cur, u,
                                     self.generator, self.rules, scored=scored is not None)
        return Verified(emitted, scores, logits)

    def keep_rows(self, keep: list[int]) -> None:
        """One sequence: nothing to drop (BatchForward overrides it)."""


def vocab_size(model) -> int | None:
    """Rows of the model's output embedding (its config's vocab_size when it has none): ids a draft may hold."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return int(head.weight.shape[0]) if head is not None else getattr(model.config, "vocab_size", None)


def widest_forward(model, rows) -> int:
    """The most tokens per row a verify forward after the prefill can hold: cur >= P + 1 leaves at most
    max_length - P - 1 (the step emits one more), and the positions P.. must stay inside the model's
    context (learned position tables, e.g. GPT-2's n_positions, raise past it). At least 1."""
    P = rows.prompt_len
    fit = rows.max_length - P - 1
    context = getattr(model.config, "max_position_embeddings", None)
    if isinstance(context, int) and context > 0:
        fit = min(fit, context - P)
    return max(fit, 1)


def tree_mask(draft, past: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive attention mask float [1, 1, N + 1, past + N + 1] for the forward over [root, nodes].

    Row 0 (the root) sees the past and itself; row j + 1 (node j) sees the past, the root, its
    ancestors and itself. 0 = attend, the dtype's minimum = masked.
    """
    n = len(draft)
    allowed = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    allowed[:, 0] = True
    for j, parent in enumerate(draft.parents.tolist()):    # a parent comes before its children (Draft checks it)
        allowed[j + 1] = allowed[parent + 1]                # what the parent sees (the root: row 0), and itself
        allowed[j + 1, j + 1] = True
    mask = torch.zeros(n + 1, past + n + 1, dtype=dtype)
    mask[:, past:] = torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)
    return mask.view(1, 1, n + 1, past + n + 1).to(device)


class SequenceForward(_Model):
    """One sequence. input_name/extra: an encoder-decoder's decoder takes decoder_input_ids and the
    encoder output (`encdec.py`); it verifies chains only, as do compiled (static-cache) forwards."""

    def __init__(self, model, cache, logits_processor, *, do_sample: bool, generator=None, rules: Rules = Rules(),
                 input_name: str = "input_ids", extra: dict | None = None):
        super().__init__(model, cache, logits_processor, do_sample=do_sample, generator=generator, rules=rules)
        self.input_name, self.extra = input_name, extra or {}
        # A static cache is there to be compiled: keep forward sizes to a few buckets.
        self.bucketed = bool(getattr(cache, "is_compileable", False))
        # Trees only where they are exact (full-attention dynamic layers); elsewhere policy.fit verifies a
        # tree's first branch, a chain, so a tree drafter still gives plain's output.
        tree = input_name == "input_ids" and full_attention(cache, model)
        self.draft_kind = "buckets" if self.bucketed else "tree" if tree else "chain"
        self._drafted = 0               # draft tokens the last verify sent (a chain)
        self._tree = None               # (past, accepted path, nodes) of the last verify, when it was a tree

    def __call__(self, ids: torch.Tensor, n_logits: int, **extra) -> torch.Tensor:
        return self.logits(n_logits, **{self.input_name: ids}, **self.extra, **extra)[0]

    def prefill(self, rows):
        logits = self(rows.ids[:, : rows.cur[0]], 1)
        start_rollback(self.cache, self.model, widest_forward(self.model, rows))   # every forward can roll back
        return [self.accept(rows, 0, EMPTY, logits)]

    def calibrate(self, rows, costs, k: int):
        """The model's live cost curve (measured now, after the prompt, if this model has none yet)."""
        last = rows.ids[:, rows.prompt_len - 1: rows.prompt_len]

        # A recurrent state cannot be cropped back from a whole forward (Jamba's updates the cached state in place
        # before recording it): time those forwards on a copy of the cache.
        recurrent = has_recurrent_state(self.cache)

        def seconds_of(n):
            if not recurrent:
                return timed_then_cropped(self.cache, n, last.device, lambda: self(last.expand(1, n), 1))
            cache, self.cache = self.cache, copy.deepcopy(self.cache)
            try:
                return timed(last.device, lambda: self(last.expand(1, n), 1))
            finally:
                self.cache = cache
        sizes, fit = None, widest_forward(self.model, rows)
        if self.bucketed:  # time bucket sizes only, and only those that fit the cache
            room = int(self.cache.get_max_length()) - int(self.cache.get_seq_length())
            if room < 1:
                return None                     # a full static cache: no forward can follow (nor be timed)
            fit = min(fit, room)
            sizes = [b for b in BUCKETS if b <= min(max(k + 1, MIN_CALIBRATED), room)]
        return costs.curve(self.model, k + 1, seconds_of, bucketed=self.bucketed, sizes=sizes, fit=fit)

    def verify(self, rows, drafts):
        draft, cur, ids = drafts[0], rows.cur[0], rows.ids
        n = len(draft)
        if draft.parents is None:
            ids[0, cur: cur + n] = torch.from_numpy(draft.tokens).to(ids.device)
            self._drafted, self._tree = n, None
            return [self.accept(rows, 0, draft, self(ids[:, cur - 1: cur + n], n + 1))]
        # A tree: one forward over [last token, nodes], each node at position last + depth.
        nodes = torch.from_numpy(draft.tokens).to(device=ids.device, dtype=torch.long)
        depth = torch.cat([torch.zeros(1, dtype=torch.long), torch.from_numpy(draft.depth)]).to(ids.device)
        dtype = next(self.model.parameters()).dtype
        logits = self(torch.cat([ids[0, cur - 1: cur], nodes]).view(1, -1), n + 1,
                      position_ids=(cur - 1 + depth).view(1, -1),
                      attention_mask=tree_mask(draft, cur - 1, dtype, ids.device))
        u = None if rows.uniforms is None else rows.uniforms[0, cur - rows.prompt_len:]
        emitted, path, scores, raw = verify_tree(draft, logits, self.processors, ids, cur, u, self.rules)
        self._tree = (cur - 1, path, n)
        return [Verified(emitted, scores, raw)]

    def rollback(self, kept: list[int]) -> None:
        """The cache keeps the last token and the accepted drafts only."""
        if self._tree is not None:
            keep_tree_path(self.cache, *self._tree)     # the path holds kept[0] nodes
        else:
            crop(self.cache, self._drafted - kept[0], self._drafted + 1, self.model)


class BatchForward(_Model):
    """Left-padded rows, one padded forward per step, ragged acceptance with masked hole columns."""

    draft_kind = "chain"

    def __init__(self, model, cache, logits_processor, attention_mask: torch.Tensor, *, do_sample: bool,
                 generator=None, rules: Rules = Rules(), hole_share: float = 0.25, min_holes: int = 32):
        super().__init__(model, cache, logits_processor, do_sample=do_sample, generator=generator, rules=rules)
        self.mask = attention_mask.to(torch.bool)                  # [A, S]: valid cache columns of the active rows
        self.positions = attention_mask.to(torch.long).sum(1)      # [A]: position id of each row's next token
        self.hole_share, self.min_holes = hole_share, min_holes
        self._width = 0

    def __call__(self, ids, mask, positions, n_logits: int) -> torch.Tensor:
        return self.logits(n_logits, input_ids=ids, attention_mask=mask.to(torch.long), position_ids=positions)

    def prefill(self, rows):
        P = rows.prompt_len
        prefill_pos = (self.mask.to(torch.long).cumsum(-1) - 1).clamp_min(0)
        logits = self(rows.ids[:, :P], self.mask, prefill_pos, 1)
        return [self.accept(rows, b, EMPTY, logits[i]) for i, b in enumerate(rows.active)]

    def calibrate(self, rows, costs, k: int):
        """The cost curve of widths 1..k+1 for this batch's rows (measured now if not yet known)."""
        last = rows.ids[:, rows.prompt_len - 1: rows.prompt_len]
        n = last.shape[0]

        def seconds_of(w):
            cols = torch.ones((n, w), dtype=torch.bool, device=last.device)
            pos = self.positions[:, None] + torch.arange(w, device=last.device)
            return timed_then_cropped(self.cache, w, last.device,
                                      lambda: self(last.expand(n, w), torch.cat([self.mask, cols], 1), pos, w))
        return costs.curve(self.model, k + 1, seconds_of, rows=n, fit=widest_forward(self.model, rows))

    def verify(self, rows, drafts):
        device = rows.ids.device
        w = 1 + max(len(d) for d in drafts)
        # The forward's input [last token, draft, padding] of every row, built on the host and sent at once.
        lengths = np.array([len(d) for d in drafts])
        host = np.zeros((len(drafts), w), np.int64)
        for i, d in enumerate(drafts):
            host[i, 1: 1 + len(d)] = d.tokens
        x = torch.from_numpy(host).to(device)       # on the CPU the same memory as host: host[:, 1:] is unchanged
        active = torch.tensor(rows.active, device=device)
        x[:, 0] = rows.ids[active, torch.tensor([rows.cur[b] - 1 for b in rows.active], device=device)]
        rows.write([row[1: 1 + len(d)] for row, d in zip(x, drafts)], [rows.cur[b] for b in rows.active])
        n_draft = torch.from_numpy(lengths).to(device)
        cols = torch.arange(w, device=device)
        new_valid = cols[None, :] <= n_draft[:, None]                      # [A, w]: padding columns are masked
        # A padding column is masked out for good, but its position id is still looked up (learned position
        # tables raise past the context): it repeats the row's last real position.
        positions = self.positions[:, None] + torch.minimum(cols[None, :], n_draft[:, None])
        logits = self(x, torch.cat([self.mask, new_valid], 1), positions, w)
        self._width = w
        if not self.do_sample and not self.processors:
            emitted = accept_greedy_rows(host[:, 1:], lengths, logits)
            row_logits = (logits[i, : n + 1] for i, n in enumerate(lengths))
            return [Verified(e, row, row) for e, row in zip(emitted, row_logits)]
        scored = [None] * len(drafts)
        if self.processors.at_once and not self.processors.per_row:
            # Prefix-free processors (temperature, top-k/p, min-p): one call over every row's verified
            # positions (padding columns left out) instead of one per row and position.
            flat = self.processors.tail(logits[new_valid])                # [sum(n_draft + 1), V], row-major
            scored = list(flat.split([len(d) + 1 for d in drafts]))
        return [self.accept(rows, b, d, logits[i, : len(d) + 1], scored[i])
                for i, (b, d) in enumerate(zip(rows.active, drafts))]

    def rollback(self, kept: list[int]) -> None:
        """Crop the columns no row kept; columns some rows kept and others not become holes."""
        n_kept = torch.tensor(kept, device=self.mask.device)
        width_kept = int(n_kept.max()) + 1
        crop(self.cache, self._width - width_kept)
        cols = torch.arange(width_kept, device=self.mask.device)
        self.mask = torch.cat([self.mask, cols[None, :] <= n_kept[:, None]], 1)
        self.positions = self.positions + n_kept + 1
        holes = self.mask.shape[1] - int(self.mask.sum(1).max())
        if holes > max(self.min_holes, self.hole_share * self.mask.shape[1]):
            self.mask = compact(self.cache, self.mask)

    def keep_rows(self, keep: list[int]) -> None:
        """Finished rows leave the batch: they stop costing compute."""
        index = torch.tensor(keep, device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask, self.positions = self.mask[index], self.positions[index]


def batch_memory_bytes(model, batch: int, max_length: int, k: int, hole_share: float = 0.25, min_holes: int = 32,
                       *, logits: bool = True) -> int | None:
    """Bytes a batch needs beyond the weights: its KV cache and (logits=True) one verify forward's float32
    logits [B, k + 1, V]. None when the config does not say enough to estimate."""
    cfg = model.config
    layers = getattr(cfg, "num_hidden_layers", None)
    heads = getattr(cfg, "num_attention_heads", None)
    if not layers or not heads:
        return None
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    dtype_bytes = next(model.parameters()).element_size()
    # Columns: every position, the widest verification, and the holes allowed before compaction.
    columns = int((max_length + k + 1) * (1 + hole_share)) + min_holes
    need = batch * columns * layers * 2 * kv_heads * head_dim * dtype_bytes
    if logits:
        need += batch * (k + 1) * int(vocab_size(model) or 0) * 4
    return need


def check_batch_memory(model, batch: int, max_length: int, k: int, hole_share: float = 0.25, min_holes: int = 32,
                       available_bytes: int | None = None) -> None:
    """Raise a clear ValueError when the KV cache and verify logits of this batch cannot fit in free memory."""
    need = batch_memory_bytes(model, batch, max_length, k, hole_share, min_holes)
    if need is None:
        return                                    # cannot estimate: let it run
    available_bytes = _free_memory(next(model.parameters()).device) if available_bytes is None else available_bytes
    if need > available_bytes:
        raise ValueError(
            f"a batch of {batch} rows x {max_length} tokens needs about {need / 2**30:.1f} GiB of KV cache and "
            f"logits for {type(model).__name__}, but only {available_bytes / 2**30:.1f} GiB is free; use a smaller "
            f"batch or fewer max_new_tokens")


def _free_memory(device: torch.device) -> int:
    """Bytes this process can still allocate on `device`.

    CUDA: the driver's free memory plus what torch's caching allocator holds reserved but unused (it
    reuses that first). CPU: psutil's available memory (Linux's MemAvailable), which counts the page cache the
    kernel gives back on demand (free pages alone, SC_AVPHYS_PAGES, refused batches that fit)."""
    if device.type == "cuda":
        reusable = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + max(reusable, 0)
    import psutil  # accelerate's dependency
    return psutil.virtual_memory().available


def measure_forward_cost(model, context_ids, sizes, repeats: int = 3) -> list[float]:
    """Median seconds of one forward over n new tokens after a prefilled context, for each n in sizes.

    context_ids: long [1, T] (real text: the cost of attention depends on T). The n tokens are the
    context's own last tokens; each measurement is cropped from the cache again.
    """
    cache, arg = new_cache(model), cache_argument(model)
    out = []
    with torch.inference_mode():
        model(input_ids=context_ids, **{arg: cache}, use_cache=True)
        for n in sizes:
            ids = context_ids[:, -n:] if n <= context_ids.shape[1] else context_ids[:, -1:].expand(1, n)

            def forward():
                return model(input_ids=ids, **{arg: cache}, use_cache=True)
            out.append(float(np.median([timed_then_cropped(cache, n, ids.device, forward) for _ in range(repeats)])))
    return out


def timed_then_cropped(cache, n: int, device, forward) -> float:
    """Seconds of `forward()`, a timing forward that adds n tokens to `cache`; they leave it again after."""
    elapsed = timed(device, forward)
    crop(cache, n)
    return elapsed
