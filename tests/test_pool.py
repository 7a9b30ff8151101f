"""IndexPool: many requests stepped in one compiled call give the drafts, match lengths and acceptance probabilities
of SuffixIndex + SourcesProposer + one DraftPolicy on the same token streams (the reference), whatever the batch
does."""

import contextlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba.typed import List

from lookup_decode.core import pool as pool_module
from lookup_decode.core.draft import kept_prefix
from lookup_decode.core.index import SuffixIndex
from lookup_decode.core.policy import DraftPolicy, ragged_lengths
from lookup_decode.core.pool import IndexPool, drop_stale_cache
from lookup_decode.sources.memory import Memory, References
from lookup_decode.sources.proposer import SourcesProposer

EOS = (2,)


def _streams(rng, n, vocab):
    """Per request: prompt and the true continuation (copying spans of the prompt half the time)."""
    out = []
    for _ in range(n):
        prompt = rng.integers(3, vocab, size=int(rng.integers(5, 80))).astype(np.int32)
        pieces = []
        while sum(map(len, pieces)) < 60:
            if rng.random() < 0.6 and len(prompt) > 10:
                a = int(rng.integers(0, len(prompt) - 6))
                pieces.append(prompt[a: a + int(rng.integers(2, 12))])
            else:
                pieces.append(rng.integers(2, vocab, size=int(rng.integers(1, 4))).astype(np.int32))
        out.append((prompt, np.concatenate(pieces)))
    return out


def _run(seed: int, k: int, vocab: int, corpora: list, growth: bool = False, corpora_of=None, between=None):
    """Drive the pool and the reference side by side; every step each row emits the kept prefix of its full
    draft plus one true token (as a verifier with that truth would); rows join and leave over time. Returns
    (rows compared, tokens kept, the sources of drafts a token was kept from).
    corpora_of(i): request i's own (name, corpus) list, one per role (per-row corpora); default: `corpora`.
    between(rng): called after every step (a corpus that changes while the pool reads it)."""
    rng = np.random.default_rng(seed)
    reqs = _streams(rng, 12, vocab)
    if growth:                                   # long prompts: slots outgrow their first room
        reqs = [(np.tile(p, 60)[:3000], o) for p, o in reqs]
    pool = IndexPool(k, min_match=1, max_match=16, eos_token_ids=EOS)
    if growth:                                   # every room past half builds its copy, a little per step
        pool.migrate_from, pool.migrate_work = 0, 1500
    matrix = np.zeros((len(reqs), 4096), np.int32)
    ref, slot, done, pos = {}, {}, {}, {}
    active, waiting = [], list(range(len(reqs)))
    compared = kept_total = 0
    sources = set()                              # sources of drafts that had a token kept
    policy = DraftPolicy(k)                      # one policy for every request, as one pool serves them all
    while waiting or active:
        if waiting and (len(active) < 5 or rng.random() < 0.3):
            i = waiting.pop(0)
            p, o = reqs[i]
            matrix[i, : len(p)] = p
            matrix[i, len(p)] = o[0]                # the prefill's token
            pos[i], done[i] = len(p) + 1, 1
            index = SuffixIndex(min_match=1, max_match=16, eos_token_ids=EOS)
            own = corpora_of(i) if corpora_of else corpora
            drafter = (SourcesProposer(index, own, min_match=1, max_match=16, eos_token_ids=EOS)
                       if own else index)
            drafter.extend(matrix[i, : pos[i]])
            ref[i] = (drafter, None)
            slot[i] = (pool.add(0 if growth else pos[i]), 0)
            active.append(i)
        rows = np.array(active, np.int64)
        slots = np.array([slot[i][0] for i in active], np.int64)
        starts = np.array([slot[i][1] for i in active], np.int64)
        ends = np.array([pos[i] for i in active], np.int64)
        limits = np.array([min(k, len(reqs[i][1]) - done[i] - 1) for i in active], np.int64)
        limits = np.maximum(limits, 0)
        learn = starts > 0
        with contextlib.ExitStack() as stack:
            if corpora_of is None:
                got = pool.step(matrix, rows, slots, starts, ends, limits, learn,
                                [stack.enter_context(c.reading()) for _, c in corpora])
            else:                               # every distinct corpus once; each row names its own by role
                distinct = list({id(c): c for i in active for _, c in corpora_of(i)}.values())
                where = {id(c): j for j, c in enumerate(distinct)}
                row_corpora = np.array([[where[id(c)] for _, c in corpora_of(i)] for i in active], np.int64)
                got = pool.step(matrix, rows, slots, starts, ends, limits, learn,
                                [stack.enter_context(c.reading()) for c in distinct], row_corpora=row_corpora)
        steps = []
        for j, i in enumerate(active):
            drafter, last = ref[i]
            full = drafter.propose(int(limits[j]))
            assert got.tokens[j, : got.lengths[j]].tolist() == full.tokens.tolist(), (seed, i)
            assert got.match[j] == full.match_len and got.source[j] == full.source
            if last is not None:           # -1: nothing to learn (an empty draft)
                assert got.kept[j] == (kept_prefix(last[0].chain, last[1]) if len(last[0]) else -1)
            # probabilities: the acceptance model's, the pool's pooled counts against the policy's
            assert np.allclose(policy.p_kept([full], [i])[0], got.p_kept[j, : len(full)], rtol=1e-12, atol=0)
            compared += 1
            # the engine: kept prefix of the full draft, then one true token
            truth = reqs[i][1][done[i]:]
            kept = kept_prefix(full.tokens, truth)
            kept_total += kept
            if kept:
                sources.add(int(got.source[j]))
            emitted = truth[: kept + 1]
            matrix[i, pos[i]: pos[i] + len(emitted)] = emitted
            drafter.extend(emitted)
            ref[i] = (drafter, (full, emitted))
            slot[i] = (slot[i][0], pos[i])
            pos[i] += len(emitted)
            done[i] += len(emitted)
            steps.append((i, full, emitted))
        # The policy learns every row of the step in order (decode.step), the pool at the row's next step, all rows
        # before drafting; a request that ends now is never stepped again, so the pool never sees its last tokens.
        if between is not None:
            between(rng)
        go_on = [(i, f, e) for i, f, e in steps if done[i] < len(reqs[i][1])]
        policy.observe_rows([f for _, f, _ in go_on], [e for _, _, e in go_on], [i for i, _, _ in go_on])
        for i in [i for i in active if done[i] >= len(reqs[i][1])]:
            active.remove(i)
            assert pool.tokens(slot[i][0]).tolist() == matrix[i, : slot[i][1]].tolist()   # what it was given
            pool.remove(slot[i][0])
    assert not growth or pool.swaps > 0, "guard: slots grew through their copies"
    return compared, kept_total, sources


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k", [1, 4, 8])
def test_pool_equals_index_and_policy(seed, k):
    compared, kept, _ = _run(seed, k, vocab=8, corpora=[])
    assert compared > 50 and kept > 0, "guard: drafts were kept"


