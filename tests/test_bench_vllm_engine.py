"""The real-engine benchmark's pure parts (benchmarks/vllm/engine.py, engine_report.py, modelled.py): cells, the
seeded randomized order, the engine arguments and environment of each method, the medians, spreads and paired
ratios, calibration tables, goals and tables computed from a fake result, and the modelled replay on synthetic
outputs. No vLLM, no model, no wall-clock thresholds."""

import json

import numpy as np
import pytest

from benchmarks.vllm import bench as bench_vllm
from benchmarks.vllm import engine as vllm_engine
from benchmarks.vllm import modelled
from benchmarks.vllm.engine import (
    calibration_of,
    calibration_since,
    child_env,
    engine_kwargs,
    parse_cells,
    plan_cells,
    plan_jobs,
    speculative_config,
)
from benchmarks.vllm.engine_report import (
    calibration,
    calibration_total,
    goal_lines,
    goals,
    markdown,
    spread_of,
    summarize,
)
from lookup_decode.core.stats import Calibration

# ------------------------------------------------------------------------------------------- cells and order

def test_parse_cells_aliases_and_errors():
    assert parse_cells(["code:1", "chat:8", "cnn_dm:4"]) == [("code_edit", 1), ("mt_bench", 8), ("cnn_dm", 4)]
    for bad in (["code"], ["code:0"], [":1"], ["code:x"], ["code:1", "code_edit:1"]):
        with pytest.raises(ValueError):
            parse_cells(bad)


def test_plan_cells_rounds_up_to_whole_batches_and_never_reuses_a_request():
    pool = {"w": list(range(100, 150)), "v": list(range(10))}
    cells = plan_cells(pool, [("w", 1), ("w", 8), ("v", 1)], 4)
    assert [(c["workload"], c["batch"], [len(g) for g in c["groups"]]) for c in cells] == \
        [("w", 1, [1, 1, 1, 1]), ("w", 8, [8]), ("v", 1, [1, 1, 1, 1])]
    used = [i for c in cells[:2] for g in c["groups"] for i in g]
    assert used == list(range(100, 112))                                        # in order, disjoint
    assert cells[2]["groups"] == [[0], [1], [2], [3]]                           # each workload from its own pool
    assert [len(g) for g in plan_cells(pool, [("w", 3)], 7)[0]["groups"]] == [3, 3, 3]
    with pytest.raises(ValueError, match="v: .* need 16 requests that fit, 10 do"):
        plan_cells(pool, [("v", 1), ("v", 8)], 8)


def test_plan_jobs_blocks_hold_every_method_and_cell_once_in_seeded_random_order():
    methods = ["none", "ngram", "suffix", "lookup_decode"]
    jobs = plan_jobs(methods, 3, 5, seed=1)
    assert jobs == plan_jobs(methods, 3, 5, seed=1)                              # seeded: reproducible
    assert jobs != plan_jobs(methods, 3, 5, seed=2)
    assert [j["repeat"] for j in jobs] == sorted(j["repeat"] for j in jobs)     # repeats are blocks
    for r in range(5):
        block = [j for j in jobs if j["repeat"] == r]
        served = sorted((j["method"], c) for j in block for c in j["cells"])
        assert served == sorted((m, c) for m in methods for c in range(3))      # every (method, cell) once
        for j in block:                                                          # memory: a fresh engine per cell
            assert len(j["cells"]) == (1 if j["method"] in vllm_engine.MEMORY_METHODS else 3)
    # the order varies across blocks: not always the same method first, nor a shared engine's cells in one order
    assert len({jobs[i * 8]["method"] for i in range(5)} | {jobs[i * 8 + 1]["method"] for i in range(5)}) > 1
    assert len({tuple(j["cells"]) for j in jobs if j["method"] == "none"}) > 1
    always = plan_jobs(methods, 3, 2, fresh="always")
    assert len(always) == 2 * 4 * 3 and all(len(j["cells"]) == 1 for j in always)
    with pytest.raises(ValueError):
        plan_jobs(methods, 3, 1, fresh="never")


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
    assert (args.k, args.repeats, args.requests, args.methods) == (8, 5, 8, ["none", "ngram", "suffix",
                                                                             "lookup_decode"])
    assert args.cell_list == [("code_edit", 1), ("code_edit", 8), ("mt_bench", 1), ("mt_bench", 8)]
    assert args.again and args.replay and args.fresh_engine == "memory"
    args = vllm_engine.parse_args(["--cells", "code:1", "--requests", "2", "--max-tokens", "16", "--repeats", "1",
                                   "--methods", "none", "lookup_decode", "--lookup-config", '{"k": 4}', "--no-again"])
    assert (args.cell_list, args.requests, args.max_tokens, args.repeats) == ([("code_edit", 1)], 2, 16, 1)
    assert args.lookup_config == {"k": 4} and args.methods == ["none", "lookup_decode"] and not args.again
    for bad in (["--methods", "eagle"], ["--batches", "0"], ["--cells", "code"]):
        with pytest.raises(SystemExit):
            vllm_engine.parse_args(bad)
    got = []
    monkeypatch.setattr(vllm_engine, "main", got.append)
    bench_vllm.main(["engine", "--k", "4"])
    assert got == [["--k", "4"]]


