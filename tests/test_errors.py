"""Bad input gets a clear error naming the problem, before any wrong output or deep crash."""

import pytest
import torch
from conftest import VOCAB, repetitive_prompt
from tiny_models import build

import lookup_decode
from lookup_decode import UnsupportedCacheError


def hooked(model, prompt, **kw):
    kw.setdefault("max_new_tokens", 8)
    return model.generate(prompt, do_sample=False, pad_token_id=0, custom_generate=lookup_decode.generate, **kw)


def test_streamer_with_a_batch(tiny_llama):
    with pytest.raises(ValueError, match="streamers take one sequence"):
        lookup_decode.generate(tiny_llama, repetitive_prompt(0).repeat(2, 1), max_new_tokens=4, pad_token_id=0,
                               streamer=object())


def test_synced_gpus_refused_by_both_entry_points(tiny_llama):
    from transformers import GenerationConfig
    for hook in (lookup_decode.generate, lookup_decode.lookup_decoding()):
        with pytest.raises(ValueError, match="synced_gpus"):
            hook(tiny_llama, repetitive_prompt(0), None, None, GenerationConfig(max_new_tokens=4), True)


def test_num_return_sequences(tiny_llama):
    with pytest.raises(ValueError, match="num_return_sequences"):
        hooked(tiny_llama, repetitive_prompt(0), num_return_sequences=2)


def test_beam_search(tiny_llama):
    with pytest.raises(ValueError, match="num_beams"):
        hooked(tiny_llama, repetitive_prompt(0), num_beams=2)


def test_empty_prompt(tiny_llama):
    with pytest.raises(ValueError, match="empty"):
        lookup_decode.generate(tiny_llama, torch.zeros((1, 0), dtype=torch.long), max_new_tokens=4)


def test_prompt_longer_than_context(tiny_llama):
    too_long = torch.randint(3, VOCAB, (1, tiny_llama.config.max_position_embeddings + 5))
    with pytest.raises(ValueError, match="context of 1024"):
        hooked(tiny_llama, too_long)


def test_token_ids_outside_vocabulary(tiny_llama):
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        hooked(tiny_llama, torch.tensor([[5, 6, VOCAB + 3]]))


def test_right_padding_in_attention_mask(tiny_llama):
    prompt = repetitive_prompt(0)
    mask = torch.ones_like(prompt)
    mask[0, -3:] = 0
    with pytest.raises(ValueError, match="left padding"):
        hooked(tiny_llama, prompt, attention_mask=mask)


def test_attentions_not_supported(tiny_llama):
    with pytest.raises(ValueError, match="attentions"):
        hooked(tiny_llama, repetitive_prompt(0), return_dict_in_generate=True, output_attentions=True)


def test_combined_with_prompt_lookup(tiny_llama):
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens"):
        hooked(tiny_llama, repetitive_prompt(0), prompt_lookup_num_tokens=4)


@pytest.mark.parametrize("option, value, message", [
    ("k", -1, "k .*>= 0"), ("min_match", 0, "min_match"), ("max_match", 1, "max_match"), ("k", 2.5, "k must be an int"),
    ("adaptive", "yes", "adaptive"),
])
def test_bad_options(tiny_llama, option, value, message):
    kw = {option: value}
    if option == "max_match":
        kw["min_match"] = 3
    with pytest.raises((ValueError, TypeError), match=message):
        hooked(tiny_llama, repetitive_prompt(0), **kw)


def test_recurrent_cache_refused():
    # Sliding-window caches now roll back (tests/test_model_coverage.py); a recurrent state cannot.
    model = build("mamba")
    with pytest.raises(UnsupportedCacheError, match="MambaForCausalLM.*LinearAttentionLayer"):
        hooked(model, repetitive_prompt(0))


def test_direct_call_needs_a_transformers_model():
    with pytest.raises(TypeError, match="no generate"):
        lookup_decode.generate(torch.nn.Linear(2, 2), torch.tensor([[1, 2]]))
