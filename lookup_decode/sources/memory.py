"""Session memory and reference documents: text to draft from that is not in the current request.

    memory = lookup_decode.Memory(max_tokens=200_000)           # earlier outputs, bounded
    refs = lookup_decode.References()
    refs.register("utils.py", text=source, tokenizer=tokenizer)  # indexed once, used by every request
    out = lookup_decode.generate(model, ids, memory=memory, references=refs, max_new_tokens=256)

Both are `Corpus`es (one suffix index each, shared by every request and thread). `generate` drafts
from the request itself, the memory and the references (rule: `sources.proposer`) and, when it returns,
stores the new output in the memory. Drafts are only guesses that the model verifies, so whatever
a source holds, the output is the one plain decoding gives.

Every way of reading them from files is here (`load_memory`, `load_references`): the CLI's chat, the batch
job and the vLLM drafter ask these, and each fails with an error naming the file.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import numpy as np

from lookup_decode.core.config import check_int
from lookup_decode.core.index import SuffixIndex
from lookup_decode.sources.corpus import Corpus, Entry, extend_index, least_useful

# After an eviction the memory holds at most this share of its bound, so the O(bound) rebuild of
# the index happens at most once per bound / 4 tokens stored: amortized <= 4 index inserts per token.
LOW_WATER = 0.75
HIGH_WATER = 0.875   # `evict_aside` evicts once the memory holds more than this share of its bound


class Memory(Corpus):
    """Earlier outputs (and optionally prompts) of a session, bounded in tokens, shared between requests.

    Eviction rule (least recently useful first): every entry carries the memory's clock value at
    its last use: when it was stored, stored again (an identical output is kept once), or when a
    draft copied from it had a token accepted. When a new entry would exceed `max_tokens`, entries
    go in order of oldest last use (ties: fewer accepted draft tokens, then older entry) until
    everything, the new entry included, fits in LOW_WATER * max_tokens; then the index is rebuilt.
    An entry longer than that keeps its first LOW_WATER * max_tokens tokens.

    Args:
        max_tokens: bound on the tokens held (>= 1). `nbytes()` tells what the index costs (measured
            per token in benchmarks/results/reference_index/).
        remember_prompts: also store each request's prompt (default: outputs only; a chat's prompt
            already holds its history, and system prompts would crowd out the outputs).
        vocab_size: reject ids >= vocab_size on insertion (models are checked before use anyway).
    """

    kind = "memory"
    settings = ("max_tokens", "remember_prompts", "vocab_size")

    def __init__(self, max_tokens: int = 1_000_000, *, remember_prompts: bool = False, vocab_size: int | None = None):
        super().__init__(vocab_size=vocab_size)
        self.max_tokens = check_int("memory max_tokens", max_tokens, 1)
        if not isinstance(remember_prompts, bool):
            raise TypeError(f"remember_prompts must be True or False, got {remember_prompts!r}")
        self.remember_prompts = remember_prompts
        self.evicted = 0                        # entries evicted so far

    def add(self, tokens) -> bool:
        """Store one sequence of token ids (int [n]); True if it was new (a repeat only refreshes its entry)."""
        return self.store(tokens)[1]

    def store(self, tokens, *, replaces: str | None = None) -> tuple[str | None, bool]:
        """Store one sequence of token ids (int [n]); returns (its entry's key, whether it was new), (None,
        False) for an empty one. `replaces`: the key of an entry this one extends (an earlier store of the same
        request's output, now longer): that entry is marked to go first at the next eviction. It is not
        removed now: removing means rebuilding the index (O(memory)), while a prefix left in place only
        duplicates tokens; drafts from it stop where it ends and continue from the longer entry."""
        arr = self._tokens(tokens, "memory tokens")
        if arr.size == 0:
            return None, False
        arr = arr[: max(1, int(LOW_WATER * self.max_tokens))]
        key = hashlib.sha1(arr.tobytes()).hexdigest()
        with self._lock:
            self.clock += 1
            old = self._entries.get(replaces) if replaces is not None and replaces != key else None
            if old is not None:
                old.last_used, old.accepted = -1, 0         # before everything else in the eviction order
            if key in self._entries:
                self._entries[key].last_used = self.clock
                return key, False
            if self._n_tokens + arr.size > self.max_tokens:
                gone = least_useful(self._entries.values(), int(LOW_WATER * self.max_tokens) - arr.size)
                self.evicted += len(gone)
                self._remove(gone)
            self._append(Entry(key, arr, added=self.clock, last_used=self.clock))
            return key, True

    def remember(self, prompt, output, *, replaces: str | None = None) -> str | None:
        """What `generate` calls when a request returns: store its output (and prompt if asked); returns the
        output's entry key (None: empty). `replaces`: as for `store`."""
        if self.remember_prompts:
            self.add(prompt)
        return self.store(output, replaces=replaces)[0]

    def evict_aside(self) -> int:
        """Evict as a full memory would (down to LOW_WATER of the bound, least recently useful first), but build
        the new index outside the lock, so requests reading the memory never wait for the O(bound) rebuild; for a
        background thread (the vLLM drafter's) to run before a store finds the memory full. Entries stored while
        it builds are added to the new index before it is swapped in (O(their tokens), under the lock). Returns
        the entries evicted: 0 when the memory holds at most HIGH_WATER of its bound, or when an entry to keep
        was removed meanwhile (then nothing changes)."""
        with self._lock:
            if self._n_tokens <= HIGH_WATER * self.max_tokens:
                return 0
            gone = set(least_useful(self._entries.values(), int(LOW_WATER * self.max_tokens)))
            kept = [e for e in self._entries.values() if e.key not in gone]
            seen, clock = set(self._entries), self.clock
        index = SuffixIndex(min_match=1, max_match=2**31 - 1)
        starts = extend_index(index, kept)
        with self._lock:
            if any(e.key not in self._entries for e in kept):
                return 0
            # Stored meanwhile, or stored again (refreshed) after being chosen to go: in the new index too.
            added = [e for key, e in self._entries.items() if key not in seen or (key in gone and e.last_used > clock)]
            starts += extend_index(index, added)
            evicted = len(self._entries) - len(kept) - len(added)
            self._install(index, kept + added, starts)
            self.evicted += evicted
            return evicted

    def _load_keep(self, header: dict, lengths) -> list[bool]:
        """The entries a load indexes: over max_tokens, the eviction rule of `store` is applied to the saved
        metadata first, so a large file never gets indexed whole just to be cut down."""
        if sum(int(n) for n in lengths) <= self.max_tokens:
            return [True] * len(lengths)
        # Entries of the right sizes that share one buffer: no token is read before the choice.
        sizes = np.empty(int(max(lengths)), np.int32)
        saved = [Entry(i, sizes[:int(n)], added=header["added"][i], last_used=header["last_used"][i],
                       accepted=header["accepted"][i]) for i, n in enumerate(lengths)]
        gone = set(least_useful(saved, int(LOW_WATER * self.max_tokens)))
        self.evicted += len(gone)
        return [i not in gone for i in range(len(lengths))]

    def snapshot(self) -> "Memory":
        """A copy of the entries without an index (O(entries): the token arrays are shared, never written), for
        `save` to write while this memory goes on serving: a writer of it holds only the copy's lock."""
        copy = Memory(**self._settings())
        with self._lock:
            copy._entries = {e.key: replace(e) for e in self._entries.values()}
            copy.clock, copy._n_tokens = self.clock, self._n_tokens
        return copy

    def merge(self, other: "Memory") -> int:
        """Add the entries of `other` that this memory lacks (e.g. what another replica saved); returns how many."""
        return sum(self.add(e.tokens) for e in other.entries())


class References(Corpus):
    """Reference documents (source files, retrieved passages) registered once and used by every request.

    Documents are never evicted: `register` refuses to exceed `max_tokens` (None: no bound), and
    `remove` takes them out. Registering or removing costs O(tokens of the documents concerned);
    removing rebuilds the index from the remaining documents.
    """

    kind = "references"
    settings = ("max_tokens", "vocab_size")

    def __init__(self, *, max_tokens: int | None = None, vocab_size: int | None = None):
        super().__init__(vocab_size=vocab_size)
        self.max_tokens = None if max_tokens is None else check_int("references max_tokens", max_tokens, 1)

    def register(self, name: str, text: str | None = None, *, tokens=None, tokenizer=None,
                 replace: bool = False) -> int:
        """Add a document from `text` (with `tokenizer`) or from token ids; returns its token count.

        `replace=True` swaps in a new version of a document already registered under `name`.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"a document needs a non-empty name, got {name!r}")
        if (text is None) == (tokens is None):
            raise ValueError(f"document {name!r}: pass either text (with a tokenizer) or tokens, not both")
        if text is not None:
            if tokenizer is None:
                raise ValueError(f"document {name!r}: text needs tokenizer=... (the model's tokenizer)")
            if not isinstance(text, str):
                raise TypeError(f"document {name!r}: text must be a str, got {type(text).__name__}")
            tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        arr = self._tokens(tokens, f"document {name!r}")
        if arr.size == 0:
            raise ValueError(f"document {name!r} is empty: nothing to draft from")
        with self._lock:
            if name in self._entries and not replace:
                raise ValueError(f"a document named {name!r} is already registered; remove it or pass replace=True")
            held = self._n_tokens - (self._entries[name].tokens.size if name in self._entries else 0)
            if self.max_tokens is not None and held + arr.size > self.max_tokens:
                raise ValueError(f"document {name!r} ({arr.size} tokens) does not fit: the references hold "
                                 f"{held} of at most {self.max_tokens} tokens; remove documents first")
            if name in self._entries:
                self._remove([name])
            self.clock += 1
            self._append(Entry(name, arr, added=self.clock, last_used=self.clock))
        return int(arr.size)

    def remove(self, *names: str) -> None:
        """Remove documents by name (KeyError naming the first unknown one; then nothing is removed)."""
        with self._lock:
            for name in names:
                if name not in self._entries:
                    raise KeyError(f"no document named {name!r} is registered")
            self._remove(list(names))

    @property
    def names(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def remember(self, prompt, output) -> None:
        """References do not learn from requests."""

    def _load_keep(self, header: dict, lengths) -> list[bool]:
        held = sum(int(n) for n in lengths)
        if self.max_tokens is not None and held > self.max_tokens:   # refused before indexing anything
            raise ValueError(f"the saved references hold {held} tokens, more than max_tokens={self.max_tokens}")
        return [True] * len(lengths)


def load_memory(paths, *, max_tokens: int = 1_000_000, vocab_size: int | None = None, missing_ok=()) -> Memory:
    """A Memory of at most max_tokens holding the entries of the `Memory.save` files `paths`, merged in order
    (the first file found is loaded as it was saved, its entries' use counts included; the others' entries
    are added to it).

    A path in `missing_ok` may not exist yet (the file this process will write); any other missing or
    unreadable file raises (FileNotFoundError, CorpusFileError), as does one holding ids a vocabulary of
    vocab_size does not know (ValueError). No file: an empty memory.
    """
    memory = None
    for path in paths:
        if not Path(path).is_file():
            if str(path) in {str(p) for p in missing_ok}:
                continue
            raise FileNotFoundError(f"no memory file at {path}")
        loaded = Memory.load(path, max_tokens=max_tokens, vocab_size=None, model_vocab=vocab_size)
        if memory is None:
            memory = loaded
            memory.vocab_size = vocab_size      # later insertions are checked against the model's vocabulary
        else:
            memory.merge(loaded)
    return memory if memory is not None else Memory(max_tokens, vocab_size=vocab_size)


def load_references(path, *, tokenizer=None, vocab_size: int | None = None) -> References:
    """References from a `References.save` file (.npz), or from a folder of such files and of UTF-8 text files
    (tokenized with `tokenizer`), each document named by its path inside the folder.

    Raises FileNotFoundError (no such path), CorpusFileError (a bad .npz), ValueError (text that is not UTF-8,
    or text without a tokenizer to read it, or ids a vocabulary of vocab_size does not know)."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"references: {root} does not exist")
    files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
    refs = References(vocab_size=vocab_size)
    for file in files:
        name = str(file.relative_to(root)) if root.is_dir() else file.name
        if file.suffix == ".npz":
            loaded = References.load(file, vocab_size=None, model_vocab=vocab_size)
            for entry in loaded.entries():
                refs.register(f"{name}:{entry.key}", tokens=entry.tokens)
            continue
        if tokenizer is None:
            raise ValueError(f"references: {file} is text and there is no tokenizer to read it; save the "
                             "references with References.save instead")
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"references: cannot read {file} as UTF-8 text ({e})") from None
        if text:                                # an empty file is no document
            refs.register(name, text, tokenizer=tokenizer)
    return refs


def prediction_of(prediction, *, tokenizer=None, vocab_size: int | None = None) -> References:
    """A request's prediction (the text its output is expected to repeat, as OpenAI's Predicted Outputs) as a
    corpus of its own: `prediction` is a text (tokenized with `tokenizer`, no special tokens) or token ids (a list,
    an int array or a 1-D tensor). ValueError/TypeError naming the problem (empty, not ids, unknown to a vocabulary
    of vocab_size ids, text without a tokenizer). Example: prediction_of([5, 6, 7]).n_tokens == 3."""
    refs = References(vocab_size=vocab_size)
    if isinstance(prediction, str):
        if tokenizer is None:
            raise ValueError("a text prediction needs the model's tokenizer (pass tokenizer=..., or token ids)")
        refs.register("prediction", prediction, tokenizer=tokenizer)
    else:
        refs.register("prediction", tokens=prediction.tolist() if hasattr(prediction, "tolist") else prediction)
    return refs