# ------------------------------------------------------------------------------------------- statistics

def test_spread_of_leaves_out_missing_values():
    assert spread_of([None, 1.0, 3.0])["median"] == 2.0 and spread_of([None]) is None


class FakeDrafter:
    def __init__(self, cal):
        self.stats = type("Stats", (), {"reliability": cal})()


def test_calibration_of_a_cell_is_the_difference_and_reads_back_both_forms():
    drafter = FakeDrafter(Calibration())
    drafter.stats.reliability.observe([0.55] * 10, [True] * 5 + [False] * 5)
    before = calibration_of(drafter)
    drafter.stats.reliability.observe([0.55] * 30 + [0.95] * 60, [True] * 24 + [False] * 6 + [True] * 54 + [False] * 6)
    assert before.tokens[5] == 10                                               # a copy: not moved by the cell
    cell = calibration(calibration_since(calibration_of(drafter), before))     # what the cell added
    rows = cell.rows()
    assert [r.tokens for r in rows] == [30, 60]
    assert rows[0].kept == pytest.approx(0.8) and rows[0].predicted == pytest.approx(0.55)
    assert cell.error(50) == pytest.approx(0.05)                                # the 60-token bin; 30 < 50 tokens
    assert calibration_of(object()) is None
    old = [{"bin_low": 0.5, "bin_high": 0.6, "tokens": 30, "predicted": 0.55, "kept": 0.8}]   # results before
    assert calibration(old).rows()[0][:5] == pytest.approx(rows[0][:5])       # (its chance spread unknown: 0)
    assert calibration_total([None, None]) is None
    assert calibration_total([old, old]).rows()[0].tokens == 60


# ------------------------------------------------------------------------------------------- summary and goals

def test_p99_is_the_nearest_rank():
    assert vllm_engine.p99([]) is None and vllm_engine.p99([0.5]) == 0.5
    assert vllm_engine.p99(list(range(1, 101))) == 99 and vllm_engine.p99(list(range(1, 201))) == 198


def _cell(workload, batch, phase, wall, tokens, *, drafts=0, draft_tokens=0, accepted=0, steps=10, step_s=1.0,
          propose_s=0.0, proposes=0, row_steps=None, calibration=None, worst=None):
    n = sum(map(len, tokens.values()))
    return {"cell": 0, "workload": workload, "batch": batch, "phase": phase, "wall_s": wall, "output_tokens": n,
            "tokens": tokens, "tpot_s": 0.05, "steps": steps, "step_s": step_s, "proposes": proposes,
            "propose_s": propose_s, "propose_max_s": worst, "propose_p99_s": worst,
            "row_steps": n if row_steps is None else row_steps,
            "emitted": n, "emitting_steps": steps, "calibration": calibration,
            "counters": {"drafts": drafts, "draft_tokens": draft_tokens, "accepted": accepted, "preemptions": 0,
                         "accepted_per_pos": [accepted, 0] if drafts else []}}


