"""lookup_decode as a vLLM drafter: `speculative_config={"method": "custom_class", "model":
"lookup_decode.vllm.LookupDrafter", "num_speculative_tokens": K}`.

vLLM's model runner builds the class with the engine's `vllm_config`, calls `load_model(model)`, and after
every step `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)`: the persistent
batch as a token matrix (row i holds its request's prompt and committed tokens, `token_ids_cpu[i,
:num_tokens_no_spec[i]]`, this step's sampled tokens already written in) and per row the tokens this step
emitted (`[]`: a partial prefill). It wants one draft per row, ragged (`[]` for none), at most K tokens, and it
runs the call inside every step, serially: its time is every step's time.

So one call does, for all rows at once:
1. find each row's request (`requests.RequestTable`, by content: vLLM passes no request ids);
2. in one compiled call (`core.pool.IndexPool.step`): learn from what the engine kept of each row's last draft,
   extend its index by the new tokens, draft from the request itself and the shared corpora (session memory,
   reference documents: the longest match wins, as in `generate`), and price each draft token by its
   probability of being kept;
3. choose how many tokens of each draft to send (`StepCost.choose`): those that pay for their place in
   the step, the cost of a token being learned from the time between calls (`step_cost.StepCost`), since vLLM calls
   once per step;
4. keep the memory of outputs (`sources.memory.Memory`, on unless `memory: false`): a request's output enters it
   as soon as the request finishes: in the call whose row emitted EOS, or (finished at max_tokens, stopped by a
   string, preempted, aborted) in the first call its row is absent, before this call's drafts are made, so the
   other rows draft from it at once. A request seen again after its output was stored (preempted, or unscheduled
   for a step) stores its whole output later, and that entry replaces the shorter one (`Memory.store`).
5. retire requests absent for `idle_steps` steps and keep the indexes within `max_index_bytes`.

A daemon thread (`_keeper`, started by the first call) keeps the slow work off the engine's step: it evicts from
the memory before a store finds it full (`Memory.evict_aside`: the O(bound) index rebuild outside the lock), and
with `memory_save` it writes the memory (a snapshot) within `save_seconds` of an output entering it, and when the
engine has made no call for IDLE_SECONDS it stores the outputs of the requests still known (the last request of a
burst leaves no later call to notice it): vLLM force-kills its worker at shutdown, so nothing may wait for the
exit. It shares one lock with `propose`, held only for bookkeeping.

Failures never stop the engine: an exception inside a call is logged once, that step drafts nothing, and the
drafter starts afresh. Settings: `settings.Settings`. Nothing here imports vLLM at module level.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import logging
import os
import sys
import threading
import time
import weakref
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lookup_decode.core.index import SuffixIndex
from lookup_decode.core.pool import IndexPool
from lookup_decode.core.stats import Calibration
from lookup_decode.core.step_cost import StepCost
from lookup_decode.core.tokens import eos_ids
from lookup_decode.engines.vllm import cpu_fix, request_args
from lookup_decode.engines.vllm.request_args import RequestArgs, parse
from lookup_decode.engines.vllm.requests import RequestTable, fingerprints  # noqa: F401  (fingerprints: documented)
from lookup_decode.engines.vllm.settings import ENV_PREFIX, Settings, replica_path  # noqa: F401
from lookup_decode.sources.memory import Memory, References, load_memory, load_references, prediction_of
from lookup_decode.sources.proposer import MEMORY, PREDICTION, REFERENCES, REQUEST

log = logging.getLogger("lookup_decode.vllm")
SOURCES = (REQUEST, MEMORY, REFERENCES, PREDICTION)   # a draft's source: 0 the request, 1 + the pool's corpus role
IDLE_SECONDS = 1.0      # no propose call for this long: the engine is idle, its known requests' outputs are stored
KNOWN_VLLM = ("0.32.", "0.33.")     # versions whose runner's request ids and states were read (`_find_runner`)
REQUESTS_KEPT = 4096    # per-request counters kept for this many requests (the most recent)


@dataclass
class RequestStats:
    """One request's counters, by vLLM's request id (`DrafterStats.request`)."""
    drafted: int = 0                   # draft tokens sent
    accepted: int = 0                  # of those, kept by the engine (vLLM's num_accepted_draft_tokens)
    sources: Counter = field(default_factory=Counter)   # accepted draft tokens per source


@dataclass
class DrafterStats:
    """Counters of one LookupDrafter (sums since construction)."""
    steps: int = 0                     # propose() calls
    rows: int = 0                      # rows that asked for a draft (non-empty sampled tokens)
    drafted: int = 0                   # draft tokens returned
    accepted: int = 0                  # of the full proposals, tokens the engine then emitted (kept)
    built: int = 0                     # requests indexed from their whole row (new, or dropped before)
    extended: int = 0                  # rows recognised and extended by their new tokens only
    continued: int = 0                 # rows whose request had missed steps (vLLM skipped the drafter)
    resumed: int = 0                   # rebuilt requests whose prompt length came back (preempted and recomputed)
    rebuilt: int = 0                   # requests indexed afresh though known before (by id: retired, then back)
    identity: str = "content"          # how rows are followed: "runner" (vLLM's request ids) or "content"
    ignored: int = 0                   # requests whose lookup_decode settings were bad (logged; those ignored)
    retired: int = 0                   # requests dropped after idle_steps absent
    evicted: int = 0                   # requests dropped for the byte bound
    refused: int = 0                   # rows left without an index for the byte bound
    stored: int = 0                    # outputs stored into the memory (a request stored twice counts twice)
    saves: int = 0                     # writes of memory_save
    errors: int = 0                    # calls that failed (logged once; those steps drafted nothing)
    propose_s: float = 0.0             # time inside propose
    propose_max_s: float = 0.0         # the slowest propose call after the first
    first_propose_s: float = 0.0       # the first call (it loads or compiles the kernels: seconds)
    sources: Counter = field(default_factory=Counter)   # accepted draft tokens per source
    reliability: Calibration = field(default_factory=Calibration)   # predicted vs kept of the tokens sent
    requests: OrderedDict = field(default_factory=OrderedDict)      # request id -> RequestStats (by id only)

    def request(self, request_id: str) -> RequestStats | None:
        """The counters of one request (None: not followed by id, or among the oldest forgotten). vLLM's engine
        adds a suffix to the id a client gave ("7" runs as "7-1a2b3c4d"): either finds it (the latest such)."""
        found = self.requests.get(request_id)
        if found is None:
            for key in reversed(self.requests):
                if key.rpartition("-")[0] == request_id:
                    return self.requests[key]
        return found

    def _new_request(self, request_id: str) -> RequestStats:
        out = self.requests[request_id] = RequestStats()
        if len(self.requests) > REQUESTS_KEPT:
            self.requests.popitem(last=False)
        return out

    def calibration(self) -> list:
        """The acceptance model's reliability table: rows (bin_low, bin_high, tokens, predicted, kept)."""
        return self.reliability.rows()

    def summary(self) -> str:
        """One line of counts (accepted per source, ms per call: mean and worst), then the calibration line."""
        share = f" ({100 * self.accepted / self.drafted:.0f}%)" if self.drafted else ""
        by_source = ", ".join(f"{name} {self.sources.get(name, 0)}" for name in SOURCES)
        mean_ms = 1e3 * self.propose_s / max(self.steps, 1)
        return (f"{self.steps} steps, {self.rows} row-steps, drafted {self.drafted}, accepted {self.accepted}{share} "
                f"(by source: {by_source}); stored {self.stored} outputs, {self.errors} errors; propose "
                f"{mean_ms:.2f} ms per step, worst {1e3 * self.propose_max_s:.1f} ms (the first call: "
                f"{1e3 * self.first_propose_s:.0f} ms)\n{self.reliability.summary()}")


