"""Soak test: generating threads share one Memory and one References while other threads save, load,
register, remove and evict; every output must equal plain generate's, nothing may deadlock, the memory
stays within its bound and the saved file is always loadable.

    python -m tests.stress.soak --seconds 600 --out benchmarks/results/soak/soak_600s.json

tests/test_soak.py runs a short version (a fixed number of operations per thread, no clock).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import threading
import time
import traceback

import numpy as np
import torch

import lookup_decode
from tests import tiny_models

VOCAB = 96
GREEDY = dict(do_sample=False, pad_token_id=0, eos_token_id=None)


def tiny_model():
    return tiny_models.build("llama")


def prompts(n: int, seed: int = 0) -> list[torch.Tensor]:
    """Prompts that repeat a span, so drafts from the prompt, the memory and the references all get accepted."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        span = rng.integers(3, VOCAB, int(rng.integers(6, 16)))
        out.append(torch.tensor(np.concatenate([np.tile(span, 3), rng.integers(3, VOCAB, 3)]))[None])
    return out


def soak(*, seconds: float | None = None, ops_per_thread: int | None = None, generators: int = 8,
         max_new_tokens: int = 24, memory_tokens: int = 400, workdir: str | None = None) -> dict:
    """Run the soak; returns counts (see the module docstring). Stops after `seconds` or when every thread
    did `ops_per_thread` operations. Failures are collected, never raised from a thread."""
    model = tiny_model()
    asks = prompts(12)
    expected = [model.generate(p, max_new_tokens=max_new_tokens, **GREEDY)[0].tolist() for p in asks]
    memory = lookup_decode.Memory(max_tokens=memory_tokens)
    refs = lookup_decode.References()
    for i, p in enumerate(asks[:4]):
        refs.register(f"doc{i}", tokens=torch.tensor(expected[i]))
    workdir = workdir or tempfile.mkdtemp(prefix="soak_")
    path = os.path.join(workdir, "memory.npz")
    memory.save(path)
    counts = {"generations": 0, "compared": 0, "accepted_tokens": 0, "saves": 0, "loads": 0, "registers": 0,
              "removes": 0, "evicted": 0, "max_memory_tokens": 0}
    failures: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()
    deadline = None if seconds is None else time.monotonic() + seconds

    def done(i: int) -> bool:
        return stop.is_set() or (ops_per_thread is not None and i >= ops_per_thread) or \
            (deadline is not None and time.monotonic() > deadline)

    def bump(**delta):
        with lock:
            for k, v in delta.items():
                counts[k] += v
            counts["max_memory_tokens"] = max(counts["max_memory_tokens"], memory.n_tokens)

    def guarded(body):
        def run():
            try:
                body()
            except Exception:          # noqa: BLE001  (a failure of the soak, reported, not raised in a thread)
                with lock:
                    failures.append(traceback.format_exc()[-2000:])
                stop.set()
        return run

    def generator(seed):
        rng = np.random.default_rng(seed)
        i = 0
        while not done(i):
            j = int(rng.integers(len(asks)))
            stats = lookup_decode.DecodeStats()
            out = model.generate(asks[j], max_new_tokens=max_new_tokens, custom_generate=lookup_decode.generate,
                                 memory=memory, references=refs, stats=stats, adaptive=bool(seed % 2), **GREEDY)
            if out[0].tolist() != expected[j]:
                raise AssertionError(f"output of prompt {j} differs from plain generate")
            if memory.n_tokens > memory.max_tokens:
                raise AssertionError(f"memory holds {memory.n_tokens} > {memory.max_tokens} tokens")
            bump(generations=1, compared=1, accepted_tokens=stats.accepted)
            i += 1

    def saver():
        i = 0
        while not done(i):
            memory.save(path)
            loaded = lookup_decode.Memory.load(path)
            if loaded.n_tokens > memory.max_tokens:
                raise AssertionError("a saved memory exceeds its bound")
            bump(saves=1, loads=1)
            i += 1

    def registrar(seed):
        rng = np.random.default_rng(seed)
        i = 0
        while not done(i):
            name = f"extra{int(rng.integers(4))}"
            doc = torch.tensor(expected[int(rng.integers(len(expected)))][-30:])
            refs.register(name, tokens=doc, replace=True)
            bump(registers=1)
            if rng.random() < 0.5 and name in refs:
                try:
                    refs.remove(name)
                    bump(removes=1)
                except KeyError:       # another registrar removed it first: fine
                    pass
            i += 1

    def evictor(seed):
        rng = np.random.default_rng(seed)
        i = 0
        while not done(i):
            before = memory.evicted
            memory.add(rng.integers(3, VOCAB, int(rng.integers(20, 120))))
            bump(evicted=memory.evicted - before)
            i += 1

    threads = [threading.Thread(target=guarded(lambda s=s: generator(s))) for s in range(generators)]
    threads += [threading.Thread(target=guarded(saver)),
                threading.Thread(target=guarded(lambda: registrar(100))),
                threading.Thread(target=guarded(lambda: registrar(101))),
                threading.Thread(target=guarded(lambda: evictor(200)))]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    limit = None if seconds is None else seconds + 120
    for t in threads:
        t.join(None if limit is None else max(1.0, limit - (time.monotonic() - t0)))
    hung = [t.name for t in threads if t.is_alive()]
    if hung:
        stop.set()
        failures.append(f"deadlock or hang: threads {hung} still running")
    final = lookup_decode.Memory.load(path)      # the file on disk is always loadable
    return dict(counts, failures=failures, seconds=round(time.monotonic() - t0, 1), threads=len(threads),
                generating_threads=generators, memory_bound=memory.max_tokens, final_file_entries=len(final),
                peak_rss_mib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--generators", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = soak(seconds=args.seconds, generators=args.generators)
    result["command"] = f"python -m tests.stress.soak --seconds {args.seconds:g} --generators {args.generators}"
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
