"""A CPU simulation of how vLLM's v1 GPU model runner drives a `custom_class` drafter, with the model
replaced by known continuations (greedy: the target emits the accepted prefix of the draft, then the
true next token).

What it reproduces of vLLM (read from vllm/v1/worker/gpu_input_batch.py and gpu_model_runner.py):
* a persistent batch: `token_ids_cpu` int32 [max_num_reqs, max_model_len] and `num_tokens_no_spec`
  int [max_num_reqs]; a joining request takes the lowest free row and its prompt is written in whole;
* chunked prefill: while a prompt is only partly computed its row's sampled tokens are `[]`;
* bookkeeping before drafting: the tokens sampled this step are written into the row and
  `num_tokens_no_spec` advanced, then `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu,
  slot_mappings=...)` is called, positionally as the runner does;
* rows that move: finished requests leave at the next step and the batch is condensed (the last rows
  fill the holes); an unscheduled request leaves the batch and comes back later in another row;
  rows may be swapped (the runner reorders decode and prefill rows);
* the engine truncates a request's output at its max_tokens (here the end of its known continuation) and at
  max_model_len;
* the whole-batch skip (`_input_fits_in_drafter`, gpu_model_runner.py ~4288-4467): when any row's length + K
  exceeds max_model_len, propose is not called that step and every row is given K drafts of token id 0;
* preemption and recompute: a request leaves the batch for some steps, then comes back with its prompt and
  output in its row, prefills all of it again (in chunks: `[]` sampled) and samples one new token;
* sampled requests (`p_off`): vLLM keeps a point-mass draft token d with probability p_target(d)
  (v1/sample/rejection_sampler.py ~870-884) and draws the recovered token from p_target without d. Here
  p_target puts 1 - p_off on the request's known token and spreads p_off over the vocabulary; a token drawn off
  the known one replaces it in the request's continuation;
* a clock: each step takes step_seconds(tokens verified) of simulated time (`now`), for drafters that time steps;
* a trace: per step (prefill tokens computed, decode tokens verified, decode rows), so a replay can price the
  decode steps on its own step cost (benchmarks/vllm/modelled.py);
* with `ids=True`, what the runner shows a drafter that found it (vLLM 0.32/0.33): `input_batch.req_ids` (the
  request id of each row) and `requests` (id -> state with `num_prompt_tokens` and `sampling_params`: temperature,
  max_tokens, extra_args), a request leaving `requests` when it finishes (preempted and unscheduled ones stay);
  the runner calls the drafter's `load_model` as vLLM's does.
A test utility (tests/test_vllm.py, test_vllm_request_control.py); the vLLM benchmarks replay through it too. No vLLM
needed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from lookup_decode.core.draft import kept_prefix


@dataclass
class SimRequest:
    prompt: np.ndarray                 # int32 [P]
    truth: np.ndarray                  # int32 [n]: what the target emits (greedy), n >= 1
    chunk: int = 1 << 30               # prefill tokens per step (chunked prefill)
    prefilled: int = 0
    out: list = field(default_factory=list)         # tokens emitted so far
    drafts: list = field(default_factory=list)      # the draft returned at each propose (after the first token)
    emitted: list = field(default_factory=list)     # tokens emitted per decode step
    draft: list = field(default_factory=list)       # the pending draft, verified at the next step
    to_prefill: int = -1                            # tokens the next prefill computes (-1: the prompt)
    id: str | None = None                           # vLLM's request id (SimRunner(ids=True) names it if None)
    extra_args: dict | None = None                  # its SamplingParams.extra_args

    @property
    def done(self) -> bool:
        return len(self.out) >= len(self.truth)


class SimRunner:
    """Drives `drafter.propose` over a persistent batch; `run(requests)` returns when all are done."""

    def __init__(self, drafter, max_num_reqs: int = 16, max_model_len: int = 4096, *, seed: int = 0,
                 p_unscheduled: float = 0.0, p_swap: float = 0.0, arrivals_per_step: int | None = None,
                 on_step=None, k: int = 8, p_preempt: float = 0.0, preempt_steps: int = 20, p_off: float = 0.0,
                 vocab: int = 64, step_seconds=None, ids: bool = False):
        self.drafter = drafter
        self.max_model_len = max_model_len
        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), np.int32)
        self.num_tokens_no_spec = np.zeros(max_num_reqs, np.int32)   # (int32 as vLLM's)
        self.rows: list[SimRequest | None] = [None] * max_num_reqs
        self.rng = np.random.default_rng(seed)
        self.p_unscheduled, self.p_swap = p_unscheduled, p_swap
        self.arrivals_per_step = arrivals_per_step
        self.on_step = on_step                  # called after every propose (tests check bounds there)
        self.steps = 0
        self.k, self.p_preempt, self.preempt_steps = k, p_preempt, preempt_steps
        self.p_off, self.vocab = p_off, vocab
        self.step_seconds = step_seconds        # tokens verified in a step -> its seconds (None: no clock)
        self.now = 0.0
        self.skipped = self.preempted = self.proposes = 0
        self.trace: list[tuple[int, int, int]] = []    # per step: (prefill tokens, decode tokens verified, decode rows)
        # What vLLM's runner holds and the drafter reads once load_model found it (None: not shown).
        self.requests: dict | None = {} if ids else None
        self.input_batch = SimpleNamespace(req_ids=[]) if ids else None
        self.joined = 0
        if ids:
            self.load_model()

    def load_model(self) -> None:
        """As vLLM's runner: hand the drafter the model (none here) from a method of the runner."""
        self.drafter.load_model(None)

    def _add(self, req: SimRequest) -> bool:
        free = [i for i, r in enumerate(self.rows) if r is None]
        if not free:
            return False
        i = free[0]
        if self.requests is not None and req.id not in self.requests:
            req.id = req.id if req.id is not None else f"req-{self.joined}"
            self.joined += 1
            self.requests[req.id] = SimpleNamespace(num_prompt_tokens=len(req.prompt), sampling_params=SimpleNamespace(
                temperature=1.0 if self.p_off else 0.0, max_tokens=len(req.truth), extra_args=req.extra_args))
        row = np.concatenate([req.prompt, np.asarray(req.out, np.int32)])
        self.token_ids_cpu[i, : len(row)] = row
        self.num_tokens_no_spec[i] = len(row)
        self.rows[i] = req
        return True

    def _condense(self) -> None:
        """vLLM's InputBatch.condense: move the last occupied rows into the holes."""
        while True:
            holes = [i for i, r in enumerate(self.rows) if r is None]
            used = [i for i, r in enumerate(self.rows) if r is not None]
            if not holes or not used or holes[0] > used[-1]:
                return
            h, u = holes[0], used[-1]
            self.token_ids_cpu[h] = self.token_ids_cpu[u]
            self.num_tokens_no_spec[h] = self.num_tokens_no_spec[u]
            self.rows[h], self.rows[u] = self.rows[u], None

    def _swap(self, a: int, b: int) -> None:
        self.token_ids_cpu[[a, b]] = self.token_ids_cpu[[b, a]]
        self.num_tokens_no_spec[[a, b]] = self.num_tokens_no_spec[[b, a]]
        self.rows[a], self.rows[b] = self.rows[b], self.rows[a]

    def clock(self) -> float:
        return self.now

    def _finished(self, i: int, r: SimRequest) -> bool:
        return r.done or int(self.num_tokens_no_spec[i]) >= self.max_model_len

    def _verify(self, r: SimRequest) -> list[int]:
        """The tokens the engine emits for r's pending draft: greedy, or point-mass rejection sampling."""
        future = r.truth[len(r.out):]
        if self.p_off == 0:
            kept = kept_prefix(np.asarray(r.draft, np.int32), future)
            return [int(t) for t in future[: kept + 1]]
        new = []
        for j in range(min(len(r.draft), len(future) - 1) + 1):
            p = np.full(self.vocab, self.p_off / self.vocab)
            p[int(future[j])] += 1 - self.p_off
            d = r.draft[j] if j < len(r.draft) else None
            if d is not None and self.rng.random() < p[d]:
                new.append(int(d))                              # accepted
            else:
                if d is not None:
                    p[d] = 0.0                                  # recovered: p_target without the draft token
                new.append(int(self.rng.choice(self.vocab, p=p / p.sum())))
            if new[-1] != int(future[j]):
                r.truth = r.truth.copy()
                r.truth[len(r.out) + j] = new[-1]               # the sampled path replaces the known token
            if d is None or new[-1] != d:
                break
        return new

    def run(self, requests: list[SimRequest]) -> None:
        waiting = list(requests)
        away: list[SimRequest] = []             # unscheduled for a step; rejoin next step
        preempted: list[list] = []              # [steps left, request]
        while waiting or away or preempted or any(r is not None for r in self.rows):
            self.steps += 1
            # 1. Finished requests leave; unscheduled ones leave for this step; the batch is condensed.
            for i, r in enumerate(self.rows):
                if r is not None and self._finished(i, r):
                    self.rows[i] = None
                    if self.requests is not None:
                        del self.requests[r.id]
            back, away = away, []
            for i, r in enumerate(self.rows):
                if r is None or r.prefilled < max(r.to_prefill, len(r.prompt)):
                    continue
                if self.rng.random() < self.p_preempt:          # preempted: its KV cache is freed, recomputed later
                    self.rows[i] = None
                    r.to_prefill, r.prefilled, r.draft = len(r.prompt) + len(r.out), 0, []
                    preempted.append([self.preempt_steps, r])
                    self.preempted += 1
                elif self.rng.random() < self.p_unscheduled:
                    self.rows[i] = None
                    away.append(r)
            for entry in preempted:
                entry[0] -= 1
            back += [r for n, r in preempted if n <= 0]
            preempted = [e for e in preempted if e[0] > 0]
            self._condense()
            # 2. Returning, then new requests join (lowest free rows).
            for r in back:
                if not self._add(r):
                    away.append(r)
            joined = 0
            while waiting and (self.arrivals_per_step is None or joined < self.arrivals_per_step):
                if not self._add(waiting[0]):
                    break
                waiting.pop(0)
                joined += 1
            used = [i for i, r in enumerate(self.rows) if r is not None]
            if len(used) >= 2 and self.rng.random() < self.p_swap:
                a, b = self.rng.choice(used, size=2, replace=False)
                self._swap(int(a), int(b))
            # 3. The forward: prefill chunks, or verify each row's pending draft against its truth.
            B = max(used) + 1 if used else 0
            sampled: list[list[int]] = [[] for _ in range(B)]
            verified = prefill = decode_rows = 0
            for i in used:
                r = self.rows[i]
                target = max(r.to_prefill, len(r.prompt))
                if r.prefilled < target:
                    verified += min(target - r.prefilled, r.chunk)
                    prefill += min(target - r.prefilled, r.chunk)
                    r.prefilled = min(target, r.prefilled + r.chunk)
                    if r.prefilled < target:
                        continue                                 # partial prefill: nothing sampled
                    new = [int(r.truth[len(r.out)])]
                else:
                    verified += 1 + len(r.draft)
                    decode_rows += 1
                    new = self._verify(r)
                    r.emitted.append(len(new))
                new = new[: len(r.truth) - len(r.out)]          # the engine stops at max_tokens
                c = int(self.num_tokens_no_spec[i])
                self.token_ids_cpu[i, c: c + len(new)] = new
                self.num_tokens_no_spec[i] = c + len(new)
                r.out.extend(new)
                sampled[i] = new
            if B:
                self.trace.append((prefill, verified - prefill, decode_rows))
            if self.step_seconds is not None:
                self.now += self.step_seconds(verified)
            # 4. Draft for the next step, unless a row is within k tokens of max_model_len: then vLLM skips the
            # drafter for the whole batch and schedules k drafts of token 0 for every row.
            fits = all(int(self.num_tokens_no_spec[i]) + self.k <= self.max_model_len for i in used)
            if B and not fits:
                self.skipped += 1
                for i in used:
                    r = self.rows[i]
                    room = self.max_model_len - int(self.num_tokens_no_spec[i]) - 1
                    r.draft = [0] * max(min(self.k, room), 0) if sampled[i] else []
            elif B:
                self.proposes += 1
                if self.input_batch is not None:
                    # (vLLM's runner keeps one list and updates it in place)
                    self.input_batch.req_ids[:] = [r.id if r is not None else None for r in self.rows[:B]]
                drafts = self.drafter.propose(sampled, self.num_tokens_no_spec, self.token_ids_cpu, slot_mappings=None)
                assert len(drafts) == B
                for i in used:
                    r = self.rows[i]
                    if sampled[i]:
                        assert len(drafts[i]) <= self.k, "a draft longer than num_speculative_tokens"
                        r.draft = list(drafts[i])
                        r.drafts.append(r.draft)
                    else:
                        assert drafts[i] == [], "a row without sampled tokens got a draft"
            if self.on_step is not None:
                self.on_step(self)
        # The next engine step: the finished requests are gone from the batch.
        self.drafter.propose([], self.num_tokens_no_spec, self.token_ids_cpu, slot_mappings=None)