def _numpy(array) -> np.ndarray:
    return array.numpy() if hasattr(array, "numpy") else np.asarray(array)


def _vocab_size(vllm_config) -> int | None:
    """The engine model's vocabulary size, when the config tells it (a test's SimpleNamespace may not)."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:
        return None
    if callable(getattr(model_config, "get_vocab_size", None)):
        return int(model_config.get_vocab_size())
    for attr in ("hf_text_config", "hf_config"):
        size = getattr(getattr(model_config, attr, None), "vocab_size", None)
        if size is not None:
            return int(size)
    return None


def _ranks(vllm_config) -> tuple[int, int, int]:
    """(tensor-parallel rank, data-parallel rank, data-parallel size) of this drafter's worker."""
    parallel = getattr(vllm_config, "parallel_config", None)
    dp_rank = int(getattr(parallel, "data_parallel_rank", 0) or 0)
    dp_size = int(getattr(parallel, "data_parallel_size", 1) or 1)
    try:
        from vllm.distributed import get_tensor_model_parallel_rank
        tp_rank = int(get_tensor_model_parallel_rank())
    except Exception:                                   # noqa: BLE001  (no process group: one rank)
        tp_rank = 0
    return tp_rank, dp_rank, dp_size


def _memory_files(value: str | None) -> list[str]:
    """The memory files of a setting: os.pathsep-separated paths, glob patterns expanded (sorted)."""
    files = []
    for p in (value or "").split(os.pathsep):
        if p:
            files += sorted(glob.glob(p)) if glob.has_magic(p) else [p]
    return files


