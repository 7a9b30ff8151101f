"""lookup_decode.vllm.LookupDrafter under a CPU simulation of vLLM's runner (tests/sim_runner.py); the real
engine's tests are tests/test_vllm_engine.py (scripts/test_vllm.sh).

The drafter's full proposals must be, row for row, those the transformers path makes for the same token stream
(the replay runs that path's `decode.step`) while rows move, finish, join, go unscheduled, prefill in chunks,
are preempted and recomputed, or the engine skips the drafter; the lengths it sends must be the best by its
cost model; its state must stay bounded and never orphaned; and it must never fail the engine.
"""

import importlib.util
import logging
import time
from dataclasses import fields
from types import SimpleNamespace

import numpy as np
import pytest

from lookup_decode.core.index import SuffixIndex
from lookup_decode.core.policy import DraftPolicy
from lookup_decode.engines.replay import replay
from lookup_decode.engines.vllm import drafter as lv
from lookup_decode.engines.vllm import keeper
from lookup_decode.engines.vllm import settings as lvs
from lookup_decode.engines.vllm.batch_drafter import BatchDrafter, EngineRequests, RequestInfo
from lookup_decode.sources.corpus import CorpusFileError
from lookup_decode.sources.memory import Memory, References
from lookup_decode.sources.proposer import SourcesProposer
from tests.sim_runner import SimRequest, SimRunner

EOS = (2,)


def _requests(seed: int, n: int, vocab: int = 12, copy: bool = True, chunk: int = 1 << 30) -> list[SimRequest]:
    """Prompts over a small vocabulary whose continuations copy spans of the prompt (so drafts get accepted)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = rng.integers(3, vocab, size=int(rng.integers(20, 120))).astype(np.int32)
        pieces = []
        while sum(map(len, pieces)) < 60:
            if copy and rng.random() < 0.7:
                a = int(rng.integers(0, len(prompt) - 8))
                pieces.append(prompt[a: a + int(rng.integers(4, 20))])
            else:
                pieces.append(rng.integers(3, vocab, size=int(rng.integers(1, 4))).astype(np.int32))
        out.append(SimRequest(prompt, np.concatenate(pieces).astype(np.int32), chunk=chunk))
    return out


class _Recording:
    """A drafter that records every proposal of the one it wraps."""

    def __init__(self, drafter):
        self.drafter, self.fulls = drafter, []

    def extend(self, tokens):
        self.drafter.extend(tokens)

    def propose(self, max_tokens):
        self.fulls.append(self.drafter.propose(max_tokens))
        return self.fulls[-1]


def transformers_path(req: SimRequest, drafter_of, k: int, cost):
    """Drafts and tokens emitted per step by the transformers path (`decode.step` in a replay) for the
    request's stream, from the step after the prefill's token on; also each step's draft limit."""
    drafter = _Recording(drafter_of())
    drafter.extend(np.concatenate([req.prompt, req.truth[:1]]))
    stats = replay(drafter, req.truth[1:], k, DraftPolicy(k, cost))
    drafts = [f.tokens[:d].tolist() for f, d in zip(drafter.fulls, stats.draft_lengths)]
    emitted = [a + 1 for a in stats.accepted_lengths]
    left = len(req.truth) - 1 - np.concatenate([[0], np.cumsum(emitted)[:-1]]).astype(int)
    return drafts, emitted, np.minimum(k, left - 1)


def _compare(requests, drafter_of, k, cost):
    """Assert equal drafts and emitted counts on every step where both paths could draft k tokens."""
    compared = accepted = 0
    for r in requests:
        drafts, emitted, limits = transformers_path(r, drafter_of, k, cost)
        steps = int(np.sum(limits == k))          # near the end the transformers path caps drafts at what is left
        assert r.drafts[:steps] == drafts[:steps]
        assert r.emitted[:steps] == emitted[:steps]
        compared += steps
        accepted += sum(e - 1 for e in emitted[:steps])
    return compared, accepted


def _drafter(k=8, settings=None, **kw):
    return lv.LookupDrafter.from_settings(settings or lv.Settings(), k, eos_token_ids=EOS, **kw)


# Every proposed token sent: drafts are the full proposals; no memory: drafts come from the request alone.
FULL = lv.Settings(adaptive=False, memory=False)


class FrozenMemory(Memory):
    """A memory that stores nothing: the same for the drafter and the transformers path it is compared with."""

    def remember(self, prompt, output, *, replaces=None):
        return None


@pytest.mark.parametrize("k", [1, 4, 16])
def test_drafts_equal_transformers_path_while_rows_move(k):
    requests = _requests(seed=k, n=40, chunk=32)
    # No request retires while it waits outside a full batch: each is indexed once (test_preempted_* rebuilds).
    drafter = _drafter(k, lv.Settings(adaptive=False, idle_steps=10**6, memory=False))
    SimRunner(drafter, max_num_reqs=8, seed=k, p_unscheduled=0.05, p_swap=0.3, arrivals_per_step=2, k=k).run(requests)
    compared, accepted = _compare(requests, lambda: SuffixIndex(eos_token_ids=EOS), k, None)
    assert compared > 200 and accepted > 100          # guard: drafts were produced and accepted
    assert drafter.stats.built == len(requests)       # every request indexed once, then only extended
    assert drafter.stats.extended > 0 and drafter.stats.accepted > 0


