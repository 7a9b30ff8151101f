"""The real-engine benchmark's pure parts (benchmarks/vllm/engine.py): ABBA order, cell planning, the engine
arguments and environment of each method, and the summary, goals and table computed from a fake result.
No vLLM, no model, no wall-clock thresholds."""

import json

import pytest

from benchmarks.vllm import bench as bench_vllm
from benchmarks.vllm import engine as vllm_engine
from benchmarks.vllm.engine import (
    abba,
    child_env,
    engine_kwargs,
    goals,
    markdown,
    plan_cells,
    speculative_config,
    summarize,
)

# ------------------------------------------------------------------------------------------- order and plan

def test_abba_alternates_direction_and_runs_every_method_once_per_repeat():
    assert abba(["a", "b"], 4) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b"), (3, "b"), (3, "a")]
    methods = ["none", "ngram", "suffix", "lookup_decode"]
    order = abba(methods, 3)
    for r in range(3):
        assert [m for rr, m in order if rr == r] == (methods if r % 2 == 0 else methods[::-1])
    # over an even number of repeats every method sits at the same mean position
    pos = {m: [] for m in methods}
    for r in range(2):
        for i, (_, m) in enumerate(order[r * 4:(r + 1) * 4]):
            pos[m].append(i)
    assert len({sum(p) for p in pos.values()}) == 1


def test_plan_cells_rounds_up_to_whole_batches_and_never_reuses_a_request():
    available = {"w": list(range(100, 150)), "v": list(range(10))}
    cells = plan_cells({"w": available["w"]}, [1, 8, 32], 4)
    assert [(c["batch"], [len(g) for g in c["groups"]]) for c in cells] == [(1, [1, 1, 1, 1]), (8, [8]), (32, [32])]
    assert not any(c["once"] for c in cells)
    assert [c["once"] for c in plan_cells({"w": available["w"]}, [1, 8, 32], 4, once=[32])] == [False, False, True]
    used = [i for c in cells for g in c["groups"] for i in g]
    assert len(used) == len(set(used)) == 44 and used == list(range(100, 144))     # in order, disjoint
    assert [len(g) for g in plan_cells({"w": available["w"]}, [3], 7)[0]["groups"]] == [3, 3, 3]
    with pytest.raises(ValueError, match="v: .* need 44 requests that fit, 10 do"):
        plan_cells({"v": available["v"]}, [1, 8, 32], 4)


# ------------------------------------------------------------------------------------------- engine settings

SETTINGS = {"model": "/m", "dtype": "float32", "enforce_eager": True, "max_model_len": 4096, "k": 8,
            "kv_cache_memory_bytes": 2 << 30, "lookup_config": None, "engine_args": None}


def test_speculative_configs_share_k_and_name_the_methods():
    assert speculative_config("none", 8) is None
    assert speculative_config("ngram", 5) == {"method": "ngram", "num_speculative_tokens": 5}
    assert speculative_config("ngram_tuned", 8) == {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5,
                                                    "num_speculative_tokens": 8}
    assert speculative_config("suffix", 8) == {"method": "suffix", "num_speculative_tokens": 8}
    assert speculative_config("lookup_decode", 8) == {"method": "custom_class", "num_speculative_tokens": 8,
                                                      "model": "lookup_decode.vllm.LookupDrafter"}
    with pytest.raises(ValueError, match="unknown method 'eagle'"):
        speculative_config("eagle", 8)


def test_engine_kwargs_lookup_config_only_for_ours_and_overrides_remove_with_null():
    s = {**SETTINGS, "lookup_config": {"draft_cost": 0}, "engine_args": {"kv_cache_memory_bytes": None, "seed": 3}}
    ours, ngram, none = (engine_kwargs(s, m) for m in ("lookup_decode", "ngram", "none"))
    assert ours["additional_config"] == {"lookup_decode": {"draft_cost": 0}}
    assert "additional_config" not in ngram and "speculative_config" not in none
    assert ngram["speculative_config"]["num_speculative_tokens"] == 8
    for kw in (ours, ngram, none):
        assert "kv_cache_memory_bytes" not in kw and kw["seed"] == 3 and kw["disable_log_stats"] is False
    assert engine_kwargs(SETTINGS, "none")["kv_cache_memory_bytes"] == 2 << 30


def test_child_env_in_process_engine_threads_and_no_lookup_decode_settings():
    env = child_env({"PATH": "/bin", "LOOKUP_DECODE_K": "3", "LOOKUP_DECODE_CONFIG": "x.json", "PYTHONPATH": "/a"}, 1)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["HF_HUB_OFFLINE"] == "1"
    assert env["OMP_NUM_THREADS"] == env["NUMBA_NUM_THREADS"] == "1"
    assert not any(k.startswith("LOOKUP_DECODE_") for k in env) and env["PATH"] == "/bin"
    assert env["PYTHONPATH"].split(":") == [str(vllm_engine.REPO), "/a"]          # this checkout first
    assert "OMP_NUM_THREADS" not in child_env({}, None)                          # a GPU run leaves them alone