class LookupDrafter:
    """vLLM `custom_class` drafter: lookup_decode's drafts for every row of vLLM's persistent batch.

    Constructed by vLLM as `LookupDrafter(vllm_config)`. Tests and benchmarks may build one with
    `LookupDrafter.from_settings(settings, k, ...)`.
    """

    def __init__(self, vllm_config):
        spec = getattr(vllm_config, "speculative_config", None)
        if spec is None or getattr(spec, "num_speculative_tokens", None) is None:
            raise ValueError("LookupDrafter needs vllm_config.speculative_config.num_speculative_tokens")
        model_config = getattr(vllm_config, "model_config", None)
        settings = Settings.from_sources(getattr(vllm_config, "additional_config", None))
        eos = settings.eos if settings.eos is not None else eos_ids(getattr(model_config, "hf_config", None))
        tp_rank, dp_rank, dp_size = _ranks(vllm_config)
        device = getattr(getattr(vllm_config, "device_config", None), "device_type", None) or "cpu"
        self._setup(settings, spec.num_speculative_tokens, getattr(model_config, "max_model_len", None),
                    _vocab_size(vllm_config), eos, tokenizer_name=getattr(model_config, "tokenizer", None),
                    saves=tp_rank == 0, replica=(dp_rank, dp_size), device=device)
        # vLLM settles its CUDA graph sizes when it captures them, after building the drafter: read at the first step.
        self._graphs = getattr(vllm_config, "compilation_config", None) if device != "cpu" else None
        self._budget = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", None)
        # A request's text prediction is tokenized inside an engine step: the tokenizer is loaded now, not there.
        # One that cannot be loaded leaves text predictions unread (each such request says so), never the engine.
        if self._tokenizer_name is not None and self.tokenizer is None:
            try:
                self._tokenizer()
            except Exception as e:                  # noqa: BLE001
                log.warning("lookup_decode: the engine's tokenizer could not be loaded (%s): requests' text "
                            "predictions are ignored (token ids still work)", e)
                self._tokenizer_name = None
        # vLLM's CPU build samples draft positions from a wrong distribution (cpu_fix's docstring); with drafts
        # sent, that would make sampled requests worse than without them.
        cpu_fix.apply()
        _show_info_logs()

    @classmethod
    def from_settings(cls, settings: Settings, num_speculative_tokens: int, *, max_model_len: int | None = None,
                      vocab_size: int | None = None, eos_token_ids=(), memory: Memory | None = None,
                      references: References | None = None, tokenizer=None, device: str = "cpu") -> "LookupDrafter":
        """A drafter without a vLLM config (tests, benchmarks); memory/references objects may be passed
        directly instead of files."""
        self = cls.__new__(cls)
        self._setup(settings, num_speculative_tokens, max_model_len, vocab_size, tuple(eos_token_ids),
                    memory=memory, references=references, tokenizer=tokenizer, device=device)
        return self

    def _setup(self, settings: Settings, num_speculative_tokens, max_model_len, vocab_size, eos, *, memory=None,
               references=None, tokenizer=None, tokenizer_name=None, saves: bool = True,
               replica: tuple[int, int] = (0, 1), device: str = "cpu") -> None:
        if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, (int, np.integer)) \
                or num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be an int >= 1 for lookup_decode's drafter, "
                             f"got {num_speculative_tokens!r}")
        self.settings = settings
        self.k = min(int(num_speculative_tokens), settings.k) if settings.k is not None else int(num_speculative_tokens)
        if self.k < 1:
            raise ValueError(f"{ENV_PREFIX}K must be >= 1, got {settings.k}")
        self.max_model_len = max_model_len
        self.eos = tuple(int(e) for e in eos)
        self.vocab_size = vocab_size
        # Tensor-parallel ranks hold the same memory: one writes it. Data-parallel replicas write their own files.
        self.saves = saves
        self.memory_save = replica_path(settings.memory_save, *replica)
        self.tokenizer, self._tokenizer_name = tokenizer, tokenizer_name
        self.memory = memory if memory is not None else self._load_memory()
        self.references = references if references is not None else self._load_references()
        self.corpora = [c for c in (self.memory, self.references) if c is not None]
        for corpus in self.corpora:                 # a foreign memory file fails here, not while serving
            if vocab_size is not None:
                corpus.check_vocab(vocab_size, "the engine's model")
        # Memory scopes (a request's lookup_decode_scope): each its own memory, the least recently used going
        # first past max_scopes. The default scope is self.memory.
        self.scopes: OrderedDict[str, Memory] = OrderedDict()
        self._runner = None                         # vLLM's model runner, weakly (found by load_model)
        self.cost = StepCost.for_device(device, prior_token_cost=settings.draft_cost)
        self._graphs = None                         # the engine's compilation_config until its graph sizes are read
        self._budget = None                         # the scheduler's token budget per step (None: unknown)
        self._retire_every = max(1, settings.idle_steps // 4)
        self.clock = time.perf_counter              # what step times are read from (a simulation sets its own)
        self.stats = DrafterStats()
        self._lock = threading.RLock()              # propose and the keeper thread
        self._unsaved = 0
        self._saved_at = time.monotonic()           # the last write of memory_save (or the start)
        self._called_at = time.monotonic()          # the last propose call
        self._idle_stored = True                    # the keeper stored the known requests since the last call
        self._keeper: threading.Thread | None = None
        self._wake = threading.Event()              # save_every outputs are waiting: the keeper writes now
        self._logged = False
        self._p_sent = np.zeros((64, self.k))       # per slot: the probabilities its last sent draft was priced at
        self._fresh()
        if self._persists:
            atexit.register(_flush_at_exit, weakref.ref(self))

    def _fresh(self) -> None:
        """No request known (at start, and after a failed call: the table may be half updated)."""
        # New requests start from the acceptance this engine's requests showed lately: a chat server's first drafts
        # are then priced as chat, a code-edit job's as code edits.
        self.pool = IndexPool(self.k, min_match=self.settings.min_match, max_match=self.settings.max_match,
                              eos_token_ids=self.eos)
        # A step the drafter missed added one token per row (vLLM then schedules zeros as drafts, rarely kept);
        # a few such steps in a row are followed, anything longer is another request.
        self.requests = RequestTable(self.pool, max_gap=4 * (self.k + 1), eos_token_ids=self.eos)
        self._own: dict[int, tuple] = {}            # slot -> (its scope's memory, its prediction) where not default
        self._req_stats: dict[int, RequestStats] = {}   # slot -> its request's counters (by id only)
        self._call = 0
        self._last = None                           # when the last call started

    # -- the vLLM contract ----------------------------------------------------------------------------
    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]:
        """One draft per row of the batch (list of int, [] for none).

        sampled_token_ids: list[list[int]], the tokens each row emitted this step ([]: a partial prefill,
            no draft). num_tokens_no_spec: int [>= rows], committed tokens per row (numpy or torch).
        token_ids_cpu: int [>= rows, max_model_len] (numpy or torch), row i's tokens in its first
            num_tokens_no_spec[i] columns. slot_mappings: unused (no model).
        """
        with self._lock:
            start, t = self.clock(), time.perf_counter()
            try:
                return self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, start)
            except Exception:                       # noqa: BLE001  (a drafter failure must never stop the engine)
                self.stats.errors += 1
                if not self._logged:
                    log.exception("lookup_decode: the drafter failed; this step drafts nothing and the drafter "
                                  "starts afresh (later failures are only counted: drafter.stats.errors)")
                    self._logged = True
                self._fresh()
                return [[] for _ in sampled_token_ids]
            finally:
                took = time.perf_counter() - t
                self.stats.propose_s += took
                if self.stats.steps <= 1:
                    self.stats.first_propose_s = took
                else:
                    self.stats.propose_max_s = max(self.stats.propose_max_s, took)
                self._called_at, self._idle_stored = time.monotonic(), False
                if self._keeper is None and self.memory is not None:
                    self._start_keeper()

    def load_model(self, *args, **kwargs) -> None:
        """vLLM calls this with the target model after building the drafter; there is no model to load. Its caller
        is the model runner (GPUModelRunner.load_model, and CPUModelRunner's), whose request ids and request
        states the drafter reads from then on (`_find_runner`)."""
        runner = _find_runner(sys._getframe(1))
        self._runner = weakref.ref(runner) if runner is not None else None
        self.stats.identity = "runner" if runner is not None else "content"
        version = _vllm_version()
        if runner is None or not version.startswith(KNOWN_VLLM):
            log.info("lookup_decode: vLLM %s: rows are followed %s", version or "(unknown version)",
                     "by vLLM's request ids (per-request settings read)" if runner is not None else
                     "by content (the runner's request ids were not found: no per-request settings, and memory "
                     "scopes are not told apart; set the memory off where tenants must not share it)")

    def _propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, now: float) -> list[list[int]]:
        self._call += 1
        self.stats.steps += 1
        B = len(sampled_token_ids)
        matrix = _numpy(token_ids_cpu)
        if matrix.dtype != np.int32 or not matrix.flags.c_contiguous:
            matrix = np.ascontiguousarray(matrix, np.int32)
        counts = _numpy(num_tokens_no_spec)[:B].astype(np.int64)
        emitted = np.fromiter(map(len, sampled_token_ids), np.int64, count=B)
        rows = np.flatnonzero(emitted > 0)
        if self.max_model_len is not None:
            rows = rows[counts[rows] < self.max_model_len]
        runner = self._runner() if self._runner is not None else None
        if runner is None:
            claim = self.requests.claim(matrix, rows, counts[rows], emitted[rows], self._call, self._admit)
        else:
            claim = self._claim_ids(runner, rows, counts[rows], emitted[rows])
        if self._graphs is not None:
            self._read_graph_sizes()
        if self._last is not None and claim.continued == 0 and len(rows):
            # A step right after the previous call: its time is that step's cost. It verified each row's token and
            # the draft it was sent (rows that finished before it are not here), beside the prompt chunks of rows
            # still prefilling (no token yet) and of rows whose prefill ended in it (fresh slots).
            verified = len(rows) + int(self.requests.sent[claim.slots[claim.slots >= 0]].sum())
            prefill = int(counts[emitted == 0].sum()) + int((counts[rows][claim.starts == 0] - 1).sum())
            if self._budget is not None:            # chunked: a step's chunks fill at most the budget
                prefill = max(0, min(prefill, int(self._budget) - verified))
            self.cost.observe(verified, now - self._last, prefill_tokens=prefill)
        placed = self._within_bound(claim, counts[rows])
        if runner is not None:
            self._drop_finished(runner)
        if self.memory is not None:
            self._store_finished(matrix, rows[placed], claim.slots[placed], counts[rows][placed], runner is None)
        rows, slots = rows[placed], claim.slots[placed]
        ends = counts[rows]
        # A step emits its kept drafts and one more token: no draft goes past where the row ends.
        limits = np.minimum(np.minimum(self.requests.limit[slots], self.k), self.requests.end[slots] - ends - 1)
        if self.max_model_len is not None:
            limits = np.minimum(limits, self.max_model_len - ends - 1)
        corpora, row_corpora = self._corpora_of(slots)
        with contextlib.ExitStack() as held:        # the corpora stay unchanged while the pool reads them
            step = self.pool.step(matrix, rows, slots, claim.starts[placed], ends, np.maximum(limits, 0),
                                  claim.learn[placed], [held.enter_context(c.reading()) for c in corpora],
                                  temperatures=self.requests.temperature[slots], row_corpora=row_corpora)
        if runner is None:
            self.requests.file(matrix, rows, slots, ends, self._call)
        self._learned(step, slots)
        # Not adaptive: everything the index proposes, up to k (vLLM's n-gram rule).
        lengths = self.cost.choose(step.p_kept, step.lengths) if self.settings.adaptive else step.lengths
        drafts: list[list[int]] = [[] for _ in range(B)]
        if lengths.any():
            # One host list of every token sent, cut per row: vLLM wants list[list[int]].
            flat = step.tokens[np.arange(step.tokens.shape[1])[None, :] < lengths[:, None]].tolist()
            ends = np.cumsum(lengths)
            has = lengths > 0
            for i, a, b in zip(rows[has].tolist(), (ends - lengths)[has].tolist(), ends[has].tolist()):
                drafts[i] = flat[a:b]
        s = self.stats
        s.rows += len(rows)
        s.drafted += int(lengths.sum())
        s.built += claim.built
        s.continued += claim.continued
        s.resumed += claim.resumed
        s.rebuilt += claim.rebuilt
        s.extended += len(rows) - claim.built - claim.continued
        if self._req_stats:
            for slot, n in zip(slots[lengths > 0].tolist(), lengths[lengths > 0].tolist()):
                if slot in self._req_stats:
                    self._req_stats[slot].drafted += n
        s.refused += int((claim.slots < 0).sum())
        self.requests.sent[slots] = lengths
        if len(self._p_sent) < self.pool.slots:
            self._p_sent = np.concatenate([self._p_sent, np.zeros((self.pool.slots + 64 - len(self._p_sent), self.k))])
        self._p_sent[slots] = step.p_kept
        self._last = now
        if self._call % self._retire_every == 0:     # a bounded delay; the scan over live requests is O(requests)
            self._retire(self._call - self.settings.idle_steps, "retired", runner.requests if runner else None)
        if self.settings.reload_every and self._call % self.settings.reload_every == 0:
            self.reload_memory()
        return drafts

    # -- requests followed by vLLM's ids, and their settings ------------------------------------------
    def _claim_ids(self, runner, rows: np.ndarray, counts: np.ndarray, emitted: np.ndarray):
        """`RequestTable.claim_ids` with the runner's request ids and prompt lengths; a new request's settings
        (`request_args`) and sampling temperature are read from its state in the runner."""
        req_ids, states, known = runner.input_batch.req_ids, runner.requests, self.requests.ids
        ids = [req_ids[i] for i in rows.tolist()]
        prompts = np.array([-1 if rid in known else getattr(states.get(rid), "num_prompt_tokens", -1) for rid in ids],
                           np.int64)
        claim = self.requests.claim_ids(rows, counts, emitted, ids, prompts, self._call, self._admit)
        for j in claim.fresh:
            self._start_request(int(claim.slots[j]), ids[j], getattr(states.get(ids[j]), "sampling_params", None))
        return claim

    def _start_request(self, s: int, request_id: str, params) -> None:
        """Slot s now holds request `request_id`: its temperature, where it ends, its own k, its scope's memory, its
        prediction."""
        self._own.pop(s, None)                      # (a slot freed without `_drop` may have held one)
        self.requests.temperature[s] = float(getattr(params, "temperature", 0.0) or 0.0)
        # Drafts past max_tokens would be verified and then dropped from the output: none are sent.
        max_tokens, prompt = getattr(params, "max_tokens", None), int(self.requests.prompt_len[s])
        if isinstance(max_tokens, int) and prompt >= 0:
            self.requests.end[s] = prompt + max_tokens
        self._req_stats[s] = self.stats.requests.get(request_id) or self.stats._new_request(request_id)
        extra = getattr(params, "extra_args", None)
        try:
            args = parse(extra)
        except ValueError as e:
            self.stats.ignored += 1
            log.warning("lookup_decode: request %s: %s; its lookup_decode settings are ignored (install "
                        "lookup_decode in the server's environment and vLLM refuses such a request instead)",
                        request_id, e)
            # A scope that cannot be read must not fall back to the shared memory: no memory for this request.
            private = isinstance(extra, dict) and request_args.SCOPE in extra
            if private:
                self._own[s] = (None, None)
            return
        if args.k is not None:
            self.requests.limit[s] = args.k
        memory = self._scope_memory(args.scope) if args.scope is not None else self.memory
        prediction = self._prediction(request_id, args) if args.prediction is not None else None
        if memory is not self.memory or prediction is not None:
            self._own[s] = (memory, prediction)

    def _scope_memory(self, scope: str) -> Memory | None:
        """The memory of a named scope (made on first use); None when the drafter keeps no memory, or when
        max_scopes scopes are all in use by live requests (that request then drafts from no memory at all)."""
        if self.memory is None:
            return None
        memory = self.scopes.get(scope)
        if memory is None:
            if len(self.scopes) >= self.settings.max_scopes:
                in_use = {id(own[0]) for own in self._own.values()}
                idle = [name for name, m in self.scopes.items() if id(m) not in in_use]
                if not idle:
                    log.warning("lookup_decode: %d memory scopes are in use (max_scopes); scope %r drafts from "
                                "no memory", len(self.scopes), scope)
                    return None
                del self.scopes[idle[0]]            # the least recently used one
            memory = self.scopes[scope] = Memory(self.settings.scope_tokens, vocab_size=self.vocab_size)
        self.scopes.move_to_end(scope)
        return memory

    def _prediction(self, request_id: str, args: RequestArgs) -> References | None:
        """The request's prediction as a corpus of its own (None, logged, if it cannot be read)."""
        try:
            tokenizer = self._tokenizer() if isinstance(args.prediction, str) else None
            return prediction_of(args.prediction, tokenizer=tokenizer, vocab_size=self.vocab_size)
        except (ValueError, TypeError, OSError) as e:
            self.stats.ignored += 1
            log.warning("lookup_decode: request %s: %s %s; it drafts without it", request_id,
                        request_args.PREDICTION, e)
            return None

    def _tokenizer(self):
        """The engine's tokenizer (loaded once, on the first text that needs it)."""
        if self.tokenizer is None:
            if self._tokenizer_name is None:
                raise ValueError("a text needs the engine's tokenizer, which this drafter does not have (send "
                                 "token ids)")
            from transformers import AutoTokenizer
            self.tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_name)
        return self.tokenizer

    def _roles(self, s: int) -> tuple:
        """The corpora slot s drafts from, by the pool's roles: (memory, references, prediction), None where none."""
        memory, prediction = self._own.get(s, (self.memory, None))
        return memory, self.references, prediction

    def _corpora_of(self, slots: np.ndarray) -> tuple[list, np.ndarray]:
        """The distinct corpora of these slots and, per slot, the index of each of its roles' corpus (-1: none)."""
        corpora, where = [], {}
        rows = np.full((len(slots), 3), -1, np.int64)
        default = self._roles(-1)
        for c, corpus in enumerate(default):
            if corpus is not None:
                where[id(corpus)] = len(corpora)
                corpora.append(corpus)
                rows[:, c] = where[id(corpus)]
        for j in [j for j, s in enumerate(slots.tolist()) if s in self._own] if self._own else ():
            for c, corpus in enumerate(self._roles(int(slots[j]))):
                if corpus is None:
                    rows[j, c] = -1
                    continue
                if id(corpus) not in where:
                    where[id(corpus)] = len(corpora)
                    corpora.append(corpus)
                rows[j, c] = where[id(corpus)]
        return corpora, rows

    def _drop_finished(self, runner) -> None:
        """Requests the runner no longer knows have finished (preempted ones it keeps): store and drop them now."""
        states, id_of = runner.requests, self.requests.id_of
        for s in [s for s, rid in id_of.items() if rid not in states]:
            self._drop(s, "retired")

    def _read_graph_sizes(self) -> None:
        """The engine's CUDA graph sizes, once settled (a step runs padded to the next one): to the step cost."""
        cc, self._graphs = self._graphs, None
        mode = getattr(cc, "cudagraph_mode", None)
        if mode is not None and getattr(mode, "name", str(mode)) != "NONE":
            self.cost.use_capture_sizes(getattr(cc, "cudagraph_capture_sizes", None))

    def _learned(self, step, slots: np.ndarray) -> None:
        """What the engine kept of the last drafts: statistics, calibration, and credit to the corpus entries
        drafted from."""
        learned = step.kept >= 0
        if learned.any():               # of the tokens sent last call, priced at _p_sent: the prefix kept
            sl = slots[learned]
            sent = self.requests.sent[sl]
            self.stats.reliability.observe_rows(self._p_sent[sl], sent, np.minimum(step.kept[learned], sent))
        kept = np.maximum(step.kept, 0)
        self.stats.accepted += int(kept.sum())
        if not kept.any():
            return
        for src, n in enumerate(np.bincount(step.credit[:, 0].clip(0), weights=kept, minlength=len(SOURCES))):
            if n:
                self.stats.sources[SOURCES[src]] += int(n)
        # A request's own counters count what it was sent and kept (its `kept` may go past what was sent, when the
        # engine's next token happened to equal the proposal's next one).
        kept_sent = np.minimum(kept, self.requests.sent[slots])
        for i in np.flatnonzero(kept > 0).tolist():
            s, (src, version, position) = int(slots[i]), step.credit[i].tolist()
            if s in self._req_stats and kept_sent[i]:
                self._req_stats[s].accepted += int(kept_sent[i])
                self._req_stats[s].sources[SOURCES[src]] += int(kept_sent[i])
            if src > 0:
                self._roles(s)[src - 1].credit(version, position, int(kept[i]))

    # -- requests leaving -----------------------------------------------------------------------------
    def _admit(self, n_tokens: int) -> bool:
        """Whether a new index over n_tokens fits the byte bound, evicting requests not seen in this call."""
        need = SuffixIndex.bytes_for(n_tokens)
        if self.index_bytes + need > self.settings.max_index_bytes:
            for s in self.requests.idle(self._call - 1):
                self._drop(s, "evicted")
                if self.index_bytes + need <= self.settings.max_index_bytes:
                    break
        if self.index_bytes + need > self.settings.max_index_bytes:
            return False
        return True

    def _within_bound(self, claim, counts: np.ndarray) -> np.ndarray:
        """bool [r]: the rows whose index may take this call's tokens. Indexes that would grow past the byte bound
        make the requests not seen in this call go first (least recently seen first); if that is not enough, the
        growing requests themselves are dropped (the largest growth first): their rows draft nothing until an
        index fits again."""
        placed = claim.slots >= 0
        growth = np.zeros(len(placed), np.int64)
        growth[placed] = self.pool.growth(claim.slots[placed], counts[placed] - claim.starts[placed])
        bound = self.settings.max_index_bytes
        if self.index_bytes + int(growth.sum()) <= bound:
            return placed
        for s in self.requests.idle(self._call - 1):
            self._drop(s, "evicted")
            if self.index_bytes + growth.sum() <= bound:
                return placed
        for j in np.argsort(-growth, kind="stable"):
            if growth[j] == 0 or self.index_bytes + growth.sum() <= bound:
                break
            self._drop(int(claim.slots[j]), "evicted")
            placed[j], growth[j] = False, 0
        return placed

    def _retire(self, before: int, counter: str, waiting=None) -> None:
        """Drop the requests last seen at call `before` or earlier, but those whose id is in `waiting` (the runner's
        requests: preempted or unscheduled ones come back)."""
        for s in self.requests.idle(before):
            if waiting is None or self.requests.id_of.get(s) not in waiting:
                self._drop(s, counter)

    def _drop(self, s: int, counter: str) -> None:
        self._store_slot(s)                         # normally stored already, when the request finished
        self.requests.drop(s)
        self._own.pop(s, None)                      # its prediction is freed with it
        self._req_stats.pop(s, None)
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)

    # -- the memory of outputs ------------------------------------------------------------------------
    def _store_finished(self, matrix, rows, slots, counts, absent: bool) -> None:
        """Store the outputs of the requests that finished since the last call, before this call drafts: rows whose
        last token is EOS (their text is the row), and (absent: rows followed by content, where a finished request
        and one away from the batch look alike) known requests whose row is absent from this call."""
        if len(self.eos) and len(rows):
            ended = np.isin(matrix[rows, counts - 1], self.eos)
            for row, s, n in zip(rows[ended].tolist(), slots[ended].tolist(), counts[ended].tolist()):
                self._store(s, matrix[row, :n])
        if not absent:
            return
        r = self.requests
        live = np.fromiter(r.live, np.int64, count=len(r.live))
        gone = live[r.last_seen[live] < self._call]
        gone = gone[self.pool.length(gone) > r.stored[gone]]
        for s in gone.tolist():
            self._store_slot(s)

    def _store_slot(self, s: int) -> None:
        if self._roles(s)[0] is not None and int(self.pool.length([s])[0]) > self.requests.stored[s]:
            self._store(s, self.pool.tokens(s))

    def _store(self, s: int, tokens: np.ndarray) -> None:
        """Store request s's output (tokens: its whole text, prompt first) into its scope's memory, replacing what it
        stored before."""
        r = self.requests
        prompt = int(r.prompt_len[s])
        r.stored[s] = len(tokens)
        memory = self._roles(s)[0]
        if memory is None or prompt < 0 or len(tokens) <= prompt:
            return                                  # an unknown prompt length could store prompt as output
        key = memory.remember(tokens[:prompt], tokens[prompt:], replaces=r.keys.get(s))
        if key is not None:
            r.keys[s] = key
        self.stats.stored += 1
        if memory is not self.memory:
            return                                  # named scopes live in this process only (not saved)
        self._unsaved += 1
        if self._persists and self._unsaved >= self.settings.save_every:
            self._wake.set()                        # written by the keeper thread, off the engine's step

    @property
    def _persists(self) -> bool:
        return self.memory is not None and bool(self.memory_save) and self.saves

    def _start_keeper(self) -> None:
        self._keeper = threading.Thread(target=_keeper, args=(weakref.ref(self),), name="lookup_decode-memory",
                                        daemon=True)
        self._keeper.start()

    def _tick(self, now: float) -> None:
        """The keeper's turn: evict from a nearly full memory aside; with memory_save, store the known requests'
        outputs once the engine is idle, and write memory_save when outputs entered the memory and save_seconds
        passed since the last write (or save_every are waiting). The file is written from a snapshot, outside
        the lock: propose never waits for a disk."""
        with self._lock:
            scoped = list(self.scopes.values())
        for memory in [self.memory, *scoped]:
            memory.evict_aside()                    # takes the memory's lock only to choose and to swap
        if not self._persists:
            return
        with self._lock:
            if not self._idle_stored and now - self._called_at >= IDLE_SECONDS:
                for s in sorted(self.requests.live):
                    self._store_slot(s)
                self._idle_stored = True
            due = self._unsaved >= self.settings.save_every or now - self._saved_at >= self.settings.save_seconds
            if not (self._unsaved and due):
                return
            pending, snapshot = self._unsaved, self.memory.snapshot()
        self._write(snapshot, self.memory_save, pending)

    # -- memory and references ------------------------------------------------------------------------
    def _load_memory(self) -> Memory | None:
        """The memory to draft from: the files in settings.memory merged (memory_save may not exist yet; none: an
        empty memory), or None when the memory is off. Unreadable files raise here, when the engine builds the
        drafter."""
        s = self.settings
        if not s.has_memory:
            return None
        try:
            return load_memory(_memory_files(s.memory), max_tokens=s.memory_tokens, vocab_size=self.vocab_size,
                               missing_ok=[self.memory_save] if self.memory_save else [])
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{ENV_PREFIX}MEMORY: {e}") from None

    def _load_references(self) -> References | None:
        path = self.settings.references
        if not path:
            return None
        # Text files are tokenized with the engine's tokenizer.
        tokenizer = self._tokenizer() if Path(path).suffix != ".npz" and self._tokenizer_name is not None \
            else self.tokenizer
        try:
            return load_references(path, tokenizer=tokenizer, vocab_size=self.vocab_size)
        except (FileNotFoundError, ValueError) as e:
            raise type(e)(f"{ENV_PREFIX}REFERENCES: {e}") from None

    def flush(self) -> None:
        """Retire every request absent from the latest call (their outputs enter the memory), then save the memory
        if `memory_save` is set. For shutdown, and for benchmarks between turns."""
        self._retire(self._call - 1, "retired")
        if self.memory_save and self.memory is not None and self.saves:
            self.save_memory()

    def save_memory(self, path=None) -> None:
        """Write the memory to `path` (default: the memory_save setting) for other replicas to load."""
        path = path if path is not None else self.memory_save
        if self.memory is None or path is None:
            raise ValueError(f"no memory to save ({ENV_PREFIX}MEMORY is false)" if self.memory is None
                             else "save_memory needs a path")
        with self._lock:
            self._write(self.memory, path, self._unsaved)

    def _write(self, memory: Memory, path, pending: int) -> None:
        """Save `memory` (this drafter's, or a snapshot of it) to path; `pending` stored outputs are then saved."""
        memory.save(path)
        with self._lock:
            self._unsaved -= min(pending, self._unsaved)
            self._saved_at = time.monotonic()
            self.stats.saves += 1
            # What a user reads in the server's log: the memory written, and what the drafter did so far.
            log.info("lookup_decode: memory saved to %s (%d outputs, %d tokens); %s", path, len(memory),
                     memory.n_tokens, self.stats.summary())

    def reload_memory(self) -> int:
        """Add the entries of the memory files (settings.memory) that this memory lacks; returns how many.
        Files are whole (written by atomic replace), so a replica never reads one half-written."""
        if self.memory is None:
            return 0
        paths = [p for p in _memory_files(self.settings.memory) if Path(p).is_file()]
        return self.memory.merge(load_memory(paths, max_tokens=self.settings.memory_tokens, vocab_size=self.vocab_size))

    @property
    def live_requests(self) -> int:
        return len(self.requests.live)

    @property
    def retire_within(self) -> int:
        """A request's state is dropped within this many calls of its last row (idle_steps + the retirement
        scan's period)."""
        return self.settings.idle_steps + self._retire_every

    @property
    def index_bytes(self) -> int:
        """Bytes held by the per-request indexes now (bounded by max_index_bytes)."""
        return self.pool.bytes


