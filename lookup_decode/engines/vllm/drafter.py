"""lookup_decode as a vLLM drafter: `speculative_config={"method": "custom_class", "model":
"lookup_decode.vllm.LookupDrafter", "num_speculative_tokens": K}`.

vLLM's model runner builds the class with the engine's `vllm_config`, calls `load_model(model)`, and after
every step `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)`: the persistent
batch as a token matrix (row i holds its request's prompt and committed tokens, `token_ids_cpu[i,
:num_tokens_no_spec[i]]`, this step's sampled tokens already written in) and per row the tokens this step
emitted (`[]`: a partial prefill). It wants one draft per row, ragged (`[]` for none), at most K tokens, and it
runs the call inside every step, serially: its time is every step's time.

This module is the adapter: everything that reads vLLM's objects (the config, the model runner's request ids and
each request's `SamplingParams`, the CUDA graph sizes) is here, turned into plain arrays and `RequestInfo` for
`batch_drafter.BatchDrafter`, which does the drafting. The runner is the caller of `load_model` (vLLM passes the
drafter no request ids); where it is not found, rows are followed by content. Nothing here imports vLLM at module
level.
"""

from __future__ import annotations

import logging
import sys
import weakref

import numpy as np

from lookup_decode.core.tokens import eos_ids
from lookup_decode.engines.vllm import cpu_fix
from lookup_decode.engines.vllm.batch_drafter import BatchDrafter, EngineRequests, RequestInfo
from lookup_decode.engines.vllm.settings import ENV_PREFIX, Settings, replica_path, show_logs  # noqa: F401
from lookup_decode.engines.vllm.table_kernels import fingerprints  # noqa: F401  (documented)

log = logging.getLogger("lookup_decode.vllm")
KNOWN_VLLM = ("0.32.", "0.33.")     # versions whose runner's request ids and states were read


def _numpy(array) -> np.ndarray:
    if isinstance(array, np.ndarray):
        return array
    return array.numpy() if hasattr(array, "numpy") else np.asarray(array)


def _vocab_size(model_config) -> int | None:
    """The engine model's vocabulary size, when the config tells it (a test's SimpleNamespace may not)."""
    if callable(getattr(model_config, "get_vocab_size", None)):
        return int(model_config.get_vocab_size())
    for attr in ("hf_text_config", "hf_config"):
        size = getattr(getattr(model_config, attr, None), "vocab_size", None)
        if size is not None:
            return int(size)
    return None


def _ranks(vllm_config) -> tuple[int, int, int]:
    """(tensor-parallel rank, data-parallel rank, data-parallel size) of this drafter's worker."""
    parallel = getattr(vllm_config, "parallel_config", None)
    dp_rank = int(getattr(parallel, "data_parallel_rank", 0) or 0)
    dp_size = int(getattr(parallel, "data_parallel_size", 1) or 1)
    try:
        from vllm.distributed import get_tensor_model_parallel_rank
        tp_rank = int(get_tensor_model_parallel_rank())
    except Exception:                                   # noqa: BLE001  (no process group: one rank)
        tp_rank = 0
    return tp_rank, dp_rank, dp_size


def _vllm_version() -> str:
    module = sys.modules.get("vllm")
    return str(getattr(module, "__version__", "")) if module is not None else ""


def _tokenizer(name: str | None):
    """The engine's tokenizer, loaded when the drafter is built (a request's text prediction is tokenized inside
    an engine step, not the place to load it). One that cannot be loaded leaves texts unread (each request that
    sends one says so; text references fail the start), never the engine."""
    if name is None:
        return None
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(name)
    except Exception as e:                          # noqa: BLE001
        log.warning("lookup_decode: the engine's tokenizer could not be loaded (%s): requests' text predictions "
                    "are ignored (token ids still work)", e)
        return None


def _info(state) -> RequestInfo:
    """What vLLM's request state (`CachedRequestState`) tells of a request."""
    params = getattr(state, "sampling_params", None)
    max_tokens = getattr(params, "max_tokens", None)
    return RequestInfo(prompt_len=int(getattr(state, "num_prompt_tokens", -1)),
                       temperature=float(getattr(params, "temperature", 0.0) or 0.0),
                       max_tokens=max_tokens if isinstance(max_tokens, int) else None,
                       extra_args=getattr(params, "extra_args", None))


