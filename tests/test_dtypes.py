"""float32 / bfloat16 / float16, on CPU (and CUDA when present): lookup decoding == plain greedy generate.

Half precision uses transformers' near-tie rule with a tolerance of the dtype's precision: outputs
are equal, or differ only after a step where plain decoding's top-2 logits were within `tol`
(a verify forward over several tokens and a one-token forward round differently).
"""

import pytest
import tiny_models
import torch
from conftest import repetitive_prompt
from test_model_coverage import assert_same_greedy

import lookup_decode
from lookup_decode import DecodeStats

# Near-tie tolerance on the logits per dtype: about the rounding step of a logit of size ~4.
TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-2, torch.float16: 1e-2}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# float32 is every other coverage test; half precision for every family that rolls back.
FAMILIES = sorted([*tiny_models.DECODER_ONLY, *tiny_models.WINDOWED, *tiny_models.ENCODER_DECODER])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", FAMILIES)
def test_dtype(name, dtype, device):
    model = tiny_models.build(name, dtype=dtype, device=device)
    source = repetitive_prompt(0, length=16).to(device)     # 52 tokens: past the sliding window (24)
    greedy = dict(do_sample=False, pad_token_id=0, eos_token_id=None, max_new_tokens=40)
    ref = model.generate(source, return_dict_in_generate=True, output_logits=True, **greedy)
    stats = DecodeStats()
    got = model.generate(source, custom_generate=lookup_decode.generate, stats=stats, min_match=1, k=8,
                         adaptive=False, **greedy)
    assert_same_greedy(ref, got, 1 if model.config.is_encoder_decoder else source.shape[1], TOL[dtype])
    assert stats.accepted > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_dtype_static_cache(dtype, device):
    model = tiny_models.build("llama", dtype=dtype, device=device)
    prompt = repetitive_prompt(1, length=16).to(device)
    greedy = dict(do_sample=False, pad_token_id=0, eos_token_id=None, max_new_tokens=40, cache_implementation="static")
    ref = model.generate(prompt, return_dict_in_generate=True, output_logits=True, **greedy)
    stats = DecodeStats()
    got = model.generate(prompt, custom_generate=lookup_decode.generate, stats=stats, min_match=1, k=8,
                         adaptive=False, **greedy)
    assert_same_greedy(ref, got, prompt.shape[1], TOL[dtype])
    assert stats.accepted > 0
