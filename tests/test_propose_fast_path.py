"""The vLLM drafter's steady-state path (`BatchDrafter._steady`: every row the request it held at the last call,
continued) against its general path: replayed through tests/sim_runner.py, every call's drafts, the counters, the
step cost's sums, the calibration table and the memory of outputs must be the same with it and without it."""

from dataclasses import asdict, fields

import numpy as np
import pytest

from lookup_decode.core.pool import IndexPool
from lookup_decode.engines.vllm import drafter as lv
from lookup_decode.engines.vllm.batch_drafter import BatchDrafter, EngineRequests, RequestInfo
from lookup_decode.engines.vllm.requests import RequestTable
from lookup_decode.sources.memory import Memory, References
from tests.sim_runner import SimRequest, SimRunner
from tests.test_vllm import EOS, _requests


def _state(drafter) -> dict:
    """What a drafter learned and counted (no wall-clock times)."""
    stats = {f.name: getattr(drafter.stats, f.name) for f in fields(drafter.stats)
             if f.name not in ("propose_s", "propose_max_s", "first_propose_s", "reliability", "requests")}
    entries = [] if drafter.memory is None else [
        {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in asdict(e).items()}
        for e in drafter.memory.entries()]
    pool = drafter.pool
    return {"stats": stats, "calibration": drafter.stats.reliability.table.tolist(),
            "cost": drafter.cost.state.tolist(), "buckets": drafter.cost.bucket.tolist(),
            "requests": {rid: asdict(r) for rid, r in drafter.stats.requests.items()}, "memory": entries,
            "pool": (pool.bytes, pool.copied, pool.swaps)}


def _run(steady: bool, requests_of, settings, runner_kw, k=8, migrate_from=None, budget=None, sizes=None,
         **drafter_kw):
    """(each request's drafts and emitted tokens per step, the drafter's state, calls taken by the steady path,
    calls, those of the steady calls whose pool step ran in the steady state's own compiled call).
    migrate_from: the smallest index room that grows by a copy built across calls (`IndexPool`; None: its own);
    budget: the engine's tokens per step (chunked prefill), as vLLM's config gives it; sizes: CUDA graph sizes, as
    the adapter hands them over."""
    drafter = lv.LookupDrafter.from_settings(settings, k, eos_token_ids=EOS, **drafter_kw)
    drafter.steady_path, drafter.budget = steady, budget
    if sizes is not None:
        drafter.cost.use_capture_sizes(sizes)
    if migrate_from is not None:
        drafter.pool.migrate_from = migrate_from
    taken = [0]
    general = drafter._steady

    def counted(*a):
        out = general(*a)
        taken[0] += out is not None
        return out

    drafter._steady = counted
    fused, table_steady = [0], drafter.requests.steady

    def stepped(*a, **kw):
        got = table_steady(*a, **kw)
        fused[0] += got is not None and bool(got[-1][6])     # (sums: ..., stepped, learned, total, drafted)
        return got

    drafter.requests.steady = stepped
    runner = SimRunner(drafter, k=k, ids=True, step_seconds=lambda n: 0.05 + 0.004 * n, **runner_kw)
    drafter.clock = runner.clock
    requests = requests_of()
    runner.run(requests)
    return [(r.drafts, r.emitted) for r in requests], _state(drafter), taken[0], runner.proposes, fused[0]


def _long(seed: int) -> list[SimRequest]:
    """Requests whose outputs run up to max_model_len 200 (the engine skips the drafter near it)."""
    rng = np.random.default_rng(seed)
    return [SimRequest(rng.integers(3, 12, size=n).astype(np.int32), np.tile(np.arange(3, 9), 40)[:m].astype(np.int32))
            for n, m in [(40, 150), (30, 100), (60, 150), (20, 80), (50, 120), (25, 140)]]


