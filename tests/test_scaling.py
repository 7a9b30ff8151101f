"""Scaling study and full-run plumbing: Aider after-files, cost grid and projected times (hand-worked),
controlled copy outputs, per-token timelines, the long-context prompt cap, and the results block of the
benchmarks page generated from the results file. No wall-clock thresholds."""

import ast
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import repetitive_prompt

from benchmarks.e2e import generate as bench_generate
from benchmarks.e2e.aider_after import move_method_to_top_level, parse_task
from benchmarks.e2e.scaling import PROPOSERS, bucket_medians, controlled_copy_output, projected
from benchmarks.harness import report, workloads
from benchmarks.harness.metrics import Timeline, copy_share
from benchmarks.micro.cost_grid import CostGrid, plain_times, step_times, synthetic_cache, time_forwards, time_to
from lookup_decode import measure

REPO = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------ Aider after-files

BEFORE = '''import os


class C:
    x = 1

    def helper(self, a, b=2):
        return a + b

    def run(self):
        return self.helper(1)


def other():
    pass
'''

AFTER = '''import os


class C:
    x = 1


    def run(self):
        return helper(1)


def helper(a, b=2):
    return a + b


def other():
    pass
'''


def test_move_method_hand_worked():
    assert move_method_to_top_level(BEFORE, "C", "helper") == AFTER


def test_move_static_method_of_a_nested_class():
    src = ("class Outer:\n    class C:\n        @staticmethod\n        def f(a):\n            return a\n\n"
           "    y = 2\n")
    after = move_method_to_top_level(src, "C", "f")
    assert after == "class Outer:\n    class C:\n        pass\n\n    y = 2\n\n\ndef f(a):\n    return a\n"
    ast.parse(after)


def test_move_method_errors_name_the_problem():
    with pytest.raises(ValueError, match="class 'D' not found"):
        move_method_to_top_level(BEFORE, "D", "helper")
    with pytest.raises(ValueError, match="method 'nope' not found"):
        move_method_to_top_level(BEFORE, "C", "nope")
    with pytest.raises(ValueError, match="not an Aider refactor"):
        parse_task("Rewrite everything")


def test_every_aider_task_gives_valid_python_with_the_function_moved():
    path = workloads.data_dir() / "aider_refactor" / "refactor_benchmark.jsonl"
    if not path.exists():
        pytest.skip("shared data not available")
    rows = [r for r in workloads.read_jsonl(path) if len(r["before_code"]) < 100_000]
    assert len(rows) > 80
    for row in rows:
        cls, method = parse_task(row["instruction"])
        after = move_method_to_top_level(row["before_code"], cls, method)
        tree = ast.parse(after)
        assert any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == method for n in tree.body)
        assert f"self.{method}(" not in after


# ---------------------------------------------------------------------------- cost grid, projection

def test_cost_grid_interpolates_and_clamps():
    grid = CostGrid([100, 300], [1, 3], [[1.0, 2.0], [3.0, 6.0]])
    assert grid(100, 1) == 1.0 and grid(300, 3) == 6.0
    assert grid(200, 2) == pytest.approx(3.0)          # contexts -> [2, 4], then n = 2 -> 3
    assert grid(50, 1) == 1.0 and grid(400, 3) == 6.0  # clamped outside the measured contexts
    assert grid.curve(200, 3)(3) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="contexts, sizes"):
        CostGrid([100, 300], [1, 3], [[1.0, 2.0]])


