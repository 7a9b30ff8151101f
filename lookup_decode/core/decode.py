"""The lookup decoding loop: prefill, then steps of propose -> choose -> verify -> roll back -> commit -> learn.

Follows speculative decoding (Leviathan et al. 2023; Chen et al. 2023) with drafts from string
matching instead of a draft model (prompt lookup decoding, Saxena 2023). `step` is the whole
algorithm and runs unchanged for one sequence, a batch of left-padded rows, trees and the offline
replay; only the forward passed in differs (the `core.forward.Forward` protocol; implementations in
`engines.hf.forward` and `engines.replay`). Engines prepare the pieces: transformers' in `engines.hf.hook`.

    prefill ─▶ ┌─ 1 propose (each row's drafter) ─ 2 choose one width (policy, cost) ─┐
               │                                                                      ▼
               └─ 6 learn ◀─ 5 commit + stop ◀─ 4 roll back cache ◀─ 3 verify in one forward
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from lookup_decode.core.cost import COSTS
from lookup_decode.core.draft import checked_rows, kept_prefix
from lookup_decode.core.forward import Forward, Verified
from lookup_decode.core.stats import DecodeStats

_FIRST_COLUMNS = 256      # columns past the prompt allocated at the start; more as rows grow


@dataclass
class Rows:
    """The sequences being decoded. Invariant: ids[b, :cur[b]] is final; the cache holds all of it but the last token.

    ids and uniforms grow as decoding goes (`reserve`), like plain generate's ids: a max_length of
    millions (stopped by EOS or a criterion) must not allocate B x max_length up front.
    """
    ids: torch.Tensor                      # long [B, capacity]: prompts (left-padded), committed tokens, drafts
    cur: list[int]                         # [B] committed length of each row
    active: list[int]                      # rows still decoding, in the forward's (cache) row order
    prompt_len: int                        # P, the padded prompt length
    uniforms: torch.Tensor | None = None   # float64 [B, capacity - P]: one per output position (sampling)
    pad_token_id: int = 0                  # fills a row after its end in the result
    max_length: int = 0                    # no row grows past it (0: ids.shape[1])
    generator: torch.Generator | None = None   # draws the uniforms of new columns

    def __post_init__(self):
        self.max_length = int(self.max_length or self.ids.shape[1])

    @classmethod
    def start(cls, input_ids: torch.Tensor, max_length: int, *, pad_token_id: int = 0, do_sample: bool = False,
              generator: torch.Generator | None = None) -> "Rows":
        B, P = input_ids.shape
        rows = cls(input_ids.clone(), [P] * B, list(range(B)), P, None, pad_token_id, max_length, generator)
        if do_sample:  # one float64 uniform per row and output position: each row its own stream
            rows.uniforms = torch.zeros((B, 0), dtype=torch.float64, device=input_ids.device)
        rows.reserve(P + _FIRST_COLUMNS)
        return rows

    def reserve(self, length: int) -> None:
        """Make room for min(length, max_length) columns, growing by doubling (amortized O(1) per token)."""
        have, length = self.ids.shape[1], min(int(length), self.max_length)
        if length <= have:
            return
        grow = min(self.max_length, max(length, 2 * have)) - have
        B = self.ids.shape[0]
        self.ids = torch.cat([self.ids, self.ids.new_full((B, grow), self.pad_token_id)], 1)
        if self.uniforms is not None:
            where = self.generator.device if self.generator is not None else self.ids.device
            more = torch.rand((B, self.ids.shape[1] - self.prompt_len - self.uniforms.shape[1]),
                              generator=self.generator, dtype=torch.float64, device=where)
            self.uniforms = torch.cat([self.uniforms, more.to(self.ids.device)], 1)

    def write(self, tokens: list[torch.Tensor], at: list[int]) -> None:
        """Write tokens[i] into the i-th active row from column at[i]: one indexed copy for all rows."""
        lengths = [len(t) for t in tokens]
        if len(tokens) == 1:        # one sequence, the common case: a slice, no index tensors to build
            self.ids[self.active[0], at[0]: at[0] + lengths[0]] = tokens[0].to(self.ids.device)
            return
        lengths, at = np.array(lengths), np.array(at)
        # Row i's j-th token goes to (active[i], at[i] + j): flat offsets minus each row's first flat offset.
        row = np.repeat(self.active, lengths)
        col = np.arange(lengths.sum()) + np.repeat(at - (np.cumsum(lengths) - lengths), lengths)
        device = self.ids.device
        self.ids[torch.from_numpy(row).to(device), torch.from_numpy(col).to(device)] = torch.cat(tokens).to(device)

    def room(self, b: int) -> int:
        """Draft tokens row b may still verify: the step also emits one target token."""
        return self.max_length - self.cur[b] - 1

    def result(self) -> torch.Tensor:
        """long [B, P + longest row's new tokens], rows padded with pad_token_id after their end."""
        for b, c in enumerate(self.cur):
            self.ids[b, c:] = self.pad_token_id       # rejected drafts and tokens after a stop were written there
        return self.ids[:, : max(self.cur)].clone()


@dataclass
class Recorded:
    """Per emitted token of a single sequence, when the caller asked generate() for them."""
    scores: list = field(default_factory=list)   # processed scores, float [1, V] each
    logits: list = field(default_factory=list)   # raw logits, float [1, V] each


# stops(ids, rows, starts, emitted) -> per row the column of the first token after which decoding stops, or None:
# row rows[i] emitted the tokens emitted[i] at columns starts[i].. of ids (long [B, >= end]); the engine's stop
# rule (transformers: its stopping criteria after every token, `engines.hf.stopping.first_stops`).
Stops = Callable[[torch.Tensor, list[int], list[int], list[torch.Tensor]], list]


def commit(rows: Rows, verified: list[Verified], stops: Stops | None, streamer=None,
           record: Recorded | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """Write each active row's emitted tokens, stopping exactly where plain decoding would (`stops` after
    every token). Returns (the indices into rows.active of the rows that go on, each active row's committed
    tokens: its emitted tokens up to and including a stop)."""
    emitted = [v.emitted for v in verified]
    starts = [rows.cur[b] for b in rows.active]
    rows.write(emitted, starts)
    found = stops(rows.ids, rows.active, starts, emitted) if stops is not None else [None] * len(emitted)
    alive, committed = [], []
    for i, (b, c, tokens, stop_at) in enumerate(zip(rows.active, starts, emitted, found)):
        n = tokens.numel() if stop_at is None else stop_at - c + 1
        if record is not None:
            # Copies: a view would keep the whole [k + 1, V] verify block alive per token.
            record.scores.extend(verified[i].scores[j: j + 1].clone() for j in range(n))
            record.logits.extend(verified[i].logits[j: j + 1].clone() for j in range(n))
        if streamer is not None:
            streamer.put(tokens[:n].cpu())
        committed.append(tokens[:n])
        rows.cur[b] = c + n
        if stop_at is None and rows.room(b) >= 0:
            alive.append(i)
    return alive, committed


def step(rows: Rows, forward: Forward, drafters, policy, stops: Stops | None, stats: DecodeStats, streamer=None,
         record: Recorded | None = None) -> None:
    """One decoding step for every active row (see the module's picture)."""
    t = time.perf_counter()
    # 1. Propose: never more than a row may still emit.
    limits = [min(policy.k, rows.room(b)) for b in rows.active]
    fulls = checked_rows([drafters[b].propose(limit) for b, limit in zip(rows.active, limits)],
                         [drafters[b] for b in rows.active], limits, forward.vocab)
    # 2. Price every draft token (the acceptance model), then choose one width for the forward: within it a row's
    # extra draft tokens cost nothing more.
    p = policy.p_kept(fulls, rows.active)
    n = policy.choose(fulls, p, room=[rows.room(b) for b in rows.active]) - 1
    drafts = [policy.fit(full, n, limit, forward.draft_kind) for full, limit in zip(fulls, limits)]
    stats.proposer_s += time.perf_counter() - t

    # 3. Verify: one forward over [last token, draft] for every row; acceptance per row.
    t = time.perf_counter()
    rows.reserve(max(rows.cur[b] + len(d) + 1 for b, d in zip(rows.active, drafts)))
    verified = forward.verify(rows, drafts)
    verify_s = time.perf_counter() - t
    kept = [v.kept for v in verified]
    # 4. Roll back: the cache keeps each row's last token and accepted drafts only.
    forward.rollback(kept)
    stats.model_s += time.perf_counter() - t

    # 5. Commit and stop; each drafter gets the committed tokens.
    width, active = 1 + max(len(d) for d in drafts), list(rows.active)
    alive = _commit_and_feed(rows, verified, drafters, stops, stats, streamer, record)

    # 6. Learn: acceptance from the whole proposals (even unverified ones), cost from this forward.
    t = time.perf_counter()
    emitted = [v.emitted.cpu().numpy() for v in verified]
    stats.observe_rows([len(d) for d in drafts], kept, trees=sum(d.parents is not None for d in drafts),
                       off_chain=sum(d.parents is not None and k > 0 and e[0] != d.tokens[0]
                                     for d, k, e in zip(drafts, kept, emitted)))
    # Calibration: the probabilities the policy priced the sent chains with against the prefix kept. A tree is
    # scored on its chain (first branch) only: the model prices chains, and a kept side branch is no chain token.
    # Tokens a compiled forward padded past the full draft were priced 0 (p is 0 there).
    sent = [len(d.chain) for d in drafts]
    on_chain = [k if d.parents is None else kept_prefix(d.chain, e) for d, k, e in zip(drafts, kept, emitted)]
    if p.shape[1] < max(sent, default=0):
        p = np.pad(p, ((0, 0), (0, max(sent) - p.shape[1])))
    stats.reliability.observe_rows(p, sent, on_chain)
    policy.observe_rows(fulls, emitted, rows=active)
    if policy.cost is not None and forward.learns_cost:
        policy.cost.observe(len(active), width, verify_s)
    _drop_finished(rows, forward, alive)
    stats.proposer_s += time.perf_counter() - t


def _commit_and_feed(rows: Rows, verified: list[Verified], drafters, stops: Stops | None, stats: DecodeStats,
                     streamer, record: Recorded | None) -> list[int]:
    """`commit` (timed as commit_s), then each row's drafter gets its committed tokens (already on the host,
    verify.accept_*; timed as proposer_s). Returns the indices into the active rows of those that go on."""
    t, active = time.perf_counter(), list(rows.active)
    alive, committed = commit(rows, verified, stops, streamer, record)
    stats.commit_s += time.perf_counter() - t
    t = time.perf_counter()
    for b, tokens in zip(active, committed):
        drafters[b].extend(tokens)
    stats.proposer_s += time.perf_counter() - t
    return alive


def _drop_finished(rows: Rows, forward: Forward, alive: list[int]) -> None:
    """Only the active rows at indices `alive` go on; the forward drops the others (unless none is left)."""
    if len(alive) < len(rows.active):
        rows.active = [rows.active[i] for i in alive]
        if alive:
            forward.keep_rows(alive)


@torch.inference_mode()
def decode(rows: Rows, forward: Forward, drafters, policy, *, prompt_mask: torch.Tensor | None = None,
           stops: Stops | None = None, stats: DecodeStats | None = None, streamer=None, record: Recorded | None = None,
           adaptive: bool = True, costs=COSTS) -> torch.Tensor:
    """Decode every row of `rows` to its end; the same tokens as plain decoding (greedy) or the same
    distribution (sampling).

    forward: a `Forward` over an empty cache; drafters: one `Drafter` per row; policy: a `DraftPolicy`
    (its cost is measured here when adaptive and not given); prompt_mask: bool [B, P], the prompt tokens
    each drafter is fed (default: all); stops: the engine's stop rule (None: rows stop at max_length only).
    Returns long [B, P + new tokens of the longest row] (see Rows.result).
    """
    stats = stats if stats is not None else DecodeStats()
    t_start = time.perf_counter()
    P = rows.prompt_len
    mask = prompt_mask if prompt_mask is not None else torch.ones(rows.ids.shape[0], P, dtype=torch.bool)
    # Prefill: the prompts enter the cache; their last rows give each row's first token.
    verified = forward.prefill(rows)
    # Calibrate only when a step can follow the prefill's token (max_new_tokens >= 2): never time what is not needed.
    if adaptive and policy.k > 0 and policy.cost is None and any(rows.room(b) >= 1 for b in rows.active):
        policy.cost = forward.calibrate(rows, costs, policy.k)
    for b in rows.active:
        drafters[b].extend(rows.ids[b, :P][mask[b].to(rows.ids.device)])
    stats.prefill_s += time.perf_counter() - t_start
    _drop_finished(rows, forward, _commit_and_feed(rows, verified, drafters, stops, stats, streamer, record))

    row_steps = [0] * rows.ids.shape[0]
    while rows.active:
        for b in rows.active:
            row_steps[b] += 1
        step(rows, forward, drafters, policy, stops, stats, streamer, record)
    if adaptive and forward.learns_cost:       # the refined curve outlives the process (cost.DiskCache)
        costs.save(forward.model, policy.cost)

    # Every field adds up, so one DecodeStats can collect several calls.
    stats.prompt_tokens += int(mask.sum())
    stats.new_tokens += sum(c - P for c in rows.cur)
    stats.row_steps.extend(row_steps)
    stats.total_s += time.perf_counter() - t_start
    return rows.result()