def test_engine_flags_parse_and_bench_vllm_hands_engine_over(monkeypatch):
    args = vllm_engine.parse_args([])
    assert (args.batches, args.k, args.repeats, args.methods) == ([1, 8, 32], 8, 2, list(vllm_engine.METHODS))
    assert args.once_batches == [32] and vllm_engine.parse_args(["--once-batches"]).once_batches == []
    args = vllm_engine.parse_args(["--workloads", "code_edit", "--batches", "1", "--requests", "2", "--max-tokens",
                                   "16", "--methods", "none", "lookup_decode", "--lookup-config", '{"k": 4}'])
    assert (args.workloads, args.batches, args.requests, args.max_tokens) == (["code_edit"], [1], 2, 16)
    assert args.lookup_config == {"k": 4} and args.methods == ["none", "lookup_decode"]
    with pytest.raises(SystemExit):
        vllm_engine.parse_args(["--methods", "eagle"])
    with pytest.raises(SystemExit):
        vllm_engine.parse_args(["--batches", "0"])
    got = []
    monkeypatch.setattr(vllm_engine, "main", got.append)
    bench_vllm.main(["engine", "--k", "4"])
    assert got == [["--k", "4"]]


# ------------------------------------------------------------------------------------------- summary and goals

def _cell(workload, batch, wall, tokens, *, drafts=0, draft_tokens=0, accepted=0, steps=10, step_s=1.0,
          propose_s=0.0, proposes=0, row_steps=None):
    n = sum(map(len, tokens.values()))
    return {"workload": workload, "batch": batch, "wall_s": wall, "output_tokens": n, "tokens": tokens,
            "tpot_s": 0.05, "steps": steps, "step_s": step_s, "proposes": proposes, "propose_s": propose_s,
            "row_steps": n if row_steps is None else row_steps, "emitted": n, "emitting_steps": steps,
            "counters": {"drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted, "preemptions": 0,
                         "accepted_per_pos": []}}


REF = {"0": [1, 2, 3, 4], "1": [5, 6, 7, 8]}        # 8 output tokens per cell
# tok/s = 8 / wall; ours: code b1 8.0 (ngram 6.0 / tuned 6.4 / suffix 7.0); code b8 4.0 (ngram 4.0, suffix 5.0);
# chat b1 0.98x none, chat b8 0.90x none; drafter share 2% at code b8, 8% at chat b8
WALLS = {  # (workload, batch): {method: wall}
    ("code_edit", 1): {"none": 4.0, "ngram": 8 / 6.0, "ngram_tuned": 8 / 6.4, "suffix": 8 / 7.0, "lookup_decode": 1.0},
    ("code_edit", 8): {"none": 4.0, "ngram": 2.0, "ngram_tuned": 2.5, "suffix": 1.6, "lookup_decode": 2.0},
    ("mt_bench", 1): {"none": 1.0, "ngram": 1.0, "ngram_tuned": 1.0, "suffix": 1.0, "lookup_decode": 1 / 0.98},
    ("mt_bench", 8): {"none": 1.0, "ngram": 1.0, "ngram_tuned": 1.0, "suffix": 1.0, "lookup_decode": 1 / 0.9},
}


def fake_runs(slow_repeat: float = 1.5, wrong_token_in=None):
    """Two repeats per method; repeat 1 is slower by slow_repeat (min picks repeat 0). wrong_token_in: a method
    whose request "1" differs from no speculation in repeat 1."""
    runs = []
    for repeat in range(2):
        for method in vllm_engine.METHODS:
            cells = []
            for (w, b), walls in WALLS.items():
                tokens = dict(REF)
                if method == wrong_token_in and repeat == 1:
                    tokens = {**REF, "1": [5, 6, 0, 8]}
                share = {("code_edit", 8): 0.02, ("mt_bench", 8): 0.08}.get((w, b), 0.01)
                cells.append(_cell(w, b, walls[method] * (slow_repeat if repeat else 1.0), tokens,
                                   drafts=2 if method != "none" else 0, draft_tokens=16 if method != "none" else 0,
                                   accepted=4 if method != "none" else 0, row_steps=4 if method != "none" else None,
                                   proposes=10 if method != "none" else 0,
                                   propose_s=share if method != "none" else 0.0))
            runs.append({"method": method, "repeat": repeat, "cells": cells})
    return runs