def test_step_times_plain_times_and_time_to_hand_worked():
    linear = CostGrid([0, 1000], [1, 33], [[1, 33], [1, 33]])   # cost(context, n) = n seconds
    emitted, seconds = step_times([3, 0, 2], [3, 0, 1], linear, context=10)
    assert emitted.tolist() == [4, 5, 7] and seconds.tolist() == [4.0, 5.0, 8.0]
    assert time_to(emitted, seconds, [1, 4, 5, 6, 7, 8]) == [4.0, 4.0, 5.0, 8.0, 8.0, None]
    growing = CostGrid([0, 10], [1, 2], [[1, 2], [2, 4]])         # cost(c, 1) = 1 + c / 10
    assert plain_times(3, growing, 0).tolist() == pytest.approx([1.0, 2.1, 3.3])
    _, s = step_times([1, 1], [1, 0], growing, context=0)         # forwards at contexts 0 and 2
    assert s.tolist() == pytest.approx([2.0, 2.0 + 2.4])


@pytest.mark.parametrize("name", PROPOSERS)
def test_projected_speedup_with_flat_cost_is_the_mean_accepted_length(name):
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 500, size=400).astype(np.int32)
    output = np.concatenate([prompt[50:120], rng.integers(600, 700, size=20), prompt[200:260]]).astype(np.int32)
    flat = CostGrid([0, 10_000], [1, 33], [[1.0, 1.0], [1.0, 1.0]])
    row = projected(name, prompt, output, flat, eos=[], lengths=[1, 64, len(output)])
    assert row["mean_accepted_length"] > 1.5                       # drafts really were accepted
    assert row["speedup"] == pytest.approx(row["mean_accepted_length"])
    assert row["speedup_at"][-1] == pytest.approx(row["speedup"])
    assert row["speedup_at"][0] == pytest.approx(1.0)              # the first token needs one forward


def test_projected_ceiling_bounds_the_real_proposers():
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, 300, size=600).astype(np.int32)
    output = np.concatenate([prompt[10:90], rng.integers(400, 450, size=10), prompt[300:380]]).astype(np.int32)
    flat = CostGrid([0, 10_000], [1, 33], [[1.0, 1.0], [1.0, 1.0]])
    rows = {n: projected(n, prompt, output, flat, eos=[]) for n in PROPOSERS}
    assert rows["context_copy_ceiling"]["speedup"] >= rows["lookup_decode"]["speedup"] > 1.0
    assert rows["context_copy_ceiling"]["speedup"] >= rows["transformers_pld"]["speedup"]


def test_synthetic_cache_has_the_asked_length_and_survives_timing(tiny_llama):
    cache = synthetic_cache(tiny_llama, 300)
    assert cache.get_seq_length() == 300
    seconds = time_forwards(tiny_llama, cache, [1, 5], repeats=1)
    assert len(seconds) == 2 and all(s > 0 for s in seconds)
    assert cache.get_seq_length() == 300                           # every timed forward was cropped back


# ---------------------------------------------------------------------------- controlled copy share

@pytest.mark.parametrize("share", [0.0, 0.25, 0.5, 0.8, 1.0])
def test_controlled_copy_output_hits_the_share_and_copies_real_spans(share):
    prompt, novel = np.arange(1000, 2000), np.arange(5000, 5600)
    out, mask = controlled_copy_output(prompt, novel, share, 512, 16, np.random.default_rng(3))
    assert len(out) == len(mask) == 512
    assert (mask == (out < 2000)).all()                            # copied tokens come from the prompt only
    assert abs(mask.mean() - share) <= 0.05
    # spans, not scattered tokens: most copied tokens continue the prompt run of the token before them
    copied = np.flatnonzero(mask[1:] & mask[:-1]) + 1
    if len(copied):
        assert np.mean(out[copied] == out[copied - 1] + 1) > 0.8
    if share == 1.0:
        assert copy_share(prompt, out, n=1) == 1.0


def test_copy_share_worked_example():
    assert copy_share([1, 2, 3], [1, 2, 9, 2, 3], n=2) == pytest.approx(4 / 5)
    assert copy_share([1, 2, 3], [7, 8, 9], n=2) == 0.0
    assert copy_share([1, 2], [1], n=2) == 0.0


def test_bucket_medians():
    got = bucket_medians([0.1, 0.5, 1.0, 0.9], [1, 2, 3, 4], [0.0, 0.5, 1.0])
    assert [b["n"] for b in got] == [1, 3] and got[0]["median"] == 1 and got[1]["median"] == 3


