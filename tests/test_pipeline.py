"""`lookup-decode run` (lookup_decode/engines/batch/): records identical to plain generate, exactly once through
malformed input, a killed command, a torn last line and a killed Ray actor.

The model is a tiny random Llama with the default model's tokenizer (both saved to a folder, so the job
loads it like any local model; nothing is downloaded). Its greedy outputs fall into loops, which the
suffix index drafts, so every exactness test also sees accepted drafts.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import tiny_models

from lookup_decode.core.config import LookupConfig
from lookup_decode.engines.batch.job import Job, run
from lookup_decode.engines.batch.output import Output
from lookup_decode.engines.batch.records import read_input

ROOT = Path(__file__).resolve().parent.parent
CONTEXT = 256

PROMPTS = [
    "the cat sat on the mat. the cat sat on the mat. the cat",
    "one two three four one two three four one two",
    "def f(x):\n    return x + 1\n\ndef g(x):\n    return",
    "hello hello hello hello",
    "x",
    "a summary of: the quick brown fox jumps over the lazy dog. the quick brown fox",
    "numbers: 1 2 3 4 5 6 7 8 9 10 1 2 3",
    "red green blue red green blue red",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from lookup_decode.engines.hf.models import load_tokenizer
    folder = tmp_path_factory.mktemp("tiny_chat_llama")
    tok = load_tokenizer()
    model = tiny_models.build("llama", vocab_size=len(tok), max_position_embeddings=CONTEXT,
                              pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                              eos_token_id=tok.eos_token_id)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def reference(model_dir):
    """Plain greedy model.generate of each prompt alone: text and token count up to EOS."""
    from lookup_decode.engines.hf.models import load_model
    model, tok = load_model(model_dir)

    def ref(prompt, max_new_tokens):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        new = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids.shape[1]:].tolist()
        end = next((i + 1 for i, t in enumerate(new) if t == tok.eos_token_id), len(new))
        return tok.decode(new[:end], skip_special_tokens=True), end
    return ref


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")


def good_rows(n=len(PROMPTS)):
    return [{"id": f"r{i}", "prompt": PROMPTS[i % len(PROMPTS)], "max_new_tokens": 12 + 4 * (i % 3)}
            for i in range(n)]


def read_output(path) -> list[dict]:
    data = Path(path).read_bytes()
    assert data == b"" or data.endswith(b"\n"), "torn last line"
    return [json.loads(line) for line in data.splitlines()]


def assert_exact(records, rows, reference):
    """Every good row has one record, equal to plain generate; drafts were accepted somewhere."""
    by_id = {r["id"]: r for r in records if "error" not in r}
    ids = [r["id"] for r in records if "id" in r]
    assert len(ids) == len(set(ids)), "a record was written twice"
    assert set(by_id) == {r["id"] for r in rows}
    for row in rows:
        text, n = reference(row["prompt"], row["max_new_tokens"])
        assert (by_id[row["id"]]["text"], by_id[row["id"]]["new_tokens"]) == (text, n), row["id"]
    steps = sum(r["steps"] for r in by_id.values())
    emitted = sum(r["new_tokens"] - 1 for r in by_id.values())
    assert emitted > steps, "no draft token was accepted"      # guard: the lookup path really ran


def job(model_dir, **kw):
    return Job(**{"model": str(model_dir), "max_new_tokens": 16, "batch_size": 3, "threads": 1,
                  "lookup": LookupConfig(adaptive=False), **kw})


def test_read_input_names_line_and_cause(tmp_path):
    path = tmp_path / "in.jsonl"
    write_jsonl(path, [{"id": 1, "prompt": "ok"}, "{not json", {"prompt": "no id"}, {"id": "x"},
                       {"id": "y", "prompt": ""}, {"id": "z", "messages": [{"role": "user"}]},
                       {"id": 1, "prompt": "again"}, {"id": "w", "prompt": "p", "max_new_tokens": 0},
                       ["a", "list"], {"id": True, "prompt": "p"}])
    items = read_input(path)
    assert items[0] == {"id": 1, "line": 1, "messages": [{"role": "user", "content": "ok"}], "max_new_tokens": None,
                        "prediction": None}
    errors = {i["line"]: i["error"] for i in items if "error" in i}
    assert sorted(errors) == list(range(2, 11))
    assert "not valid JSON" in errors[2] and "'id'" in errors[3] and "'prompt' (a string)" in errors[4]
    assert "'prompt' must be a non-empty string" in errors[5] and "'messages'" in errors[6]
    assert "duplicate id 1 (first at line 1)" in errors[7] and "max_new_tokens" in errors[8]
    assert "JSON object" in errors[9] and "string or an integer" in errors[10]


def test_local_job_exact_with_errors_then_resume(tmp_path, model_dir, reference):
    rows = good_rows()
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(path, rows[:3] + ["{broken", {"id": "long", "prompt": "word " * CONTEXT}] + rows[3:])
    summary = run(job(model_dir), path, out, progress=False)
    records = read_output(out)
    assert_exact(records, rows, reference)
    errors = {r["line"]: r for r in records if "error" in r}
    assert "not valid JSON" in errors[4]["error"]
    assert errors[5]["id"] == "long" and "context is 256" in errors[5]["error"]
    assert (summary.done, summary.errors, summary.skipped) == (len(rows), 2, 0)
    again = run(job(model_dir), path, out, progress=False)
    assert (again.done, again.errors, again.skipped) == (0, 0, len(rows) + 2)
    assert read_output(out) == records


def test_records_with_a_prediction_draft_from_it(tmp_path, model_dir, reference):
    """A record's `prediction` (here what plain generate answers) is drafted from for that record alone: the same
    text in fewer steps; a prediction that is not a string is that record's error."""
    rows = [{**row, "max_new_tokens": 24} for row in good_rows(4)]
    predicted = [{**row, "id": row["id"] + "-p", "prediction": reference(row["prompt"], 24)[0]} for row in rows]
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(path, rows + predicted + [{"id": "bad", "prompt": "p", "prediction": 7}])
    run(job(model_dir, memory=False), path, out, progress=False)
    records = {r["id"]: r for r in read_output(out)}
    assert "'prediction' must be a non-empty string" in records["bad"]["error"]
    for row, p in zip(rows, predicted):
        assert records[p["id"]]["text"] == records[row["id"]]["text"] == reference(row["prompt"], 24)[0]
    assert sum(records[p["id"]]["steps"] for p in predicted) * 2 < sum(records[r["id"]]["steps"] for r in rows)