def test_pool_slots_grow_through_copies():
    compared, kept, _ = _run(7, 8, vocab=8, corpora=[], growth=True)
    assert compared > 50 and kept > 0


@pytest.mark.parametrize("seed", range(3))
def test_pool_with_corpora_equals_sources_proposer(seed):
    rng = np.random.default_rng(100 + seed)
    memory, refs = Memory(10_000), References()
    for j in range(4):
        memory.add(rng.integers(3, 8, size=40).astype(np.int32))
        refs.register(f"doc{j}", tokens=rng.integers(3, 8, size=60).astype(np.int32))
    compared, kept, _ = _run(seed, 8, vocab=8, corpora=[("memory", memory), ("references", refs)])
    assert compared > 50 and kept > 0


def test_pool_reads_a_memory_that_changes_between_steps(monkeypatch):
    """A corpus stored into between steps (a finished request's output): the pool sets the changed entry of its
    corpus list in place (building a numba List costs ~0.5 ms a call), and its drafts stay the reference's."""
    memory, refs = Memory(10_000), References()
    refs.register("doc", tokens=np.arange(3, 8, dtype=np.int32).repeat(8))
    memory.add(np.arange(3, 8, dtype=np.int32))
    built = []
    monkeypatch.setattr(pool_module, "List", lambda *a: built.append(len(a)) or List(*a))   # (a slot list: no args)

    def store(rng):
        memory.add(rng.integers(3, 8, size=30).astype(np.int32))

    compared, kept, sources = _run(11, 8, vocab=8, corpora=[("memory", memory), ("references", refs)], between=store)
    assert compared > 50 and kept > 0 and 1 in sources and len(memory) > 50  # guard: drafts kept from the memory
    assert sum(built) == 1                      # the corpus list built once, then set in place


