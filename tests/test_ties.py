"""The bfloat16 exactness contract (docs/limits.md): greedy lookup decoding equals plain decoding, except where the
first difference is a near-tie (`engines.hf.ties`).

Fast tests on a tiny random model in bfloat16 check the classifier itself; the `code_model` tests run the code
model (Qwen2.5-Coder-0.5B in bfloat16) end to end on real code edits, classify every difference and fail on any
that is not a near-tie (skipped, with the reason, where `lookup_decode.code_model()` has not been assembled)."""

import json
from pathlib import Path

import pytest
import tiny_models
import torch
from conftest import repetitive_prompt

import lookup_decode
from lookup_decode.engines.hf import models, ties


def test_first_difference():
    assert ties.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert ties.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert ties.first_difference([1, 2], [1, 2, 3]) == 2
    assert ties.first_difference([], []) is None


@pytest.fixture(scope="module")
def bf16_run():
    model = tiny_models.build("llama", dtype=torch.bfloat16)
    prompt = repetitive_prompt(0, length=16)
    out = model.generate(prompt, do_sample=False, pad_token_id=0, eos_token_id=None, max_new_tokens=24,
                         return_dict_in_generate=True, output_logits=True)
    return model, prompt[0], out.sequences[0, prompt.shape[1]:], torch.stack(out.logits)[:, 0].float()


def test_equal_outputs_have_no_difference(bf16_run):
    model, prompt, plain, _ = bf16_run
    assert ties.classify(model, prompt, plain, plain.clone()) is None


def test_classify_measures_the_gap_between_the_two_tokens(bf16_run):
    model, prompt, plain, logits = bf16_run
    at = 10
    for other, near in ((int(logits[at].topk(2).indices[1]), None), (int(logits[at].argmin()), False)):
        lookup = plain.clone()
        lookup[at:] = other
        d = ties.classify(model, prompt, plain, lookup)
        assert (d.position, d.plain, d.lookup) == (at, int(plain[at]), other)
        gap = float(logits[at, int(plain[at])] - logits[at, other])
        assert d.gaps[0] == pytest.approx(gap, abs=0.1)      # the 1-token forward is plain decoding's shape
        assert d.near_tie == (max(d.gaps) <= ties.NEAR_TIE)
        if near is not None:
            assert d.near_tie is near
        assert ties.classify(model, prompt, plain, lookup, threshold=float("inf")).near_tie
        assert not ties.classify(model, prompt, plain, lookup, threshold=-1.0).near_tie


def test_an_output_that_ends_early_is_no_near_tie(bf16_run):
    model, prompt, plain, _ = bf16_run
    d = ties.classify(model, prompt, plain, plain[:5], threshold=float("inf"))
    assert (d.position, d.lookup, d.near_tie) == (5, -1, False)


def test_rounding_spread_is_zero_sized_in_float32_and_bounded_in_bfloat16():
    prompt = repetitive_prompt(1, length=16)[0]
    spreads = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_models.build("qwen2", dtype=dtype)
        spreads[dtype] = ties.rounding_spread(model, prompt, 20)
        assert spreads[dtype].shape == (len(prompt) - 20,)
    assert float(spreads[torch.float32].max()) < 1e-4
    assert float(spreads[torch.bfloat16].max()) < ties.NEAR_TIE
    # Native bf16 kernels (AVX512-BF16, AMX) round the two forward shapes differently; where bf16 is emulated (an
    # AVX2-only CPU upcasts to float32 and rounds each output once) the tiny model's spread is exactly zero.
    if models.bf16_native("cpu"):
        assert float(spreads[torch.bfloat16].max()) > 0


# ------------------------------------------------------------------ the code model, end to end

def _code_edits():
    path = Path(__file__).parent / "data" / "real_prompts.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    edits = [(r["id"], r["messages"]) for r in rows if r["category"] == "code_edit"]
    example = Path(__file__).parent.parent / "examples" / "data" / "edit_request.txt"
    return edits + [("edit_request", [{"role": "user", "content": example.read_text(encoding="utf-8").rstrip()}])]


@pytest.fixture(scope="module")
def code_model():
    try:
        path = models.code_model(download=False)
    except models.ModelNotFoundError as e:
        pytest.skip(f"the code model is not assembled: {e}")
    return models.load_model(path, dtype=torch.bfloat16)