# ------------------------------------------------------------------------------------- timelines

# adaptive off: the cost model's choice depends on this machine's load (a busy CI box drafted nothing useful)
@pytest.mark.parametrize("variant", [measure.PLAIN,
                                     measure.Variant("lookup_decode", lookup={"k": 8, "adaptive": False})])
def test_timeline_stamps_every_new_token(tiny_llama, variant):
    from transformers import StoppingCriteriaList
    ids = repetitive_prompt(0)
    timeline = Timeline("cpu")
    v = measure.Variant(variant.name, variant.lookup, {"stopping_criteria": StoppingCriteriaList([timeline])})
    run = measure.run_variant(tiny_llama, ids, v, 30)
    plain = measure.run_variant(tiny_llama, ids, measure.PLAIN, 30)
    assert run.tokens == plain.tokens
    if run.stats is not None:
        assert run.stats.accepted > 0                              # several tokens per step really happened
    lengths, seconds = timeline.cumulative(ids.shape[1], start=0.0)
    assert lengths.tolist() == list(range(1, len(run.tokens) + 1))
    assert (np.diff(seconds) >= 0).all()


# ------------------------------------------------------------------------- long prompts in the full run

class FakeTokenizer:
    def apply_chat_template(self, messages, **kwargs):
        return {"input_ids": torch.zeros(1, len(messages[0]["content"]), dtype=torch.long)}


def test_long_workloads_have_their_own_prompt_cap():
    sizes = {"qa": [5000, 100], "aider_refactor": [9000, 5000, 1200]}

    def load(name):
        return [workloads.Request(name, f"{name}/{i}", [{"role": "user", "content": "x" * n}])
                for i, n in enumerate(sizes[name])]
    chosen, skipped = bench_generate.select_prompts(["qa", "aider_refactor"], FakeTokenizer(), n=5,
                                                    max_prompt_tokens=4096, context=8192, max_new_tokens=128,
                                                    seed=0, long_prompt_tokens=6144, load=load)
    kept = sorted((r.category, ids.shape[1]) for r, ids in chosen)
    assert kept == [("aider_refactor", 1200), ("aider_refactor", 5000), ("qa", 100)]
    assert skipped == {"qa": 1, "aider_refactor": 1}
    assert "aider_refactor" in bench_generate.CATEGORIES + bench_generate.LONG


# ------------------------------------------------------------------ the results page from the results

def test_results_block_is_generated_from_the_committed_results():
    page = REPO / report.PAGE
    if not page.exists():       # until docs/benchmarks.md (issue 26's docs pages) holds the block
        pytest.skip(f"{report.PAGE} does not exist yet")
    path = REPO / "benchmarks" / "results" / "generate" / "results.json"
    result = json.loads(path.read_text())
    result["aggregate"] = report.aggregate(result["prompts"], result["settings"]["variants"],
                                           result["settings"]["loop_threshold"])
    block = report.results_block(result)
    text = page.read_text(encoding="utf-8")
    start = text.index(report.BLOCK_START)
    assert text[start:text.index(report.BLOCK_END) + len(report.BLOCK_END)] == block, \
        f"the results block of {report.PAGE} is stale: python -m benchmarks.harness.report " \
        f"benchmarks/results/generate/results.json --page {report.PAGE}"


def test_update_page_replaces_only_the_marked_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"intro\n{report.BLOCK_START}\nold\n{report.BLOCK_END}\noutro\n")
    report.update_page(page, f"{report.BLOCK_START}\nnew\n{report.BLOCK_END}")
    assert page.read_text() == f"intro\n{report.BLOCK_START}\nnew\n{report.BLOCK_END}\noutro\n"
    page.write_text("no markers")
    with pytest.raises(ValueError, match="no <!-- results:generate -->"):
        report.update_page(page, "x")
