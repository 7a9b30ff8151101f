"""The vLLM drafter's counters: `DrafterStats` (sums since the drafter was built, with the acceptance model's
reliability table) and `RequestStats` (one request's, by vLLM's request id)."""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from lookup_decode.core.stats import Calibration
from lookup_decode.sources.proposer import MEMORY, PREDICTION, REFERENCES, REQUEST

SOURCES = (REQUEST, MEMORY, REFERENCES, PREDICTION)   # a draft's source: 0 the request, 1 + the pool's corpus role
REQUESTS_KEPT = 4096    # per-request counters kept for this many requests (the most recent)


@dataclass
class RequestStats:
    """One request's counters, by vLLM's request id (`DrafterStats.request`)."""
    drafted: int = 0                   # draft tokens sent
    accepted: int = 0                  # of those, kept by the engine (vLLM's num_accepted_draft_tokens)
    sources: Counter = field(default_factory=Counter)   # accepted draft tokens per source


@dataclass
class DrafterStats:
    """Counters of one drafter (sums since construction)."""
    steps: int = 0                     # propose() calls
    rows: int = 0                      # rows that asked for a draft (non-empty sampled tokens)
    drafted: int = 0                   # draft tokens returned
    accepted: int = 0                  # of the full proposals, tokens the engine then emitted (kept)
    built: int = 0                     # requests indexed from their whole row (new, or dropped before)
    extended: int = 0                  # rows recognised and extended by their new tokens only
    continued: int = 0                 # rows whose request had missed steps (vLLM skipped the drafter)
    resumed: int = 0                   # rebuilt requests whose prompt length came back (preempted and recomputed)
    rebuilt: int = 0                   # requests indexed afresh though known before (by id: retired, then back)
    identity: str = "content"          # how rows are followed: "runner" (vLLM's request ids) or "content"
    ignored: int = 0                   # requests whose lookup_decode settings were bad (logged; those ignored)
    retired: int = 0                   # requests dropped after idle_steps absent
    evicted: int = 0                   # requests dropped for the byte bound
    refused: int = 0                   # rows left without an index for the byte bound
    stored: int = 0                    # outputs stored into the memory (a request stored twice counts twice)
    saves: int = 0                     # writes of memory_save
    errors: int = 0                    # calls that failed (logged once; those steps drafted nothing)
    propose_s: float = 0.0             # time inside propose
    propose_max_s: float = 0.0         # the slowest propose call after the first
    first_propose_s: float = 0.0       # the first call (it loads or compiles the kernels: seconds)
    sources: Counter = field(default_factory=Counter)   # accepted draft tokens per source
    reliability: Calibration = field(default_factory=Calibration)   # predicted vs kept of the tokens sent
    requests: OrderedDict = field(default_factory=OrderedDict)      # request id -> RequestStats (by id only)

    def timed(self, seconds: float) -> None:
        """One propose call took `seconds` (the first is apart: it loads or compiles the kernels)."""
        self.propose_s += seconds
        if self.steps <= 1:
            self.first_propose_s = seconds
        elif seconds > self.propose_max_s:
            self.propose_max_s = seconds

    def request(self, request_id: str) -> RequestStats | None:
        """The counters of one request (None: not followed by id, or among the oldest forgotten). vLLM's engine
        adds a suffix to the id a client gave ("7" runs as "7-1a2b3c4d"): either finds it (the latest such)."""
        if request_id in self.requests:
            return self.requests[request_id]
        return next((self.requests[key] for key in reversed(self.requests) if key.rpartition("-")[0] == request_id),
                    None)

    def of_request(self, request_id: str) -> RequestStats:
        """The counters of request_id, made if new (only the REQUESTS_KEPT most recent are kept)."""
        out = self.requests.get(request_id)
        if out is None:
            out = self.requests[request_id] = RequestStats()
            if len(self.requests) > REQUESTS_KEPT:
                self.requests.popitem(last=False)
        return out

    def calibration(self) -> list:
        """The acceptance model's reliability table: rows (bin_low, bin_high, tokens, predicted, kept, chance)."""
        return self.reliability.rows()

    def summary(self, calibration: bool = True) -> str:
        """One line of counts (accepted per source, ms per call: mean and worst), then (calibration) the
        calibration line."""
        share = f" ({100 * self.accepted / self.drafted:.0f}%)" if self.drafted else ""
        by_source = ", ".join(f"{name} {self.sources.get(name, 0)}" for name in SOURCES)
        mean_ms = 1e3 * self.propose_s / max(self.steps, 1)
        line = (f"{self.steps} steps, {self.rows} row-steps, drafted {self.drafted}, accepted {self.accepted}{share} "
                f"(by source: {by_source}); stored {self.stored} outputs, {self.saves} saves, {self.errors} errors; "
                f"propose {mean_ms:.2f} ms per step, worst {1e3 * self.propose_max_s:.1f} ms (the first call: "
                f"{1e3 * self.first_propose_s:.0f} ms)")
        return f"{line}\n{self.reliability.summary()}" if calibration else line
