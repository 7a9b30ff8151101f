"""Session memory, reference documents and the choice among sources, without a model.

Cursors are checked against a brute-force twin of the occurrence rule; eviction, threads,
persistence and bad input against their stated rules.
"""

import json
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lookup_decode import CorpusFileError, Memory, References, SuffixIndex
from lookup_decode.core.draft import Draft
from lookup_decode.sources.corpus import SEPARATOR
from lookup_decode.sources.memory import LOW_WATER, load_references
from lookup_decode.sources.proposer import SourcesProposer, check_sources


def cross_trace(docs, query):
    """Brute-force cursor rule over documents joined by separators: after each query token, (match_len,
    end position in the joined text). Follow the copied occurrence while it continues; else the earliest
    occurrence of the longest suffix of the query found in the text."""
    joined = []
    for d in docs:
        joined += list(d) + [SEPARATOR]
    text = "".join(chr(t + 0x100) if t != SEPARATOR else "\0" for t in joined)
    q = "".join(chr(t + 0x100) for t in query)
    out, mlen, mend = [], 0, -1
    for i, c in enumerate(q):
        if mlen > 0 and mend + 1 < len(text) and text[mend + 1] == c:
            mlen, mend = mlen + 1, mend + 1
        else:
            mlen, mend = 0, -1
            for length in range(1, i + 2):
                start = text.find(q[i - length + 1: i + 1])
                if start < 0:
                    break
                mlen, mend = length, start + length - 1
        out.append((mlen, mend))
    return out, joined


def refs_of(docs):
    refs = References()
    for i, d in enumerate(docs):
        refs.register(f"d{i}", tokens=d)
    return refs


@settings(max_examples=60, deadline=None)
@given(docs=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), min_size=1, max_size=4),
       query=st.lists(st.integers(0, 3), min_size=1, max_size=60), chunk=st.integers(1, 7))
def test_cursor_equals_brute_force(docs, query, chunk):
    expected, joined = cross_trace(docs, query)
    cursor = refs_of(docs).cursor(min_match=1, max_match=10**6, eos_token_ids=[3])
    got = []
    for i in range(0, len(query), chunk):        # any chunking of the request's tokens gives the same trace
        part = query[i:i + chunk]
        for j, tok in enumerate(part):
            cursor.extend([tok])
            got.append((cursor.match_len, int(cursor._state[2])))
    assert got == expected
    mlen, mend = expected[-1]
    draft = cursor.propose(5).tokens.tolist()
    want = []
    for tok in joined[mend + 1: mend + 6] if mlen else []:
        if tok in (3, SEPARATOR):                # drafts stop before EOS and at the end of a document
            break
        want.append(tok)
    assert draft == want


def test_cursor_worked_examples():
    refs = refs_of([[1, 2, 3, 4, 5, 6], [7, 8, 1, 2, 9]])
    c = refs.cursor()
    c.extend([0, 1, 2])
    assert (c.propose(5).tokens.tolist(), c.match_len) == ([3, 4, 5, 6], 2)    # earliest occurrence of "1 2"
    c.extend([3, 4, 5, 6])
    assert (c.propose(5).tokens.tolist(), c.match_len) == ([], 6)              # end of document: no draft across it
    c.extend([8, 1, 2])
    assert (c.propose(5).tokens.tolist(), c.match_len) == ([9], 3)             # "8 1 2" only in the second document


def test_cursor_follows_changes_of_the_corpus():
    refs = refs_of([[1, 2, 3, 4]])
    c = refs.cursor()
    c.extend([9, 1, 2])
    assert c.propose(4).tokens.tolist() == [3, 4]
    refs.register("new", tokens=[5, 1, 2, 7, 7])
    refs.remove("d0")                            # rebuild: the cursor re-walks its request's last tokens
    assert c.propose(4).tokens.tolist() == [7, 7]
    refs.remove("new")
    assert c.propose(4).tokens.tolist() == [] and len(refs) == 0


class Fixed:
    """A stand-in source with a given draft and match length."""

    def __init__(self, draft, match_len):
        self.draft, self.match_len = np.array(draft, np.int32), match_len

    def extend(self, tokens):
        pass

    def propose(self, max_tokens):
        return Draft(self.draft[:max_tokens], self.match_len)


