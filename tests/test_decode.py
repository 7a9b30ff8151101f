"""End-to-end exactness on tiny random models: lookup decoding == plain greedy generate, token for token."""

import numpy as np
import pytest
import reference
import torch
from conftest import VOCAB, FlatCosts, lookup_generate, repetitive_prompt
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import build
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

import lookup_decode
from lookup_decode import DecodeStats, Draft
from lookup_decode.engines.hf.stopping import first_stop, first_stops

GREEDY = dict(do_sample=False, pad_token_id=0)


def plain(model, prompt, **kw):
    return model.generate(prompt, **GREEDY, **kw)


def lookup(model, prompt, stats=None, min_match=1, **kw):
    # min_match=1: tiny random models copy short spans; more drafts make every test stricter.
    # kw: lookup options and generate()'s, and costs= (see conftest.lookup_generate).
    return lookup_generate(model, prompt, **GREEDY, stats=stats, min_match=min_match, **kw)


class ReplayProposer:
    """Drafts from a known continuation (oracle), optionally corrupted so every draft is wrong."""

    def __init__(self, prompt_len, continuation, wrong=False):
        self.continuation = list(continuation)
        self.prompt_len, self.seen, self.wrong = prompt_len, 0, wrong

    def extend(self, tokens):
        self.seen += len(tokens)

    def propose(self, max_tokens):
        done = self.seen - self.prompt_len
        draft = np.array(self.continuation[done: done + max_tokens], dtype=np.int32)
        return Draft((draft + 1) % VOCAB if self.wrong else draft, match_len=64)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k", [1, 4, 16])
def test_equals_plain_greedy(tiny_lm, seed, k):
    prompt = repetitive_prompt(seed)
    ref = plain(tiny_lm, prompt, max_new_tokens=48, eos_token_id=None)
    stats = DecodeStats()
    got = lookup(tiny_lm, prompt, stats, max_new_tokens=48, eos_token_id=None, k=k, adaptive=False)
    assert got.tolist() == ref.tolist()
    assert stats.accepted > 0                       # guard: drafts were verified and kept
    assert stats.new_tokens == 48


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2"])
def test_adaptive_equals_plain_greedy(arch):
    model = build(arch, seed=1)
    for seed in range(3):
        prompt = repetitive_prompt(10 + seed)
        ref = plain(model, prompt, max_new_tokens=64, eos_token_id=None)
        stats = DecodeStats()
        # The adaptive policy chooses each draft length; priced flat, no draft is priced out by the load.
        got = lookup(model, prompt, stats, max_new_tokens=64, eos_token_id=None, costs=FlatCosts())
        assert got.tolist() == ref.tolist()
        assert stats.accepted > 0                   # guard: drafts were verified and kept


def test_plain_generate_equals_one_by_one_reference(tiny_llama):
    # Anchors the comparisons above: plain generate itself equals a cache-free greedy loop.
    prompt = repetitive_prompt(3)
    assert plain(tiny_llama, prompt, max_new_tokens=20, eos_token_id=None).tolist() == \
        reference.greedy_one_by_one(tiny_llama, prompt, 20).tolist()


@pytest.mark.parametrize("k", [1, 3, 8])
def test_oracle_proposer_emits_k_plus_one_per_step(tiny_lm, k):
    prompt = repetitive_prompt(5)
    n_new = 40
    ref = plain(tiny_lm, prompt, max_new_tokens=n_new, eos_token_id=None)
    oracle = ReplayProposer(prompt.shape[1], ref[0, prompt.shape[1]:].tolist())
    stats = DecodeStats()
    got = lookup(tiny_lm, prompt, stats, max_new_tokens=n_new, eos_token_id=None, k=k, adaptive=False,
                 proposer=oracle)
    assert got.tolist() == ref.tolist()
    assert stats.acceptance_rate == 1.0
    # The prefill emits one token; each step then emits k + 1 until the budget is nearly spent.
    full_steps = (n_new - 1) // (k + 1)
    assert stats.draft_lengths[:full_steps] == [k] * full_steps
    assert stats.steps == -(-(n_new - 1) // (k + 1))


def test_always_wrong_proposer_gives_identical_output(tiny_lm):
    prompt = repetitive_prompt(6)
    ref = plain(tiny_lm, prompt, max_new_tokens=30, eos_token_id=None)
    wrong = ReplayProposer(prompt.shape[1], ref[0, prompt.shape[1]:].tolist(), wrong=True)
    stats = DecodeStats()
    got = lookup(tiny_lm, prompt, stats, max_new_tokens=30, eos_token_id=None, k=4, adaptive=False, proposer=wrong)
    assert got.tolist() == ref.tolist()
    assert stats.drafted > 0 and stats.accepted == 0


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 7, 17, 33])
def test_max_new_tokens_exact(tiny_llama, max_new_tokens):
    prompt = repetitive_prompt(7)
    ref = plain(tiny_llama, prompt, max_new_tokens=max_new_tokens, eos_token_id=None)
    got = lookup(tiny_llama, prompt, max_new_tokens=max_new_tokens, eos_token_id=None, k=8, adaptive=False)
    assert got.tolist() == ref.tolist()