class LookupDrafter(BatchDrafter):
    """vLLM `custom_class` drafter: lookup_decode's drafts for every row of vLLM's persistent batch.

    Constructed by vLLM as `LookupDrafter(vllm_config)`. Tests and benchmarks may build one with
    `LookupDrafter.from_settings(settings, k, ...)` (the `BatchDrafter` arguments).
    """

    def __init__(self, vllm_config):
        spec = getattr(vllm_config, "speculative_config", None)
        if spec is None or getattr(spec, "num_speculative_tokens", None) is None:
            raise ValueError("LookupDrafter needs vllm_config.speculative_config.num_speculative_tokens")
        model_config = getattr(vllm_config, "model_config", None)
        settings = Settings.from_sources(getattr(vllm_config, "additional_config", None))
        eos = settings.eos if settings.eos is not None else eos_ids(getattr(model_config, "hf_config", None))
        tp_rank, dp_rank, dp_size = _ranks(vllm_config)
        device = getattr(getattr(vllm_config, "device_config", None), "device_type", None) or "cpu"
        super().__init__(settings, spec.num_speculative_tokens, max_model_len=getattr(model_config, "max_model_len",
                         None), vocab_size=_vocab_size(model_config), eos_token_ids=eos,
                         tokenizer=_tokenizer(getattr(model_config, "tokenizer", None)), saves=tp_rank == 0,
                         replica=(dp_rank, dp_size), device=device)
        # vLLM settles its CUDA graph sizes when it captures them, after building the drafter: read at the first step.
        self._graphs = getattr(vllm_config, "compilation_config", None) if device != "cpu" else None
        self.budget = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens", None)
        # vLLM's CPU build samples draft positions from a wrong distribution (cpu_fix's docstring); with drafts
        # sent, that would make sampled requests worse than without them.
        cpu_fix.apply()
        show_logs()
        log.info("lookup_decode: drafter ready (k %d, memory %s%s, references %s)", self.k,
                 "off" if self.memory is None else f"{len(self.memory)} outputs",
                 f", saved to {self.keeper.memory_save}" if self.keeper.persists else "", settings.references or "none")

    @classmethod
    def from_settings(cls, settings: Settings, num_speculative_tokens: int, **kwargs) -> "LookupDrafter":
        """A drafter without a vLLM config (tests, benchmarks): `BatchDrafter`'s arguments."""
        self = cls.__new__(cls)
        BatchDrafter.__init__(self, settings, num_speculative_tokens, **kwargs)
        return self

    _runner = None                                  # vLLM's model runner, weakly (found by load_model)
    _graphs = None                                  # the engine's compilation_config until its graph sizes are read
    _matrix = None                                  # the token matrix last found int32 and contiguous
    _engine = None                                  # the runner's rows as EngineRequests (its same list and dict)
    _counts = None                                  # vLLM's counts array, as last seen
    _batches: dict | None = None                    # batch size -> (the view of its counts, emitted counts)

    def load_model(self, *args, **kwargs) -> None:
        """vLLM calls this with the target model after building the drafter; there is no model to load. Its caller
        is the model runner (GPUModelRunner.load_model, and CPUModelRunner's), whose request ids and request
        states the drafter reads from then on."""
        runner = sys._getframe(1).f_locals.get("self")
        found = hasattr(runner, "input_batch") and isinstance(getattr(runner, "requests", None), dict)
        self._runner = weakref.ref(runner) if found else None
        self.stats.identity = "runner" if found else "content"
        version = _vllm_version()
        if not found or not version.startswith(KNOWN_VLLM):
            log.info("lookup_decode: vLLM %s: rows are followed %s", version or "(unknown version)",
                     "by vLLM's request ids (per-request settings read)" if found else
                     "by content (the runner's request ids were not found: no per-request settings, and memory "
                     "scopes are not told apart; set the memory off where tenants must not share it)")

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None) -> list[list[int]]:
        """One draft per row of the batch (list of int, [] for none).

        sampled_token_ids: list[list[int]], the tokens each row emitted this step ([]: a partial prefill,
            no draft). num_tokens_no_spec: int [>= rows], committed tokens per row (numpy or torch).
        token_ids_cpu: int [>= rows, max_model_len] (numpy or torch), row i's tokens in its first
            num_tokens_no_spec[i] columns. slot_mappings: unused (no model).
        """
        B = len(sampled_token_ids)
        matrix = token_ids_cpu              # vLLM's persistent batch: the same int32 array at every step
        if matrix is not self._matrix:
            matrix = _numpy(token_ids_cpu)
            if matrix.dtype != np.int32 or not matrix.flags.c_contiguous:
                matrix = np.ascontiguousarray(matrix, np.int32)
            elif matrix is token_ids_cpu:
                self._matrix = matrix
        # After a model's forward a numpy call costs ~10 us: vLLM's int32 counts are taken as they are (the steady
        # call is compiled for them), and each batch size's counts view and emitted array are the same objects from
        # call to call (the steady call's direct entry needs that).
        batch = self._batches.get(B) if self._counts is num_tokens_no_spec else None
        if batch is None:
            whole = _numpy(num_tokens_no_spec)
            if whole.dtype != np.int32:
                whole = whole.astype(np.int64, copy=False)
            batch = whole[:B], np.zeros(B, np.int64)
            if whole is num_tokens_no_spec:     # vLLM's persistent array: the view of its first rows stays valid
                if self._counts is not whole:
                    self._counts, self._batches = whole, {}
                self._batches[B] = batch
        counts, emitted = batch
        if B == 1:
            emitted[0] = len(sampled_token_ids[0])
        else:
            emitted[:] = list(map(len, sampled_token_ids))
        runner = self._runner() if self._runner is not None else None
        engine = None
        if runner is not None:
            engine, ids, states = self._engine, runner.input_batch.req_ids, runner.requests
            if engine is None or engine.ids is not ids or engine.held is not states:
                engine = self._engine = EngineRequests(ids, states, lambda rid: _info(states.get(rid)))
        if self._graphs is not None:
            cc, self._graphs = self._graphs, None   # a step runs padded to the next graph size: to the step cost
            mode = getattr(cc, "cudagraph_mode", None)
            if mode is not None and getattr(mode, "name", str(mode)) != "NONE":
                self.cost.use_capture_sizes(getattr(cc, "cudagraph_capture_sizes", None))
        out = self.draft(matrix, counts, emitted, engine)
        if B == 1:                                  # (one row: no lists of the three arrays)
            return [out.tokens[0, :out.lengths[0]].tolist() if len(out.rows) else []]
        drafts: list[list[int]] = [[] for _ in range(B)]
        for i, n, tokens in zip(out.rows.tolist(), out.lengths.tolist(), out.tokens.tolist()):
            if n:                                   # vLLM wants list[list[int]]
                drafts[i] = tokens[:n]
        return drafts