def test_drafts_equal_transformers_path_with_memory_and_references(tmp_path):
    rng = np.random.default_rng(7)
    requests = _requests(seed=3, n=24)
    memory, refs = FrozenMemory(10_000), References()
    for r in requests[:12]:                  # earlier outputs: later requests copy some of them
        memory.add(r.truth)
    refs.register("doc", tokens=rng.integers(3, 12, size=400))
    k = 8
    # A frozen memory: finished requests store nothing, so the memory is the same for both paths.
    drafter = _drafter(k, lv.Settings(idle_steps=10**6, adaptive=False), memory=memory,
                       references=refs)
    SimRunner(drafter, max_num_reqs=6, seed=1, p_swap=0.5, arrivals_per_step=1).run(requests)
    corpora = [("memory", memory), ("references", refs)]
    compared, accepted = _compare(requests, lambda: SourcesProposer(SuffixIndex(eos_token_ids=EOS), corpora,
                                                                    eos_token_ids=EOS), k, None)
    assert compared > 100 and accepted > 50
    assert drafter.stats.sources["memory"] > 0       # guard: the memory really drafted


def test_sent_lengths_are_the_best_for_the_learned_step_cost():
    """Adaptive: each step sends the draft prefixes `ragged_lengths` picks for the cost the drafter has learned
    from the (simulated) step times; the learned cost approaches the simulated one."""
    sent = []

    class Watch(lv.LookupDrafter):
        def _draft(self, *args):
            out = super()._draft(*args)
            sent.append((self.cost.token_cost, out.lengths.tolist()))
            return out

    requests = _requests(seed=2, n=16)
    drafter = Watch.from_settings(lv.Settings(), 8, eos_token_ids=EOS)
    runner = SimRunner(drafter, max_num_reqs=6, seed=2, arrivals_per_step=1, step_seconds=lambda n: 0.05 + 0.004 * n)
    drafter.clock = runner.clock
    runner.run(requests)
    assert drafter.cost.token_cost == pytest.approx(0.08, rel=0.15)   # 0.004 / 0.05
    full = _drafter(8, FULL)
    SimRunner(full, max_num_reqs=6, seed=2, arrivals_per_step=1).run(_requests(seed=2, n=16))
    assert 0 < drafter.stats.drafted < full.stats.drafted             # expensive tokens: shorter drafts, not none
    assert drafter.stats.accepted / drafter.stats.drafted > full.stats.accepted / full.stats.drafted


def test_stands_down_where_drafts_do_not_pay():
    """Chat-like requests (little to copy) on a step whose tokens are dear: almost nothing is drafted, while
    the same requests on a flat-cost engine (a GPU) keep drafting what the index offers."""
    def run(seconds, device):
        requests = _requests(seed=4, n=16, copy=False)
        drafter = _drafter(8, device=device)
        runner = SimRunner(drafter, max_num_reqs=8, seed=4, step_seconds=seconds)
        drafter.clock = runner.clock
        runner.run(requests)
        return drafter.stats
    dear, flat = run(lambda n: 0.05 + 0.01 * n, "cpu"), run(lambda n: 0.05 + 1e-6 * n, "cuda")
    assert dear.drafted < 0.25 * flat.drafted and flat.drafted > 100


def test_a_skipped_step_continues_the_requests_without_orphans():
    """vLLM skips the drafter for the whole batch while any row is within k of max_model_len: the requests are
    continued (not rebuilt), nothing is learned from the missed tokens, and no state is left behind."""
    rng = np.random.default_rng(9)
    requests = [SimRequest(rng.integers(3, 12, size=int(n)).astype(np.int32), np.tile(np.arange(3, 9), 30)[:int(m)]
                           .astype(np.int32)) for n, m in [(40, 150), (30, 100), (60, 150), (20, 80)]]
    drafter = _drafter(4, FULL)
    runner = SimRunner(drafter, max_num_reqs=4, max_model_len=200, k=4)
    runner.run(requests)
    assert runner.skipped > 0 and drafter.stats.continued > 0        # guard: the skip happened and was followed
    assert drafter.stats.built == len(requests)                      # nobody rebuilt from a whole row
    drafter.flush()
    assert drafter.live_requests == 0 and drafter.index_bytes == 0
    after = [len(d) for r in requests for d in r.drafts[-5:]]
    assert sum(after) > 0                                            # drafting went on after the skips


