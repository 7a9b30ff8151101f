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