REF = {"0": [1, 2, 3, 4], "1": [5, 6, 7, 8]}        # 8 output tokens per cell
# tok/s = 8 / wall in repeat 0; ours: code b1 8.0 (ngram 6.0 / suffix 7.0); code b8 4.0 (ngram 4.0, suffix 5.0);
# chat b1 0.98x none, chat b8 0.90x none; drafter share 2% at code b8, 8% at chat b8
WALLS = {  # (workload, batch): {method: wall}
    ("code_edit", 1): {"none": 4.0, "ngram": 8 / 6.0, "suffix": 8 / 7.0, "lookup_decode": 1.0},
    ("code_edit", 8): {"none": 4.0, "ngram": 2.0, "suffix": 1.6, "lookup_decode": 2.0},
    ("mt_bench", 1): {"none": 1.0, "ngram": 1.0, "suffix": 1.0, "lookup_decode": 1 / 0.98},
    ("mt_bench", 8): {"none": 1.0, "ngram": 1.0, "suffix": 1.0, "lookup_decode": 1 / 0.9},
}
SLOW = [1.0, 1.2, 0.9, 1.1, 1.5]        # the machine's speed per repeat: every method alike (paired ratios exact)
CAL = [{"bin_low": 0.5, "bin_high": 0.6, "tokens": 20, "predicted": 0.55, "kept": 0.6}]


def fake_runs(repeats=5, wrong_token_in=None, jitter=None):
    """Per repeat and method, every cell cold and again (again: 10% faster for suffix). wrong_token_in: a method
    whose request "1" differs from no speculation in repeat 1. jitter: {method: factor per repeat} on its walls."""
    runs = []
    for repeat in range(repeats):
        for method in ("none", "ngram", "suffix", "lookup_decode"):
            cells = []
            for (w, b), walls in WALLS.items():
                for phase in ("cold", "again"):
                    tokens = dict(REF)
                    if method == wrong_token_in and repeat == 1:
                        tokens = {**REF, "1": [5, 6, 0, 8]}
                    share = {("code_edit", 8): 0.02, ("mt_bench", 8): 0.08}.get((w, b), 0.01)
                    wall = walls[method] * SLOW[repeat] * (jitter or {}).get(method, [1] * repeats)[repeat]
                    if phase == "again" and method == "suffix":
                        wall /= 1.1
                    spec = method != "none"
                    cells.append(_cell(w, b, phase, wall, tokens, drafts=2 if spec else 0,
                                       draft_tokens=16 if spec else 0, accepted=4 if spec else 0,
                                       row_steps=4 if spec else None, proposes=10 if spec else 0,
                                       propose_s=share if spec else 0.0, worst=0.003 * (repeat + 1) if spec else None,
                                       calibration=CAL if method == "lookup_decode" else None))
            runs.append({"method": method, "repeat": repeat, "cells": cells})
    return runs


def test_summary_medians_spreads_paired_ratios_and_phases_apart():
    s = summarize(fake_runs(wrong_token_in="suffix"))
    assert list(s["code_edit"]["1"]) == ["cold", "again"]
    row = s["code_edit"]["1"]["cold"]["lookup_decode"]
    assert row["repeats"] == 5 and row["tok_s"]["n"] == 5
    assert row["tok_s"]["median"] == pytest.approx(8.0 / 1.1)                  # median of 8 / SLOW
    assert row["tok_s"]["min"] == pytest.approx(8 / 1.5) and row["tok_s"]["max"] == pytest.approx(8 / 0.9)
    assert row["tok_s"]["q1"] is not None and row["tok_s"]["q1"] <= row["tok_s"]["median"] <= row["tok_s"]["q3"]
    assert row["vs"]["ngram"] == {"n": 5, **{k: pytest.approx(8 / 6.0) for k in ("median", "min", "max", "q1",
                                                                                   "q3")}}
    assert row["tokens_per_step"] == pytest.approx(2.0)                         # 8 tokens over 4 request-steps
    assert (row["drafted"], row["kept"], row["wasted"]) == (16, 4, 12)
    assert row["accepted_per_pos"] == [20, 0]                                   # summed over 5 repeats
    assert row["drafter_ms_mean"] == pytest.approx(1.0) and row["drafter_ms_worst"] == pytest.approx(15.0)
    assert row["drafter_share"] == pytest.approx(0.01)
    assert row["calibration"] == [{**CAL[0], "tokens": 100, "predicted": pytest.approx(0.55),
                                   "kept": pytest.approx(0.6), "chance": 0.0}]      # (stored rows: no variance)
    assert row["identical"] == 2 and s["code_edit"]["1"]["cold"]["suffix"]["identical"] == 1
    assert s["code_edit"]["1"]["cold"]["none"]["tokens_per_step"] == 1.0
    assert s["code_edit"]["1"]["cold"]["none"]["drafter_share"] is None
    again = s["code_edit"]["1"]["again"]["lookup_decode"]["vs"]["suffix"]
    assert again["median"] == pytest.approx(8 / 7.0 / 1.1)                      # suffix is faster again