@pytest.mark.parametrize("steps", [3, 40])
def test_preempted_requests_keep_their_prompt_length(steps, tmp_path):
    """Preempted for fewer steps than idle_steps: the state waits and is extended; for more: it was retired, and
    the rebuilt request gets its prompt length back. Either way every entry stored in the memory is output only
    (never part of a prompt): a request retired while preempted stores what it had emitted, a prefix of its
    output, and its whole output when it finishes."""
    requests = _requests(seed=6, n=12)
    memory = Memory(100_000)
    drafter = _drafter(8, lv.Settings(idle_steps=16), memory=memory)
    runner = SimRunner(drafter, max_num_reqs=4, seed=6, p_preempt=0.05, preempt_steps=steps)
    runner.run(requests)
    drafter.flush()
    assert runner.preempted > 0
    if steps > 16:
        assert drafter.stats.resumed > 0
    stored = [e.tokens.tolist() for e in memory.entries()]
    outputs = [r.truth.tolist() for r in requests]
    assert stored and all(any(o[: len(s)] == s for o in outputs) for s in stored)
    assert sum(s in outputs for s in stored) == len(requests)           # every whole output, once
    # a prefix stored while its request was away goes first at the next eviction (unless drafts from it were kept)
    prefixes = [e for e in memory.entries() if e.tokens.tolist() not in outputs]
    assert prefixes and all(e.last_used == -1 or e.accepted > 0 for e in prefixes)


def test_sampled_rows_draft_and_learn_lower_acceptance():
    """Point-mass rejection sampling: drafts are kept with the target's probability of the token; the drafter keeps
    drafting and its acceptance model sees fewer kept tokens than under greedy."""
    greedy, sampled = _drafter(8, FULL), _drafter(8, FULL)
    SimRunner(greedy, max_num_reqs=4, seed=3).run(_requests(seed=8, n=12))
    SimRunner(sampled, max_num_reqs=4, seed=3, p_off=0.3, vocab=12).run(_requests(seed=8, n=12))
    assert sampled.stats.accepted > 0
    assert sampled.stats.accepted / sampled.stats.drafted < greedy.stats.accepted / greedy.stats.drafted


def test_an_exception_inside_propose_is_logged_once_and_serving_goes_on(caplog):
    class Faulty(lv.LookupDrafter):
        calls = 0

        def _draft(self, *args):
            Faulty.calls += 1
            if Faulty.calls in (3, 5):
                raise RuntimeError("boom")
            return super()._draft(*args)

    drafter = Faulty.from_settings(lv.Settings(), 8, eos_token_ids=EOS)
    requests = _requests(seed=1, n=6)
    with caplog.at_level(logging.ERROR, logger="lookup_decode.vllm"):
        SimRunner(drafter, max_num_reqs=4).run(requests)
    assert drafter.stats.errors == 2 and len([r for r in caplog.records if "drafter failed" in r.message]) == 1
    assert all(r.done for r in requests) and drafter.stats.accepted > 0     # the engine went on, drafting too
    assert [r.out for r in requests] == [r.truth.tolist() for r in requests]


def test_identical_requests_in_one_batch_keep_separate_states():
    """Two rows with equal content (parallel sampling of one prompt) each get a state and the same drafts."""
    req = _requests(seed=5, n=1)[0]
    twins = [SimRequest(req.prompt, req.truth), SimRequest(req.prompt.copy(), req.truth.copy())]
    drafter = _drafter(8, FULL)
    SimRunner(drafter, max_num_reqs=4).run(twins)
    assert twins[0].drafts == twins[1].drafts and sum(map(len, twins[0].drafts)) > 0
    assert drafter.stats.built == 2


def test_partial_prefill_rows_get_no_draft_and_no_state():
    drafter = _drafter(4, FULL)
    tokens = np.zeros((2, 64), np.int32)
    tokens[0, :10] = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    assert drafter.propose([[], []], np.array([10, 0]), tokens) == [[], []]
    assert drafter.live_requests == 0
    assert drafter.propose([[4]], np.array([10]), tokens) == [[5, 6, 3, 4]]


def test_memory_stays_within_bounds_over_10000_requests(tmp_path):
    bound = 40 * SuffixIndex.bytes_for(1)                # room for 40 short requests' indexes
    settings = lv.Settings(max_index_bytes=bound, idle_steps=4, memory_tokens=5_000,
                           memory_save=str(tmp_path / "replica.mem"), save_every=500)
    drafter = lv.LookupDrafter.from_settings(settings, 4, eos_token_ids=EOS)
    peak = {"bytes": 0, "live": 0}

    def check(runner):
        assert drafter.index_bytes <= bound
        assert drafter.memory.n_tokens <= settings.memory_tokens
        peak["bytes"] = max(peak["bytes"], drafter.index_bytes)
        peak["live"] = max(peak["live"], drafter.live_requests)

    rng = np.random.default_rng(0)
    requests = [SimRequest(rng.integers(3, 50, size=12).astype(np.int32), rng.integers(3, 50, size=4).astype(np.int32))
                for _ in range(10_000)]
    SimRunner(drafter, max_num_reqs=48, seed=0, p_unscheduled=0.02, on_step=check, k=4).run(requests)
    assert drafter.stats.built >= 10_000 and drafter.stats.retired + drafter.stats.evicted > 9_000
    assert drafter.stats.refused > 0                  # 48 rows, room for 40: the bound was reached
    assert peak["bytes"] > bound // 2 and drafter.stats.stored > 9_000
    for _ in range(100):                            # written by the keeper thread within a few ticks
        if (tmp_path / "replica.mem").is_file():
            break
        time.sleep(0.1)
    assert Memory.load(tmp_path / "replica.mem").n_tokens > 0   # saved for other replicas
    assert drafter.pool.slots <= 64                  # slots are reused, never leaked