@pytest.mark.parametrize("lens, drafts, winner", [
    ((3, 5, 4), ([1], [2], [3]), 1),            # the longest match wins
    ((5, 5, 5), ([1], [2], [3]), 0),            # tie: the request itself
    ((2, 5, 5), ([1], [2], [3]), 1),            # tie between corpora: memory before references
    ((2, 5, 9), ([1], [2], []), 1),             # an empty draft never wins, however long its match
    ((0, 0, 0), ([], [], []), None),            # nothing to draft
    ((1, 3, 0), ([1], [2], []), 0),             # while the request drafts, a corpus needs CORPUS_MIN_MATCH tokens
    ((0, 2, 0), ([], [2], []), 1),              # ... but not when the request has nothing
])
def test_choice_rule(lens, drafts, winner):
    p = SourcesProposer(Fixed(drafts[0], lens[0]), [], min_match=1)
    p.names += ["memory", "references"]
    p.sources += [Fixed(drafts[1], lens[1]), Fixed(drafts[2], lens[2])]
    draft = p.propose(4)
    got = draft.tokens.tolist()
    if winner is None:
        assert got == [] and not p.drafts_from
    else:
        assert got == drafts[winner] and draft.match_len == lens[winner]
        assert p.drafts_from == {p.names[winner]: 1}


def test_composite_drafts_from_memory_and_credits_the_entry():
    mem = Memory(1000)
    mem.add([10, 11, 12, 13, 14, 15])
    mem.add([20, 21, 22])
    p = SourcesProposer(SuffixIndex(), check_sources(mem, None), min_match=1)
    p.extend([5, 6, 10, 11])
    draft = p.propose(3)
    assert draft.tokens.tolist() == [12, 13, 14] and draft.match_len == 2
    p.extend([12, 13, 99])                       # two drafted tokens were right
    assert p.accepted_from == {"memory": 2}
    entries = {tuple(e.tokens.tolist()): e for e in mem.entries()}
    assert entries[(10, 11, 12, 13, 14, 15)].accepted == 2
    assert entries[(10, 11, 12, 13, 14, 15)].last_used > entries[(20, 21, 22)].last_used


def test_eviction_keeps_the_bound_and_drops_least_recently_useful():
    rng = np.random.default_rng(0)
    mem = Memory(max_tokens=300)
    useful = rng.integers(0, 1000, 40).astype(np.int32)
    mem.add(useful)
    for i in range(60):
        mem.add(rng.integers(0, 1000, int(rng.integers(5, 60))))
        assert mem.n_tokens <= mem.max_tokens
        c = mem.cursor()                         # every request accepts a draft from `useful`
        c.extend(useful[:3])
        assert c.propose(4).tokens.tolist() == useful[3:7].tolist()
        c.credit(4)
    assert mem.evicted > 0
    assert any(np.array_equal(e.tokens, useful) for e in mem.entries())
    # after an eviction the memory holds at most LOW_WATER of the bound plus what came since
    assert sum(e.tokens.size for e in mem.entries()) == mem.n_tokens


def test_eviction_order_is_least_recently_useful_first():
    mem = Memory(max_tokens=30)
    a, b, c, d = (np.arange(10) + 100 * i for i in range(1, 5))
    for x in (a, b, c):
        mem.add(x)
    cur = mem.cursor()
    cur.extend(a[:3])
    assert cur.propose(2).tokens.tolist() == a[3:5].tolist()
    cur.credit(2)                                # a draft from `a` was accepted: a is now the most recently useful
    mem.add(d)                                   # 40 > 30: evict b, then c, until d fits in 3/4 of the bound
    assert [e.tokens[0] for e in mem.entries()] == [a[0], d[0]]
    assert mem.n_tokens == 20 and mem.evicted == 2


