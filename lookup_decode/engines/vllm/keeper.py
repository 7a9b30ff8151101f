"""The drafter's memory of outputs across requests: its scopes, its saves to `memory_save`, the reload of other
replicas' files, and its shutdown.

`Keeper.remember` puts a finished request's output into its scope's memory (the default scope unless the request
named one). With `memory_save`, a daemon thread (`_loop`) writes the default scope's memory from a snapshot,
outside the lock, so the engine's step never waits for a disk: at once when the batch has emptied (the drafter
calls `write_soon`: every request it saw has its output stored), else within `save_seconds` of an output entering
it or after `save_every` outputs. vLLM's server force-kills its worker at shutdown, so the write when the batch
empties is the one that counts; an exit hook (atexit, and multiprocessing's finalizers, which a worker process
runs instead of atexit) stores the live requests and writes once more where the process does get to exit. The
thread also evicts from a nearly full memory aside (`Memory.evict_aside`: the O(bound) index rebuild off the
step), and when the engine has made no call for IDLE_SECONDS it asks the drafter to store the outputs of the
requests still known (`on_idle`: the last request of a burst, finished at a stop string, leaves no later call to
notice it). Idle after drafting, at most once every SUMMARY_SECONDS, it logs the drafter's summary at INFO: the
summary an exit would log never shows in a server whose worker is force-killed. Failures are logged, never raised.
"""

from __future__ import annotations

import atexit
import glob
import logging
import multiprocessing.util
import os
import threading
import time
import weakref
from collections import OrderedDict

from lookup_decode.engines.vllm.settings import ENV_PREFIX, Settings
from lookup_decode.engines.vllm.stats import DrafterStats
from lookup_decode.sources.memory import Memory, load_memory

log = logging.getLogger("lookup_decode.vllm")
IDLE_SECONDS = 1.0      # no propose call for this long: the engine is idle, its known requests' outputs are stored
SUMMARY_SECONDS = 60.0  # at most this often, once idle after drafting: the drafter's summary at INFO


def memory_files(value: str | None) -> list[str]:
    """The memory files of a setting: os.pathsep-separated paths, glob patterns expanded (sorted)."""
    patterns = [p for p in (value or "").split(os.pathsep) if p]
    return [f for p in patterns for f in (sorted(glob.glob(p)) if glob.has_magic(p) else [p])]