def test_a_replica_loads_memory_saved_by_another(tmp_path):
    """Replica A serves a request and saves its memory; replica B drafts that output for a new request."""
    req = _requests(seed=11, n=1, copy=False)[0]
    path = tmp_path / "shared.mem"
    a = lv.LookupDrafter.from_settings(lv.Settings(memory_save=str(path), idle_steps=1), 8, eos_token_ids=EOS)
    SimRunner(a, max_num_reqs=2).run([SimRequest(req.prompt, req.truth)])
    a.flush()
    b_settings = lv.Settings(memory=str(path))
    lonely = SimRequest(np.array([9, 9, 9, 9], np.int32), np.concatenate([[req.truth[0]], req.truth]))
    b = lv.LookupDrafter.from_settings(b_settings, 8, eos_token_ids=EOS)
    SimRunner(b, max_num_reqs=2).run([lonely])
    isolated = SimRequest(lonely.prompt, lonely.truth)
    SimRunner(_drafter(8), max_num_reqs=2).run([isolated])
    assert b.stats.sources["memory"] > 10
    assert len(lonely.emitted) < len(isolated.emitted)      # fewer steps for the same tokens


def test_memory_is_saved_at_exit_with_the_live_requests(tmp_path):
    """vLLM calls nothing on a drafter at shutdown: the exit hook stores the live requests' outputs and saves."""
    path = tmp_path / "exit.mem"
    settings = lv.Settings(memory_save=str(path), save_seconds=3600)    # the keeper thread waits
    drafter = lv.LookupDrafter.from_settings(settings, 8, eos_token_ids=EOS)
    runner = SimRunner(drafter, max_num_reqs=2)
    runner.run(_requests(seed=12, n=2))
    assert drafter.live_requests > 0 and not path.exists()
    drafter.shutdown()
    assert Memory.load(path).n_tokens > 0 and drafter.live_requests == 0


# -- construction from vLLM's config and environment -------------------------------------------------

def _vllm_config(k=4, vocab=50, max_model_len=256):
    model = SimpleNamespace(max_model_len=max_model_len, hf_config=SimpleNamespace(vocab_size=vocab, eos_token_id=2),
                            tokenizer=None)
    return SimpleNamespace(speculative_config=SimpleNamespace(model="lookup_decode.vllm.LookupDrafter",
                                                              method="custom_class", num_speculative_tokens=k),
                           model_config=model)


@pytest.fixture
def clean_env(monkeypatch):
    for name in [f.name for f in fields(lv.Settings)] + ["config"]:
        monkeypatch.delenv(lv.ENV_PREFIX + name.upper(), raising=False)
    return monkeypatch


def test_additional_config_wins_over_environment_and_file(clean_env, tmp_path):
    (tmp_path / "s.json").write_text('{"k": 3, "min_match": 3, "max_match": 9}')
    clean_env.setenv("LOOKUP_DECODE_CONFIG", str(tmp_path / "s.json"))
    clean_env.setenv("LOOKUP_DECODE_MIN_MATCH", "2")
    config = _vllm_config(k=8)
    config.additional_config = {"lookup_decode": {"k": 5, "adaptive": False}}
    drafter = lv.LookupDrafter(config)
    assert (drafter.k, drafter.settings.min_match, drafter.settings.max_match) == (5, 2, 9)
    assert drafter.settings.adaptive is False
    config.additional_config = {"lookup_decode": {"kk": 1}}
    with pytest.raises(ValueError, match="unknown settings"):
        lv.LookupDrafter(config)


def test_replicas_write_their_own_memory_files_and_one_tensor_rank_writes(clean_env, tmp_path):
    config = _vllm_config()
    config.parallel_config = SimpleNamespace(data_parallel_rank=1, data_parallel_size=2)
    clean_env.setenv("LOOKUP_DECODE_MEMORY_SAVE", str(tmp_path / "mem.npz"))
    assert lv.LookupDrafter(config).keeper.memory_save == str(tmp_path / "mem-replica1.npz")
    clean_env.setenv("LOOKUP_DECODE_MEMORY_SAVE", str(tmp_path / "m{replica}.npz"))
    assert lv.LookupDrafter(config).keeper.memory_save == str(tmp_path / "m1.npz")
    assert lvs.replica_path("a.npz", 0, 1) == "a.npz"
    # Every replica's files load with one pattern.
    for i in range(2):
        memory = Memory(100)
        memory.add([3, 4, 5 + i])
        memory.save(tmp_path / f"r{i}.npz")
    clean_env.setenv("LOOKUP_DECODE_MEMORY", str(tmp_path / "r*.npz"))
    assert lv.LookupDrafter(config).memory.n_tokens == 6


