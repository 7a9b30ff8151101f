"""The examples in examples/ run end to end on the real default model, in-process and short.

Each example's `main(argv, model_and_tokenizer=...)` reuses the session's `real_model` (conftest.py)
instead of loading the model again. Assertions are on outputs and statistics, never on timings.
"""

import importlib.util
from pathlib import Path

import pytest
from conftest import FlatCosts

import lookup_decode

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


code_edit = _example("code_edit")
summarize_folder = _example("summarize_folder")
existing_code = _example("existing_code")


# --- without the model: argument handling and small helpers ---

def test_code_edit_strip_fence():
    assert code_edit.strip_fence("x = 1\n```\nThat's it.") == "x = 1\n"
    assert code_edit.strip_fence("x = 1\ny = 2") == "x = 1\ny = 2\n"  # stopped before the closing fence


@pytest.mark.parametrize("module, argv", [
    (code_edit, ["no/such/file.py"]),
    (code_edit, ["--max-new-tokens", "0"]),
    (summarize_folder, ["no/such/folder"]),
    (existing_code, ["--max-new-tokens", "-1"]),
])
def test_bad_arguments_exit_before_loading_a_model(module, argv):
    with pytest.raises(SystemExit) as e:
        module.main(argv, model_and_tokenizer=object())  # would fail if main got as far as using it
    assert e.value.code == 2


def test_summarize_folder_without_txt_files(tmp_path):
    (tmp_path / "notes.md").write_text("not a .txt file")
    with pytest.raises(SystemExit):
        summarize_folder.main([str(tmp_path)], model_and_tokenizer=object())


# --- on the real model ---

@pytest.mark.real_model
def test_code_edit_streams_and_writes_the_file(real_model, tmp_path, capsys):
    out = tmp_path / "edited.py"
    result = code_edit.main(["--max-new-tokens", "32", "--out", str(out)], model_and_tokenizer=real_model)
    stats = result["stats"]
    assert result["reply"].strip()
    assert 0 < stats.new_tokens <= 32
    assert stats.steps > 0
    assert out.read_text(encoding="utf-8") == result["code"]
    streamed = capsys.readouterr()
    assert streamed.out.startswith("```python\n")
    assert result["reply"].splitlines()[0] in streamed.out  # the streamer printed the reply as it came
    assert "steps" in streamed.err  # stats.summary()


@pytest.mark.real_model
def test_code_edit_other_file_and_instruction(real_model, tmp_path):
    source = tmp_path / "greet.py"
    source.write_text('def greet(name):\n    return "Hello, " + name + "!"\n', encoding="utf-8")
    result = code_edit.main([str(source), "--instruction", "Use an f-string.", "--max-new-tokens", "24"],
                            model_and_tokenizer=real_model)
    assert result["code"].strip()
    assert result["stats"].steps > 0
    assert not (tmp_path / "edited.py").exists()


@pytest.mark.real_model
def test_summarize_folder_per_document_and_total_stats(real_model, tmp_path, capsys):
    out_dir = tmp_path / "summaries"
    result = summarize_folder.main(["--max-new-tokens", "24", "--out-dir", str(out_dir)],
                                   model_and_tokenizer=real_model)
    docs = sorted((EXAMPLES / "data" / "articles").glob("*.txt"))
    assert [Path(p).name for p in result["summaries"]] == [d.name for d in docs]
    per_doc, total = list(result["stats"].values()), result["total"]
    for path, summary in result["summaries"].items():
        assert summary
        assert (out_dir / f"{Path(path).stem}.summary.txt").read_text(encoding="utf-8").strip() == summary
    assert all(s.steps > 0 and 0 < s.new_tokens <= 24 for s in per_doc)
    assert total.steps == sum(s.steps for s in per_doc)
    assert total.new_tokens == sum(s.new_tokens for s in per_doc)
    assert total.accepted == sum(s.accepted for s in per_doc)
    assert "total over 3 documents" in capsys.readouterr().out


@pytest.mark.real_model
def test_existing_code_outputs_identical(real_model, capsys, monkeypatch):
    # The example passes custom_generate=lookup_decode.generate, priced by the shared COSTS: priced flat here, so
    # this machine's load cannot price every draft out and the identity below is checked on accepted drafts.
    monkeypatch.setattr(lookup_decode.COSTS, "curve", FlatCosts().curve)
    result = existing_code.main(["--max-new-tokens", "40", "--no-warmup"], model_and_tokenizer=real_model)
    assert result["identical"]
    assert result["lookup_text"].strip()
    assert result["lookup_text"] == result["plain_text"]
    assert result["stats"].accepted > 0
    assert "identical output: yes" in capsys.readouterr().out