class Keeper:
    """The memory (`memory`; None: off), its named scopes (`scopes`) and its saves. `lock` is shared with the
    drafter's calls; `on_idle` (a method of the drafter, held weakly) stores the known requests' outputs."""

    def __init__(self, settings: Settings, stats: DrafterStats, *, vocab_size: int | None, memory_save: str | None,
                 saves: bool, memory: Memory | None = None, on_idle=None, on_exit=None):
        self.settings, self.stats, self.vocab_size = settings, stats, vocab_size
        self.memory_save, self.saves = memory_save, saves
        self.memory = memory if memory is not None else self._load()
        self.scopes: OrderedDict[str, Memory] = OrderedDict()
        self.lock = threading.RLock()
        self.unsaved = 0
        self.saved_at = self.called_at = time.monotonic()   # the last write (or the start); the last call
        self.idle_stored = True                 # on_idle ran since the last call
        self.due = False                        # write at the thread's next turn (the batch emptied)
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None
        self.summarized, self.summarized_at = 0, self.saved_at  # steps in the last summary logged, and when
        self._on_idle = weakref.WeakMethod(on_idle) if on_idle is not None else None
        if on_exit is not None:
            ref = weakref.WeakMethod(on_exit)
            atexit.register(_at_exit, ref)
            multiprocessing.util.Finalize(None, _at_exit, args=(ref,), exitpriority=10)

    @property
    def persists(self) -> bool:
        return self.memory is not None and bool(self.memory_save) and self.saves

    def _load(self) -> Memory | None:
        """The files in settings.memory merged (memory_save may not exist yet; none: an empty memory), or None
        when the memory is off. Unreadable files raise here, when the engine builds the drafter."""
        s = self.settings
        if not s.has_memory:
            return None
        try:
            return load_memory(memory_files(s.memory), max_tokens=s.memory_tokens, vocab_size=self.vocab_size,
                               missing_ok=[self.memory_save] if self.memory_save else [])
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{ENV_PREFIX}MEMORY: {e}") from None

    def scope(self, name: str, in_use) -> Memory | None:
        """The memory of a named scope (made on first use); None when the drafter keeps no memory, or when
        max_scopes scopes are all in use (`in_use`: ids of the memories live requests use)."""
        if self.memory is None:
            return None
        memory = self.scopes.get(name)
        if memory is None:
            if len(self.scopes) >= self.settings.max_scopes:
                idle = [n for n, m in self.scopes.items() if id(m) not in in_use]
                if not idle:
                    log.warning("lookup_decode: %d memory scopes are in use (max_scopes); scope %r drafts from "
                                "no memory", len(self.scopes), name)
                    return None
                del self.scopes[idle[0]]            # the least recently used one
            memory = self.scopes[name] = Memory(self.settings.scope_tokens, vocab_size=self.vocab_size)
        self.scopes.move_to_end(name)
        return memory

    def remember(self, memory: Memory, prompt, output, replaces: str | None) -> str | None:
        """Store one output into `memory` (replacing the entry `replaces`); returns its key."""
        key = memory.remember(prompt, output, replaces=replaces)
        self.stats.stored += 1
        if memory is self.memory:                   # named scopes live in this process only (not saved)
            self.unsaved += 1
            if self.persists and self.unsaved >= self.settings.save_every:
                self.wake.set()
        return key

    def write_soon(self) -> None:
        """Every request seen has its output stored: write at the thread's next turn (within milliseconds)."""
        if self.unsaved and self.persists:
            self.due = True
            self.wake.set()

    def called(self) -> None:
        """The drafter was called (under the lock): the engine is not idle; the thread runs from the first call."""
        self.called_at, self.idle_stored = time.monotonic(), False
        if self.thread is None and self.memory is not None:
            self.thread = threading.Thread(target=_loop, args=(weakref.ref(self),), name="lookup_decode-memory",
                                           daemon=True)
            self.thread.start()

    def tick(self, now: float) -> None:
        """The thread's turn: evict aside, store the known requests once the engine is idle, write when due."""
        with self.lock:
            scoped = list(self.scopes.values())
        for memory in [self.memory, *scoped]:
            memory.evict_aside()                    # takes the memory's lock only to choose and to swap
        with self.lock:
            if self.stats.steps > self.summarized and now - self.called_at >= IDLE_SECONDS \
                    and now - self.summarized_at >= SUMMARY_SECONDS:
                self.log_summary(now)
        if not self.persists:
            return
        with self.lock:
            if not self.idle_stored and now - self.called_at >= IDLE_SECONDS:
                on_idle = self._on_idle() if self._on_idle is not None else None
                if on_idle is not None:
                    on_idle()
                self.idle_stored = self.due = True      # idle: nothing is coming that a later write would hold
            due = self.due or self.unsaved >= self.settings.save_every \
                or now - self.saved_at >= self.settings.save_seconds
            if not (self.unsaved and due):
                return
            self.due, pending, snapshot = False, self.unsaved, self.memory.snapshot()
        self.write(snapshot, self.memory_save, pending)

    def log_summary(self, now: float) -> None:
        """The drafter's summary, one line at INFO (calibration: `drafter.stats.summary()`)."""
        self.summarized, self.summarized_at = self.stats.steps, now
        log.info("lookup_decode: drafter summary: %s", self.stats.summary(calibration=False))

    def save(self) -> None:
        """Write the memory to memory_save now (`persists` only)."""
        with self.lock:
            self.write(self.memory, self.memory_save, self.unsaved)

    def write(self, memory: Memory, path, pending: int) -> None:
        """Save `memory` (the memory, or a snapshot of it) to path; `pending` stored outputs are then saved."""
        memory.save(path)
        with self.lock:
            self.unsaved -= min(pending, self.unsaved)
            self.saved_at = time.monotonic()
            self.stats.saves += 1
        log.debug("lookup_decode: memory saved to %s (%d outputs, %d tokens)", path, len(memory), memory.n_tokens)

    def reload(self) -> int:
        """Add the entries of the memory files (settings.memory) that this memory lacks; returns how many.
        Files are whole (written by atomic replace), so a replica never reads one half-written."""
        if self.memory is None:
            return 0
        paths = [p for p in memory_files(self.settings.memory) if os.path.isfile(p)]
        return self.memory.merge(load_memory(paths, max_tokens=self.settings.memory_tokens, vocab_size=self.vocab_size))


def _loop(ref) -> None:
    """The thread's loop (a daemon: it never delays an exit). It holds the keeper only weakly; a failure is logged
    (once) and never raised."""
    failed = False
    while True:
        keeper = ref()
        if keeper is None:
            return
        pause, wake = min(keeper.settings.save_seconds, IDLE_SECONDS) / 4, keeper.wake
        del keeper
        wake.wait(pause)
        wake.clear()
        keeper = ref()
        if keeper is None:
            return
        try:
            keeper.tick(time.monotonic())
        except Exception:                           # noqa: BLE001
            if not failed:
                log.exception("lookup_decode: storing or saving the memory failed (retried; logged once)")
                failed = True
        del keeper


def _at_exit(ref) -> None:
    """At exit (vLLM calls nothing on a drafter at shutdown): the drafter's shutdown. Never raises."""
    shutdown = ref()
    if shutdown is None:
        return
    try:
        shutdown()
    except Exception:                               # noqa: BLE001
        log.exception("lookup_decode: saving the memory at exit failed")
