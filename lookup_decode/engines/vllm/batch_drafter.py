"""The engine-neutral half of the vLLM drafter: drafts for every row of a batch given as plain arrays (a token
matrix, counts, tokens emitted per row) and, where the engine tells them, request ids.

One call (`BatchDrafter.draft`) does, for all rows at once:
1. find each row's request (`requests.RequestTable`: by id when the engine gives ids, else by content);
2. learn the step's cost from the time since the last call (`StepCost.observe`), and keep the per-request indexes
   within `max_index_bytes` (`_evict_idle`: requests not in this call go first, least recently seen first);
3. store the outputs of the requests that finished (`keeper.Keeper.remember`): a request the engine no longer
   holds (ids) before this call drafts, so the other rows draft from it at once; a row whose last token is EOS or
   that reached its request's end, and (content) a known request absent from the call, once this call has drafted
   (so that a request's last call stays one compiled step; the other rows draft from it from the next call on).
   When no request seen is left unstored, the keeper writes `memory_save` at once (a server stopped right after
   its last answer keeps every output);
4. in one compiled call (`core.pool.IndexPool.step`): learn from what the engine kept of each row's last draft,
   extend its index by the new tokens, draft from the request itself and the shared corpora (memory, references,
   the request's prediction: the longest match wins), and price each draft token by its probability of being kept;
5. choose how many tokens of each draft to send (`StepCost.choose`; `adaptive=False`: all of them);
6. retire requests absent for `idle_steps` calls.

Each request's own settings are one `Request` record, made by `_start` from what the engine tells of it
(`RequestInfo`): a new per-request knob is a field of `Request`, the line of `_start` that reads it, and its use.
A failure never stops the engine: a call that raises is logged once, drafts nothing, and the drafter starts afresh.

Most calls bring no new request: by id, every row that emitted tokens holds a known request, continued by them. Such
a call (`_steady`) skips most of step 1 and the general path's bookkeeping: one compiled call
(`RequestTable.steady`) checks that, gives the arrays of step 4 and, where nothing before the step needs Python (no
index growing, the rows reading only the shared corpora), runs step 4 itself, and then the step's time, step 5 and
the booking too (the outputs of rows that ended are stored after it, in Python). A call after a model's forward
finds its objects out of the caches, so it is the count of numpy calls, Python frames and objects handed to compiled
code a call touches, more than their work, that sets its time (measured with 64 MB streamed through the caches
before each: ~10 us a numpy call, ~6 us a call into compiled code and ~8 more for each object numba types in
Python).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from lookup_decode.core.index import SuffixIndex
from lookup_decode.core.pool import IndexPool
from lookup_decode.core.step_cost import StepCost
from lookup_decode.engines.vllm import request_args
from lookup_decode.engines.vllm.keeper import Keeper
from lookup_decode.engines.vllm.requests import NO_LIMIT, Drafts, EngineRequests, Request, RequestInfo, RequestTable
from lookup_decode.engines.vllm.settings import ENV_PREFIX, Settings, load_references_setting, replica_path
from lookup_decode.engines.vllm.stats import SOURCES, DrafterStats
from lookup_decode.sources.corpus import Reading
from lookup_decode.sources.memory import Memory, References, prediction_of

log = logging.getLogger("lookup_decode.vllm")
_NO_CORPORA = Reading(())


class BatchDrafter:
    """Drafts for a batch of rows, keeping each request's index, the memory of outputs and the step cost."""

    steady_path = True                  # False: every call takes the general path (tests compare the two)

    def __init__(self, settings: Settings, num_speculative_tokens: int, *, max_model_len: int | None = None,
                 vocab_size: int | None = None, eos_token_ids=(), memory: Memory | None = None,
                 references: References | None = None, tokenizer=None,
                 saves: bool = True, replica: tuple[int, int] = (0, 1), device: str = "cpu"):
        k = num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an int >= 1 for lookup_decode's drafter, got {k!r}")
        self.settings = settings
        self.k = min(int(k), settings.k) if settings.k is not None else int(k)
        if self.k < 1:
            raise ValueError(f"{ENV_PREFIX}K must be >= 1, got {settings.k}")
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.eos = tuple(int(e) for e in eos_token_ids)
        self.tokenizer = tokenizer                  # the engine's (texts: references, predictions)
        self.stats = DrafterStats()
        # Tensor-parallel ranks hold the same memory: one writes it. Data-parallel replicas write their own files.
        self.keeper = Keeper(settings, self.stats, vocab_size=vocab_size, memory=memory, saves=saves,
                             memory_save=replica_path(settings.memory_save, *replica), on_idle=self.store_known,
                             on_exit=self.shutdown)
        self.memory, self.scopes = self.keeper.memory, self.keeper.scopes
        self.references = references if references is not None else load_references_setting(
            settings.references, tokenizer=tokenizer, vocab_size=vocab_size)
        for corpus in (self.memory, self.references):   # a foreign memory file fails here, not while serving
            if corpus is not None and vocab_size is not None:
                corpus.check_vocab(vocab_size, "the engine's model")
        self.cost = StepCost.for_device(device, prior_token_cost=settings.draft_cost)
        self.budget: int | None = None              # the engine's token budget per step (chunked prefill)
        self._retire_every = max(1, settings.idle_steps // 4)
        self._room_1024 = SuffixIndex.bytes_for(1024)   # the smallest index's bytes
        self.clock = time.perf_counter              # what step times are read from (a simulation sets its own)
        self._logged = self._shut = False
        self._fresh()

    def _fresh(self) -> None:
        """No request known (at start, and after a failed call: the table may be half updated)."""
        self.pool = IndexPool(self.k, min_match=self.settings.min_match, max_match=self.settings.max_match,
                              eos_token_ids=self.eos)
        # A step the drafter missed added one token per row (vLLM then schedules zeros as drafts, rarely kept);
        # a few such steps in a row are followed, anything longer is another request.
        self.requests = RequestTable(self.pool, max_gap=4 * (self.k + 1), eos_token_ids=self.eos)
        self.records: dict[int, Request] = {}      # slot -> its request's record (requests followed by id)
        self._own: set[int] = set()                 # slots whose record has its own memory or prediction
        self._shared = None                         # the shared corpora, the roles of rows reading them, a Reading
        self._call = 0
        self._last = None                           # when the last call started

    # -- one call -------------------------------------------------------------------------------------
    def draft(self, matrix: np.ndarray, counts: np.ndarray, emitted: np.ndarray,
              engine: EngineRequests | None = None) -> Drafts:
        """Drafts for the rows of a batch. matrix: int32 [>= B, L], row i's tokens in its first counts[i] columns
        (this step's tokens written in); counts, emitted: int [B], tokens per row and of those emitted this step
        (0: no draft wanted, e.g. a partial prefill); engine: the rows' request ids, or None (followed by content)."""
        with self.keeper.lock:
            start, t = self.clock(), time.perf_counter()
            try:
                return self._draft(matrix, counts, emitted, engine, start)
            except Exception:                       # noqa: BLE001  (a drafter failure must never stop the engine)
                self.stats.errors += 1
                if not self._logged:
                    log.exception("lookup_decode: the drafter failed; this step drafts nothing and the drafter "
                                  "starts afresh (later failures are only counted: drafter.stats.errors)")
                    self._logged = True
                self._fresh()
                return Drafts(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, self.k), np.int32))
            finally:
                self.stats.timed(time.perf_counter() - t)
                self.keeper.called()

    def _draft(self, matrix, counts, emitted, engine: EngineRequests | None, now: float) -> Drafts:
        self._call += 1
        self.stats.steps += 1
        if engine is not None and self.steady_path:
            out = self._steady(matrix, counts, emitted, engine, now)
            if out is not None:
                return out
        self.requests.row_ids = None                # slots may change: the next call finds its rows' slots by id
        counts, emitted = np.asarray(counts, np.int64), np.asarray(emitted, np.int64)    # (vLLM's counts: int32)
        rows = np.flatnonzero(emitted > 0)
        if self.max_model_len is not None:
            rows = rows[counts[rows] < self.max_model_len]
        r_counts, r_emitted, table = counts[rows], emitted[rows], self.requests
        if engine is None:
            claim = table.claim(matrix, rows, r_counts, r_emitted, self._call, self._admit)
        else:
            claim = self._claim_ids(engine, rows, r_counts, r_emitted)
        if claim.continued == 0 and len(rows):
            # It verified each row's token and the draft it was sent, beside the prompt chunks of rows still
            # prefilling (no token yet) and of rows whose prefill ended in it (fresh slots).
            verified = len(rows) + int(table.sent[claim.slots[claim.slots >= 0]].sum())
            self._observe(verified, int(counts[emitted == 0].sum()) + int((r_counts[claim.starts == 0] - 1).sum()),
                          len(rows), now)
        placed = self._within_bound(claim, r_counts)
        self._retire_gone(engine, len(rows))
        rows, slots, ends = rows[placed], claim.slots[placed], r_counts[placed]
        # A step emits its kept drafts and one more token: no draft goes past where the row ends.
        limits = np.minimum(np.minimum(table.limit[slots], self.k), table.end[slots] - ends - 1)
        if self.max_model_len is not None:
            limits = np.minimum(limits, self.max_model_len - ends - 1)
        step = self._step(matrix, rows, slots, claim.starts[placed], ends, np.maximum(limits, 0), claim.learn[placed],
                          table.temperature[slots], self._corpora_of(slots))
        if self.memory is not None:
            self._store_finished(matrix, rows, slots, ends, absent=engine is None)
        if engine is None:
            table.file(matrix, rows, slots, ends, self._call)
        s = self.stats
        for name in ("built", "continued", "resumed", "rebuilt"):
            setattr(s, name, getattr(s, name) + getattr(claim, name))
        s.extended += len(rows) - claim.built - claim.continued
        s.refused += int((claim.slots < 0).sum())
        return self._sent(step, rows, slots, now, engine)

    def _steady(self, matrix, counts, emitted, engine: EngineRequests, now: float) -> Drafts | None:
        """A call in the steady state (`RequestTable.steady`: no row new, refused or rebuilt) far below the byte
        bound: the general path's drafts with a few numpy calls. None (nothing changed): take the general path."""
        table, pool, shared = self.requests, self.pool, self._shared
        if not table.rows_known(engine.ids, emitted):
            return None                             # (a new request: nothing built for the steady call)
        # The pool steps the rows in the steady state's own compiled call (`RequestTable.steady`'s kernel) where the
        # rows read only the shared corpora, in their roles by default, no slot is being copied, and the byte bound
        # leaves every row a first room: nothing to do in Python before the step.
        fused = not self._own and shared is not None and shared[1] is None and not pool.copies \
            and 4 * (pool.bytes + len(counts) * self._room_1024) <= self.settings.max_index_bytes
        with shared[2] if fused else _NO_CORPORA as held:
            # Where it steps, that call also observes the last step, chooses the lengths and books them.
            got = table.steady(matrix, counts, emitted, engine.ids, self._call, k=self.k,
                               max_len=self.max_model_len if self.max_model_len is not None else NO_LIMIT << 30,
                               check_end=self.memory is not None, kernel=pool.kernel(held, len(counts)) if fused
                               else None, cost=self.cost,
                               calibration=self.stats.reliability, adaptive=self.settings.adaptive,
                               seconds=now - self._last if self._last is not None else -1.0,
                               budget=int(self.budget) if self.budget is not None else -1)
        if got is None:
            return None
        rows, slots, starts, ends, limits, learn, temps, lengths, sums = got
        verified, prefill, continued, most, near, ended, stepped, learned, total, drafted = sums
        r = len(rows)
        booked = None
        if stepped:
            step, booked = pool.outputs(r), (lengths, learned, total, drafted)
            if ended:
                self._store_finished(matrix, rows, slots, ends, absent=False)
        else:
            room = SuffixIndex.bytes_for(most) if most > 1024 else self._room_1024
            if 4 * (pool.bytes + r * room) > self.settings.max_index_bytes:
                return None                         # (the general path marks the same slots seen)
            if continued == 0:
                self._observe(verified, prefill, r, now)
            if len(table.id_of) > r:
                self._retire_gone(engine, r)
            corpora = self._corpora_of(slots) if self._own else self._shared_corpora(r)
            step = self._step(matrix, rows, slots, starts, ends, limits, learn, temps, corpora, fits=not near)
            if ended:
                self._store_finished(matrix, rows, slots, ends, absent=False)
        self.stats.continued += continued
        self.stats.extended += r - continued
        return self._sent(step, rows, slots, now, engine, booked)

    def _observe(self, verified: int, prefill: int, rows: int, now: float) -> None:
        """The step since the last call, none of whose rows missed steps: its time is its cost (`StepCost`)."""
        if self._last is not None:
            self.cost.observe(verified, now - self._last, prefill_tokens=prefill, drafted=verified > rows,
                              budget=self.budget)

    def _retire_gone(self, engine: EngineRequests | None, rows: int) -> None:
        """Requests the engine no longer holds have finished (none has while every known one has one of the rows)."""
        if engine is not None and len(self.requests.id_of) > rows:
            for s in [s for s, rid in self.requests.id_of.items() if rid not in engine.held]:
                self._drop(s, "retired")

    def _shared_corpora(self, r: int) -> tuple[list, np.ndarray | None]:
        """`_corpora_of` r rows that read only the shared corpora (None for the roles where they are the pool's
        default: corpus c in role c)."""
        if self._shared is None or self._shared[1] is not None and len(self._shared[1]) < r:
            corpora, roles = self._corpora_of(np.full(max(64, 2 * r), -1, np.int64))
            default = roles[0].tolist() == list(range(len(corpora))) + [-1] * (roles.shape[1] - len(corpora))
            self._shared = corpora, None if default else roles, Reading(corpora)
        corpora, roles, _ = self._shared
        return corpora, None if roles is None else roles[:r]

    def _step(self, matrix, rows, slots, starts, ends, limits, learn, temps, corpora, fits: bool = False):
        """`IndexPool.step` over these rows, the corpora (the distinct ones, and each row's roles) unchanged while
        it reads them."""
        corpora, row_corpora = corpora
        with Reading(corpora) as held:
            return self.pool.step(matrix, rows, slots, starts, ends, limits, learn, held, temperatures=temps,
                                  row_corpora=row_corpora, fits=fits)

    def _sent(self, step, rows, slots, now: float, engine: EngineRequests | None, booked=None) -> Drafts:
        """What the engine kept of the last drafts learned, this call's lengths chosen and recorded, idle requests
        retired. booked: (lengths, learned, total, drafted) where the steady call chose and booked them already."""
        table, r = self.requests, len(rows)
        if booked is None:
            lengths = self.cost.choose(step.p_kept, step.lengths) if self.settings.adaptive else step.lengths
            learned, total, drafted = table.book(slots, lengths, step, self.stats.reliability)
        else:
            lengths, learned, total, drafted = booked
        s = self.stats
        s.rows += r
        s.drafted += drafted
        if total:
            self._credit(learned, total)
        if self.records and drafted:
            for slot, n in zip(slots.tolist(), lengths.tolist()):
                if n and slot in self.records:
                    self.records[slot].stats.drafted += n
        self._last = now
        # A bounded delay; the scan over live requests is O(requests), and finds none while all are in this call.
        if self._call % self._retire_every == 0 and len(table.live) > r:
            for slot in table.idle(self._call - self.settings.idle_steps):
                if engine is None or table.id_of.get(slot) not in engine.held:
                    self._drop(slot, "retired")
        if self.settings.reload_every and self._call % self.settings.reload_every == 0:
            self.keeper.reload()
        return Drafts(rows, lengths, step.tokens)

    def _credit(self, learned: int, total: int) -> None:
        """The kept draft tokens of the rows `RequestTable.book` listed: statistics, and credit to the corpus entries
        drafted from."""
        self.stats.accepted += total
        # A request's own counters count what it was sent and kept (its `kept` may go past what was sent, when the
        # engine's next token happened to equal the proposal's next one).
        sources, records = self.stats.sources, self.records
        for s, n, n_sent, src, version, position, _ in self.requests.learned[:, :learned].T.tolist():
            if n <= 0:
                continue
            sources[SOURCES[src]] += n
            record = records.get(s)
            if record is not None and min(n, n_sent):
                record.stats.accepted += min(n, n_sent)
                record.stats.sources[SOURCES[src]] += min(n, n_sent)
            if src > 0:
                self._roles(s)[src - 1].credit(version, position, n)

    # -- requests: ids, records, corpora --------------------------------------------------------------
    def _claim_ids(self, engine: EngineRequests, rows, counts, emitted):
        """`RequestTable.claim_ids` with the engine's request ids; each new request gets its record."""
        ids, known = engine.ids, self.requests.ids
        ids = [ids[i] for i in rows.tolist()]
        infos = {rid: engine.info(rid) for rid in ids if rid is not None and rid not in known}
        prompts = np.fromiter((infos[rid].prompt_len if rid in infos else -1 for rid in ids), np.int64, len(ids))
        claim = self.requests.claim_ids(rows, counts, emitted, ids, prompts, self._call, self._admit)
        for j in claim.fresh:
            self._start(int(claim.slots[j]), ids[j], infos[ids[j]])
        return claim

    def _start(self, s: int, request_id: str, info: RequestInfo) -> None:
        """Slot s now holds request `request_id`: its record, from what the engine told of it."""
        record = self.records[s] = Request(request_id, self.stats.of_request(request_id), memory=self.memory)
        record.temperature = float(info.temperature or 0.0)
        prompt = int(self.requests.prompt_len[s])
        if isinstance(info.max_tokens, int) and prompt >= 0:   # drafts past max_tokens would be dropped
            record.end = prompt + info.max_tokens
        try:
            args = request_args.parse(info.extra_args)
        except ValueError as e:
            self.stats.ignored += 1
            log.warning("lookup_decode: request %s: %s; its lookup_decode settings are ignored (install "
                        "lookup_decode in the server's environment and vLLM refuses such a request instead)",
                        request_id, e)
            # A scope that cannot be read must not fall back to the shared memory: no memory for this request.
            if isinstance(info.extra_args, dict) and request_args.SCOPE in info.extra_args:
                record.memory = None
            args = request_args.RequestArgs()
        if args.k is not None:
            record.k = args.k
        if args.scope is not None:
            record.memory = self.keeper.scope(args.scope, {id(self.records[o].memory) for o in self._own})
        if args.prediction is not None:
            record.prediction = self._prediction(request_id, args.prediction)
        if record.memory is not self.memory or record.prediction is not None:
            self._own.add(s)
        table = self.requests                       # the step reads them from the table's per-slot arrays
        table.limit[s], table.temperature[s], table.end[s] = record.k, record.temperature, record.end

    def _prediction(self, request_id: str, prediction) -> References | None:
        """The request's prediction as a corpus of its own (None, logged, if it cannot be read)."""
        try:                                        # (a text without the engine's tokenizer: a ValueError)
            return prediction_of(prediction, tokenizer=self.tokenizer, vocab_size=self.vocab_size)
        except (ValueError, TypeError, OSError) as e:
            self.stats.ignored += 1
            log.warning("lookup_decode: request %s: %s %s; it drafts without it", request_id,
                        request_args.PREDICTION, e)
            return None

    def _roles(self, s: int) -> tuple:
        """The corpora slot s drafts from, by the pool's roles: (memory, references, prediction), None where none."""
        record = self.records.get(s) if s in self._own else None
        if record is None:
            return self.memory, self.references, None
        return record.memory, self.references, record.prediction

    def _corpora_of(self, slots: np.ndarray) -> tuple[list, np.ndarray]:
        """The distinct corpora of these slots and, per slot, the index of each of its roles' corpus (-1: none)."""
        corpora, where = [], {}
        rows = np.full((len(slots), 3), -1, np.int64)
        own = [j for j, s in enumerate(slots.tolist()) if s in self._own] if self._own else []
        for j, roles in [(slice(None), self._roles(-1))] + [(j, self._roles(int(slots[j]))) for j in own]:
            for c, corpus in enumerate(roles):
                if corpus is not None and id(corpus) not in where:
                    where[id(corpus)] = len(corpora)
                    corpora.append(corpus)
                rows[j, c] = -1 if corpus is None else where[id(corpus)]
        return corpora, rows

    # -- the byte bound and requests leaving ----------------------------------------------------------
    def _evict_idle(self, fits: Callable[[], bool]) -> bool:
        """Drop requests not seen in this call, least recently seen first, until fits(); returns fits()."""
        if fits():
            return True
        for s in self.requests.idle(self._call - 1):
            if fits():
                return True
            self._drop(s, "evicted")
        return fits()

    def _admit(self, n_tokens: int) -> bool:
        """Whether a new index over n_tokens fits the byte bound (evicting requests not seen in this call)."""
        need, bound = SuffixIndex.bytes_for(n_tokens), self.settings.max_index_bytes
        return self._evict_idle(lambda: self.pool.bytes + need <= bound)

    def _within_bound(self, claim, counts: np.ndarray) -> np.ndarray:
        """bool [r]: the rows whose index may take this call's tokens. Past the byte bound the requests not seen in
        this call go first; if that is not enough, the growing requests themselves are dropped (the largest growth
        first): their rows draft nothing until an index fits again."""
        placed, bound = claim.slots >= 0, self.settings.max_index_bytes
        more = counts - claim.starts
        # A slot's growth is at most its bytes doubled and the new tokens' room (twice): far below the bound, the
        # exact sum (`IndexPool.growth`, O(rows) numpy calls) is not needed.
        room = SuffixIndex.bytes_for(int(more.max())) if len(more) and more.max() > 1024 else self._room_1024
        if 4 * (self.pool.bytes + len(more) * room) <= bound:
            return placed
        growth = np.zeros(len(placed), np.int64)
        growth[placed] = self.pool.growth(claim.slots[placed], more[placed])
        if self._evict_idle(lambda: self.pool.bytes + int(growth.sum()) <= bound):
            return placed
        for j in np.argsort(-growth, kind="stable"):
            if growth[j] == 0 or self.pool.bytes + growth.sum() <= bound:
                break
            self._drop(int(claim.slots[j]), "evicted")
            placed[j], growth[j] = False, 0
        return placed

    def _drop(self, s: int, counter: str) -> None:
        self._store_slot(s)                         # normally stored already, when the request finished
        self.requests.drop(s)
        self.records.pop(s, None)                   # its prediction is freed with it
        self._own.discard(s)
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)

    # -- the memory of outputs ------------------------------------------------------------------------
    def _store_finished(self, matrix, rows, slots, counts, absent: bool) -> None:
        """Store the outputs of the requests that finished: rows whose last token is EOS or that reached their
        request's end (their text is the row), and (absent: rows followed by content, where a finished request and
        one away from the batch look alike) known requests absent from this call. Then, if no request seen is left
        unstored, the keeper writes memory_save at once. Called once the call has drafted, so that the steady call
        steps in a request's last call too: other rows draft from these outputs from the next call on."""
        ended = self.requests.ended(matrix, rows, slots, counts)
        for row, s, n in zip(rows[ended].tolist(), slots[ended].tolist(), counts[ended].tolist()):
            self._store(s, matrix[row, :n])
        for s in self.requests.unstored(self._call).tolist() if absent else ():
            self._store_slot(s)
        if self.keeper.unsaved and (ended.all() or not len(rows)) and not len(self.requests.unstored()):
            self.keeper.write_soon()

    def _store_slot(self, s: int) -> None:
        if self._roles(s)[0] is not None and int(self.pool.length([s])[0]) > self.requests.stored[s]:
            self._store(s, self.pool.tokens(s))

    def _store(self, s: int, tokens: np.ndarray) -> None:
        """Store request s's output (tokens: its whole text, prompt first) into its scope's memory, replacing what it
        stored before."""
        table = self.requests
        prompt = int(table.prompt_len[s])
        table.stored[s] = len(tokens)
        memory = self._roles(s)[0]
        if memory is None or prompt < 0 or len(tokens) <= prompt:
            return                                  # an unknown prompt length could store prompt as output
        key = self.keeper.remember(memory, tokens[:prompt], tokens[prompt:], table.keys.get(s))
        if key is not None:
            table.keys[s] = key

    def store_known(self) -> None:
        """Store the outputs of every request still known (the keeper's, once the engine is idle)."""
        for s in sorted(self.requests.live):
            self._store_slot(s)

    def flush(self, everything: bool = False) -> None:
        """Retire every request absent from the latest call (everything: every request) so that their outputs
        enter the memory, then save the memory if `memory_save` is set. For benchmarks between turns, and (at
        exit, `shutdown`) for the end."""
        with self.keeper.lock:
            for s in self.requests.idle(self._call if everything else self._call - 1):
                self._drop(s, "retired")
            if self.keeper.persists:
                self.keeper.save()

    def shutdown(self) -> None:
        """At exit: store every live request's output, save the memory, log the summary (once)."""
        if not self._shut:
            self._shut = True
            self.flush(everything=True)
            self.keeper.log_summary(time.monotonic())

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