def test_a_config_without_eos_builds(clean_env):
    config = _vllm_config()
    config.model_config.hf_config = SimpleNamespace(vocab_size=50)      # no eos_token_id attribute at all
    assert lv.LookupDrafter(config).eos == ()


def test_constructed_from_vllm_config_and_environment(clean_env, tmp_path):
    (tmp_path / "s.json").write_text('{"k": 3, "draft_cost": 0.0}')
    clean_env.setenv("LOOKUP_DECODE_CONFIG", str(tmp_path / "s.json"))
    clean_env.setenv("LOOKUP_DECODE_MIN_MATCH", "2")
    drafter = lv.LookupDrafter(_vllm_config(k=4))
    assert drafter.k == 3 and drafter.settings.min_match == 2 and drafter.eos == (2,)
    tokens = np.zeros((1, 256), np.int32)
    tokens[0, :9] = [5, 6, 7, 8, 9, 5, 6, 7, 8]
    assert drafter.propose([[8]], np.array([9]), tokens) == [[9, 5, 6]]
    drafter.load_model()


@pytest.mark.parametrize("k", [0, -1])
def test_num_speculative_tokens_below_one_fails_at_construction(clean_env, k):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        lv.LookupDrafter(_vllm_config(k=k))


def test_unreadable_memory_file_fails_at_construction(clean_env, tmp_path):
    bad = tmp_path / "bad.mem"
    bad.write_bytes(b"not a memory file")
    clean_env.setenv("LOOKUP_DECODE_MEMORY", str(bad))
    with pytest.raises(CorpusFileError):
        lv.LookupDrafter(_vllm_config())
    clean_env.setenv("LOOKUP_DECODE_MEMORY", str(tmp_path / "missing.mem"))
    with pytest.raises(FileNotFoundError):
        lv.LookupDrafter(_vllm_config())


def test_unreadable_references_fail_at_construction(clean_env, tmp_path):
    clean_env.setenv("LOOKUP_DECODE_REFERENCES", str(tmp_path / "nothing_here"))
    with pytest.raises(FileNotFoundError):
        lv.LookupDrafter(_vllm_config())
    (tmp_path / "refs").mkdir()
    (tmp_path / "refs" / "a.txt").write_text("some text")
    clean_env.setenv("LOOKUP_DECODE_REFERENCES", str(tmp_path / "refs"))
    with pytest.raises(ValueError, match="tokenizer"):       # text without a tokenizer named in the config
        lv.LookupDrafter(_vllm_config())


def test_memory_of_another_vocabulary_fails_at_construction(clean_env, tmp_path):
    memory = Memory(1000)
    memory.add([3, 4, 5, 70])
    memory.save(tmp_path / "big_vocab.mem")
    clean_env.setenv("LOOKUP_DECODE_MEMORY", str(tmp_path / "big_vocab.mem"))
    with pytest.raises(ValueError, match="vocabulary"):
        lv.LookupDrafter(_vllm_config(vocab=50))
    assert lv.LookupDrafter(_vllm_config(vocab=100)).memory.n_tokens == 4


def test_bad_settings_fail_at_construction(clean_env, tmp_path):
    clean_env.setenv("LOOKUP_DECODE_K", "many")
    with pytest.raises(ValueError, match="LOOKUP_DECODE_K"):
        lv.LookupDrafter(_vllm_config())
    clean_env.delenv("LOOKUP_DECODE_K")
    (tmp_path / "s.json").write_text('{"kk": 3}')
    clean_env.setenv("LOOKUP_DECODE_CONFIG", str(tmp_path / "s.json"))
    with pytest.raises(ValueError, match="unknown settings"):
        lv.LookupDrafter(_vllm_config())
    clean_env.setenv("LOOKUP_DECODE_CONFIG", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="no such settings file"):
        lv.LookupDrafter(_vllm_config())


def test_fingerprints_tell_rows_apart_by_length_and_sampled_positions():
    tokens = np.array([[5, 6, 7, 8] + [0] * 60, [5, 6, 7, 9] + [0] * 60], np.int32)
    f = lv.fingerprints(tokens, np.array([0, 1, 0, 1]), np.array([3, 3, 4, 4]))
    assert f[0] == f[1] and f[2] != f[3] and f[0] != f[2]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed (scripts/test_vllm.sh)")
def test_vllm_loads_the_drafter(clean_env):
    """The way vLLM's own test builds a custom proposer: a SimpleNamespace config."""
    from vllm.v1.spec_decode import custom_class_proposer as ccp
    drafter = ccp.create_custom_proposer(_vllm_config(k=4))     # the class path in speculative_config.model
    assert isinstance(drafter, lv.LookupDrafter)
    tokens = np.zeros((1, 256), np.int32)
    tokens[0, :9] = [5, 6, 7, 8, 9, 5, 6, 7, 8]
    drafts = drafter.propose(sampled_token_ids=[[8]], num_tokens_no_spec=np.array([9]), token_ids_cpu=tokens,
                             slot_mappings=None)
    assert drafts == [[9, 5, 6, 7]]