def test_paired_ratios_follow_the_repeat_not_the_sorted_values():
    # ours is slow in repeat 0 only, the baseline in repeat 4 only: pairing by repeat keeps those apart
    runs = fake_runs(jitter={"lookup_decode": [2, 1, 1, 1, 1], "ngram": [1, 1, 1, 1, 2]})
    vs = summarize(runs)["code_edit"]["1"]["cold"]["lookup_decode"]["vs"]["ngram"]
    base = 8 / 6.0
    assert vs["min"] == pytest.approx(base / 2) and vs["max"] == pytest.approx(base * 2)
    assert vs["median"] == pytest.approx(base)


def test_goals_met_not_met_and_whether_the_spread_tells_them_apart():
    g = {x["goal"]: x for x in goals(summarize(fake_runs()))}
    b1 = g["code edits >= 1.2x ngram at batch 1 (cold)"]
    assert b1["met"] is True and b1["clear"] is True and "x1.33 (x1.33-x1.33, 5 pairs)" in b1["detail"]
    assert g["code edits >= 1.05x suffix at batch 1 (cold)"]["met"] is True          # 8 / 7 = 1.14
    b8 = g["code edits >= ngram and suffix at batch 8 (cold)"]
    assert b8["met"] is False and "vs suffix 4.5 tok/s, paired x0.80" in b8["detail"]
    again = g["repeated requests >= suffix (again)"]
    assert again["met"] is False and "code_edit b1 again" in again["detail"]
    chat = g["chat >= 0.97x no speculation at batch 1 and 8 (cold)"]
    assert chat["met"] is False and "mt_bench b1 cold" in chat["detail"] and "x0.90" in chat["detail"]
    assert g["every output identical to no speculation, with drafts accepted"]["met"] is True
    share = g["drafter <= 5% of the step at batch 8"]
    assert share["met"] is False and "code_edit b8: 2.00%" in share["detail"]
    assert "mt_bench b8: 8.00%" in share["detail"]
    cal = g["calibration: |mean predicted - share kept| <= 0.05 in every bin of >= 50 tokens (cold)"]
    assert cal["met"] is True and "worst gap 0.050" in cal["detail"]            # 100 tokens summed, 0.55 vs 0.6
    assert g["replay: modelled >= 97% of the oracle-cut ceiling, both step costs, batch 1 and 8 (cold)"]["met"] is None
    # a median past the bar with one pair below: met, but not told apart
    runs = fake_runs(jitter={"lookup_decode": [1, 1, 1, 1, 1.3]})
    g = {x["goal"]: x for x in goals(summarize(runs))}
    b1 = g["code edits >= 1.05x suffix at batch 1 (cold)"]
    assert b1["met"] is True and b1["clear"] is False
    assert "within the spread" in [line for line in goal_lines([b1])][0]


def test_goals_identical_outputs_fail_on_a_difference_and_without_drafts_kept():
    g = {x["goal"]: x for x in goals(summarize(fake_runs(wrong_token_in="ngram")))}
    ident = g["every output identical to no speculation, with drafts accepted"]
    assert ident["met"] is False and "ngram: 1/2 identical" in ident["detail"]
    runs = fake_runs()
    for r in runs:
        if r["method"] == "ngram":
            for c in r["cells"]:
                c["counters"]["accepted"] = 0                 # identical, but vacuously: nothing was ever kept
    ident = {x["goal"]: x for x in goals(summarize(runs))}["every output identical to no speculation, with drafts "
                                                             "accepted"]
    assert ident["met"] is False and ident["detail"] == "ngram: no draft token kept in any cell"


def test_goals_not_measured_without_the_cells():
    runs = [r for r in fake_runs() if r["method"] in ("none", "lookup_decode")]
    for r in runs:
        r["cells"] = [c for c in r["cells"] if c["batch"] == 1 and c["workload"] == "code_edit" and
                      c["phase"] == "cold"]
    g = {x["goal"]: x["met"] for x in goals(summarize(runs))}
    assert g["code edits >= 1.2x ngram at batch 1 (cold)"] is None
    assert g["repeated requests >= suffix (again)"] is None
    assert g["chat >= 0.97x no speculation at batch 1 and 8 (cold)"] is None
    assert g["every output identical to no speculation, with drafts accepted"] is True


