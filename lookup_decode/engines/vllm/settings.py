"""The vLLM drafter's settings: vLLM builds `LookupDrafter(vllm_config)` and passes it no options of its own.

They come from three places, the first that names a setting winning:
1. `additional_config={"lookup_decode": {...}}` of the engine (`LLM(..., additional_config=...)`, the server's
   `--additional-config`): per engine, and shipped with the config to every worker, Ray's included;
2. `LOOKUP_DECODE_<NAME>` environment variables (upper-case names);
3. the JSON object in the file named by `LOOKUP_DECODE_CONFIG` (lower-case names).
Every value is checked when the drafter is built: a bad one fails there, naming the setting, never while serving.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from lookup_decode.core.config import LookupConfig, check_k, check_match
from lookup_decode.sources.memory import References, load_references

ENV_PREFIX = "LOOKUP_DECODE_"
CONFIG_KEY = "lookup_decode"        # the key of additional_config the drafter reads
_UNSET_WHEN_EMPTY = ("memory", "memory_save", "references", "eos", "draft_cost", "k")   # None or "": not given
_WORDS = {"true": True, "on": True, "yes": True, "1": True, "false": False, "off": False, "no": False, "0": False}


@dataclass(frozen=True)
class Settings:
    """The drafter's options.

    k: most draft tokens per row and step (default and upper bound: vLLM's num_speculative_tokens).
    min_match, max_match: as in `LookupConfig` (same defaults as the transformers path).
    adaptive: send each row the draft tokens that pay for their place in the step (their probability of being
        kept against what a token costs the step, learned from the time between the drafter's calls);
        False: every token the index proposes, up to k (vLLM's n-gram proposer's rule).
    draft_cost: what one more token costs a step, relative to the step's fixed part, before any step was
        timed (adaptive only: the prior of the learned cost); None: the device's (`StepCost.for_device`).
    memory: the engine keeps a memory of its requests' outputs (on by default: every output enters it when its
        request finishes, and every later or concurrent request drafts from it). A string: memory file(s) to
        load at start (os.pathsep-separated; glob patterns allowed, e.g. every replica's `/shared/mem-*.npz`),
        made by `Memory.save` or by another replica's `memory_save`. False ("false", "off", "no", "0"): no
        memory at all.
    memory_save: where this engine writes its memory: as soon as the batch empties (every output stored), within
        `save_seconds` of an output entering it, every `save_every` stored outputs, and when the process exits.
        "{replica}" in it becomes the data-parallel rank; with several replicas and no "{replica}" the rank is
        added before the suffix. With memory_save but no memory file yet, the memory starts empty.
    memory_tokens: the memory's bound in tokens; past it the least recently useful outputs go. The default,
        250,000, keeps the index (its tokens and one separator per output) within room for 2**18 tokens: 42 MiB
        (~170 bytes per token); a rebuild after eviction then costs ~0.1 s off the step (`Memory.evict_aside`).
    save_seconds: memory_save is written at most this long after an output entered the memory (by a
        background thread, so a server that sits idle or is killed at shutdown has saved it); the thread
        also stores the outputs of requests still known when the engine has made no step for
        `keeper.IDLE_SECONDS`, and then writes the file.
    references: a `References.save` file, or a folder of them and of text files (tokenized with the
        engine's tokenizer).
    max_scopes: memory scopes (a request's `lookup_decode_scope`) kept at once; past it the least recently used
        scope that no live request uses is forgotten. Named scopes live in this process only (memory_save writes
        the default scope).
    scope_tokens: the bound in tokens of each named scope's memory (the default scope's is memory_tokens).
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
    adaptive: bool = True
    draft_cost: float | None = None
    memory: str | bool | None = None
    memory_save: str | None = None
    memory_tokens: int = 250_000
    save_seconds: float = 5.0
    references: str | None = None
    max_scopes: int = 64
    scope_tokens: int = 50_000
    max_index_bytes: int = 4 * 2**30
    idle_steps: int = 16
    save_every: int = 64
    reload_every: int = 0
    eos: tuple[int, ...] | None = None

    @classmethod
    def from_sources(cls, additional_config=None, environ=None) -> "Settings":
        """Settings from an engine's additional_config, LOOKUP_DECODE_* variables and LOOKUP_DECODE_CONFIG."""
        environ = os.environ if environ is None else environ
        names = [f.name for f in fields(cls)]
        values: dict = {}
        path = environ.get(ENV_PREFIX + "CONFIG")
        if path:
            where = f"{ENV_PREFIX}CONFIG={path}"
            if not Path(path).is_file():
                raise ValueError(f"{where}: no such settings file")
            try:
                values.update(_checked_keys(json.loads(Path(path).read_text(encoding="utf-8")), where, names))
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not a JSON settings file ({e})") from None
        values.update({n: environ[ENV_PREFIX + n.upper()] for n in names if ENV_PREFIX + n.upper() in environ})
        given = (additional_config or {}).get(CONFIG_KEY) if isinstance(additional_config, dict) else None
        if given is not None:
            values.update(_checked_keys(given, f"additional_config[{CONFIG_KEY!r}]", names))
        return cls(**{name: _parse(name, value) for name, value in values.items()})

    def __post_init__(self):
        if self.k is not None:
            check_k(self.k)
        check_match(self.min_match, self.max_match)
        for name in ("memory_tokens", "max_index_bytes", "idle_steps", "save_every", "max_scopes", "scope_tokens",
                     "reload_every"):
            if getattr(self, name) < (low := int(name != "reload_every")):
                raise ValueError(f"{ENV_PREFIX}{name.upper()} must be >= {low}, got {getattr(self, name)}")
        if self.draft_cost is not None and not self.draft_cost >= 0:
            raise ValueError(f"{ENV_PREFIX}DRAFT_COST must be >= 0, got {self.draft_cost}")
        if not self.save_seconds > 0:
            raise ValueError(f"{ENV_PREFIX}SAVE_SECONDS must be > 0, got {self.save_seconds}")
        if self.memory is False and self.memory_save:
            raise ValueError(f"{ENV_PREFIX}MEMORY is false (no memory) but {ENV_PREFIX}MEMORY_SAVE is set: "
                             "there would be nothing to save")
        if self.memory is True:
            raise ValueError(f"{ENV_PREFIX}MEMORY: True is the default (None); give file paths or False")

    @property
    def has_memory(self) -> bool:
        """Whether the drafter keeps a memory of outputs (everything but `memory: false`)."""
        return self.memory is not False


def _checked_keys(raw, where: str, names: list[str]) -> dict:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a JSON object of settings, got {type(raw).__name__}")
    unknown = set(raw) - set(names)
    if unknown:
        raise ValueError(f"{where}: unknown settings {sorted(unknown)}; known: {sorted(names)}")
    return dict(raw)


def _parse(name: str, value):
    """A setting from a string (environment) or a JSON value, to its field's type; ValueError naming it."""
    try:
        if name in _UNSET_WHEN_EMPTY and value in (None, ""):
            return None
        if name == "memory":
            # A switch or file paths: JSON true/false, or the words below (a file named "off" needs "./off").
            switch = _WORDS.get(value.strip().lower()) if isinstance(value, str) else value
            return (None if switch else False) if isinstance(switch, bool) else str(value)
        if name in ("memory_save", "references"):
            return str(value)
        if name == "eos":
            return tuple(int(v) for v in (value.split(",") if isinstance(value, str) else value))
        if name == "adaptive":
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "0", "false", "no"):
                return value.lower() in ("1", "true", "yes")
            if not isinstance(value, bool):
                raise ValueError(value)
            return value
        real = name in ("draft_cost", "save_seconds")
        if isinstance(value, bool) or not real and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return float(value) if real else int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{ENV_PREFIX}{name.upper()}: cannot read {value!r} as a {name} setting") from None


def load_references_setting(path: str | None, *, tokenizer=None, vocab_size: int | None = None) -> References | None:
    """The references a `references` setting names (text files tokenized with the engine's tokenizer); None without
    one. A bad one raises when the drafter is built, naming the setting."""
    if not path:
        return None
    try:
        return load_references(path, tokenizer=tokenizer, vocab_size=vocab_size)
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"{ENV_PREFIX}REFERENCES: {e}") from None


def replica_path(path: str | None, rank: int, replicas: int) -> str | None:
    """memory_save for data-parallel replica `rank` of `replicas`: "{replica}" becomes the rank; with several
    replicas and no placeholder the rank goes before the suffix (mem.npz -> mem-replica1.npz), so replicas that
    share the settings never write one file. Example: replica_path("m-{replica}.npz", 2, 4) -> "m-2.npz"."""
    if path is None:
        return None
    if "{replica}" in path:
        return path.replace("{replica}", str(rank))
    if replicas <= 1:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}-replica{rank}{p.suffix}"))


def show_logs() -> None:
    """vLLM configures its own loggers only: give lookup_decode's a stderr handler unless the process has one, so
    its INFO lines (start-up, failures, the summary at shutdown) reach the server's log."""
    ours = logging.getLogger("lookup_decode")
    if not ours.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(logging.INFO)