def test_index_bytes_stay_within_bound_when_indexes_grow():
    """Indexes double their buffers as requests grow past 1024 tokens; the bound still holds."""
    bound = 3 * SuffixIndex.bytes_for(1024)             # one grown index (2 units) fits, two do not
    drafter = lv.LookupDrafter.from_settings(lv.Settings(max_index_bytes=bound), 8, eos_token_ids=EOS)
    rng = np.random.default_rng(3)
    requests = []
    for _ in range(3):
        prompt = rng.integers(3, 40, size=1000).astype(np.int32)
        requests.append(SimRequest(prompt, np.concatenate([prompt[100:400], prompt[500:700]])))

    def check(runner):
        assert drafter.index_bytes <= bound

    SimRunner(drafter, max_num_reqs=3, on_step=check).run(requests)
    assert drafter.stats.evicted + drafter.stats.refused > 0      # guard: the bound was hit
    assert drafter.stats.accepted > 100                           # and drafting went on where an index fit


def test_benchmark_ngram_proposer_follows_vllm_rule():
    """The benchmark's port of vLLM's n-gram scan, driven as vLLM's runner drives its NgramProposer (the rule itself
    is checked against a brute force in tests/test_bench_harness.py, through the replay drafter that shares it)."""
    from benchmarks.harness.baselines import VllmNgramProposer, ngram_draft
    out = np.zeros(8, np.int32)
    d, matched = ngram_draft(np.array([1, 2, 3, 4, 2, 3], np.int32), 2, 3, 100, 4, out)
    assert (out[:d].tolist(), matched) == ([4, 2, 3], 2)   # vLLM's docstring example
    assert ngram_draft(np.array([1, 2, 3, 4, 2, 3], np.int32), 2, 3, 8, 4, out)[0] == 2    # max_model_len caps it
    proposer = VllmNgramProposer(4, 64, min_n=2, max_n=3)
    rows = np.zeros((2, 64), np.int32)
    rows[1, :6] = [1, 2, 3, 4, 2, 3]
    assert proposer.propose([[], [3]], np.array([0, 6]), rows) == [[], [4, 2, 3]]


# -- the memory of outputs: on by default, stored when a request finishes, saved on a bound of time ----------

def _copier_pair(eos: bool, rng_seed: int = 21) -> list[SimRequest]:
    """Two concurrent requests: A emits X and finishes (with EOS, or at max_tokens); B, which cannot know X from
    its own prompt, emits X after A has finished."""
    rng = np.random.default_rng(rng_seed)
    x = rng.integers(3, 200, size=40).astype(np.int32)
    a = SimRequest(rng.integers(3, 200, size=30).astype(np.int32), np.append(x, EOS[0]).astype(np.int32) if eos else x)
    b = SimRequest(rng.integers(3, 200, size=30).astype(np.int32),
                   np.concatenate([rng.integers(3, 200, size=60), x]).astype(np.int32))
    return [a, b]


@pytest.mark.parametrize("eos", [True, False])
def test_a_finished_output_is_drafted_at_once_by_a_concurrent_request(eos):
    """A's output enters the memory in the call its EOS was emitted in, or (finished at max_tokens) the first call
    its row is absent from; B, still decoding, then drafts it. Without the memory B copies nothing."""
    seen = {}

    def watch(runner):
        a = requests[0]
        if a.done and "done" not in seen:
            seen["done"] = runner.steps
        if len(drafter.memory) and "stored" not in seen:
            seen["stored"] = runner.steps

    requests = _copier_pair(eos)
    drafter = _drafter(8, lv.Settings(adaptive=False))
    SimRunner(drafter, max_num_reqs=4, on_step=watch).run(requests)
    alone = _copier_pair(eos)
    off = _drafter(8, FULL)
    SimRunner(off, max_num_reqs=4).run(alone)
    assert [r.out for r in requests] == [r.truth.tolist() for r in requests]
    assert seen["stored"] == seen["done"] + (0 if eos else 1)
    assert drafter.stats.sources["memory"] > 30 and off.stats.sources["memory"] == 0
    assert len(requests[1].emitted) < len(alone[1].emitted) - 20        # B: far fewer steps for the same tokens
    assert [e.tokens.tolist() for e in drafter.memory.entries()] == [r.truth.tolist() for r in requests]