def differences_are_near_ties(model, ids, options, max_new_tokens=128):
    """Plain greedy vs lookup decoding (a flat cost curve: a calibration timed on a busy machine could price every
    draft out and leave nothing verified) on prompt ids [1, T]; the first difference must be a near-tie and drafts
    must have been accepted. Returns the classified difference (None: identical)."""
    plain = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    stats = lookup_decode.DecodeStats()
    costs = lookup_decode.CostModel("off")
    costs.curve(model, 33, lambda w: 0.08 * (1 + 0.01 * (w - 1)))
    hook = lookup_decode.lookup_decoding(stats=stats, costs=costs, **options)
    got = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, custom_generate=hook)
    d = ties.classify(model, ids[0], plain[0, ids.shape[1]:], got[0, ids.shape[1]:])
    assert d is None or d.near_tie, d
    assert stats.accepted > 0
    return d


def test_the_end_to_end_check_runs_on_a_tiny_bf16_model():
    model = tiny_models.build("qwen2", dtype=torch.bfloat16)
    for options in ({}, {"adaptive": False, "k": 16}):
        differences_are_near_ties(model, repetitive_prompt(2, length=16), dict(options, min_match=1),
                                  max_new_tokens=40)


@pytest.mark.code_model
@pytest.mark.parametrize("options", [{}, {"adaptive": False, "k": 16}], ids=["default", "k16-every-draft"])
@pytest.mark.parametrize("name, messages", _code_edits(), ids=[n for n, _ in _code_edits()])
def test_code_model_bf16_differs_only_at_near_ties(code_model, name, messages, options):
    torch.set_num_threads(2)
    model, tokenizer = code_model
    differences_are_near_ties(model, models.chat_ids(tokenizer, messages), options)


def test_the_vllm_study_classifier_finds_and_classifies_each_difference(bf16_run):
    """benchmarks/vllm/ties.py on a study shaped like the engine study's JSON: the request whose tokens differ
    from no speculation's is found and classified by `ties.classify`; the equal one and the reference are not."""
    from benchmarks.vllm import ties as study_ties

    model, prompt, plain, logits = bf16_run
    other = plain.tolist()
    other[10:] = [int(logits[10].argmin())] * (len(other) - 10)      # far from a tie
    cell = {"workload": "code_edit", "batch": 1, "phase": "cold"}
    study = {"prompts": {"0": prompt.tolist(), "1": prompt.tolist()},
             "settings": {"model": "tiny", "dtype": "bfloat16"},
             "runs": [{"method": "none", "repeat": 0, "cells": [{**cell, "tokens": {"0": plain.tolist(),
                                                                                    "1": plain.tolist()}}]},
                      {"method": "lookup_decode", "repeat": 0, "cells": [{**cell, "tokens": {"0": plain.tolist(),
                                                                                             "1": other}}]}]}
    rows = study_ties.classify_all(study, model)
    assert [(r["method"], r["request"], r["position"]) for r in rows] == [("lookup_decode", "1", 10)]
    expect = ties.classify(model, prompt, plain, torch.tensor(other))
    assert (rows[0]["near_tie"], rows[0]["gap_1"]) == (expect.near_tie, expect.gaps[0])
    assert "1 of 2 speculative outputs differ" in study_ties.report(study, rows, "study.json")
    assert ("NOT MET" in study_ties.report(study, rows, "study.json")) == (not expect.near_tie)


def test_the_generate_benchmark_classifies_each_distinct_difference(bf16_run):
    """benchmarks/e2e/generate.py: of a variant's repeats, the output equal to plain's is not listed, two repeats
    with the same different output are one classified difference, and the report lists it."""
    from types import SimpleNamespace

    from benchmarks.e2e import generate as bench
    from benchmarks.harness import report

    model, prompt, plain, logits = bf16_run
    other = plain.tolist()
    other[10:] = [int(logits[10].argmin())] * (len(other) - 10)      # far from a tie
    runs = [SimpleNamespace(tokens=t) for t in (plain.tolist(), other, list(other))]
    found = bench.classified_differences(model, prompt[None], plain.tolist(), runs)
    expect = ties.classify(model, prompt, plain, torch.tensor(other))
    assert [(d["repeats"], d["position"], d["near_tie"]) for d in found] == [([1, 2], 10, expect.near_tie)]
    assert not expect.near_tie
    text = "\n".join(report.differences_section({"prompts": [{"id": "p", "variants": {"x": {"differences": found}}}]}))
    assert "1 distinct outputs differ from plain's; 0 part at a bfloat16 near-tie" in text
    assert "| p | x | 1, 2 | 10 |" in text