def _eos_inside_drafts(model, n_new, k, first_seed):
    """A prompt, its greedy continuation, and tokens that first appear at a draft position of a
    k-token oracle draft (so making one of them EOS cuts a draft in the middle)."""
    for seed in range(first_seed, first_seed + 30):
        prompt = repetitive_prompt(seed)
        ref = plain(model, prompt, max_new_tokens=n_new, eos_token_id=None)[0, prompt.shape[1]:].tolist()
        # Prefill emits ref[0]; step s drafts ref[1 + (k+1)s ...] k tokens, then the bonus token.
        positions = [p for p in range(1, n_new) if (p - 1) % (k + 1) != k]
        candidates = [ref[p] for p in positions if ref[p] not in ref[:p]]
        if candidates:
            return prompt, ref, candidates
    raise AssertionError("guard: no prompt puts a first occurrence inside a draft")


@pytest.mark.parametrize("k", [4, 8])
def test_eos_inside_a_draft_stops_exactly(tiny_lm, k):
    prompt, ref, candidates = _eos_inside_drafts(tiny_lm, 40, k, first_seed=8)
    for eos in candidates[:3]:
        expected = plain(tiny_lm, prompt, max_new_tokens=40, eos_token_id=eos)
        oracle = ReplayProposer(prompt.shape[1], ref)   # drafts run past the EOS on purpose
        got = lookup(tiny_lm, prompt, max_new_tokens=40, eos_token_id=eos, k=k, adaptive=False, proposer=oracle)
        assert got.tolist() == expected.tolist()
        assert got[0, -1].item() == eos


def test_several_eos_ids(tiny_lm):
    prompt, ref, candidates = _eos_inside_drafts(tiny_lm, 40, 8, first_seed=40)
    eos = [VOCAB - 1, *candidates[:2]]
    expected = plain(tiny_lm, prompt, max_new_tokens=40, eos_token_id=eos)
    got = lookup(tiny_lm, prompt, max_new_tokens=40, eos_token_id=eos, k=8, adaptive=False)
    assert got.tolist() == expected.tolist()


def test_index_never_drafts_eos(tiny_llama):
    prompt = torch.tensor([[5, 6, 7, 2, 9, 5, 6, 7, 2, 9, 5, 6]])   # 2 is EOS, right after the match
    stats = DecodeStats()
    proposer = lookup_decode.SuffixIndex(min_match=2, eos_token_ids=[2])
    lookup(tiny_llama, prompt, stats, max_new_tokens=1 + 1, eos_token_id=2, proposer=proposer, adaptive=False)
    proposer_drafts = lookup_decode.SuffixIndex(prompt[0], min_match=2, eos_token_ids=[2]).propose(8)
    assert proposer_drafts.tokens.tolist() == [7]


class Recorder:
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.tolist())

    def end(self):
        self.ended = True


def test_streamer_receives_tokens_in_order(tiny_llama):
    prompt = repetitive_prompt(11)
    ref = plain(tiny_llama, prompt, max_new_tokens=30, eos_token_id=None)
    streamer, stats = Recorder(), DecodeStats()
    got = lookup_decode.generate(tiny_llama, prompt, max_new_tokens=30, eos_token_id=None, pad_token_id=0,
                                 streamer=streamer, stats=stats, k=8, adaptive=False)
    assert got.tolist() == ref.tolist()
    assert streamer.chunks[0] == prompt.tolist()             # transformers puts the prompt first
    flat = [t for chunk in streamer.chunks[1:] for t in chunk]
    assert flat == ref[0, prompt.shape[1]:].tolist() and streamer.ended
    assert any(len(chunk) > 1 for chunk in streamer.chunks[1:])  # guard: multi-token steps were streamed


def test_stats_are_consistent(tiny_llama):
    prompt = repetitive_prompt(12)
    stats = DecodeStats()
    # Chains: the calibration table scores a tree on its chain only, so its side branches are drafted, not priced.
    out = lookup(tiny_llama, prompt, stats, max_new_tokens=50, eos_token_id=None, costs=FlatCosts(), tree_width=1)
    assert stats.accepted > 0                       # guard: the sums below count kept drafts
    assert stats.new_tokens == out.shape[1] - prompt.shape[1] == 50
    assert stats.new_tokens == 1 + stats.steps + stats.accepted       # prefill token + one per step + kept drafts
    assert sum(stats.draft_lengths) == stats.drafted
    assert stats.accepted_at[0] <= stats.steps and sum(stats.accepted_at) == stats.accepted
    assert stats.mean_accepted_length == pytest.approx(1 + stats.accepted / stats.steps)
    assert stats.model_s > 0 and stats.proposer_s > 0 and stats.total_s >= stats.model_s
    # Calibration telemetry: every sent draft token is in the reliability table, the kept ones as kept.
    rows = stats.calibration()
    assert sum(r.tokens for r in rows) == stats.drafted
    assert round(sum(r.kept * r.tokens for r in rows)) == stats.accepted
    assert all(0.0 <= r.predicted <= 1.0 for r in rows)


