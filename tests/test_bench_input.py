"""`lookup-decode bench` input and output (issue 16): JSONL read per the JSON spec, errors naming the request,
every run written as it is measured. Written before the fixes; each failed then."""

import json

import pytest
import torch

from lookup_decode import measure
from lookup_decode.cli import bench


def test_jsonl_line_separators_inside_strings(tmp_path):
    """U+2028/U+2029 are legal unescaped inside JSON strings; str.splitlines() splits on them."""
    path = tmp_path / "r.jsonl"
    text = "one\u2028two\u2029three\x85four\x0cfive"
    path.write_text(json.dumps({"prompt": text}, ensure_ascii=False) + "\n" + json.dumps({"prompt": "b"}) + "\r\n",
                    encoding="utf-8")
    requests = bench.read_requests(path)
    assert [r.messages[0]["content"] for r in requests] == [text, "b"]
    assert [r.id for r in requests] == ["r.jsonl:1", "r.jsonl:2"]


class Template:
    def apply_chat_template(self, messages, **kwargs):
        if "bad" in messages[0]["content"]:
            raise ValueError("template error")
        return {"input_ids": torch.tensor([[5, 6, 7]])}


def test_error_after_parsing_names_the_request(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": "bad one"}\n', encoding="utf-8")
    with pytest.raises(SystemExit, match=r"r.jsonl:2.*template error"):
        bench.prompt_ids(Template(), bench.read_requests(path), "cpu")


def test_runs_are_written_as_they_are_measured(tmp_path, monkeypatch):
    calls = []

    def fake_run(model, ids, variant, max_new_tokens):
        calls.append(variant.name)
        if len(calls) == 3:
            raise RuntimeError("CUDA out of memory")
        return measure.Run(variant.name, [1, 2, 3], 0.5)
    monkeypatch.setattr(measure, "run_variant", fake_run)
    out = tmp_path / "runs.jsonl"
    prompts = [torch.tensor([[5, 6]]), torch.tensor([[7, 8]])]
    with pytest.raises(RuntimeError):
        measure.measure(None, prompts, [measure.PLAIN, measure.Variant("lookup_decode", lookup={})], 8, 1, lambda: None,
                      results=out, ids=["a:1", "a:2"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["request"], r["variant"]) for r in rows] == [("a:1", calls[0]), ("a:1", calls[1])]
    assert rows[0]["new_tokens"] == 3 and rows[0]["seconds"] == 0.5


def _stats_with_calibration(seed: int):
    import numpy as np

    from lookup_decode.core.stats import DecodeStats
    rng = np.random.default_rng(seed)
    stats = DecodeStats()
    stats.observe(60, 30)
    p = rng.random(60)
    stats.reliability.observe(p, rng.random(60) < p)
    return stats


def test_bench_reports_the_calibration_per_variant(tmp_path, monkeypatch, capsys):
    """compare() carries the merged reliability table into the JSON; the text summary prints it, named."""
    def fake_run(model, ids, variant, max_new_tokens):
        stats = _stats_with_calibration(int(ids[0, 0])) if variant.lookup is not None else None
        return measure.Run(variant.name, [1, 2, 3], 0.5, stats)
    monkeypatch.setattr(measure, "run_variant", fake_run)
    prompts = [torch.tensor([[5, 6]]), torch.tensor([[7, 8]])]
    variant = measure.Variant("lookup_decode", lookup={})
    measured = measure.measure(None, prompts, [measure.PLAIN, variant], 8, 1, lambda: None)
    summary = measure.compare(measured, "lookup_decode")
    rows = summary["calibration"]
    assert sum(r["tokens"] for r in rows) == 120                     # both prompts' tokens, merged
    assert set(rows[0]) == {"bin_low", "bin_high", "tokens", "predicted", "kept", "chance"}
    assert 0 <= summary["calibration_error"] <= 1
    json.dumps(summary)                                              # the JSON output holds it as it is
    lines = bench.calibration_lines("lookup_decode", summary)
    assert "calibration of lookup_decode" in lines[0] and "share kept" in lines[1]
    assert len(lines) == 2 + len(rows) + 1
    assert "nothing" not in "".join(lines)
    empty = bench.calibration_lines("tuned", {"calibration": [], "calibration_error": 0.0})
    assert empty == ["  calibration of tuned: no draft token sent carried a prediction"]


def test_bench_command_prints_and_stores_the_calibration(tmp_path, capsys):
    """`lookup-decode bench` end to end on a tiny model: the text names the reliability table, the JSON holds it."""
    import tiny_models

    from lookup_decode.cli.commands import main
    from lookup_decode.engines.hf.models import load_tokenizer
    tok = load_tokenizer()
    folder = tmp_path / "tiny"
    tiny_models.build("llama", vocab_size=len(tok), max_position_embeddings=256, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id).save_pretrained(folder)
    tok.save_pretrained(folder)
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"say a b c a b c {i}"}) + "\n" for i in range(2)))
    args = ["bench", "--prompts", str(path), "--model", str(folder), "--max-new-tokens", "12", "--no-confirm"]
    assert main(args + ["--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert isinstance(result["default"]["calibration"], list) and "calibration_error" in result["default"]
    assert main(args) == 0
    assert "calibration of lookup_decode" in capsys.readouterr().out