@pytest.mark.parametrize("seed", range(3))
def test_pool_with_corpora_per_row_equals_sources_proposer(seed):
    """Rows read different corpora (two memories, as two scopes; shared references; a prediction of their own):
    each row's drafts, sources and probabilities are those of a SourcesProposer over its own corpora alone."""
    rng = np.random.default_rng(200 + seed)
    scopes = [Memory(10_000), Memory(10_000)]
    refs = References()
    for j in range(3):
        for memory in scopes:
            memory.add(rng.integers(3, 8, size=40).astype(np.int32))
        refs.register(f"doc{j}", tokens=rng.integers(3, 8, size=60).astype(np.int32))
    predictions = {}

    def corpora_of(i):
        if i not in predictions:
            predictions[i] = References()
            predictions[i].register("prediction", tokens=rng.integers(3, 8, size=50).astype(np.int32))
        return [("memory", scopes[i % 2]), ("references", refs), ("prediction", predictions[i])]

    compared, kept, sources = _run(seed, 8, vocab=8, corpora=[], corpora_of=corpora_of)
    assert compared > 50 and kept > 0
    assert {1, 3} <= sources, "guard: drafts from a memory and from the row's own prediction were kept"


def test_row_corpora_must_name_given_corpora():
    pool = IndexPool(4)
    s = pool.add(8)
    matrix = np.arange(8, dtype=np.int32)[None, :]
    with pytest.raises(ValueError, match="row_corpora"):
        pool.step(matrix, [0], [s], [0], [8], [4], [False], [], row_corpora=np.array([[0, -1, -1]]))


@settings(max_examples=200, deadline=None)
@given(p=st.lists(st.lists(st.floats(0.0, 1.0), min_size=4, max_size=4), min_size=1, max_size=5),
       avail=st.lists(st.integers(0, 4), min_size=5, max_size=5), cost=st.floats(0.0, 1.0))
def test_ragged_lengths_is_the_best_choice(p, avail, cost):
    # Brute force over every choice of prefix lengths: the rule's choice has the best value per cost.
    p = -np.sort(-np.array(p), axis=1)                 # a row's probabilities fall along its draft
    avail = np.array(avail[: len(p)])
    got = ragged_lengths(p, avail, cost)
    r = len(p)

    def rate(lengths):
        return (r + sum(p[i, :n].sum() for i, n in enumerate(lengths))) / (1 + cost * (r + sum(lengths)))
    best = max(rate(c) for c in np.ndindex(*(avail + 1)))
    assert np.all(got <= avail) and rate(got) >= best - 1e-9


def test_new_slots_start_from_what_all_slots_saw():
    # A slot whose long-match drafts are always kept: a new slot that copies as well is priced from the pool as soon
    # as its first step puts it in the copying class (its first step is priced by what every slot's first step saw).
    pool = IndexPool(8)
    matrix = np.tile(np.arange(3, 13, dtype=np.int32), 40)[None, :]     # a repeating text: long matches
    s = pool.add(0)
    got = pool.step(matrix, np.array([0]), np.array([s]), np.array([0]), np.array([100]), np.array([8]),
                    np.array([False]))
    fresh = got.p_kept[0, : got.lengths[0]].copy()
    end = 100
    while end < 300:                      # the text goes on as before: every draft token is kept, and one more
        start, end = end, end + int(got.lengths[0]) + 1
        got = pool.step(matrix, np.array([0]), np.array([s]), np.array([start]), np.array([end]), np.array([8]),
                        np.array([True]))
        assert got.kept[0] == 8
    t = pool.add(0)
    got = pool.step(matrix, np.array([0]), np.array([t]), np.array([0]), np.array([100]), np.array([8]),
                    np.array([False]))
    got = pool.step(matrix, np.array([0]), np.array([t]), np.array([100]), np.array([100 + int(got.lengths[0]) + 1]),
                    np.array([8]), np.array([True]))
    # From the measured root (0.99 per token after a long match) toward what the pool saw (every token kept).
    assert got.kept[0] == 8
    assert got.lengths[0] == 8 and np.all(got.p_kept[0, :8] > fresh) and got.p_kept[0, 7] > fresh[7] + 0.05


