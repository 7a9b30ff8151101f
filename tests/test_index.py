"""SuffixIndex against the brute-force reference: worked examples, edge cases, hypothesis, growth."""

import numpy as np
import pytest
import reference
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lookup_decode import SuffixIndex


def trace_of(index_tokens_chunks, **kw):
    """(match_len, match_end) after every token, extending one token at a time."""
    index = SuffixIndex(min_match=1, max_match=10**6, **kw)
    out = []
    for chunk in index_tokens_chunks:
        for tok in chunk:
            index.extend([tok])
            out.append((index.match_len, index.match_end))
    return out


@pytest.mark.parametrize("tokens, max_tokens, expected", [
    ([1, 2, 3, 4, 1, 2, 3], 3, [4, 1, 2]),          # vLLM's worked example
    ([1, 2, 3, 4, 1, 2, 3], 10, [4, 1, 2, 3]),      # draft may run up to the newest token
    ([1, 2, 3, 4], 5, []),                          # no repeat at all
    ([5], 5, []),                                   # length 1
    ([], 5, []),                                    # empty
    ([7, 7, 7, 7], 3, [7]),                         # all equal: follows the earliest occurrence
    ([1, 2, 9, 4, 1, 2, 8, 3, 1, 2], 2, [8, 3]),    # tie between two 2-grams: nearest the re-sync anchor wins
    ([1, 2, 3, 5, 0, 2, 3, 6, 1, 2, 3], 1, [5]),     # longer match (1,2,3) beats the later (2,3)
])
def test_worked_examples(tokens, max_tokens, expected):
    index = SuffixIndex(tokens, min_match=1)
    assert index.propose(max_tokens).tokens.tolist() == expected
    assert reference.draft(tokens, max_tokens) == expected


@pytest.mark.parametrize("tokens, window, expected", [
    # "1 2" copies from 0, breaks at 8 (source had 9): the anchor is 3; the next "1 2" re-syncs to the
    # occurrence at 3-4, nearest the anchor, not the earliest at 0-1.
    ([1, 2, 9, 1, 2, 8, 3, 1, 2], 64, [8, 3]),
    ([1, 2, 9, 1, 2, 8, 3, 1, 2], 0, [9, 1]),        # rule 2 off: earliest occurrence
    # A rewritten line: source "5 6 7 1 8 9 1 4 4", copy "5 6 X 1 8" -> after the substituted X,
    # "1" re-syncs to the source's next "1" (8 follows), not its first "1" in the prompt head.
    ([1, 0, 5, 6, 7, 1, 8, 9, 1, 4, 4, 5, 6, 2, 1], 64, [8, 9]),
    ([1, 0, 5, 6, 7, 1, 8, 9, 1, 4, 4, 5, 6, 2, 1], 0, [0, 5]),
    ([1, 0, 5, 6, 7, 1, 8, 9, 1, 4, 4, 5, 6, 2, 1], 1, [8, 9]),   # anchor 5, occurrence start 6: within 1
])
def test_resync_after_a_miss(tokens, window, expected):
    index = SuffixIndex(tokens, min_match=1, resync_window=window)
    assert index.propose(2).tokens.tolist() == expected
    assert reference.draft(tokens, 2, window=window) == expected


def test_min_match_gates_drafts():
    tokens = [1, 2, 3, 9, 3]                       # only a 1-token match
    assert SuffixIndex(tokens, min_match=1).propose(4).tokens.tolist() == [9, 3]
    assert SuffixIndex(tokens, min_match=2).propose(4).tokens.tolist() == []


def test_max_match_caps_reported_length_only():
    tokens = list(range(10)) * 2
    index = SuffixIndex(tokens, min_match=2, max_match=4)
    assert index.match_len == 4
    assert index.propose(3).tokens.tolist() == reference.draft(tokens, 3)


def test_draft_stops_before_eos():
    tokens = [1, 2, 3, 0, 4, 5, 1, 2]               # 0 is EOS, right after the matched "1 2 3"
    assert SuffixIndex(tokens, min_match=2, eos_token_ids=[0]).propose(5).tokens.tolist() == [3]
    assert SuffixIndex(tokens, min_match=2, eos_token_ids=[0, 3]).propose(5).tokens.tolist() == []


def test_alignment_is_kept_while_the_source_matches():
    # After "1 2 3" the index copies from position 0; when the text continues "4" it stays aligned
    # with that occurrence even though "3 4" is as long a match elsewhere.
    tokens = [1, 2, 3, 4, 5, 6, 3, 4, 7, 1, 2, 3, 4]
    assert trace_of([tokens])[-1] == reference.match_trace(tokens)[-1] == (4, 3)
    assert SuffixIndex(tokens, min_match=1).propose(2).tokens.tolist() == [5, 6]