def test_memory_false_turns_the_memory_off_and_the_default_is_on(clean_env):
    assert lv.LookupDrafter(_vllm_config()).memory.max_tokens == lv.Settings().memory_tokens
    clean_env.setenv("LOOKUP_DECODE_MEMORY", "false")
    assert lv.LookupDrafter(_vllm_config()).memory is None
    clean_env.delenv("LOOKUP_DECODE_MEMORY")
    config = _vllm_config()
    config.additional_config = {"lookup_decode": {"memory": False}}
    assert lv.LookupDrafter(config).memory is None
    config.additional_config = {"lookup_decode": {"memory": False, "memory_save": "m.npz"}}
    with pytest.raises(ValueError, match="MEMORY"):
        lv.LookupDrafter(config)
    read = [lvs.Settings.from_sources(environ={"LOOKUP_DECODE_MEMORY": v}).memory for v in ("off", "true", "a.npz")]
    assert read == [False, None, "a.npz"]
    assert lvs.Settings.from_sources(environ={"LOOKUP_DECODE_SAVE_SECONDS": "2.5"}).save_seconds == 2.5
    with pytest.raises(ValueError, match="SAVE_SECONDS"):
        lvs.Settings.from_sources(environ={"LOOKUP_DECODE_SAVE_SECONDS": "0"})
    requests = _requests(seed=13, n=8)
    drafter = _drafter(8, lv.Settings(memory=False))
    SimRunner(drafter, max_num_reqs=4).run(requests)
    assert drafter.stats.stored == 0 and drafter.stats.accepted > 0


def test_draft_cost_default_is_the_devices_prior():
    from lookup_decode.core.step_cost import device_token_cost
    assert lv.Settings().draft_cost is None
    assert _drafter(8).cost.token_cost == device_token_cost("cpu")
    assert _drafter(8, device="cuda").cost.token_cost == device_token_cost("cuda") < device_token_cost("cpu")
    assert _drafter(8, lv.Settings(draft_cost=0.3)).cost.token_cost == 0.3


def test_the_keeper_writes_memory_save_within_save_seconds_with_no_further_call(tmp_path, monkeypatch, caplog):
    """A server whose last request finished at max_tokens makes no further call: after IDLE_SECONDS the keeper
    stores the requests still known, and writes memory_save; the save is logged at DEBUG only (the INFO log
    stays quiet while serving)."""
    monkeypatch.setattr(keeper, "IDLE_SECONDS", 0.2)
    path = tmp_path / "m.npz"
    drafter = _drafter(4, lv.Settings(memory_save=str(path), save_seconds=0.2))
    tokens = np.zeros((1, 64), np.int32)
    tokens[0, :10] = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]
    with caplog.at_level(logging.DEBUG, logger="lookup_decode.vllm"):
        drafter.propose([[4]], np.array([10]), tokens)
        tokens[0, 10] = 5
        drafter.propose([[5]], np.array([11]), tokens)
        for _ in range(100):                        # up to 10 s on a busy machine; ~0.5 s when idle
            if path.is_file():
                break
            time.sleep(0.1)
        time.sleep(0.1)                             # the log line follows the write
    assert [e.tokens.tolist() for e in Memory.load(path).entries()] == [[4, 5]]
    assert drafter.stats.saves >= 1 and drafter.live_requests == 1      # stored, still known
    assert any("memory saved to" in r.message and r.levelno == logging.DEBUG for r in caplog.records)
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]


def test_the_keeper_logs_the_summary_once_idle_at_most_every_summary_seconds(monkeypatch, caplog):
    """vLLM's server force-kills its worker at shutdown, so the summary at exit never shows there: once the engine
    is idle after drafting the keeper logs it at INFO, once per idle period and at most every SUMMARY_SECONDS."""
    monkeypatch.setattr(keeper, "IDLE_SECONDS", 0.1)
    monkeypatch.setattr(keeper, "SUMMARY_SECONDS", 0.0)
    drafter = _drafter(4, lv.Settings())
    tokens = np.zeros((1, 64), np.int32)
    tokens[0, :10] = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]

    def summaries() -> list:          # this drafter's keeper only: an earlier test's keeper may still be ticking
        return [r for r in caplog.records if "drafter summary" in r.message and r.levelno == logging.INFO
                and r.thread == drafter.keeper.thread.ident]

    with caplog.at_level(logging.INFO, logger="lookup_decode.vllm"):
        drafter.propose([[4]], np.array([10]), tokens)
        for _ in range(100):                        # the keeper thread ticks every IDLE_SECONDS / 4
            if summaries():
                break
            time.sleep(0.1)
        time.sleep(0.5)                             # idle on: no second line without a new step
    assert len(summaries()) == 1 and "1 steps" in summaries()[0].message