def test_growth_work_per_step_is_bounded_at_any_context():
    # Two rows grow from 20k to 140k tokens, 64 a step: their rooms double at 32k, 64k and 128k. No step may write
    # more than the migration budget (MIGRATE_WORK units, and MIGRATE_PER_TOKEN per appended token), whatever the
    # context: growth never copies a whole room in one step.
    from lookup_decode.core.pool import _HASH_PER_WORK, MIGRATE_PER_TOKEN, MIGRATE_WORK
    rng = np.random.default_rng(0)
    end, per_step = 140_000, 64
    matrix = np.resize(rng.integers(3, 5000, size=997), (2, end)).astype(np.int32)
    pool = IndexPool(8)
    slots = np.array([pool.add(20_000), pool.add(20_000)])
    rows, limits = np.arange(2), np.full(2, 8)
    pool.step(matrix, rows, slots, np.zeros(2, np.int64), np.full(2, 20_000), limits, np.zeros(2, np.bool_))
    most, n = 0, 20_000
    while n + per_step <= end:
        before = pool.copied
        got = pool.step(matrix, rows, slots, np.full(2, n), np.full(2, n + per_step), limits, np.ones(2, np.bool_))
        most = max(most, pool.copied - before)
        n += per_step
    assert pool.swaps == 6 and pool.cap[slots].tolist() == [262_144, 262_144]
    budget = MIGRATE_WORK + MIGRATE_PER_TOKEN * 2 * per_step
    assert most <= budget * max(12 * _HASH_PER_WORK, 4 + 16 * 2 + 12 * 3 + 12 * 8 + 8), most
    assert got.lengths.min() > 0 and pool.tokens(int(slots[0])).tolist() == matrix[0, :n].tolist()


def test_a_new_pool_has_the_growth_kernels_compiled():
    # Growth inside an engine step must not wait for numba: a memory outgrowing its room at batch 16 once stalled a
    # vLLM step for 121 ms while `index.grown`'s rehash compiled. Building a pool compiles (or loads) them.
    from lookup_decode.core import automaton as K
    IndexPool(8)
    assert K.extend.signatures and K.rehash.signatures


def test_growth_reports_what_reserve_adds():
    # Before every step, growth() (what a memory bound checks) equals the change of pool.bytes the step's reserve
    # makes: a room grown now, or a growing copy started.
    rng = np.random.default_rng(1)
    matrix = np.resize(rng.integers(3, 5000, size=997), (2, 12_000)).astype(np.int32)
    pool = IndexPool(8)
    pool.migrate_from = 1024
    slots = np.array([pool.add(0), pool.add(0)])
    n, seen = np.array([0, 0]), set()
    while n.max() < 11_000:
        more = np.array([int(rng.integers(1, 40)), int(rng.integers(1, 3000 if rng.random() < 0.05 else 40))])
        expect = pool.growth(slots, more).sum()
        before = pool.bytes
        pool.reserve(slots, more)
        assert pool.bytes - before == expect
        seen.add("copy" if pool.copies else "none")
        pool.step(matrix, np.arange(2), slots, n, n + more, np.full(2, 8), n > 0)
        n = n + more
    assert pool.swaps > 0 and "copy" in seen


def test_pool_prices_with_the_constants_it_is_given():
    from lookup_decode.core import acceptance as A
    root = [0.5] * A.N_BUCKETS
    pool = IndexPool(4, params=A.params(root_first=root, root_later=root))
    matrix = np.array([[5, 6, 7, 8, 9, 5, 6, 7]], np.int32)
    got = pool.step(matrix, [0], [pool.add(8)], [0], [8], [4], [False])
    assert got.lengths[0] == 4 and np.allclose(got.p_kept[0, :3], [0.5, 0.25, 0.125])