RESULT_SETTINGS = {"model": "/m", "dtype": "float32", "k": 8, "max_tokens": 4, "ignore_eos": False, "requests": 2,
                   "max_prompt_tokens": 1024, "repeats": 5, "seed": 0, "fresh": "memory", "threads": 1,
                   "max_model_len": 4096, "methods": ["none", "ngram", "lookup_decode"], "again": True,
                   "label": "reduced run: noisy"}


def test_markdown_tables_calibration_and_goal_lines_from_a_result(tmp_path, monkeypatch):
    runs = fake_runs() + [{"method": "suffix", "repeat": 5, "error": "exit 1\nRuntimeError: boom"}]
    result = {"command": "python -m benchmarks.vllm.bench engine", "run_s": 60.0,
              "environment": {"cpu": "test cpu", "cpu_count": 2}, "settings": RESULT_SETTINGS, "runs": runs}
    vllm_engine.finish(result, tmp_path, "engine")
    text = (tmp_path / "engine.md").read_text()
    assert text == markdown(json.loads((tmp_path / "engine.json").read_text()))
    assert text.startswith("# lookup_decode vs vLLM's drafters") and "**reduced run: noisy**" in text
    assert "## code_edit, batch 1, cold (5 repeats)" in text and "## mt_bench, batch 8, again (5 repeats)" in text
    line = next(x for x in text.splitlines() if x.startswith("| lookup_decode | 7.27 |"))
    assert "| 5.33–8.89 |" in line and "| 16 / 4 / 12 | 20/0 | 1.00 / 15.00 / 15.0 | 1.00% | 2/2 |" in line
    assert "| ngram | 5.45 | 4.00–6.67 |" in text and "| x1.33 (x1.33-x1.33, 5 pairs) |" in text
    assert "### code_edit, batch 1, cold" in text and "| 0.5–0.6 | 100 | 0.550 | 0.600 | +0.050 |" in text
    assert "* NOT MET: code edits >= ngram and suffix at batch 8 (cold)" in text
    assert "* met: code edits >= 1.05x suffix at batch 1 (cold)" in text
    assert "* suffix (repeat 5): RuntimeError: boom" in text
    assert "Not run (`--no-replay`" in text
    # --from-json re-makes the same files
    monkeypatch.setattr("sys.argv", ["x"])
    vllm_engine.main(["--from-json", str(tmp_path / "engine.json"), "--out", str(tmp_path / "again")])
    assert (tmp_path / "again" / "engine.md").read_text() == text


def test_results_before_the_phase_split_still_render(tmp_path):
    runs = fake_runs(repeats=2)
    for r in runs:
        old = ("phase", "propose_max_s", "propose_p99_s", "calibration")
        r["cells"] = [{k: v for k, v in c.items() if k not in old}
                      for c in r["cells"] if c["phase"] == "cold"]
    s = summarize(runs)
    assert list(s["code_edit"]["1"]) == ["cold"] and s["code_edit"]["1"]["cold"]["ngram"]["drafter_ms_worst"] is None
    result = {"command": "c", "environment": {}, "settings": {**RESULT_SETTINGS, "label": None}, "runs": runs}
    vllm_engine.finish(result, tmp_path, "old")
    assert "| 1.00 / – / – |" in (tmp_path / "old.md").read_text()


# ------------------------------------------------------------------------------------------- the modelled replay

