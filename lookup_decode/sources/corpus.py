"""Corpus: token sequences (entries) kept across requests in one suffix index, safe to share between threads.

The base of session memory and reference documents (`memory.py`). All entries live in one
`SuffixIndex` over their concatenation, each followed by `SEPARATOR`; since no model emits that
id, no match ever crosses from one entry into the next. The index is built once and only read by
requests: each request follows its own tokens over it with a `Cursor` (matching statistics, O(1)
amortized per token, whatever the corpus size). A suffix automaton cannot forget, so removing
entries rebuilds the index from the kept ones (O(kept tokens)).

Thread safety: one lock guards the entries and the index; cursors take it for each `extend` /
`propose` (microseconds), writers for an append (O(entry)) or a rebuild (O(corpus)). Every change
bumps `version`; a cursor that sees a new version re-walks the last `max_match` tokens of its
request, so it never reads an index that changed under it.

Persistence (`save` / `load`): a NumPy .npz archive (no pickle) holding a JSON header (format name,
format version, kind, settings, entry metadata, SHA-256 of the tokens) and the tokens; the index is
rebuilt on load. Everything is validated before an object is built, so a bad file never yields a
half-loaded corpus.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import operator
import os
import tempfile
import threading
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from lookup_decode.core import automaton as K
from lookup_decode.core.config import check_int, check_match
from lookup_decode.core.draft import Draft
from lookup_decode.core.index import SuffixIndex
from lookup_decode.core.tokens import CURSOR_TAIL, SEPARATOR, as_token_array

FORMAT = "lookup_decode.corpus"
FORMAT_VERSION = 1


_HELD = operator.attrgetter("_index", "version")     # (in C: a comprehension is one more Python frame)


class Reading:
    """`Corpus.reading()` of several corpora at once: `with Reading(corpora) as held:` held lists their (index,
    version), each corpus unchanged while the block runs. A plain class: a drafter enters it at every engine step,
    where a generator-based context manager per corpus costs several times as much."""

    __slots__ = ("corpora",)

    def __init__(self, corpora):
        self.corpora = corpora

    def __enter__(self) -> list:
        held = 0
        try:
            for corpus in self.corpora:
                corpus._lock.acquire()
                held += 1
            return list(map(_HELD, self.corpora))
        except BaseException:
            for corpus in self.corpora[:held]:
                corpus._lock.release()
            raise

    def __exit__(self, *exc) -> None:
        for corpus in self.corpora:
            corpus._lock.release()


class CorpusFileError(ValueError):
    """A saved memory / references file that is corrupt, foreign, or of an unknown format version."""


@dataclass
class Entry:
    key: str                   # document name (references) or content hash (memory)
    tokens: np.ndarray         # int32 [n], n >= 1
    start: int = 0             # position of tokens[0] in the index text; changes on rebuild
    added: int = 0             # clock value when stored
    last_used: int = 0         # clock value when stored, or when a draft from it was last accepted
    accepted: int = 0          # draft tokens from this entry that the model kept


class Corpus:
    """Entries of token ids indexed together; see the module docstring.

    vocab_size: when given, every stored id must be below it (checked on insertion); a model is
    checked against the stored ids anyway before any request uses the corpus (`check_vocab`).
    """

    kind = "corpus"
    settings = ("vocab_size",)     # the constructor keywords `save` keeps and `load` passes back

    def __init__(self, *, vocab_size: int | None = None):
        self.vocab_size = None if vocab_size is None else check_int("vocab_size", vocab_size, 1)
        self._lock = threading.RLock()
        self._entries: dict[str, Entry] = {}   # in index order
        self._index = SuffixIndex(min_match=1, max_match=2**31 - 1)
        self._starts: list[int] = []           # [entries] start positions, ascending (index order)
        self._keys: list[str] = []             # [entries] keys, same order
        self._n_tokens = 0                     # tokens held (separators not counted)
        self._max_id = -1
        self.version = 0
        self.clock = 0

    # -- reading ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    @property
    def n_tokens(self) -> int:
        """Tokens held in all entries (separators not counted)."""
        return self._n_tokens

    def nbytes(self) -> int:
        """Bytes held by the index (its buffers' capacity) and the entries' own copies."""
        with self._lock:
            return self._index.nbytes() + sum(e.tokens.nbytes for e in self._entries.values())

    def entries(self) -> list[Entry]:
        """A snapshot of the entries, in index order (copies of the metadata; tokens are shared, read-only)."""
        with self._lock:
            return [replace(e) for e in self._entries.values()]

    def check_vocab(self, vocab_size: int, what: str = "the model") -> None:
        """ValueError if an entry holds an id that `what` (a vocabulary of `vocab_size` ids) does not know."""
        if self._max_id >= vocab_size:
            raise ValueError(f"the {self.kind} holds token id {self._max_id} but {what} has a vocabulary of "
                             f"{vocab_size} ids; was it filled with another tokenizer?")

    @contextmanager
    def reading(self):
        """(index, version) of the corpus, held unchanged while the block runs: for drafters that read the
        index directly (`core.pool.IndexPool.step` follows many requests over it in one call)."""
        with Reading((self,)) as (held,):
            yield held

    def cursor(self, *, min_match: int = 1, max_match: int = 64, eos_token_ids=(), window: int = 0) -> "Cursor":
        return Cursor(self, min_match=min_match, max_match=max_match, eos_token_ids=eos_token_ids, window=window)

    # -- writing (callers hold the lock) ---------------------------------------------------------
    def _tokens(self, tokens, what: str) -> np.ndarray:
        # A copy of our own: the caller may reuse its buffer, and entries must stay what was indexed.
        arr = np.array(as_token_array(tokens, what), dtype=np.int32, copy=True)
        if arr.size and int(arr.max()) == SEPARATOR:
            raise ValueError(f"{what} hold id {SEPARATOR}, reserved as the separator between entries")
        if self.vocab_size is not None and arr.size and int(arr.max()) >= self.vocab_size:
            raise ValueError(f"{what} hold token id {int(arr.max())}, unknown to a vocabulary of {self.vocab_size} ids")
        return arr

    def _append(self, entry: Entry) -> None:
        (entry.start,) = extend_index(self._index, [entry])
        self._entries[entry.key] = entry
        self._starts.append(entry.start)
        self._keys.append(entry.key)
        self._n_tokens += entry.tokens.size
        self._max_id = max(self._max_id, int(entry.tokens.max()))
        self.version += 1

    def _remove(self, keys) -> None:
        """Drop entries and rebuild the index from the others (O(kept tokens)).

        Exception safe: the new index is built aside and swapped in with the entries' new positions
        only when complete; a MemoryError or Ctrl-C during the rebuild leaves every entry in place."""
        gone = set(keys)
        kept = [e for key, e in self._entries.items() if key not in gone]
        index = SuffixIndex(min_match=1, max_match=2**31 - 1)
        self._install(index, kept, extend_index(index, kept))

    def _install(self, index: SuffixIndex, entries: list[Entry], starts: list[int]) -> None:
        """Swap in `index` holding `entries` at `starts` (caller holds the lock; nothing here can fail half way)."""
        for e, start in zip(entries, starts):
            e.start = int(start)
        self._index = index
        self._entries = {e.key: e for e in entries}
        self._starts = [e.start for e in entries]
        self._keys = [e.key for e in entries]
        self._n_tokens = sum(e.tokens.size for e in entries)
        self._max_id = max((int(e.tokens.max()) for e in entries), default=-1)
        self.version += 1

    def credit(self, version: int, position: int, accepted: int) -> None:
        """A draft copied from index `position` (at corpus `version`) had `accepted` tokens kept."""
        if accepted <= 0:
            return
        with self._lock:
            if version != self.version or not self._keys:
                return                          # the entry moved or went since; nothing to credit
            i = bisect.bisect_right(self._starts, position) - 1
            entry = self._entries.get(self._keys[i]) if i >= 0 else None
            if entry is not None:
                self.clock += 1
                entry.last_used = self.clock
                entry.accepted += int(accepted)

    # -- persistence -----------------------------------------------------------------------------
    def _settings(self) -> dict:
        return {name: getattr(self, name) for name in self.settings}

    def save(self, path) -> None:
        """Write the entries (not the index: it is rebuilt on load) to `path` (.npz).

        Atomic: written under the lock to a temp file of its own (two saves to one path never share one),
        fsynced, then renamed over `path`; on any failure the temp file goes and the old file stays."""
        path = Path(path)
        with self._lock:
            entries = list(self._entries.values())
            tokens = np.concatenate([e.tokens for e in entries]) if entries else np.zeros(0, np.int32)
            header = {"format": FORMAT, "version": FORMAT_VERSION, "kind": self.kind, "settings": self._settings(),
                      "clock": self.clock, "keys": [e.key for e in entries],
                      "added": [e.added for e in entries], "last_used": [e.last_used for e in entries],
                      "accepted": [e.accepted for e in entries], "sha256": hashlib.sha256(tokens.tobytes()).hexdigest()}
            lengths = np.array([e.tokens.size for e in entries], np.int64)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as f:   # np.savez would append ".npz" to a path without it
                    np.savez(f, header=np.frombuffer(json.dumps(header).encode(), np.uint8), tokens=tokens,
                             lengths=lengths)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise

    @classmethod
    def load(cls, path, *, model_vocab: int | None = None, **overrides):
        """A new corpus of this class from a file written by `save`; CorpusFileError when the file
        is not one (foreign, corrupt, other kind or format version). `overrides` replace saved settings.
        model_vocab: ValueError naming the file when an entry holds an id a model of that many ids does not know."""
        header, tokens, lengths = _read(path, cls.kind)
        try:
            obj = cls(**header["settings"])
        except (TypeError, ValueError) as e:
            raise CorpusFileError(f"{path}: saved settings {header['settings']} are not valid: {e}") from None
        if overrides:
            obj = cls(**{**header["settings"], **overrides})
        pieces = np.split(tokens, np.cumsum(lengths)[:-1]) if len(lengths) else []
        keep = obj._load_keep(header, lengths)
        with obj._lock:
            for i, key in enumerate(header["keys"]):
                if keep[i]:
                    arr = obj._tokens(pieces[i], f"entry {key!r} of {path}")
                    obj._append(Entry(key, arr, added=header["added"][i], last_used=header["last_used"][i],
                                      accepted=header["accepted"][i]))
            obj.clock = header["clock"]
        if model_vocab is not None:
            obj.check_vocab(model_vocab, f"the model ({cls.kind} file {path})")
        return obj

    def _load_keep(self, header: dict, lengths: np.ndarray) -> list[bool]:
        """Which saved entries to index (all; a bounded memory drops what it would evict before indexing, so
        a loaded corpus is within its bounds)."""
        return [True] * len(lengths)


def extend_index(index: SuffixIndex, entries: list[Entry]) -> list[int]:
    """Append the entries to index, each followed by SEPARATOR (one kernel call); their start positions."""
    if not entries:
        return []
    base = len(index)
    index.extend(np.concatenate([np.append(e.tokens, np.int32(SEPARATOR)) for e in entries]))
    return (base + np.concatenate([[0], np.cumsum([e.tokens.size + 1 for e in entries])[:-1]])).tolist()


def least_useful(entries, budget: int) -> list:
    """The keys of the entries to drop until at most `budget` of their tokens remain, least recently useful first:
    oldest last use, then fewer accepted draft tokens, then older entry."""
    held, gone = sum(e.tokens.size for e in entries), []
    for e in sorted(entries, key=lambda e: (e.last_used, e.accepted, e.added)):
        if held <= budget:
            break
        gone.append(e.key)
        held -= e.tokens.size
    return gone


_MEMBERS = {"header.npy", "tokens.npy", "lengths.npy"}
_MAX_HEADER_BYTES = 1 << 26


def _check_members(path, bad) -> None:
    """Before any array is read: the file is a zip of exactly our three members, stored uncompressed (what
    `save` writes), so no member can expand beyond the file's own size; the header is small."""
    os.stat(path)                               # FileNotFoundError as before for a missing file
    if not zipfile.is_zipfile(path):
        raise bad("not an .npz archive")
    with zipfile.ZipFile(path) as z:
        infos = z.infolist()
        if {i.filename for i in infos} != _MEMBERS or len(infos) != 3:
            raise bad(f"arrays {sorted(i.filename.removesuffix('.npy') for i in infos)}")
        for i in infos:
            if i.compress_type != zipfile.ZIP_STORED or i.file_size != i.compress_size:
                raise bad(f"member {i.filename} is compressed; save() stores arrays uncompressed, and a compressed "
                          f"member could expand far beyond the file's size")
        if z.getinfo("header.npy").file_size > _MAX_HEADER_BYTES:
            raise bad("header too large")


def _read(path, kind: str):
    """(header, tokens int32 [n], lengths int64 [entries]) from a saved corpus, fully validated."""
    def bad(why):
        return CorpusFileError(f"{path}: not a lookup_decode {kind} file ({why})")
    try:
        _check_members(path, bad)
        with np.load(path, allow_pickle=False) as f:     # the members are _MEMBERS (checked above)
            raw, tokens, lengths = f["header"], f["tokens"], f["lengths"]
    except (CorpusFileError, FileNotFoundError):
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, TypeError, AttributeError) as e:
        raise bad(f"unreadable: {e}") from None
    try:
        header = json.loads(raw.tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise bad("header is not JSON") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise bad(f"format {header.get('format') if isinstance(header, dict) else None!r}")
    if header.get("version") != FORMAT_VERSION:
        raise CorpusFileError(f"{path}: format version {header.get('version')!r}; this lookup_decode reads "
                              f"version {FORMAT_VERSION}")
    if header.get("kind") != kind:
        raise CorpusFileError(f"{path} holds a {header.get('kind')!r}, not a {kind!r}")
    if tokens.dtype != np.int32 or tokens.ndim != 1 or lengths.dtype != np.int64 or lengths.ndim != 1:
        raise bad("array types")
    # Python ints: an int64 sum of crafted lengths could wrap around to the right total.
    if np.any(lengths < 1) or sum(int(n) for n in lengths) != tokens.size:
        raise bad("entry lengths do not add up to the tokens")
    n = len(lengths)
    fields = ("keys", "added", "last_used", "accepted")
    if not all(isinstance(header.get(k), list) and len(header[k]) == n for k in fields) \
            or not isinstance(header.get("settings"), dict) or not isinstance(header.get("clock"), int):
        raise bad("entry metadata does not match the entries")
    if not all(isinstance(key, str) for key in header["keys"]) or not all(
            isinstance(v, int) and not isinstance(v, bool) for k in fields[1:] for v in header[k]):
        raise bad("entry metadata has the wrong types")
    if len(set(header["keys"])) != n:
        raise bad("duplicate entry keys")
    if hashlib.sha256(tokens.tobytes()).hexdigest() != header.get("sha256"):
        raise bad("checksum mismatch: the tokens were changed or truncated")
    return header, tokens, lengths


class Cursor:
    """One request's view of a corpus: follows the request's tokens, drafts what followed them there.

    A `Drafter`: `extend(tokens)`, `propose(max_tokens) -> Draft`; `match_len` is the current match.
    Occurrence rule: the index's (keep copying from the same place while it matches; else, with window > 0,
    the occurrence nearest to where the copied place would have gone on, within window tokens — how a
    request's prediction is followed through edits; else the earliest occurrence of the longest suffix found
    in the corpus). Drafts stop before an EOS id and at the end of an entry.
    """

    def __init__(self, corpus: Corpus, *, min_match: int = 1, max_match: int = 64, eos_token_ids=(), window: int = 0):
        self.min_match, self.max_match = check_match(min_match, max_match)
        self.window = int(window)
        self.corpus = corpus
        self._stops = np.append(as_token_array(list(eos_token_ids), "eos_token_ids"), np.int32(SEPARATOR))
        self._tail = np.zeros(0, np.int32)     # the request's last tokens, for re-walking after a change
        self._state = SuffixIndex.new_cursor()
        self._version = -1
        self.draft_end = -1                     # index position the last non-empty draft copied after
        self.draft_version = -1

    def _catch_up(self) -> None:
        """Re-walk the tail if the corpus changed since this cursor last read it (caller holds the lock)."""
        if self._version != self.corpus.version:
            self._state = SuffixIndex.new_cursor()
            self.corpus._index.follow(self._state, self._tail, self.window)
            self._version = self.corpus.version

    def extend(self, tokens) -> None:
        new = as_token_array(tokens)
        if new.size == 0:
            return
        keep = min(self.max_match, CURSOR_TAIL)
        self._tail = np.concatenate([self._tail, new])[-keep:]
        with self.corpus._lock:
            if self._version != self.corpus.version:
                self._catch_up()
            else:
                self.corpus._index.follow(self._state, new, self.window)

    def propose(self, max_tokens: int) -> Draft:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        with self.corpus._lock:
            self._catch_up()
            if self._state[3] < self.min_match or max_tokens == 0:
                return Draft(np.zeros(0, np.int32), self.match_len)
            end = int(self._state[2])
            index = self.corpus._index
            draft = index.continuation(end, max_tokens, self._stops)
            if draft.size:
                self.draft_end, self.draft_version = end, self.corpus.version
            branched = bool(K.branched(index._shead, index._enext, self._state[0]))
            return Draft(draft, self.match_len, branched=branched)

    @property
    def match_len(self) -> int:
        return min(int(self._state[3]), self.max_match)

    def credit(self, accepted: int) -> None:
        """The last non-empty draft had `accepted` tokens kept: mark its entry as useful."""
        self.corpus.credit(self.draft_version, self.draft_end + 1, accepted)