def test_accepts_numpy_and_torch_and_rejects_bad_ids():
    a = SuffixIndex(np.array([1, 2, 1], dtype=np.int64))
    b = SuffixIndex(torch.tensor([1, 2, 1]))
    assert a.tokens.tolist() == b.tokens.tolist() == [1, 2, 1]
    with pytest.raises(ValueError, match="one-dimensional"):
        SuffixIndex([[1, 2]])
    with pytest.raises(ValueError, match=r"\[0, 2\*\*31 - 1\]"):
        SuffixIndex([1, -3])
    with pytest.raises(TypeError, match="integers"):
        SuffixIndex([1.5, 2.0])
    with pytest.raises(ValueError, match="min_match"):
        SuffixIndex(min_match=0)
    with pytest.raises(ValueError, match="max_match"):
        SuffixIndex(min_match=4, max_match=3)
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixIndex([1]).propose(-1)


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=300), window=st.sampled_from([0, 1, 3, 64]))
def test_trace_equals_reference(tokens, window):
    assert trace_of([tokens], resync_window=window) == reference.match_trace(tokens, window)


def test_resync_is_exercised_and_bounded():
    # Guard against the re-sync rule passing vacuously: on noisy repeats it must choose other
    # occurrences than the earliest-occurrence rule, with the same match lengths.
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 4, 600).tolist()
    with_resync, without = reference.match_trace(tokens, 64), reference.match_trace(tokens, 0)
    assert trace_of([tokens]) == with_resync
    assert [m for m, _ in with_resync] == [m for m, _ in without]
    assert sum(a != b for a, b in zip(with_resync, without)) > 50
    # Mutated copies of a long block: matches longer than LOCAL_MAX (64) break and re-sync too.
    base = rng.integers(0, 4, 150)
    parts = [base]
    for _ in range(4):
        copy = base.copy()
        at = rng.integers(0, 150, 3)
        copy[at] = rng.integers(0, 4, 3)
        parts.append(np.delete(copy, rng.integers(0, 147)))
    tokens = np.concatenate(parts).tolist()
    trace = trace_of([tokens])
    assert trace == reference.match_trace(tokens, 64)
    assert max(m for m, _ in trace) > 64


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=200), max_tokens=st.integers(0, 12),
       min_match=st.integers(1, 4), eos=st.sets(st.integers(0, 3), max_size=2))
def test_propose_equals_reference(tokens, max_tokens, min_match, eos):
    index = SuffixIndex(tokens, min_match=min_match, eos_token_ids=sorted(eos))
    assert index.propose(max_tokens).tokens.tolist() == reference.draft(tokens, max_tokens, min_match, eos)
    index = SuffixIndex(tokens, min_match=min_match, eos_token_ids=sorted(eos), resync_window=0)
    assert index.propose(max_tokens).tokens.tolist() == reference.draft(tokens, max_tokens, min_match, eos, window=0)


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 5), min_size=1, max_size=300), cuts=st.lists(st.integers(0, 300), max_size=5))
def test_incremental_equals_built_at_once(tokens, cuts):
    bounds = [0] + sorted(c % (len(tokens) + 1) for c in cuts) + [len(tokens)]
    chunks = [tokens[a:b] for a, b in zip(bounds, bounds[1:])]
    at_once = SuffixIndex(tokens, min_match=1)
    pieces = SuffixIndex(min_match=1)
    for chunk in chunks:
        pieces.extend(chunk)
    assert pieces.tokens.tolist() == tokens
    assert (pieces.match_len, pieces.match_end) == (at_once.match_len, at_once.match_end)
    assert pieces.propose(16).tokens.tolist() == at_once.propose(16).tokens.tolist()


def test_growth_past_initial_capacity_matches_reference():
    rng = np.random.default_rng(0)
    # Repeated spans with noise: long matches, re-alignments, and several buffer doublings.
    base = rng.integers(0, 50, size=400)
    tokens = np.concatenate([base, rng.integers(0, 50, 30), base[:300], base[100:], rng.integers(0, 4, 1500)])
    expected = reference.match_trace(tokens.tolist())
    index = SuffixIndex(min_match=1, max_match=10**6)
    got = []
    for chunk in np.array_split(tokens, 37):
        for tok in chunk:
            index.extend([tok])
            got.append((index.match_len, index.match_end))
    assert len(index) == len(tokens) > 2048
    assert got == expected
    assert max(m for m, _ in got) >= 300        # guard: the long copied span was really matched


def test_large_vocabulary_ids():
    tokens = [150_000, 2**31 - 1, 7, 150_000, 2**31 - 1]
    assert SuffixIndex(tokens, min_match=2).propose(3).tokens.tolist() == [7, 150_000, 2**31 - 1]


def test_follow_resynchronises_near_where_the_copy_broke():
    """A cursor copying from the second of two equal regions: after a substitution, with a window it resumes in the
    same region (a diff's re-synchronisation), without one at the earliest occurrence."""
    index = SuffixIndex([1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7])
    for window, end in ((64, 11), (0, 4)):
        cursor = index.new_cursor()
        index.follow(cursor, [7, 1, 2, 3], window)
        assert cursor[2] == 9 and cursor[3] == 4
        index.follow(cursor, [8, 5], window)            # 8 replaced the 4: the copy goes on after it
        assert cursor[2] == end and cursor[3] == 1