def test_a_longer_store_of_one_output_replaces_the_shorter_at_the_next_eviction():
    """A request stored before it finished (the vLLM drafter: preempted) and again whole: the prefix stays indexed
    (no rebuild) but goes first when the memory is full, before entries that are older."""
    mem = Memory(max_tokens=28)
    old = mem.store(np.arange(4) + 500)[0]
    short, new = mem.store(np.arange(8) + 100)
    whole, new_whole = mem.store(np.arange(12) + 100, replaces=short)
    assert new and new_whole and short != whole and len(mem) == 3
    assert mem.store([], replaces=whole) == (None, False)
    mem.add(np.arange(5) + 900)                  # 29 > 28: down to 21 with it, the superseded prefix first
    assert [e.key for e in mem.entries()] == [old, whole, mem.entries()[-1].key] and mem.evicted == 1


def test_a_snapshot_saves_what_the_memory_holds(tmp_path):
    mem = Memory(max_tokens=1000)
    for i in range(3):
        mem.add(np.arange(5) + 10 * i)
    snap = mem.snapshot()
    mem.add([7, 7, 7])                           # the memory goes on; the snapshot does not change
    snap.save(tmp_path / "s.npz")
    loaded = Memory.load(tmp_path / "s.npz")
    assert [e.tokens.tolist() for e in loaded.entries()] == [e.tokens.tolist() for e in mem.entries()][:3]
    assert loaded.clock == snap.clock and len(snap) == 3


def test_memory_keeps_one_copy_of_a_repeat_and_truncates_huge_entries():
    mem = Memory(max_tokens=100)
    assert mem.add([1, 2, 3]) and not mem.add([1, 2, 3])
    assert len(mem) == 1 and mem.n_tokens == 3
    mem.add(np.arange(500))
    assert mem.n_tokens <= 100 and max(e.tokens.size for e in mem.entries()) == int(LOW_WATER * 100)


def test_threads_lose_no_entries_and_never_crash():
    mem = Memory(max_tokens=10**6)
    n_threads, per_thread = 6, 40
    errors = []

    def writer(t):
        rng = np.random.default_rng(t)
        try:
            for i in range(per_thread):
                mem.add(np.concatenate([[t, i], rng.integers(0, 50, 30)]).astype(np.int32))
                c = mem.cursor()                 # readers interleave with the writers
                c.extend(rng.integers(0, 50, 8))
                c.propose(8)
        except Exception as e:                   # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert len(mem) == n_threads * per_thread
    assert {tuple(e.tokens[:2].tolist()) for e in mem.entries()} == \
        {(t, i) for t in range(n_threads) for i in range(per_thread)}
    # the index holds every entry: each one's head is found with its continuation
    c = mem.cursor(max_match=4)
    e = mem.entries()[-1]
    c.extend(e.tokens[:12])
    assert c.match_len == 4


def test_threads_with_eviction_keep_the_bound():
    mem = Memory(max_tokens=500)
    errors = []

    def work(t):
        rng = np.random.default_rng(100 + t)
        try:
            for _ in range(60):
                mem.add(rng.integers(0, 50, int(rng.integers(5, 80))))
                assert mem.n_tokens <= 500
                c = mem.cursor()
                c.extend(rng.integers(0, 50, 6))
                c.credit(len(c.propose(4)))
        except Exception as e:                   # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    [th.start() for th in threads]
    [th.join() for th in threads]
    assert not errors and mem.n_tokens <= 500 and mem.evicted > 0


def test_save_load_round_trip(tmp_path):
    mem = Memory(max_tokens=5000, remember_prompts=True, vocab_size=1000)
    rng = np.random.default_rng(1)
    for _ in range(20):
        mem.add(rng.integers(0, 1000, 50))
    mem.cursor().credit(0)
    path = tmp_path / "session.mem"
    mem.save(path)
    back = Memory.load(path)
    assert (back.max_tokens, back.remember_prompts, back.vocab_size) == (5000, True, 1000)
    assert back.clock == mem.clock and back.n_tokens == mem.n_tokens
    for a, b in zip(mem.entries(), back.entries()):
        assert (a.key, a.start, a.added, a.last_used, a.accepted) == (b.key, b.start, b.added, b.last_used, b.accepted)
        assert np.array_equal(a.tokens, b.tokens)
    query = mem.entries()[7].tokens[:5]
    c1, c2 = mem.cursor(), back.cursor()
    c1.extend(query)
    c2.extend(query)
    assert c1.propose(10).tokens.tolist() == c2.propose(10).tokens.tolist() == mem.entries()[7].tokens[5:15].tolist()

    refs = refs_of([[1, 2, 3], [4, 5]])
    refs.save(tmp_path / "refs")
    assert References.load(tmp_path / "refs").names == ["d0", "d1"]
    with pytest.raises(CorpusFileError, match="references"):
        Memory.load(tmp_path / "refs")           # a references file is not a memory file