def test_repetition_penalty_applied_per_verified_position(tiny_llama):
    # Processors that depend on the prefix must see exactly the prefix of each verified row.
    prompt = repetitive_prompt(13)
    kw = dict(max_new_tokens=40, eos_token_id=None, repetition_penalty=1.3, no_repeat_ngram_size=4, min_new_tokens=5)
    ref = plain(tiny_llama, prompt, **kw)
    stats = DecodeStats()
    got = lookup(tiny_llama, prompt, stats, k=6, adaptive=False, **kw)
    assert got.tolist() == ref.tolist()
    assert stats.drafted > 0


def test_return_dict_with_scores_and_logits(tiny_llama):
    prompt = repetitive_prompt(14)
    kw = dict(max_new_tokens=25, eos_token_id=None, return_dict_in_generate=True, output_scores=True,
              output_logits=True, repetition_penalty=1.2)
    ref = plain(tiny_llama, prompt, **kw)
    got = lookup(tiny_llama, prompt, k=6, adaptive=False, **kw)
    assert got.sequences.tolist() == ref.sequences.tolist()
    assert len(got.scores) == len(ref.scores) == len(got.logits) == 25
    for a, b in zip(got.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for a, b in zip(got.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert got.cache.get_seq_length() == ref.cache.get_seq_length()


def test_bound_streamer_receives_prompt_then_tokens(tiny_llama):
    prompt = repetitive_prompt(15)
    ref = plain(tiny_llama, prompt, max_new_tokens=20, eos_token_id=None)
    streamer = Recorder()
    hook = lookup_decode.lookup_decoding(streamer=streamer, k=8, adaptive=False, min_match=1)
    got = tiny_llama.generate(prompt, max_new_tokens=20, eos_token_id=None, custom_generate=hook, **GREEDY)
    assert got.tolist() == ref.tolist()
    assert streamer.chunks[0] == prompt.tolist()
    assert [t for chunk in streamer.chunks[1:] for t in chunk] == ref[0, prompt.shape[1]:].tolist()


def test_stats_add_up_across_calls(tiny_llama):
    once, twice = DecodeStats(), DecodeStats()
    for stats, calls in ((once, 1), (twice, 2)):
        for _ in range(calls):
            lookup(tiny_llama, repetitive_prompt(16), stats, max_new_tokens=12, eos_token_id=None, k=4, adaptive=False)
    for name in ("prompt_tokens", "new_tokens", "steps", "drafted", "accepted"):
        assert getattr(twice, name) == 2 * getattr(once, name), name
    assert twice.new_tokens == 1 * 2 + twice.steps + twice.accepted


class _EveryThird(StoppingCriteria):
    """A user criterion transformers does not know: stop where the row's length is a multiple of 3. Records
    the lengths it was asked about (plain asks every criterion after every token, up to the stop)."""

    def __init__(self):
        self.asked = []

    def __call__(self, input_ids, scores, **kwargs):
        self.asked.extend([input_ids.shape[1]] * input_ids.shape[0])
        return torch.full((input_ids.shape[0],), input_ids.shape[1] % 3 == 0, dtype=torch.bool)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_first_stops_of_a_batch_equal_asking_every_row_and_token(data):
    # Reference: the criteria asked of each row after each token, as plain decoding asks them.
    rows = data.draw(st.integers(1, 6))
    starts = data.draw(st.lists(st.integers(3, 12), min_size=rows, max_size=rows))
    emitted = [torch.tensor(data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=6)), dtype=torch.long)
               for _ in range(rows)]
    criteria = StoppingCriteriaList()
    if data.draw(st.booleans()):
        criteria.append(MaxLengthCriteria(data.draw(st.integers(4, 20))))
    if data.draw(st.booleans()):
        criteria.append(EosTokenCriteria(data.draw(st.sampled_from([3, [3, 4], torch.tensor([5])]))))
    user = _EveryThird() if data.draw(st.booleans()) else None
    if user is not None:
        criteria.append(user)
    ids = torch.randint(0, 6, (rows, 24))
    for b, (s, e) in enumerate(zip(starts, emitted)):
        ids[b, s: s + len(e)] = e
    expected = [first_stop(criteria, ids[b: b + 1], s, s + len(e)) for b, (s, e) in enumerate(zip(starts, emitted))]
    asked = sorted(user.asked) if user is not None else None
    if user is not None:
        user.asked.clear()
    assert first_stops(criteria, ids, list(range(rows)), starts, emitted) == expected
    if user is not None:
        assert sorted(user.asked) == asked