def test_parquet_input_and_references(tmp_path, model_dir, reference):
    pytest.importorskip("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = good_rows(4)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    refs = tmp_path / "refs"
    refs.mkdir()
    (refs / "doc.txt").write_text("the cat sat on the mat. " * 20)
    run(job(model_dir, references=str(refs)), tmp_path / "in.parquet", tmp_path / "out.jsonl", progress=False)
    assert_exact(read_output(tmp_path / "out.jsonl"), rows, reference)


def test_torn_last_line_is_cut_and_redone(tmp_path, model_dir, reference):
    rows = good_rows(4)
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(path, rows)
    run(job(model_dir), path, out, progress=False)
    lines = out.read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(lines[:2]) + lines[2][:20])        # a crash in the middle of the third line
    opened = Output(out)
    assert opened.repaired == 20 and len(opened.done) == 2
    opened.close()
    summary = run(job(model_dir), path, out, progress=False)
    assert summary.skipped == 2 and summary.done == 2
    assert_exact(read_output(out), rows, reference)


def test_second_writer_is_refused(tmp_path):
    first = Output(tmp_path / "out.jsonl")
    with pytest.raises(RuntimeError, match="another run"):
        Output(tmp_path / "out.jsonl")
    first.close()


def cli(*args):
    return [sys.executable, "-m", "lookup_decode.cli", "run", *map(str, args)]


def test_command_killed_and_rerun(tmp_path, model_dir, reference):
    rows = good_rows(12)
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(path, rows)
    cmd = cli("--input", path, "--output", out, "--model", model_dir, "--threads", 1, "--batch-size", 1,
              "--no-adaptive", "--no-progress")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    while proc.poll() is None and (not out.exists() or out.read_bytes().count(b"\n") < 2):
        time.sleep(0.05)
    killed_mid_job = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert killed_mid_job, proc.stderr.read().decode()[-2000:]
    partial = len(read_output(out))
    assert 2 <= partial < len(rows)
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "already done" in done.stderr and f"{len(rows) - partial} generated" in done.stderr
    assert_exact(read_output(out), rows, reference)