def test_corrupt_and_foreign_files_give_clear_errors(tmp_path):
    mem = Memory(100)
    mem.add([1, 2, 3, 4])
    good = tmp_path / "good"
    mem.save(good)
    raw = good.read_bytes()
    cases = {"truncated": raw[: len(raw) // 2], "garbage": b"not a memory file at all",
             "empty": b""}
    for name, data in cases.items():
        p = tmp_path / name
        p.write_bytes(data)
        with pytest.raises(CorpusFileError, match="not a lookup_decode memory file"):
            Memory.load(p)
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, x=np.arange(3))
    with pytest.raises(CorpusFileError, match="arrays"):
        Memory.load(foreign)
    # tokens changed behind the header's back -> checksum
    with np.load(good) as f:
        header, original, lengths = f["header"], f["tokens"], f["lengths"]
    tokens = original.copy()
    tokens[0] += 1
    tampered = tmp_path / "tampered.npz"
    np.savez(tampered, header=header, tokens=tokens, lengths=lengths)
    with pytest.raises(CorpusFileError, match="checksum"):
        Memory.load(tampered)
    # a future format version
    h = json.loads(header.tobytes().decode())
    h["version"] = 99
    future = tmp_path / "future.npz"
    np.savez(future, header=np.frombuffer(json.dumps(h).encode(), np.uint8), tokens=original, lengths=lengths)
    with pytest.raises(CorpusFileError, match="format version 99"):
        Memory.load(future)
    with pytest.raises(FileNotFoundError):
        Memory.load(tmp_path / "missing")
    # well-formed archive, nonsense metadata
    for change in ({"settings": {"max_tokens": 0}}, {"settings": {"colour": "red"}}, {"added": ["x"]},
                   {"keys": [7]}, {"kind": "references"}):
        h = {**json.loads(header.tobytes().decode()), **change}
        odd = tmp_path / "odd.npz"
        np.savez(odd, header=np.frombuffer(json.dumps(h).encode(), np.uint8), tokens=original, lengths=lengths)
        with pytest.raises(CorpusFileError):
            Memory.load(odd)


def test_references_from_text_files(tmp_path):
    for name, text in (("a.py", "def f():\n    return 1\n"), ("b.py", "x = 2\n")):
        (tmp_path / name).write_text(text)
    tokenizer = lambda text, add_special_tokens=False: {"input_ids": [ord(c) for c in text]}  # noqa: E731
    refs = load_references(tmp_path, tokenizer=tokenizer)
    assert refs.n_tokens == sum(len(p.read_text()) for p in tmp_path.iterdir())
    assert refs.names == ["a.py", "b.py"]
    c = refs.cursor()
    c.extend([ord(ch) for ch in "def f"])
    assert bytes(c.propose(4).tokens.tolist()).decode() == "():\n"


def test_million_token_reference_indexes_in_bounded_memory():
    import time
    rng = np.random.default_rng(0)
    n = 1_000_000
    doc = rng.integers(0, 49152, n).astype(np.int32)
    doc[500_000:500_040] = np.arange(40)         # a span to find
    refs = References()
    t = time.perf_counter()
    refs.register("big", tokens=doc)
    seconds = time.perf_counter() - t
    per_token = refs.nbytes() / n
    print(f"\n1M-token reference: indexed in {seconds:.2f} s, {refs.nbytes() / 2**20:.0f} MiB "
          f"({per_token:.0f} B/token)")
    assert per_token < 256                       # bounded: O(n) buffers, at most doubling slack
    c = refs.cursor()
    c.extend([7, 0, 1, 2, 3])
    assert c.propose(5).tokens.tolist() == [4, 5, 6, 7, 8]