def _find_runner(frame):
    """The model runner that called load_model: the `self` of the calling frame (or one of the few above it) that
    holds an `input_batch` and a `requests` table; None if there is none (an unknown vLLM, a test)."""
    for _ in range(4):
        if frame is None:
            return None
        runner = frame.f_locals.get("self")
        if hasattr(runner, "input_batch") and isinstance(getattr(runner, "requests", None), dict):
            return runner
        frame = frame.f_back
    return None


def _vllm_version() -> str:
    module = sys.modules.get("vllm")
    return str(getattr(module, "__version__", "")) if module is not None else ""


def _keeper(ref) -> None:
    """The memory thread's loop (a daemon: it never delays an exit). It holds the drafter only weakly, and a
    failure is logged (once) and never raised."""
    failed = False
    while True:
        drafter = ref()
        if drafter is None:
            return
        pause, wake = min(drafter.settings.save_seconds, IDLE_SECONDS) / 4, drafter._wake
        del drafter
        wake.wait(pause)
        wake.clear()
        drafter = ref()
        if drafter is None:
            return
        try:
            drafter._tick(time.monotonic())
        except Exception:                           # noqa: BLE001
            if not failed:
                log.exception("lookup_decode: storing or saving the memory failed (retried; logged once)")
                failed = True
        del drafter


def _flush_at_exit(ref) -> None:
    """At interpreter exit (vLLM calls nothing on a drafter at shutdown): store the live requests' outputs and
    save the memory. Never raises: an exit must not fail for it."""
    drafter = ref()
    if drafter is None:
        return
    try:
        with drafter._lock:
            drafter._retire(drafter._call, "retired")
            drafter.save_memory()
    except Exception:                               # noqa: BLE001
        log.exception("lookup_decode: saving the memory at exit failed")


def _show_info_logs() -> None:
    """vLLM configures its own loggers only: give lookup_decode's a handler (stderr) unless the process has one, so
    its INFO lines (each memory save, with the drafter's stats) reach the server's log."""
    ours = logging.getLogger("lookup_decode")
    if not ours.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.INFO)
