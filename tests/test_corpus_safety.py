"""Issue 16: exception safety of the index and corpora, and save/load that never corrupts or over-reads.

Each test was written before its fix and failed then.
"""

import io
import threading
import zipfile

import numpy as np
import pytest

from lookup_decode.core import automaton as K
from lookup_decode.core import index as index_module
from lookup_decode.core.index import SuffixIndex
from lookup_decode.sources.corpus import CorpusFileError
from lookup_decode.sources.memory import Memory, References


def text(n, seed=0):
    return np.random.default_rng(seed).integers(0, 8, n).astype(np.int32)


def same_index(a: SuffixIndex, b: SuffixIndex) -> bool:
    """Same text and the same draft after every prefix-free probe: propose agrees at several max_tokens."""
    return a.tokens.tolist() == b.tokens.tolist() and all(
        a.propose(m).tokens.tolist() == b.propose(m).tokens.tolist() for m in (1, 5, 50))


# --- growth: allocate first, swap after -----------------------------------------------------------------

def test_index_growth_interrupted_leaves_the_index_usable(monkeypatch):
    t = text(1000)
    index = SuffixIndex(t)
    more = text(200, seed=1)

    def fail(*args):
        raise MemoryError("injected")
    with monkeypatch.context() as m:
        m.setattr(K, "rehash", fail)
        with pytest.raises(MemoryError):
            index.extend(more)                 # 1200 tokens > capacity 1024: grows
    assert same_index(index, SuffixIndex(t))
    index.extend(more)                         # and grows fine afterwards
    assert same_index(index, SuffixIndex(np.concatenate([t, more])))


def test_index_refuses_past_its_int32_limit(monkeypatch):
    monkeypatch.setattr(index_module, "MAX_TOKENS", 1500)
    index = SuffixIndex(text(1000))
    with pytest.raises(ValueError, match="at most 1500 tokens"):
        index.extend(text(600))
    assert len(index) == 1000 and same_index(index, SuffixIndex(text(1000)))


# --- corpus rebuilds: build the new index, then swap ------------------------------------------------------

def test_corpus_rebuild_interrupted_keeps_every_entry(monkeypatch):
    refs = References()
    docs = {f"d{i}": text(300, seed=i) for i in range(4)}
    for name, tokens in docs.items():
        refs.register(name, tokens=tokens)
    before = [e.tokens.tolist() for e in refs.entries()]
    real_extend = SuffixIndex.extend

    def interrupted(self, tokens):
        if len(tokens) > 500:                  # the rebuild's one big extend
            raise KeyboardInterrupt
        return real_extend(self, tokens)
    with monkeypatch.context() as m:
        m.setattr(SuffixIndex, "extend", interrupted)
        with pytest.raises(KeyboardInterrupt):
            refs.remove("d0")
    assert [e.tokens.tolist() for e in refs.entries()] == before and refs.n_tokens == 1200
    cursor = refs.cursor(min_match=1)
    cursor.extend(docs["d2"][:20])
    assert cursor.propose(5).tokens.tolist() == docs["d2"][20:25].tolist()
    refs.remove("d0")
    assert refs.names == ["d1", "d2", "d3"]


# --- save: unique temp, fsync, under the lock; concurrent saves never collide --------------------------

def test_concurrent_saves_to_one_path(tmp_path):
    path = tmp_path / "memory.npz"
    memories = [Memory(10_000) for _ in range(3)]
    for i, m in enumerate(memories):
        m.add(text(50 + i, seed=i))
    errors = []

    def saver(m):
        try:
            for _ in range(30):
                m.save(path)
        except Exception as e:                 # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=saver, args=(m,)) for m in memories]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(Memory.load(path)) == 1
    assert not [p for p in tmp_path.iterdir() if p.name != "memory.npz"], "temp files left behind"


def test_failed_save_leaves_no_temp_file_and_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "memory.npz"
    m = Memory(1000)
    m.add(text(40))
    m.save(path)
    old = path.read_bytes()

    def broken(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(np, "savez", broken)
    with pytest.raises(OSError):
        m.save(path)
    assert path.read_bytes() == old and [p.name for p in tmp_path.iterdir()] == ["memory.npz"]


# --- load: CorpusFileError for anything that is not a memory file; sizes checked before reading ----------

def test_load_of_an_npy_file_is_a_corpus_file_error(tmp_path):
    path = tmp_path / "x.npy"
    np.save(path, np.arange(5))
    with pytest.raises(CorpusFileError):
        Memory.load(path)


def test_load_checks_sizes_before_reading(tmp_path):
    """A compressed member holding 200 MB of zeros is a small file: refused from the zip directory, never read."""
    m = Memory(1000)
    m.add(text(40))
    good = tmp_path / "good.npz"
    m.save(good)
    bad = tmp_path / "bad.npz"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w", zipfile.ZIP_DEFLATED) as dst:
        for name in src.namelist():
            if name == "tokens.npy":
                buf = io.BytesIO()
                np.lib.format.write_array_header_1_0(buf, {"descr": "<i4", "fortran_order": False,
                                                           "shape": (50_000_000,)})
                with dst.open(name, "w", force_zip64=True) as f:
                    f.write(buf.getvalue())
                    zeros = bytes(1 << 24)
                    for _ in range(200_000_000 // len(zeros)):
                        f.write(zeros)
            else:
                dst.writestr(name, src.read(name))
    assert bad.stat().st_size < 2_000_000
    with pytest.raises(CorpusFileError, match="compressed"):
        Memory.load(bad)


def test_memory_load_applies_max_tokens_before_indexing(tmp_path, monkeypatch):
    m = Memory(100_000)
    for i in range(10):
        m.add(text(100, seed=i))
    path = tmp_path / "m.npz"
    m.save(path)
    indexed = []
    real_extend = SuffixIndex.extend

    def counting(self, tokens):
        indexed.append(len(tokens))
        return real_extend(self, tokens)
    monkeypatch.setattr(SuffixIndex, "extend", counting)
    small = Memory.load(path, max_tokens=300)
    assert small.n_tokens <= 300 and sum(indexed) <= 400


# --- caller arrays are copied ---------------------------------------------------------------------------

def test_corpus_keeps_its_own_copy_of_caller_arrays():
    tokens = text(50)
    refs = References()
    refs.register("d", tokens=tokens)
    memory = Memory(1000)
    memory.add(tokens)
    original = tokens.copy()
    tokens[:] = 7                                   # the caller reuses its buffer
    assert refs.entries()[0].tokens.tolist() == original.tolist()
    assert memory.entries()[0].tokens.tolist() == original.tolist()


def test_references_load_refuses_over_max_tokens_before_indexing(tmp_path, monkeypatch):
    refs = References()
    refs.register("a", tokens=text(500))
    path = tmp_path / "r.npz"
    refs.save(path)
    indexed = []
    real_extend = SuffixIndex.extend
    monkeypatch.setattr(SuffixIndex, "extend", lambda self, t: (indexed.append(len(t)), real_extend(self, t))[1])
    with pytest.raises(ValueError, match="more than max_tokens=100"):
        References.load(path, max_tokens=100)
    assert sum(indexed) == 0
