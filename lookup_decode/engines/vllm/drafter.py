"""lookup_decode as a vLLM drafter: `speculative_config={"method": "custom_class", "model":
"lookup_decode.vllm.LookupDrafter", "num_speculative_tokens": K}`.

vLLM (v1 GPU model runner) builds the class with the engine's `vllm_config` and, after every step,
calls `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None)`: the
persistent batch as a token matrix (row i holds the request's prompt and committed tokens,
`token_ids_cpu[i, :num_tokens_no_spec[i]]`, the tokens sampled this step already written in), and
per row the tokens this step emitted (`[]`: a partial prefill). It returns one draft per row, ragged,
`[]` for none. Request ids are not passed, and rows move (finished requests leave and the batch is
condensed; unscheduled ones leave and come back elsewhere).

So each live request is recognised by content: a fingerprint of its row (length, first tokens, last
tokens, tokens at evenly spaced positions: O(1) per row, whatever the context) before this step's
tokens must equal the fingerprint the request had after the previous step. Its state — the same
drafter as the transformers path (`SuffixIndex`, wrapped in `SourcesProposer` with memory /
references) and its own `DraftPolicy` — is then extended by the new tokens only. A row whose
fingerprint is unknown (a new request, or one whose state was dropped) gets a state built from its
row once. A wrong recognition (two requests of equal length agreeing on every sampled position) can
only cost draft quality: vLLM verifies every draft, so the output never depends on the drafter.

States of requests absent for `idle_steps` steps are retired (their output goes to the session
memory, if any); index bytes stay within `max_index_bytes` (least recently seen states go first; a
new request that does not fit while every state is live gets no index, and no drafts, until one frees).

Settings come from environment variables or a JSON file (vLLM passes no options to the class); see
`Settings`. Nothing here imports vLLM.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from lookup_decode.core.config import LookupConfig, check_k, check_match
from lookup_decode.core.cost import CostCurve
from lookup_decode.core.draft import Draft, kept_prefix
from lookup_decode.core.index import SuffixIndex
from lookup_decode.core.policy import DraftPolicy
from lookup_decode.core.tokens import eos_ids
from lookup_decode.sources.memory import Memory, References, load_memory, load_references
from lookup_decode.sources.proposer import MEMORY, REFERENCES, SourcesProposer

ENV_PREFIX = "LOOKUP_DECODE_"

# Fingerprint positions: the first and last tokens tell most requests apart; evenly spaced ones catch
# requests that share a long template at both ends (same system prompt, same closing question).
_HEAD, _TAIL, _SPREAD = 8, 16, 8
_MULT = np.random.default_rng(20250514).integers(1, 2**63, size=_HEAD + _TAIL + _SPREAD + 1, dtype=np.uint64) | 1


@dataclass(frozen=True)
class Settings:
    """What the drafter reads from LOOKUP_DECODE_<NAME> (upper case) or from the JSON file named by
    LOOKUP_DECODE_CONFIG (lower-case keys); environment variables win over the file.

    k: most draft tokens per step (default and upper bound: vLLM's num_speculative_tokens).
    min_match, max_match: as in `LookupConfig` (same defaults as the transformers path).
    draft_cost: cost of one draft token in the verify forward relative to the step without drafts
        (the policy drafts d tokens when E[emitted | d] / (1 + draft_cost * d) is best). 0: always
        draft everything the index proposes (up to k), like vLLM's n-gram proposer.
    memory: memory file(s) to load at start (os.pathsep-separated; merged), made by `Memory.save` or
        by another replica's `memory_save`.
    memory_save: where this replica writes its memory (every `save_every` stored outputs, and on
        `flush`). With memory_save but no memory file yet, the memory starts empty.
    memory_tokens: the memory's bound in tokens.
    references: a `References.save` file, or a folder of them and of text files (tokenized with the
        engine's tokenizer).
    max_index_bytes: bound on the bytes of all per-request indexes together.
    idle_steps: a request absent from the batch for this many steps is retired.
    save_every: memory_save is written after this many outputs were stored.
    reload_every: every this many steps, the memory files are read again and their new entries added
        (what other replicas saved since); 0: only at start.
    eos: token ids a draft never contains (default: the model config's eos_token_id).
    """
    k: int | None = None
    min_match: int = LookupConfig.min_match
    max_match: int = LookupConfig.max_match
    draft_cost: float = 0.02
    memory: str | None = None
    memory_save: str | None = None
    memory_tokens: int = 1_000_000
    references: str | None = None
    max_index_bytes: int = 4 * 2**30
    idle_steps: int = 16
    save_every: int = 64
    reload_every: int = 0
    eos: tuple[int, ...] | None = None

    @classmethod
    def from_env(cls, environ=None) -> "Settings":
        """Settings from LOOKUP_DECODE_CONFIG (a JSON object) and LOOKUP_DECODE_* variables."""
        environ = os.environ if environ is None else environ
        raw: dict = {}
        path = environ.get(ENV_PREFIX + "CONFIG")
        if path:
            try:
                raw = json.loads(Path(path).read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{ENV_PREFIX}CONFIG={path}: cannot read a JSON settings file ({e})") from None
            if not isinstance(raw, dict):
                raise ValueError(f"{ENV_PREFIX}CONFIG={path}: expected a JSON object, got {type(raw).__name__}")
        names = {f.name: f for f in fields(cls)}
        unknown = set(raw) - set(names)
        if unknown:
            raise ValueError(f"{ENV_PREFIX}CONFIG={path}: unknown settings {sorted(unknown)}; known: {sorted(names)}")
        values = dict(raw)
        for name in names:
            if ENV_PREFIX + name.upper() in environ:
                values[name] = environ[ENV_PREFIX + name.upper()]
        return cls(**{name: _parse(name, value) for name, value in values.items()})

    def __post_init__(self):
        if self.k is not None:
            check_k(self.k)
        check_match(self.min_match, self.max_match)
        for name in ("memory_tokens", "max_index_bytes", "idle_steps", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{ENV_PREFIX}{name.upper()} must be >= 1, got {getattr(self, name)}")
        if self.reload_every < 0:
            raise ValueError(f"{ENV_PREFIX}RELOAD_EVERY must be >= 0, got {self.reload_every}")
        if not self.draft_cost >= 0:
            raise ValueError(f"{ENV_PREFIX}DRAFT_COST must be >= 0, got {self.draft_cost}")


def _parse(name: str, value):
    """A setting from a string (environment) or a JSON value, to its field's type; ValueError naming it."""
    try:
        if name in ("memory", "memory_save", "references"):
            return None if value in (None, "") else str(value)
        if name == "eos":
            if value in (None, ""):
                return None
            items = value.split(",") if isinstance(value, str) else value
            return tuple(int(v) for v in items)
        if name == "draft_cost":
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if name == "k" and value in (None, ""):
            return None
        if isinstance(value, bool) or isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{ENV_PREFIX}{name.upper()}: cannot read {value!r} as a {name} setting") from None


def _vocab_size(vllm_config) -> int | None:
    """The engine model's vocabulary size, when the config tells it (a test's SimpleNamespace may not)."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is None:
        return None
    if callable(getattr(model_config, "get_vocab_size", None)):
        return int(model_config.get_vocab_size())
    for attr in ("hf_text_config", "hf_config"):
        size = getattr(getattr(model_config, attr, None), "vocab_size", None)
        if size is not None:
            return int(size)
    return None


def _eos_ids(vllm_config) -> tuple[int, ...]:
    return tuple(eos_ids(getattr(getattr(vllm_config, "model_config", None), "hf_config", None)))


def fingerprints(token_ids: np.ndarray, rows: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """uint64 [r]: a fingerprint of token_ids[rows[j], :lengths[j]] for each j, from O(1) tokens per row.

    It hashes the length, the first 8 and last 16 tokens and 8 tokens at evenly spaced positions, so
    rows that differ in length or at any of those positions get different fingerprints (with
    probability ~1 - 2**-64). Example: the rows [5, 6, 7] and [5, 6, 7, 8] at length 3 are equal.
    """
    lengths = lengths.astype(np.int64)
    head = np.arange(_HEAD)[None, :]
    tail = lengths[:, None] - _TAIL + np.arange(_TAIL)[None, :]
    spread = (lengths[:, None] * np.arange(1, _SPREAD + 1)[None, :]) // (_SPREAD + 1)
    pos = np.concatenate([np.broadcast_to(head, (len(rows), _HEAD)), tail, spread], axis=1)
    inside = (pos >= 0) & (pos < lengths[:, None])
    pos = np.clip(pos, 0, None)
    toks = token_ids[rows[:, None], pos].astype(np.uint64) + np.uint64(1)
    toks = np.where(inside, toks, np.uint64(0))                 # positions past a short row count as 0
    with np.errstate(over="ignore"):
        return (toks * _MULT[:-1]).sum(axis=1, dtype=np.uint64) + lengths.astype(np.uint64) * _MULT[-1]


@dataclass
class RequestState:
    """One live request: its drafter, its policy, and what the next step needs to learn."""
    drafter: object                    # SuffixIndex, or SourcesProposer around it
    index: SuffixIndex                 # the request's own index (for its length and bytes)
    sources: SourcesProposer | None    # the drafter when it also drafts from corpora (its per-source counts)
    policy: DraftPolicy
    prompt_len: int | None             # known when first seen right after its prefill (one sampled token)
    last_seen: int = 0                 # drafter step counter when this request was last in the batch
    full: Draft | None = None          # the whole proposal of the previous step (the policy learns from it)
    nbytes: int = 0
    grows_at: int = 0                  # index length past which its buffers may grow (bytes re-read)


@dataclass
class DrafterStats:
    """Counters of one LookupDrafter (sums since construction)."""
    steps: int = 0                     # propose() calls
    rows: int = 0                      # rows that asked for a draft (non-empty sampled tokens)
    drafted: int = 0                   # draft tokens returned
    accepted: int = 0                  # of those, kept by the engine (seen in the next step's tokens)
    built: int = 0                     # states built from a whole row (new or forgotten requests)
    extended: int = 0                  # rows recognised and extended by their new tokens only
    retired: int = 0                   # states dropped after idle_steps absent
    evicted: int = 0                   # states dropped for the byte bound
    refused: int = 0                   # rows left without an index for the byte bound
    stored: int = 0                    # outputs stored into the memory
    sources: Counter = field(default_factory=Counter)   # accepted draft tokens per source (with corpora)


class LookupDrafter:
    """vLLM `custom_class` drafter: lookup_decode's drafts for every row of vLLM's persistent batch.

    Constructed by vLLM as `LookupDrafter(vllm_config)`; settings from the environment (`Settings`).
    Tests and benchmarks may build one with `LookupDrafter.from_settings(settings, k=..., ...)`.
    """

    def __init__(self, vllm_config):
        spec = getattr(vllm_config, "speculative_config", None)
        if spec is None or getattr(spec, "num_speculative_tokens", None) is None:
            raise ValueError("LookupDrafter needs vllm_config.speculative_config.num_speculative_tokens")
        model_config = getattr(vllm_config, "model_config", None)
        settings = Settings.from_env()
        eos = settings.eos if settings.eos is not None else _eos_ids(vllm_config)
        self._setup(settings, spec.num_speculative_tokens, getattr(model_config, "max_model_len", None),
                    _vocab_size(vllm_config), eos, tokenizer_name=getattr(model_config, "tokenizer", None))

    @classmethod
    def from_settings(cls, settings: Settings, num_speculative_tokens: int, *, max_model_len: int | None = None,
                      vocab_size: int | None = None, eos_token_ids=(), memory: Memory | None = None,
                      references: References | None = None, tokenizer=None) -> "LookupDrafter":
        """A drafter without a vLLM config (tests, benchmarks); memory/references objects may be passed
        directly instead of files."""
        self = cls.__new__(cls)
        self._setup(settings, num_speculative_tokens, max_model_len, vocab_size, tuple(eos_token_ids),
                    memory=memory, references=references, tokenizer=tokenizer)
        return self

    def _setup(self, settings: Settings, num_speculative_tokens, max_model_len, vocab_size, eos, *,
               memory=None, references=None, tokenizer=None, tokenizer_name=None) -> None:
        if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, (int, np.integer)) \
                or num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be an int >= 1 for lookup_decode's drafter, "
                             f"got {num_speculative_tokens!r}")
        self.settings = settings
        self.k = min(int(num_speculative_tokens), settings.k) if settings.k is not None else int(num_speculative_tokens)
        if self.k < 1:
            raise ValueError(f"{ENV_PREFIX}K must be >= 1, got {settings.k}")
        self.max_model_len = max_model_len
        self.eos = tuple(eos)
        # The policy's price of a step drafting d tokens, relative to one without drafts: linear. A flat
        # price (draft_cost 0) makes the longest draft best whatever was learned (E[emitted | d] grows with
        # d), which is the policy without a cost: it skips the per-width pricing.
        self.cost = (CostCurve([1, self.k + 1], [1.0, 1.0 + settings.draft_cost * self.k], self.k + 1)
                     if settings.draft_cost > 0 else None)
        self.vocab_size = vocab_size
        self.memory = memory if memory is not None else _load_memory(settings, vocab_size)
        self.references = references if references is not None else _load_references(
            settings, vocab_size, tokenizer, tokenizer_name)
        self.corpora = [(name, c) for name, c in ((MEMORY, self.memory), (REFERENCES, self.references))
                        if c is not None]
        for name, corpus in self.corpora:       # a foreign memory file fails here, not while serving
            if vocab_size is not None:
                corpus.check_vocab(vocab_size, "the engine's model")
        self.stats = DrafterStats()
        self._states: dict[int, list[RequestState]] = {}    # fingerprint -> states (equal rows share one)
        self._index_bytes = 0
        self._step = 0
        self._unsaved = 0

    # -- the vLLM contract ---------------------------------------------------------------------------
    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]:
        """One draft per row of the batch (list of int, [] for none).

        sampled_token_ids: list[list[int]], the tokens each row emitted this step ([]: a partial prefill,
            no draft). num_tokens_no_spec: int [>= rows], committed tokens per row (numpy or torch).
        token_ids_cpu: int [>= rows, max_model_len] (numpy or torch), row i's tokens in its first
            num_tokens_no_spec[i] columns. slot_mappings: unused (no model).
        """
        self._step += 1
        self.stats.steps += 1
        B = len(sampled_token_ids)
        counts = _numpy(num_tokens_no_spec)[:B].astype(np.int64)
        tokens = _numpy(token_ids_cpu)
        emitted_n = np.fromiter((len(s) for s in sampled_token_ids), np.int64, count=B)
        rows = np.flatnonzero(emitted_n > 0)
        if self.max_model_len is not None:
            rows = rows[counts[rows] < self.max_model_len]
        before = fingerprints(tokens, rows, counts[rows] - emitted_n[rows])
        after = fingerprints(tokens, rows, counts[rows])
        drafts: list[list[int]] = [[] for _ in range(B)]
        for j, i in enumerate(rows.tolist()):
            state = self._claim(int(before[j]), sampled_token_ids[i], tokens[i], int(counts[i]))
            if state is None:
                continue
            state.last_seen = self._step
            self._states.setdefault(int(after[j]), []).append(state)
            limit = self.k if self.max_model_len is None else min(self.k, self.max_model_len - int(counts[i]) - 1)
            if limit <= 0:
                state.full = None
                continue
            full = state.drafter.propose(limit)
            n = state.policy.choose([full]) - 1
            state.full = full
            drafts[i] = (full.tokens if n >= len(full) else full.cut(n).tokens).tolist()
            self.stats.drafted += len(drafts[i])
        self.stats.rows += len(rows)
        self._retire_idle()
        if self.settings.reload_every and self._step % self.settings.reload_every == 0:
            self.reload_memory()
        return drafts

    def load_model(self, *args, **kwargs) -> None:
        """vLLM calls this after building the drafter; there is no model to load."""

    # -- requests ------------------------------------------------------------------------------------
    def _claim(self, key: int, emitted, row: np.ndarray, n: int) -> RequestState | None:
        """The state of the request in this row, extended by its new tokens; built if unknown."""
        waiting = self._states.get(key)
        if waiting:
            state = waiting.pop()
            if not waiting:
                del self._states[key]
            new = np.asarray(emitted, dtype=np.int32)
            if state.full is not None:
                if self.cost is not None:       # without a cost the policy never reads what it learns
                    state.policy.observe(state.full, new)
                if len(state.full):
                    self.stats.accepted += kept_prefix(state.full.chain, new)
            if state.sources is not None:
                before = Counter(state.sources.accepted_from)
                state.drafter.extend(new)
                self.stats.sources.update(state.sources.accepted_from - before)
            else:
                state.drafter.extend(new)
            if len(state.index) > state.grows_at:
                self._account(state)
                if self._index_bytes > self.settings.max_index_bytes:
                    # Its buffers doubled past the bound: older states go first, else this one does
                    # (its row drafts nothing until an index fits again).
                    self._evict(self.settings.max_index_bytes)
                    if self._index_bytes > self.settings.max_index_bytes:
                        self._index_bytes -= state.nbytes
                        self.stats.evicted += 1
                        self._remember(state)
                        return None
            self.stats.extended += 1
            return state
        return self._build(row[:n], n - len(emitted) if len(emitted) == 1 else None)

    def _build(self, tokens: np.ndarray, prompt_len: int | None) -> RequestState | None:
        estimate = SuffixIndex.bytes_for(len(tokens))
        if self._index_bytes + estimate > self.settings.max_index_bytes:
            self._evict(self.settings.max_index_bytes - estimate)
            if self._index_bytes + estimate > self.settings.max_index_bytes:
                self.stats.refused += 1
                return None
        index = SuffixIndex(min_match=self.settings.min_match, max_match=self.settings.max_match,
                            eos_token_ids=self.eos)
        sources = None
        if self.corpora:
            sources = SourcesProposer(index, self.corpora, min_match=self.settings.min_match,
                                      max_match=self.settings.max_match, eos_token_ids=self.eos)
        drafter = sources if sources is not None else index
        drafter.extend(tokens)
        state = RequestState(drafter, index, sources, DraftPolicy(self.k, self.cost), prompt_len)
        self._account(state)
        self.stats.built += 1
        return state

    def _account(self, state: RequestState) -> None:
        self._index_bytes -= state.nbytes
        state.nbytes = state.index.nbytes()
        self._index_bytes += state.nbytes
        # The buffers double when the text outgrows them; until then the bytes cannot change.
        state.grows_at = max(1024, 1 << max(len(state.index) - 1, 1).bit_length())

    def _retire_idle(self) -> None:
        idle = self._step - self.settings.idle_steps
        if any(s.last_seen <= idle for states in self._states.values() for s in states):
            self._drop(lambda s: s.last_seen <= idle, "retired")

    def _evict(self, budget: int) -> None:
        """Drop states not seen in this step, least recently seen first, until at most `budget` bytes remain."""
        old = sorted((s for states in self._states.values() for s in states if s.last_seen < self._step),
                     key=lambda s: s.last_seen)
        gone, held = set(), self._index_bytes
        for s in old:
            if held <= budget:
                break
            gone.add(id(s))
            held -= s.nbytes
        if gone:
            self._drop(lambda s: id(s) in gone, "evicted")

    def _drop(self, which, counter: str) -> None:
        for key in list(self._states):
            keep = []
            for s in self._states[key]:
                if which(s):
                    self._index_bytes -= s.nbytes
                    setattr(self.stats, counter, getattr(self.stats, counter) + 1)
                    self._remember(s)
                else:
                    keep.append(s)
            if keep:
                self._states[key] = keep
            else:
                del self._states[key]

    def _remember(self, state: RequestState) -> None:
        """A request left: its output goes to the memory, as `generate` stores outputs when it returns."""
        if self.memory is None or state.prompt_len is None:
            return
        tokens = state.index.tokens
        self.memory.remember(tokens[: state.prompt_len], tokens[state.prompt_len:])
        self.stats.stored += 1
        self._unsaved += 1
        if self.settings.memory_save and self._unsaved >= self.settings.save_every:
            self.save_memory()

    # -- sharing -------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Retire every request absent from the latest step (their outputs enter the memory), then save
        the memory if `memory_save` is set. For shutdown, and for benchmarks between turns."""
        self._drop(lambda s: s.last_seen < self._step, "retired")
        if self.settings.memory_save and self.memory is not None:
            self.save_memory()

    def save_memory(self, path=None) -> None:
        """Write the memory to `path` (default: the memory_save setting) for other replicas to load."""
        path = path if path is not None else self.settings.memory_save
        if self.memory is None or path is None:
            raise ValueError("no memory to save (set LOOKUP_DECODE_MEMORY_SAVE or LOOKUP_DECODE_MEMORY_TOKENS "
                             "with a memory file)" if self.memory is None else "save_memory needs a path")
        self.memory.save(path)
        self._unsaved = 0

    def reload_memory(self) -> int:
        """Add the entries of the memory files (settings.memory) that this memory lacks; returns how many.
        Files are whole (written by atomic replace), so a replica never reads one half-written."""
        if self.memory is None:
            return 0
        paths = [p for p in _paths(self.settings.memory) if Path(p).is_file()]
        return self.memory.merge(load_memory(paths, max_tokens=self.settings.memory_tokens, vocab_size=self.vocab_size))

    @property
    def live_requests(self) -> int:
        return sum(len(states) for states in self._states.values())

    @property
    def index_bytes(self) -> int:
        """Bytes held by the per-request indexes now (bounded by max_index_bytes)."""
        return self._index_bytes


def _numpy(array) -> np.ndarray:
    return array.numpy() if hasattr(array, "numpy") else np.asarray(array)


def _paths(value: str | None) -> list[str]:
    return [p for p in (value or "").split(os.pathsep) if p]


def _load_memory(settings: Settings, vocab_size: int | None) -> Memory | None:
    """The memory to draft from: the files in settings.memory merged (memory_save may not exist yet), or
    None when neither is set. Unreadable files raise here, when the engine builds the drafter."""
    if not settings.memory and not settings.memory_save:
        return None
    try:
        return load_memory(_paths(settings.memory), max_tokens=settings.memory_tokens, vocab_size=vocab_size,
                           missing_ok=[settings.memory_save] if settings.memory_save else [])
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{ENV_PREFIX}MEMORY: {e}") from None


def _load_references(settings: Settings, vocab_size: int | None, tokenizer, tokenizer_name) -> References | None:
    if not settings.references:
        return None
    if tokenizer is None and tokenizer_name is not None and Path(settings.references).suffix != ".npz":
        from transformers import AutoTokenizer  # text files are tokenized with the engine's tokenizer
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_name)
    try:
        return load_references(settings.references, tokenizer=tokenizer, vocab_size=vocab_size)
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"{ENV_PREFIX}REFERENCES: {e}") from None
