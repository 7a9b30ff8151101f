"""Encoder-decoder models (BART, T5, Pegasus, Marian, ...): drafts from the source text, verified through the decoder.

transformers' generate runs the encoder once and hands the decoding loop the decoder prompt
(`[decoder_start]`), the encoder output and the source ids (`inputs_tensor`). The decoder is then an
ordinary causal LM conditioned on that output: the same lookup loop applies, with two differences
handled here. (1) The proposer first sees the source ids, so a summary or a correction can copy
spans of its input from the first token on. (2) Each forward passes the encoder output and its
attention mask; the EncoderDecoderCache's cross-attention half is written by the first decoder
forward and never cropped, only its self-attention half rolls back (cache.py).
"""

from __future__ import annotations

import torch


def is_encoder_decoder(model) -> bool:
    return bool(getattr(model.config, "is_encoder_decoder", False))


def source_ids(model, inputs_tensor, model_kwargs) -> torch.Tensor:
    """The encoder's input ids, long [1, S], checked; they seed the proposer before the decoder prompt."""
    name = type(model).__name__
    if inputs_tensor is None or inputs_tensor.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"{name}: lookup decoding drafts from the encoder's input token ids; pass input_ids "
                         "(not inputs_embeds or features) to generate")
    if inputs_tensor.ndim != 2 or inputs_tensor.shape[0] != 1:
        raise ValueError(f"{name}: encoder input_ids must be [1, length], got shape {tuple(inputs_tensor.shape)}")
    if model_kwargs.get("encoder_outputs") is None:
        raise ValueError(f"{name}: generate() did not pass the encoder output to the decoding loop")
    return inputs_tensor


def decoder_forward_kwargs(model, model_kwargs) -> dict:
    """Constant keyword arguments of every decoder forward: the encoder output and its padding mask."""
    kwargs = {"encoder_outputs": model_kwargs["encoder_outputs"]}
    if model_kwargs.get("attention_mask") is not None:      # mask of the encoder input, [1, S]
        kwargs["attention_mask"] = model_kwargs["attention_mask"]
    if model_kwargs.get("decoder_attention_mask") is not None:
        raise ValueError(f"{type(model).__name__}: lookup_decode does not support decoder_attention_mask")
    return kwargs