SCENARIOS = {
    # rows that move, go unscheduled, join two a step and prefill in chunks; the memory of outputs on
    "moving": (lambda: _requests(seed=3, n=24, chunk=32), lv.Settings(),
               dict(max_num_reqs=8, seed=3, p_unscheduled=0.05, p_swap=0.3, arrivals_per_step=2)),
    # preemptions (missed steps: slots continued without learning) and the whole-batch skip near max_model_len
    "preempted": (lambda: _requests(seed=5, n=12), lv.Settings(idle_steps=6),
                  dict(max_num_reqs=4, seed=5, p_preempt=0.05, preempt_steps=10, max_model_len=220)),
    # the whole-batch skip near max_model_len: rows continued by missed steps, not learned from
    "skipped": (lambda: _long(13), lv.Settings(idle_steps=4), dict(max_num_reqs=4, max_model_len=200, seed=3)),
    # one request at a time, as the batch-1 study
    "alone": (lambda: _requests(seed=7, n=6), lv.Settings(), dict(max_num_reqs=4, seed=7)),
    # not adaptive, no memory
    "plain": (lambda: _requests(seed=8, n=16), lv.Settings(adaptive=False, memory=False),
              dict(max_num_reqs=8, seed=8, arrivals_per_step=4)),
    # sampled requests (temperature 1: cells of their own)
    "sampled": (lambda: _requests(seed=9, n=12), lv.Settings(), dict(max_num_reqs=4, seed=9, p_off=0.3, vocab=12)),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_steady_path_gives_the_general_paths_drafts(name):
    requests_of, settings, runner_kw = SCENARIOS[name]
    drafts, state, taken, calls, fused = _run(True, requests_of, settings, runner_kw)
    drafts_general, state_general, taken_general, _, _ = _run(False, requests_of, settings, runner_kw)
    assert taken_general == 0 and taken > calls // 4           # guard: the steady path served many calls, some
    assert fused > 0 and (name not in ("alone", "sampled") or fused > taken // 2)   # stepped in one compiled call
                                                               # (most, where no request is held outside the batch)
    assert sum(len(d) for ds, _ in drafts for d in ds) > 100 and state["stats"]["accepted"] > 50   # and drafted
    assert drafts == drafts_general
    assert state == state_general


def test_a_requests_last_call_steps_in_the_steady_call_and_stores_its_output_after(monkeypatch):
    """A row whose request ended (EOS, or its end) no longer sends the call to the general path: the steady call
    drafts it and every row, then its output enters the memory, in the same call (the general path stores after
    drafting too: the same drafts and state)."""
    ended_and_stepped, steady = [0], RequestTable.steady

    def counted(self, *a, **kw):
        got = steady(self, *a, **kw)
        ended_and_stepped[0] += got is not None and got[-1][5] > 0 and bool(got[-1][6])   # (sums: ended, stepped)
        return got

    monkeypatch.setattr(RequestTable, "steady", counted)
    requests_of, settings, runner_kw = SCENARIOS["alone"]
    drafts, state, _, _, fused = _run(True, requests_of, settings, runner_kw)
    drafts_general, state_general, _, _, _ = _run(False, requests_of, settings, runner_kw)
    assert ended_and_stepped[0] > 0 and state["stats"]["accepted"] > 50      # (0 where an ended row sent it away)
    assert sorted(e["tokens"] for e in state["memory"]) == sorted(r.truth.tolist() for r in requests_of())
    assert drafts == drafts_general
    assert state == state_general


def test_steady_path_with_the_engines_token_budget():
    """Chunked prefill under a token budget: the steady call observes the step with the prefill clamped to the budget
    (in compiled code) as the general path does (in Python)."""
    requests_of, settings, runner_kw = SCENARIOS["moving"]
    drafts, state, taken, _, fused = _run(True, requests_of, settings, runner_kw, budget=40)
    drafts_general, state_general, _, _, _ = _run(False, requests_of, settings, runner_kw, budget=40)
    unbounded = _run(True, requests_of, settings, runner_kw)[1]
    assert taken > 0 and fused > 0 and state["stats"]["accepted"] > 50
    assert state["cost"] != unbounded["cost"]                  # guard: the budget clamped some steps' prefill
    assert drafts == drafts_general
    assert state == state_general


def test_steady_path_with_graph_sizes():
    """With CUDA graph sizes (a step padded to the next one; each size's own mean), the steady call observes the step
    and chooses the lengths on the sizes' curve as `StepCost` does in Python."""
    requests_of, settings, runner_kw = SCENARIOS["moving"]
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64]
    drafts, state, taken, _, fused = _run(True, requests_of, settings, runner_kw, sizes=sizes)
    drafts_general, state_general, _, _, _ = _run(False, requests_of, settings, runner_kw, sizes=sizes)
    line = _run(True, requests_of, settings, runner_kw)
    assert taken > 0 and fused > 0 and state["stats"]["accepted"] > 50
    assert state["cost"] != line[1]["cost"] and drafts != line[0]   # guard: the sizes moved the fit and the choice
    assert drafts == drafts_general
    assert state == state_general


def test_steady_call_skips_numbas_dispatch_while_its_arrays_are_the_same(monkeypatch):
    """`RequestTable.steady` calls steady_call's compiled entry itself (numba's dispatch types every argument at every
    call) while the caller's arrays are the objects it found the entry for: the same drafts and state as through the
    dispatch, most fused calls served by the entry. Counts that turn int64 midway, the matrix and emitted counts
    still the same objects, go back through the dispatch, which finds their entry (the int32 one would misread them)."""
    from numba import typeof

    from lookup_decode.engines.vllm import requests as rq
    served, found_counts, real = {"entry": 0}, set(), rq.entry_of

    def counting(dispatcher, args):
        found_counts.add(args[1].dtype.name)
        entry, found_for = real(dispatcher, args), [typeof(a) for a in args]

        def run(*a):
            served["entry"] += 1
            assert [typeof(x) for x in a] == found_for, "an entry called with arguments of other types"
            return entry(*a)
        return run

    draft = BatchDrafter.draft

    def int64_midway(self, matrix, counts, emitted, engine=None):
        self.seen = getattr(self, "seen", 0) + 1
        if self.seen > 20:                                      # (one int64 array from then on)
            if len(getattr(self, "wide", ())) != len(counts):
                self.wide = np.empty(len(counts), np.int64)
            self.wide[:] = counts
            counts = self.wide
        return draft(self, matrix, counts, emitted, engine)

    monkeypatch.setattr(BatchDrafter, "draft", int64_midway)
    requests_of, settings, runner_kw = SCENARIOS["plain"]      # (several rows: an int64 read as int32 shows)
    monkeypatch.setattr(rq, "entry_of", counting)
    drafts, state, _, _, fused = _run(True, requests_of, settings, runner_kw)
    monkeypatch.setattr(rq, "entry_of", lambda dispatcher, args: None)
    drafts_dispatched, state_dispatched, _, _, fused_dispatched = _run(True, requests_of, settings, runner_kw)
    assert served["entry"] > fused // 2 and found_counts == {"int32", "int64"}    # guard: it served both dtypes
    assert fused == fused_dispatched and state["stats"]["accepted"] > 50
    assert drafts == drafts_dispatched
    assert state == state_dispatched


def test_arrays_new_at_every_call_never_pay_for_the_direct_entry(monkeypatch):
    """A caller that hands the drafter new arrays at every call (a torch tensor's counts, converted) goes through
    numba's dispatch: no entry is looked up for arrays seen once (it costs ~0.15 ms), and the drafts are the same."""
    from lookup_decode.engines.vllm import requests as rq
    looked_up, real = [0], rq.entry_of

    def counting(dispatcher, args):
        looked_up[0] += 1
        return real(dispatcher, args)

    draft = BatchDrafter.draft
    monkeypatch.setattr(BatchDrafter, "draft", lambda self, matrix, counts, emitted, engine=None: draft(
        self, matrix, counts.copy(), emitted.copy(), engine))
    monkeypatch.setattr(rq, "entry_of", counting)
    requests_of, settings, runner_kw = SCENARIOS["alone"]
    drafts, state, _, _, fused = _run(True, requests_of, settings, runner_kw)
    new_arrays = looked_up[0]
    monkeypatch.setattr(BatchDrafter, "draft", draft)
    drafts_same, state_same, _, _, _ = _run(True, requests_of, settings, runner_kw)
    assert fused > 30 and looked_up[0] > new_arrays            # guard: the same arrays' calls looked one up
    assert state["stats"]["accepted"] > 50                     # and drafts were kept
    assert new_arrays == 0
    assert drafts == drafts_same and state == state_same


def _past_three_quarters() -> list[SimRequest]:
    """Prompts of 600-740 tokens and outputs of ~190: past 3/4 of a new slot's room (1024), within it."""
    out = _requests(seed=7, n=8)
    for j, r in enumerate(out):
        r.prompt = np.tile(r.prompt, 900 // len(r.prompt))[:600 + 20 * j]
        r.truth = np.concatenate([r.truth] * 3)
    return out


def test_steady_path_where_indexes_grow_by_copying():
    """Every room grows by a copy built over later calls (`IndexPool.reserve` starts it past 3/4 of the room,
    `migrate` builds it, then it is swapped in): the steady path must hand `reserve` each call that has work for it
    (and may skip it otherwise), so both paths start, build and swap the same copies."""
    runner_kw = dict(max_num_reqs=4, seed=7)
    drafts, state, taken, calls, _ = _run(True, _past_three_quarters, lv.Settings(), runner_kw, migrate_from=0)
    drafts_general, state_general, _, _, _ = _run(False, _past_three_quarters, lv.Settings(), runner_kw,
                                                  migrate_from=0)
    assert taken > calls // 2 and state_general["pool"][2] >= 6    # guard: many steady calls, copies swapped in
    assert drafts == drafts_general
    assert state == state_general


def test_steady_path_skips_reserve_where_it_has_nothing_to_do(monkeypatch):
    """A room below `migrate_from` grows only once full: past 3/4 of it `reserve` has nothing to do, and a steady
    call does not call it (its numpy calls were a third of such a call, caches cold after the model's forward)."""
    steady, reserve, inside, reserved = BatchDrafter._steady, IndexPool.reserve, [False], {True: 0, False: 0}

    def steady_call(drafter, *a):
        inside[0] = True
        try:
            return steady(drafter, *a)
        finally:
            inside[0] = False

    def counted(pool, *a):
        reserved[inside[0]] += 1
        return reserve(pool, *a)

    monkeypatch.setattr(BatchDrafter, "_steady", steady_call)
    monkeypatch.setattr(IndexPool, "reserve", counted)
    _, state, taken, calls, _ = _run(True, _past_three_quarters, lv.Settings(), dict(max_num_reqs=4, seed=7))
    assert taken > calls // 2 and state["pool"][1] == 0        # many steady calls, no room grew
    assert reserved[False] > 0 and reserved[True] == 0          # the general path's calls only


def _with_own_corpora():
    """Requests with their own draft lengths, memory scopes and predictions (rows reading corpora of their own)."""
    requests = _requests(seed=11, n=16, copy=False)
    for j, r in enumerate(requests):
        r.extra_args = [None, {"lookup_decode_k": 3}, {"lookup_decode_scope": f"t{j % 3}"},
                        {"lookup_decode_prediction": r.truth.tolist()}][j % 4]
    return requests


def _references() -> References:
    refs = References()
    refs.register("doc", tokens=np.random.default_rng(12).integers(3, 12, size=400))
    return refs


def test_steady_path_with_per_request_settings_and_references():
    runner_kw = dict(max_num_reqs=6, seed=11, arrivals_per_step=2)
    drafts, state, taken, calls, _ = _run(True, _with_own_corpora, lv.Settings(), runner_kw, references=_references())
    drafts_general, state_general, _, _, _ = _run(False, _with_own_corpora, lv.Settings(), runner_kw,
                                                  references=_references())
    assert taken > calls // 2 and state["stats"]["accepted"] > 50
    assert drafts == drafts_general
    assert state == state_general


def test_a_request_let_go_outside_the_batch_and_a_missed_step():
    """A request the engine lets go while it is out of the batch (preempted, then aborted) changes no row: the
    steady path must retire it at that very call too (its output enters the memory before the others draft). A
    step the drafter missed (the whole-batch skip) leaves the rows where they were: the steady path continues them
    without learning, as the general path does."""
    rng = np.random.default_rng(0)
    a = np.concatenate([rng.integers(3, 12, size=30), np.tile(np.arange(3, 9), 20)]).astype(np.int32)
    b = np.concatenate([rng.integers(3, 12, size=30), np.tile(np.arange(3, 9), 20)]).astype(np.int32)
    info = lambda rid: RequestInfo(prompt_len=30, max_tokens=1000)        # noqa: E731
    lengths = [n for n in range(31, 90) if n not in (40, 41, 70)]         # calls missed at 40, 41 and 70
    log = {}
    for steady in (True, False):
        drafter = lv.LookupDrafter.from_settings(lv.Settings(adaptive=False), 4, eos_token_ids=EOS,
                                                 memory=Memory(10**6))
        drafter.steady_path = steady
        out = log[steady] = []
        for n in lengths:
            both = n < 50                                   # b leaves the batch at 50, is let go at 60
            ids = ["a", "b"] if both else ["a"]
            matrix = np.stack([a, b]) if both else a[None]
            held = {"a", "b"} if n < 60 else {"a"}
            got = drafter.draft(np.ascontiguousarray(matrix), np.full(len(ids), n, np.int64),
                                np.ones(len(ids), np.int64), EngineRequests(ids, held, info))
            s = drafter.stats
            out.append((got.rows.tolist(), got.lengths.tolist(), got.tokens[:, :4].tolist(), s.retired, s.continued,
                        s.accepted, drafter.live_requests, len(drafter.memory), s.reliability.table.tolist()))
        assert drafter.stats.retired == 1 and out[lengths.index(60)][3] == 1   # retired at the call where it went
        assert drafter.stats.continued == 3 and drafter.stats.accepted > 50
    assert log[True] == log[False]
