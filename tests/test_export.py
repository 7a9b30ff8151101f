"""`lookup-decode export-hf` / `export_hf`: the default GGUF model saved as a plain transformers folder (what vLLM
loads). The reference is the GGUF-loaded model itself: the folder, reloaded with plain transformers (no GGUF,
no lookup_decode loader), must give the same greedy tokens."""

import pytest
import torch
from conftest import chat_ids

from lookup_decode.cli.commands import main
from lookup_decode.engines.hf.models import export_hf


def test_export_refuses_a_folder_that_is_not_empty(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not an empty folder"):
        export_hf(tmp_path)              # refused before any model is loaded
    with pytest.raises(SystemExit, match="not an empty folder"):
        main(["export-hf", str(tmp_path)])
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


@pytest.mark.real_model
def test_exported_folder_reloads_and_decodes_like_the_gguf_model(real_model, tmp_path):
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_model, gguf_tok = real_model
    folder = tmp_path / "smollm2-hf"
    assert main(["export-hf", str(folder)]) == 0
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert (folder / "model.safetensors").is_file() and (folder / "generation_config.json").is_file()

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    assert model.dtype == torch.float32 and type(model).__name__ == "LlamaForCausalLM"
    text = "Repeat exactly: the quick brown fox jumps over the lazy dog."
    ids = chat_ids(tok, text)
    assert ids.tolist() == chat_ids(gguf_tok, text).tolist()    # same tokenizer and chat template
    with torch.no_grad():
        ref = gguf_model.generate(ids, max_new_tokens=16, do_sample=False)
        got = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert got.tolist() == ref.tolist()
    assert got.shape[1] > ids.shape[1]