@pytest.mark.parametrize("make, error, match", [
    (lambda: Memory(0), ValueError, "max_tokens must be >= 1"),
    (lambda: Memory(-5), ValueError, "max_tokens must be >= 1"),
    (lambda: Memory(1.5), TypeError, "max_tokens must be an int"),
    (lambda: References(max_tokens=0), ValueError, "max_tokens must be >= 1"),
    (lambda: References().register("empty", tokens=[]), ValueError, "'empty' is empty"),
    (lambda: References().register("e", text="", tokenizer=lambda s, **k: {"input_ids": []}), ValueError, "is empty"),
    (lambda: References().register("t", text="hello"), ValueError, "needs tokenizer"),
    (lambda: References().register("t", text="x", tokens=[1]), ValueError, "not both"),
    (lambda: References().register("", tokens=[1]), ValueError, "non-empty name"),
    (lambda: References(vocab_size=96).register("v", tokens=[5, 96]), ValueError, "token id 96"),
    (lambda: References().register("n", tokens=[-1]), ValueError, r"\[0, 2\*\*31 - 1\]"),
    (lambda: References().register("s", tokens=[SEPARATOR]), ValueError, "reserved"),
    (lambda: References(max_tokens=3).register("big", tokens=[1, 2, 3, 4]), ValueError, "does not fit"),
    (lambda: References().remove("nope"), KeyError, "nope"),
    (lambda: check_sources(References(), None), TypeError, "memory= takes a lookup_decode.Memory"),
])
def test_bad_input(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_duplicate_document_name_and_replace():
    refs = References()
    refs.register("f.py", tokens=[1, 2, 3])
    with pytest.raises(ValueError, match="already registered"):
        refs.register("f.py", tokens=[4, 5])
    refs.register("f.py", tokens=[4, 5, 6], replace=True)
    assert [e.tokens.tolist() for e in refs.entries()] == [[4, 5, 6]]


def test_check_vocab_names_the_problem():
    mem = Memory(100)
    mem.add([3, 200])
    with pytest.raises(ValueError, match="token id 200 .* vocabulary of 96"):
        mem.check_vocab(96)
    mem.check_vocab(201)


def test_evict_aside_equals_eviction_and_keeps_entries_stored_meanwhile(monkeypatch):
    """The rebuild outside the lock evicts what a full memory would, and an entry stored while it builds is kept and
    indexed (the new index drafts from it)."""
    import lookup_decode.sources.memory as memory_module
    rng = np.random.default_rng(3)
    entries = [rng.integers(0, 50, size=10) for _ in range(9)]
    a, b = Memory(max_tokens=100), Memory(max_tokens=100)
    for i, e in enumerate(entries[:8]):
        for m in (a, b):
            m.add(e)
            if i == 2:
                m.credit(m.version, m.entries()[0].start, 1)    # the first entry was useful: it stays
    assert a.evict_aside() == 0                                 # 80 tokens: below HIGH_WATER
    for m in (a, b):
        m.add(entries[8])                                       # 90: above it
    late = np.arange(5) + 60
    real_extend = memory_module.extend_index

    def store_meanwhile(index, es):                             # another thread stores while the index is built
        if not hasattr(store_meanwhile, "done"):
            store_meanwhile.done = True
            b.add(late)
        return real_extend(index, es)

    monkeypatch.setattr(memory_module, "extend_index", store_meanwhile)
    assert b.evict_aside() == 2
    monkeypatch.setattr(memory_module, "extend_index", real_extend)
    assert a.evict_aside() == 2 and a.n_tokens == 70
    assert [e.key for e in b.entries()][:-1] == [e.key for e in a.entries()]
    assert b.entries()[-1].tokens.tolist() == late.tolist() and b.n_tokens == 75
    assert entries[0].tolist() in [e.tokens.tolist() for e in b.entries()]
    cur = b.cursor(min_match=2)
    cur.extend(late[:3])
    assert cur.propose(2).tokens.tolist() == late[3:5].tolist()
