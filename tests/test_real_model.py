"""End to end on the real default model (SmolLM2-135M-Instruct) over real prompts kept in tests/data.

The prompts are copied into the repository (tests/data/README.md: sources and licences) so the suite runs
in a clone without ../shared/data beside it.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import StoppingCriteriaList, StopStringCriteria

import lookup_decode
from lookup_decode import DecodeStats
from lookup_decode.engines.hf import models

pytestmark = pytest.mark.real_model


def _requests():
    path = Path(__file__).parent / "data" / "real_prompts.jsonl"
    with open(path, encoding="utf-8") as f:
        return [SimpleNamespace(**json.loads(line)) for line in f if line.strip()]


REQUESTS = _requests()
CASES = [(r.category, r) for r in REQUESTS if r.category != "mt_redundant"]


def _ids(tokenizer, request):
    return models.chat_ids(tokenizer, request.messages)


def test_adaptive_default_identical_on_code_edit(real_model):
    model, tokenizer = real_model
    ids = _ids(tokenizer, CASES[1][1])
    ref = model.generate(ids, max_new_tokens=96, do_sample=False)
    stats = DecodeStats()
    # The adaptive default, priced by a cost curve like the ones this model measures on a CPU (a forward of 33
    # tokens ~2.2x one of 1): a calibration timed on a loaded machine could price every draft out and leave
    # the guard below nothing to check.
    costs = lookup_decode.CostModel("off")
    costs.curve(model, 33, lambda w: 0.02 * (1 + 0.04 * (w - 1)))
    hook = lookup_decode.lookup_decoding(stats=stats, costs=costs)
    got = model.generate(ids, max_new_tokens=96, do_sample=False, custom_generate=hook)
    assert got.tolist() == ref.tolist()
    assert stats.accepted > 0


@pytest.mark.parametrize("category, request_", CASES, ids=[f"{c}-{r.id}" for c, r in CASES])
def test_greedy_identical_to_plain_generate(real_model, category, request_):
    model, tokenizer = real_model
    ids = _ids(tokenizer, request_)
    ref = model.generate(ids, max_new_tokens=96, do_sample=False)
    stats = DecodeStats()
    # adaptive=False verifies every draft the index offers: the strictest exactness check.
    got = model.generate(ids, max_new_tokens=96, do_sample=False, custom_generate=lookup_decode.generate, stats=stats,
                         adaptive=False, k=16)
    assert got.tolist() == ref.tolist()
    assert stats.accepted > 0, f"guard: no draft was kept on {category}"


def _inside_step_positions(stats):
    """Indices of new tokens after which the same step emitted more tokens (stopping there cuts a step)."""
    inside, pos = [], 1                                    # new token 0 comes from the prefill
    for kept in stats.accepted_lengths:
        inside.extend(range(pos, pos + kept))              # every emitted token but the step's last
        pos += kept + 1
    return inside


def test_stop_strings_inside_a_step_stop_exactly(real_model):
    model, tokenizer = real_model
    ids = _ids(tokenizer, CASES[0][1])
    opts = dict(k=8, adaptive=False)
    stats = DecodeStats()
    full = lookup_decode.generate(model, ids, max_new_tokens=80, do_sample=False, stats=stats, **opts)
    new = full[0, ids.shape[1]:].tolist()
    cut_inside = 0
    for j in _inside_step_positions(stats):
        piece = tokenizer.decode(new[j: j + 1]).strip()
        # A stop string counts only where it ends in the newest token, so the prompt does not matter;
        # an earlier generated occurrence would stop before j.
        if len(piece) < 3 or piece in tokenizer.decode(new[:j]):
            continue
        kw = dict(max_new_tokens=80, do_sample=False, stop_strings=[piece], tokenizer=tokenizer)
        ref = model.generate(ids, **kw)
        got = lookup_decode.generate(model, ids, **kw, **opts)
        assert got.tolist() == ref.tolist(), piece
        cut_inside += ref.shape[1] == ids.shape[1] + j + 1
        if cut_inside == 3:
            break
    assert cut_inside > 0, "guard: some stop string completed in the middle of a multi-token step"


def test_aho_corasick_stop_strings_stop_where_transformers_does(real_model):
    model, tokenizer = real_model
    ids = _ids(tokenizer, CASES[1][1])
    full = model.generate(ids, max_new_tokens=60, do_sample=False)
    text = tokenizer.decode(full[0, ids.shape[1]:])
    stops = sorted({w for w in text.split() if len(w) >= 3})[:6] + ["\n\n", "zzqx"]
    ours = StoppingCriteriaList([lookup_decode.StopStrings(tokenizer, stops)])
    theirs = StoppingCriteriaList([StopStringCriteria(tokenizer, stops)])
    for end in range(ids.shape[1] + 1, full.shape[1] + 1):
        prefix = full[:, :end]
        assert bool(ours(prefix, None)[0]) == bool(theirs(prefix, None)[0]), tokenizer.decode(full[0, end - 3:end])


def test_sampling_on_real_model_is_valid_and_keeps_drafts(real_model):
    model, tokenizer = real_model
    ids = _ids(tokenizer, CASES[0][1])
    total = DecodeStats()
    for seed in range(3):
        torch.manual_seed(seed)
        stats = DecodeStats()
        out = lookup_decode.generate(model, ids, max_new_tokens=64, do_sample=True, temperature=0.5, top_p=0.95,
                                     stats=stats, stop_strings=["```\n\n"], tokenizer=tokenizer,
                                     adaptive=False)   # whole drafts: the cost model's choice depends on the load
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        assert text.strip() and "\ufffd" not in text
        assert out.shape[1] - ids.shape[1] <= 64
        total.merge(stats)
    assert total.accepted > 0, "guard: drafts were kept at temperature 0.5 on a code edit"


def test_cli_generate_json_compare(real_model, capsys):
    from lookup_decode.cli import commands as cli
    code = cli.main(["generate", "--prompt", "Repeat exactly: the cat sat on the mat. the cat sat on the mat.",
                     "--max-new-tokens", "24", "--json", "--compare"], loaded=real_model)
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["text"].strip()
    assert result["compare"]["identical"] is True
    assert result["stats"]["new_tokens"] <= 24 and result["stats"]["steps"] > 0


def test_cli_compare_times_a_call_that_learned_nothing_from_its_warm_up(real_model, capsys, monkeypatch):
    """--compare warms up on the same prompt (allocations, the cost calibration); the timed call must not price its
    drafts by what the warm-up saw of this very answer: it starts from an empty acceptance pool."""
    import lookup_decode.measure
    from lookup_decode.cli import commands as cli
    from lookup_decode.engines.hf import hook
    timed, seen = lookup_decode.measure.timed_generate, []

    def spy(model, *args, **kwargs):
        if "custom_generate" in kwargs:
            seen.append(float(hook._POOLS[model].sum()) if model in hook._POOLS else 0.0)
        return timed(model, *args, **kwargs)
    monkeypatch.setattr(lookup_decode.measure, "timed_generate", spy)
    code = cli.main(["generate", "--prompt", "Repeat exactly: the cat sat on the mat. the cat sat on the mat.",
                     "--max-new-tokens", "24", "--json", "--compare"], loaded=real_model)
    assert code == 0 and seen == [0.0]
    assert json.loads(capsys.readouterr().out)["compare"]["identical"] is True


def test_cli_generate_prediction_file_leads(real_model, capsys, tmp_path):
    """`--prediction-file`: the same output as without it, in fewer steps when it holds the answer (the
    prediction's drafts lead)."""
    from lookup_decode.cli import commands as cli
    code = (Path(__file__).parent.parent / "examples" / "data" / "inventory.py").read_text()
    ask = ["generate", "--prompt", "Add a docstring to every function and return the whole code:\n" + code,
           "--max-new-tokens", "64", "--json", "--compare", "--no-adaptive"]   # timing-free: a loaded machine
    assert cli.main(ask, loaded=real_model) == 0                                 # once priced every draft out
    without = json.loads(capsys.readouterr().out)
    (tmp_path / "pred.txt").write_text(without["text"])
    assert cli.main(ask + ["--prediction-file", str(tmp_path / "pred.txt")], loaded=real_model) == 0
    with_it = json.loads(capsys.readouterr().out)
    assert without["compare"]["identical"] is True and with_it["compare"]["identical"] is True
    assert with_it["text"] == without["text"]
    assert with_it["stats"]["accepted"] > 0, "guard: drafts were accepted"
    assert with_it["stats"]["steps"] < without["stats"]["steps"]