def test_summary_takes_the_min_repeat_and_counts_identical_outputs():
    s = summarize(fake_runs(wrong_token_in="suffix"), "min")
    row = s["code_edit"]["1"]["lookup_decode"]
    assert row["tok_s"] == pytest.approx(8.0) and row["wall_s_all"] == [1.0, 1.5] and row["repeats"] == 2
    assert row["tokens_per_step"] == pytest.approx(2.0)                  # 8 tokens over 4 request-steps
    assert row["acceptance_length"] == pytest.approx(3.0)                # 1 + 4 accepted / 2 drafts
    assert row["drafter_ms_per_step"] == pytest.approx(1.0) and row["drafter_share"] == pytest.approx(0.01)
    assert row["vs"]["ngram"] == pytest.approx(8 / 6.0) and row["vs"]["none"] == pytest.approx(4.0)
    assert (s["code_edit"]["1"]["none"]["tokens_per_step"] == 1.0
            and s["code_edit"]["1"]["none"]["drafter_share"] is None)
    assert row["identical"] == 2 and s["code_edit"]["1"]["suffix"]["identical"] == 1      # a repeat differed
    med = summarize(fake_runs(slow_repeat=3.0), "median")["code_edit"]["1"]["lookup_decode"]
    assert med["tok_s"] == pytest.approx(8 / 2.0)                        # median of walls 1.0 and 3.0


def test_goals_met_and_not_met_with_their_numbers():
    g = {x["goal"]: x for x in goals(summarize(fake_runs()))}
    b1 = g["code edits >= 1.2x ngram at batch 1"]
    assert b1["met"] is True and "vs ngram_tuned 6.4" in b1["detail"] and "x1.25" in b1["detail"]   # the faster ngram
    assert g["code edits >= suffix at batch 1"]["met"] is True
    b8 = g["code edits >= ngram and suffix at batch 8"]
    assert b8["met"] is False and "suffix 5.0 = x0.80" in b8["detail"] and "ngram 4.0 = x1.00" in b8["detail"]
    chat = g["chat >= 0.97x no speculation"]
    assert chat["met"] is False and "b1: x0.980" in chat["detail"] and "b8: x0.900" in chat["detail"]
    share = g["drafter <= 5% of the step at batch 8"]
    assert (share["met"] is False and "code_edit b8: 2.00%" in share["detail"]
            and "mt_bench b8: 8.00%" in share["detail"])


def test_goals_not_measured_without_the_cells():
    runs = [r for r in fake_runs() if r["method"] in ("none", "lookup_decode")]
    for r in runs:
        r["cells"] = [c for c in r["cells"] if c["batch"] == 1 and c["workload"] == "code_edit"]
    g = {x["goal"]: x["met"] for x in goals(summarize(runs))}
    assert g == {"code edits >= 1.2x ngram at batch 1": None, "code edits >= suffix at batch 1": None,
                 "code edits >= ngram and suffix at batch 8": None, "chat >= 0.97x no speculation": None,
                 "drafter <= 5% of the step at batch 8": None}


def test_markdown_table_and_goal_lines_from_a_result(tmp_path, monkeypatch):
    runs = fake_runs() + [{"method": "suffix", "repeat": 2, "error": "exit 1\nRuntimeError: boom"}]
    result = {"command": "python -m benchmarks.vllm.bench engine", "run_s": 60.0,
              "environment": {"cpu": "test cpu", "cpu_count": 2},
              "settings": {"model": "/m", "dtype": "float32", "k": 8, "max_tokens": 4, "ignore_eos": False,
                           "requests": 2, "max_prompt_tokens": 1024, "repeats": 2, "stat": "min", "threads": 1},
              "runs": runs}
    vllm_engine.finish(result, tmp_path, "engine")
    text = (tmp_path / "engine.md").read_text()
    assert text == markdown(json.loads((tmp_path / "engine.json").read_text()))
    assert "| 1 | lookup_decode | 8.0 | 50.0 | 2.00 | 3.00 | 2 / 16 / 4 | 1.00 | 1.0% | 2/2 |  |" in text
    assert "| 1 | ngram | 6.0 |" in text and "| x1.33 |" in text
    assert "* NOT MET: code edits >= ngram and suffix at batch 8" in text and "* met: code edits >= suffix" in text
    assert "* suffix (repeat 2): RuntimeError: boom" in text
    # --from-json re-makes the same files
    monkeypatch.setattr("sys.argv", ["x"])
    vllm_engine.main(["--from-json", str(tmp_path / "engine.json"), "--out", str(tmp_path / "again")])
    assert (tmp_path / "again" / "engine.md").read_text() == text
