"""benchmarks/e2e/fast_apply.py on a tiny random model (no ../shared): the variants it runs, an edit measured side
by side (the prediction reaches generate(), every output equals plain's), its groups, summary and report."""

from __future__ import annotations

import pytest

from benchmarks.e2e import fast_apply as fa
from tests.tiny_models import build


class CharTokenizer:
    """One id per character (3..95), no chat template: chat_ids sends the user message as plain text."""
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [3 + ord(c) % 93 for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(32 + int(i) % 90) for i in ids)


@pytest.fixture(scope="module")
def model():
    m = build("llama")
    m.generation_config.eos_token_id = None         # every run writes its whole budget
    m.generation_config.pad_token_id = 0
    return m


def edit(i, file="def f(x):\n    return x + 1\n", name="editeval"):
    return {"set": name, "id": str(i), "instruction": "Add a docstring.", "file": file, "lang": "python",
            "file_tokens": 40}


def test_arguments_and_the_variants(tmp_path):
    args = fa.parse_args(["--sets", "editeval", "--requests", "2", "--k", "8", "--out", str(tmp_path)])
    assert (args.sets, args.requests, args.k, args.model, args.dtype) == (["editeval"], 2, 8, None, "float32")
    with pytest.raises(SystemExit):
        fa.parse_args(["--k", "0"])
    v = fa.variants([5, 6], {"k": 8})
    assert list(v) == fa.NAMES
    assert v["plain"].lookup is None and v["prompt_lookup"].generate_kwargs == {"prompt_lookup_num_tokens": 10}
    assert v["lookup_decode"].lookup == {"k": 8} and v[fa.PREDICTION].lookup == {"k": 8, "prediction": [5, 6]}
    assert fa.describe({})[3] == "lookup_decode+prediction (prediction=the file)"


def test_the_prompt_is_the_servers_message_and_the_context_bounds_the_edits():
    tok = CharTokenizer()
    ids, pred = fa.encode(tok, edit(0))
    assert ids[0].tolist() == tok(fa.messages(edit(0))[0]["content"])["input_ids"]
    assert pred == tok(edit(0)["file"])["input_ids"]
    long = edit(1, file="x = 1\n" * 40)
    kept, skipped = fa.fits([edit(0), long], tok, context=200, cap=64)
    assert [e["id"] for e, _, _ in kept] == ["0"] and skipped == ["1"]


def test_edits_measured_side_by_side_summary_and_report(model):
    tok = CharTokenizer()
    options = {"k": 8, "adaptive": False}          # whole drafts: the cost model's choice depends on the load
    records = []
    for i in range(2):
        e = edit(i)
        ids, _ = fa.encode(tok, e)
        plain = fa.run_variant(model, ids, fa.PLAIN, 24).tokens
        # edit 0: the prediction is the output itself (drafted whole); edit 1: tokens the output never has.
        prediction = plain if i == 0 else [2] * 30
        records.append(fa.measure_edit(model, tok, e, ids, prediction, options, cap=24, repeats=2, offset=i))
    first, second = records
    assert all(r["variants"][n]["identical"] for r in records for n in fa.NAMES)
    assert not any("differences" in r["variants"][n] for r in records for n in fa.NAMES)   # none to classify
    assert first["variants"]["plain"]["new_tokens"] == 24 and first["variants"]["plain"]["forwards"] == 24
    assert first["accepted_prediction_tokens"] == 24 and first["rejected_prediction_tokens"] == 0
    assert second["accepted_prediction_tokens"] == 0 and second["file_tokens"] == 30
    pred = first["variants"][fa.PREDICTION]
    assert pred["forwards"] <= 6 and pred["stats"]["mean_accepted_length"] > 4      # guard: the prediction drafted
    assert set(first["speedup_vs_lookup_decode"]) == {fa.PREDICTION}

    summary = fa.summarize(records)
    assert list(summary) == ["editeval", "rewrites", "all"] and summary["rewrites"]["n"] == 1
    row = summary["all"]
    assert row["plain"]["forwards"] == 48 and row[fa.PREDICTION]["forwards"] < row["lookup_decode"]["forwards"]
    assert row[fa.PREDICTION]["identical"] == 2 and row[fa.PREDICTION]["speedup_vs_lookup_decode"]["n"] == 2
    assert row["accepted_prediction_tokens"] == 24 and row["rejected_prediction_tokens"] == 30
    assert "speedup_vs_lookup_decode" not in row["lookup_decode"]

    result = {"environment": {"model": "tiny", "dtype": "float32", "device": "cpu", "command": "cmd"},
              "settings": {"repeats": 2, "variant_descriptions": fa.describe(options)}, "prompts": records,
              "summary": summary, "skipped": ["9"]}
    text = fa.markdown(result)
    assert "## rewrites (1 edits; prediction tokens 0 / 30)" in text and "| plain | " in text
    assert "| editeval | 0 | " in text and "| all |" in text and "left out" in text


def test_a_rewrite_is_judged_on_what_the_budget_could_keep():
    def rec(i, kept, file_tokens, budget):
        return {"set": "nofuneval", "id": str(i), "accepted_prediction_tokens": kept, "file_tokens": file_tokens,
                "max_new_tokens": budget}
    records = [rec(0, 26, 356, 32), rec(1, 40, 100, 157), rec(2, 60, 100, 157)]
    assert [r["id"] for r in fa.groups(records)["rewrites"]] == ["1"]      # 26 of 32 kept: a cut output, not a rewrite