def _pairs(n=3, seed=0):
    """(prompt, output) pairs whose outputs copy spans of their prompts (drafts get kept) with new tokens between."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        base = rng.integers(0, 400, 160).astype(np.int32)
        out.append((base, np.concatenate([base[20:60], rng.integers(0, 400, 6), base[90:120]]).astype(np.int32)))
    return out


def test_price_counts_decode_steps_only():
    assert modelled.price([(400, 0, 0), (0, 9, 1), (0, 3, 1)], (0.1, 0.01)) == \
        {"steps": 2, "row_steps": 2, "verified": 12, "seconds": pytest.approx(0.32)}
    assert modelled.price([(5, 18, 2)], (1.0, 0.5))["seconds"] == pytest.approx(10.0)    # a mixed step: decode part


def test_oracle_cut_keeps_exactly_what_the_target_keeps():
    pairs = _pairs()
    full = modelled.replay_cell(modelled.make_drafter("ngram", 8, 1024), [[p] for p in pairs], clock=(0.1, 0.01),
                                k=8, max_model_len=1024)
    cut = modelled.replay_cell(modelled.OracleCut(modelled.make_drafter("ngram", 8, 1024)), [[p] for p in pairs],
                               clock=(0.1, 0.01), k=8, max_model_len=1024)
    for phase in ("cold", "again"):
        a, b = full[phase], cut[phase]
        assert a["tokens"] == b["tokens"] == sum(len(o) for _, o in pairs)
        assert a["kept"] > 0 and a["drafted"] > a["kept"]                       # drafts kept, some wasted
        assert b["drafted"] == b["kept"] == a["kept"] and b["steps"] == a["steps"]
        assert b["verified"] < a["verified"] and b["tok_s"] > a["tok_s"]
    none = modelled.replay_cell(modelled.NoDrafter(), [pairs], clock=(0.1, 0.01), k=8, max_model_len=1024)
    assert none["cold"]["steps"] == max(len(o) for _, o in pairs) - 1 and none["cold"]["drafted"] == 0


def test_replay_every_method_against_its_ceiling_on_both_clocks():
    pairs = _pairs(4, seed=1)
    cells = [{"workload": "w", "batch": 1, "groups": [[p] for p in pairs[:2]]},
             {"workload": "w", "batch": 2, "groups": [pairs[2:]]}]
    r = modelled.replay(cells, ["none", "ngram", "lookup_decode", "suffix"], k=8, max_model_len=1024,
                        warmup=[pairs[0]])
    assert set(r) == set(modelled.CLOCKS)
    for clock in r:
        for b in ("1", "2"):
            for phase in ("cold", "again"):
                rows = r[clock]["w"][b][phase]
                assert rows["none"]["ceiling"] is None and rows["none"]["share"] is None
                for m in ("ngram", "lookup_decode"):
                    x = rows[m]
                    assert x["modelled"]["kept"] > 0
                    assert x["ceiling"]["drafted"] == x["ceiling"]["kept"]
                    assert 0 < x["share"] <= 1.0 + 1e-9
                    assert x["modelled"]["tok_s"] > rows["none"]["modelled"]["tok_s"]
    # arctic_inference is optional here: suffix is replayed where it is installed, left out where not
    try:
        import arctic_inference.suffix_decoding  # noqa: F401
        assert "suffix" in r["cpu"]["w"]["1"]["cold"]
    except ImportError:
        assert "suffix" not in r["cpu"]["w"]["1"]["cold"]


def test_a_failing_replay_keeps_the_engines_results(capsys):
    result = {"runs": fake_runs(repeats=1), "prompts": {"0": [1, 1], "1": [2, 2]}, "warmup": [],
              "cells": [{"workload": "code_edit", "batch": 1, "groups": [[0], [1]]}],
              "settings": {"methods": ["none", "eagle"], "k": 8, "max_model_len": 64}}
    assert vllm_engine.run_replay(result) is None
    assert "no replay drafter for method 'eagle'" in result["replay_error"]
    assert "replay failed" in capsys.readouterr().out


def test_replay_cells_from_a_result_use_no_speculations_outputs_and_warmup():
    runs = fake_runs(repeats=1)
    for run in runs:
        run["warmup_tokens"] = [[9, 9]] if run["method"] == "none" else [[7]]
        for c in run["cells"]:
            if run["method"] == "ngram":
                c["tokens"] = {"0": [0], "1": [0]}
    result = {"runs": runs, "prompts": {"0": [1, 1], "1": [2, 2]}, "warmup": [[3, 3]],
              "cells": [{"workload": "code_edit", "batch": 1, "groups": [[0], [1]]},
                        {"workload": "absent", "batch": 1, "groups": [[0]]}]}
    cells, warmup = vllm_engine.replay_cells(result)
    assert cells == [{"workload": "code_edit", "batch": 1, "groups": [[([1, 1], REF["0"])], [([2, 2], REF["1"])]]}]
    assert warmup == [([3, 3], [9, 9])]