def _edit_steps(role, fast_apply: bool = False, seed: int = 5, k: int = 8) -> tuple[int, int]:
    """(output tokens, steps) of a code edit replayed through the pool: the prompt holds the original file; the
    output is the file with a 6-token line inserted every 24 tokens (fast_apply: a file of repeated lines, some
    deleted, others inserted), and the prediction is the output (fast_apply: the original file, what editors send)
    in pool role `role` (2: the prediction's; 1: plain references; None: none). Each step emits the kept prefix and
    one more token."""
    rng = np.random.default_rng(seed)
    if fast_apply:
        lines = [rng.integers(3, 60, size=int(rng.integers(4, 12))).astype(np.int32) for _ in range(12)]
        file = [lines[int(rng.integers(0, 12))] for _ in range(60)]
        edited = [x for i, line in enumerate(file) if i % 7 != 3
                  for x in ([line, rng.integers(60, 90, size=5).astype(np.int32)] if i % 5 == 0 else [line])]
        file, output = np.concatenate(file), np.concatenate(edited)
    else:
        file = rng.integers(3, 200, size=400).astype(np.int32)
        output = np.concatenate([x for a in range(0, len(file), 24)
                                 for x in (file[a: a + 24], rng.integers(200, 400, size=6).astype(np.int32))])
    prompt = np.concatenate([[1, 2, 1], file, [2, 1]]).astype(np.int32)
    prediction = References()
    prediction.register("prediction", tokens=file if fast_apply else output)
    pool = IndexPool(k, max_match=64 if fast_apply else 16)
    matrix = np.zeros((1, len(prompt) + len(output) + k + 2), np.int32)
    matrix[0, : len(prompt)] = prompt
    matrix[0, len(prompt)] = output[0]
    s, start, end, done, steps = pool.add(0), 0, len(prompt) + 1, 1, 0
    roles = np.full((1, 3), -1)
    if role is not None:
        roles[0, role] = 0
    while done < len(output):
        with prediction.reading() as c:
            got = pool.step(matrix, [0], [s], [start], [end], [min(k, len(output) - done - 1)], [start > 0], [c],
                            row_corpora=roles)
        kept = kept_prefix(got.tokens[0, : got.lengths[0]], output[done:])
        emitted = output[done: done + kept + 1]
        matrix[0, end: end + len(emitted)] = emitted
        start, end, done, steps = end, end + len(emitted), done + len(emitted), steps + 1
    return len(output), steps


def test_a_prediction_leads_where_the_prompt_holds_the_file():
    """The prediction's drafts lead: accepted lengths near K at every step. As plain references the same text loses
    every tie of capped matches to the prompt's copy of the file, whose drafts break at each insertion."""
    n, lead = _edit_steps(2)
    _, plain = _edit_steps(1)
    assert n / lead >= 0.8 * (8 + 1) and lead < plain, (n, lead, plain)


def test_fast_apply_prediction_follows_the_file_through_the_edit():
    """Fast apply: the prediction is the file before the edit. It is followed through insertions and deletions
    (re-synchronised near where it broke): never more steps than the same text as plain references or none, fewer
    over five edits; where it stops matching it costs nothing."""
    steps = np.array([[_edit_steps(role, True, seed)[1] for role in (2, 1, None)] for seed in range(5)])
    assert np.all(steps[:, 0] <= steps[:, 1]) and np.all(steps[:, 1] <= steps[:, 2])
    assert steps[:, 0].sum() < steps[:, 1].sum(), steps


def test_stale_kernels_of_a_module_are_dropped_when_a_file_it_compiles_in_changes(tmp_path, monkeypatch):
    """A module whose kernels compile in another file's: its cached kernels go when that file changed, not before."""
    package = tmp_path / "lookup_decode"
    (package / "core").mkdir(parents=True)
    dep, module, cache = package / "core" / "dep.py", package / "core" / "mod.py", package / "core" / "__pycache__"
    dep.write_text("x = 1\n")
    monkeypatch.setattr("lookup_decode.core.pool.__file__", str(package / "core" / "pool.py"))
    cache.mkdir()
    kernel = cache / "mod.f-1.py311.nbi"
    kernel.write_text("")
    drop_stale_cache(str(module), ("core/dep.py",))     # no digest yet: dropped
    assert not kernel.exists() and (cache / "mod.deps").exists()
    kernel.write_text("")
    drop_stale_cache(str(module), ("core/dep.py",))     # unchanged: kept
    assert kernel.exists()
    dep.write_text("x = 2\n")
    drop_stale_cache(str(module), ("core/dep.py",))     # changed: dropped
    assert not kernel.exists()


def test_the_kernel_constructors_take_their_fields_in_order():
    """The structrefs' constructors name each field (numba types star-args in Python): in the fields' own order."""
    import inspect

    from lookup_decode.core import pool as pool_module
    from lookup_decode.engines.vllm import table_kernels
    for constructor, fields in [(getattr(pool_module, "_new_kernel"), getattr(pool_module, "_KERNEL_FIELDS")),
                                (table_kernels.new_table_kernel, table_kernels.TABLE_FIELDS)]:
        assert tuple(inspect.signature(constructor.py_func).parameters) == tuple(fields)