def test_a_failing_save_is_logged_and_never_raised(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(keeper, "IDLE_SECONDS", 0.1)
    drafter = _drafter(4, lv.Settings(memory_save=str(tmp_path / "no" / "such" / "dir.npz"), save_seconds=0.1,
                                      save_every=10**6))
    requests = _requests(seed=14, n=4)
    with caplog.at_level(logging.ERROR, logger="lookup_decode.vllm"):
        SimRunner(drafter, max_num_reqs=4).run(requests)
        for _ in range(100):
            if any("saving the memory failed" in r.message for r in caplog.records):
                break
            time.sleep(0.1)
    assert any("saving the memory failed" in r.message for r in caplog.records)
    assert drafter.stats.errors == 0 and drafter.stats.accepted > 0 and drafter.keeper.thread.is_alive()


def test_calibration_counts_the_tokens_sent_and_what_was_kept_of_them():
    full = _drafter(8, FULL)
    SimRunner(full, max_num_reqs=4, seed=3).run(_requests(seed=8, n=12))
    rel, st = full.stats.reliability, full.stats
    assert sum(rel.kept) == st.accepted                 # every token sent is the full proposal: kept = accepted
    assert 0.8 * st.drafted < sum(rel.tokens) <= st.drafted     # the last draft of each request is never learned
    rows = st.calibration()
    assert rows and all(0 <= r.kept <= 1 and r.bin_low <= r.predicted <= r.bin_high for r in rows)
    adaptive = _drafter(8)
    runner = SimRunner(adaptive, max_num_reqs=4, seed=3, step_seconds=lambda n: 0.05 + 0.004 * n)
    adaptive.clock = runner.clock
    runner.run(_requests(seed=8, n=12))
    rel, st = adaptive.stats.reliability, adaptive.stats
    assert 0 < sum(rel.tokens) <= st.drafted and 0 < sum(rel.kept) <= st.accepted
    assert st.propose_max_s >= st.propose_s / st.steps > 0
    assert "calibration (predicted->kept" in st.summary() and "worst" in st.summary().splitlines()[0]


# -- the engine-neutral batch drafter, driven with plain arrays and ids --------------------------------------

def _engine(held, prompt_len=6, max_tokens=4, extra=None):
    extra = extra or {}
    return EngineRequests(list(held), set(held), lambda rid: RequestInfo(prompt_len=prompt_len, max_tokens=max_tokens,
                                                                           extra_args=extra.get(rid)))


def test_batch_drafter_drafts_for_plain_arrays_and_request_ids():
    """No vLLM and no runner: a token matrix, counts, tokens emitted and ids. Row 0 asks for no draft (a prefill),
    rows 1 and 2 repeat their prompt; request "b" allows itself 2 draft tokens."""
    drafter = BatchDrafter(lv.Settings(adaptive=False, memory=False), 4, eos_token_ids=EOS)
    matrix = np.zeros((3, 32), np.int32)
    matrix[:, :7] = [3, 4, 5, 6, 3, 4, 5]
    counts, emitted = np.array([5, 7, 7]), np.array([0, 1, 1])
    out = drafter.draft(matrix, counts, emitted, _engine(["p", "a", "b"], max_tokens=9,
                                                         extra={"b": {"lookup_decode_k": 2}}))
    assert out.rows.tolist() == [1, 2]
    assert [out.tokens[j, :n].tolist() for j, n in enumerate(out.lengths)] == [[6, 3, 4, 5], [6, 3]]
    assert drafter.stats.request("b").drafted == 2 and drafter.live_requests == 2
    # "a" finished (the engine no longer holds it): gone at the next call; "b" is extended by its two kept tokens.
    matrix[2, 7:10] = [6, 3, 9]
    out = drafter.draft(matrix[2:], np.array([10]), np.array([3]), _engine(["b"]))
    assert drafter.live_requests == 1 and drafter.stats.accepted == 2 and drafter.stats.request("b").accepted == 2
    assert list(drafter.records.values())[0].id == "b"


def test_outputs_are_saved_in_the_step_their_requests_finish(tmp_path, monkeypatch):
    """A server stopped right after its last answers: the outputs enter the memory in the call where their rows
    end (EOS, or prompt + max_tokens), and with the batch empty the keeper writes memory_save at once, not after
    save_seconds or an idle wait."""
    monkeypatch.setattr(keeper, "IDLE_SECONDS", 3600.0)
    path = tmp_path / "m.npz"
    drafter = BatchDrafter(lv.Settings(memory_save=str(path), save_seconds=3600), 4, eos_token_ids=EOS)
    matrix = np.zeros((3, 32), np.int32)
    matrix[:, :6] = [[3, 4, 5, 6, 7, 8], [5, 6, 7, 8, 9, 10], [7, 8, 9, 10, 11, 3]]
    matrix[:, 6] = [9, 11, 4]
    ids = ["a", "b", "c"]
    drafter.draft(matrix, np.array([7, 7, 7]), np.array([1, 1, 1]), _engine(ids, max_tokens=3))
    matrix[:, 7:9] = [[10, 11], [12, 2], [5, 6]]      # "b" ends with EOS; "a" and "c" reach max_tokens
    drafter.draft(matrix, np.array([9, 9, 9]), np.array([2, 2, 2]), _engine(ids, max_tokens=3))
    for _ in range(100):
        if path.is_file():
            break
        time.sleep(0.05)
    saved = sorted(e.tokens.tolist() for e in Memory.load(path).entries())
    assert saved == [[4, 5, 6], [9, 10, 11], [11, 12, 2]]
    assert drafter.live_requests == 3               # stored while the engine still holds them