def test_ray_actor_pool_exact_through_a_killed_actor(tmp_path, model_dir, reference):
    pytest.importorskip("ray")
    rows = good_rows(12)
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jsonl(path, rows[:5] + ["{broken"] + rows[5:])
    killed = {}

    def kill_first_worker():
        # Once a record is out, the actor that wrote it is busy with its next batch: kill it there.
        while "pid" not in killed and not killed.get("stop"):
            if out.exists():
                for line in out.read_bytes().splitlines():
                    record = json.loads(line)
                    if "worker" in record:
                        pid = int(record["worker"].rsplit(":", 1)[1])
                        killed["lines_before"] = out.read_bytes().count(b"\n")
                        os.kill(pid, signal.SIGKILL)
                        killed["pid"] = pid
                        break
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_first_worker)
    watcher.start()
    try:
        summary = run(job(model_dir, batch_size=1), path, out, use_ray=True, actors=2, progress=False,
                      ray_init={"num_cpus": 2})
    finally:
        killed["stop"] = True
        watcher.join()
    assert "pid" in killed and killed["lines_before"] < len(rows) + 1, "the actor was not killed mid-job"
    records = read_output(out)
    assert_exact(records, rows, reference)
    assert [r["line"] for r in records if "error" in r] == [6]
    assert summary.done == len(rows)
    workers = {r["worker"] for r in records if "worker" in r}
    assert len(workers) >= 2                                    # both actors (or an actor and its restart) ran
    assert f"{socket.gethostname()}:{killed['pid']}" in workers


def test_ray_actors_ask_for_the_gpus_their_engine_needs():
    """`--engine vllm --ray`: each actor asks Ray for tensor_parallel_size GPUs where the cluster has GPUs, none on
    a CPU cluster or for the transformers engine (it runs on the CPU); --gpus-per-actor is taken as given; an
    engine wider than the cluster is refused before Ray would wait for its GPUs forever."""
    from lookup_decode.engines.batch.job import actor_resources
    vllm = Job(engine="vllm")
    assert actor_resources(vllm, 0) == {"num_cpus": 1, "num_gpus": 0}
    assert actor_resources(vllm, 8) == {"num_cpus": 1, "num_gpus": 1}
    assert actor_resources(Job(engine="vllm", tensor_parallel_size=4), 8)["num_gpus"] == 4
    assert actor_resources(Job(), 8)["num_gpus"] == 0
    assert actor_resources(Job(engine="vllm", gpus_per_actor=0.5), 1)["num_gpus"] == 0.5
    assert actor_resources(Job(engine="vllm", gpus_per_actor=0), 8)["num_gpus"] == 0
    assert actor_resources(Job(engine="vllm", gpus_per_actor=1), 0)["num_gpus"] == 1    # autoscaling: as given
    with pytest.raises(RuntimeError, match="the Ray cluster has 2"):
        actor_resources(Job(engine="vllm", tensor_parallel_size=4), 2)


def test_gpus_per_actor_reaches_the_job(monkeypatch, tmp_path):
    from lookup_decode import LookupConfig
    from lookup_decode.cli import commands
    from lookup_decode.engines.batch import job as job_module
    from lookup_decode.engines.batch import vllm as batch_vllm
    seen = []
    monkeypatch.setattr(job_module, "run", lambda job, *a, **kw: seen.append((job, kw)) or job_module.Summary())
    monkeypatch.setattr(batch_vllm, "check_job", lambda job: None)
    args = ["run", "--input", "x", "--output", "y", "--engine", "vllm", "--model", str(tmp_path), "--ray",
            "--tensor-parallel-size", "2"]
    assert commands.main(args) == 0
    assert seen[-1][0].gpus_per_actor is None and seen[-1][0].tensor_parallel_size == 2 and seen[-1][1]["use_ray"]
    assert commands.main(args + ["--gpus-per-actor", "0.5"]) == 0
    assert seen[-1][0].gpus_per_actor == 0.5
    with pytest.raises(SystemExit, match="--gpus-per-actor must be >= 0"):
        commands.main(args + ["--gpus-per-actor", "-1"])
    with pytest.raises(SystemExit, match="--gpus-per-actor is an option of --engine vllm"):
        commands.main(["run", "--input", "x", "--output", "y", "--gpus-per-actor", "1"])
    # vLLM's drafter sends chains: a tree width given to it is refused, not silently ignored
    with pytest.raises(SystemExit, match="--tree-width is an option of --engine transformers"):
        commands.main(args + ["--tree-width", "2"])
    assert commands.main(args[:-2]) == 0 and seen[-1][0].lookup.tree_width == LookupConfig().tree_width
    seen.clear()
    assert commands.main(["run", "--input", "x", "--output", "y", "--tree-width", "2"]) == 0
    assert seen[-1][0].lookup.tree_width == 2


def test_the_job_remembers_across_records_unless_told_not_to():
    from lookup_decode.cli.commands import build_parser
    from lookup_decode.engines.batch.job import Job
    from lookup_decode.engines.batch.vllm import lookup_settings
    assert Job().memory and "memory" not in lookup_settings(Job())       # the drafter's memory is on by default
    assert lookup_settings(Job(memory=False))["memory"] is False
    args = build_parser().parse_args(["run", "--input", "in.jsonl", "--output", "out.jsonl", "--no-memory"])
    assert args.no_memory
